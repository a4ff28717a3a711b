"""Automatic choice of the hybrid LLM's sequence kernels (core attention, Mamba-2 mixer) for this machine
and this rank's context-parallel group, logged in one line.

    kernels = select_kernels(pg_collection)          # logs e.g. "kernels: attention=... mamba=..."
    model = HybridLM(config, pg_collection, core_attention=kernels.core_attention,
                     mamba_mixer=kernels.mamba_mixer)

Rules (GPU kernels are an optional extra, never required):
  attention: GPU + Transformer Engine -> megatron's TEDotProductAttention (its own CP, ring/p2p, same
             zigzag layout); otherwise CP > 1 -> hetero ZigzagCPCoreAttention (all-gather K/V), CP = 1 ->
             models' SDPACoreAttention.
  mamba:     CP > 1 -> hetero ZigzagCPMamba2Mixer (torch ops on any device; mamba_ssm has no CP);
             GPU + mamba_ssm + causal_conv1d -> MambaSSMMixer (fused Triton scan, CUDA conv);
             otherwise the pure-torch Mamba2Mixer.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from tessera.hetero.parallel.cp_attention_module import ZigzagCPCoreAttention
from tessera.hetero.parallel.cp_mamba import ZigzagCPMamba2Mixer
from tessera.models.sdpa_attention import SDPACoreAttention
from tessera.models.mamba2 import Mamba2Mixer

log = logging.getLogger("tessera.kernels")


class MambaSSMMixer(Mamba2Mixer):
    """Mamba2Mixer with mamba_ssm's fused SSD scan and causal_conv1d's conv (GPU). Same parameters, so
    checkpoints and the HF import are shared with the CPU mixer."""

    def conv(self, xbc: torch.Tensor) -> torch.Tensor:
        from causal_conv1d import causal_conv1d_fn

        out = causal_conv1d_fn(xbc.transpose(1, 2).contiguous(), self.conv1d_weight, self.conv1d_bias)
        return out.transpose(1, 2)

    def scan(self, x, dt, A, B, C, initial_state=None) -> torch.Tensor:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        # dt arrives softplus'ed and clamped, so the kernel's own dt_bias/softplus/limit stay off.
        y = mamba_chunk_scan_combined(x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(),
                                      chunk_size=self.config.mamba_chunk_size, initial_states=initial_state)
        return y.float()


@dataclass(frozen=True)
class Kernels:
    core_attention: type
    mamba_mixer: type
    line: str  # the one log line naming what was chosen


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def select_kernels(pg_collection=None, gpu: bool | None = None, have=installed) -> Kernels:
    """Pick the kernels for this rank. `gpu`/`have` default to the real machine (tests override them)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    cp = cp_group.size() if cp_group is not None else 1
    if gpu and have("transformer_engine"):
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        attention, attention_name = TEDotProductAttention, "transformer_engine"
    elif cp > 1:
        attention, attention_name = ZigzagCPCoreAttention, f"cpu-cp-allgather(cp={cp})"
    else:
        attention, attention_name = SDPACoreAttention, "torch-sdpa"
    if cp > 1:
        mamba, mamba_name = ZigzagCPMamba2Mixer, f"torch-ssd-cp-state-passing(cp={cp})"
    elif gpu and have("mamba_ssm") and have("causal_conv1d"):
        mamba, mamba_name = MambaSSMMixer, "mamba_ssm"
    else:
        mamba, mamba_name = Mamba2Mixer, "torch-ssd"
    line = f"kernels: attention={attention_name} mamba={mamba_name} device={'cuda' if gpu else 'cpu'}"
    log.info(line)
    return Kernels(attention, mamba, line)
