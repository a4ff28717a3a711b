"""The zigzag split of a sequence over context-parallel ranks, written once (pure; no torch.distributed).

The sequence of length S is cut into 2*cp equal chunks and CP rank r holds chunks r and 2cp-1-r, in that
order, so every rank does the same amount of causal-attention work. Everything that places tokens on CP
ranks imports this: the boundary plan, the CP attention and Mamba kernels, the training stages, the parity
tools and the planner's closed-form boundary rows. numpy only at import (the boundary plan is torch-free);
the two tensor helpers import torch when called.
"""

from __future__ import annotations

import numpy as np


def zigzag_multiple(cp: int) -> int:
    """A sequence split over `cp` ranks must be a multiple of this long: 2*cp equal chunks (the one rule)."""
    return 2 * cp


def zigzag_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2*cp) that CP rank `cp_rank` holds, in local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def zigzag_owner(chunk: np.ndarray, cp: int) -> np.ndarray:
    """The CP rank holding each chunk index (of 2*cp)."""
    return np.where(chunk < cp, chunk, 2 * cp - 1 - chunk)


def zigzag_local_offset(pos: np.ndarray, seq_length: int, cp: int) -> np.ndarray:
    """Where global position `pos` sits in its owner's local sequence (first chunk, then the mirrored one)."""
    chunk_len = seq_length // (2 * cp)
    chunk = pos // chunk_len
    return np.where(chunk < cp, 0, chunk_len) + pos - chunk * chunk_len


def zigzag_positions(seq_length: int, cp: int, cp_rank: int) -> np.ndarray:
    """Global positions held by CP rank `cp_rank`: chunk r then chunk 2cp-1-r of 2cp equal chunks."""
    if cp == 1:
        return np.arange(seq_length)
    chunk = seq_length // (2 * cp)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in zigzag_chunks(cp, cp_rank)])


def zigzag_rank_positions(local_len: int, cp: int) -> list[np.ndarray]:
    """Global positions held by each CP rank when every rank holds `local_len` tokens."""
    return [zigzag_positions(local_len * cp, cp, r) for r in range(cp)]


def zigzag_shard(x, cp: int, cp_rank: int, dim: int):
    """This CP rank's zigzag slice of a full-sequence tensor along `dim`."""
    import torch

    idx = torch.as_tensor(zigzag_positions(x.shape[dim], cp, cp_rank), device=x.device)
    return x.index_select(dim, idx)


def zigzag_unshard(gathered, cp: int, dim: int = 0):
    """Inverse of zigzag sharding: `gathered` is every rank's slice concatenated in rank order along
    `dim`; returns the tensor in natural sequence order."""
    import torch

    local = gathered.shape[dim] // cp
    order = torch.as_tensor(np.concatenate(zigzag_rank_positions(local, cp)), device=gathered.device)
    out = torch.empty_like(gathered)
    out.index_copy_(dim, order, gathered)
    return out
