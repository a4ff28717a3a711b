"""OMP_NUM_THREADS=1 python -m tessera.scripts.bench_dryrun [--worlds 16384 65536 131072] [--auto 16384] [--recipes ...]

Wall time and peak memory of the at-scale dry run (`python -m tessera.scripts.dryrun --recipe R --world W`, every
check it makes) for every full-size recipe (recipes/full_size.py) at each world, and of `layout=auto` (the
planner's search and the run's resolution, hetero/planner/run_layout.best_layout_for_run) for each recipe at
--auto ranks: what an elastic restart pays before its first step (issue 36 item 6: targets under 60 s at 131,072
ranks, flat memory; layout=auto under 10 s at 16,384).

Method: each run is a fresh subprocess, one at a time; peak RSS is the largest sum over the process and its
children (the dry run's spawned fake-world process) sampled every 0.1 s; the dry-run columns are its own
per-part timings (cost model, boundary plans, schedule, meta-device count, the wait for the fake-world process).
Imports (torch, megatron, nemo: ~10 s) are inside the wall time. On a shared machine the load is printed with
the table: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import psutil

AUTO = """
import sys, time
import fiddle as fdl
from tessera.recipes import registry
from tessera.hetero.planner.run_layout import best_layout_for_run
name, world = sys.argv[1], int(sys.argv[2])
cfg = fdl.build(registry.recipe(name, gpus=world))
t = time.perf_counter()
best = best_layout_for_run(cfg, world)
print(f"planned {time.perf_counter() - t:.2f} {best}")
"""


def measure(cmd: list[str]) -> tuple[float, float, int, str]:
    """(wall seconds, peak RSS GiB of the process tree, exit status, stdout) of one command."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.1)
    out = proc.stdout.read()
    return time.perf_counter() - t, peak / 2 ** 30, proc.returncode, out


def main(argv: list[str] | None = None) -> int:
    from tessera.recipes.full_size import RECIPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="*", default=sorted(RECIPES), choices=sorted(RECIPES))
    ap.add_argument("--worlds", nargs="*", type=int, default=[16384, 65536, 131072])
    ap.add_argument("--auto", nargs="*", type=int, default=[16384], help="worlds to time layout=auto at")
    a = ap.parse_args(argv)
    rows = [f"{'what':<28} {'ranks':>7} {'wall s':>7} {'peak GiB':>8} {'verdict':<7} parts (s)", "-" * 110]
    for name in a.recipes:
        for world in a.worlds:
            wall, gib, rc, out = measure([sys.executable, "-m", "tessera.scripts.dryrun", "--recipe", name,
                                          "--world", str(world)])
            last = re.search(r"dry run: (PASS|FAIL) (.*)", out)
            verdict, parts = (last.group(1), last.group(2)) if last else (f"rc={rc}", "")
            rows.append(f"{'dryrun ' + name:<28} {world:>7} {wall:>7.1f} {gib:>8.2f} {verdict:<7} {parts}")
            print(rows[-1], flush=True)
        for world in a.auto:
            wall, gib, rc, out = measure([sys.executable, "-c", AUTO, name, str(world)])
            got = re.search(r"planned ([\d.]+) (\S+)", out)
            planned = f"planning {got.group(1)} s -> {got.group(2)}" if got else f"rc={rc}"
            rows.append(f"{'layout=auto ' + name:<28} {world:>7} {wall:>7.1f} {gib:>8.2f} {'':<7} {planned}")
            print(rows[-1], flush=True)
    print("\n" + "\n".join(rows))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
