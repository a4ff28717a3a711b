"""Vision encoders: ViT vs transformers' RadioModel (the released RADIO with random non-1 layer scales, square and
non-square patch grids, dense and packed like NemotronH Omni calls it) and SiglipVisionModel, at TP=1
in-process and TP=2 on two gloo ranks (forward and weight gradients, layer scales included); pixel shuffle
and token counts vs data/tokens.py; exact HF round trips of the tower and its TP shards. The Omni model's
final norm, import errors and the tower's buffers: tests/test_encoders_vision_omni.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_encoders_vision.py -q
"""

from __future__ import annotations

import pytest
import torch
from _hf_oracles import radio_model
from _mcore_cpu import module_pgs, single_rank_world

from tessera.hetero.tools.spawn import run_on_ranks
from tessera.models.encoders import encoder_config, tokens_config
from tessera.models.multimodal_hf import (RADIO_ROOT, RADIO_TOWER, SIGLIP_ROOT, _load_params, vision_from_hf,
                                         vision_to_hf)
from tessera.models.vision import VisionEncoder, VisionTransformer, patchify, pixel_shuffle

TOL = 1e-5


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _random_hf(cfg, seed):
    """An HF-layout tower with every tensor random (norm weights and RADIO's layer scales around 1, so neither is
    the identity it is initialised to), via our export of a fresh model."""
    torch.manual_seed(seed)
    vit = VisionTransformer(cfg, single_rank_world())
    with torch.no_grad():
        for name, p in vit.named_parameters():
            around_one = name.endswith(("norm.weight", "lambda1"))
            p.copy_((1.0 if around_one else 0.0) + 0.2 * torch.randn_like(p))
    return vision_to_hf([vit.state_dict()], cfg)


def reference_radio(hf: dict, cfg: dict, pixels: torch.Tensor, model=None) -> torch.Tensor:
    """transformers' RadioModel (the released architecture, no final norm) on the same tensors: its `features`
    as [n, rows, cols, hidden]."""
    model = model or radio_model(hf, cfg)
    n, _, h, w = pixels.shape
    return model(pixels).features.reshape(n, h // cfg.patch, w // cfg.patch, -1)


def radio_grad(model, key: str) -> torch.Tensor:
    """The gradient RadioModel holds for HF-layout tensor `key` (its fused qkv is q/k/v_proj there)."""
    layer = lambda i: model.encoder.layer[int(i)]  # noqa: E731
    rest = key[len(RADIO_ROOT):].split(".")
    if rest[0] == "patch_generator" and rest[1] == "pos_embed":
        return model.embeddings.position_embedding.grad
    if rest[2:4] == ["attn", "qkv"]:
        att = layer(rest[1]).attention
        return torch.cat([getattr(att, f"{x}_proj").weight.grad for x in "qkv"])
    if rest[2] == "mlp":
        return getattr(layer(rest[1]).mlp, rest[3]).weight.grad
    if rest[2].startswith("layer_scale"):
        return getattr(layer(rest[1]), rest[2]).lambda1.grad
    raise KeyError(key)


def reference_siglip(hf: dict, cfg: dict, pixels: torch.Tensor) -> torch.Tensor:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    hf_cfg = SiglipVisionConfig(hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                                num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                                image_size=cfg.pos_grid * cfg.patch, patch_size=cfg.patch,
                                layer_norm_eps=cfg.eps, vision_use_head=False)
    model = SiglipVisionModel(hf_cfg).eval()
    model.load_state_dict({k[len(SIGLIP_ROOT):]: v for k, v in hf.items()}, strict=True)
    with torch.no_grad():
        out = model(pixel_values=pixels).last_hidden_state
    side = pixels.shape[-1] // cfg.patch
    return out.reshape(len(pixels), side, side, -1)


def _reference(hf, cfg, pixels):
    return (reference_radio if cfg.family == "radio" else reference_siglip)(hf, cfg, pixels)


@pytest.fixture(scope="module")
def towers():
    cases = {}
    for seed, name in enumerate(["radio_vit_tiny", "siglip_tiny"]):
        cfg = encoder_config(name)
        hf = _random_hf(cfg, seed)
        # RADIO at a non-square grid unlike its 8x8 table (exercises interpolation); SigLIP at its native grid.
        size = (3 * 16, 5 * 16) if name.startswith("radio") else (cfg.tile, cfg.tile)
        pixels = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(seed))
        cases[name] = (cfg, hf, pixels)
    return cases


@pytest.mark.parametrize("name", ["radio_vit_tiny", "siglip_tiny"])
def test_vit_matches_reference_tp1(towers, name):
    cfg, hf, pixels = towers[name]
    vit = VisionTransformer(cfg, single_rank_world()).eval()
    _load_params(vit, vision_from_hf(hf, cfg))
    with torch.no_grad():
        got = vit(pixels)
    ref = _reference(hf, cfg, pixels)
    err = _rel(got, ref)
    print(f"{name} TP=1 rel err {err:.2e}")
    assert got.shape == ref.shape and err < TOL
    with torch.no_grad():  # the check can fail: one swapped head in the fused QKV must show
        vit.layers[0].self_attention.linear_qkv.weight[: cfg.hidden // cfg.heads].mul_(-1)
        assert _rel(vit(pixels), ref) > 1e-3


# Square grids smaller, equal to and larger than the 8x8 table, and non-square ones both ways: on those
# RADIO's CPE rule (square resize to the longer side, then a window) differs from a plain resize.
RADIO_GRIDS = [(2, 2), (8, 8), (16, 16), (3, 5), (5, 3), (2, 12), (12, 2)]


@pytest.fixture(scope="module")
def radio_pair(towers):
    cfg, hf, _ = towers["radio_vit_tiny"]
    vit = VisionTransformer(cfg, single_rank_world()).eval()
    _load_params(vit, vision_from_hf(hf, cfg))
    return cfg, hf, vit, radio_model(hf, cfg)


@pytest.mark.parametrize("grid", RADIO_GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_radio_matches_transformers_radio_model(radio_pair, grid):
    """Same tensors in Tessera's ViT and transformers' RadioModel, fp32: the outputs agree to 1e-5 on every
    grid and the resampled position tables are bit-identical."""
    cfg, hf, vit, oracle = radio_pair
    rows, cols = grid
    pixels = torch.randn(2, 3, rows * cfg.patch, cols * cfg.patch, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, ref = vit(pixels), reference_radio(hf, cfg, pixels, oracle)
        # black pixels: the bias-free patch projection gives 0, so the embeddings are the position table
        pos_ref = oracle.embeddings(torch.zeros_like(pixels[:1]))[0, cfg.prefix_tokens:]
        pos_got = vit.position_embedding(rows, cols)[0]
    err = _rel(got, ref)
    print(f"radio {rows}x{cols} vs RadioModel rel err {err:.2e}, "
          f"position table rel err {_rel(pos_got, pos_ref):.2e}")
    assert got.shape == ref.shape and err <= TOL
    assert torch.equal(pos_got, pos_ref)


def test_radio_packed_images_match_transformers(radio_pair):
    """NemotronH Omni's call: the patches of images of different grids concatenated, with image_grid_hw.
    Tessera encodes each image on its own; the per-image features must be RadioModel's packed ones."""
    cfg, hf, vit, oracle = radio_pair
    p, grids = cfg.patch, [(3, 5), (2, 12), (4, 4)]
    gen = torch.Generator().manual_seed(3)
    images = [torch.randn(1, 3, r * p, c * p, generator=gen) for r, c in grids]
    with torch.no_grad():
        got = torch.cat([vit(x).flatten(0, 2) for x in images])
        packed = torch.cat([patchify(x, p)[0] for x in images])
        ref = oracle(packed, image_grid_hw=torch.tensor(grids)).features
    err = _rel(got, ref)
    print(f"radio packed {grids} vs RadioModel rel err {err:.2e}")
    assert got.shape == ref.shape and err <= TOL


def _tp2_forward_backward(cases):
    pg = module_pgs("tp2", "vision")
    out = {}
    for name, (cfg, hf, pixels) in cases.items():
        vit = VisionTransformer(cfg, pg)
        _load_params(vit, vision_from_hf(hf, cfg, pg.tp.rank(), 2))
        y = vit(pixels)
        y.square().sum().backward()
        # (the video embedder gets no gradient from images: a zero one keeps every parameter in the export)
        grads = {k: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for k, p in vit.named_parameters()}
        params = {k: v for k, v in vit.state_dict().items() if "_extra" not in k}
        out[name] = (y.detach().numpy(), {k: v.numpy() for k, v in params.items()}, {k: v.numpy() for k, v in grads.items()})
    return out  # numpy: torch tensors would travel as shared memory that dies with the worker


def _torch(d):
    return {k: torch.from_numpy(v) for k, v in d.items()}


@pytest.mark.multiproc
def test_vit_tp2_matches_reference_and_shards_merge_exactly(towers):
    ranks = run_on_ranks(2, _tp2_forward_backward, towers)
    for name, (cfg, hf, pixels) in towers.items():
        oracle = radio_model(hf, cfg) if cfg.family == "radio" else None
        if oracle is not None:
            ref = reference_radio(hf, cfg, pixels, oracle)
            ref.square().sum().backward()
        else:
            ref = _reference(hf, cfg, pixels)
        for rank, y in enumerate(ranks):
            err = _rel(torch.from_numpy(y[name][0]), ref.detach())
            print(f"{name} TP=2 rank {rank} rel err {err:.2e}")
            assert err < TOL
        merged = vision_to_hf([_torch(r[name][1]) for r in ranks], cfg)
        assert merged.keys() == hf.keys() and all(torch.equal(merged[k], hf[k]) for k in hf)
        if cfg.family == "radio":  # weight grads of the sharded layers, merged, equal autograd on the reference
            grad_hf = vision_to_hf([_torch(r[name][2]) for r in ranks], cfg)
            for key in (f"{RADIO_ROOT}blocks.1.attn.qkv.weight", f"{RADIO_ROOT}blocks.0.mlp.fc2.weight",
                        f"{RADIO_ROOT}patch_generator.pos_embed", f"{RADIO_ROOT}blocks.0.layer_scale1.lambda1",
                        f"{RADIO_ROOT}blocks.1.layer_scale2.lambda1"):
                assert _rel(grad_hf[key], radio_grad(oracle, key)) < 1e-4, key
            # layer scales are replicated: every TP rank computes the same full gradient
            for k in ("layers.0.self_attn_bda.lambda1", "layers.1.mlp_bda.lambda1"):
                assert torch.equal(_torch(ranks[0][name][2])[k], _torch(ranks[1][name][2])[k]), k


def test_hf_round_trip_is_exact(towers):
    for name, (cfg, hf, _) in towers.items():
        assert all(k.startswith(SIGLIP_ROOT) for k in hf)  # "vision_model.": no final norm outside the tower
        if cfg.family == "radio":  # RadioModel's buffer summary_idxs and layer scales, no final norm
            assert f"{RADIO_TOWER}summary_idxs" in hf and f"{RADIO_ROOT}blocks.1.layer_scale2.lambda1" in hf
            assert not any(k.startswith(RADIO_ROOT + "norm.") for k in hf)
        vit = VisionTransformer(cfg, single_rank_world())
        _load_params(vit, vision_from_hf(hf, cfg))
        again = vision_to_hf([vit.state_dict()], cfg)
        assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k]) for k in hf)
        shards = [vision_from_hf(hf, cfg, r, 2) for r in range(2)]
        assert shards[0]["layers.0.mlp.linear_fc1.weight"].shape[0] == cfg.ffn // 2
        merged = vision_to_hf(shards, cfg)
        assert all(torch.equal(merged[k], hf[k]) for k in hf)


def test_pixel_shuffle_groups_2x2_blocks_row_offset_first():
    x = torch.randn(2, 4, 6, 3)
    y = pixel_shuffle(x, 2)
    assert y.shape == (2, 2, 3, 12)
    i, j = 1, 2
    want = torch.cat([x[:, 2 * i, 2 * j], x[:, 2 * i, 2 * j + 1], x[:, 2 * i + 1, 2 * j], x[:, 2 * i + 1, 2 * j + 1]], -1)
    assert torch.equal(y[:, i, j], want)
    with pytest.raises(ValueError, match="not divisible"):
        pixel_shuffle(torch.randn(1, 3, 4, 2))


@pytest.mark.parametrize("name", ["radio_vit_tiny", "siglip_tiny"])
def test_token_counts_equal_data_side(name):
    cfg = encoder_config(name)
    enc = VisionEncoder(VisionTransformer(cfg, single_rank_world())).eval()
    tiles = torch.randint(0, 256, (3, 3, cfg.tile, cfg.tile), dtype=torch.uint8)
    with torch.no_grad():
        out = enc(tiles)
    assert out.shape == (tokens_config(cfg).image_tokens(3), 4 * cfg.hidden)
    for full in ("radio_vit_h", "siglip_so400m"):  # the real sizes: 256 tokens per tile, like the data default
        c = encoder_config(full)
        assert (c.tile // c.patch // c.pixel_shuffle) ** 2 == tokens_config(c).tokens_per_tile == 256
