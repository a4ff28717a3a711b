"""The step measured where it runs: per-layer and whole-step TFLOPS/GPU and MFU of the full recipes on one GPU.

    python -m tessera.scripts.gpu_step              # GPU: the per-layer table, then every slice trains 20 steps
    python -m tessera.scripts.gpu_step --recipes nemotron_omni_30b_a3b --steps 20 --seq 8192
    python -m tessera.scripts.gpu_step --dry        # the commands and FLOP rows, nothing runs
    python -m tessera.scripts.gpu_step --smoke      # CPU, tiny shapes: the same code path end to end (a test runs it)

Per layer: forward+backward of one Mamba-2 / attention / MLP / MoE layer at the released widths (bf16, --seq tokens;
scripts/gpu_check.layer_tflops), model FLOPs as the planner counts them. Whole step: a real-width slice of each full
recipe (recipes/full_size.py: the release's encoders, the LLM at its widths, heads, experts and vocabulary with a few
layers, models/configs.*_SLICE, so one GPU holds it with mixed-precision Adam) trains --steps steps through the
trainer (`python -m tessera.recipes.train`, one rank, synthetic data at the recipe's media per row, no recompute),
and the table reports the trainer's own model TFLOPS/GPU and MFU (metrics.jsonl: hetero/planner/flops.StepFlops,
the planner's FLOP count) over the steps after --warmup, with the kernels select_kernels picks for that LLM.
Targets (issue 49, H100/H200 bf16 at 8K): Mamba >= 35% MFU, attention >= 50%, MLP >= 65%, MoE >= 35%; the VL slice's
whole step >= 40%, the Omni slice's >= 25%. A row below its target is marked, not hidden.

--smoke runs the same functions on this CPU at tiny shapes (each full recipe's tiny sibling and tiny LLM, fp32,
2 steps, a few hundred tokens): the numbers mean nothing there; that it runs, parses and prints is what it shows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from tessera.scripts.gpu_check import text_table, layer_flops, layer_tflops, symbols


@dataclass(frozen=True)
class StepRun:
    recipe: str   # recipes/registry name
    llm: str      # models.configs.REGISTRY name
    layout: str   # one rank


ONE_RANK = "vision=dp1@0-0;language=dp1@0-0"
OMNI_ONE_RANK = "vision=dp1@0-0;audio=dp1@0-0;language=dp1@0-0"
SLICES = {  # full recipe -> its real-width slice on one GPU
    "nemotron_vl_12b": StepRun("nemotron_vl_12b", "nemotron_nano_12b_v2_slice", ONE_RANK),
    "nemotron_video_12b": StepRun("nemotron_video_12b", "nemotron_nano_12b_v2_slice", ONE_RANK),
    "nemotron_omni_30b_a3b": StepRun("nemotron_omni_30b_a3b", "nemotron_3_nano_30b_a3b_slice", OMNI_ONE_RANK),
}
SMOKE = {  # --smoke: each full recipe's tiny sibling (same modules and data path, tiny sizes)
    "nemotron_vl_12b": StepRun("nemotron_vl_tiny", "nemotron_h_tiny_dense", ONE_RANK),
    "nemotron_video_12b": StepRun("nemotron_video_tiny", "nemotron_h_tiny_dense", ONE_RANK),
    "nemotron_omni_30b_a3b": StepRun("nemotron_omni_tiny", "nemotron_h_tiny_moe", OMNI_ONE_RANK),
}
LAYER_MODELS = {"gpu": ["nemotron_nano_12b_v2", "nemotron_3_nano_30b_a3b"], "smoke": ["nemotron_h_tiny_moe"]}
TARGET_MFU = {"M": 0.35, "*": 0.50, "-": 0.65, "E": 0.35, "nemotron_vl_12b": 0.40, "nemotron_omni_30b_a3b": 0.25}


def step_command(run: StepRun, run_dir: str, seq: int, steps: int, dtype: str) -> list[str]:
    """The trainer's command line for `run`: one rank, one row of `seq` tokens per step, no recompute."""
    return [sys.executable, "-m", "tessera.recipes.train", "--recipe", run.recipe, f"layout={run.layout}",
            f"model.llm={run.llm}", f"model.dtype={dtype}", "model.recompute=none", f"data.seq_length={seq}",
            "data.rows_per_microbatch=1", "data.microbatches=1", f"trainer.max_steps={steps}", "trainer.log_every=1",
            f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false"]


def kernels_line(llm: str, dtype: torch.dtype) -> str:
    """The `kernels:` line the trainer's one rank logs for this LLM (select_kernels, same inputs)."""
    from tessera.hetero.parallel.kernel_choice import select_kernels
    from tessera.models.configs import hf_fields
    from tessera.models.nemotron_h_hf import hybrid_config_from_hf

    return select_kernels(None, dtype=dtype, config=hybrid_config_from_hf(hf_fields(llm), dtype=dtype)).line


def train_step_row(name: str, run: StepRun, seq: int, steps: int, warmup: int, dtype: str) -> tuple:
    """(recipe, LLM, steps timed, s/step, TFLOPS/GPU, MFU, peak GiB, kernels) of `run`'s trainer on one rank."""
    from tessera.hetero.training.metrics import read_metrics

    run_dir = tempfile.mkdtemp(prefix=f"tessera_gpu_step_{name}_")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run(step_command(run, run_dir, seq, steps, dtype), capture_output=True, text=True, env=env)
    records = read_metrics(run_dir)
    if res.returncode or len(records) < steps:
        raise RuntimeError(f"{run.recipe}: trainer exit {res.returncode}, {len(records)}/{steps} steps in {run_dir}: "
                           f"{(res.stderr or res.stdout)[-600:]}")
    timed = records[min(warmup, len(records) - 1):]  # the first steps compile, autotune and warm the allocator
    tflops = statistics.median(r["model_tflops_per_gpu"] for r in timed)
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]  # None where the device's peak is unknown (CPU)
    return (name, run.llm, len(timed), f"{statistics.median(r['step_time_s'] for r in timed):.3f}", _num(tflops),
            _pct(statistics.median(mfu) if mfu else None, TARGET_MFU.get(name)),
            f"{max(r.get('peak_memory_gib', 0) for r in timed):.1f}",
            kernels_line(run.llm, getattr(torch, dtype)).removeprefix("kernels: "))


def _num(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"  # CPU smoke figures are thousandths


def _pct(mfu: float | None, target: float | None) -> str:
    if mfu is None:
        return "-"
    return f"{100 * mfu:.1f}%" + (f" (< {100 * target:.0f}% target)" if target is not None and mfu < target else "")


def layer_rows(models: list[str], dev, seq: int, batch: int, iters: int, dtype: torch.dtype, peak: float | None):
    """The per-layer table: one row per layer kind of each model, in a one-rank world (process_world)."""
    from tessera.hetero.runtime.world import process_world
    from tessera.hetero.tools.parity import init_groups

    with process_world():
        return _layer_rows(init_groups(), models, dev, seq, batch, iters, dtype, peak)


def _layer_rows(pgs, models: list[str], dev, seq: int, batch: int, iters: int, dtype: torch.dtype,
                peak: float | None):
    rows = [("model", "layer", "GFLOP fwd", "ms fwd+bwd", "TFLOPS", "MFU", "kernels")]
    for model in models:
        line = kernels_line(model, dtype).removeprefix("kernels: ")
        for sym in symbols(model):
            try:
                ms, tf = layer_tflops(pgs, dev, model, sym, seq, batch, iters, dtype)
                mfu = _pct(tf / peak if peak else None, TARGET_MFU[sym])
                rows.append((model, sym, f"{layer_flops(model, sym, seq, batch) / 1e9:.2f}", f"{ms:.2f}", _num(tf),
                             mfu, line))
            except Exception as e:  # a missing extra or a kernel error is a row, not a crash
                rows.append((model, sym, "-", "-", f"{type(e).__name__}: {str(e)[:120]}", "-", line))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="*", default=list(SLICES), choices=list(SLICES))
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default 8192; --smoke 256)")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps per slice (default 20; --smoke 2)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--iters", type=int, default=5, help="timed forward+backward passes per layer")
    parser.add_argument("--skip-layers", action="store_true", help="only the whole-step table")
    parser.add_argument("--dry", action="store_true", help="print the commands and FLOP rows; nothing runs")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp32: the code path, not the speed")
    args = parser.parse_args(argv)
    smoke = args.smoke
    seq, steps = args.seq or (256 if smoke else 8192), args.steps or (2 if smoke else 20)
    runs, models = (SMOKE, LAYER_MODELS["smoke"]) if smoke else (SLICES, LAYER_MODELS["gpu"])
    dtype = "float32" if smoke else "bfloat16"
    if args.dry:
        for name in args.recipes:
            print(" ".join(step_command(runs[name], f"/tmp/gpu_step_{name}", seq, steps, dtype)))
        print(text_table([("model", "layer", "GFLOP fwd")] + [(m, s, f"{layer_flops(m, s, seq, 1) / 1e9:.1f}")
                                                          for m in models for s in symbols(m)]))
        return 0
    if not smoke and not torch.cuda.is_available():
        print("gpu_step: no CUDA GPU on this machine (torch.cuda.is_available() is False); run it on a GPU with the "
              "gpu extra installed, or pass --smoke (CPU, tiny shapes) or --dry", file=sys.stderr)
        return 2
    from tessera.hetero.planner.flops import peak_tflops

    if smoke:
        dev, peak = torch.device("cpu"), None
    else:
        from tessera.hetero.runtime.device import bind_local_device

        dev = bind_local_device(0)
        peak = peak_tflops(torch.cuda.get_device_name(dev), "bfloat16")  # the trainer's MFU denominator
        print(f"gpu_step on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, peak {peak} TFLOPS bf16\n",
              flush=True)
    if not args.skip_layers:
        print(f"per layer, forward+backward, {dtype}, seq={seq} batch=1:", flush=True)
        print(text_table(layer_rows(models, dev, seq, 1, args.iters, getattr(torch, dtype), peak)) + "\n", flush=True)
    rows, failed = [("recipe", "LLM slice", "steps timed", "s/step", "TFLOPS/GPU", "MFU", "peak GiB", "kernels")], 0
    for name in args.recipes:
        try:
            rows.append(train_step_row(name, runs[name], seq, steps, args.warmup, dtype))
        except Exception as e:  # one recipe failing still prints the others
            failed += 1
            rows.append((name, runs[name].llm, "-", "-", "-", "-", "-", f"{type(e).__name__}: {str(e)[:300]}"))
        print(f"{name}: {rows[-1][1:]}", flush=True)
    print(f"\nwhole step through the trainer, {dtype}, seq={seq}, 1 row/step, median of steps >= {args.warmup}:")
    print(text_table(rows), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
