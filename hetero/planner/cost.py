"""Predicted step time, memory and throughput of one layout: `predict(layout, model, workload, cluster)`.

Per module and microbatch, every pipeline stage costs compute (FLOPs / (peak * eff)) plus its exposed
communication: TP (two all-reduce-sized collectives per block, forward and backward; sequence parallel,
so activations are sharded by TP too), CP (per LLM layer kind as the trainer runs it: head-parallel all-to-alls, or the zigzag
path's gathers and slower torch kernels; cp_cost.py), EP (4 all-to-alls per MoE layer) and PP (one activation send each
way). DP is the distributed optimizer's gradient reduce-scatter + parameter all-gather, hidden behind one
microbatch's forward+backward (Megatron's overlap) except what sticks out. How modules combine:

    homogeneous    Megatron's baseline (predict(..., baseline=True), a comparison point): every module has
                   the LLM's layout, the encoders inherit its TP and DP, run on its first PP stage (making that
                   stage the slowest) and are replicated over its CP ranks (wasted work, not counted in TFLOPS).
                   Tessera's trainer runs the same layout string as colocated (an encoder given the LLM's pp or
                   cp is split like the LLM), so without baseline=True it is priced as colocated. An LLM alone
                   is 'homogeneous' either way (nothing differs).
    colocated      encoders on the LLM's ranks, three phases: all microbatches' encoder forward + boundary,
                   the LLM's 1F1B, then boundary + encoder backward. The encoder activations of every
                   microbatch stay alive until phase 3 (or are recomputed), except when the LLM and the
                   colocated encoders are all at pp 1: then the trainer runs them inside each microbatch
                   (hetero/plan/schedule_plan.py) and one microbatch of them is alive.
    non-colocated  one pipeline: encoder stages -> boundary -> LLM stages, in 1F1B order; a pipeline with
                   per-microbatch stage times t_i takes m * max(t) + sum(t) - max(t), and every module waits
                   for the slowest one (its idle time is reported).
    mixed          colocated phases around the pipeline of the non-colocated encoders; their pipeline fill
                   hides behind phase 1.

Memory per GPU: bf16 weights (2 B/param; replicated parameters whole on every TP rank), fp32 main grads
(4 B), fp32 Adam master + moments (12 B) sharded over the module's DP x CP ranks (ZeRO-1; experts over their
expert-DP ranks, cp * dp / ep: step_time.optimizer_bytes, which the memory report reads too), activations
of the microbatches in flight (1F1B's first stage holds pp of them; model.py has the per-token formulas) plus,
under full recompute, the largest layer once, and the LLM head's fp32 logits on its last stage.
hetero/planner/meta_memory.py counts the same on the modules built on the meta device; the dry run prints both.
A layout that does not fit in HEADROOM of HBM, or fails HeteroLayout.validate, comes back with feasible=False
and the reason. Memory is priced before time: a layout that fits under none of predict's recompute options is not
timed (step_s inf), and the search skips, unpriced, candidates whose encoder-only block cannot fit
(remote_encoders_fit), most of them at scale.

This file prices modules (module_cost) and a layout (predict); how the placements combine module costs
into a step is in step_time.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from tessera.hetero.plan.layout import (LANGUAGE, HeteroLayout, LayoutError, ModelShapes, ModuleLayout,
                                       llm_sequence_parallel)
from tessera.hetero.plan.schedule_plan import colocated_per_microbatch
from tessera.hetero.planner import comm
from tessera.hetero.planner.cluster import Cluster, Constants, Workload
from tessera.hetero.planner.cp_cost import kernel_paths, llm_cp_activation, llm_cp_seconds
from tessera.hetero.planner.flops import llm_row_flops, sequence_flops, vit_sequence_flops
from tessera.hetero.planner.model import BF16, ModelDesc, ModuleDesc
from tessera.hetero.planner.straggler import busiest_rank_factor
from tessera.hetero.planner.step_time import (GIB, Memory, ModuleCost, ModuleMemory, Stage, StepParts,
                                              block_memory, colocated_encoders, encoder_costs, encoder_pipeline,
                                              expert_dp, homogeneous_step, optimizer_bytes, optimizer_params,
                                              rank_memory, remote_encoders)

HEADROOM = 0.9        # of HBM usable by tensors (the rest: allocator fragmentation, NCCL and CUDA buffers)
OPTIM_BYTES = 30      # HBM traffic per local parameter of one Adam step (read 16 B, write 14 B)


@dataclass
class Prediction:
    layout: str
    placement: str                      # homogeneous | colocated | non-colocated | mixed
    feasible: bool
    reason: str = ""
    step_s: float = math.inf
    breakdown: dict[str, float] = field(default_factory=dict)   # sums to step_s
    idle_s: dict[str, float] = field(default_factory=dict)      # per rank range: step time its GPUs wait
    memory_gib: dict[str, float] = field(default_factory=dict)  # per rank range "first-last"
    memory: dict[str, Memory] = field(default_factory=dict)       # per rank range, by kind (.describe())
    state_gib: dict[str, float] = field(default_factory=dict)   # per rank range: weights + optimizer (what a save writes)
    tflops_per_gpu: float = 0.0
    tokens_per_s: float = 0.0
    microbatches: int = 0
    micro_batch: int = 1                # sequences per LLM DP replica per microbatch
    global_batch: int = 0               # sequences per step as priced
    gain: float | None = None           # tokens/s over the best homogeneous layout, minus 1 (search sets it)
    baseline: bool = False              # priced as Megatron runs it, not as Tessera trains this string: never recommended
    recompute: tuple[str, ...] = ()
    gpus: int = 0
    modules: dict[str, ModuleCost] = field(default_factory=dict)  # each module as priced (memory per stage)
    in_flight: dict[str, int] = field(default_factory=dict)       # microbatches alive on its first stage
    kernels: str = ""                   # the LLM's CP path per layer kind at CP > 1 (cp_cost.kernel_paths)

    @property
    def max_memory_gib(self) -> float:
        return max(self.memory_gib.values(), default=0.0)


def items_of(mod: ModuleDesc, w: Workload) -> tuple[float, float, float, float]:
    """(items per sequence, tokens per item, LLM tokens per sequence, forward FLOPs per item: the mean of the
    sequence's items, hetero/planner/flops.py; the LLM's lm_head left to the last stage)."""
    if mod.kind == "llm":
        return 1.0, float(w.seq_length), float(w.seq_length), sequence_flops(mod, w.seq_length)
    if mod.key == "vision":  # images and video frames, priced by the family's numbers per tile / tubelet
        fused = mod.temporal_patch if (w.tubelets and mod.temporal_patch) else 1
        tubelets = math.ceil(w.frames / fused)
        items = w.tiles + tubelets
        patches = mod.tokens_per_tile - mod.prefix_tokens
        fwd = (w.tiles * vit_sequence_flops(mod, patches) + tubelets * vit_sequence_flops(mod, patches, fused))
        return items, float(mod.tokens_per_tile), items * mod.out_per_tile, fwd / items if items else 0.0
    clips = w.audio_seconds / w.audio_clip_seconds
    per_clip = mod.frames_per_second * w.audio_clip_seconds
    fwd = sequence_flops(mod, per_clip, mod.pre_flops_per_second * w.audio_clip_seconds)
    return clips, per_clip, clips * per_clip, fwd


def activation_bytes(mod: ModuleDesc, lay: ModuleLayout, tokens: float, ctx: float,
                     recompute: bool) -> tuple[float, float, float]:
    """Activation bytes on one rank of `lay` for `tokens` tokens of one microbatch (model.py's formulas):
    (kept per microbatch in flight, the largest layer while full recompute rebuilds it (once), the LLM's head
    on its last stage). Sequence parallelism (MoE LLM at TP > 1) splits the replicated part too."""
    tp, pp = lay.tp, lay.pp
    sp = tp if mod.kind == "llm" and llm_sequence_parallel(bool(mod.moe_layers), tp) else 1
    cp = lay.cp > 1 and mod.kind == "llm"
    cp_extra = llm_cp_activation(mod, lay, ctx) if cp else {}  # the zigzag kernels' scores and scan tensors
    layers_of = {"*": mod.attn_layers, "M": mod.mamba_layers}
    per_layer_cp = {ch: b / max(1, layers_of[ch]) for ch, b in cp_extra.items()}
    # vision CP (models/vision_cp.py): each layer keeps the K/V it gathered from the cp ranks for its backward
    gathered = lay.cp * mod.kv_width * BF16 / tp if lay.cp > 1 and mod.cp_split == "tokens" else 0.0
    if recompute:
        per_mb = tokens * (mod.act_bytes_recompute / sp) / pp
        peak = tokens * max(r / sp + (a + (per_layer_cp.get(ch, 0.0) if cp else 0.0)) / tp + u
                            for ch, r, a, u in mod.act_peak)
        peak += tokens * (mod.act_ctx * ctx / tp / mod.layers + gathered)
    else:
        extra = sum(cp_extra.values())
        per_mb = tokens * (mod.act_replicated / sp + (mod.act_bytes + mod.act_ctx * ctx + extra) / tp
                           + mod.act_unsplit + gathered * mod.layers) / pp
        peak = 0.0
    if mod.kind == "llm":
        return per_mb, peak, tokens * (mod.act_edge / sp + mod.logits_bytes / tp)
    return per_mb + tokens * mod.act_edge, peak, 0.0


def module_cost(mod: ModuleDesc, lay: ModuleLayout, samples: int, w: Workload, cl: Cluster,
                k: Constants, recompute: bool, in_flight: int, grad_group: int | None = None) -> ModuleCost:
    """One module in layout `lay`, fed `samples` sequences per microbatch (global); `in_flight`
    microbatches' activations are alive at once on its first stage. An encoder computes at its busiest DP rank's
    pace (straggler.py)."""
    tp, cp, pp, dp = lay.tp, lay.cp, lay.pp, lay.dp_size
    items, toks, out_toks, fwd_item = items_of(mod, w)
    per_dp = samples / dp
    tokens, ctx = rank_tokens(mod, lay, samples, w)
    if mod.kind == "llm":       # one sequence per item, the sequence split over CP (zigzag)
        fwd_body = per_dp * fwd_item / (tp * cp * pp)
    else:                        # encoder CP splits a sequence's media tokens (hetero/plan/encoder_cp.py)
        rank_items = per_dp * items / cp
        # the busiest DP rank sets the encoder's pace: the expected maximum over DP ranks for the media mix, with or
        # without items dealt by cost (straggler.py), not the mean
        busiest = busiest_rank_factor(dp, per_dp, per_dp * items, w.spread(mod.key), w.balance_encoders)
        fwd_body = rank_items * fwd_item / (tp * pp) * busiest
    mult = 4 if recompute else 3
    speed = cl.peak_tflops * 1e12 * k.eff(mod.kind)
    msg = tokens * mod.hidden * BF16
    tp_s = (mod.tp_collectives / pp) * (3 if recompute else 2) * comm.all_reduce(
        msg, tp, comm.group_link(cl, tp, 1), cl, k)
    cp_s = 0.0
    if cp > 1 and mod.kind == "llm":  # each layer kind on the path the trainer takes (cp_cost.py)
        seq_flops = {"*": per_dp * toks * mod.attn_flops * ctx, "M": per_dp * toks * mod.scan_flops}
        cp_s = llm_cp_seconds(mod, lay, tokens, per_dp, lambda ch: seq_flops[ch] / (tp * cp * pp), cl, k, recompute)
    elif cp > 1 and mod.cp_split == "tokens":
        # vision CP: every layer all-gathers its tiles' K/V over the CP group (again when recompute reruns the
        # forward) and all-reduces their gradient in backward; not overlapped with compute
        kv = tokens * cp * mod.kv_width * BF16 / tp
        link = comm.group_link(cl, cp, tp)
        per_layer = (2 if recompute else 1) * comm.reduce_scatter(kv, cp, link, cl, k) + comm.all_reduce(
            kv, cp, link, cl, k)
        cp_s = (mod.layers / pp) * per_layer
    elif cp > 1:
        # item-parallel CP (audio): whole clips per rank; their outputs all-gathered, the gradient all-reduced
        out = per_dp * out_toks * mod.out_hidden * BF16  # every output of the DP rank's rows
        link = comm.group_link(cl, cp, tp)
        cp_s = comm.reduce_scatter(out, cp, link, cl, k) + comm.all_reduce(out, cp, link, cl, k)
    ep_s = 0.0
    if mod.moe_layers and lay.ep > 1:
        ep_s = (mod.moe_layers / pp) * 4 * comm.all_to_all(
            tokens / tp * mod.topk * mod.hidden * BF16, lay.ep, comm.group_link(cl, lay.ep, tp), k)
    pp_s = 2 * comm.p2p(msg / tp, comm.group_link(cl, pp, tp * cp * dp), k) if pp > 1 else 0.0
    # recompute's extra forward runs inside the backward pass, so the forward share is 1/mult either way;
    # every layer call costs layer_overhead_s of software time per microbatch on top of its FLOPs
    overhead = (mod.layers / pp) * mult * k.layer_overhead_s
    body = Stage(fwd_body * mult / speed + overhead, tp_s, cp_s, ep_s, pp_s, 1 / mult)
    head = Stage(per_dp * toks * mod.head_flops / (tp * cp) * 3 / speed) if mod.head_flops else Stage()
    stages = tuple(body + head if i == pp - 1 else body for i in range(pp))

    dense, edge_first, experts = _local_params(mod, lay)
    dp_ranks = grad_group or dp * cp
    mem = module_memory(mod, lay, samples, w, recompute, in_flight, grad_group)
    dp_link = comm.group_link(cl, dp_ranks, tp)
    dp_s = 2 * comm.reduce_scatter((dense + edge_first) * BF16, dp_ranks, dp_link, cl, k)
    if experts:
        dp_s += 2 * comm.reduce_scatter(experts * BF16, expert_dp(lay), dp_link, cl, k)
    optim_s = OPTIM_BYTES * optimizer_params(dense + edge_first, experts, lay, dp_ranks) / (cl.hbm_tbps * 1e12)
    flops = 3 * samples * (llm_row_flops(mod, toks) if mod.kind == "llm" else items * fwd_item)
    return ModuleCost(mod.key, stages, dp_s, optim_s, mem.mem_first, mem.mem_last, flops)


def rank_tokens(mod: ModuleDesc, lay: ModuleLayout, samples: int, w: Workload) -> tuple[float, float]:
    """(tokens one rank of `lay` holds per microbatch of `samples` sequences, its attention context): the LLM's
    sequence split over CP (zigzag); an encoder's items split over its DP ranks and its media tokens over CP."""
    items, toks, _, _ = items_of(mod, w)
    per_dp = samples / lay.dp_size
    return (per_dp * toks / lay.cp if mod.kind == "llm" else per_dp * items / lay.cp * toks), toks


def _local_params(mod: ModuleDesc, lay: ModuleLayout) -> tuple[float, float, float]:
    """(dense, edge on the first stage, routed expert) parameters on one rank: edge parameters (embedding,
    lm_head) sit on the first and last stage; replicated parameters (norms, routers, encoder embeddings and
    projectors) are whole on every TP rank."""
    tp, pp = lay.tp, lay.pp
    experts = mod.expert_params / (tp * lay.ep * pp)
    dense = ((mod.params - mod.edge_params - mod.expert_params - mod.replicated_params) / tp
             + mod.replicated_params) / pp
    return dense, mod.edge_params / tp if pp == 1 else mod.edge_params / 2 / tp, experts


def module_memory(mod: ModuleDesc, lay: ModuleLayout, samples: int, w: Workload, recompute: bool,
                  in_flight: int, grad_group: int | None = None) -> ModuleMemory:
    """module_cost's memory alone (its first and last PP stage), without the time: what decides whether a
    layout can fit."""
    tokens, ctx = rank_tokens(mod, lay, samples, w)
    dense, edge_first, experts = _local_params(mod, lay)
    dp_ranks = grad_group or lay.dp_size * lay.cp
    local = dense + edge_first + experts
    weights = Memory(BF16 * local, 4 * local, optimizer_bytes(dense + edge_first, experts, lay, dp_ranks=dp_ranks))
    act_per_mb, act_peak, act_last = activation_bytes(mod, lay, tokens, ctx, recompute)
    mem_first = weights + Memory(act=act_per_mb * in_flight + act_peak + (act_last if lay.pp == 1 else 0.0))
    mem_last = mem_first if lay.pp == 1 else weights + Memory(act=act_per_mb + act_peak + act_last)
    return ModuleMemory(mem_first, mem_last)


@functools.lru_cache(maxsize=4096)  # the search asks for the same few hundred shapes ~10^5 times
def _sizes(lay: ModuleLayout) -> ModuleLayout:
    """The layout's sizes at rank 0: module costs do not depend on where the ranks are."""
    return ModuleLayout(0, lay.size - 1, tp=lay.tp, cp=lay.cp, pp=lay.pp, dp=lay.dp_size, ep=lay.ep)


_module_cost = functools.lru_cache(maxsize=65536)(module_cost)  # the search prices each module shape once
_module_memory = functools.lru_cache(maxsize=65536)(module_memory)  # the search's fit check, before any time
# ... and each boundary once (the three recompute options of a layout, and its other placements, share them)
_boundary_rows = functools.lru_cache(maxsize=65536)(comm.boundary_rows)


def _check(layout: HeteroLayout, model: ModelDesc, w: Workload, gpus: int, samples: int) -> None:
    """Raise LayoutError for what the layout's own validate() and the model/workload rule out."""
    heads = {mod.key: mod.tp_divides[0] for mod in model.modules}
    kv = {LANGUAGE: model[LANGUAGE].tp_divides[1]}
    if set(layout.modules) != set(model.keys):
        raise LayoutError(f"layout modules {sorted(layout.modules)} != model modules {sorted(model.keys)}")
    layout.validate(ModelShapes(heads=heads, kv_heads=kv, seq_length=w.seq_length,
                                samples_per_microbatch=samples), world_size=gpus)
    for mod in model.modules:
        lay = layout[mod.key]
        for n in mod.tp_divides[2:]:
            if n % lay.tp:
                raise LayoutError(f"module '{mod.key}': tp={lay.tp} does not divide its {n} Mamba groups/heads")
        if lay.pp > mod.layers:
            raise LayoutError(f"module '{mod.key}': pp={lay.pp} exceeds its {mod.layers} layers")
    if w.global_batch % samples:
        raise LayoutError(f"global batch {w.global_batch} is not a multiple of the {samples} sequences per "
                          f"microbatch (micro_batch {w.micro_batch} x language dp {layout[LANGUAGE].dp_size})")
    media = sum(items_of(mod, w)[2] for mod in model.encoders)
    if media > w.seq_length:
        raise LayoutError(f"{media:.0f} media tokens per sequence exceed seq_length {w.seq_length}")


def same_shape(layout: HeteroLayout) -> bool:
    """Every module on the same ranks with the same TP, CP, PP and DP (EP only exists for MoE layers, so it
    does not make a layout heterogeneous): the layouts Megatron's homogeneous baseline can price."""
    shape = lambda m: (m.first, m.last, m.tp, m.cp, m.pp, m.dp_size)  # noqa: E731
    return len({shape(m) for m in layout.modules.values()}) == 1


def placement(layout: HeteroLayout, baseline: bool = False) -> str:
    """'homogeneous' for an LLM alone or Megatron's baseline (baseline=True, every module the LLM's shape),
    else layout.placement: how Tessera's trainer runs the layout."""
    if len(layout.modules) == 1:
        return "homogeneous"
    if baseline:
        if not same_shape(layout):
            raise ValueError(f"baseline=True prices Megatron's homogeneous baseline: every module of {layout} "
                             f"needs the LLM's ranks, TP, CP, PP and DP")
        return "homogeneous"
    return layout.placement


def _boundary(src: ModuleLayout, dst: ModuleLayout, enc: ModuleDesc, w: Workload, samples: int,
              cl: Cluster, k: Constants) -> tuple[float, float]:
    """Forward and backward boundary time per microbatch (busiest rank)."""
    _, _, media, _ = items_of(enc, w)
    rows = _boundary_rows(src, dst, samples, media)
    disjoint = src.last < dst.first or dst.last < src.first
    lk = comm.link(cl, disjoint or dst.size > cl.gpus_per_node)
    row = enc.out_hidden * BF16
    fwd = comm.p2p(max(rows.fwd_recv_max, rows.fwd_send_max) * row, lk, k, rows.messages)
    bwd = comm.p2p(max(rows.bwd_recv_max, rows.bwd_send_max) * row, lk, k, rows.messages)
    return fwd, bwd


def predict(layout: HeteroLayout | str, model: ModelDesc, w: Workload, cl: Cluster,
            k: Constants = Constants(), recompute: tuple[str, ...] | None = None,
            baseline: bool = False) -> Prediction:
    """Price one layout as Tessera's trainer runs it, or (baseline=True, every module the LLM's shape) as
    Megatron's homogeneous baseline runs it. recompute=None tries no recompute, then encoders, then every
    module, and keeps the first that fits in memory."""
    layout = HeteroLayout.parse(layout) if isinstance(layout, str) else layout
    if recompute is None:
        return _least_recompute(layout, model, w, cl, k, baseline)
    return _price(layout, model, w, cl, k, recompute, baseline, check=True)


def _price(layout: HeteroLayout, model: ModelDesc, w: Workload, cl: Cluster, k: Constants,
           recompute: tuple[str, ...], baseline: bool, check: bool, time_unfit: bool = True) -> Prediction:
    """predict() for one recompute option; check=False: the caller has run _check on this layout and workload.
    Memory is priced first; time_unfit=False returns a layout that does not fit with its memory and reason only
    (step_s inf, no throughput): the search's 9 in 10 candidates that cannot fit are not timed."""
    out = Prediction(str(layout), placement(layout, baseline), False, gpus=layout.world_size, recompute=recompute,
                     micro_batch=w.micro_batch, global_batch=w.global_batch,
                     baseline=baseline and len(layout.modules) > 1)
    lang = layout[LANGUAGE]
    samples = w.micro_batch * lang.dp_size
    out.kernels = kernel_paths(model[LANGUAGE], _sizes(lang))
    try:
        if check:
            _check(layout, model, w, out.gpus, samples)
    except LayoutError as e:
        out.reason = str(e)
        return out
    m = out.microbatches = w.global_batch // samples

    def price(key, lay, flight, group=None):
        out.modules[key], out.in_flight[key] = _module_cost(
            model[key], _sizes(lay), samples, w, cl, k, key in recompute, flight, group), flight
        return out.modules[key]

    homogeneous = out.placement == "homogeneous"
    coloc, remote = _placed(layout, model, homogeneous)
    llm = price(LANGUAGE, lang, min(lang.pp, m))
    costs = encoder_costs(homogeneous, lang, coloc, remote, m, price,
                          not homogeneous and colocated_per_microbatch(layout))
    mem = rank_memory(homogeneous, llm, lang, costs, remote)
    fits = _memory(out, mem, cl)
    if not fits and not time_unfit:
        return out
    acc = StepParts.start(llm, lang, m, mem)
    if homogeneous:
        core = homogeneous_step(acc, llm, costs, m)
    else:
        boundary = lambda key, lay: _boundary(lay, lang, model[key], w, samples, cl, k)  # noqa: E731
        phase1, phase3 = colocated_encoders(acc, coloc, costs, m, boundary)
        enc_side, bound = remote_encoders(acc, remote, costs, m, boundary)
        core = encoder_pipeline(acc, llm, enc_side, bound, m, phase1, phase3)
    _finish(out, acc, core, llm, layout, w)
    out.feasible = fits
    return out


def _placed(layout: HeteroLayout, model: ModelDesc, homogeneous: bool) -> tuple[dict, dict]:
    """({encoder: layout} on the LLM's ranks, {encoder: layout} on ranks of their own); Megatron's baseline puts
    every encoder on the LLM's ranks."""
    coloc = {e.key: layout[e.key] for e in model.encoders if homogeneous or layout.colocated(e.key, LANGUAGE)}
    return coloc, {e.key: layout[e.key] for e in model.encoders if e.key not in coloc}


def _least_recompute(layout: HeteroLayout, model: ModelDesc, w: Workload, cl: Cluster, k: Constants,
                     baseline: bool) -> Prediction:
    """The first of no recompute, encoders only, every module that fits (or fails for a reason other than memory);
    timed only if it fits: a layout that fits under none comes back with the last option's memory and reason.

    An option whose LLM alone exceeds the usable memory is passed over unpriced: its rank range holds the LLM
    plus, at most, colocated encoders (never less). A layout that fails its checks is priced at the first option
    as before (the failure does not depend on the option)."""
    options = [(), tuple(model.keys[:-1]), tuple(model.keys)]
    lang = layout[LANGUAGE]
    samples = w.micro_batch * lang.dp_size
    try:
        _check(layout, model, w, layout.world_size, samples)
    except LayoutError:
        return _price(layout, model, w, cl, k, options[0], baseline, check=True)
    limit = cl.hbm_gib * HEADROOM
    for i, opt in enumerate(options):
        if i < len(options) - 1:
            llm = _module_cost(model[LANGUAGE], _sizes(lang), samples, w, cl, k, LANGUAGE in opt,
                               min(lang.pp, w.global_batch // samples), None)
            if llm.memory.total / GIB > limit:
                continue
        p = _price(layout, model, w, cl, k, opt, baseline, check=False, time_unfit=False)
        if p.feasible or not p.reason.startswith("memory"):
            return p
    return p


def remote_encoders_fit(layout: HeteroLayout, model: ModelDesc, w: Workload, cl: Cluster) -> bool:
    """False when a block of ranks that holds only encoders exceeds the usable memory under both of predict's
    encoder choices (recompute off, on): the layout cannot fit whatever recompute predict picks, so the search
    skips it unpriced (most of its candidates at scale: an encoder on too few ranks for the global batch).
    True for a layout without such a block, or whose batch does not split (predict says why)."""
    lang = layout[LANGUAGE]
    samples = w.micro_batch * lang.dp_size
    _, remote = _placed(layout, model, homogeneous=False)  # the search never fits Megatron's baseline this way
    if not remote or samples <= 0 or w.global_batch % samples:
        return True
    m, limit = w.global_batch // samples, cl.hbm_gib * HEADROOM * GIB
    for recompute in (True, False):  # recompute on first: what fits mostly fits with it
        def price(key, lay, flight, group=None):
            return _module_memory(model[key], _sizes(lay), samples, w, recompute, flight, group)
        costs = encoder_costs(False, lang, {}, remote, m, price, False)
        if all(mm.total <= limit for mm in block_memory(costs, remote).values()):
            return True
    return False


def _memory(out: Prediction, mem: dict[str, Memory], cl: Cluster) -> bool:
    """Memory per rank range into `out`; whether the fullest rank range fits in HEADROOM of HBM (if not, the
    reason says which range needs what)."""
    out.memory_gib = {r: mm.total / GIB for r, mm in mem.items()}
    out.memory = mem
    out.state_gib = {r: (mm.weights + mm.optim) / GIB for r, mm in mem.items()}
    limit = cl.hbm_gib * HEADROOM
    worst = max(mem, key=lambda r: mem[r].total)
    if mem[worst].total / GIB > limit:
        out.reason = (f"memory: ranks {worst} need {mem[worst].describe()} > {limit:.1f} GiB usable "
                      f"({cl.hbm_gib} GiB x {HEADROOM})")
        return False
    return True


def _finish(out: Prediction, acc: StepParts, core: float, llm: ModuleCost, layout: HeteroLayout,
            w: Workload) -> None:
    """Step time (the pipeline's core, plus the worst rank range's exposed DP and optimizer), idle time per rank
    range and throughput."""
    parts = acc.parts
    parts["dp"] = max(acc.dp_exposed.values())
    parts["optimizer"] = max(acc.optim.values())
    out.step_s = core + parts["dp"] + parts["optimizer"]
    out.breakdown = parts
    ranges = {key: f"{layout[key].first}-{layout[key].last}" for key in acc.busy}
    out.idle_s = {r: max(0.0, out.step_s - sum(b for key, b in acc.busy.items() if ranges[key] == r))
                  for r in set(ranges.values())}
    out.tflops_per_gpu = (acc.flops + out.microbatches * llm.model_flops) / out.step_s / out.gpus / 1e12
    out.tokens_per_s = w.global_batch * w.seq_length / out.step_s
