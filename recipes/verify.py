"""Check a layout with the trainer itself: one training step in the layout == the same step on one device.

    torchrun --standalone --nproc-per-node 4 -m tessera.recipes.verify --recipe nemotron_omni_tiny \
        layout="vision=dp4@0-3;audio=dp4@0-3;language=tp2,cp2@0-3"
    torchrun --standalone --nproc-per-node 4 -m tessera.recipes.verify --recipe nemotron_omni_tiny \
        model.llm=nemotron_h_tiny_moe layout="vision=dp4@0-3;audio=dp4@0-3;language=dp4,ep2@0-3"

What runs is what trains: the recipe's model (a tiny one on a CPU box), data, resolution (hetero/plan/
resolved_run.py), stages, boundary communicators, loss and the optimizers' gradient reduction, through
recipes/train.train, for `--steps` optimizer steps (default 1) in the layout, saving a checkpoint; then rank 0
runs the same recipe with the same overrides and batch split as one process (layout "", every module on one
rank) and compares the two checkpoints, read back as whole tensors with torch's DCP tools (not Tessera's
loader): the same tensors under the same names and shapes, every Adam first and second moment (after one step
exactly (1 - beta) x the step's gradient and its square, so a gradient summed over the wrong group, a missing
boundary row or a wrong CP split shows), and the loss. Rank 0's last line is

    verify: PASS max_rel_err=<float> compared=<tensors> loss=<float> ref_loss=<float>   (or FAIL, exit 1)

max_rel_err is, over the loss and every moment, max |layout - one device| / max |one device| (see compare for
gradients that are zero in exact arithmetic); FAIL above --tolerance (default 1e-5, fp32) or when the tensors or
their shapes differ. Where the runs go: --out (default: a fresh temporary directory, removed after a PASS).

The chain model of hetero/tools/verify.py remains the runtime's component check (boundary bytes against the
minimum, MoE expert routing per rank, documents alone); this one checks the trainer end to end.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOLERANCE = 1e-5
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "GROUP_WORLD_SIZE")


def _quiet(overrides: list[str], run_dir: Path, steps: int) -> list[str]:
    """The user's overrides, then the verify run's own: `steps` steps, a checkpoint after the last, no extras."""
    return [*overrides, f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}", f"trainer.save_every={steps}",
            "trainer.resume=False", "trainer.progress=False", "trainer.tensorboard=False", "trainer.export_hf=None",
            "trainer.save_interval_minutes=0", "trainer.async_save=False"]


def whole_tensors(run_dir: Path) -> dict:
    """The run's last checkpoint as whole tensors (torch's DCP format tools: independent of Tessera's loader)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = run_dir / "checkpoints"
    last = ckpt / (ckpt / "latest").read_text().strip()
    out = run_dir / "whole.pt"
    dcp_to_torch_save(str(last), str(out))
    # weights and optimizer states; not the per-rank RNG states (a layout's ranks each keep their own)
    return {k: v for k, v in torch.load(out, weights_only=True).items()
            if isinstance(v, torch.Tensor) and k.startswith(("model.", "optim."))}


MOMENTS = ("optim.exp_avg.", "optim.exp_avg_sq.")  # Adam's moments after one step: (1-b1) g and (1-b2) g^2
NOISE_FLOOR = 1e-3  # below this share of its family's largest value, a tensor is rounding noise around zero


def compare(got: dict, ref: dict) -> tuple[float, list[str], list[str]]:
    """(max relative error of the Adam moments, problems, notes) of the layout's checkpoint against one
    device's. Keys and shapes must agree. A moment's error is max|got - ref| over the larger of its own max|ref|
    and NOISE_FLOOR x the largest of its family (first or second moment): a gradient that is zero in exact
    arithmetic (an attention key's bias, which softmax ignores; a conv bias under BatchNorm) is rounding noise
    whose relative error means nothing. BatchNorm running statistics are noted, not failed: each encoder DP rank
    tracks the items it encodes (DDP without SyncBatchNorm does the same), so they differ from one device's."""
    problems = [f"only in the layout's checkpoint: {k}" for k in sorted(set(got) - set(ref))]
    problems += [f"only in the one-device checkpoint: {k}" for k in sorted(set(ref) - set(got))]
    common = sorted(set(got) & set(ref))
    problems += [f"{k}: shape {tuple(got[k].shape)} != one device's {tuple(ref[k].shape)}"
                 for k in common if got[k].shape != ref[k].shape]
    common = [k for k in common if got[k].shape == ref[k].shape and ref[k].numel()]
    family_max = {f: max((float(ref[k].abs().max()) for k in common if k.startswith(f)), default=0.0) for f in MOMENTS}
    worst = 0.0
    for k in common:
        family = next((f for f in MOMENTS if k.startswith(f)), None)
        if family is None:
            continue
        diff = float((got[k].double() - ref[k].double()).abs().max())
        worst = max(worst, diff / max(float(ref[k].abs().max()), NOISE_FLOOR * family_max[family], 1e-30))
    import torch

    moved = sorted(k.rsplit(".", 2)[0] for k in common
                   if k.endswith(".running_mean") and not torch.equal(got[k], ref[k]))
    notes = [f"BatchNorm running statistics differ from one device's in {len(moved)} layers (e.g. {moved[0]}): "
             f"each encoder DP rank tracks the items it encodes"] if moved else []
    return worst, problems, notes


def _reference(recipe: str, overrides: list[str], run_dir: Path, steps: int, rows: int, microbatches: int) -> None:
    """The same recipe, overrides and batch split on one rank (layout ""), in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    cmd = [sys.executable, "-m", "tessera.recipes.train", "--recipe", recipe,
           *_quiet(overrides, run_dir, steps), "layout=\"\"", f"data.rows_per_microbatch={rows}",
           f"data.microbatches={microbatches}"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"the one-device reference failed ({' '.join(cmd)}):\n{res.stdout[-2000:]}"
                           f"{res.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, help="a registered recipe (recipes/registry.py)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--out", default=None, help="where both runs go (default: a temporary directory)")
    args, overrides = parser.parse_known_args(argv)

    import torch.distributed as dist

    from tessera.hetero.runtime.world import process_world
    from tessera.hetero.training.metrics import read_metrics
    from tessera.recipes.checks import resolve
    from tessera.hetero.runspec.config import RunConfig
    from tessera.recipes.registry import build_recipe_kwargs
    from tessera.recipes.train import train

    with process_world():  # the launcher's world, the device bound, megatron's CPU shims
        out = [args.out or (tempfile.mkdtemp(prefix="tessera_verify_") if dist.get_rank() == 0 else None)]
        dist.broadcast_object_list(out)
        out = Path(out[0])
        kwargs = build_recipe_kwargs(args.recipe, _quiet(overrides, out / "layout", args.steps))
        resolved = resolve(RunConfig(**kwargs), dist.get_world_size())  # a bad layout fails here, before any work
        train(**kwargs)
        verdict = [None]
        if dist.get_rank() == 0:
            _reference(args.recipe, overrides, out / "one_device", args.steps, resolved.rows_per_microbatch,
                       resolved.microbatches)
            ref_tensors = whole_tensors(out / "one_device")
            err, problems, notes = compare(whole_tensors(out / "layout"), ref_tensors)
            loss, ref = read_metrics(out / "layout")[-1]["loss"], read_metrics(out / "one_device")[-1]["loss"]
            err_loss = abs(loss - ref) / max(abs(ref), 1e-12)
            ok = not problems and max(err, err_loss) <= args.tolerance and math.isfinite(err)
            for line in problems[:20] + notes:
                print(f"verify: {line}", flush=True)
            compared = sum(k.startswith(MOMENTS) for k in ref_tensors)
            verdict[0] = (ok, f"verify: {'PASS' if ok else 'FAIL'} max_rel_err={max(err, err_loss):.3e} "
                              f"compared={compared} loss={loss:.6f} ref_loss={ref:.6f} layout={resolved.layout}")
            print(verdict[0][1], flush=True)
            if ok and args.out is None:
                shutil.rmtree(out, ignore_errors=True)
        dist.broadcast_object_list(verdict)
        return 0 if verdict[0][0] else 1


if __name__ == "__main__":
    sys.exit(main())
