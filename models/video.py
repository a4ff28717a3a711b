"""Video: frames encoded as tiles by the vision encoder, optional tubelets, EVS pruning of static tokens.

The data side samples frames uniformly and resizes each to one tile, or for the omni family to the release's
aspect-keeping frame grid (data/media.decode_video, with timestamps; models/media_tokens.video_frame_grid); the
prompt's per-tubelet labels are the data side's (data/templates.tubelet_chunks).
    tubelets   temporal_patch (2) consecutive frames share one patch embedding: the ViT's video_embedder is
               a linear over (t, c, y, x)-flattened tubelets (the release's packing: VideoEncoder.tiles), a
               Conv3D(kernel = stride = (t, p, p)) in effect.
               An odd frame count repeats the last frame. Tokens per video: ceil(F / t) * tokens_per_tile.
    EVS        Efficient Video Sampling, the releases' rule (transformers' compute_retention_mask): token j of
               (tubelet) frame f > 0 scores 1 - cos(x[f, j], x[f-1, j]) on the *projected* embeddings; frame 0
               is always kept. The evs_kept_tokens(frames, per_frame, rate) highest scores survive, in their
               original order, so the count depends only on (frames, rate) and the data side can size the
               placeholders before encoding (`VideoEncoder.num_tokens`). Which tubelet keeps how many is known
               only after encoding (evs_tubelet_counts): the omni family's per-tubelet chunks are settled to it
               by the trainer (hetero/runtime/tubelet_settle.py).
With the defaults (no tubelets, rate 0) the count is frames * tokens_per_tile; models/media_tokens.video_tokens
is the one count rule (the omni family's tubelets: models/encoders.video_temporal).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tessera.models.media_tokens import evs_kept_tokens
from tessera.models.vision import VisionEncoder, pixel_shuffle


def evs_prune(grid: torch.Tensor, rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """grid [F, h, w, d] -> (kept tokens [k, d] in frame/raster order, their flat indices [k]); k =
    evs_kept_tokens(F, h*w, rate). The releases score the projected embeddings (MediaModule prunes after its
    projector)."""
    frames = grid.flatten(1, 2)  # [F, n, d]
    keep = evs_kept_tokens(frames.shape[0], frames.shape[1], rate)
    with torch.no_grad():  # selection is discrete; gradients flow through the kept tokens only
        change = 1 - torch.cosine_similarity(frames[1:].float(), frames[:-1].float(), dim=-1)
        score = torch.cat([torch.full_like(frames[0, :, 0], float("inf"), dtype=change.dtype)[None], change])
        # Stable descending sort: among equal scores the earlier token wins, so the choice is deterministic.
        chosen = torch.sort(torch.argsort(score.flatten(), descending=True, stable=True)[:keep]).values
    return frames.flatten(0, 1)[chosen], chosen


def evs_tubelet_counts(chosen: torch.Tensor, tubelets: int, per_tubelet: int) -> list[int]:
    """How many of evs_prune's `chosen` flat indices fall in each tubelet: what each tubelet's <img> ... </img>
    chunk holds in the release's layout (data/packing.settle_tubelet_chunks)."""
    return torch.bincount(chosen // per_tubelet, minlength=tubelets).tolist()


class VideoEncoder(nn.Module):
    """uint8 frames [F, 3, H, W] (one tile each, or the omni family's native frame grid) -> tokens
    [num_tokens(F, H, W), out_dim], sharing the image encoder."""

    def __init__(self, image_encoder: VisionEncoder, tubelets: bool = False, pruning_rate: float = 0.0):
        super().__init__()
        if tubelets and not getattr(image_encoder.cfg, "temporal_patch", 0):  # (on a later pipeline stage: not built here)
            raise ValueError(f"encoder {image_encoder.cfg.name} has no tubelet embedder (temporal_patch=0)")
        evs_kept_tokens(1, 1, pruning_rate)  # validate early
        self.image_encoder, self.tubelets, self.pruning_rate = image_encoder, tubelets, pruning_rate

    @property
    def temporal(self) -> int:
        return self.image_encoder.cfg.temporal_patch if self.tubelets else 1

    def num_tokens(self, frames: int, height: int | None = None, width: int | None = None) -> int:
        """Embeddings of a clip of `frames` frames of height x width pixels (None: one tile each): the data
        side's rule (EncoderTokens.video_tokens) at this encoder's tubelets and pruning."""
        from tessera.models.encoders import tokens_config

        cfg = self.image_encoder.cfg
        rule = dataclasses.replace(tokens_config(cfg), video_temporal=self.temporal, video_pruning=self.pruning_rate)
        p = cfg.patch
        return rule.video_tokens(frames if height is None else (frames, height // p, width // p))

    def tiles(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised frames [F, 3, H, W] -> what the ViT embeds as tiles: the frames, or with tubelets each
        tubelet's frames stacked along the channels [ceil(F/t), t*3, H, W] (the last frame repeated), as the
        release's get_video_features packs them; models/vision.patchify then flattens each patch (t, c, y, x)
        and the ViT embeds it with its video embedder (a Conv3D(kernel = stride = (t, p, p)) in effect)."""
        if not self.tubelets:
            return pixels
        t = self.temporal
        if pixels.shape[0] % t:
            pixels = torch.cat([pixels, pixels[-1:].expand(t - pixels.shape[0] % t, -1, -1, -1)])
        return pixels.reshape(pixels.shape[0] // t, t * pixels.shape[1], *pixels.shape[2:])

    def grid_tokens(self, frames: torch.Tensor) -> torch.Tensor:
        enc = self.image_encoder
        return pixel_shuffle(enc.vit(self.tiles(enc.normalize(frames))), enc.cfg.pixel_shuffle)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """The clip's token grid [F', h, w, out_dim], not yet pruned: EVS scores the projected embeddings, as the
        releases do (MediaModule.project)."""
        return self.grid_tokens(frames)
