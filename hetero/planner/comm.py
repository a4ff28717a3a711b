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

import functools
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


def _most_overlapping(n: int, m: int) -> int:
    """The most of m equal parts of [0, 1) that one of n equal parts overlaps (with positive length), in closed
    form: with p/q = m/n in lowest terms, part j starts at residue s = j*p mod q (every residue occurs) and meets
    ceil((s + p) / q) parts of the other side, largest at s = q - 1. (The matrix of all n x m overlaps it
    replaces was quadratic in the DP sizes: 2 GiB per boundary at 16,384 ranks.)"""
    g = math.gcd(n, m)
    p, q = m // g, n // g
    return -(-(q - 1 + p) // q)


@dataclass(frozen=True)
class _Window:
    """The colocated ranks whose local copies stand for all of them (see _local_window)."""

    offsets: np.ndarray   # ranks to visit, as offsets from the range's first rank
    copies: int           # how often the visited ranks repeat over the range (1: once, the rest copy nothing)
    fwd_all: bool         # the visited ranks are every LLM first-stage rank (else one of them copies nothing)
    bwd_all: bool         # ... every encoder last-stage rank


def _local_window(src: ModuleLayout, dst: ModuleLayout) -> _Window:
    """Where colocated ranks (identical ranges) can copy boundary rows locally, found without visiting every rank
    (that made the layout search's pricing grow with the world: layout=auto took 4 minutes at 16,384 ranks).

    A rank copies rows when it is a destination on the LLM's first stage and a source on the encoder's last
    stage and its two shards share samples (a, b: tp*cp of the LLM and of the encoder; n ranks):
      * both pp 1: the ranks repeat every lcm(a, b) ranks: a period shifts both DP ranks by whole blocks of
        the same samples, so one period stands for all (copies = n / period);
      * LLM pp > 1, encoder pp 1: only the LLM's first stage can; its rank x holds samples from x*pp/n on and
        the encoder's from x/n on; they meet only for x < (b + pp*(a-1)) / (pp-1), a few ranks;
      * encoder pp > 1, LLM pp 1: mirrored, the last (a - 1 + b*pp) / (pp-1) ranks of the range;
      * both pp > 1: the LLM's first stage and the encoder's last stage share no rank."""
    n, a, b = dst.size, dst.tp * dst.cp, src.tp * src.cp
    if src.pp == 1 and dst.pp == 1:
        period = math.lcm(a, b)
        return _Window(np.arange(period), n // period, True, True)
    if src.pp == 1:
        stage = n // dst.pp
        width = min(stage, (b + dst.pp * (a - 1)) // (dst.pp - 1) + 1)
        return _Window(np.arange(width), 1, width == stage, False)
    if dst.pp == 1:
        stage = n // src.pp
        width = min(stage, (a - 1 + b * src.pp) // (src.pp - 1) + 1)
        return _Window(np.arange(n - width, n), 1, False, width == stage)
    return _Window(np.zeros(0, np.int64), 1, False, False)


@functools.lru_cache(maxsize=256)
def _cp_overlap(dst_cp: int, src_cp: int) -> tuple[np.ndarray, int, int]:
    """Token positions shared by [dst CP rank, src CP rank] as fractions of a sample's media tokens, and the most
    dst CP ranks one src CP rank meets and back (a few CP sizes: computed once each)."""
    rc, sc = np.arange(dst_cp), np.arange(src_cp)
    lo, hi = sc[None, :] / src_cp, (sc[None, :] + 1) / src_cp
    two = 2 * dst_cp
    first, second = zigzag_chunks(dst_cp, rc[:, None])  # dst CP rank r holds these two of 2cp chunks
    tok = (_interval_overlap(first / two, (first + 1) / two, lo, hi)
           + _interval_overlap(second / two, (second + 1) / two, lo, hi))
    tok.flags.writeable = False
    return tok, int((tok > 0).sum(0).max()), int((tok > 0).sum(1).max())


def boundary_rows(src: ModuleLayout, dst: ModuleLayout, samples: int, tokens: float) -> BoundaryRows:
    """Closed-form row counts of plan_boundary for `samples` samples of `tokens` media tokens each, evenly
    spread over the LLM sequence (so a share of positions is the same share of media tokens). Its cost does
    not grow with the world: the layout search prices it for thousands of layouts (layout=auto at 16,384 ranks)."""
    tok, src_meets, dst_meets = _cp_overlap(dst.cp, src.cp)
    total = samples * tokens
    need = total / (dst.dp_size * dst.cp)   # rows every destination rank needs (each TP replica)
    held = total / (src.dp_size * src.cp)   # rows every source rank holds
    # samples are cut into equal DP parts on both sides: a src part meets at most this many dst parts, and back
    peers = max(_most_overlapping(src.dp_size, dst.dp_size) * src_meets,
                _most_overlapping(dst.dp_size, src.dp_size) * dst_meets)
    # destination TP replica t is served by source TP replica t % src.tp: the busiest serves ceil(dst/src)
    busiest = math.ceil(dst.tp / src.tp)
    back = math.ceil(src.tp / dst.tp)  # backward: source replica t is served by destination replica t % dst.tp
    n_dst, n_src = dst.dp_size * dst.cp * dst.tp, src.dp_size * src.cp * src.tp
    if src.last < dst.first or dst.last < src.first:  # disjoint ranks: nothing is local
        return BoundaryRows(need, held * busiest, held, need * back, need * n_dst, held * n_src, peers)
    # colocated: a rank that is a first-stage destination and a last-stage source copies its own
    # source shard's rows locally, and nobody sends them to it
    win = _local_window(src, dst)
    ranks = dst.first + win.offsets
    d_tp, d_cp, d_dp, d_pp = _coords(dst, ranks)
    s_tp, s_cp, s_dp, s_pp = _coords(src, ranks)
    both = (d_pp == 0) & (s_pp == src.pp - 1)
    samp = _interval_overlap(d_dp / dst.dp_size, (d_dp + 1) / dst.dp_size, s_dp / src.dp_size,
                             (s_dp + 1) / src.dp_size)
    local = np.where(both, samp * tok[d_cp, s_cp], 0.0) * total
    fwd_recv_max = need - (local.min() if win.fwd_all and len(local) else 0.0)
    bwd_recv_max = held - (local.min() if win.bwd_all and len(local) else 0.0)
    # source TP replica t of shard (dp, cp) serves destination replicas t, t + src.tp, ...: it sends all it
    # holds to them but what they copied locally; the busiest is the replica t whose least copied shard
    # copied least (a shard the window misses copies nothing)
    shard = s_dp * src.cp + s_cp
    n_shards = src.dp_size * src.cp
    domain = len(np.unique(shard)) if win.copies > 1 else n_shards  # a period's shards stand for all
    keys, inv = np.unique((d_tp[both] % src.tp) * n_shards + shard[both], return_inverse=True)
    sums = np.bincount(inv, weights=local[both], minlength=len(keys))
    least = np.zeros(src.tp)
    for t in range(src.tp):
        mine = sums[keys // n_shards == t]
        least[t] = mine.min() if len(mine) == domain else 0.0
    counts = np.bincount(np.arange(dst.tp) % src.tp, minlength=src.tp)
    moved_local = float(local.sum()) * win.copies
    return BoundaryRows(fwd_recv_max=float(max(fwd_recv_max, 0.0)), fwd_send_max=float((counts * held - least).max()),
                        bwd_recv_max=float(bwd_recv_max), bwd_send_max=need * back,
                        fwd_moved=need * n_dst - moved_local, bwd_moved=held * n_src - moved_local, messages=peers)
