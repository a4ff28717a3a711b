"""Training throughput of the tiny image+audio model on 4 CPU gloo ranks: homogeneous vs heterogeneous layouts.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_train.py --out bench_train.json          # ~3 min here
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_train.py --only-extra --layout "vision=tp4@0-3;audio=dp4@0-3;language=pp2,dp2@0-3"
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_train.py --saves --out bench_saves.json   # what a save costs
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_train.py --overlap     # boundary wait deferred vs in the op
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_train.py --grad-overlap   # grad reduction after vs in backward

One spawn of 4 ranks (hetero.tools.spawn.run_on_ranks) trains every layout in sequence through the real entry
point (recipes.train.train, as tests/test_train_hetero.py does): RADIO-tiny + FastConformer-tiny +
Nemotron-H tiny, synthetic data, seq_length 128, 4 rows per microbatch, 2 microbatches per step, fp32,
same seed and global batches in every layout (so the loss column must agree across rows). Per layout:
median step_time_s of hetero/training/loop.py's metrics over the steps after a warm-up of --warmup (2),
tokens/s = rows x seq_length / median step, the tokens/s ratio to the homogeneous layout (>1 = faster),
boundary MB moved per step (summed over ranks) and the last step's loss. Placement: 'homogeneous' when every
module has the same layout (hetero.planner.cost.same_shape), else the layout's own (encoders sharing ranks 0-1
apart from the LLM on 2-3 count as 'mixed'). Setup (process groups, model
build, final checkpoint) is outside the timed steps.

Caveat: this box has 2 CPU cores shared with other work, and 4 ranks oversubscribe them; step times of a
model this small are dominated by Python and gloo latency, not FLOPs, and vary by +-20% run to run. Read the
ratios as rough; the table is the harness, a GPU node gives the numbers that matter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

# (name, layout): "" = every module dp4 on ranks 0-3
LAYOUTS = [
    ("homogeneous", ""),
    ("coloc_tp2_pp2", "vision=tp2,dp2@0-3;audio=dp4@0-3;language=tp2,pp2@0-3"),
    ("coloc_cp2_dp2", "vision=dp4@0-3;audio=dp4@0-3;language=cp2,dp2@0-3"),
    ("noncoloc_cp2", "vision=dp2@0-1;audio=dp2@0-1;language=cp2@2-3"),
    ("noncoloc_tp2", "vision=dp1@0-0;audio=dp1@1-1;language=tp2@2-3"),
    ("noncoloc_dp2", "vision=dp2@0-1;audio=dp2@0-1;language=dp2@2-3"),
]
WORLD = 4
MODEL = dict(vision="radio_vit_tiny", audio="fastconformer_tiny")


def _train_all(root: str, layouts: list[tuple[str, str]], steps: int, seq: int, rows: int, microbatches: int,
               pre=None, trainer_kw: dict | None = None):
    """Every rank: pre() first when given (a microbenchmark), then train each layout for `steps` steps into
    root/<name> (trainer_kw: TrainerConfig fields per run name); returns (pre's result, the run summaries)."""
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    before = pre() if pre is not None else None
    out = []
    for name, layout in layouts:
        trainer = TrainerConfig(max_steps=steps, run_dir=str(Path(root) / name), resume=False, progress=False,
                                tensorboard=False, **(trainer_kw or {}).get(name, {}))
        summary = train(ModelConfig(**MODEL), DataConfig(seq_length=seq, rows_per_microbatch=rows,
                                                         microbatches=microbatches),
                        OptimConfig(lr=2e-3, warmup_steps=2, min_lr_ratio=1.0), trainer, layout=layout, name=name)
        out.append(summary)
    return before, out


def summarize(name: str, spec: str, resolved: str, metrics: list[dict], warmup: int, tokens_per_step: int) -> dict:
    """One table row from a run's metrics.jsonl records (pure; tests feed it synthetic records)."""
    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.planner.cost import placement, same_shape

    timed = [r["step_time_s"] for r in metrics[warmup:]] or [r["step_time_s"] for r in metrics]
    med = statistics.median(timed)
    hl = HeteroLayout.parse(resolved)
    return {"name": name, "layout": spec or "(default: every module dp4)", "resolved": resolved,
            "placement": "homogeneous" if same_shape(hl) else placement(hl), "steps": len(metrics), "timed_steps": len(timed),
            "median_step_s": med, "min_step_s": min(timed), "max_step_s": max(timed),
            "tokens_per_s": tokens_per_step / med,
            "boundary_mb_per_step": statistics.median(r["boundary_bytes"] for r in metrics) / 2 ** 20,
            # exposed boundary time: the slowest rank's seconds inside the exchanges and waiting for deferred ones
            "boundary_s": statistics.median(r.get("max_over_ranks", {}).get("boundary_s", 0.0) for r in metrics[warmup:]
                                            or metrics),
            "first_loss": metrics[0]["loss"], "final_loss": metrics[-1]["loss"],
            "step_times_s": [r["step_time_s"] for r in metrics]}


def add_ratios(rows: list[dict], baseline: str = "homogeneous") -> list[dict]:
    """tokens/s relative to the baseline row (the first homogeneous one when `baseline` is absent)."""
    base = next((r for r in rows if r["name"] == baseline), None) or next(
        (r for r in rows if r["placement"] == "homogeneous"), None)
    for r in rows:
        r["vs_homogeneous"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    return rows


def markdown_table(rows: list[dict]) -> str:
    head = ("| layout | placement | median step s | tokens/s | vs homogeneous | boundary MB/step | exposed boundary s "
            "| final loss |\n|---|---|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        ratio = f"{r['vs_homogeneous']:.2f}x" if r.get("vs_homogeneous") is not None else "n/a"
        lines.append(f"| `{r['layout']}` | {r['placement']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{ratio} | {r['boundary_mb_per_step']:.3f} | {r.get('boundary_s', 0.0):.3f} | "
                     f"{r['final_loss']:.4f} |")
    return "\n".join(lines)


def run(layouts: list[tuple[str, str]], steps: int = 10, warmup: int = 2, seq: int = 128, rows: int = 4,
        microbatches: int = 2, root: str | None = None, timeout: float = 1800.0, pre=None) -> tuple[list, list]:
    """Train every layout on WORLD gloo ranks in one spawn (after pre() on every rank, if given):
    (one summarize() row per layout with ratios, pre's result per rank)."""
    from tessera.hetero.tools.spawn import run_on_ranks
    from tessera.hetero.training.metrics import read_metrics

    tmp = None if root else tempfile.TemporaryDirectory(prefix="bench_train_")
    root = root or tmp.name
    try:
        per_rank = run_on_ranks(WORLD, _train_all, root, layouts, steps, seq, rows, microbatches, pre,
                                timeout=timeout)
        out = [summarize(name, spec, res["layout"], read_metrics(Path(root) / name), warmup, rows * microbatches * seq)
               for (name, spec), res in zip(layouts, per_rank[0][1])]
    finally:
        if tmp is not None:
            tmp.cleanup()
    return add_ratios(out), [r[0] for r in per_rank]


def measure(layouts: list[tuple[str, str]], steps: int = 10, warmup: int = 2, **kw) -> list[dict]:
    """run() without a microbenchmark: the table rows."""
    return run(layouts, steps, warmup, **kw)[0]


SAVE_VARIANTS = {"no saves": {}, "sync": {"save_every": 2}, "async": {"save_every": 2, "async_save": True}}


def measure_saves(steps: int = 20, repeats: int = 3, root: str | None = None) -> list[dict]:
    """The homogeneous layout trained `steps` steps with no save but the last, a synchronous save every 2 steps,
    and an asynchronous one every 2 steps, alternating, `repeats` times, in one spawn: per variant the median over
    repeats of the step loop's wall time, of the time the loop was blocked in saves (per save), and the loop's
    extra time per save over the no-save run (rank 0's clock; every rank waits at the step's all-reduce)."""
    from tessera.hetero.tools.spawn import run_on_ranks

    runs = [(f"{v}#{i}", "") for i in range(repeats) for v in SAVE_VARIANTS]
    kw = {name: SAVE_VARIANTS[name.split("#")[0]] for name, _ in runs}
    tmp = None if root else tempfile.TemporaryDirectory(prefix="bench_saves_")
    try:
        summaries = run_on_ranks(WORLD, _train_all, root or tmp.name, runs, steps, 128, 4, 2, None, kw,
                                 timeout=3600)[0][1]
    finally:
        if tmp is not None:
            tmp.cleanup()
    rows = []
    for v in SAVE_VARIANTS:
        mine = [s for (name, _), s in zip(runs, summaries) if name.split("#")[0] == v]
        rows.append({"variant": v, "saves": mine[0]["saves"],
                     "loop_s": statistics.median(s["loop_s"] for s in mine),
                     "blocked_per_save_s": statistics.median(s["save_blocked_s"] / s["saves"] for s in mine)})
    base = rows[0]["loop_s"]
    for r in rows:
        extra = r["saves"] - rows[0]["saves"]
        r["extra_per_save_s"] = (r["loop_s"] - base) / extra if extra else 0.0
    return rows


def saves_table(rows: list[dict]) -> str:
    lines = ["| saves | count | step loop s | blocked per save s | loop time added per save s |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['saves']} | {r['loop_s']:.2f} | {r['blocked_per_save_s']:.3f} | "
              f"{r['extra_per_save_s']:.3f} |" for r in rows]
    return "\n".join(lines)


def _train_overlap(root: str, layouts: list[tuple[str, str]], steps: int, repeats: int):
    """Every rank: each layout `repeats` times with the boundary's wait deferred (the trainer's) and inside the
    boundary op, alternating which goes first."""
    from tessera.hetero.runtime import step_executor

    try:
        for rep in range(repeats):
            for name, layout in layouts:
                for defer in ((True, False) if rep % 2 == 0 else (False, True)):
                    step_executor.DEFER_BOUNDARY_WAIT = defer
                    _train_all(root, [(f"{name}_{'deferred' if defer else 'sync'}_{rep}", layout)], steps, 128, 4, 2)
    finally:
        step_executor.DEFER_BOUNDARY_WAIT = True


def measure_overlap(layouts: list[tuple[str, str]], steps: int = 12, warmup: int = 2, repeats: int = 2) -> str:
    """Exposed boundary seconds and step time per layout, the boundary wait inside the op vs deferred."""
    from tessera.hetero.tools.spawn import run_on_ranks
    from tessera.hetero.training.metrics import read_metrics

    lines = ["| layout | exposed boundary s, waited in the op | deferred | step s, waited in the op | deferred |",
             "|---|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="bench_overlap_") as root:
        run_on_ranks(WORLD, _train_overlap, root, layouts, steps, repeats, timeout=3600)
        for name, spec in layouts:
            got = {}
            for mode in ("sync", "deferred"):
                recs = [r for rep in range(repeats) for r in read_metrics(Path(root) / f"{name}_{mode}_{rep}")[warmup:]]
                got[mode] = (statistics.median(r["max_over_ranks"]["boundary_s"] for r in recs),
                             statistics.median(r["step_time_s"] for r in recs))
            lines.append(f"| `{spec}` | {got['sync'][0]:.3f} | {got['deferred'][0]:.3f} | {got['sync'][1]:.3f} | "
                         f"{got['deferred'][1]:.3f} |")
    return "\n".join(lines)


GRAD_LAYOUTS = [lay for lay in LAYOUTS if lay[0] in ("homogeneous", "coloc_cp2_dp2", "noncoloc_dp2")]


def measure_grad_overlap(layouts: list[tuple[str, str]], bucket_elements: int, steps: int = 12, warmup: int = 2,
                         repeats: int = 2) -> str:
    """Exposed gradient communication per step (the slowest rank's seconds in ModuleOptimizers.sync_gradients
    after backward: the metrics' grad_reduce_s) and step time per layout, every bucket reduced after backward
    vs started during it (trainer.overlap_grad_reduce), alternating, in one spawn; losses must agree bitwise."""
    from tessera.hetero.tools.spawn import run_on_ranks
    from tessera.hetero.training.metrics import read_metrics

    runs, kw = [], {}
    for rep in range(repeats):
        for name, spec in layouts:
            for overlap in ((False, True) if rep % 2 == 0 else (True, False)):
                run_name = f"{name}_{'overlap' if overlap else 'sync'}_{rep}"
                runs.append((run_name, spec))
                kw[run_name] = {"overlap_grad_reduce": overlap, "grad_bucket_elements": bucket_elements}
    lines = ["| layout | exposed grad reduction s, after backward | overlapped | step s, after backward | overlapped "
             "| buckets started in backward | same losses |", "|---|---:|---:|---:|---:|---:|---|"]
    with tempfile.TemporaryDirectory(prefix="bench_grad_overlap_") as root:
        run_on_ranks(WORLD, _train_all, root, runs, steps, 128, 4, 2, None, kw, timeout=3600)
        for name, spec in layouts:
            got, losses = {}, {}
            for mode in ("sync", "overlap"):
                recs = [read_metrics(Path(root) / f"{name}_{mode}_{rep}") for rep in range(repeats)]
                losses[mode] = [[r["loss"] for r in rs] for rs in recs]
                timed = [r for rs in recs for r in rs[warmup:]]
                got[mode] = (statistics.median(r["max_over_ranks"]["grad_reduce_s"] for r in timed),
                             statistics.median(r["step_time_s"] for r in timed),
                             statistics.median(r["grad_buckets_in_backward"] for r in timed),
                             statistics.median(r["grad_buckets"] for r in timed))
            lines.append(f"| `{spec or '(every module dp4)'}` | {got['sync'][0]:.4f} | {got['overlap'][0]:.4f} | "
                         f"{got['sync'][1]:.3f} | {got['overlap'][1]:.3f} | "
                         f"{got['overlap'][2]:.0f} of {got['overlap'][3]:.0f} (rank 0) | "
                         f"{losses['sync'] == losses['overlap']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="steps per layout (the first --warmup are not timed)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layout", action="append", default=[],
                    help="a layout to add (repeatable); the homogeneous baseline always runs first")
    ap.add_argument("--only-extra", action="store_true", help="run only the homogeneous one and the --layout ones")
    ap.add_argument("--runs", default=None, help="keep the run directories here (default: a temporary folder)")
    ap.add_argument("--out", default="bench_train.json", help="JSON output path")
    ap.add_argument("--saves", action="store_true", help="instead: what a checkpoint save costs, sync vs async")
    ap.add_argument("--overlap", action="store_true",
                    help="instead: exposed boundary time with the boundary's wait deferred vs inside the op")
    ap.add_argument("--grad-overlap", action="store_true",
                    help="instead: exposed gradient communication per step, reduced after backward vs during it")
    ap.add_argument("--grad-bucket-elements", type=int, default=50_000,
                    help="with --grad-overlap: trainer.grad_bucket_elements (the tiny models need small buckets)")
    args = ap.parse_args(argv)
    if args.grad_overlap:
        t0 = time.perf_counter()
        print(measure_grad_overlap(GRAD_LAYOUTS, args.grad_bucket_elements))
        print(f"\n{WORLD} gloo ranks, fp32, buckets of {args.grad_bucket_elements} elements, 12 steps per run, 2 "
              f"alternating repeats, medians over steps 3-12 of the slowest rank's seconds; wall "
              f"{time.perf_counter() - t0:.0f} s")
        return 0
    if args.overlap:
        print(measure_overlap([lay for lay in LAYOUTS if lay[1]]))
        print(f"\n{WORLD} gloo ranks, 12 steps per run, 2 alternating repeats, medians over steps 3-12 of the slowest "
              f"rank's seconds in (or waiting for) boundary exchanges")
        return 0
    if args.saves:
        t0 = time.perf_counter()
        rows = measure_saves(root=args.runs)
        print(saves_table(rows))
        print(f"\n{WORLD} gloo ranks, homogeneous layout, 20 steps, a save every 2 steps (the last step always saves), "
              f"median of 3 alternating repeats; wall {time.perf_counter() - t0:.0f} s")
        Path(args.out).write_text(json.dumps({"world": WORLD, "rows": rows}, indent=1))
        return 0
    layouts = LAYOUTS[:1] if args.only_extra else list(LAYOUTS)
    layouts += [(f"extra{i}", spec) for i, spec in enumerate(args.layout)]
    t0 = time.perf_counter()
    rows = measure(layouts, args.steps, args.warmup, root=args.runs)
    wall = time.perf_counter() - t0
    print(markdown_table(rows))
    print(f"\n{WORLD} gloo ranks, {args.steps} steps per layout, median over steps {args.warmup + 1}-{args.steps}; "
          f"8 rows x 128 tokens per step; wall {wall:.0f} s (setup and checkpoints included)")
    losses = {round(r["final_loss"], 4) for r in rows}
    print(f"final loss equal in every layout (same data, same init): {len(losses) == 1}")
    Path(args.out).write_text(json.dumps({"world": WORLD, "steps": args.steps, "warmup": args.warmup,
                                          "wall_s": wall, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
