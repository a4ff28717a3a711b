"""Context-parallel attention for any backend: all-gather K/V over the CP group, mask by global position.

megatron-core's CP attention exists only in Transformer Engine (GPU). This is the CPU/gloo (and generic)
kernel: each CP rank keeps its own queries, gathers every rank's keys and values (with their global
positions and sample ids), and masks by those: a query attends to keys of the same sample, and with
`causal` only to keys at earlier or equal positions. With zigzag sharding (rank r holds chunks r and
2cp-1-r of the 2cp chunks) every rank does the same amount of causal work.

Gathered K/V cost O(seq) memory per rank instead of ring attention's O(seq/cp) blocks: simple and exact,
right for CPU-sized tests and modest sequences. The LLM uses it only for layers whose heads do not split over
tp x cp (hetero/plan/cp_path.py); the others run head-parallel (cp_heads.py), with fused kernels on a GPU.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 with per-rank row counts (ranks may hold different numbers of rows).

    Backward: each rank's slice of the gathered tensor was used by every rank, so its gradient is the
    sum over ranks: all-reduce the full gradient and keep the own slice (gloo has no reduce-scatter).
    """

    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.group, ctx.counts = group, counts
        ctx.rank = dist.get_rank(group)
        width = max(counts)
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start: start + ctx.counts[ctx.rank]], None, None


def gather_rows(x: torch.Tensor, group, counts: list[int] | None = None) -> torch.Tensor:
    """Differentiable all-gather along dim 0. counts: every rank's row count (all equal if None)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    counts = counts or [x.shape[0]] * dist.get_world_size(group)
    return _GatherRows.apply(x, group, list(counts))


def masked_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, causal: bool, scale: float | None = None):
    """Softmax attention on flattened tokens. q: [Tq, heads, d]; k, v: [Tk, kv_heads, d] (GQA when fewer).

    q_pos/k_pos: global sequence positions; q_seg/k_seg: sample ids (tokens attend within their sample).
    """
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = dim ** -0.5 if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = q_seg[:, None] == k_seg[None, :]
    if causal:
        allowed &= k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    probs = torch.nan_to_num(probs)  # a query with no allowed key (padding) gets zeros, not NaN
    return torch.einsum("hqk,khd->qhd", probs, v)


def context_parallel_attention(q, k, v, q_pos, q_seg, causal: bool, cp_group=None, counts=None,
                               scale: float | None = None):
    """Attention of this CP rank's queries over all CP ranks' keys/values.

    q, k, v: this rank's tokens [T, heads|kv_heads, d]; q_pos, q_seg: their global positions and sample
    ids (LongTensor [T]). counts: every CP rank's token count when they differ (encoders), else None.
    """
    k_all = gather_rows(k, cp_group, counts)
    v_all = gather_rows(v, cp_group, counts)
    meta = torch.stack([q_pos, q_seg], dim=1)
    meta_all = gather_rows(meta, cp_group, counts) if cp_group is not None else meta
    return masked_attention(q, k_all, v_all, q_pos, meta_all[:, 0], q_seg, meta_all[:, 1], causal, scale)
