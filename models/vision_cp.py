"""The vision tower on this context-parallel rank's part of a microbatch's tokens (hetero/plan/encoder_cp.py).

    plan = plan_vision_cp(grids, shuffle, prefix_tokens, cp)   # every rank computes the same plan
    features = encode_parts(vit, tiles, plan)                   # [this rank's tokens, hidden * shuffle**2]

The pieces of VisionTransformer.forward — patch embedder, resampled position table, prefix tokens, megatron's
layers, final norm, pixel shuffle — on the patches this rank holds: its tiles' patches flattened into one
[T, 1, hidden] sequence with TileSeqParams, so each tile's queries attend only to that tile's keys, which the
injected context-parallel core attention (hetero/parallel/cp_tile_attention.py) gathers from every CP rank.
Patches are ordered block by block in pixel_shuffle's channel order, so the output rows (prefix dropped) reshape
straight into shuffled tokens, in the order the boundary plan expects of this rank.
"""

from __future__ import annotations

import torch

from tessera.hetero.plan.encoder_cp import VisionCPPlan
from tessera.models.vision import TileSeqParams, VisionTransformer, patchify


def encode_parts(vit: VisionTransformer, tiles: list[torch.Tensor], plan: VisionCPPlan) -> torch.Tensor:
    """tiles: normalised pixels [3, H, W] of every tile the plan names (index = TilePart.tile; only this rank's
    are read). Returns this rank's shuffled tokens [plan.tokens(rank), hidden * shuffle**2], in plan order.
    Every rank of the CP group must call it (the layers gather keys/values), also one with no tokens."""
    if vit.pp != 1:
        raise RuntimeError("a context-parallel vision encoder runs as one pipeline stage")
    rank, p, d = vit.cp_rank, vit.cfg.patch, vit.cfg.hidden
    if plan.cp != vit.cp:
        raise ValueError(f"plan for cp{plan.cp}, encoder on cp{vit.cp}")
    dev = vit.embedder.weight.device
    pieces, slices, feature_rows, start, positions = [], [], [], 0, {}
    for part in plan.parts[rank]:
        index = torch.as_tensor(part.patches, device=dev)
        if part.grid not in positions:  # the table resampled once per grid shape
            positions[part.grid] = vit.position_embedding(*part.grid)[0]
        tile = tiles[part.tile]  # [3, H, W], or a video tubelet [t*3, H, W]
        x = vit.patch_embedder(tile.shape[0])(patchify(tile[None], p)[0, index]) + positions[part.grid][index]
        if part.prefix and vit.prefix is not None:
            x = torch.cat([vit.prefix, x])
        # the prefix tokens' outputs are not features (VisionTransformer.head drops them too)
        feature_rows.append(torch.arange(start + len(x) - len(part.patches), start + len(x)))
        pieces.append(x)
        slices.append((start, start + len(x)))
        start += len(x)
    hidden = torch.cat(pieces) if pieces else vit.embedder.weight.new_zeros(0, d)
    params = TileSeqParams(query_slices=tuple(slices), counts=tuple(plan.lengths()),
                           key_index=tuple(torch.as_tensor(k, device=dev) for k in plan.key_index(rank)))
    hidden = vit.run_stage_layers(hidden[:, None], packed_seq_params=params)[:, 0]
    if start != sum(len(r) for r in feature_rows):  # prefix rows to drop (an index, not a mask: the meta device
        hidden = hidden[torch.cat(feature_rows).to(dev)]  # of the dry run knows its shape)
    if vit.final_norm is not None:
        hidden = vit.final_norm(hidden)
    return hidden.reshape(-1, plan.shuffle ** 2 * d)
