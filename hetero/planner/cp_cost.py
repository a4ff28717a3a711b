"""The LLM's context parallelism priced as the trainer runs it: per layer kind the path of hetero/plan/cp_path.py.

    head-parallel  one all-to-all per tensor each way (megatron's MambaContextParallel moves z, x, B, C, dt in
                   and y out; attention moves q, k, v in and the output out), forward and backward (forward
                   again under full recompute), not overlapped with compute; the kernels are the CP = 1 ones
                   (fused on a GPU), so compute is priced at the module's efficiency and memory as at CP = 1.
    zigzag         attention all-gathers K/V (again under recompute) and all-reduces its gradient; Mamba
                   all-gathers every chunk's final state; both run torch ops (unfused masked attention, the
                   torch SSD scan), so their FLOPs run at eff_torch_attention / eff_torch_scan (measured) instead of the module's efficiency, and
                   they keep the scores / intra-chunk tensors (ModuleDesc.cp_ctx, cp_act).
A mixed model (one kind head-parallel, the other zigzag) prices each kind by its own path.
"""

from __future__ import annotations

from tessera.hetero.plan.cp_path import CPPath, attention_path, mamba_path, replicas
from tessera.hetero.plan.layout import ModuleLayout
from tessera.hetero.planner import comm
from tessera.hetero.planner.cluster import Cluster, Constants
from tessera.hetero.planner.model import BF16, ModuleDesc


def llm_cp_paths(mod: ModuleDesc, lay: ModuleLayout) -> tuple[CPPath, CPPath]:
    """(attention, Mamba) CP path of the LLM in `lay`."""
    q, kv, heads, groups = mod.cp_heads
    return attention_path(q, kv, lay.tp, lay.cp), mamba_path(heads, groups, lay.tp, lay.cp)


def kernel_paths(mod: ModuleDesc, lay: ModuleLayout) -> str:
    """What the plan table shows per LLM at CP > 1, e.g. 'attention head-parallel, mamba zigzag (...)'."""
    if mod.kind != "llm" or lay.cp == 1:
        return ""
    return ", ".join(f"{name} {p.path}" + (f" ({p.reason})" if p.reason else "")
                     for name, p in zip(("attention", "mamba"), llm_cp_paths(mod, lay)))


def llm_cp_activation(mod: ModuleDesc, lay: ModuleLayout, ctx: float) -> dict[str, float]:
    """Extra activation bytes per local token (TP-sharded, all layers of each kind) of the zigzag kernels."""
    attention, mamba = llm_cp_paths(mod, lay)
    return {"*": 0.0 if attention.head_parallel else mod.cp_ctx * ctx,
            "M": 0.0 if mamba.head_parallel else mod.cp_act}


def llm_cp_seconds(mod: ModuleDesc, lay: ModuleLayout, tokens: float, sequences: float, seq_flops, cl: Cluster,
                   k: Constants, recompute: bool) -> float:
    """Exposed CP seconds of one pipeline stage per microbatch: communication plus, on the zigzag path, the
    torch kernels' extra time. tokens / sequences: this rank's tokens and the sequences they belong to;
    seq_flops(kind): forward FLOPs of that kind's sequence kernels on this rank and stage ("*": attention
    core, "M": Mamba conv + scan)."""
    tp, cp, pp = lay.tp, lay.cp, lay.pp
    link = comm.group_link(cl, cp, tp)
    passes = 3 if recompute else 2
    mult = 4 if recompute else 3
    fused = cl.peak_tflops * 1e12 * k.eff(mod.kind)
    # seconds per FLOP the torch kernels add over the fused ones (the fused scan is priced at the module's
    # efficiency, as at CP 1, though it runs nearer 0.03 of peak: the penalty is ~10% high for Mamba)
    slower = {ch: max(0.0, 1 / (cl.peak_tflops * 1e12 * eff) - 1 / fused)
              for ch, eff in (("*", k.eff_torch_attention), ("M", k.eff_torch_scan))}
    q, kv, heads, groups = mod.cp_heads
    hd, (head_dim, state) = mod.head_dim, mod.mamba_dims
    attention, mamba = llm_cp_paths(mod, lay)
    a2a = lambda widths: sum(comm.all_to_all(tokens * w * BF16 / tp, cp, link, k) for w in widths)  # noqa: E731

    def gather_layer(nbytes: float) -> float:  # all-gather (again under recompute), gradient all-reduced
        return (passes - 1) * comm.reduce_scatter(nbytes, cp, link, cl, k) + comm.all_reduce(nbytes, cp, link, cl, k)
    seconds = 0.0
    if attention.head_parallel:
        kv_moved = kv * replicas(kv, tp, cp) * hd
        seconds += mod.attn_layers / pp * passes * a2a((q * hd, kv_moved, kv_moved, q * hd))
    else:
        seconds += mod.attn_layers / pp * gather_layer(tokens * cp * mod.kv_width * BF16 / tp)
        seconds += seq_flops("*") * mult * slower["*"]
    if mamba.head_parallel:
        inner, bc = heads * head_dim, groups * replicas(groups, tp, cp) * state
        back = (inner,) if replicas(groups, tp, cp) == 1 else (2 * inner, inner)  # y (fp32) and z when split
        seconds += mod.mamba_layers / pp * passes * a2a((inner, inner, bc, bc, heads, *back))
    else:  # every rank all-gathers the final state of all 2cp chunks of each of its sequences
        seconds += mod.mamba_layers / pp * gather_layer(sequences * 2 * cp * mod.state_bytes / tp)
        seconds += seq_flops("M") * mult * slower["M"]
    return seconds
