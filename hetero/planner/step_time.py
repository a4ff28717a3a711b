"""How one layout's module costs add up to a step (the model itself is described in cost.py's docstring).

Stage, Memory and ModuleCost are what cost.module_cost prices per module. encoder_costs prices each encoder as
its placement runs it and rank_memory adds up the memory per rank range: both come first, so a layout that
cannot fit is known before any time is added. StepParts then collects the step's breakdown, busy time, exposed
DP and optimizer time while one function per placement adds its modules: homogeneous_step (Megatron's
baseline), or colocated_encoders (phases 1 and 3) and remote_encoders (the encoder side of the pipeline)
followed by encoder_pipeline (the 1F1B pipeline between the phases). cost.predict calls them and turns the
result into a Prediction.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from tessera.hetero.plan.layout import LANGUAGE, ModuleLayout

GIB = 2 ** 30
STAGE_PARTS = ("compute", "tp", "cp", "ep", "pp")
BREAKDOWN = (*STAGE_PARTS, "boundary", "bubble", "dp", "optimizer")
ADAM_BYTES = 12       # per trainable parameter of a bf16 run: fp32 master weights + Adam's exp_avg and exp_avg_sq
ADAM_BYTES_FP32 = 8   # fp32 runs: the parameters are their own master weights


def expert_dp(lay: ModuleLayout) -> int:
    """Ranks that hold copies of one routed expert (and share its gradients and Adam state): megatron's expert
    grid takes the module's CP x DP ranks and splits them into EP groups, cp * dp / ep of each."""
    return max(1, lay.cp * lay.dp_size // lay.ep)


def optimizer_params(dense: float, experts: float, lay: ModuleLayout, dp_ranks: int | None = None) -> float:
    """Parameters whose Adam state one rank holds under ZeRO-1 (the distributed optimizer,
    hetero/optim/zero.py): its `dense` ones split over the module's DP x CP ranks (`dp_ranks` when the
    gradients are reduced over another group) and its routed `experts` over their expert-DP ranks.
    The one formula: the cost model (memory and optimizer time) and the dry run's memory report read it."""
    return dense / (dp_ranks or lay.dp_size * lay.cp) + experts / expert_dp(lay)


def optimizer_bytes(dense: float, experts: float, lay: ModuleLayout, zero1: bool = True, mixed: bool = True,
                    dp_ranks: int | None = None) -> float:
    """Adam state bytes on one rank holding `dense` + `experts` trainable parameters; zero1=False: every rank
    keeps the state of all of them (use_distributed_optimizer=false)."""
    per = ADAM_BYTES if mixed else ADAM_BYTES_FP32
    return per * (optimizer_params(dense, experts, lay, dp_ranks) if zero1 else dense + experts)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage, one microbatch, forward + backward (seconds)."""

    compute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    pp: float = 0.0
    fwd_frac: float = 1 / 3   # share of the time spent in the forward pass

    @cached_property  # frozen: computed once (the layout search reads it millions of times)
    def total(self) -> float:
        return self.compute + self.tp + self.cp + self.ep + self.pp

    def __add__(self, o: "Stage") -> "Stage":
        t = self.total + o.total
        frac = (self.fwd_frac * self.total + o.fwd_frac * o.total) / t if t else self.fwd_frac
        return Stage(self.compute + o.compute, self.tp + o.tp, self.cp + o.cp, self.ep + o.ep, self.pp + o.pp, frac)


@dataclass(frozen=True)
class Memory:
    weights: float = 0.0
    grads: float = 0.0
    optim: float = 0.0
    act: float = 0.0

    @cached_property
    def total(self) -> float:
        return self.weights + self.grads + self.optim + self.act

    def __add__(self, o: "Memory") -> "Memory":
        return Memory(self.weights + o.weights, self.grads + o.grads, self.optim + o.optim, self.act + o.act)

    def describe(self) -> str:
        return (f"{self.total / GIB:.1f} GiB (weights {self.weights / GIB:.1f}, grads {self.grads / GIB:.1f}, "
                f"adam {self.optim / GIB:.1f}, activations {self.act / GIB:.1f})")


@dataclass(frozen=True)
class ModuleMemory:
    """A module's memory on its first and last PP stage (the same stage when pp == 1)."""

    mem_first: Memory
    mem_last: Memory

    @cached_property
    def memory(self) -> Memory:
        return max(self.mem_first, self.mem_last, key=lambda mm: mm.total)


@dataclass(frozen=True)
class ModuleCost:
    key: str
    stages: tuple[Stage, ...]
    dp_s: float              # gradient reduce-scatter + parameter all-gather per step
    optim_s: float
    mem_first: Memory        # first and last PP stage (the same stage when pp == 1)
    mem_last: Memory
    model_flops: float       # 3 x forward FLOPs of one microbatch, all ranks (useful work only)

    @cached_property
    def slowest(self) -> Stage:
        return max(self.stages, key=lambda s: s.total)

    @cached_property
    def memory(self) -> Memory:
        return max(self.mem_first, self.mem_last, key=lambda mm: mm.total)


# price(module key, its layout, microbatches in flight, gradient group or None) -> its cost, and
# boundary(encoder key, its layout) -> (forward, backward) seconds per microbatch; cost.predict binds both
Price = Callable[..., ModuleCost]
Boundary = Callable[[str, ModuleLayout], tuple[float, float]]


@dataclass
class StepParts:
    """The step as the placement functions add it up; memory (rank_memory's), DP and optimizer are kept per rank
    range because the slowest range sets the step and the fullest one decides feasibility."""

    llm: str                        # the LLM's rank range "first-last", shared by colocated encoders
    parts: dict[str, float]         # the breakdown; dp and optimizer are filled in last
    busy: dict[str, float]          # per module: seconds of the step its GPUs compute
    mem: dict[str, Memory]
    dp_exposed: dict[str, float]
    optim: dict[str, float]
    flops: float = 0.0              # useful FLOPs of the encoders' microbatches (the LLM's are added last)

    @classmethod
    def start(cls, llm: ModuleCost, lang: ModuleLayout, m: int, mem: dict[str, Memory]) -> "StepParts":
        """The LLM alone: its busy time, and the DP traffic one microbatch does not hide; `mem` is
        rank_memory's, priced before any time."""
        r = f"{lang.first}-{lang.last}"
        return cls(r, {n: 0.0 for n in BREAKDOWN}, {LANGUAGE: m * llm.slowest.total}, mem,
                   {r: max(0.0, llm.dp_s - llm.slowest.total)}, {r: llm.optim_s})

    def add(self, stage: Stage, times: float) -> None:
        for n in STAGE_PARTS:
            self.parts[n] += getattr(stage, n) * times


def encoder_costs(homogeneous: bool, lang: ModuleLayout, coloc: dict[str, ModuleLayout],
                  remote: dict[str, ModuleLayout], m: int, price: Price, per_microbatch: bool) -> dict[str, ModuleCost]:
    """Each encoder priced as its placement runs it, with the microbatches of activations its first stage holds:
    Megatron's baseline runs it at the LLM's TP and DP on the LLM's first stage, replicated over its CP ranks (so
    its gradients are reduced over DP x CP); a colocated one keeps every microbatch's activations until phase 3,
    or one microbatch's when it runs inside each microbatch (per_microbatch); a remote one heads a pipeline of
    its own stages + boundary + the LLM's."""
    if homogeneous:
        as_llm = ModuleLayout(lang.first, lang.first + lang.tp * lang.dp_size - 1, tp=lang.tp, dp=lang.dp_size)
        return {key: price(key, as_llm, min(lang.pp, m), lang.dp_size * lang.cp) for key in coloc}
    out = {key: price(key, lay, 1 if per_microbatch else m) for key, lay in coloc.items()}
    out.update({key: price(key, lay, min(m, lay.pp + lang.pp + 1)) for key, lay in remote.items()})
    return out


def rank_memory(homogeneous: bool, llm: ModuleCost, lang: ModuleLayout, encoders: dict[str, ModuleCost],
                remote: dict[str, ModuleLayout]) -> dict[str, Memory]:
    """Memory per rank range "first-last": the LLM's fullest stage plus the encoders on its ranks (Megatron's
    baseline: on its first stage), and each remote encoder's block (encoders sharing a block add up). Priced
    before any time, so a layout that cannot fit is known without timing it."""
    r = f"{lang.first}-{lang.last}"
    local = [e.memory for key, e in encoders.items() if key not in remote]
    if homogeneous:
        mem = {r: max(llm.mem_first + sum(local, Memory()), llm.mem_last, key=lambda mm: mm.total)}
    else:
        mem = {r: functools.reduce(operator.add, local, llm.memory)}
    return {**mem, **block_memory(encoders, remote)}


def block_memory(encoders: dict[str, ModuleCost], remote: dict[str, ModuleLayout]) -> dict[str, Memory]:
    """Memory of each block of ranks that holds only encoders (the remote ones; encoders sharing a block add up)."""
    mem: dict[str, Memory] = {}
    for key, lay in remote.items():
        block = f"{lay.first}-{lay.last}"
        mem[block] = mem.get(block, Memory()) + encoders[key].memory
    return mem


def pipeline(chain: list[Stage], m: int) -> tuple[float, Stage]:
    """1F1B over stages with per-microbatch times: (step, the slowest stage)."""
    slow = max(chain, key=lambda s: s.total)
    return m * slow.total + sum(s.total for s in chain) - slow.total, slow


def homogeneous_step(acc: StepParts, llm: ModuleCost, encoders: dict[str, ModuleCost], m: int) -> float:
    """Megatron's baseline: encoders (encoder_costs) at the LLM's TP and DP on its first PP stage, replicated
    over its CP ranks; returns the pipeline's time."""
    stage0 = llm.stages[0]
    for key, e in encoders.items():
        stage0 = stage0 + e.slowest
        acc.busy[key] = m * e.slowest.total
        acc.dp_exposed[acc.llm] += max(0.0, e.dp_s - llm.stages[0].total)
        acc.optim[acc.llm] += e.optim_s
        acc.flops += m * e.model_flops
    pipe, slow = pipeline([stage0, *llm.stages[1:]], m)
    acc.add(slow, m)
    acc.parts["bubble"] = pipe - m * slow.total
    return pipe


def colocated_encoders(acc: StepParts, encoders: dict[str, ModuleLayout], costs: dict[str, ModuleCost], m: int,
                       boundary: Boundary) -> tuple[float, float]:
    """Encoders on the LLM's ranks: (phase 1, phase 3) seconds, every microbatch's forward + boundary
    before the LLM's pipeline and boundary + backward after it (at pp 1 everywhere the trainer runs the same
    work inside each microbatch: encoder_costs prices its memory)."""
    phase1 = phase3 = 0.0
    for key, lay in encoders.items():
        e = costs[key]
        fb, bb = boundary(key, lay)
        s = e.slowest
        fill = (lay.pp - 1) * s.total
        phase1 += (m * s.total + fill) * s.fwd_frac + m * fb
        phase3 += (m * s.total + fill) * (1 - s.fwd_frac) + m * bb
        acc.add(s, m)
        acc.parts["bubble"] += fill
        acc.parts["boundary"] += m * (fb + bb)
        acc.busy[key] = m * s.total
        # its DP traffic hides behind its own phase-3 backward
        acc.dp_exposed[acc.llm] += max(0.0, e.dp_s - m * s.total * (1 - s.fwd_frac))
        acc.optim[acc.llm] += e.optim_s
        acc.flops += m * e.model_flops
    return phase1, phase3


def remote_encoders(acc: StepParts, encoders: dict[str, ModuleLayout], costs: dict[str, ModuleCost], m: int,
                    boundary: Boundary) -> tuple[list[Stage], Stage]:
    """Encoders on their own ranks: (their stages, the boundary stage) at the head of the LLM's pipeline."""
    enc_side: list[Stage] = []
    bound = Stage()
    for key, lay in encoders.items():
        r, e = f"{lay.first}-{lay.last}", costs[key]
        fb, bb = boundary(key, lay)
        bound = Stage(pp=bound.pp + fb + bb, fwd_frac=0.5)
        # parallel encoders feed the same boundary: align their last stages, keep the slower per slot
        n = max(len(enc_side), lay.pp)
        ours = [Stage()] * (n - lay.pp) + list(e.stages)
        enc_side = [max(a, b, key=lambda s: s.total) for a, b in
                    zip([Stage()] * (n - len(enc_side)) + enc_side, ours)]
        acc.busy[key] = m * e.slowest.total
        acc.dp_exposed[r] = acc.dp_exposed.get(r, 0.0) + max(0.0, e.dp_s - e.slowest.total)
        acc.optim[r] = acc.optim.get(r, 0.0) + e.optim_s
        acc.flops += m * e.model_flops
    return enc_side, bound


def encoder_pipeline(acc: StepParts, llm: ModuleCost, enc_side: list[Stage], bound: Stage, m: int,
                     phase1: float, phase3: float) -> float:
    """Encoder stages -> boundary -> LLM stages in one 1F1B pipeline between the colocated phases; returns
    the step before DP and optimizer."""
    chain = enc_side + ([bound] if enc_side else []) + list(llm.stages)
    pipe, slow = pipeline(chain, m)
    # the remote encoders' pipeline fill runs while the colocated encoders do phase 1
    hidden = min(phase1, sum(s.total * s.fwd_frac for s in enc_side))
    if slow is bound:
        acc.parts["boundary"] += m * bound.total
    else:
        acc.add(slow, m)
        acc.parts["boundary"] += bound.total
    acc.parts["bubble"] += pipe - m * slow.total - (bound.total if slow is not bound else 0.0) - hidden
    return phase1 + pipe - hidden + phase3
