"""OMP_NUM_THREADS=1 python -m tessera.scripts.bench_reads [--media small camera] [--steps 4] [--rows 8]

Bytes each rank of a layout reads from the shards per step, before and after issue 31 (media metadata at prepare
time: the global stream reads JSON members only, a rank reads the bytes of only the items it decodes), against
the minimum: the JSON of the stream plus the bytes of the items that rank decodes.

Every rank of each layout is simulated in turn in this process: its loader (no workers) with its decode plan
(hetero/plan/resolved_run.decode_rows) over `--steps` microbatches of `--rows` rows, after one warm-up step.
Two measures: `counted`, the member bytes the loader reports (data/loader.py, what metrics.jsonl logs), and
`os`, the process's read bytes from /proc/self/io (rchar: also tar headers, energon's index and read-ahead).
"before" is the same samples prepared without the metadata (scripts/bench_loader.py builds both sets).
The table gives, per layout and dataset, the mean minimum per rank, the worst and the mean rank's ratio to its
minimum, and the OS bytes per step of the worst rank and of all ranks together.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from tessera.scripts.bench_loader import nometa, encoder_tokens, make_sets

LAYOUTS = ["vision=dp8@0-7;audio=dp8@0-7;language=tp2,dp4@0-7", "vision=dp2@0-1;audio=dp2@2-3;language=tp4@4-7"]


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _sizes(path: Path) -> dict[str, dict[str, int]]:
    """sample key -> {module: bytes of its media for that module}, from the tars."""
    from tessera.data.prepare import shard_media
    from tessera.data.tokens import MODULE_OF_KIND

    out = {}
    for key, items in shard_media(path).items():
        out[key] = {}
        for kind, _, size in items:
            out[key][MODULE_OF_KIND[kind]] = out[key].get(MODULE_OF_KIND[kind], 0) + size
    return out


def rank_reads(path: Path, tokenizer: Path, plan: dict, rows: int, steps: int) -> dict:
    """One rank: counted and OS bytes per step, and its minimum (the stream's JSON + its decoded items)."""
    from tessera.data.loader import ChatTaskEncoder, build_loader, close_loader

    loader = build_loader(path, ChatTaskEncoder(tokenizer, 65536, encoder_tokens(), decode=plan), rows,
                          shuffle_buffer=None, packing_buffer=8)
    it = iter(loader)
    next(it)  # warm-up: index open, first buffer fill
    r0 = _rchar()
    batches = [next(it) for _ in range(steps)]
    os_bytes = _rchar() - r0
    close_loader(loader)
    sizes = _sizes(path)
    decoded = sum(sizes[k].get(m, 0) for b in batches for r, keys in enumerate(b.keys) for k in keys
                  for m in plan if r in plan[m])
    return {"counted": sum(b.read_bytes for b in batches) / steps, "os": os_bytes / steps, "decoded": decoded / steps}


def main(argv=None) -> int:
    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.plan.resolved_run import decode_rows

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    ap.add_argument("--media", nargs="+", default=["small"], choices=["small", "camera"])
    ap.add_argument("--layouts", nargs="+", default=LAYOUTS)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--out", type=Path, default=Path("/tmp/tessera_bench_loader"))
    args = ap.parse_args(argv)
    print(f"{'media':7s} {'layout':48s} {'data':7s} {'ranks':>5s} {'min MB':>7s} {'counted/min':>18s} "
          f"{'os/min':>18s} {'os MB max':>9s} {'os MB sum':>9s}")
    for media in args.media:
        make_sets(args.out, media, args.samples, kinds=("mixed",))
        path = args.out / media / "mixed"
        json_per_step = None
        for spec in args.layouts:
            layout = HeteroLayout.parse(spec)
            for data, where in (("after", path), ("before", nometa(path))):
                per_rank = [rank_reads(where, path / "tokenizer.model", decode_rows(layout, r, args.rows), args.rows,
                                       args.steps) for r in range(layout.world_size)]
                if data == "after":  # the stream's JSON: what an LLM-only rank reads, measured where it is minimal
                    json_per_step = min(r["counted"] - r["decoded"] for r in per_rank)
                mins = [r["decoded"] + json_per_step for r in per_rank]
                counted = [r["counted"] / m for r, m in zip(per_rank, mins)]
                osr = [r["os"] / m for r, m in zip(per_rank, mins)]
                print(f"{media:7s} {spec:48s} {data:7s} {layout.world_size:5d} {statistics.mean(mins) / 1e6:7.2f} "
                      f"{'max ' + format(max(counted), '.2f'):>9s} {'mean ' + format(statistics.mean(counted), '.2f'):>8s} "
                      f"{'max ' + format(max(osr), '.2f'):>9s} {'mean ' + format(statistics.mean(osr), '.2f'):>8s} "
                      f"{max(r['os'] for r in per_rank) / 1e6:9.2f} {sum(r['os'] for r in per_rank) / 1e6:9.2f}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
