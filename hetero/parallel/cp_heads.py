"""Head-parallel ("all-to-all", Ulysses-style) context parallelism for the hybrid LLM: the CP = 1 kernels, fused
ones on a GPU, run on the whole sequence of 1/cp of the heads.

Every CP rank holds its zigzag tokens (hetero/plan/zigzag.py) of all its TP rank's heads. Before the sequence
kernels an all-to-all over the CP group trades them for every token of 1/cp of the heads, the zigzag order is
undone, and the kernel a one-rank run would use runs there: SDPA or Transformer Engine for attention, the
torch SSD or mamba_ssm / causal_conv1d for Mamba (hetero/parallel/kernel_choice.py picks). An all-to-all back
restores the zigzag tokens of all heads. Packed documents: every rank all-gathers the document ids of the
whole row once per layer (b x S integers), so its kernel masks documents exactly as at CP = 1. The boundary,
the loss and every per-token layer keep the zigzag layout; only these two kernels see the sequence whole.

Mamba follows megatron-core's MambaContextParallel (its all-to-alls, zigzag undo, group replication and
parameter slices), with one change in what travels back: where each rank holds whole B/C groups, the gated
RMSNorm (per group of channels) runs on the head side and only the normalised output returns; megatron also
returns the gate z. Where a group's heads straddle ranks (fewer groups per TP rank than cp) both go back and
the norm runs on the token side, as in megatron.

Attention: Q by query heads, K and V by KV heads (each KV head replicated over cp / kv ranks when there are
fewer per TP rank than cp, as megatron replicates Mamba groups); the inner attention is the CP = 1 class,
built as if the model had this rank's share of the heads on each TP rank.

Which layers can take this path (heads dividing tp x cp) is the rule in hetero/plan/cp_path.py; the others
keep the zigzag kernels.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.distributed as dist
from megatron.core.ssm.mamba_context_parallel import (MambaContextParallel, _all_to_all_cp2hp, _all_to_all_hp2cp,
                                                      _redo_attention_load_balancing, _undo_attention_load_balancing)
from megatron.core.transformer.module import MegatronModule

from tessera.hetero.parallel.cp_gather_attention import gather_rows
from tessera.hetero.plan.cp_path import attention_path, mamba_path, replicas
from tessera.models.mamba2 import Mamba2Mixer, MixerShard, gated_rms_norm
from tessera.models.sdpa_attention import DocumentSeqParams, SDPACoreAttention


def whole_row_documents(doc_ids: torch.Tensor | None, cp_group) -> torch.Tensor | None:
    """[b, s_local] zigzag document ids of this rank -> [b, S] ids of the whole row in natural order."""
    if doc_ids is None:
        return None
    gathered = gather_rows(doc_ids.t().contiguous(), cp_group)  # [S, b] rank-major
    return _undo_attention_load_balancing(gathered, dist.get_world_size(cp_group)).t()


# megatron's all-to-alls of MambaContextParallel, used for attention too, so both layer kinds move and reorder
# tokens one way (its load balancing is the zigzag of hetero/plan/zigzag.py: chunks r and 2cp-1-r on rank r)
def tokens_to_heads(x: torch.Tensor, cp_group) -> torch.Tensor:
    """[s_local, b, n * w] zigzag tokens of n heads of width w -> [S, b, n/cp * w] in natural order: each rank
    gets every token of its 1/cp of the heads (differentiable: backward is the reverse all-to-all)."""
    return _undo_attention_load_balancing(_all_to_all_cp2hp(x, cp_group), dist.get_world_size(cp_group))


def heads_to_tokens(x: torch.Tensor, cp_group) -> torch.Tensor:
    """Inverse of tokens_to_heads: [S, b, m] natural order -> [S / cp, b, m * cp] zigzag tokens of all heads."""
    return _all_to_all_hp2cp(_redo_attention_load_balancing(x, dist.get_world_size(cp_group)), cp_group)


class HeadParallelMamba2Mixer(Mamba2Mixer):
    """Mamba2Mixer whose conv and scan run on the whole sequence of 1/cp of this TP rank's heads. Same
    parameters as the CP = 1 mixer (each CP rank slices its heads' share in forward, so gradients land on the
    full parameters and the dp x cp gradient reduction sums them)."""

    def __init__(self, config, submodules, layer_number: int = 1, tp_group=None, pg_collection=None):
        super().__init__(config, submodules, layer_number, tp_group=tp_group, pg_collection=pg_collection)
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            raise ValueError("HeadParallelMamba2Mixer needs a pg_collection with a cp group")
        self.cp_group = pg_collection.cp
        tp = pg_collection.tp.size() if pg_collection.tp is not None else 1
        path = mamba_path(config.mamba_num_heads, config.mamba_num_groups, tp, self.cp_group.size())
        if path.reason:
            raise ValueError(f"head-parallel CP: {path.reason}; this layer takes the zigzag path")

    def _context(self) -> MambaContextParallel:
        # built per call (integer bookkeeping only): parameters are read when sliced, so a meta-device build
        # materialised later, or a dtype cast, is never held on to
        conv = types.SimpleNamespace(weight=self.conv1d_weight, bias=self.conv1d_bias)
        return MambaContextParallel(self.cp_group, self.d_inner, self.heads, self.groups, self.state, conv,
                                    self.dt_bias, self.A_log, self.D, D_has_hdim=False)

    def forward(self, hidden_states: torch.Tensor, initial_state: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None):
        if initial_state is not None:
            raise ValueError("head-parallel CP mixes whole sequences from a zero state; initial_state is for "
                             "decoding at CP = 1")
        cp = self._context()
        zxbcdt, _ = self.in_proj(hidden_states)
        full = cp.pre_conv_ssm(zxbcdt)  # [S, b, F / cp]: this rank's heads, whole sequence, natural order
        shard = MixerShard(cp.nheads_local_tpcp, cp.ngroups_local_tpcp, cp.get_conv1d_weight(),
                           cp.get_conv1d_bias(), cp.get_dt_bias(), cp.get_A_log(), cp.get_D())
        y, z = self.mix(full.transpose(0, 1), shard, None, whole_row_documents(doc_ids, self.cp_group))
        eps = self.config.layernorm_epsilon
        if cp.group_repeat_count == 1:  # whole norm groups here: gate and normalise, send the output alone
            width = cp.d_inner_local_tpcp
            weight = self.norm_weight[cp.cp_rank * width:(cp.cp_rank + 1) * width]
            y = gated_rms_norm(y, z, weight, self.norm_group, eps).to(hidden_states.dtype)
            y = cp.post_conv_ssm(y.transpose(0, 1).contiguous())
        else:  # a group's heads straddle CP ranks: its norm needs all of them, so y and the gate go back
            y, z = (cp.post_conv_ssm(t.transpose(0, 1).contiguous()) for t in (y, z))
            y = gated_rms_norm(y, z, self.norm_weight, self.norm_group, eps).to(hidden_states.dtype)
        return self.out_proj(y)


def head_parallel_attention(inner: type) -> type:
    """A core-attention class running `inner` (a CP = 1 core attention: SDPA, Transformer Engine) head-parallel
    over the CP group of its pg_collection."""
    return _HEAD_PARALLEL.setdefault(inner, type(f"HeadParallel{inner.__name__}", (HeadParallelCoreAttention,),
                                                 {"inner_class": inner}))


_HEAD_PARALLEL: dict[type, type] = {}


class HeadParallelCoreAttention(MegatronModule):
    """Causal GQA attention of this CP rank's zigzag tokens: all-to-all to heads, `inner_class` on the whole
    sequence, all-to-all back. query [s_local, b, heads, d], key/value [s_local, b, kv_heads, d] ->
    [s_local, b, heads * d], equal to the one-device attention of the whole sequence."""

    inner_class: type = SDPACoreAttention

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", cp_comm_type=None,
                 softmax_scale=None, pg_collection=None):
        super().__init__(config=config)
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            raise ValueError("HeadParallelCoreAttention needs a pg_collection with a cp group")
        self.cp_group = pg_collection.cp
        tp, cp = pg_collection.tp.size() if pg_collection.tp is not None else 1, self.cp_group.size()
        path = attention_path(config.num_attention_heads, config.num_query_groups, tp, cp)
        if path.reason:
            raise ValueError(f"head-parallel CP: {path.reason}; this layer takes the zigzag path")
        self.kv_replicas = replicas(config.num_query_groups, tp, cp)
        # the inner kernel sees 1/cp of this TP rank's heads: build it as for a model with that many per TP rank
        local = copy.copy(config)
        local.num_attention_heads = config.num_attention_heads // cp
        local.num_query_groups = config.num_query_groups * self.kv_replicas // cp
        local.context_parallel_size = 1
        self.inner = self.inner_class(local, layer_number, attn_mask_type, attention_type,
                                      softmax_scale=softmax_scale, pg_collection=pg_collection)

    def forward(self, query, key, value, attention_mask=None, *, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        doc_ids = getattr(packed_seq_params, "doc_ids", None)
        if (packed_seq_params is not None and doc_ids is None) or attention_bias is not None:
            raise ValueError("HeadParallelCoreAttention takes padded [s, b, h, d] batches (optionally with "
                             "DocumentSeqParams) without attention bias")
        s, b, heads, dim = query.shape
        if self.kv_replicas > 1:  # consecutive CP ranks share a KV head, as their query heads do
            key, value = (t.repeat_interleave(self.kv_replicas, dim=2) for t in (key, value))
        q, k, v = (tokens_to_heads(t.reshape(s, b, -1), self.cp_group) for t in (query, key, value))
        q, k, v = (t.reshape(t.shape[0], b, -1, dim) for t in (q, k, v))
        docs = whole_row_documents(doc_ids, self.cp_group)
        params = None if docs is None else DocumentSeqParams(doc_ids=docs)
        out = self.inner(q, k, v, None, attn_mask_type=attn_mask_type, packed_seq_params=params)
        return heads_to_tokens(out, self.cp_group)
