"""Samples, packed rows and microbatches, and what the heterogeneous boundary needs from them.

A microbatch is N packed rows of exactly `seq_length` tokens. Each row concatenates whole samples
(cu_seqlens marks them; a trailing padding segment makes cu_seqlens end at seq_length, so padding attends
only to itself). For every encoder module ("vision", "audio") a row also carries:
  - `positions[module]`: the sorted int64 positions of that module's tokens in the row (every rank),
  - `media_meta[module]`: (kind, units, tokens) per item in position order (every rank); an item written in
    several chunks (a video in the omni family's tubelet chunks) has a fourth entry, its chunks
    ((start, count), ...) in the row: where each chunk's context positions begin and how many there are, and
  - `media[module]`: the decoded items in the same order — only on ranks that encode some of them (data/loader.py
    decodes per rank; an item another rank encodes is None; an LLM-only rank holds no decoded media at all).
A microbatch also records which DP rank of each encoder encodes each item (`owners`, made by the loader from the
metadata: hetero/plan/encoder_balance.ItemAssignment, by cost); without it, the rank that owns the row.
Consuming items in order and scattering embeddings to `positions` is therefore the whole alignment
contract; `PackedBatch.check()` enforces it (one position per produced embedding; collate runs it on every
batch, with the encoders' counts where they run).

EVS-pruned clips in tubelet chunks: only the clip's total of kept tokens is known before encoding, so the row is
written with nominal per-tubelet counts (models/media_tokens.evs_nominal_tubelet_counts); once the vision encoder
has chosen, every rank that reads the row's layout moves the chunks to the chosen counts
(PackedBatch.settle_tubelet_chunks, driven by hetero/runtime/tubelet_settle.py). The row keeps its length, its
labels (media chunks are never targets) and every token outside the clip's chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from megatron.energon import Batch, Sample
from megatron.energon.edataclass import edataclass

from tessera.data.tokens import EncodedPrompt
from tessera.hetero.plan.resolved_run import IGNORE  # the label value that losses skip


@edataclass
class EncodedSample(Sample):
    """One sample after tokenization. `media` is filled by the post-encode step (decode), in span order."""

    prompt: EncodedPrompt
    raw_media: list  # [(kind, bytes | MediaRef)] per stored media item; decoded (or dropped) when the batch is formed
    media: list  # already decoded items [(module, kind, units, array | (frames, timestamps))] in span order,
    # or [] when the items are still raw (the loader's case)
    units: list  # predicted tiles/frames/samples per raw media item (checked against the decode)
    shard: str

    def __len__(self) -> int:
        return len(self.prompt)


@edataclass
class PackedSample(Sample):
    """One row of `seq_length` tokens built from whole samples."""

    tokens: np.ndarray  # int64 [S]
    labels: np.ndarray  # int64 [S], IGNORE where no loss
    position_ids: np.ndarray  # int64 [S], restarting at 0 for every sample
    cu_seqlens: np.ndarray  # int32 [k+1], last entry == S
    keys: list  # sample keys in row order
    media: dict  # module -> [(kind, array | (frames, timestamps))] in position order (decoded modules only)
    positions: dict  # module -> int64 sorted positions
    media_meta: dict  # module -> [(kind, units, tokens[, chunks])] in position order
    raw: dict  # module -> [(kind, bytes, units, key, shard)] awaiting decode; emptied by the task encoder


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group indices into bins of total length <= capacity; longest first, ties by index (deterministic).

    Every index ends up in a bin: energon drops what select_samples_to_pack does not return."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    # Keep buffer order inside a bin so a row reads in the order the stream delivered the samples.
    return [sorted(b) for b in bins]


def _items(spans: list[tuple[str, int, int, int]]) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """A prompt's spans grouped into its media items, in order: (module, [(start, length, item)] per chunk); a
    video in tubelet chunks is one item of several spans (data/tokens.encode_conversation)."""
    items: list[tuple[str, list[tuple[int, int, int]]]] = []
    for module, start, length, item in spans:
        if items and items[-1][1][-1][2] == item:
            items[-1][1].append((start, length, item))
        else:
            items.append((module, [(start, length, item)]))
    return items


def pack_row(samples: list[EncodedSample], seq_length: int, pad_id: int) -> PackedSample:
    tokens = np.full(seq_length, pad_id, dtype=np.int64)
    labels = np.full(seq_length, IGNORE, dtype=np.int64)
    position_ids = np.zeros(seq_length, dtype=np.int64)
    cu = [0]
    media: dict[str, list] = {}
    meta: dict[str, list] = {}
    raw: dict[str, list] = {}
    positions: dict[str, list[np.ndarray]] = {}
    for s in samples:
        p, o, n = s.prompt, cu[-1], len(s.prompt)
        if o + n > seq_length:
            raise ValueError(f"pack of {sum(map(len, samples))} tokens exceeds seq_length={seq_length}")
        tokens[o:o + n] = p.tokens
        # Label i is token i+1 of the same sample, kept only where that token is a training target; the last
        # token of a sample predicts nothing, so no loss ever crosses into the next packed sample.
        labels[o:o + n - 1] = np.where(p.target[1:], p.tokens[1:], IGNORE)
        position_ids[o:o + n] = np.arange(n)
        for j, (module, chunks) in enumerate(_items(p.spans)):
            if s.media:  # decoded before packing (tests, callers with in-memory media)
                m2, kind, units, arr = s.media[j]
                assert module == m2, "media list out of span order"
                media.setdefault(module, []).append((kind, arr))
            else:
                kind, data = s.raw_media[chunks[0][2]]
                units = s.units[chunks[0][2]]
                raw.setdefault(module, []).append((kind, data, units, s.__key__, s.shard))
            entry = (kind, units, sum(length for _, length, _ in chunks))
            # several chunks (a video's tubelets): where each begins, so their counts can be settled later
            meta.setdefault(module, []).append(
                entry if len(chunks) == 1 else (*entry, tuple((o + start, length) for start, length, _ in chunks)))
            positions.setdefault(module, []).extend(np.arange(o + start, o + start + length, dtype=np.int64)
                                                    for start, length, _ in chunks)
        cu.append(o + n)
    if cu[-1] < seq_length:
        cu.append(seq_length)
    return PackedSample(
        __key__=",".join(s.__key__ for s in samples), __restore_key__=(), __subflavors__=None, __sources__=None,
        tokens=tokens, labels=labels, position_ids=position_ids, cu_seqlens=np.asarray(cu, dtype=np.int32),
        keys=[s.__key__ for s in samples], media=media,
        positions={m: np.concatenate(v) for m, v in positions.items()}, media_meta=meta, raw=raw)


def _boundary_batch_cls():
    """hetero.plan.boundary_plan.BoundaryBatch when present; a field-identical stand-in otherwise."""
    try:
        from tessera.hetero.plan.boundary_plan import BoundaryBatch

        return BoundaryBatch
    except ImportError:
        @dataclasses.dataclass(frozen=True)
        class BoundaryBatch:
            seq_length: int
            positions: tuple
            sources: tuple | None = None

        return BoundaryBatch


@edataclass
class PackedBatch(Batch):
    """One global microbatch of N rows. Identical on every rank; data/sharding.py cuts each rank's part."""

    tokens: torch.Tensor  # int64 [N, S]
    labels: torch.Tensor  # int64 [N, S]
    position_ids: torch.Tensor  # int64 [N, S]
    cu_seqlens: list  # N int32 tensors (THD boundaries per row)
    keys: list  # N lists of sample keys
    media: list  # N dicts module -> decoded items (only the modules/rows this rank decodes)
    positions: list  # N dicts module -> int64 positions (every rank, every row)
    media_meta: list  # N dicts module -> [(kind, units, tokens[, chunks])] (every rank, every row)
    seq_length: int
    skipped: dict  # reason -> count, skips observed by the producing worker since its previous batch
    read_bytes: int = 0  # bytes the producing worker read from the shards since its previous batch
    # module -> (DP size, per row the DP rank encoding each item): ItemAssignment.owners; {}: the rows' owners
    owners: dict = dataclasses.field(default_factory=dict)

    @property
    def modules(self) -> list[str]:
        return sorted({m for row in self.positions for m in row})

    def real_tokens(self) -> int:
        """Tokens of the packed samples, the padding after a row's last sample left out (cu_seqlens[len(keys)])."""
        return int(sum(int(cu[len(keys)]) for cu, keys in zip(self.cu_seqlens, self.keys)))

    def module_positions(self, module: str) -> tuple[np.ndarray, ...]:
        empty = np.zeros(0, dtype=np.int64)
        return tuple(row.get(module, empty) for row in self.positions)

    def item_owners(self, module: str, dp_size: int) -> tuple[tuple[int, ...], ...]:
        """Per row, the DP rank (of the module's dp_size) that encodes each of the row's items of `module`: the
        loader's assignment (`owners`), else the row's owner (row ownership)."""
        from tessera.hetero.plan.encoder_balance import row_owners

        if module not in self.owners:
            return row_owners(self.media_meta, module, dp_size)
        dp, per_row = self.owners[module]
        if dp != dp_size:
            raise ValueError(f"{module}: the microbatch's items were assigned over dp={dp} but the layout has "
                             f"dp={dp_size}; the loader must be built with the run's layout")
        return per_row

    def element_sources(self, module: str) -> tuple[np.ndarray, ...] | None:
        """Per row, the encoding DP rank of each of the module's media tokens (its item's owner, in position order);
        None under row ownership, which the boundary plan derives from the row itself."""
        if module not in self.owners:
            return None
        _, per_row = self.owners[module]
        return tuple(np.repeat(np.asarray(own, dtype=np.int64), [m[2] for m in meta.get(module, [])])
                     for own, meta in zip(per_row, self.media_meta))

    def boundary_batches(self, modules: list[str] | None = None) -> dict[str, Any]:
        """module key -> BoundaryBatch(seq_length, one sorted int64 array per row, each token's encoding DP rank
        when the items were assigned by cost) for hetero/boundary_plan."""
        cls = _boundary_batch_cls()
        return {m: cls(seq_length=self.seq_length, positions=self.module_positions(m),
                       sources=self.element_sources(m))
                for m in (modules if modules is not None else self.modules)}

    def rows(self, lo: int, hi: int) -> "PackedBatch":
        """Rows [lo, hi) as a batch of their own (what one DP rank keeps)."""
        return PackedBatch.derive_from(
            self, tokens=self.tokens[lo:hi], labels=self.labels[lo:hi], position_ids=self.position_ids[lo:hi],
            cu_seqlens=self.cu_seqlens[lo:hi], keys=self.keys[lo:hi], media=self.media[lo:hi],
            positions=self.positions[lo:hi], media_meta=self.media_meta[lo:hi], seq_length=self.seq_length,
            skipped=dict(self.skipped), read_bytes=self.read_bytes,
            owners={m: (dp, own[lo:hi]) for m, (dp, own) in self.owners.items()})

    def chunked_items(self, module: str) -> list[tuple[int, int, tuple]]:
        """(row, item index, chunks) of every item of `module` written in several chunks, in row and item order:
        the same list on every rank (it comes from the metadata)."""
        return [(r, j, m[3]) for r, meta in enumerate(self.media_meta) for j, m in enumerate(meta.get(module, []))
                if len(m) > 3]

    def settle_tubelet_chunks(self, module: str, counts: dict[tuple[int, int], list[int]]) -> None:
        """Move each chunked item's chunks to its per-chunk `counts` {(row, item index): [count per chunk]}, in
        place: the row's tokens in the item's chunks, the module's positions and the item's metadata. Each
        count list sums to the item's tokens; the text between chunks (a chunk's </img>, the next one's label and
        <img>) moves with them, so the result is the sequence the release's processor writes with these counts
        (what transformers' forward keeps of it under EVS: input_ids[retention_mask])."""
        for (r, j), new in counts.items():
            meta = self.media_meta[r][module]
            kind, units, total, chunks = meta[j]
            if len(new) != len(chunks) or sum(new) != total or min(new) < 0:
                raise ValueError(f"row {r} {module} item {j}: counts {list(new)} do not settle {len(chunks)} chunks "
                                 f"of {total} tokens")
            tokens, row = settle_chunks(self.tokens[r].numpy(), chunks, new)
            self.tokens[r] = torch.from_numpy(tokens)
            offset = sum(m[2] for m in meta[:j])
            pos = self.positions[r][module].copy()
            pos[offset:offset + total] = np.concatenate([np.arange(a, a + n) for a, n in row])
            self.positions[r][module] = pos
            meta[j] = (kind, units, total, row)

    def check(self, count_tokens=None) -> None:
        """Raise unless the alignment contract holds: per row and module, positions strictly increasing, the
        metadata's planned tokens == positions to fill, no loss on the token before a media slot, and (with
        count_tokens) embeddings produced == positions. collate() runs it without count_tokens on every batch
        (metadata and positions only: a few array ops per row); the encoders' counts are known where they run.

        count_tokens(kind, item) is the encoder's output count for one decoded item; rows/modules this rank
        did not decode (and items another rank encodes) are checked against their metadata (what the encoding rank
        will produce)."""
        for r, (media, meta, pos) in enumerate(zip(self.media, self.media_meta, self.positions)):
            for module in set(media) | set(meta) | set(pos):
                p = pos.get(module, np.zeros(0, dtype=np.int64))
                where = f"packed row {r} ({', '.join(self.keys[r]) if self.keys else self.__key__[r]}) {module}"
                planned = sum(m[2] for m in meta.get(module, []))
                if planned != len(p):
                    raise ValueError(f"{where}: metadata plans {planned} tokens for {len(p)} positions")
                if count_tokens is not None and module in media:
                    # an item another rank encodes (None here) is counted from its metadata
                    produced = sum(count_tokens(k, a) if a is not None else m[2]
                                   for (k, a), m in zip(media[module], meta.get(module, []), strict=True))
                    if produced != len(p):
                        raise ValueError(f"{where}: {produced} embeddings for {len(p)} positions")
                if np.any(np.diff(p) <= 0):
                    raise ValueError(f"{where}: media positions not strictly increasing (two items' tokens overlap "
                                     f"or are out of order)")
                # A media token is an embedding slot, never a prediction target.
                prev = p[p > 0] - 1
                if not bool((self.labels[r, prev.tolist()] == IGNORE).all()):
                    raise ValueError(f"{where}: a loss on the token before a media slot")


def settle_chunks(tokens: np.ndarray, chunks: tuple, counts: list[int]) -> tuple[np.ndarray, tuple]:
    """(row tokens, chunks) with an item's chunks ((start, count), ...) moved to `counts`: each chunk keeps
    its context token and the text that follows it up to the next chunk (so the region from the first chunk's
    start to the last chunk's end keeps its length when the counts keep their sum). Pure: a new array."""
    context = next(int(tokens[a]) for a, n in chunks if n)
    gaps = [tokens[a + n:b].copy() for (a, n), (b, _) in zip(chunks, chunks[1:])]  # the text between chunks
    out, at, placed = tokens.copy(), chunks[0][0], []
    for c, count in enumerate(counts):
        out[at:at + count] = context
        placed.append((at, count))
        at += count
        if c < len(gaps):
            out[at:at + len(gaps[c])] = gaps[c]
            at += len(gaps[c])
    assert at == chunks[-1][0] + chunks[-1][1], "settled chunks must keep the region's length"
    return out, tuple(placed)


#: Arrays at least this large leave a loader worker through shared memory instead of the pickle stream.
SHARE_MIN_BYTES = 1 << 18


def _rebuild_ndarray(t: torch.Tensor) -> np.ndarray:
    return t.numpy()  # the array keeps the tensor, and so its shared-memory mapping, alive


def _reduce_ndarray(a: np.ndarray):
    if (a.nbytes < SHARE_MIN_BYTES or not a.flags.writeable or a.dtype.hasobject or a.dtype.byteorder == ">"
            or min(a.strides, default=0) < 0):
        return a.__reduce__()
    return _rebuild_ndarray, (torch.from_numpy(a),)


def share_large_arrays() -> None:
    """In a loader worker, send decoded media to the main process through shared memory (idempotent).

    Media items are numpy arrays (data/media.py), and multiprocessing pickles numpy arrays into the result
    pipe: for 1-2 MB per tile that was a pickle copy and a pipe write in the worker plus a pipe read and an
    unpickle copy in the main process — 7 ms per 7-tile image, more than decoding it, and the main process
    (which also trains) paid half. torch tensors travel as shared-memory handles instead, so large arrays
    are sent as a tensor view of the same memory and rebuilt as the same numpy array (shape, strides and
    dtype unchanged) on arrival. Registered only inside worker processes; small arrays pickle as before."""
    from multiprocessing.reduction import ForkingPickler

    if torch.utils.data.get_worker_info() is not None and np.ndarray not in ForkingPickler._extra_reducers:
        ForkingPickler.register(np.ndarray, _reduce_ndarray)


def collate(rows: list[PackedSample], skipped: dict, read_bytes: int = 0, owners: dict | None = None) -> PackedBatch:
    share_large_arrays()
    batch = PackedBatch(
        __key__=[r.__key__ for r in rows], __restore_key__=(), __subflavors__=None, __sources__=None,
        tokens=torch.from_numpy(np.stack([r.tokens for r in rows])),
        labels=torch.from_numpy(np.stack([r.labels for r in rows])),
        position_ids=torch.from_numpy(np.stack([r.position_ids for r in rows])),
        cu_seqlens=[torch.from_numpy(r.cu_seqlens) for r in rows], keys=[r.keys for r in rows],
        media=[r.media for r in rows], positions=[r.positions for r in rows],
        media_meta=[r.media_meta for r in rows], seq_length=len(rows[0].tokens), skipped=skipped,
        read_bytes=read_bytes, owners=owners or {})
    batch.check()  # every batch the loader builds keeps the alignment contract (metadata and positions)
    return batch
