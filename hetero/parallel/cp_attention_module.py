"""Context-parallel core attention for the hybrid LLM: a megatron-core spec submodule on top of
hetero/parallel/cp_gather_attention.py, for the zigzag layout.

megatron's own CP attention is Transformer Engine only (GPU). This class has the constructor and forward
of a megatron core attention (see models/sdpa_attention.py), so it plugs in through
`build_hybrid_layer_specs(config, core_attention=ZigzagCPCoreAttention)` and finds its CP group in the
injected pg_collection; models/ never sees torch.distributed.

Layout: the global sequence of length S = cp * s_local is cut into 2*cp equal chunks and CP rank r holds
chunks r and 2cp-1-r, in that order (hetero.parallel.cp_gather_attention.zigzag_positions). Every rank all-gathers K and
V over the CP group (differentiable; backward sums each rank's K/V gradient over the group) and masks
by *global* position: query at global position i sees keys at global positions <= i, and with packed
rows (DocumentSeqParams.doc_ids, this rank's slice) only keys of its own document. The global
positions of every rank follow from (S, cp), so they are computed, not communicated. The batch
dimension is kept (one masked attention per sample): packing samples into a flat token list would
multiply the score matrix by the batch size. Nemotron-H attention has no RoPE; a rotary variant would
apply its embedding at these same global positions before this module.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from tessera.hetero.parallel.cp_gather_attention import gather_rows, masked_attention
from tessera.hetero.plan.zigzag import zigzag_positions, zigzag_rank_positions


class ZigzagCPCoreAttention(MegatronModule):
    """Causal GQA attention of this CP rank's zigzag tokens over all ranks' keys and values.

    query [s_local, b, heads, d], key/value [s_local, b, kv_heads, d] -> [s_local, b, heads * d].
    With a one-rank CP group it is plain causal attention (same result as SDPACoreAttention).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", cp_comm_type=None,
                 softmax_scale=None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"ZigzagCPCoreAttention supports causal masks only, got {attn_mask_type}")
        if config.attention_dropout:
            # masked_attention has no dropout; silently training without it would change the recipe.
            raise ValueError("ZigzagCPCoreAttention has no attention dropout; set attention_dropout=0")
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            raise ValueError("ZigzagCPCoreAttention needs a pg_collection with a cp group")
        self.cp_group = pg_collection.cp
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim)

    def forward(self, query, key, value, attention_mask=None, *, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        doc_ids = getattr(packed_seq_params, "doc_ids", None)  # [b, s_local] this rank's tokens' documents
        if (packed_seq_params is not None and doc_ids is None) or attention_bias is not None:
            raise ValueError("ZigzagCPCoreAttention takes padded [s, b, h, d] batches (optionally with "
                             "DocumentSeqParams) without attention bias")
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        s_local, batch = query.shape[0], query.shape[1]
        if cp > 1 and s_local % 2:
            raise ValueError(f"zigzag CP needs an even local length (two chunks per rank), got {s_local}")
        positions = zigzag_rank_positions(s_local, cp)
        q_pos = torch.as_tensor(positions[rank], device=query.device)
        k_pos = torch.as_tensor(np.concatenate(positions), device=query.device)
        keys = gather_rows(key, self.cp_group)      # [cp * s_local, b, kv, d], rank-major
        values = gather_rows(value, self.cp_group)
        if doc_ids is None:  # one sequence per batch column: no packing mask
            q_docs = torch.zeros(batch, s_local, dtype=torch.long, device=query.device)
            k_docs = torch.zeros(batch, cp * s_local, dtype=torch.long, device=query.device)
        else:  # keys keep the documents of the tokens they came from (gathered in the same rank order)
            q_docs = doc_ids.to(device=query.device, dtype=torch.long)
            k_docs = gather_rows(q_docs.t().contiguous(), self.cp_group).t()
        out = torch.stack([
            masked_attention(query[:, i], keys[:, i], values[:, i], q_pos, k_pos, q_docs[i], k_docs[i],
                             causal=True, scale=self.softmax_scale)
            for i in range(batch)
        ], dim=1)
        return out.reshape(s_local, batch, -1)
