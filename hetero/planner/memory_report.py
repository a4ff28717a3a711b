"""Per-rank memory of a layout: the meta-device count of the real modules (meta_memory.py) next to the cost
model's prediction (cost.py), per module and in total, for the dry run.

From a module shard's exact parameter count (meta_memory.Shard):
    params  its bytes in the training dtype (bf16 runs cast every parameter, hetero/optim/optimizers.py)
    grads   4 B per trainable parameter: the fp32 main grads (bf16) or fp32 grads (fp32 runs)
    optim   fp32 master + exp_avg + exp_avg_sq = 12 B per trainable parameter (fp32 runs: 8 B, no master);
            ZeRO-1 (optim.use_distributed_optimizer, hetero/optim/zero.py) divides the dense part by the
            module's DP x CP size and routed experts by their expert-DP size (cp * dp / ep): the cost model's
            formula, step_time.optimizer_bytes, so the two columns can differ only by the parameter counts
    act     measured bytes of one microbatch (saved tensors of a meta forward) x the microbatches in flight on
            that stage as the cost model has them (1F1B: pp - stage; colocated encoders: every microbatch);
            with full recompute, layer inputs per microbatch plus the largest layer once. Where the meta
            forward failed: the cost model's formula, marked "formula".
Frozen modules have no trainable parameters (a frozen encoder's projector still trains).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.hetero.plan.layout import HeteroLayout, ModuleLayout
from tessera.hetero.planner.cost import Prediction
from tessera.hetero.planner.meta_memory import Shard
from tessera.hetero.planner import step_time
from tessera.hetero.planner.step_time import GIB, Memory


@dataclass
class ParamCheck:
    key: str
    stage: int
    meta_bytes: int
    planner_bytes: float

    @property
    def rel(self) -> float:
        return self.planner_bytes / self.meta_bytes - 1


def optimizer_bytes(s: Shard, lay: ModuleLayout, zero1: bool, mixed: bool = True) -> float:
    """The shard's Adam state bytes by the cost model's formula (step_time.optimizer_bytes), from its built
    trainable parameter counts."""
    return step_time.optimizer_bytes(s.trainable - s.trainable_experts, s.trainable_experts, lay, zero1, mixed)


def in_flight(key: str, stage: int, lay: ModuleLayout, pred: Prediction) -> int:
    """Microbatches whose activations a stage holds at once, as the cost model has them."""
    return max(1, min(lay.pp - stage, pred.in_flight[key])) if lay.pp > 1 else pred.in_flight[key]


def planner_memory(pred: Prediction, key: str, stage: int) -> Memory:
    cost = pred.modules[key]
    return cost.mem_first if stage == 0 else cost.mem_last


def shard_memory(s: Shard, lay: ModuleLayout, pred: Prediction, zero1: bool, mixed: bool = True) -> tuple[Memory, str]:
    """(Memory of the shard, where its activations come from)."""
    if s.act is None:
        act, source = planner_memory(pred, s.key, s.stage).act, "formula"
    elif s.key in pred.recompute:
        act, source = s.act_full * in_flight(s.key, s.stage, lay, pred) + s.act_peak_layer, "measured"
    else:
        act, source = s.act * in_flight(s.key, s.stage, lay, pred), "measured"
    return Memory(float(s.param_bytes), 4.0 * s.trainable, optimizer_bytes(s, lay, zero1, mixed), act), source


def param_checks(shards: list[Shard], pred: Prediction) -> list[ParamCheck]:
    """Parameter bytes per module shard: meta count vs the cost model's weights."""
    return [ParamCheck(s.key, s.stage, s.param_bytes, planner_memory(pred, s.key, s.stage).weights) for s in shards]


def _gib(m: Memory) -> str:
    return (f"params {m.weights / GIB:6.2f} grads {m.grads / GIB:6.2f} optim {m.optim / GIB:6.2f} "
            f"act {m.act / GIB:6.2f} = {m.total / GIB:6.2f}")


def _diff(meta: float, planner: float) -> str:
    return f"{100 * (planner / meta - 1):+.1f}%" if meta else "n/a"


def memory_report(layout: HeteroLayout, shards: list[Shard], pred: Prediction, usable_gib: float,
                  zero1: bool, mixed: bool = True) -> tuple[list[str], list[str]]:
    """(report lines, problems): per representative rank, every module it hosts and the total, meta count
    (the optimizer assumption in force) vs the cost model (always ZeRO-1), and a problem where the total
    exceeds `usable_gib`."""
    by = {(s.key, s.stage): s for s in shards}
    opt = "ZeRO-1 (optim.use_distributed_optimizer=true)" if zero1 else "replicated (use_distributed_optimizer=false)"
    lines = [f"memory per rank, GiB (meta-device build of the real modules; optimizer {opt}: fp32 master + "
             f"2 Adam moments, 4 B fp32 main grads; planner: cost model, ZeRO-1):"]
    lines.append("  activations: autograd's saved tensors in a meta forward of one microbatch (flash attention, fused "
                 "RMSNorm and, at CP 1, mamba_ssm's scan as on GPU; balanced MoE routing) x microbatches in flight")
    frozen = sorted({s.key for s in shards if s.trainable < s.params})
    if frozen:
        lines.append(f"  frozen parameters in {', '.join(frozen)}: the cost model prices every module trainable "
                     f"(compare params and activations there)")
    notes = sorted({f"{s.key}: {s.act_note}" for s in shards if s.act is None})
    lines += [f"  activations {n} -> planner formula" for n in notes]
    problems = []
    for rank in sorted({m.rank_of(pp=st) for m in layout.modules.values() for st in range(m.pp)}):
        hosted = {k: m.coord(rank).pp for k, m in layout.modules.items() if rank in m.ranks}
        where = ", ".join(f"{k}" + (f" stage {st}/{layout[k].pp}" if layout[k].pp > 1 else "")
                          for k, st in sorted(hosted.items()))
        lines.append(f"  rank {rank} ({where}):")
        total, planned, other, staged, gathered = Memory(), Memory(), 0.0, 0.0, 0.0
        for key, stage in sorted(hosted.items()):
            s, lay = by[(key, stage)], layout[key]
            mem, source = shard_memory(s, lay, pred, zero1, mixed)
            plan = planner_memory(pred, key, stage)
            flight = in_flight(key, stage, lay, pred)
            how = f"{source}, {flight} in flight" + (", full recompute" if key in pred.recompute else "")
            lines.append(f"    {key:9s} {_gib(mem)}  ({how}) | planner {_gib(plan)} ({_diff(mem.total, plan.total)})")
            total, planned = total + mem, planned + plan
            other += optimizer_bytes(s, lay, not zero1, mixed) - mem.optim
            staged += mem.weights + mem.optim
            gathered += optimizer_bytes(s, lay, False, mixed) if zero1 else 0.0
        usable = f" of {usable_gib:.1f} usable" if usable_gib else ""
        lines.append(f"    {'total':9s} {_gib(total)}{usable} | planner {planned.total / GIB:.2f} "
                     f"({_diff(total.total, planned.total)}) | with the {'replicated' if zero1 else 'ZeRO-1'} "
                     f"optimizer {(total.total + other) / GIB:.2f}")
        # a save hands the checkpoint views of the live weights and (ZeRO-1) optimizer shards: no GPU memory is
        # added (tests/test_distributed_optimizer.py checks the views); the writer stages at most the rank's
        # weights + optimizer bytes in host memory (D2H) while it writes
        lines.append(f"    {'save':9s} during a save {total.total / GIB:6.2f} (+0.00 on the GPU); host staging "
                     f"<= {staged / GIB:.2f}" + (f" (a save that gathered the ZeRO-1 states would add "
                                                 f"{gathered / GIB:.2f})" if zero1 else ""))
        if usable_gib and total.total / GIB > usable_gib:
            problems.append(f"memory: rank {rank} ({where}) needs {total.total / GIB:.1f} GiB > {usable_gib:.1f} "
                            f"GiB usable (meta-device count, optimizer {opt.split(' ')[0]})")
    return lines, problems
