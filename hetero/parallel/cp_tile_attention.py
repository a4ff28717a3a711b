"""Context-parallel core attention for the vision encoder (models/vision_cp.py): a megatron spec submodule.

Each CP rank holds parts of tiles (hetero/plan/encoder_cp.py) flattened into one [T, 1] sequence; a tile's
queries must see every key of the tile, wherever it lives. So every layer all-gathers keys and values (one gather) over
the CP group (hetero/parallel/cp_gather_attention.gather_rows: per-rank row counts, differentiable; backward sums
each rank's gradient over the group) and runs models.vision.tile_attention on the gathered sequence with the
plan's per-tile key rows: the single-device tile attention with the keys fetched first. Row counts and key
rows come with the TileSeqParams (every rank computes the same plan), so nothing but K/V is communicated.
"""

from __future__ import annotations

import torch

from tessera.hetero.parallel.cp_gather_attention import gather_rows
from tessera.models.vision import BidirectionalCoreAttention, TileSeqParams, tile_attention


class TileCPCoreAttention(BidirectionalCoreAttention):
    """Bidirectional per-tile attention of this rank's queries over every CP rank's keys/values."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", cp_comm_type=None,
                 softmax_scale=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale,
                         pg_collection)
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            raise ValueError("TileCPCoreAttention needs a pg_collection with a cp group")
        self.cp_group = pg_collection.cp

    def forward(self, query, key, value, attention_mask=None, *, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not isinstance(packed_seq_params, TileSeqParams) or attention_bias is not None:
            raise ValueError("a context-parallel vision encoder takes tiles flattened with TileSeqParams "
                             "(models/vision_cp.encode_parts), no attention bias")
        # keys and values in one gather: one collective per layer each way, so no rank can order them differently
        heads = key.shape[2]
        kv = gather_rows(torch.cat([key, value], dim=2), self.cp_group, list(packed_seq_params.counts))
        out = tile_attention(query, kv[:, :, :heads], kv[:, :, heads:], packed_seq_params, self.softmax_scale)
        if query.shape[0] == 0:
            # no tile here, yet the gather's backward all-reduces over the group: keep it in this rank's graph
            out = out + 0 * kv.sum()
        return out
