"""Core attention (softmax(QK^T)V) for the hybrid LLM's attention layers, as a megatron spec submodule.

megatron's local DotProductAttention forks the CUDA RNG tracker on every call (dot_product_attention.py
~217), which needs a CPU shim, and materialises the full score matrix; torch's SDPA does neither and
handles GQA natively. Any class with this constructor and forward can replace it through
`build_hybrid_layer_specs(core_attention=...)`, which is how a context-parallel attention (hetero/)
plugs in: it receives the same pg_collection and can reach its CP group there.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """Causal GQA attention on [s, b, heads, dim] tensors; returns [s, b, heads * dim]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", cp_comm_type=None,
                 softmax_scale=None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim), the Nemotron-H choice
        self.dropout_p = config.attention_dropout

    def forward(self, query, key, value, attention_mask=None, *, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention takes padded [s, b, h, d] batches without attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1],
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
