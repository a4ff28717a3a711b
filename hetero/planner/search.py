"""Search layouts for a GPU count, rank them by predicted throughput, compare with the best homogeneous one.

    from tessera.hetero.planner import plan_layouts, format_table, describe_model, Workload, cluster
    preds = plan_layouts(describe_model("nemotron_nano_12b_v2", "radio_vit_h"), Workload(tiles=16), cluster("h100"), 64)
    print(format_table(preds))

Candidates (pruned to what can run well):
    LLM       tp a power of two within one node that divides its attention/KV heads and Mamba groups/heads;
              cp a power of two up to 16 leaving >= 4096 tokens per rank (zigzag needs seq % 2cp == 0);
              pp a power of two up to 8; dp what is left; ep (MoE): per LLM shape, the power of two dividing
              cp*dp with the fastest LLM-only step whose memory fits (recompute assumed when scoring).
    encoder   tp a power of two within a node dividing its heads; cp 1 or 2 (splits each sequence's media
              tokens: hetero/plan/encoder_cp.py); pp 1 when colocated, 1 or 2 when on its own ranks; and
              the LLM's own layout (the homogeneous string as Tessera trains it: encoders split like the LLM).
    placements  homogeneous (all modules the LLM's layout priced as Megatron runs it: the baseline gains are
              measured against, never recommended; the same string as Tessera trains it is a colocated
              candidate), colocated (every encoder on
              all GPUs with its own layout), non-colocated / mixed (each encoder colocated or on its own
              first block of ranks; block sizes 1/32 .. 1/2 of the GPUs and powers of two; with several encoders,
              powers of two up to 1/4 each).
Encoders are chosen one at a time for each LLM layout and placement (their costs add up, so coordinate-wise
choice loses little and keeps the search linear in the number of encoder options). The LLM's micro batch
is raised from the workload's until every encoder's DP divides the samples of one microbatch, and the global
batch is rounded to a whole number of microbatches (Prediction.global_batch says what was priced).
"""

from __future__ import annotations

import dataclasses
from itertools import product

from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout, LayoutError, ModuleLayout, rows_for_layout, rows_multiple
from tessera.hetero.plan.zigzag import zigzag_multiple
from tessera.hetero.planner.cluster import Cluster, Constants, Workload
from tessera.hetero.planner.cost import GIB, HEADROOM, Prediction, module_cost, predict, remote_encoders_fit
from tessera.hetero.planner.model import ModelDesc, ModuleDesc

MAX_CP, MAX_PP, MAX_EP, MIN_TOKENS_PER_CP_RANK = 16, 8, 64, 4096
SPLITS = (1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 5 / 16, 3 / 8, 1 / 2)


def _pow2(upto: int) -> list[int]:
    return [1 << i for i in range(max(0, upto).bit_length()) if 1 << i <= upto]


def llm_options(mod: ModuleDesc, gpus: int, w: Workload, cl: Cluster) -> list[dict]:
    out = []
    for tp, cp, pp in product(_pow2(min(cl.gpus_per_node, gpus)), _pow2(MAX_CP), _pow2(min(MAX_PP, mod.layers))):
        if any(n % tp for n in mod.tp_divides) or gpus % (tp * cp * pp):
            continue
        if cp > 1 and (w.seq_length % zigzag_multiple(cp) or w.seq_length // cp < MIN_TOKENS_PER_CP_RANK):
            continue
        dp = gpus // (tp * cp * pp)
        out.append(dict(tp=tp, cp=cp, pp=pp, dp=dp, ep=_best_ep(mod, tp, cp, pp, dp, w, cl)))
    return out


def _best_ep(mod: ModuleDesc, tp: int, cp: int, pp: int, dp: int, w: Workload, cl: Cluster) -> int:
    """MoE: the expert parallel size with the fastest LLM step among those whose LLM memory fits (EP only
    changes the LLM's expert sharding and all-to-alls, so it is chosen once per LLM shape, not per layout)."""
    if not mod.expert_params:
        return 1
    samples = w.micro_batch * dp
    m = max(1, round(w.global_batch / samples))
    scored = []
    for ep in (e for e in _pow2(min(MAX_EP, cp * dp)) if (cp * dp) % e == 0):
        lay = ModuleLayout(0, tp * cp * pp * dp - 1, tp=tp, cp=cp, pp=pp, dp=dp, ep=ep)
        c = module_cost(mod, lay, samples, w, cl, Constants(), True, min(pp, m))
        fits = c.memory.total / GIB <= cl.hbm_gib * HEADROOM
        scored.append((not fits, m * c.slowest.total + c.dp_s, ep))
    return min(scored)[2]


def encoder_options(mod: ModuleDesc, gpus: int, cl: Cluster, colocated: bool) -> list[dict]:
    out = []
    for tp, cp, pp in product(_pow2(min(cl.gpus_per_node, gpus)), (1, 2), (1,) if colocated else (1, 2)):
        if mod.tp_divides[0] % tp or gpus % (tp * cp * pp) or pp > mod.layers:
            continue
        out.append(dict(tp=tp, cp=cp, pp=pp, dp=gpus // (tp * cp * pp)))
    return out


def _module(first: int, size: int, sizes: dict) -> ModuleLayout:
    return ModuleLayout(first, first + size - 1, **sizes)


def _micro_batch(layout: HeteroLayout, w: Workload) -> Workload:
    """A run's workload (rows_per_microbatch set): the rows per microbatch the trainer runs in this layout
    (rows_for_layout, the one rule), the step unchanged. Otherwise, or where the trainer refuses the run's step in
    this layout (the plan table marks it untrainable): the smallest micro batch >= w's that lets every encoder's DP
    take an equal share (fan-in/out), and the global batch rounded to the nearest multiple of one microbatch's
    samples (DP sizes that are not powers of two, as disjoint rank blocks give, would otherwise never divide it)."""
    dp = layout[LANGUAGE].dp_size
    if w.rows_per_microbatch:
        try:
            rows, _ = rows_for_layout(layout, w.rows_per_microbatch, w.global_batch // w.rows_per_microbatch)
            return dataclasses.replace(w, micro_batch=rows // dp)
        except LayoutError:
            pass
    need = rows_multiple(layout)
    mb = w.micro_batch
    while (mb * dp) % need and mb < w.global_batch:
        mb *= 2
    samples = mb * dp
    gb = max(samples, round(w.global_batch / samples) * samples)
    return dataclasses.replace(w, micro_batch=mb, global_batch=gb)


def price_layout(layout: HeteroLayout, model: ModelDesc, w: Workload, cl: Cluster,
                 k: Constants = Constants(), baseline: bool = False) -> Prediction:
    """One layout as the search prices it: the micro batch grown until every module's DP takes an equal share."""
    return predict(layout, model, _micro_batch(layout, w), cl, k, baseline=baseline)


def _price_if_fits(layout: HeteroLayout, model: ModelDesc, w: Workload, cl: Cluster, k: Constants) -> Prediction | None:
    """price_layout, or None for a layout one of whose encoder-only blocks cannot fit under any recompute."""
    wl = _micro_batch(layout, w)
    return predict(layout, model, wl, cl, k) if remote_encoders_fit(layout, model, wl, cl) else None


def _split_sizes(gpus: int) -> list[int]:
    sizes = {round(gpus * f) for f in SPLITS if (gpus * f).is_integer()} | set(_pow2(gpus // 2))
    return sorted(s for s in sizes if 1 <= s < gpus)


def _best(preds: list[Prediction]) -> Prediction | None:
    ok = [p for p in preds if p.feasible]
    return max(ok, key=lambda p: p.tokens_per_s) if ok else None


def search(model: ModelDesc, w: Workload, cl: Cluster, gpus: int, k: Constants = Constants()) -> list[Prediction]:
    """Every candidate's prediction (feasible or not), best first."""
    llm = model[LANGUAGE]
    encs = model.encoders
    preds: list[Prediction] = []
    for opt in llm_options(llm, gpus, w, cl):  # every module the LLM's layout: Megatron's baseline, and as we train it
        mods = {e.key: _module(0, gpus, {**opt, "ep": 1}) for e in encs}
        same = HeteroLayout({**mods, LANGUAGE: _module(0, gpus, opt)})
        preds += [price_layout(same, model, w, cl, k, baseline=True)] + ([price_layout(same, model, w, cl, k)]
                                                                          if encs else [])
    # each encoder colocated (size 0: on the LLM's ranks) or on its own block of ranks
    # several encoders: fewer block sizes each (their product is searched)
    blocks = [0] + (_split_sizes(gpus) if len(encs) == 1 else
                    sorted({s for s in _split_sizes(gpus) if s <= gpus // 4 and (s & (s - 1)) == 0}))
    for sizes in product(blocks, repeat=len(encs)):
        llm_gpus = gpus - sum(sizes)
        if llm_gpus < max(1, gpus // 2):
            continue
        for opt in llm_options(llm, llm_gpus, w, cl):
            first, chosen = 0, {}
            for enc, size in zip(encs, sizes):
                chosen[enc.key] = (first, size)
                first += size
            lang = _module(first, llm_gpus, opt)
            # start every encoder at its first option, then improve one encoder at a time
            pick = {e.key: encoder_options(e, s or llm_gpus, cl, s == 0) for e, s in zip(encs, sizes)}
            if not all(pick.values()):
                continue
            current = {key: opts[0] for key, opts in pick.items()}

            def layout_with(cur):
                mods = {key: (_module(chosen[key][0], chosen[key][1], o) if chosen[key][1]
                              else _module(lang.first, lang.size, o)) for key, o in cur.items()}
                return HeteroLayout({**mods, LANGUAGE: lang})

            for key, opts in pick.items():
                tries = [(i, _price_if_fits(layout_with({**current, key: o}), model, w, cl, k))
                         for i, o in enumerate(opts)]
                tries = [(i, p) for i, p in tries if p is not None]
                preds.extend(p for _, p in tries)
                ok = [(p.tokens_per_s, i) for i, p in tries if p.feasible]
                if ok:
                    current[key] = opts[max(ok)[1]]
    unique = {}
    for p in preds:  # a string twice: Megatron's baseline and the same string as Tessera trains it
        key = (p.layout, p.baseline)
        if key not in unique or (p.feasible and p.tokens_per_s > unique[key].tokens_per_s):
            unique[key] = p
    ranked = sorted(unique.values(), key=lambda p: (not p.feasible, -p.tokens_per_s))
    base = _best([p for p in ranked if p.placement == "homogeneous"])
    for p in ranked:
        if p.feasible and base is not None:
            p.gain = p.tokens_per_s / base.tokens_per_s - 1
    return ranked


def plan_layouts(model_desc: ModelDesc, workload: Workload, cluster: Cluster, gpus: int, top: int = 10,
                 constants: Constants = Constants()) -> list[Prediction]:
    """The `top` best feasible layouts as Tessera trains them, best first, plus the best homogeneous one
    (Megatron's baseline) when it is not among them (last), each with .gain over that baseline."""
    ranked = [p for p in search(model_desc, workload, cluster, gpus, constants) if p.feasible]
    head = [p for p in ranked if not p.baseline][:top]
    base = _best([p for p in ranked if p.placement == "homogeneous"])
    if base is not None and base not in head:
        head.append(base)
    return head


def best_layout(model_desc: ModelDesc, workload: Workload, cluster: Cluster, gpus: int) -> str:
    """The best predicted layout as a hetero/plan/layout.py string (for `layout=auto`)."""
    preds = [p for p in plan_layouts(model_desc, workload, cluster, gpus, top=1) if not p.baseline]
    if not preds:
        raise ValueError(f"no feasible layout for {model_desc.name} on {gpus} GPUs of {cluster.name}; "
                         f"lower the micro batch or the sequence length, or add GPUs")
    return preds[0].layout


# what each column is: the table is read by people choosing a layout, who then pass its last column as layout=
LEGEND = ("columns: tok/s and TFLOPS per GPU predicted; gain over the homogeneous* row; step s = compute + comm "
          "(TP, CP, EP, PP and DP collectives left exposed) + bubble (pipeline fill and drain) + bound (the "
          "encoder-to-LLM boundary's sends); idle: the seconds of a step the most idle rank range waits; GiB: peak "
          "memory per GPU; mb: sequences per LLM data-parallel replica per microbatch; recompute: modules with full "
          "activation recompute. Train a row with layout=\"<its layout column>\".")


def format_table(preds: list[Prediction], top: int | None = None) -> str:
    """A fixed-width table: rank, placement, throughput, gain, step breakdown, memory, layout; a baseline row
    (placement `homogeneous*`) is footnoted."""
    head = (f"{'#':>2} {'placement':<13} {'tok/s':>9} {'TFLOPS':>6} {'gain':>7} {'step s':>7} {'compute':>7} "
            f"{'comm':>6} {'bubble':>6} {'bound':>6} {'idle':>6} {'GiB':>5} {'mb':>2} {'recompute':<10} layout")
    rows = [head, "-" * len(head)]
    for i, p in enumerate(preds[:top] if top else preds, 1):
        b = p.breakdown
        comm_s = b["tp"] + b["cp"] + b["ep"] + b["pp"] + b["dp"]
        gain = f"{100 * p.gain:+.1f}%" if p.gain is not None else "-"
        idle = max(p.idle_s.values(), default=0.0)
        place = p.placement + ("*" if p.baseline else "")
        rows.append(f"{i:>2} {place:<13} {p.tokens_per_s:>9.0f} {p.tflops_per_gpu:>6.0f} {gain:>7} "
                    f"{p.step_s:>7.2f} {b['compute']:>7.2f} {comm_s:>6.2f} {b['bubble']:>6.2f} "
                    f"{b['boundary']:>6.3f} {idle:>6.2f} {p.max_memory_gib:>5.1f} {p.micro_batch:>2} "
                    f"{','.join(p.recompute) or '-':<10} {p.layout}")
    shown = preds[:top] if top else preds
    rows += [f"{i:>2} LLM context parallelism: {p.kernels}" for i, p in enumerate(shown, 1) if p.kernels]
    rows.append(LEGEND)
    if any(p.baseline for p in (preds[:top] if top else preds)):
        rows.append("* Megatron's baseline, the gains' reference: encoders unsplit on the LLM's first pipeline stage, "
                    "replicated over its CP ranks. Tessera trains this string as colocated (encoders split like the LLM).")
    return "\n".join(rows)
