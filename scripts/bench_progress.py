"""What naming a hung rank costs a step (hetero/runtime/progress.py): the tiny VL recipe trained on 2 gloo ranks with
the progress beacon and its marks, and with both switched off, in alternating runs; plus the pieces alone.

    .venv/bin/python scripts/bench_progress.py                  # 4 runs of 12 steps each way, ~3 min on 2 cores
    .venv/bin/python scripts/bench_progress.py --steps 4 --pairs 1

Prints a table: median step time (after the first 2 steps) with and without, their ratio, and the cost of one
mark() (the main thread's share: one per schedule op) and of one publish (one per step and one per beat).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

LAYOUT = "vision=dp2@0-1;language=dp2@0-1"


def _train(run_dir: str, steps: int, on: bool) -> list[float]:
    """One rank of the run; with on=False the marks and the beacon are replaced by no-ops first."""
    from tessera.hetero.runtime import step_executor
    from tessera.hetero.training import loop
    from tessera.hetero.training.metrics import read_metrics
    from tessera.recipes.registry import build_recipe_kwargs
    from tessera.recipes.train import train

    if not on:
        class _Off:
            def __init__(self, *a, **k):
                pass

            def report(self, *a, **k):
                return []

            def close(self):
                pass

        step_executor.mark = loop.mark = lambda *a, **k: None
        loop.ProgressBeacon = _Off
    kwargs = build_recipe_kwargs("nemotron_vl_tiny", [f"layout={LAYOUT}", f"trainer.max_steps={steps}",
                                                       f"trainer.run_dir={run_dir}", "trainer.save_every=0",
                                                       "trainer.progress=false", "trainer.tensorboard=false",
                                                       "data.val_path=None"])
    train(**kwargs)
    return [r["step_time_s"] for r in read_metrics(run_dir)]


def _pieces(n: int = 100_000) -> tuple[float, float]:
    """(ns per mark, us per publish) in this process, a one-rank world's store."""
    from tessera.hetero.runtime.progress import ProgressBeacon, mark
    from tessera.hetero.runtime.world import process_world

    with process_world(backend="gloo", alone=True):
        phases = ["forward", "boundary", "backward", "pipeline"]
        t = time.perf_counter()
        for i in range(n):
            mark(phases[i & 3], "language")
        per_mark = (time.perf_counter() - t) / n * 1e9
        beacon = ProgressBeacon(0, 1, 300.0)
        t = time.perf_counter()
        for _ in range(1000):
            beacon._publish()
        per_publish = (time.perf_counter() - t) / 1000 * 1e6
        beacon.close()
    return per_mark, per_publish


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the first 2 are warm-up)")
    ap.add_argument("--pairs", type=int, default=4, help="runs each way, alternating")
    args = ap.parse_args()
    from tessera.hetero.tools.spawn import run_on_ranks

    times = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for on in (True, False):
                run_dir = str(Path(tmp) / f"run{i}{'on' if on else 'off'}")
                times[on] += run_on_ranks(2, _train, run_dir, args.steps, on)[0][2:]
    per_mark, per_publish = _pieces()
    with_, without = statistics.median(times[True]), statistics.median(times[False])
    print("| progress | median step s | steps | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| off | {without:.4f} | {len(times[False])} | 1.000 |")
    print(f"| on | {with_:.4f} | {len(times[True])} | {with_ / without:.3f} |")
    print(f"mark(): {per_mark:.0f} ns (one per schedule op); publish: {per_publish:.0f} us (one per step and beat)")


if __name__ == "__main__":
    main()
