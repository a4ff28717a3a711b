"""Boundary benchmark: Tessera's plan vs a Megatron-style leader+broadcast bridge vs raw point-to-point.

    .venv/bin/python scripts/bench_boundary.py            # gloo on this machine, worlds of 4 and 8 ranks
    .venv/bin/python scripts/bench_boundary.py --iters 50 --hidden 2048

For each layout, one microbatch of media embeddings crosses the encoder -> language boundary (forward),
timed three ways side by side in the same processes:
  tessera   the plan: each destination rank receives only its own rows (its DP samples, its CP chunks),
            colocated rows never leave the rank.
  megatron  one leader per destination DP replica receives its replica's rows from the source leaders,
            then broadcasts them to every TP x CP rank of the replica (full sequence to every CP rank).
            Megatron's bridge rejects source CP > 1: those rows say n/a.
  raw p2p   the same sender -> receiver byte counts as tessera, one contiguous message per pair, no
            gather/scatter, no local copies (receivers allocate their buffers): the floor for those bytes.
Bytes are summed over ranks; time is the median over iterations of the slowest rank's time.
Targets: tessera bytes = minimum on every row; tessera time <= 1.2x raw p2p.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from tessera.hetero.runtime.boundary import BoundaryCommunicator
from tessera.hetero.plan.boundary_plan import BoundaryBatch, minimum_rows, source_shard
from tessera.hetero.runtime.groups import build_module_groups, destroy_module_groups
from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout

LAYOUTS = {
    4: ["vision=dp4@0-3;language=tp2,cp2@0-3",
        "vision=dp4@0-3;language=tp4@0-3",
        "vision=dp2@0-1;language=tp2@2-3",
        "vision=dp2@0-1;language=cp2@2-3"],
    8: ["vision=dp8@0-7;language=tp2,cp2,dp2@0-7",
        "vision=dp4@0-3;language=tp2,cp2@4-7",
        "vision=dp2,tp2@0-3;language=cp4@4-7",
        "vision=cp2,dp2@0-3;language=tp2,dp2@4-7"],
}


def make_batch(layout: HeteroLayout, samples: int, seq: int, seed: int = 0) -> BoundaryBatch:
    rng = np.random.default_rng(seed)
    counts = rng.integers(seq // 4, seq // 2, samples)
    return BoundaryBatch.from_lists(seq, [np.sort(rng.choice(seq, int(c), replace=False)) for c in counts])


def _timed(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def _megatron_style(layout, groups, batch, values, rank):
    """Forward of a leader-per-DP-replica bridge; returns (callable, bytes it moves) or None if unsupported."""
    src, dst = layout["vision"], layout[LANGUAGE]
    if src.cp > 1:
        return None
    n, hidden = batch.num_samples, values.shape[1]
    offsets = np.r_[0, np.cumsum(batch.tokens_per_sample)]
    src_leader = {d: src.rank_of(0, 0, d, src.pp - 1) for d in range(src.dp_size)}
    dst_leader = {d: dst.rank_of(0, 0, d, 0) for d in range(dst.dp_size)}
    # per (source replica, destination replica): the samples they share, as element rows
    pairs = []
    for a in range(src.dp_size):
        for b in range(dst.dp_size):
            lo = max(a * n // src.dp_size, b * n // dst.dp_size)
            hi = min((a + 1) * n // src.dp_size, (b + 1) * n // dst.dp_size)
            if lo < hi:
                pairs.append((a, b, np.arange(offsets[lo], offsets[hi])))
    coord = dst.coord(rank)
    moved = 0
    for a, b, rows in pairs:
        if src_leader[a] != dst_leader[b]:
            moved += len(rows) * hidden * values.element_size()
    for b in range(dst.dp_size):
        rows = offsets[(b + 1) * n // dst.dp_size] - offsets[b * n // dst.dp_size]
        moved += int(rows) * hidden * values.element_size() * (dst.tp * dst.cp - 1)

    def run():
        ops, bufs = [], {}
        for a, b, rows in pairs:
            if src_leader[a] == dst_leader[b]:
                continue
            if rank == src_leader[a]:
                ops.append(dist.P2POp(dist.isend, values[torch.as_tensor(rows)], dst_leader[b]))
            if rank == dst_leader[b]:
                bufs[(a, b)] = torch.empty(len(rows), hidden, dtype=values.dtype)
                ops.append(dist.P2POp(dist.irecv, bufs[(a, b)], src_leader[a]))
        for r in dist.batch_isend_irecv(ops) if ops else []:
            r.wait()
        if coord is not None and coord.pp == 0:
            d = coord.dp
            replica = values[offsets[d * n // dst.dp_size]:offsets[(d + 1) * n // dst.dp_size]].clone()
            dist.broadcast(replica, dst_leader[d], group=groups[LANGUAGE].pgs.tp_cp)

    return run, moved


def _raw_p2p(plan, rank, hidden, dtype):
    """One message per (sender, receiver) pair of the plan; senders' buffers ready-made, receivers allocate
    theirs each microbatch (as any receive path that hands the data on must)."""
    sends = [torch.empty(len(t.src_index), hidden, dtype=dtype) for t in plan.forward.sends(rank)]
    recvs = plan.forward.recvs(rank)

    def run():
        ops = [dist.P2POp(dist.isend, b, t.dst_rank) for b, t in zip(sends, plan.forward.sends(rank))]
        ops += [dist.P2POp(dist.irecv, torch.empty(len(t.dst_index), hidden, dtype=dtype), t.src_rank)
                for t in recvs]
        for r in dist.batch_isend_irecv(ops) if ops else []:
            r.wait()

    return run


def bench_world(specs, samples, seq, hidden, iters):
    rank, rows = dist.get_rank(), []
    for spec in specs:
        layout = HeteroLayout.parse(spec).validate(world_size=dist.get_world_size())
        groups = build_module_groups(layout)
        src, dst = layout["vision"], layout[LANGUAGE]
        batch = make_batch(layout, samples, seq)
        values = torch.randn(int(batch.tokens_per_sample.sum()), hidden)
        comm = BoundaryCommunicator(src, dst, hidden)
        c = src.coord(rank)
        x = values[torch.as_tensor(source_shard(src, batch, c.dp, c.cp))] if c and c.pp == src.pp - 1 else None
        plan = comm.plan(batch)

        def tessera():
            with torch.no_grad():
                comm(x, batch)

        t_tessera = _timed(tessera, iters)
        t_raw = _timed(_raw_p2p(plan, rank, hidden, values.dtype), iters)
        mega = _megatron_style(layout, groups, batch, values, rank)
        t_mega = _timed(mega[0], iters) if mega else None
        row_bytes = hidden * values.element_size()
        rows.append({"layout": spec, "placement": layout.placement, "bytes": plan.forward.rows_moved() * row_bytes,
                     "min_bytes": minimum_rows(src, dst, batch)[0] * row_bytes,
                     "mega_bytes": mega[1] if mega else None,
                     "t_tessera": t_tessera, "t_raw": t_raw, "t_mega": t_mega})
        destroy_module_groups(groups)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=8, help="samples per microbatch")
    ap.add_argument("--seq", type=int, default=2048, help="LLM sequence length")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    rows = []
    for world, specs in LAYOUTS.items():
        rows += run_on_ranks(world, bench_world, specs, args.samples, args.seq, args.hidden, args.iters,
                             timeout=1200)[0]
    mb = 2 ** 20
    print(f"{'layout':44s} {'place':13s} {'tessera MB':>10s} {'min MB':>7s} {'mega MB':>8s} "
          f"{'tessera ms':>10s} {'raw ms':>7s} {'mega ms':>8s} {'t/raw':>6s} {'mega/t':>7s}")
    for r in rows:
        mega_b = f"{r['mega_bytes'] / mb:8.2f}" if r["mega_bytes"] is not None else f"{'n/a':>8s}"
        mega_t = f"{r['t_mega'] * 1e3:8.2f}" if r["t_mega"] is not None else f"{'n/a':>8s}"
        speed = f"{r['t_mega'] / r['t_tessera']:7.2f}" if r["t_mega"] is not None else f"{'n/a':>7s}"
        print(f"{r['layout']:44s} {r['placement']:13s} {r['bytes'] / mb:10.2f} {r['min_bytes'] / mb:7.2f} "
              f"{mega_b} {r['t_tessera'] * 1e3:10.2f} {r['t_raw'] * 1e3:7.2f} {mega_t} "
              f"{r['t_tessera'] / max(r['t_raw'], 1e-9):6.2f} {speed}")
    ok = all(r["bytes"] == r["min_bytes"] for r in rows)
    print(f"bytes = minimum on every row: {ok}")


if __name__ == "__main__":
    main()
