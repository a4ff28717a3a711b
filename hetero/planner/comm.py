"""Communication times (alpha-beta model) and the boundary's per-rank row counts in closed form.

A message of B bytes on a link costs latency + overhead + B / (bandwidth * bw_eff). Collectives follow
NCCL's ring volumes: all-reduce moves 2(p-1)/p of the buffer, reduce-scatter and all-gather (p-1)/p,
all-to-all (p-1)/p; their latency term is 2(p-1) hops inside a node and 2*log2(p) hops across nodes,
where NCCL switches to tree/hierarchical algorithms. A group crosses nodes when its ranks, `stride` apart,
span more than one node.

`boundary_rows` is the closed form of hetero.plan.boundary_plan's row counts when media tokens are spread
evenly over the sequence (tests/test_planner_cost.py checks it against plan_boundary row for row), so the
search can price thousands of layouts without building plans: per microbatch, how many rows the busiest
destination rank receives and the busiest source rank sends (forward) and receives (backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tessera.hetero.plan.layout import ModuleLayout
from tessera.hetero.plan.zigzag import zigzag_chunks
from tessera.hetero.planner.cluster import Cluster, Constants


@dataclass(frozen=True)
class Link:
    gbps: float
    latency_s: float


def link(cluster: Cluster, inter: bool) -> Link:
    if inter:
        return Link(cluster.inter_gbps, cluster.inter_latency_s)
    return Link(cluster.intra_gbps, cluster.intra_latency_s)


def group_link(cluster: Cluster, size: int, stride: int) -> Link:
    """The link a group of `size` ranks, `stride` apart, runs on (inter-node if it spans nodes)."""
    return link(cluster, size > 1 and stride * (size - 1) >= cluster.gpus_per_node)


def _hops(p: int, lk: Link, cluster: Cluster) -> float:
    return 2 * (p - 1) if lk.gbps == cluster.intra_gbps else 2 * math.ceil(math.log2(p))


def _beta(nbytes: float, lk: Link, k: Constants) -> float:
    return nbytes / (lk.gbps * 1e9 * k.bw_eff)


def all_reduce(nbytes: float, p: int, lk: Link, cluster: Cluster, k: Constants) -> float:
    if p <= 1:
        return 0.0
    return _beta(2 * (p - 1) / p * nbytes, lk, k) + _hops(p, lk, cluster) * (lk.latency_s + k.msg_overhead_s)


def reduce_scatter(nbytes: float, p: int, lk: Link, cluster: Cluster, k: Constants) -> float:
    """Also the time of an all-gather of the same buffer."""
    if p <= 1:
        return 0.0
    return _beta((p - 1) / p * nbytes, lk, k) + _hops(p, lk, cluster) / 2 * (lk.latency_s + k.msg_overhead_s)


def all_to_all(nbytes: float, p: int, lk: Link, k: Constants) -> float:
    if p <= 1:
        return 0.0
    return _beta((p - 1) / p * nbytes, lk, k) + (p - 1) * (lk.latency_s + k.msg_overhead_s)


def p2p(nbytes: float, lk: Link, k: Constants, messages: int = 1) -> float:
    return _beta(nbytes, lk, k) + messages * (lk.latency_s + k.msg_overhead_s)


@dataclass(frozen=True)
class BoundaryRows:
    """Rows per microbatch of one encoder -> language boundary (multiply by hidden * 2 bytes)."""

    fwd_recv_max: float   # busiest destination (LLM first-stage) rank, forward
    fwd_send_max: float   # busiest source (encoder last-stage) rank, forward
    bwd_recv_max: float   # busiest source rank receiving gradients, backward
    bwd_send_max: float   # busiest destination rank sending gradients (colocated: an upper bound)
    fwd_moved: float      # all ranks, forward (rows copied locally excluded)
    bwd_moved: float
    messages: int         # most peers one rank exchanges with


def _interval_overlap(a0, a1, b0, b1):
    return np.clip(np.minimum(a1, b1) - np.maximum(a0, b0), 0, None)


def _coords(m: ModuleLayout, ranks: np.ndarray):
    """(tp, cp, dp, pp) arrays of global ranks inside module m (ranks must belong to m)."""
    r = ranks - m.first
    tp, r = r % m.tp, r // m.tp
    cp, r = r % m.cp, r // m.cp
    return tp, cp, r % m.dp_size, r // m.dp_size


def boundary_rows(src: ModuleLayout, dst: ModuleLayout, samples: int, tokens: float) -> BoundaryRows:
    """Closed-form row counts of plan_boundary for `samples` samples of `tokens` media tokens each, evenly
    spread over the LLM sequence (so a share of positions is the same share of media tokens)."""
    # shard overlaps as fractions of all elements: samples [dst dp, src dp], token positions [dst cp, src cp]
    ds, ss = np.arange(dst.dp_size), np.arange(src.dp_size)
    samp = _interval_overlap(ds[:, None] / dst.dp_size, (ds[:, None] + 1) / dst.dp_size,
                             ss[None, :] / src.dp_size, (ss[None, :] + 1) / src.dp_size)
    rc, sc = np.arange(dst.cp), np.arange(src.cp)
    lo, hi = sc[None, :] / src.cp, (sc[None, :] + 1) / src.cp
    two = 2 * dst.cp
    first, second = zigzag_chunks(dst.cp, rc[:, None])  # dst CP rank r holds these two of 2cp chunks
    tok = (_interval_overlap(first / two, (first + 1) / two, lo, hi)
           + _interval_overlap(second / two, (second + 1) / two, lo, hi))
    total = samples * tokens
    need = total / (dst.dp_size * dst.cp)   # rows every destination rank needs (each TP replica)
    held = total / (src.dp_size * src.cp)   # rows every source rank holds
    peers = int(max((samp > 0).sum(0).max() * (tok > 0).sum(0).max(),
                    (samp > 0).sum(1).max() * (tok > 0).sum(1).max()))
    # destination TP replica t is served by source TP replica t % src.tp: the busiest serves ceil(dst/src)
    busiest = math.ceil(dst.tp / src.tp)
    back = math.ceil(src.tp / dst.tp)  # backward: source replica t is served by destination replica t % dst.tp
    n_dst, n_src = dst.dp_size * dst.cp * dst.tp, src.dp_size * src.cp * src.tp
    if src.last < dst.first or dst.last < src.first:  # disjoint ranks: nothing is local
        return BoundaryRows(need, held * busiest, held, need * back, need * n_dst, held * n_src, peers)
    # colocated: a rank that is a first-stage destination and a last-stage source copies its own
    # source shard's rows locally, and nobody sends them to it
    ranks = np.arange(max(dst.first, src.first), min(dst.last, src.last) + 1)
    d_tp, d_cp, d_dp, d_pp = _coords(dst, ranks)
    s_tp, s_cp, s_dp, s_pp = _coords(src, ranks)
    both = (d_pp == 0) & (s_pp == src.pp - 1)
    local = np.where(both, samp[d_dp, s_dp] * tok[d_cp, s_cp], 0.0) * total
    fwd_recv_max = need - local[d_pp == 0].min()          # ranges are identical here (layout.validate)
    bwd_recv_max = held - local[s_pp == src.pp - 1].min()
    sent = np.zeros((src.tp, src.dp_size, src.cp))
    counts = np.bincount(np.arange(dst.tp) % src.tp, minlength=src.tp)
    sent += (counts * held)[:, None, None]
    np.subtract.at(sent, (d_tp[both] % src.tp, s_dp[both], s_cp[both]), local[both])
    return BoundaryRows(fwd_recv_max=float(max(fwd_recv_max, 0.0)), fwd_send_max=float(sent.max()),
                        bwd_recv_max=float(bwd_recv_max), bwd_send_max=need * back, fwd_moved=need * n_dst - float(local.sum()),
                        bwd_moved=held * n_src - float(local.sum()), messages=peers)
