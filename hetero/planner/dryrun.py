"""At-scale dry run: everything a layout needs at N ranks, checked in one process, before any GPU is booked.

    .venv/bin/python -m tessera.scripts.dryrun --recipe nemotron_vl_12b --world 1024
    .venv/bin/python -m tessera.scripts.dryrun --layout "vision=dp8@0-7;language=tp4,dp2@8-15" --world 1024 \
        --llm nemotron_nano_12b_v2 --vision radio_vit_h
(the command line is scripts/dryrun.py's: recipes sit above the planner, tests/test_layering.py)

1. process groups: every module's groups are created with torch's fake backend, as rank p sees them, for a
   few probe ranks p (first/last/middle of every module); membership must match the layout's rank formula
   and every probe must create the groups in the same order (creation is collective: a different order
   hangs a real job). A fresh spawned process, as tests/test_groups_fake.py: the fake world must be that
   process's only default group and megatron keeps global state. Each probe creates its own groups only
   (hetero/planner/fake_groups.py: the others' rank lists are checked, not created), so the cost is linear
   in the world, not a million new_group calls.
2. boundary plans for every encoder -> language pair (a synthetic microbatch with the layout's real number
   of samples, few media tokens each, uneven and random positions): every element delivered exactly once
   to every rank that needs it in both directions, from a rank that holds it (checked against shard
   membership derived independently of hetero.plan.boundary_plan), and no more rows moved than needed.
3. the pipeline schedule of every rank via hetero.plan.schedule_plan (build_schedule, check_schedule).
   2 and 3 run on the layout's distinct block of DP replicas (hetero/plan/replicas.py: at N ranks a scaled
   layout is N / block copies of it, each the block with ranks and samples shifted; hetero/planner/plan_checks.py),
   so time and memory stay flat as N grows; colocated modules of different PP are checked on every rank.
4. per-rank memory from the cost model (hetero.planner.cost.predict), and per module and rank from the real
   modules built on the meta device in the same spawned fake world (hetero/planner/meta_memory.py: params,
   grads, optimizer states, measured activations), printed next to the cost model's with the difference
   (hetero/planner/memory_report.py); a rank over the GPU's usable memory fails the dry run.
`scale_layout(layout, world)` (hetero/plan/layout.py) grows a recipe's layout (recipes/full_size.py) to N ranks by DP.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout, LayoutError, ModuleLayout, rows_multiple, scale_layout
from tessera.hetero.plan.replicas import dp_fold
from tessera.hetero.planner.cluster import Workload, cluster
from tessera.hetero.planner.cost import HEADROOM, items_of, predict
from tessera.hetero.planner.memory_report import ParamCheck, memory_report, param_checks
from tessera.hetero.planner.step_time import GIB
from tessera.hetero.planner.meta_memory import batch_for, model_config, rank_shards, seeded_init_units
from tessera.hetero.planner.model import ModelDesc
from tessera.hetero.planner.plan_checks import (check_boundaries, check_boundary_plan, check_schedules,  # noqa: F401
                                                fold_note, synthetic_batch)


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
    """The ranks of each of `rank`'s groups in module m, from the layout's rank formula alone (evaluated on arrays:
    a DP group holds up to the whole world)."""
    c = m.coord(rank)

    def vary(**ranges) -> list[int]:  # rank's coordinates, the named ones taking every value
        axes = [np.arange(ranges[n]) if n in ranges else np.array([getattr(c, n)]) for n in ("tp", "cp", "dp", "pp")]
        return np.unique(m.rank_of(*np.ix_(*axes))).tolist()

    flat = c.cp + m.cp * c.dp  # experts re-cut the cp*dp slice into ep (fastest) x expt_dp
    f = np.arange(m.cp * m.dp_size)
    slice_ranks = m.rank_of(c.tp, f % m.cp, f // m.cp, c.pp)
    return {"tp": vary(tp=m.tp), "cp": vary(cp=m.cp), "dp": vary(dp=m.dp_size), "pp": vary(pp=m.pp),
            "dp_cp": vary(dp=m.dp_size, cp=m.cp),
            "ep": sorted(slice_ranks[(flat // m.ep) * m.ep:(flat // m.ep + 1) * m.ep].tolist()),
            "expt_dp": sorted(slice_ranks[flat % m.ep::m.ep].tolist())}


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
    from tessera.hetero.planner.fake_groups import member_groups_only
    from tessera.hetero.runtime.groups import build_module_groups
    from tessera.hetero.runtime.world import fake_world

    layout = HeteroLayout.parse(spec)
    problems: list[str] = []
    orders: list[list[str]] = []  # per probe, every enumeration megatron passes in creation order (digests)
    with member_groups_only(lambda digest: orders[-1].append(digest)):
        for rank in probes:
            orders.append([])
            try:
                with fake_world(rank, world):
                    problems += _group_problems(layout, rank, build_module_groups(layout))
            except Exception as e:  # noqa: BLE001 - any failure of group creation is the finding
                problems.append(f"rank {rank}: building groups failed: {e}")
    if any(o != orders[0] for o in orders):
        problems.append("probe ranks create process groups in different orders (a real job would hang)")
    return problems


# --- the dry run -----------------------------------------------------------------------------------------

def _in_fresh_process(fn, *args):
    """Start fn(*args) in a spawned process; the caller works meanwhile and collects the future."""
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    future = pool.submit(fn, *args)
    future.add_done_callback(lambda _: pool.shutdown(wait=False))
    return future


def _fake_world_checks(spec: str, world: int, probes: list[int] | None, model_cfg, batch):
    """Both fake-world parts in one spawned process: (group problems or None, meta shards or None)."""
    from tessera.hetero.planner.fake_groups import member_groups_only

    with member_groups_only():  # every rank creates its own groups only; megatron enumerates each kind once
        problems = check_groups(spec, world, probes) if probes is not None else None
        t = time.perf_counter()
        shards = rank_shards(spec, model_cfg, batch) if model_cfg is not None else None
    # a run from a checkpoint loads it instead of drawing from the seed
    units = seeded_init_units(model_cfg) if model_cfg is not None and not model_cfg.checkpoint else None
    return problems, shards, units, time.perf_counter() - t


def _meta_inputs(layout: HeteroLayout, model: ModelDesc, w: Workload, frozen, dtype: str, run_model=None):
    """(model config, microbatch) for meta_memory, or (None, why) when the model has no registry names and no
    run_model config is given."""
    if run_model is None and any(not mod.name for mod in model.modules):
        return None, "meta-device count skipped: the model is not given by registry names"
    items = {mod.key: items_of(mod, w)[0] for mod in model.encoders}
    batch = batch_for(layout, w.micro_batch, w.seq_length, items, w.audio_clip_seconds)
    return run_model or model_config({mod.key: mod.name for mod in model.modules}, set(frozen), dtype), batch


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


def _priced_recompute(recompute: str | None, layout: HeteroLayout) -> tuple[tuple[str, ...] | None, str]:
    """(the modules the cost model prices with full recompute, or None for its own choice; why, in words)."""
    if recompute is None:
        return None, "the planner's least that fits; the run's model.recompute was not given"
    from tessera.hetero.plan.recompute import parse_recompute

    modes = {k: m for k, m in parse_recompute(recompute).items() if k in layout.modules}
    selective = [k for k, m in modes.items() if m == "selective"]
    return (tuple(k for k, m in modes.items() if m == "full"),
            f"model.recompute={recompute}" + (f"; selective ({','.join(selective)}) priced as none" if selective
                                              else ""))


def dry_run(layout_str: str, world: int | None = None, microbatches: int = 4, model: ModelDesc | None = None,
            workload: Workload | None = None, cluster_name: str = "h100", groups: bool = True, meta: bool = True,
            frozen: tuple[str, ...] = (), zero1: bool = True, dtype: str = "bfloat16", run_model=None,
            recompute: str | None = None) -> Report:
    """Check `layout_str` (scaled by DP to `world` ranks when given) at full size; see the module docstring.
    meta: count memory on the modules built on the meta device (needs `model`); frozen: module keys whose
    parameters are frozen; zero1: whether the optimizer states are sharded (optim.use_distributed_optimizer);
    run_model: the model config built on the meta device (meta_memory.model_config, e.g. with a checkpoint whose
    config.json defines the modules), else `model`'s registry names. recompute: the run's model.recompute, priced
    as the run trains (the cost model knows full recompute or none: selective is priced as none, and said so);
    None: the planner's least recompute that fits, named as its choice."""
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
        priced, why = _priced_recompute(recompute, layout)
        pred = predict(layout, model, w, cl, recompute=priced)
        report.memory_gib = pred.memory_gib
        if not pred.feasible:
            report.problems.append(pred.reason)
        else:
            report.notes.append(f"cost model: {pred.tokens_per_s:.0f} tokens/s, {pred.tflops_per_gpu:.0f} "
                                f"TFLOPS/GPU, recompute {','.join(pred.recompute) or 'none'} ({why})")
        if meta and pred.modules:
            model_cfg, batch = _meta_inputs(layout, model, w, frozen, dtype, run_model)
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
    fold = dp_fold(layout)
    report.notes.append(fold_note(layout, fold))
    for key, b in check_boundaries(fold, samples).items():
        report.problems += [f"boundary {key}: {p}" for p in b.problems]
        report.notes.append(f"boundary {key}: {b.samples} samples, {b.media_rows} media rows, moved fwd/bwd "
                            f"{b.moved} = minimum, {b.transfers} transfers")
    report.seconds["boundary"] = time.perf_counter() - t

    t = time.perf_counter()
    sched = check_schedules(fold, microbatches)
    if sched.problem:
        report.problems.append(f"schedule: {sched.problem}")
    else:
        report.notes.append(f"schedule: {microbatches} microbatches, {sched.ops} ops on {sched.ranks} ranks, no "
                            f"deadlock, every message received ({sched.ran} run)")
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
