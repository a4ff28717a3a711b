"""Core attention (softmax(QK^T)V) for the hybrid LLM's attention layers, as a megatron spec submodule.

megatron's local DotProductAttention forks the CUDA RNG tracker on every call (dot_product_attention.py
~217), which needs a CPU shim, and materialises the full score matrix; torch's SDPA does neither and
handles GQA natively. Any class with this constructor and forward can replace it through
`build_hybrid_layer_specs(core_attention=...)`, which is how a context-parallel attention (hetero/)
plugs in: it receives the same pg_collection and can reach its CP group there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


@dataclass
class DocumentSeqParams(PackedSeqParams):
    """megatron's PackedSeqParams for padded [s, b] batches whose rows pack several documents.

    HybridLM.forward(doc_ids=...) hands one to every layer through megatron's `packed_seq_params` channel
    (SelfAttention passes it to its core attention untouched when qkv_format is not "thd"). doc_ids [b, s]:
    the packed-document id of every token this rank holds (its zigzag slice under CP), non-decreasing
    along each row; attention keeps keys of the query's document, Mamba resets its conv window and state
    at every document start. GPU kernels turn it into THD cu_seqlens / seq_idx (hetero.parallel.kernel_choice).
    """

    qkv_format: str = "sbhd"
    doc_ids: torch.Tensor = None


def document_ids(cu_seqlens, seq_length: int) -> torch.Tensor:
    """[n, seq_length] int64 document id per token from every row's cu_seqlens (data/packing.py: starts
    of the packed samples, the trailing padding segment included, last entry seq_length)."""
    rows = []
    for cu in cu_seqlens:
        cu = torch.as_tensor(cu, dtype=torch.int64)
        starts = torch.zeros(seq_length, dtype=torch.int64)
        starts[cu[1:-1][cu[1:-1] < seq_length]] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def document_mask(q_docs: torch.Tensor, k_docs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """bool [b, 1, sq, sk], True where the query may attend: same document and key position <= query's."""
    same = q_docs[:, :, None] == k_docs[:, None, :]
    return (same & (k_pos[None, :] <= q_pos[:, None])[None])[:, None]


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
        doc_ids = getattr(packed_seq_params, "doc_ids", None)
        if (packed_seq_params is not None and doc_ids is None) or attention_bias is not None:
            raise ValueError("SDPACoreAttention takes padded [s, b, h, d] batches (optionally with DocumentSeqParams) "
                             "without attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        mask = None
        if doc_ids is not None and bool((doc_ids != doc_ids[:, :1]).any()):  # several documents in a row
            pos = torch.arange(q.shape[2], device=q.device)
            mask = document_mask(doc_ids, doc_ids, pos, pos)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
