"""Boundary plans: which rank sends which rows of the encoder output to whom. Pure functions, no torch.

An encoder module produces embeddings for its media tokens; the LLM ("language") consumes them at given
positions of its fused sequence. Both sides shard the same elements differently:

* element g = (sample i, media token j); samples are split over DP, media tokens of one sample over CP.
* source (encoder, last PP stage): DP rank d holds samples [d*N/dp, (d+1)*N/dp), or, when the items were
  assigned by cost (hetero/plan/encoder_balance.py: `sources` names each token's encoding DP rank), the tokens of
  the items it encodes; within a sample the media tokens one DP rank holds are cut into cp contiguous parts as
  evenly as possible (encoders attend bidirectionally, so contiguous parts are already balanced). Every TP rank
  of a (dp, cp) shard holds the same rows.
* destination (language, first PP stage): DP as above with its own dp; the LLM sequence of S positions is
  cut into 2*cp chunks and CP rank r keeps chunks r and 2cp-1-r (zigzag, balances causal attention); a
  media token belongs to the CP rank whose chunk holds its position. Every TP rank needs the rows.

A rank's tensor holds its elements in (sample, token) order: as [rows, hidden] ("tokens"), or for the
destination also "dense" [local samples, S/cp, hidden] with each media row at its local sequence slot.

Forward: every destination rank receives each element it needs exactly once, from a source rank that
holds it; if the rank itself holds it in the source layout the row is copied locally and never sent.
Backward: every source rank (each TP replica needs the full gradient) receives each of its elements'
gradient exactly once from one destination TP replica (they all hold the same gradient after TP's
backward all-reduce, so it is counted once). At the granularity of (dp, cp) shards the backward plan
moves every element along the forward edge reversed: it is the forward plan's transpose.
Shapes follow from the metadata every rank has, so no shape handshake is ever sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tessera.hetero.plan.layout import ModuleLayout
from tessera.hetero.plan.resolved_run import dp_owner
from tessera.hetero.plan.zigzag import zigzag_local_offset, zigzag_multiple, zigzag_owner


class BoundaryError(ValueError):
    """Metadata that does not fit the layouts; the message names what and how to fix it."""


@dataclass(frozen=True)
class BoundaryBatch:
    """Per-microbatch metadata every rank of every module has (it comes with the batch).

    seq_length: the LLM sequence length S (per sample, packed).
    positions: one sorted int array per sample: where this encoder's media tokens sit in that sample's
        LLM sequence. Its length is the number of media tokens the encoder produces for the sample.
    sources: None (each sample's tokens are encoded by the sample's DP rank), or one int array per sample
        aligned with `positions`: the encoder DP rank that encodes each token (its item's, by cost).
    """

    seq_length: int
    positions: tuple[np.ndarray, ...]
    sources: tuple[np.ndarray, ...] | None = None

    @classmethod
    def from_lists(cls, seq_length: int, positions: Sequence[Sequence[int]],
                   sources: Sequence[Sequence[int]] | None = None) -> "BoundaryBatch":
        return cls(seq_length, tuple(np.asarray(p, dtype=np.int64) for p in positions),
                   None if sources is None else tuple(np.asarray(s, dtype=np.int64) for s in sources))

    @property
    def num_samples(self) -> int:
        return len(self.positions)

    @property
    def tokens_per_sample(self) -> np.ndarray:
        return np.array([len(p) for p in self.positions], dtype=np.int64)

    def validate(self) -> None:
        for i, p in enumerate(self.positions):
            if p.ndim != 1:
                raise BoundaryError(f"sample {i}: media positions must be a 1-D array, got shape {p.shape}")
            if len(p) and (p[0] < 0 or p[-1] >= self.seq_length):
                raise BoundaryError(f"sample {i}: media positions must lie in [0, {self.seq_length}); "
                                    f"got {p[0]}..{p[-1]}: the sample does not fit the sequence length")
            if np.any(np.diff(p) <= 0):
                raise BoundaryError(f"sample {i}: media positions must be strictly increasing (one token per "
                                    f"position, in sequence order)")
            if self.sources is not None and len(self.sources[i]) != len(p):
                raise BoundaryError(f"sample {i}: {len(self.sources[i])} source ranks for {len(p)} media tokens")

    def source_dp(self, dp_size: int) -> np.ndarray:
        """Per element g (in (sample, token) order): the source DP rank that encodes it."""
        if self.sources is None:
            sample, _ = _sample_and_token(self)
            return dp_owner(sample, self.num_samples, dp_size)
        src = np.concatenate(self.sources) if self.num_samples else np.zeros(0, np.int64)
        if len(src) and (src.min() < 0 or src.max() >= dp_size):
            raise BoundaryError(f"source ranks {src.min()}..{src.max()} outside the encoder's dp={dp_size}: the "
                                f"items were assigned for another layout")
        return src

    def source_parts(self, src: ModuleLayout) -> tuple[np.ndarray, np.ndarray]:
        """Per element: (source DP rank, source CP rank). A DP rank's tokens of one sample (all of the sample's
        under row ownership) are cut into src.cp contiguous parts, the order its encoder stage hands them on."""
        sample, token = _sample_and_token(self)
        src_dp = self.source_dp(src.dp_size)
        if self.sources is None:
            return src_dp, contiguous_part(token, self.tokens_per_sample[sample], src.cp)
        group = sample * src.dp_size + src_dp
        in_group = _rank_in_group(group)
        size = np.bincount(group, minlength=1)[group] if len(group) else group
        return src_dp, contiguous_part(in_group, size, src.cp)


@dataclass(frozen=True)
class Transfer:
    """Rows src_index of src_rank's input go to rows dst_index of dst_rank's output (same order)."""

    src_rank: int
    dst_rank: int
    src_index: np.ndarray
    dst_index: np.ndarray

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class DirectionPlan:
    """One direction of a boundary: every rank's input rows, output rows and the transfers between them."""

    in_rows: dict[int, int]   # ranks holding an input tensor -> its number of rows
    out_rows: dict[int, int]  # ranks producing an output tensor -> its number of rows
    transfers: tuple[Transfer, ...]

    def sends(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src_rank == rank and not t.local]

    def recvs(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst_rank == rank and not t.local]

    def locals(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src_rank == rank and t.local]

    def rows_moved(self) -> int:
        return sum(len(t.src_index) for t in self.transfers if not t.local)


@dataclass(frozen=True)
class BoundaryPlan:
    forward: DirectionPlan
    backward: DirectionPlan
    dst_format: str
    dst_shape: dict[int, tuple[int, ...]]  # destination rank -> output shape without the hidden dim

    def written(self, rank: int) -> np.ndarray:
        """Which of `rank`'s output rows (bool, dst_shape[rank]) the forward writes: where the media go. The one
        place media positions become destination rows; the LLM reads this instead of placing them again."""
        mask = np.zeros(self.dst_shape.get(rank, (0,)), dtype=bool)
        for t in self.forward.transfers:
            if t.dst_rank == rank:
                mask.reshape(-1)[t.dst_index] = True
        return mask


@dataclass(frozen=True)
class _Elements:
    """Per-element shard coordinates and local row indices on both sides (arrays over all elements g)."""

    sample: np.ndarray
    src_dp: np.ndarray
    src_cp: np.ndarray
    src_row: np.ndarray
    dst_dp: np.ndarray
    dst_cp: np.ndarray
    dst_row: np.ndarray


def contiguous_part(token: np.ndarray, count: np.ndarray, parts: int) -> np.ndarray:
    """Index of the part holding `token` when `count` tokens are cut into `parts` near-equal contiguous
    parts (the first count % parts parts get one extra token, like numpy.array_split)."""
    base, extra = count // parts, count % parts
    head = extra * (base + 1)  # tokens in the larger leading parts
    in_tail = (token - head) // np.maximum(base, 1)
    return np.where(token < head, token // (base + 1), extra + in_tail)


def _rank_in_group(keys: np.ndarray) -> np.ndarray:
    """For each element, how many elements with the same key come before it (elements are in g order)."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_keys)) + 1]
    first_of_group = np.repeat(starts, np.diff(np.r_[starts, len(keys)]))
    rank = np.empty_like(keys)
    rank[order] = np.arange(len(keys)) - first_of_group
    return rank


def _sample_and_token(batch: BoundaryBatch) -> tuple[np.ndarray, np.ndarray]:
    """Per element g: its sample i and its media-token index j within the sample."""
    counts = batch.tokens_per_sample
    sample = np.repeat(np.arange(batch.num_samples, dtype=np.int64), counts)
    token = np.arange(len(sample), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return sample, token


def _elements(src: ModuleLayout, dst: ModuleLayout, batch: BoundaryBatch, dst_format: str) -> _Elements:
    n, seq = batch.num_samples, batch.seq_length
    for side, layout in (("source", src), ("destination", dst)):
        if n % layout.dp_size:
            raise BoundaryError(f"{side} dp={layout.dp_size} does not divide the {n} samples of the microbatch; "
                                f"use a multiple of {layout.dp_size} samples")
    if seq % zigzag_multiple(dst.cp):
        raise BoundaryError(f"seq_length={seq} is not divisible by 2*cp={zigzag_multiple(dst.cp)} of the destination; "
                            f"pad it")
    batch.validate()
    sample, _ = _sample_and_token(batch)
    pos = np.concatenate(batch.positions) if n else np.zeros(0, np.int64)

    src_dp, src_cp = batch.source_parts(src)
    src_row = _rank_in_group(src_dp * src.cp + src_cp)  # a source rank's rows: its elements in (sample, token) order

    dst_dp = dp_owner(sample, n, dst.dp_size)
    chunk_len = seq // zigzag_multiple(dst.cp)
    chunk = pos // chunk_len
    dst_cp = zigzag_owner(chunk, dst.cp)
    if dst_format == "tokens":
        dst_row = _rank_in_group(dst_dp * dst.cp + dst_cp)
    elif dst_format == "dense":
        # local slot: the rank's first chunk then its mirrored chunk, each chunk_len long
        slot = zigzag_local_offset(pos, seq, dst.cp)
        local_sample = sample - dst_dp * (n // dst.dp_size)
        dst_row = local_sample * (seq // dst.cp) + slot
    else:
        raise BoundaryError(f"dst_format={dst_format!r}: use 'tokens' ([rows, hidden]) or 'dense' "
                            f"([samples, seq/cp, hidden])")
    return _Elements(sample, src_dp, src_cp, src_row, dst_dp, dst_cp, dst_row)


def _route(receivers: list[tuple[int, np.ndarray, np.ndarray]], recv_rows: np.ndarray,
           send_rows: np.ndarray) -> list[Transfer]:
    """Group each receiver's needed elements by the rank that will send them into one Transfer per pair.

    receivers: (rank, element ids it needs, sender rank per needed element); rows index both sides.
    """
    transfers = []
    for rank, elems, senders in receivers:
        for sender in np.unique(senders):
            pick = elems[senders == sender]
            transfers.append(Transfer(int(sender), rank, send_rows[pick], recv_rows[pick]))
    return transfers


def _receivers(recv: ModuleLayout, recv_stage: int, recv_dp, recv_cp, send: ModuleLayout, send_stage: int,
               send_dp, send_cp):
    """For every receiving rank (each TP replica of each (dp, cp) shard on its stage): the elements it
    holds and, per element, the rank that sends it — the rank itself when it also holds the element on
    the other side (colocated: nothing is sent), else a sending TP replica chosen round-robin by the
    receiver's TP rank so that replicas share the sending."""
    for dp in range(recv.dp_size):
        for cp in range(recv.cp):
            elems = np.flatnonzero((recv_dp == dp) & (recv_cp == cp))
            for tp in range(recv.tp):
                rank = recv.rank_of(tp, cp, dp, recv_stage)
                sender_tp = np.full(len(elems), tp % send.tp)
                mine = send.coord(rank)
                if mine is not None and mine.pp == send_stage:
                    held = (send_dp[elems] == mine.dp) & (send_cp[elems] == mine.cp)
                    sender_tp[held] = mine.tp
                senders = send.first + sender_tp + send.tp * (send_cp[elems] + send.cp * (
                    send_dp[elems] + send.dp_size * send_stage))
                yield rank, elems, senders


def plan_boundary(src: ModuleLayout, dst: ModuleLayout, batch: BoundaryBatch,
                  dst_format: str = "tokens") -> BoundaryPlan:
    """The forward and backward transfers of one encoder -> language boundary for one microbatch."""
    e = _elements(src, dst, batch, dst_format)
    src_last, n = src.pp - 1, batch.num_samples
    fwd = list(_receivers(dst, 0, e.dst_dp, e.dst_cp, src, src_last, e.src_dp, e.src_cp))
    bwd = list(_receivers(src, src_last, e.src_dp, e.src_cp, dst, 0, e.dst_dp, e.dst_cp))
    if dst_format == "tokens":
        dst_shape = {rank: (len(elems),) for rank, elems, _ in fwd}
    else:
        dst_shape = {rank: (n // dst.dp_size, batch.seq_length // dst.cp) for rank, _, _ in fwd}
    out_rows = {rank: int(np.prod(shape)) for rank, shape in dst_shape.items()}
    src_rows = {rank: len(elems) for rank, elems, _ in bwd}
    forward = DirectionPlan(src_rows, out_rows, tuple(_route(fwd, e.dst_row, e.src_row)))
    backward = DirectionPlan(out_rows, src_rows, tuple(_route(bwd, e.src_row, e.dst_row)))
    return BoundaryPlan(forward, backward, dst_format, dst_shape)


def minimum_rows(src: ModuleLayout, dst: ModuleLayout, batch: BoundaryBatch) -> tuple[int, int]:
    """Lower bound on rows moved (forward, backward), counted from element sets, independently of any plan.

    Forward: every first-stage destination rank must receive each element it needs, except those it
    already holds as a last-stage source rank. Backward: mirrored.
    """
    e = _elements(src, dst, batch, "tokens")
    fwd = bwd = 0
    for rank in dst.ranks:
        c = dst.coord(rank)
        if c.pp:
            continue
        need = (e.dst_dp == c.dp) & (e.dst_cp == c.cp)
        s = src.coord(rank)
        if s is not None and s.pp == src.pp - 1:
            need &= ~((e.src_dp == s.dp) & (e.src_cp == s.cp))
        fwd += int(need.sum())
    for rank in src.ranks:
        c = src.coord(rank)
        if c.pp != src.pp - 1:
            continue
        need = (e.src_dp == c.dp) & (e.src_cp == c.cp)
        d = dst.coord(rank)
        if d is not None and d.pp == 0:
            need &= ~((e.dst_dp == d.dp) & (e.dst_cp == d.cp))
        bwd += int(need.sum())
    return fwd, bwd


def source_shard(src: ModuleLayout, batch: BoundaryBatch, dp: int, cp: int) -> np.ndarray:
    """Global element ids held by the source (dp, cp) shard, in its row order."""
    src_dp, src_cp = batch.source_parts(src)
    return np.flatnonzero((src_dp == dp) & (src_cp == cp))
