"""The dry run's boundary-plan and schedule checks (hetero/planner/dryrun.py), made on the distinct DP block.

At N ranks a layout scaled by data parallelism is k copies of one block of DP replicas (hetero/plan/replicas.py
says why a check of the block is a check of every copy: each copy's boundary plan and schedule are the block's
with ranks moved). Checking all N ranks cost time and memory growing with N x samples (the plan's per-shard
scans and the oracle's per-rank shard lists): 51 s at 65,536 ranks for one VL boundary. The block is checked
in full - every element delivered exactly once from a rank that holds it, rows moved against the minimum,
the schedule simulated to the end - and the counts reported for the whole layout are k times the block's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tessera.hetero.plan.boundary_plan import BoundaryBatch, BoundaryPlan, minimum_rows, plan_boundary
from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout, ModuleLayout
from tessera.hetero.plan.replicas import Fold
from tessera.hetero.plan.schedule_plan import ScheduleError, build_schedule, check_schedule


def synthetic_batch(samples: int, dst_cp: int, seed: int = 0) -> BoundaryBatch:
    """Uneven media counts at random sorted positions: a plan that is right here is right for any batch."""
    rng = np.random.default_rng(seed)
    seq = 16 * dst_cp
    counts = rng.integers(1, seq // 2, size=samples)
    return BoundaryBatch(seq, tuple(np.sort(rng.choice(seq, size=int(c), replace=False)) for c in counts))


def tile_batch(batch: BoundaryBatch, copies: int) -> BoundaryBatch:
    """`batch` repeated `copies` times: the whole layout's microbatch whose every DP copy sees the block's."""
    return BoundaryBatch(batch.seq_length, batch.positions * copies)


def _shards(src: ModuleLayout, dst: ModuleLayout, batch: BoundaryBatch):
    """Element ids per source (dp, cp) and per destination (dp, cp) shard, derived from the layouts'
    documented sharding (samples by DP; source CP: contiguous token parts; destination CP: zigzag chunks)."""
    n, seq = batch.num_samples, batch.seq_length
    src_sh, dst_sh = {}, {}
    g = 0
    chunk = seq // (2 * dst.cp)
    for i, pos in enumerate(batch.positions):
        ids = np.arange(g, g + len(pos))
        g += len(pos)
        for c, part in enumerate(np.array_split(ids, src.cp)):
            src_sh.setdefault((i // (n // src.dp_size), c), []).append(part)
        ck = pos // chunk
        owner = np.where(ck < dst.cp, ck, 2 * dst.cp - 1 - ck)
        for c in range(dst.cp):
            dst_sh.setdefault((i // (n // dst.dp_size), c), []).append(ids[owner == c])
    cat = lambda d: {k: np.concatenate(v) for k, v in d.items()}  # noqa: E731
    return cat(src_sh), cat(dst_sh)


def check_boundary_plan(plan: BoundaryPlan, src: ModuleLayout, dst: ModuleLayout, batch: BoundaryBatch) -> list[str]:
    """Problems of one plan: a needed row missing or delivered twice, a wrong element, a rank that sends
    what it does not hold."""
    src_sh, dst_sh = _shards(src, dst, batch)
    empty = np.zeros(0, np.int64)
    problems = []
    sides = (("forward", plan.forward, src, src.pp - 1, src_sh, dst, 0, dst_sh),
             ("backward", plan.backward, dst, 0, dst_sh, src, src.pp - 1, src_sh))
    for name, direction, send_m, send_stage, send_sh, recv_m, recv_stage, recv_sh in sides:
        hits = {}
        for r in recv_m.ranks:
            c = recv_m.coord(r)
            if c.pp == recv_stage:
                hits[r] = np.zeros(len(recv_sh.get((c.dp, c.cp), empty)), np.int64)
        for t in direction.transfers:
            s, d = send_m.coord(t.src_rank), recv_m.coord(t.dst_rank)
            if s is None or s.pp != send_stage or d is None or t.dst_rank not in hits:
                problems.append(f"{name}: transfer {t.src_rank}->{t.dst_rank} between ranks outside the boundary")
                continue
            held = send_sh.get((s.dp, s.cp), empty)
            want = recv_sh.get((d.dp, d.cp), empty)
            if t.src_index.max(initial=-1) >= len(held) or t.dst_index.max(initial=-1) >= len(want):
                problems.append(f"{name}: transfer {t.src_rank}->{t.dst_rank} indexes rows the ranks do not have")
                continue
            if not np.array_equal(held[t.src_index], want[t.dst_index]):
                problems.append(f"{name}: transfer {t.src_rank}->{t.dst_rank} carries the wrong elements")
            np.add.at(hits[t.dst_rank], t.dst_index, 1)
        for r, h in hits.items():
            if np.any(h != 1):
                problems.append(f"{name}: rank {r} gets {int((h == 0).sum())} rows never and "
                                f"{int((h > 1).sum())} rows more than once")
    return problems[:20]


@dataclass
class BoundaryCheck:
    """One boundary's verdict and counts (media rows, rows moved and their minimum per direction, transfers)."""

    problems: list[str] = field(default_factory=list)
    samples: int = 0
    media_rows: int = 0
    moved: tuple[int, int] = (0, 0)
    minimum: tuple[int, int] = (0, 0)
    transfers: int = 0

    def times(self, copies: int) -> "BoundaryCheck":
        """The counts of `copies` copies of this boundary (the problems are the block's)."""
        k = copies
        return BoundaryCheck(self.problems, self.samples * k, self.media_rows * k, (self.moved[0] * k,
                             self.moved[1] * k), (self.minimum[0] * k, self.minimum[1] * k), self.transfers * k)


def check_boundary(src: ModuleLayout, dst: ModuleLayout, batch: BoundaryBatch) -> BoundaryCheck:
    """Plan one boundary for `batch` and check it: delivery (check_boundary_plan) and no more rows moved than the
    minimum in either direction."""
    plan = plan_boundary(src, dst, batch)
    out = BoundaryCheck(check_boundary_plan(plan, src, dst, batch), batch.num_samples,
                        int(sum(len(p) for p in batch.positions)),
                        (plan.forward.rows_moved(), plan.backward.rows_moved()), minimum_rows(src, dst, batch),
                        len(plan.forward.transfers))
    if out.moved[0] > out.minimum[0] or out.moved[1] > out.minimum[1]:
        out.problems.append(f"moves {out.moved} rows, more than the minimum {out.minimum}")
    return out


def check_boundaries(fold: Fold, samples: int) -> dict[str, BoundaryCheck]:
    """Every encoder -> language boundary of the folded layout for `samples` samples per microbatch over the
    whole layout: planned and checked on the block (a synthetic batch of its share of the samples), counted
    for the whole layout (the block's batch repeated over the copies)."""
    lay, out = fold.layout, {}
    for i, key in enumerate(lay.encoders):
        batch = synthetic_batch(fold.shrink(samples), lay[LANGUAGE].cp, seed=i)
        out[key] = check_boundary(lay[key], lay[LANGUAGE], batch).times(fold.copies)
    return out


@dataclass
class ScheduleCheck:
    problem: str = ""   # empty when every rank runs to the end
    ops: int = 0
    ranks: int = 0
    ran: int = 0


def check_schedules(fold: Fold, microbatches: int) -> ScheduleCheck:
    """Every rank's schedule of the block built and simulated together (schedule_plan.check_schedule), counted for
    the whole layout."""
    schedules = build_schedule(fold.layout, microbatches)
    k = fold.copies
    out = ScheduleCheck(ops=k * sum(map(len, schedules.values())), ranks=k * len(schedules))
    try:
        out.ran = k * check_schedule(schedules, fold.layout)
    except ScheduleError as e:
        out.problem = str(e)
    return out


def fold_note(full: HeteroLayout, fold: Fold) -> str:
    """What the boundary and schedule checks ran on."""
    if fold.copies > 1:
        return (f"boundary plans and schedules checked on one block of {fold.layout.world_size} ranks ({fold.layout}): "
                f"the {full.world_size} ranks are {fold.copies} copies of it, DP ranks and samples shifted "
                f"(hetero/plan/replicas.py); counts below are for all ranks")
    why = f" ({fold.why_not})" if fold.why_not else ""
    return f"boundary plans and schedules checked on every rank{why}"
