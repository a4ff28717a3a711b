"""Vision-encoder context parallelism: which patches of which tiles each CP rank computes. Pure (numpy).

The boundary plan (hetero/plan/boundary_plan.py) cuts each sample's media tokens into cp contiguous parts
(`contiguous_part`) and expects CP rank r of the encoder to hand on part r. A vision token is one pixel-shuffle
block of f x f patches of one tile (or video frame), tokens in (item, tile, block row, block col) order. So rank
r computes exactly the patches of its tokens' blocks, and the ViT's attention, which mixes patches only within a
tile, gathers the keys/values of a tile from every rank holding some of it (per-tile masks: patches of different
tiles and images never attend to each other; hetero/parallel/cp_tile_attention.py).

A tile's prefix (cls/register) tokens are computed once, by the rank holding the tile's first token; the other
ranks of the tile see them only as gathered keys/values. Every token of the single-device computation is thus
computed by exactly one rank from the same inputs, so the forward is the single-device one with its work split,
and the gradients summed over the CP group (with the gathers' backward) are the single-device gradients.

A rank's local sequence is, tile after tile in token order, [the tile's prefix tokens if it owns them] + [its
patches of the tile, block by block, each block's f*f patches in pixel_shuffle's channel order (row offset
slowest)]: dropping the prefix rows and reshaping gives the shuffled tokens directly, in the boundary's order.

    plan = plan_vision_cp([[(32, 32), (32, 32)], [(16, 48)]], shuffle=2, prefix_tokens=8, cp=2)
    plan.parts[r]        # rank r's TileParts
    plan.key_index(r)    # per TilePart of rank r: its tile's rows in the gathered (rank-major) sequence
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tessera.hetero.plan.boundary_plan import contiguous_part
from tessera.hetero.plan.layout import VISION

# How an encoder module runs on a rank, decided once from its key and layout (encoder_path); the stage
# dispatches on it and the media module refuses an entry point that is not its path's:
#   items     cp1, pp1: each item through MediaModule.forward;
#   pipeline  pp > 1: the tower split over stages, MediaModule.forward_stage;
#   token_cp  vision cp > 1: each CP rank computes its part of every row's tokens, MediaModule.forward_cp;
#   item_cp   another encoder at cp > 1: items dealt over CP ranks (item_owners), each through forward,
#             outputs gathered (its convolution and subsampling windows cross any cut of a clip).
ENCODER_PATHS = ("items", "pipeline", "token_cp", "item_cp")


def encoder_path(key: str, cp: int, pp: int) -> str:
    """The one decision of how encoder `key` runs at `cp` x `pp` (ENCODER_PATHS); cp and pp together are
    refused by the trainability rule (hetero/plan/trainable.py) before any module exists."""
    if cp > 1 and pp > 1:
        raise ValueError(f"{key}: cp{cp} with pp{pp}; an encoder splits over cp or pp, not both")
    if cp > 1:
        return "token_cp" if key == VISION else "item_cp"
    return "pipeline" if pp > 1 else "items"


@dataclass(frozen=True)
class TilePart:
    """What one CP rank computes of one tile."""

    tile: int            # index in the concatenated tile list of all rows
    grid: tuple[int, int]  # the tile's patch grid (rows, cols)
    prefix: bool         # this rank computes the tile's prefix tokens
    patches: np.ndarray  # patch indices (row-major in the grid), block by block in pixel_shuffle order

    def length(self, prefix_tokens: int) -> int:
        return (prefix_tokens if self.prefix else 0) + len(self.patches)


@dataclass(frozen=True)
class VisionCPPlan:
    parts: tuple[tuple[TilePart, ...], ...]  # per CP rank, in its local sequence order
    prefix_tokens: int
    shuffle: int

    @property
    def cp(self) -> int:
        return len(self.parts)

    def lengths(self) -> list[int]:
        """Every rank's local sequence length (prefix + patches): the gathers' row counts."""
        return [sum(p.length(self.prefix_tokens) for p in parts) for parts in self.parts]

    def tokens(self, rank: int) -> int:
        """Shuffled tokens rank `rank` hands on (its contiguous parts of every row)."""
        return sum(len(p.patches) for p in self.parts[rank]) // self.shuffle ** 2

    def key_index(self, rank: int) -> list[np.ndarray]:
        """Per TilePart of `rank`: the rows of the gathered sequence (every rank's local sequence, rank after
        rank) that belong to its tile — the keys/values its queries attend to."""
        rows: dict[int, list[np.ndarray]] = {}
        offset = 0
        for parts in self.parts:
            for p in parts:
                n = p.length(self.prefix_tokens)
                rows.setdefault(p.tile, []).append(np.arange(offset, offset + n, dtype=np.int64))
                offset += n
        return [np.concatenate(rows[p.tile]) for p in self.parts[rank]]


def block_patches(tokens: np.ndarray, cols: int, shuffle: int) -> np.ndarray:
    """Patch indices of shuffled tokens `tokens` (row-major in a tile of `cols` patch columns), f*f per token in
    pixel_shuffle's order: token (i, j) is patches (fi + a, fj + b) for a, then b, in range(f)."""
    i, j = np.divmod(tokens, cols // shuffle)
    a, b = np.divmod(np.arange(shuffle * shuffle), shuffle)
    return ((shuffle * i[:, None] + a) * cols + shuffle * j[:, None] + b).reshape(-1)


def plan_vision_cp(rows: Sequence[Sequence[tuple[int, int]]], shuffle: int, prefix_tokens: int,
                   cp: int) -> VisionCPPlan:
    """rows: per sample (row of the microbatch, in order), the patch grids (rows, cols) of its tiles in token
    order (an image's tiles, a video's frames). Each row's tokens are cut over the cp ranks as the boundary
    plan cuts them."""
    if cp < 1:
        raise ValueError(f"cp={cp}: must be >= 1")
    parts: list[list[TilePart]] = [[] for _ in range(cp)]
    tile = 0
    for grids in rows:
        for g in grids:
            if g[0] % shuffle or g[1] % shuffle:
                raise ValueError(f"patch grid {g[0]}x{g[1]} is not divisible by the pixel-shuffle factor {shuffle}")
        counts = np.array([(r // shuffle) * (c // shuffle) for r, c in grids], dtype=np.int64)
        total = int(counts.sum())
        owner = contiguous_part(np.arange(total, dtype=np.int64), np.int64(total), cp) if total else np.zeros(0, int)
        start = 0
        for (r, c), n in zip(grids, counts):
            mine = owner[start:start + n]
            for rank in np.unique(mine):
                tokens = np.flatnonzero(mine == rank)
                parts[int(rank)].append(TilePart(tile, (r, c), bool(mine[0] == rank),
                                                 block_patches(tokens, c, shuffle)))
            start += n
            tile += 1
    return VisionCPPlan(tuple(tuple(p) for p in parts), prefix_tokens, shuffle)


# ---- item-parallel CP (the audio encoder): whole items per rank, outputs gathered, each rank keeps its part ----
# A conformer's convolution and subsampling windows cross any cut of a clip, but clips are encoded each on its own
# (hetero/training/stages.py), so CP can split a microbatch's *items*: each rank encodes the items dealt to it,
# the outputs are all-gathered over the CP group (backward: each item's gradient summed back to its encoder), and
# each rank keeps the boundary plan's contiguous part of every row's tokens. Exact by construction.

def item_owners(tokens_per_item: Sequence[Sequence[int]], cp: int) -> list[list[int]]:
    """Per row, per item: the CP rank that encodes it. All items of the microbatch are dealt largest first to the
    rank with the fewest tokens so far (ties: the lower rank), so every rank computes the same deal."""
    flat = [(n, r, j) for r, row in enumerate(tokens_per_item) for j, n in enumerate(row)]
    load = [0] * cp
    owners = [[0] * len(row) for row in tokens_per_item]
    for n, r, j in sorted(flat, key=lambda t: (-t[0], t[1], t[2])):
        q = min(range(cp), key=lambda i: (load[i], i))
        owners[r][j] = q
        load[q] += n
    return owners


def item_cp_index(tokens_per_item: Sequence[Sequence[int]], owners: Sequence[Sequence[int]], cp: int,
                  rank: int) -> np.ndarray:
    """Rows of the gathered outputs (rank after rank, each rank's items in (row, item) order) that make up
    `rank`'s part: for each row in order, the contiguous part `rank` of the row's tokens (as the boundary plan
    cuts them)."""
    start, offset = {}, 0  # (row, item) -> its first row in the gathered sequence
    for q in range(cp):
        for r, row in enumerate(tokens_per_item):
            for j, n in enumerate(row):
                if owners[r][j] == q:
                    start[r, j] = offset
                    offset += n
    out = []
    for r, row in enumerate(tokens_per_item):
        full = np.concatenate([np.arange(start[r, j], start[r, j] + n) for j, n in enumerate(row)] +
                              [np.zeros(0, np.int64)]).astype(np.int64)
        if len(full):
            out.append(full[contiguous_part(np.arange(len(full)), np.int64(len(full)), cp) == rank])
    return np.concatenate(out) if out else np.zeros(0, np.int64)
