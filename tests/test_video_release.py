"""Video as the released Omni model encodes it, with transformers as the oracle (issue 15, item 4):
tubelets of two frames through the ViT's video embedder, pixel shuffle and mlp1 (get_video_features), and
Efficient Video Sampling on the projected embeddings (compute_retention_mask): the tokens kept, their order and
their count, which the data side announces before anything is encoded (EncoderTokens.video_tokens); the
decoded frames' pixels against the release's video processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.models.media_tokens import EncoderTokens, evs_kept_tokens
from tessera.models.video import evs_prune


@pytest.mark.parametrize("frames,rate", [(1, 0.5), (2, 0.3), (3, 0.5), (5, 0.75), (4, 0.9), (6, 0.1), (3, 0.0)])
def test_evs_keeps_what_the_release_keeps(frames, rate):
    """Tessera's EVS (models/video.evs_prune) on a token grid == transformers' compute_retention_mask: the same
    tokens, in raster order, as many as evs_kept_tokens (the data side's count) says."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import compute_retention_mask

    g = torch.Generator().manual_seed(frames * 100 + int(rate * 100))
    grid = torch.randn(frames, 4, 4, 16, generator=g)
    if frames > 2:
        grid[2] = grid[1] + 0.01 * torch.randn(4, 4, 16, generator=g)  # a near-static frame: pruned first
    _, kept = evs_prune(grid, rate)
    if rate == 0.0:
        mask = torch.ones(grid.shape[:3], dtype=torch.bool).flatten()  # the release skips EVS at rate 0
    else:
        mask = compute_retention_mask(grid.reshape(-1, 16), frames, rate)
    assert kept.tolist() == torch.nonzero(mask).flatten().tolist()
    tokens = EncoderTokens(tile=128, patch=16, pixel_shuffle=2, video_pruning=rate)  # 4x4 tokens per frame
    assert len(kept) == evs_kept_tokens(frames, 16, rate) == tokens.video_tokens(frames)


def test_evs_count_is_the_releases_arithmetic():
    """int(T * n * (1 - q)), never below one frame: e.g. 10 tokens at q = 0.7 keep int(2.999...) = 2 frames' worth
    rounded the release's way, and a budget under one frame keeps one frame."""
    assert evs_kept_tokens(10, 1, 0.7) == int(10 * (1 - 0.7))
    assert evs_kept_tokens(4, 16, 0.9) == 16  # 6.4 tokens: one frame's 16
    assert evs_kept_tokens(0, 16, 0.5) == 0
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        evs_kept_tokens(3, 4, 1.0)


@pytest.mark.parametrize("frames,rate,size", [(4, 0.0, (64, 64)), (5, 0.0, (64, 64)), (5, 0.5, (64, 64)),
                                             (9, 0.5, (64, 64)), (12, 0.3, (64, 64)), (4, 0.0, (64, 96)),
                                             (5, 0.5, (96, 32))])
def test_tubelet_video_equals_the_releases_video_features(frames, rate, size):
    """A clip through Tessera's vision module with tubelets (the ViT's video embedder over two frames at a time;
    an odd count repeats the last frame) == transformers' Omni get_video_features (+ its EVS at `rate`), also
    for frames of a non-square grid (height, width `size`: the omni family's frame grid keeps the clip's aspect
    ratio, models/media_tokens.video_frame_grid)."""
    from _hf_oracles import tiny_omni
    from _mcore_cpu import single_rank_world
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import compute_retention_mask

    from tessera.models import configs
    from tessera.models.encoders import encoder_config
    from tessera.models.multimodal import build_media_module
    from tessera.models.hf_reference import release_video_pixels
    from tessera.models.multimodal_hf import PROJECTOR_ROOT, _load_params, vision_from_hf

    cfg = encoder_config("radio_vit_tiny")
    omni, released = tiny_omni(cfg, None, seed=11)
    mod = build_media_module(cfg.name, configs.TINY_DENSE["hidden_size"], single_rank_world(), tubelets=True,
                             pruning_rate=rate, **{k: getattr(cfg, k) for k in ("final_norm", "summary_idxs",
                                                                        "input_conditioner")})
    root = PROJECTOR_ROOT["vision"]
    mod.projector.load_state_dict({k[len(root):]: v for k, v in released.items() if k.startswith(root)})
    _load_params(mod.encoder.vit, vision_from_hf(released, cfg))
    mod.eval()
    clip = np.random.default_rng(frames).integers(0, 256, (frames, 3, *size), dtype=np.uint8)
    with torch.no_grad():
        got = mod([("video", (clip, None))])
        x = release_video_pixels(clip, cfg)  # the video processor's pixels (test_decoded_frames_are_...)
        (ref,) = omni.get_video_features(x).pooler_output  # [tubelets * tokens per tubelet, llm_hidden]
        if rate:
            ref = ref[compute_retention_mask(ref, x.shape[1], rate)]
    assert got.shape == ref.shape == (mod.num_tokens("video", (clip, None)), configs.TINY_DENSE["hidden_size"])
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err <= 1e-5, err


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_tubelet_video_through_vision_pipeline_stages(rate):
    """RADIO split over two pipeline stages (a stage reads only its pipeline group's size and rank): stage 0 embeds
    the tubelets with the video embedder, the last one projects and prunes; == the one-stage module, gradients too."""
    from types import SimpleNamespace

    from _mcore_cpu import single_rank_world

    from tessera.models.multimodal import build_media_module

    class Group:
        def __init__(self, rank):
            self._rank = rank

        def size(self):
            return 2

        def rank(self):
            return self._rank

    pgs = single_rank_world()
    torch.manual_seed(0)
    whole = build_media_module("radio_vit_tiny", 24, pgs, tubelets=True, pruning_rate=rate)
    clip = np.random.default_rng(1).integers(0, 256, (9, 3, 64, 64), dtype=np.uint8)
    items = [("image", clip[:2]), ("video", (clip, None))]
    want = whole(items)
    want.square().sum().backward()
    stages = [build_media_module("radio_vit_tiny", 24, SimpleNamespace(tp=pgs.tp, cp=pgs.cp, dp=pgs.dp, pp=Group(s)),
                                 tubelets=True, pruning_rate=rate) for s in range(2)]
    full = whole.state_dict()
    for st in stages:
        st.load_state_dict({k: full[k] for k in st.state_dict()})
    x = stages[0].forward_stage(items)
    assert tuple(x.shape) == stages[1].stage_shape(items)  # 2 tiles + 5 tubelets, each prefix + 16 patches
    x.retain_grad()
    got = stages[1].forward_stage(items, x)
    assert got.shape == want.shape and float((got - want).abs().max() / want.abs().max()) <= 1e-5
    got.square().sum().backward()
    g = stages[0].encoder.vit.video_embedder.weight.grad
    ref = whole.encoder.vit.video_embedder.weight.grad
    assert float((g - ref).abs().max() / ref.abs().max()) <= 1e-4


def _smooth_frames(width: int, height: int, frames: int = 3) -> np.ndarray:
    """uint8 [frames, h, w, 3] of smooth, moving content within [40, 216] (no bicubic overshoot past 0 / 255)."""
    y, x = np.mgrid[0:height, 0:width]
    out = [128 + 60 * np.sin(2 * np.pi * (x + 3 * t) / 23.0) * np.cos(2 * np.pi * y / 17.0) for t in range(frames)]
    return np.stack([np.stack([f, 0.8 * f + 20, 255 - f], -1) for f in out]).round().astype(np.uint8)


@pytest.mark.parametrize("size", [(160, 90), (1280, 720), (96, 300)])
def test_decoded_frames_are_the_release_processors_pixels(size):
    """An omni clip decoded by the loader (data/media.decode_video at the release's frame grid) against
    transformers' video processor (NemotronH_Omni_Reasoning_V3VideoProcessor, run as is) on the same decoded
    frames, packed into tubelets (models/hf_reference.release_video_pixels, which the oracles here feed the
    model; 3 frames: the last tubelet repeats the last frame): within 1.25 uint8 levels, mean <= 0.35. Tessera resizes uint8 in two passes (rounding between them,
    torch's uint8 kernel), the release in one float pass; measured 1.0-1.1 levels max (a bilinear or
    non-antialiased resize: 1.6-4.3). Where bicubic overshoots past 0 / 255 (noise), Tessera's uint8 clamps and the
    release's float does not: up to ~43 levels there (0.66 of a 0.25 std), mean ~0.4 levels."""
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import \
        NemotronH_Omni_Reasoning_V3VideoProcessor

    from tessera.data.media import decode_video
    from tessera.data.prepare import encode_mp4
    from tessera.models.encoders import encoder_config
    from tessera.models.hf_reference import release_video_pixels
    from tessera.models.media_tokens import video_frame_grid

    w, h = size
    data = encode_mp4(iter(_smooth_frames(w, h)), fps=8)
    source, _ = decode_video(data, frames=8, size=(h, w))  # the decoded frames, not resized
    rows, cols = video_frame_grid(h, w, 1024, 2)
    ours, _ = decode_video(data, frames=8, size=(rows * 16, cols * 16))
    mean, std = 0.5, 0.25
    ref = NemotronH_Omni_Reasoning_V3VideoProcessor(norm_mean=[mean] * 3, norm_std=[std] * 3)(
        videos=[torch.as_tensor(source)], do_sample_frames=False)["pixel_values_videos"]
    ours = release_video_pixels(ours, encoder_config("radio_vit_tiny", mean=(mean,) * 3, std=(std,) * 3,
                                                     temporal_patch=2))
    assert ref.shape == ours.shape == (1, 2, 6, rows * 16, cols * 16)
    levels = (ours - ref).abs() * std * 255
    assert float(levels.max()) <= 1.25 and float(levels.mean()) <= 0.35, (float(levels.max()), float(levels.mean()))
