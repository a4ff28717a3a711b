"""At-scale dry run: everything a layout needs at N ranks, checked in one process, before any GPU is booked.

    .venv/bin/python -m tessera.scripts.dryrun --recipe nemotron_vl_12b --world 1024
    .venv/bin/python -m tessera.scripts.dryrun --layout "vision=dp8@0-7;language=tp4,dp2@8-15" --world 1024 \
        --llm nemotron_nano_12b_v2 --vision radio_vit_h
(the command line is scripts/dryrun.py's: recipes sit above the planner, tests/test_layering.py)

1. process groups: every module's groups are created with torch's fake backend, as rank p sees them, for a
   few probe ranks p (first/last/middle of every module); membership must match the layout's rank formula
   and every probe must create the groups in the same order (creation is collective: a different order
   hangs a real job). A fresh spawned process, as tests/test_groups_fake.py: the fake world must be that
   process's only default group and megatron keeps global state.
2. boundary plans for every encoder -> language pair (a synthetic microbatch with the layout's real number
   of samples, few media tokens each, uneven and random positions): every element delivered exactly once
   to every rank that needs it in both directions, from a rank that holds it (checked against shard
   membership derived here, independently of hetero.plan.boundary_plan), and no more rows moved than needed.
3. the pipeline schedule of every rank via hetero.plan.schedule_plan (build_schedule, check_schedule), when
   that module exists.
4. per-rank memory from the cost model (hetero.planner.cost.predict), and per module and rank from the real
   modules built on the meta device in the same spawned fake world (hetero/planner/meta_memory.py: params,
   grads, optimizer states, measured activations), printed next to the cost model's with the difference
   (hetero/planner/memory_report.py); a rank over the GPU's usable memory fails the dry run.
`scale_layout(layout, world)` (hetero/plan/layout.py) grows a recipe's layout (recipes/full_size.py) to N ranks by DP.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tessera.hetero.plan.boundary_plan import BoundaryBatch, BoundaryPlan, minimum_rows, plan_boundary
from tessera.hetero.plan.schedule_plan import ScheduleError, build_schedule, check_schedule
from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout, LayoutError, ModuleLayout, rows_multiple, scale_layout
from tessera.hetero.planner.cluster import Workload, cluster
from tessera.hetero.planner.cost import HEADROOM, items_of, predict
from tessera.hetero.planner.memory_report import ParamCheck, memory_report, param_checks
from tessera.hetero.planner.step_time import GIB
from tessera.hetero.planner.meta_memory import batch_for, model_config, rank_shards, seeded_init_units
from tessera.hetero.planner.model import ModelDesc


@dataclass
class Report:
    layout: str
    world: int
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    memory_gib: dict[str, float] = field(default_factory=dict)
    memory_lines: list[str] = field(default_factory=list)   # meta-device count vs cost model, per rank
    params: list[ParamCheck] = field(default_factory=list)  # parameter bytes per module shard, meta vs planner

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = [f"dry run: {self.layout} at {self.world} ranks"] + [f"  {n}" for n in self.notes]
        lines += [f"  memory ranks {r}: {g:.1f} GiB (cost model)" for r, g in self.memory_gib.items()]
        lines += [f"  {line}" for line in self.memory_lines]
        lines += [f"  FAIL {p}" for p in self.problems]
        timing = " ".join(f"{k}={v:.2f}s" for k, v in self.seconds.items())
        lines.append(f"dry run: {'PASS' if self.ok else 'FAIL'} {timing}")
        return "\n".join(lines)


# --- 1. process groups (runs in a spawned process) -------------------------------------------------------

def expected_groups(m: ModuleLayout, rank: int) -> dict[str, list[int]]:
    """The ranks of each of `rank`'s groups in module m, from the layout's rank formula alone."""
    c = m.coord(rank)
    vary = lambda **ranges: sorted({m.rank_of(**{**c.__dict__, **dict(zip(ranges, v))})  # noqa: E731
                                    for v in itertools.product(*ranges.values())})
    flat = c.cp + m.cp * c.dp  # experts re-cut the cp*dp slice into ep (fastest) x expt_dp
    slice_ranks = [m.rank_of(c.tp, f % m.cp, f // m.cp, c.pp) for f in range(m.cp * m.dp_size)]
    return {"tp": vary(tp=range(m.tp)), "cp": vary(cp=range(m.cp)), "dp": vary(dp=range(m.dp_size)),
            "pp": vary(pp=range(m.pp)), "dp_cp": vary(dp=range(m.dp_size), cp=range(m.cp)),
            "ep": sorted(slice_ranks[(flat // m.ep) * m.ep:(flat // m.ep + 1) * m.ep]),
            "expt_dp": sorted(slice_ranks[flat % m.ep::m.ep])}


def probe_ranks(layout: HeteroLayout) -> list[int]:
    ranks = set()
    for m in layout.modules.values():
        ranks |= {m.first, m.last, m.first + m.tp * m.cp, (m.first + m.last) // 2}
    return sorted(r for r in ranks if r < layout.world_size)


def _group_problems(layout: HeteroLayout, rank: int, groups: dict) -> list[str]:
    """Where the groups `rank` built differ from the layout's (hetero/plan/layout.py's rank order)."""
    import torch.distributed as dist

    problems = []
    for key, g in groups.items():
        m = layout[key]
        if rank not in m.ranks:
            if g.pgs is not None:
                problems.append(f"rank {rank} got {key} groups without being in the module")
            continue
        got = {n: sorted(dist.get_process_group_ranks(getattr(g.pgs, n))) for n in
               ("tp", "cp", "dp", "pp", "dp_cp", "ep", "expt_dp")}
        want = expected_groups(m, rank)
        problems += [f"rank {rank} {key} {n} group {got[n]} != {want[n]}" for n in want if got[n] != want[n]]
    return problems


def check_groups(spec: str, world: int, probes: list[int]) -> list[str]:
    """Build every module's groups as each probe rank sees them (fake backend); return the problems."""
    import torch.distributed as dist

    from tessera.hetero.runtime.groups import build_module_groups
    from tessera.hetero.runtime.world import fake_world

    layout = HeteroLayout.parse(spec)
    problems, orders = [], []
    for rank in probes:
        calls: list[list[list[int]]] = []
        real = dist.new_subgroups_by_enumeration
        dist.new_subgroups_by_enumeration = lambda enum, *a, **k: (calls.append([list(g) for g in enum]),
                                                                   real(enum, *a, **k))[1]
        try:
            with fake_world(rank, world):
                problems += _group_problems(layout, rank, build_module_groups(layout))
        except Exception as e:  # noqa: BLE001 - any failure of group creation is the finding
            problems.append(f"rank {rank}: building groups failed: {e}")
        finally:
            dist.new_subgroups_by_enumeration = real
        orders.append(calls)
    if any(o != orders[0] for o in orders):
        problems.append("probe ranks create process groups in different orders (a real job would hang)")
    return problems


# --- 2. boundary plans -----------------------------------------------------------------------------------

def synthetic_batch(samples: int, dst_cp: int, seed: int = 0) -> BoundaryBatch:
    """Uneven media counts at random sorted positions: a plan that is right here is right for any batch."""
    rng = np.random.default_rng(seed)
    seq = 16 * dst_cp
    counts = rng.integers(1, seq // 2, size=samples)
    return BoundaryBatch(seq, tuple(np.sort(rng.choice(seq, size=int(c), replace=False)) for c in counts))


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


# --- the dry run -----------------------------------------------------------------------------------------

def _in_fresh_process(fn, *args):
    """Start fn(*args) in a spawned process; the caller works meanwhile and collects the future."""
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    future = pool.submit(fn, *args)
    future.add_done_callback(lambda _: pool.shutdown(wait=False))
    return future


def _fake_world_checks(spec: str, world: int, probes: list[int] | None, model_cfg, batch):
    """Both fake-world parts in one spawned process: (group problems or None, meta shards or None)."""
    problems = check_groups(spec, world, probes) if probes is not None else None
    t = time.perf_counter()
    shards = rank_shards(spec, model_cfg, batch) if model_cfg is not None else None
    units = seeded_init_units(model_cfg) if model_cfg is not None else None
    return problems, shards, units, time.perf_counter() - t


def _meta_inputs(layout: HeteroLayout, model: ModelDesc, w: Workload, frozen, dtype: str):
    """(model config, microbatch) for meta_memory, or (None, why) when the model has no registry names."""
    if any(not mod.name for mod in model.modules):
        return None, "meta-device count skipped: the model is not given by registry names"
    items = {mod.key: items_of(mod, w)[0] for mod in model.encoders}
    batch = batch_for(layout, w.micro_batch, w.seq_length, items, w.audio_clip_seconds)
    return model_config({mod.key: mod.name for mod in model.modules}, set(frozen), dtype), batch


def init_note(units: dict[tuple, int]) -> str:
    """What a rank holds in host memory while it initialises from the seed (no checkpoint)."""
    big = max(units, key=units.get)
    name = "/".join(map(str, big))
    return (f"init from the seed (no checkpoint): a rank holds its fp32 shard + one unit at a time, the "
            f"largest {name} {units[big] * 4 / GIB:.2f} GiB ({len(units)} units; the whole model in fp32 would "
            f"be {sum(units.values()) * 4 / GIB:.1f} GiB)")


def microbatch_workload(layout: HeteroLayout, w: Workload, microbatches: int) -> Workload:
    """`w` with the smallest microbatch every module's DP divides (rows per LLM DP replica, as the full-size
    recipes' rows_per_microbatch) and `microbatches` of them per step."""
    dp = layout[LANGUAGE].dp_size
    need = rows_multiple(layout)
    samples = dp * (need // math.gcd(need, dp))
    return dataclasses.replace(w, micro_batch=samples // dp, global_batch=samples * microbatches)


def dry_run(layout_str: str, world: int | None = None, microbatches: int = 4, model: ModelDesc | None = None,
            workload: Workload | None = None, cluster_name: str = "h100", groups: bool = True, meta: bool = True,
            frozen: tuple[str, ...] = (), zero1: bool = True, dtype: str = "bfloat16") -> Report:
    """Check `layout_str` (scaled by DP to `world` ranks when given) at full size; see the module docstring.
    meta: count memory on the modules built on the meta device (needs `model`); frozen: module keys whose
    parameters are frozen; zero1: whether the optimizer states are sharded (optim.use_distributed_optimizer)."""
    t0 = time.perf_counter()
    report = Report(layout_str, world or 0)
    try:
        layout = HeteroLayout.parse(layout_str)
        layout = scale_layout(layout, world) if world else layout
        layout.validate(world_size=layout.world_size)
    except LayoutError as e:
        report.problems.append(f"layout: {e}")
        return report
    report.layout, report.world = str(layout), layout.world_size
    lang = layout[LANGUAGE]
    w = microbatch_workload(layout, workload or Workload(), microbatches)
    samples = w.micro_batch * lang.dp_size
    pred = model_cfg = batch = None
    cl = cluster(cluster_name, layout.world_size)
    if model is not None:
        # the cost model checks heads, sequence and batch divisibility and prices memory per rank range
        pred = predict(layout, model, w, cl)
        report.memory_gib = pred.memory_gib
        if not pred.feasible:
            report.problems.append(pred.reason)
        else:
            report.notes.append(f"cost model: {pred.tokens_per_s:.0f} tokens/s, {pred.tflops_per_gpu:.0f} "
                                f"TFLOPS/GPU, recompute {','.join(pred.recompute) or 'none'}")
        if meta and pred.modules:
            model_cfg, batch = _meta_inputs(layout, model, w, frozen, dtype)
            if model_cfg is None:
                report.notes.append(batch)
            else:
                report.notes.append(f"meta-device microbatch per rank: {batch.llm_rows} row(s) x {batch.llm_tokens} "
                                    f"LLM tokens, {batch.vision_tiles} tiles/frames, {batch.audio_clips} audio clips"
                                    + (f"; frozen: {','.join(sorted(frozen))}" if frozen else ""))
    report.seconds["cost"] = time.perf_counter() - t0
    probes = probe_ranks(layout) if groups else None
    future = (_in_fresh_process(_fake_world_checks, str(layout), layout.world_size, probes, model_cfg, batch)
              if groups or model_cfg is not None else None)
    t = time.perf_counter()
    for i, key in enumerate(layout.encoders):
        batch = synthetic_batch(samples, lang.cp, seed=i)
        plan = plan_boundary(layout[key], lang, batch)
        found = check_boundary_plan(plan, layout[key], lang, batch)
        report.problems += [f"boundary {key}: {p}" for p in found]
        fwd_min, bwd_min = minimum_rows(layout[key], lang, batch)
        moved = (plan.forward.rows_moved(), plan.backward.rows_moved())
        if moved > (fwd_min, bwd_min):
            report.problems.append(f"boundary {key}: moves {moved} rows, more than the minimum {(fwd_min, bwd_min)}")
        report.notes.append(f"boundary {key}: {samples} samples, {sum(len(p) for p in batch.positions)} media "
                            f"rows, moved fwd/bwd {moved} = minimum, {len(plan.forward.transfers)} transfers")
    report.seconds["boundary"] = time.perf_counter() - t

    t = time.perf_counter()
    schedules = build_schedule(layout, microbatches)
    try:
        ran = check_schedule(schedules, layout)
        report.notes.append(f"schedule: {microbatches} microbatches, {sum(map(len, schedules.values()))} ops on "
                            f"{len(schedules)} ranks, no deadlock, every message received ({ran} run)")
    except ScheduleError as e:
        report.problems.append(f"schedule: {e}")
    report.seconds["schedule"] = time.perf_counter() - t

    if future is not None:
        t = time.perf_counter()
        found, shards, units, meta_s = future.result(timeout=1800)
        if found is not None:
            report.problems += [f"groups: {p}" for p in found]
            report.notes.append(f"groups: built at {layout.world_size} ranks for probe ranks {probes}")
        if shards is not None:
            lines, over = memory_report(layout, shards, pred, cl.hbm_gib * HEADROOM, zero1, dtype != "float32")
            report.memory_lines, report.params = lines, param_checks(shards, pred)
            report.problems += over
            report.seconds["meta"] = meta_s
        if units:
            report.notes.append(init_note(units))
        report.seconds["fake_world_wait"] = time.perf_counter() - t
    report.seconds["total"] = time.perf_counter() - t0
    return report
