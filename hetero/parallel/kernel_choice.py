"""Automatic choice of the hybrid LLM's sequence kernels (core attention, Mamba-2 mixer) for this machine
and this rank's context-parallel group, logged in one line.

    kernels = select_kernels(pg_collection)          # logs e.g. "kernels: attention=... mamba=..."
    model = HybridLM(config, pg_collection, core_attention=kernels.core_attention,
                     mamba_mixer=kernels.mamba_mixer, moe_experts=kernels.moe_experts)

Rules (GPU kernels are an optional extra, never required):
  one-rank kernels (what runs at CP = 1, and on the whole sequence of a rank's heads at CP > 1):
    attention: GPU + Transformer Engine + a bf16/fp16 model -> megatron's TEDotProductAttention (packed
               documents as THD); otherwise models' SDPACoreAttention. fp32 never gets TE: its flash/fused
               backends take only fp16/bf16.
    mamba:     GPU + mamba_ssm -> mamba_ssm's fused Triton scan, its conv chosen on its own: causal_conv1d's CUDA
               conv where that imports (MambaSSMMixer), torch's conv otherwise (MambaSSMScanMixer: mamba_ssm
               ships as pure Python + Triton when built with MAMBA_SKIP_CUDA_BUILD, causal_conv1d needs nvcc);
               no GPU or no mamba_ssm -> the pure-torch Mamba2Mixer. The line says both: mamba=mamba_ssm+torch-conv.
  MoE experts (with `config` of an MoE LLM): models/moe_experts.GroupedGemmExperts (torch's _grouped_mm, on
               every device: the same code on CPU and GPU, equal to the loop), megatron's SequentialMLP loop where
               torch lacks the op. megatron's own GroupedMLP/TEGroupedMLP are not picked even where grouped_gemm
               or Transformer Engine is installed: their parameters (weight1/weight2, linear_fc1.weightJ) are not
               the local_experts.J.linear_fc1 names the HF import, checkpoints and LoRA read.
  CP > 1, per layer kind, by the rule of hetero/plan/cp_path.py (the planner prices the same):
    heads split over tp x cp -> head-parallel (hetero/parallel/cp_heads.py): all-to-all to whole sequences
               of 1/cp of the heads, the one-rank kernel above there, all-to-all back;
    otherwise  -> zigzag, torch ops on any device: ZigzagCPCoreAttention (all-gather K/V, unfused, documents
               masked by id) and ZigzagCPMamba2Mixer (chunk-state passing); the logged line says why.
  TE's own CP is never used: its THD load balancing would re-split every packed document its own way, not
  the zigzag rows the boundary, the loss and every other layer share.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass

import torch

from tessera.hetero.parallel.cp_attention_module import ZigzagCPCoreAttention
from tessera.hetero.parallel.cp_heads import HeadParallelMamba2Mixer, head_parallel_attention
from tessera.hetero.parallel.cp_mamba import ZigzagCPMamba2Mixer
from tessera.hetero.plan.cp_path import attention_path, mamba_path
from megatron.core.transformer.moe.experts import SequentialMLP

from tessera.models.moe_experts import GroupedGemmExperts, grouped_mm_available
from tessera.models.sdpa_attention import SDPACoreAttention
from tessera.models.mamba2 import Mamba2Mixer

log = logging.getLogger("tessera.kernels")


class MambaSSMScanMixer(Mamba2Mixer):
    """Mamba2Mixer with mamba_ssm's fused SSD scan (GPU, Triton) and torch's conv: what runs where mamba_ssm imports
    but causal_conv1d does not. Same parameters, so checkpoints and the HF import are shared with the CPU mixer."""

    # mamba_chunk_scan_combined saves about its inputs and output for backward: selective recompute of the
    # scan would buy no memory, only a second scan (models/recompute.py)
    scan_keeps_intermediates = False

    def scan(self, x, dt, A, B, C, initial_state=None, doc_ids=None) -> torch.Tensor:
        mamba_chunk_scan_combined = import_kernel_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
        # dt arrives softplus'ed and clamped, so the kernel's own dt_bias/softplus/limit stay off.
        # Packed documents: doc_ids [b, s] become the kernel's seq_idx (int32 [b, s], a new id = a new sequence:
        # the scan restarts its state), as megatron's MambaMixer does for THD.
        seq_idx = doc_ids.to(torch.int32).contiguous() if doc_ids is not None else None
        y = mamba_chunk_scan_combined(x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(),
                                      chunk_size=self.config.mamba_chunk_size, initial_states=initial_state,
                                      seq_idx=seq_idx)
        return y.float()


class MambaSSMMixer(MambaSSMScanMixer):
    """MambaSSMScanMixer with causal_conv1d's CUDA conv: both fused kernels (GPU)."""

    # doc_ids as seq_idx: the conv zeroes taps of other ids
    def conv(self, xbc: torch.Tensor, doc_ids: torch.Tensor | None = None, weight=None, bias=None) -> torch.Tensor:
        from causal_conv1d import causal_conv1d_fn

        weight, bias = (self.conv1d_weight, self.conv1d_bias) if weight is None else (weight, bias)
        if doc_ids is None:
            out = causal_conv1d_fn(xbc.transpose(1, 2).contiguous(), weight, bias)
        else:  # causal_conv1d takes seq_idx only in channel-last layout: [b, d, s] with stride(1) == 1
            out = causal_conv1d_fn(xbc.contiguous().transpose(1, 2), weight, bias,
                                   seq_idx=doc_ids.to(torch.int32).contiguous())
        return out.transpose(1, 2)


class HeadParallelMambaSSMScanMixer(HeadParallelMamba2Mixer, MambaSSMScanMixer):
    """Head-parallel CP (hetero/parallel/cp_heads.py) with mamba_ssm's scan and torch's conv on the whole sequence
    of this rank's heads."""


class HeadParallelMambaSSMMixer(HeadParallelMamba2Mixer, MambaSSMMixer):
    """Head-parallel CP (hetero/parallel/cp_heads.py) with mamba_ssm's scan and causal_conv1d's conv on the whole
    sequence of this rank's heads: the fused kernels at CP > 1."""


@contextlib.contextmanager
def ieee_fp32_dots():
    """fp32 matmuls in IEEE fp32 on both sides of a fused-vs-torch comparison. Triton's fp32 tl.dot runs as TF32
    unless TRITON_F32_DEFAULT says otherwise (read when a kernel compiles), and torch may be set to TF32
    (set_float32_matmul_precision): a TF32 side differs by ~1e-3 (1.45e-3 seen between mamba_ssm's scan and
    torch's on an H200) and would hide a real bug under the rounding; both in IEEE agree to ~1e-6 (6.3e-7).
    Kernels compiled inside keep the setting they compiled with, so enter this before the first call."""
    saved_env, saved_torch = os.environ.get("TRITON_F32_DEFAULT"), torch.get_float32_matmul_precision()
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved_torch)
        if saved_env is None:
            del os.environ["TRITON_F32_DEFAULT"]
        else:
            os.environ["TRITON_F32_DEFAULT"] = saved_env


def thd_cu_seqlens(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32) and max length of the documents of doc_ids [b, s] laid out row after row as
    one THD token list: a sequence starts at every row start and every change of id."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = starts.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([first, first.new_tensor([doc_ids.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


@functools.lru_cache(maxsize=None)
def te_document_attention():
    """megatron's TEDotProductAttention taking our padded [s, b] layout plus DocumentSeqParams: packed rows
    are re-laid out as THD (qkv_format="thd", cu_seqlens_q/kv from the doc ids, padding_causal), the
    format megatron feeds Transformer Engine for packed sequences. Without doc ids it is unchanged."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    class TEDocumentAttention(TEDotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            doc_ids = getattr(packed_seq_params, "doc_ids", None)
            if doc_ids is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params, **kwargs)
            s, b = query.shape[:2]
            thd = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]).contiguous() for t in (query, key, value)]
            cu, longest = thd_cu_seqlens(doc_ids.to(query.device))
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=longest, max_seqlen_kv=longest)
            out = super().forward(*thd, None, attn_mask_type=AttnMaskType.padding_causal,
                                  attention_bias=attention_bias, packed_seq_params=params, **kwargs)
            return out.reshape(b, s, -1).transpose(0, 1).contiguous()  # [t, h*d] -> [s, b, h*d]

    return TEDocumentAttention


@dataclass(frozen=True)
class Kernels:
    core_attention: type
    mamba_mixer: type
    line: str  # the one log line naming what was chosen
    moe_experts: type = SequentialMLP


# What must import for an extra to count as installed: the exact modules and names we call. A build against
# another torch or CUDA (missing .so symbols, ABI mismatch) has its files in place, so find_spec finds it,
# and fails only here; such a build is logged and skipped, never picked.
PROBES = {
    "transformer_engine": [("transformer_engine.pytorch", "DotProductAttention"),
                           ("megatron.core.extensions.transformer_engine", "TEDotProductAttention")],
    "mamba_ssm": [("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")],
    "causal_conv1d": [("causal_conv1d", "causal_conv1d_fn")],
}
HALF = (torch.bfloat16, torch.float16)


def import_kernel_module(name: str):
    """importlib.import_module, except that mamba_ssm built with MAMBA_SKIP_CUDA_BUILD=TRUE (pure Python + Triton:
    the build a cluster without nvcc or package access gets shipped, README "CPU and GPU paths") still gives its
    Triton ops. Its package __init__ imports selective_scan_cuda, the Mamba-1 CUDA extension such a build lacks and
    the SSD scan never calls, so the ops are imported below the package left unexecuted (same files, same path)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if not name.startswith("mamba_ssm.") or e.name != "selective_scan_cuda":
            raise
    spec = importlib.util.find_spec("mamba_ssm")
    sys.modules["mamba_ssm"] = importlib.util.module_from_spec(spec)  # __path__ set, __init__ not run
    log.info("kernels: mamba_ssm has no selective_scan_cuda (a MAMBA_SKIP_CUDA_BUILD build): Triton ops only")
    return importlib.import_module(name)


@functools.cache
def installed(module: str) -> bool:
    """True when `module`'s probes (PROBES) import and expose the names we call; a failure is logged once."""
    for name, attr in PROBES.get(module, [(module, None)]):
        try:
            mod = import_kernel_module(name)
            if attr is not None:
                getattr(mod, attr)
        except Exception as e:  # ImportError, OSError (undefined symbol), RuntimeError from the extension's init
            log.warning("kernels: %s is present but unusable (%s: %s: %s); using the torch path",
                        module, name, type(e).__name__, e)
            return False
    return True


def moe_experts_kernel() -> tuple[type, str]:
    """(class, name) of the routed experts' compute on this machine (the rule in the module docstring)."""
    if grouped_mm_available():
        return GroupedGemmExperts, "torch-grouped-mm"
    return SequentialMLP, "megatron-sequential"


def _size(group) -> int:
    return group.size() if group is not None else 1


def select_kernels(pg_collection=None, gpu: bool | None = None, have=installed,
                   dtype: torch.dtype = torch.float32, config=None) -> Kernels:
    """Pick the kernels for this rank. `gpu`/`have` default to the real machine (tests override them);
    `dtype` is the dtype the model computes in (the run's, not the fp32 of a config built before casting);
    `config` (the LLM's HybridConfig: its heads) is needed at CP > 1 to choose each layer kind's CP path."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    cp = _size(getattr(pg_collection, "cp", None))
    tp = _size(getattr(pg_collection, "tp", None))
    if cp > 1 and config is None:
        raise ValueError("select_kernels at CP > 1 needs the LLM config: the CP path follows its heads")
    fused_attention = gpu and dtype in HALF and have("transformer_engine")
    one_rank_attention, one_rank_attention_name = ((te_document_attention(), "transformer_engine")
                                                   if fused_attention else (SDPACoreAttention, "torch-sdpa"))
    fused_scan = gpu and have("mamba_ssm")
    conv_name = "causal_conv1d" if fused_scan and have("causal_conv1d") else "torch-conv"
    one_rank_mamba = {"causal_conv1d": MambaSSMMixer, "torch-conv": MambaSSMScanMixer}[conv_name]
    head_parallel_mamba = {"causal_conv1d": HeadParallelMambaSSMMixer,
                           "torch-conv": HeadParallelMambaSSMScanMixer}[conv_name]
    notes = []
    attention_cp = attention_path(config.num_attention_heads, config.num_query_groups, tp, cp) if cp > 1 else None
    if attention_cp is None:
        attention, attention_name = one_rank_attention, one_rank_attention_name
    elif attention_cp.head_parallel:
        attention = head_parallel_attention(one_rank_attention)
        attention_name = f"head-parallel(cp={cp})+{one_rank_attention_name}"
    else:
        attention, attention_name = ZigzagCPCoreAttention, f"zigzag-allgather(cp={cp})+torch"
        notes.append(f"attention {attention_cp.reason}")
    mamba_cp = mamba_path(config.mamba_num_heads, config.mamba_num_groups, tp, cp) if cp > 1 else None
    fused_name = f"mamba_ssm+{conv_name}"
    if mamba_cp is None:
        mamba, mamba_name = (one_rank_mamba, fused_name) if fused_scan else (Mamba2Mixer, "torch-ssd")
    elif mamba_cp.head_parallel:
        mamba, mamba_name = ((head_parallel_mamba, f"head-parallel(cp={cp})+{fused_name}") if fused_scan
                             else (HeadParallelMamba2Mixer, f"head-parallel(cp={cp})+torch-ssd"))
    else:
        mamba, mamba_name = ZigzagCPMamba2Mixer, f"zigzag-state-passing(cp={cp})+torch"
        notes.append(f"mamba {mamba_cp.reason}")
    experts, experts_name = moe_experts_kernel()
    moe = getattr(config, "num_moe_experts", None)
    line = (f"kernels: attention={attention_name} mamba={mamba_name}" + (f" experts={experts_name}" if moe else "")
            + f" device={'cuda' if gpu else 'cpu'}"
            + ("" if dtype == torch.float32 else f" dtype={str(dtype).removeprefix('torch.')}")
            + (f" (zigzag because {'; '.join(notes)})" if notes else ""))
    log.info(line)
    return Kernels(attention, mamba, line, experts)
