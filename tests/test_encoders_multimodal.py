"""Video tubelets and EVS pruning, the registry (every encoder builds; parameter counts), and the full tiny
image+video+audio+LLM model: forward/backward on CPU per encoder swap, frozen encoders, exact-count
errors naming the sample, exact HF export/import of the whole model.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_encoders_multimodal.py -q -s
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _mcore_cpu import single_rank_world

from tessera.models import configs
from tessera.models.encoders import REGISTRY, encoder_config
from tessera.models.hybrid_llm import HybridLM
from tessera.models.multimodal import MultimodalModel, build_media_module
from tessera.models.multimodal_hf import export_hf, import_hf
from tessera.models.nemotron_h_hf import hybrid_config_from_hf
from tessera.models.media_tokens import evs_kept_tokens
from tessera.models.video import evs_prune
from tessera.models.vision import patchify

LLM_HIDDEN = configs.TINY_DENSE["hidden_size"]


def test_tubelet_embedder_is_a_conv3d():
    pixels = torch.randn(5, 3, 32, 48)  # odd frame count: the last frame is repeated
    weight = torch.randn(8, 3 * 2 * 16 * 16)
    video = build_media_module("radio_vit_tiny", LLM_HIDDEN, single_rank_world(), tubelets=True).video
    got = patchify(video.tiles(pixels), 16) @ weight.T
    video = torch.cat([pixels, pixels[-1:]]).reshape(3, 2, 3, 32, 48).transpose(1, 2)  # [g, c, t, H, W]
    kernel = weight.reshape(8, 2, 3, 16, 16).transpose(1, 2)  # the release's (t, c, y, x) flattening
    ref = F.conv3d(video, kernel, stride=(2, 16, 16)).flatten(2).transpose(1, 2)
    assert torch.allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("tubelets,rate", [(False, 0.0), (True, 0.0), (True, 0.4)])
def test_video_encoder_token_count_matches_num_tokens(tubelets, rate):
    mod = build_media_module("radio_vit_tiny", LLM_HIDDEN, single_rank_world(), tubelets=tubelets, pruning_rate=rate)
    frames = torch.randint(0, 256, (5, 3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        out = mod.video(frames)
    assert out.shape[:3] == ((3 if tubelets else 5), 2, 2)  # the grid; MediaModule prunes after projecting
    assert mod.num_tokens("video", (frames, None)) == mod.video.num_tokens(5) == len(mod([("video", (frames, None))]))
    assert mod.video.num_tokens(5) == max(4, int((3 if tubelets else 5) * 4 * (1 - rate)))


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.75, 0.9])
def test_evs_keeps_exact_count_and_prunes_static_tokens(rate):
    grid = torch.randn(4, 2, 2, 8)
    grid[2] = grid[1]  # frame 2 is a copy of frame 1: its tokens are the most static
    grid[3, 0, 0] = grid[2, 0, 0] * 3.0  # same direction: cosine change 0
    kept, index = evs_prune(grid, rate)
    assert len(kept) == len(index) == evs_kept_tokens(4, 4, rate) == max(4, int(16 * (1 - rate)))
    assert torch.equal(kept, grid.flatten(0, 2)[index]) and bool((index.diff() > 0).all())
    pruned, static = set(range(16)) - set(index.tolist()), {8, 9, 10, 11, 12}  # tokens with zero change
    assert pruned <= static if len(pruned) <= 5 else static <= pruned  # the static ones go first
    assert set(range(4)) <= set(index.tolist()) or rate > 0.75  # frame 0 survives unless the budget < 1 frame
    with pytest.raises(ValueError):
        evs_kept_tokens(10, 1, 1.0)


def test_unknown_encoder_lists_known_ones():
    with pytest.raises(KeyError, match="radio_vit_h.*siglip_so400m"):
        encoder_config("radio_vit_x")
    with pytest.raises(KeyError, match="no fields"):
        encoder_config("radio_vit_tiny", hiden=3)


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _vit_params(cfg) -> int:
    """The ViT's parameters from its config: patch embedder (+ bias for SigLIP's conv), position table,
    prefix tokens, video tubelet embedder, per layer 2 LayerNorms + QKV/proj/FC1/FC2 with biases (+ 2 layer
    scales for RADIO), final norm where the config has one."""
    d, p, f = cfg.hidden, cfg.patch, cfg.ffn
    layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    layer += 2 * d * (cfg.layer_scale is not None)
    return (3 * p * p * d + d * (cfg.family == "siglip") + cfg.pos_grid ** 2 * d + cfg.prefix_tokens * d
            + cfg.temporal_patch * 3 * p * p * d + cfg.layers * layer + 2 * d * cfg.final_norm)


def _reference_params(cfg) -> int:
    """Encoder parameter count from an outside implementation where there is one: transformers'
    SiglipVisionModel (no pooling head) for SigLIP, transformers' ParakeetEncoder for both conformer
    families (NeMo's ConformerEncoder is the same architecture); transformers' RadioModel for RADIO."""
    if cfg.family == "radio":
        from _hf_oracles import radio_config_fields
        from transformers import RadioConfig, RadioModel

        with torch.device("meta"):
            return _params(RadioModel(RadioConfig(**radio_config_fields(cfg))))
    if cfg.family == "siglip":
        from transformers import SiglipVisionConfig, SiglipVisionModel

        hf = SiglipVisionConfig(hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
                                num_attention_heads=cfg.heads, patch_size=cfg.patch,
                                image_size=cfg.pos_grid * cfg.patch, layer_norm_eps=cfg.eps, vision_use_head=False)
        with torch.device("meta"):
            return _params(SiglipVisionModel(hf))
    if cfg.modality == "audio":
        from transformers import ParakeetEncoder

        from tessera.models.audio import parakeet_hf_config

        with torch.device("meta"):
            return _params(ParakeetEncoder(parakeet_hf_config(cfg)))
    return _vit_params(cfg)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_encoder_builds(name):
    """Every registry entry builds with the parameter count of its reference, produces exactly the tokens
    models.encoders.tokens_config announces (what the data side sizes placeholders with), finite, and its
    projector maps them to the LLM width. Full-size ViTs run on the meta device (shapes only); full-size
    conformers are built with full width and 1-2 layers (NeMo's subsampling calls tensor.item(), which meta
    refuses; parameters are linear in the layer count, so two builds give the exact total)."""
    from tessera.models.encoders import tokens_config

    pg, llm = single_rank_world(), 2688
    cfg = encoder_config(name)
    tiny = name.endswith("_tiny")
    if cfg.modality == "vision":
        ctx = torch.device("cpu" if tiny else "meta")
        with ctx:
            mod = build_media_module(name, llm, pg)
            tiles = torch.randint(0, 256, (2, 3, cfg.tile, cfg.tile), dtype=torch.uint8)
            with torch.no_grad():
                feats = mod.encoder(tiles)
                out = mod.projector(feats)
        enc = _params(mod.encoder)
        announced = tokens_config(cfg).image_tokens(2)
        assert announced == mod.num_tokens("image", np.zeros((2, 3, cfg.tile, cfg.tile), np.uint8))
        assert announced == 2 * (cfg.tile // cfg.patch // cfg.pixel_shuffle) ** 2
        assert feats.shape == (announced, cfg.hidden * cfg.pixel_shuffle ** 2) == (announced, mod.encoder.out_dim)
        if name == "radio_vit_h":
            assert cfg.hidden * cfg.pixel_shuffle ** 2 == 5120  # Nano VL's mlp1 input width
    else:
        mod = build_media_module(name, llm, pg, **({} if tiny else {"layers": 1}))
        waves = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i, n in enumerate((16000, 8037))]
        with torch.no_grad():
            feats = torch.cat(mod.encoder([torch.as_tensor(w) for w in waves]))
            out = mod([("audio", w) for w in waves])
        announced = sum(tokens_config(cfg).audio_tokens(len(w)) for w in waves)
        assert announced == sum(mod.num_tokens("audio", w) for w in waves) == 13 + 7  # 1 s -> 13, 0.5 s -> 7
        assert feats.shape == (announced, cfg.hidden)
        if tiny:
            enc = _params(mod.encoder)
        else:
            one = _params(mod.encoder)
            two = _params(build_media_module(name, llm, pg, layers=2).encoder)
            enc = one + (cfg.layers - 1) * (two - one)
    assert out.shape == (announced, llm)
    if tiny or cfg.modality == "audio":
        assert bool(torch.isfinite(feats).all()) and bool(torch.isfinite(out).all())
        assert feats.std() > 0  # a real encoding, not a constant
    proj, width = _params(mod.projector), mod.encoder.out_dim
    assert proj == width + width * 4 * width + 4 * width * llm  # RMSNorm + Linear(w, 4w) + Linear(4w, llm)
    assert enc == _reference_params(cfg), (enc, _reference_params(cfg))
    if cfg.modality == "vision":
        assert enc == _vit_params(cfg)
    print(f"\n{name}: encoder {enc / 1e6:.2f}M params, projector to {llm} {proj / 1e6:.2f}M")
    expected = {"radio_vit_h": (620e6, 680e6), "siglip_so400m": (400e6, 430e6),
                "fastconformer_parakeet_0_6b": (580e6, 640e6), "parakeet_hf_0_6b": (580e6, 640e6)}
    if name in expected:
        lo, hi = expected[name]
        assert lo < enc < hi, enc


def _batch(vision_name, audio_name, key_prefix="s"):
    """Two rows: row 0 = image (2 tiles) + audio, row 1 = video (3 frames) + text only."""
    torch.manual_seed(0)
    v, a = encoder_config(vision_name), encoder_config(audio_name)
    tile = v.tile
    tpt = (tile // v.patch // v.pixel_shuffle) ** 2
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (2, 3, tile, tile), dtype=np.uint8)
    frames = rng.integers(0, 256, (3, 3, tile, tile), dtype=np.uint8)
    wave = rng.standard_normal(8000).astype(np.float32)
    from tessera.models.encoders import tokens_config

    n_audio = tokens_config(a).audio_tokens(len(wave))
    seq = 2 * tpt + n_audio + 12
    tokens = torch.randint(0, 100, (2, seq))
    media = [{"vision": [("image", image)], "audio": [("audio", wave)]}, {"vision": [("video", (frames, np.arange(3.0)))]}]
    positions = [{"vision": np.arange(2, 2 + 2 * tpt), "audio": np.arange(4 + 2 * tpt, 4 + 2 * tpt + n_audio)},
                 {"vision": np.arange(1, 1 + 3 * tpt)}]
    labels = torch.randint(0, 100, (2, seq))
    for r, pos in enumerate(positions):  # no loss on media tokens
        for p in pos.values():
            labels[r, p] = -100
    return tokens, media, positions, labels, [f"{key_prefix}0", f"{key_prefix}1"]


def _model(vision_name, audio_name, frozen_audio=False):
    pg = single_rank_world()
    torch.manual_seed(0)
    llm = HybridLM(hybrid_config_from_hf(configs.TINY_DENSE), pg)
    return MultimodalModel(llm, {"vision": build_media_module(vision_name, LLM_HIDDEN, pg),
                                 "audio": build_media_module(audio_name, LLM_HIDDEN, pg, frozen=frozen_audio)})


@pytest.mark.parametrize("vision,audio", [("radio_vit_tiny", "fastconformer_tiny"), ("siglip_tiny", "parakeet_hf_tiny")])
def test_tiny_multimodal_forward_backward(vision, audio):
    model = _model(vision, audio, frozen_audio=True).train()
    tokens, media, positions, labels, keys = _batch(vision, audio)
    loss = model(tokens, media, positions, labels=labels, keys=keys)
    assert loss.shape == tokens.shape and bool((loss[labels == -100] == 0).all())
    loss.sum().backward()
    vit = model.media["vision"].encoder.vit
    assert vit.layers[0].self_attention.linear_qkv.weight.grad.abs().sum() > 0
    assert model.media["vision"].projector[1].weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.media["audio"].encoder.parameters())  # frozen: no grads
    assert model.media["audio"].projector.linear1.weight.grad.abs().sum() > 0
    trainable = {id(p) for p in model.trainable_parameters()}
    assert not trainable & {id(p) for p in model.media["audio"].encoder.parameters()}
    assert not model.media["audio"].encoder.training  # BatchNorm statistics stay fixed
    # The media really reach the LLM: changing the image changes the logits of row 0 only.
    with torch.no_grad():
        base = model(tokens, media, positions)
        media2 = [dict(media[0], vision=[("image", 255 - media[0]["vision"][0][1])]), media[1]]
        moved = model(tokens, media2, positions)
    assert (moved[0] - base[0]).abs().max() > 1e-4 and torch.equal(moved[1], base[1])


def test_count_mismatch_names_the_sample():
    model = _model("radio_vit_tiny", "fastconformer_tiny")
    tokens, media, positions, labels, keys = _batch("radio_vit_tiny", "fastconformer_tiny", key_prefix="shard3/")
    positions[1]["vision"] = positions[1]["vision"][:-1]
    with pytest.raises(ValueError, match=r"sample shard3/1: vision encoder produced 12 embeddings .* 11 placeholder"):
        model(tokens, media, positions, keys=keys)


def test_whole_model_hf_round_trip_is_exact():
    model = _model("radio_vit_tiny", "fastconformer_tiny")
    hf = export_hf(model)
    prefixes = ("vision_model.radio_model.", "mlp1.", "sound_encoder.encoder.", "sound_projection.",
                "language_model.")
    assert all(k.startswith(prefixes) for k in hf) and all(any(k.startswith(p) for k in hf) for p in prefixes)
    other = _model("radio_vit_tiny", "fastconformer_tiny")
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    import_hf(other, hf)
    again = export_hf(other)
    assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k]) for k in hf)


def test_projectors_match_transformers_omni():
    """Both projectors as build_media_module makes them, loaded from the tensors a transformers
    NemotronH_Omni_Reasoning_V3 saves (released names, through import_hf's projector mapping), equal the Omni
    model's own `multi_modal_projector` (mlp1) and `embed_audio` (sound_projection) in fp32; every saved
    projector tensor is consumed and export gives the same key set back."""
    from _hf_oracles import tiny_omni

    from tessera.models.multimodal_hf import PROJECTOR_ROOT

    pg = single_rank_world()
    vision, audio = encoder_config("radio_vit_tiny"), encoder_config("parakeet_hf_tiny")
    omni, released = tiny_omni(vision, audio, seed=5)
    assert omni.config.text_config.hidden_size == LLM_HIDDEN
    oracles = {"vision": omni.multi_modal_projector, "audio": omni.embed_audio}
    for key, name in (("vision", "radio_vit_tiny"), ("audio", "parakeet_hf_tiny")):
        proj, root = build_media_module(name, LLM_HIDDEN, pg).projector, PROJECTOR_ROOT[key]
        theirs = {k[len(root):]: v for k, v in released.items() if k.startswith(root)}
        proj.load_state_dict(theirs, strict=True)  # what import_hf does: no tensor left over, none missing
        assert set(proj.state_dict()) == set(theirs)  # and what export_hf writes back
        width = next(iter(proj.parameters())).shape[0]  # the RMSNorm weight: the input width
        x = 2.0 * torch.randn(9, width, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got, ref = proj(x), oracles[key](x)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        print(f"{key} projector vs transformers Omni rel err {err:.2e}")
        assert got.shape == ref.shape and err <= 1e-5
