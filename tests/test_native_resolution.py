"""Native-resolution images of the omni family (issue 15, item 4): the released Omni image processor's patch grid.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_native_resolution.py -q

The oracle is transformers' own code: get_patch_grid_size of models/nemotron_h_omni/image_processing_nemotron_h_
omni.py with the processor's defaults and per-call budget (tests/_omni_image_processor.py: how the module is
loaded without torchvision), and the processor's replace_image_token for the placeholder count. Tessera's side is
what the data pipeline does: models/media_tokens.EncoderTokens.image_grid through data/media.native_grid (a grid
the release cannot make is a MediaError), the loader's prediction and decode, and the model's count and encoder
output for the decoded [1, 3, H, W] image. The pixel values after the resize are not the release's (torchvision
float32 resize against Tessera's uint8 one, data/media.decode_native_image), so only the grid and the encoder's
treatment of given pixels are compared.
"""

from __future__ import annotations

import io
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _omni_image_processor import release_grid, release_image_module, release_video_grid
from PIL import Image

from tessera.data.loader import RawSample
from tessera.data.media import MediaError, blank_item, native_grid
from tessera.data.pipeline import chat_task_encoder, encoder_tokens
from tessera.data.tokens import train_sentencepiece
from tessera.models.tiling import TileSource

OMNI = {"vision": "radio_vit_h", "audio": "parakeet_hf_0_6b"}
OMNI_TINY = {"vision": "radio_vit_tiny", "audio": "fastconformer_tiny"}
RELEASE = release_image_module().NemotronH_Omni_Reasoning_V3ImageProcessor  # class defaults only
FULL = dict(max_tiles=12)                # the full omni recipe: 1024..13312 patches (test below)
TINY = dict(max_tiles=2)                 # the tiny omni recipe: 16..48 patches of 16 px
TINY_RELEASE = dict(min_num_patches=16, max_num_patches=48, max_model_len=256)

# (width, height): tiny, exact multiples of the patch (odd and even: the release's round() halves to even),
# exactly at and around the full budget's min (1024 = 32 x 32) and max (13312 = 104 x 128), huge, extreme aspect
# ratios, including ones where the release's scaling floors a side to 0 patches (it divides by zero there)
SIZES = [(1, 1), (1, 2), (2, 1), (15, 17), (16, 16), (17, 16), (31, 33), (48, 48), (64, 64), (65, 63),
         (496, 496), (512, 512), (528, 528), (480, 496), (500, 500), (512, 480), (511, 513), (513, 511),
         (2048, 1664), (1664, 2048), (2048, 1680), (2064, 1664), (2047, 1663),
         (8192, 8192), (10000, 10000), (20000, 15000), (4032, 3024), (1920, 1080), (1080, 1920),
         (300, 1200), (1200, 300), (4000, 40), (40, 4000), (5000, 1), (1, 5000), (16384, 16), (20000, 1),
         (100000, 1), (1, 100000), (100000, 50), (50, 100000), (250000, 16),
         (300000, 1), (1, 300000), (1000000, 10), (10, 1000000)]  # the last four: no grid in 13312 patches


def _random_sizes(n: int, seed: int, top: int = 20000) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(max(1, round(top ** rng.random())), max(1, round(top ** rng.random()))) for _ in range(n)]


def _release_count(grid: tuple[int, int], merge_ratio: float) -> int:
    """The placeholder count transformers' processor writes for an image of this grid (its replace_image_token,
    on a stand-in `self` carrying only what that method reads)."""
    from transformers import NemotronH_Omni_Reasoning_V3Processor

    me = SimpleNamespace(image_processor=SimpleNamespace(downsample_ratio=merge_ratio), image_start_token="<img>",
                         image_token="<image>", image_end_token="</img>")
    text = NemotronH_Omni_Reasoning_V3Processor.replace_image_token(me, {"image_grid_hw": torch.tensor([grid])}, 0)
    assert text.startswith("<img>") and text.endswith("</img>")
    return text.count("<image>")


def _compare(enc, sizes, **release):
    """Tessera's grid and count against the release's for every size; returns how many the release refused."""
    refused = 0
    for w, h in sizes:
        try:
            want = release_grid(h, w, **release)
        except ZeroDivisionError:  # the release's scaling floored a side to 0 patches
            want = None
        if want is None or 0 in want:
            refused += 1
            with pytest.raises(MediaError, match="patch grid") as e:
                native_grid(w, h, enc)
            assert e.value.reason == "no_patch_grid"
            continue
        got = native_grid(w, h, enc)
        assert got == want, f"{w}x{h}: tessera {got}, release {want}"
        assert enc.image_tokens(got) == _release_count(want, 1 / enc.pixel_shuffle), f"{w}x{h}"
    return refused


def test_full_omni_grid_and_count_equal_the_release():
    enc = encoder_tokens(OMNI, native_resolution=True, **FULL)
    refused = _compare(enc, SIZES + _random_sizes(3000, 0))
    assert refused >= 4  # the extreme sizes above do reach the release's division by zero


def test_tiny_omni_grid_and_count_equal_the_release_with_the_tiny_budget():
    enc = encoder_tokens(OMNI_TINY, native_resolution=True, **TINY)
    _compare(enc, SIZES + _random_sizes(3000, 1, top=2000), patch_size=enc.patch, **TINY_RELEASE)


@pytest.mark.parametrize("budget", [(1024, 1024), (4, 4096), (100, 200), (2, 8)])
def test_other_budgets_equal_the_release(budget):
    lo, hi = budget
    enc = encoder_tokens(OMNI, native_resolution=True, min_patches=lo, max_patches=hi)
    _compare(enc, SIZES + _random_sizes(500, hi), min_num_patches=lo, max_num_patches=hi)


def test_at_the_budget_edges():
    """512² is exactly the min (32 x 32 patches, 256 tokens); 2048 x 1664 exactly the max (104 x 128, 3328)."""
    enc = encoder_tokens(OMNI, native_resolution=True, **FULL)
    assert native_grid(512, 512, enc) == release_grid(512, 512) == (32, 32)
    assert native_grid(2048, 1664, enc) == release_grid(1664, 2048) == (104, 128)
    assert enc.image_tokens((104, 128)) == 3328


def test_the_full_omni_recipe_uses_the_release_defaults():
    """max_tiles 12 of 512-px tiles / 16-px patches: the class defaults of the released image processor, and the
    recipe's seq_length as its max_model_len leaves the budget at max_num_patches."""
    import fiddle as fdl

    from tessera.recipes.registry import recipe

    cfg = fdl.build(recipe("nemotron_omni_30b_a3b"))
    enc = encoder_tokens({"vision": cfg.model.vision, "audio": cfg.model.audio}, cfg.data.max_tiles,
                         native_resolution=True)
    assert enc.patch_budget == (RELEASE.min_num_patches, RELEASE.max_num_patches) == (1024, 13312)
    assert (enc.patch, enc.pixel_shuffle) == (RELEASE.patch_size, round(1 / RELEASE.downsample_ratio))
    big = (20000, 15000)
    assert release_grid(*big, max_model_len=cfg.data.seq_length) == release_grid(*big) == native_grid(*big[::-1], enc)


def test_the_tiny_omni_recipe_keeps_images_small():
    import fiddle as fdl

    from tessera.recipes.registry import recipe

    cfg = fdl.build(recipe("nemotron_omni_tiny"))
    enc = encoder_tokens({"vision": cfg.model.vision, "audio": cfg.model.audio}, cfg.data.max_tiles,
                         native_resolution=True)
    assert enc.patch_budget == (16, 48) and enc.patch == 16
    from tessera.data.prepare import SIZES as SYNTHETIC_SIZES

    for w, h in SYNTHETIC_SIZES:  # the synthetic data set's images: 4-12 tokens, as its tiles gave
        grid = native_grid(w, h, enc)
        assert grid == release_grid(h, w, patch_size=16, min_num_patches=16, max_num_patches=48,
                                    max_model_len=cfg.data.seq_length)
        assert 4 <= enc.image_tokens(grid) <= 12


def test_a_context_that_would_shrink_the_release_budget_is_refused():
    with pytest.raises(ValueError, match="seq_length 3000 holds fewer than max_patches 13312"):
        chat_task_encoder(None, OMNI, 3000, max_tiles=12)


# ---- the data path: prediction, decode, deferred upscale, blanks, placeholders --------------------------------

IMAGES = {"small_png": ((40, 30), "PNG"), "wide_jpg": ((500, 60), "JPEG"), "tall_png": ((70, 300), "PNG"),
          "big_jpg": ((900, 700), "JPEG")}


def _image_bytes(size, fmt, seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = ["Describe the image.", "A picture.", "user\n", "assistant\n", "system\n"] * 10
    return train_sentencepiece(texts, tmp_path_factory.mktemp("tok") / "tok", vocab_size=120)


@pytest.mark.parametrize("name", list(IMAGES))
def test_the_loader_predicts_decodes_and_announces_the_release_grid(name, tokenizer):
    (w, h), fmt = IMAGES[name]
    data = _image_bytes((w, h), fmt)
    te = chat_task_encoder(tokenizer, OMNI_TINY, 256, **TINY)
    deferred = chat_task_encoder(tokenizer, OMNI_TINY, 256, defer_upscale=True, **TINY)
    enc = te.enc
    assert te.template == "omni" and enc.native_resolution
    grid = release_grid(h, w, patch_size=16, **TINY_RELEASE)
    assert te._units("image", data) == (grid, None)
    arr = te._decode_item("image", data, grid, "k", "s")
    assert arr.dtype == np.uint8 and arr.shape == (1, 3, grid[0] * enc.patch, grid[1] * enc.patch)
    # the deferred upscale: a TileSource of the image's own pixels when it is smaller than its grid, cut to
    # the same uint8 image on the CPU
    lazy = deferred._decode_item("image", data, grid, "k", "s")
    assert isinstance(lazy, TileSource) == (w * h < arr.shape[2] * arr.shape[3])
    assert lazy.shape == arr.shape and np.array_equal(np.asarray(lazy), arr)
    assert blank_item("image", grid, enc).shape == arr.shape
    # the placeholders of a sample with this image: the release's count
    members = {"json": json.dumps({"conversation": [{"role": "user", "content": "<image>\nDescribe the image."},
                                                    {"role": "assistant", "content": "A picture."}],
                                   "media": [{"kind": "image", "field": "img0"}]}).encode(), "img0": data}
    raw = RawSample(__key__=name, __restore_key__=(), __subflavors__=None, __sources__=None, members=members)
    prompt = te.preencode_sample(raw).prompt.tokens
    assert (prompt == te.tok.special["<image>"]).sum() == _release_count(grid, RELEASE.downsample_ratio)


# ---- video frames: the released video processor's grid (aspect ratio kept, a tile's patches) -----------------

@pytest.mark.parametrize("encoders,target", [(OMNI, 1024), (OMNI_TINY, 16)])
def test_video_frame_grid_equals_the_release(encoders, target):
    """Every frame size (the SIZES above and random ones): Tessera's frame grid == the release's; its target is
    a tile's patches (the release's 1024 for the full ViT)."""
    enc = encoder_tokens(encoders, native_resolution=True, **TINY)
    assert enc.patches_per_tile == target
    for w, h in SIZES + _random_sizes(3000, 2, top=8000):
        assert enc.video_grid(w, h) == release_video_grid(h, w, target), f"{w}x{h}"


@pytest.mark.parametrize("size", [(160, 90), (64, 64), (40, 120)])
def test_the_loader_decodes_video_frames_at_the_release_grid(size, tokenizer):
    """An omni clip: units (frames, rows, cols) from the header, frames decoded (and deferred, and blanked) at that
    grid, the tubelet chunks' counts those of the grid; a vision-only (vl) model keeps one tile a frame."""
    from tessera.data.prepare import encode_mp4

    w, h = size
    data = encode_mp4((np.full((h, w, 3), 10 * t, np.uint8) for t in range(5)), fps=8)
    te = chat_task_encoder(tokenizer, OMNI_TINY, 256, video_frames=4, **TINY)
    deferred = chat_task_encoder(tokenizer, OMNI_TINY, 256, video_frames=4, defer_upscale=True, **TINY)
    grid = release_video_grid(h, w, te.enc.patches_per_tile)
    units, times = te._units("video", data)
    assert units == (4, *grid) and times == [0.0, 0.125, 0.25, 0.375]  # frames 0-3 of 5 at 8 fps
    frames, stamps = te._decode_item("video", data, units, "k", "s")
    assert frames.shape == (4, 3, grid[0] * 16, grid[1] * 16) and len(stamps) == 4
    lazy, _ = deferred._decode_item("video", data, units, "k", "s")
    assert lazy.shape == frames.shape and np.array_equal(np.asarray(lazy), frames)
    assert blank_item("video", units, te.enc)[0].shape == frames.shape
    per_tubelet = grid[0] * grid[1] // 4
    assert te.enc.video_tokens(units) == 2 * per_tubelet
    vl = chat_task_encoder(tokenizer, {"vision": "radio_vit_tiny"}, 256, video_frames=4, **TINY)
    assert vl._units("video", data)[0] == 4 and vl._decode_item("video", data, 4, "k", "s")[0].shape == (4, 3, 64, 64)


def test_vision_only_models_keep_tiles(tokenizer):
    te = chat_task_encoder(tokenizer, {"vision": "radio_vit_tiny"}, 256, **TINY)
    assert te.template == "vl" and not te.enc.native_resolution
    data = _image_bytes((500, 60), "JPEG")
    tiles, _ = te._units("image", data)
    assert isinstance(tiles, int) and te._decode_item("image", data, tiles, "k", "s").shape == (tiles, 3, 64, 64)


def test_an_image_without_a_grid_is_skipped_as_no_patch_grid(tokenizer):
    """A 2000 x 1 PNG floors to 0 rows in the tiny budget (the release divides by zero): skipped, not fatal."""
    from megatron.energon import SkipSample

    with pytest.raises(ZeroDivisionError):
        release_grid(1, 2000, patch_size=16, **TINY_RELEASE)
    te = chat_task_encoder(tokenizer, OMNI_TINY, 256, **TINY)
    members = {"json": json.dumps({"conversation": [{"role": "user", "content": "<image>"},
                                                    {"role": "assistant", "content": "A picture."}],
                                   "media": [{"kind": "image", "field": "img0"}]}).encode(),
               "img0": _image_bytes((2000, 1), "PNG")}
    raw = RawSample(__key__="line", __restore_key__=(), __subflavors__=None, __sources__=None, members=members)
    with pytest.raises(SkipSample, match="no_patch_grid"):
        te.preencode_sample(raw)


# ---- the model: count and encoder output of a decoded native image ---------------------------------------------

def test_the_model_encodes_a_native_image_as_the_release_does(tokenizer):
    """The decoded [1, 3, H, W] image through Tessera's vision module: MediaModule.num_tokens is the announced
    count, and the embeddings equal transformers' Omni get_image_features on the processor's patches of the same
    pixels at the release's image_grid_hw (rel err <= 1e-5)."""
    from _hf_oracles import tiny_omni
    from _mcore_cpu import single_rank_world

    from tessera.models import configs
    from tessera.models.encoders import encoder_config
    from tessera.models.hf_reference import processor_pixels
    from tessera.models.multimodal import build_media_module
    from tessera.models.multimodal_hf import PROJECTOR_ROOT, _load_params, vision_from_hf

    cfg = encoder_config("radio_vit_tiny")
    omni, released = tiny_omni(cfg, None, seed=5)
    mod = build_media_module(cfg.name, configs.TINY_DENSE["hidden_size"], single_rank_world(),
                             **{k: getattr(cfg, k) for k in ("final_norm", "summary_idxs", "input_conditioner")})
    root = PROJECTOR_ROOT["vision"]
    mod.projector.load_state_dict({k[len(root):]: v for k, v in released.items() if k.startswith(root)})
    _load_params(mod.encoder.vit, vision_from_hf(released, cfg))
    mod.eval()

    te = chat_task_encoder(tokenizer, OMNI_TINY, 256, **TINY)
    for name in ("wide_jpg", "tall_png"):
        (w, h), fmt = IMAGES[name]
        grid = release_grid(h, w, patch_size=16, **TINY_RELEASE)
        item = te._decode_item("image", _image_bytes((w, h), fmt), grid, "k", "s")
        announced = te.enc.image_tokens(grid)
        assert mod.num_tokens("image", item) == announced
        assert mod.num_tokens("image", TileSource.native_image(np.zeros((h, w, 3), np.uint8), *item.shape[2:])) \
            == announced
        with torch.no_grad():
            got = mod([("image", item)])
            pixels = processor_pixels(torch.as_tensor(item), cfg.patch, cfg.mean, cfg.std)
            ref = omni.get_image_features(pixels, image_grid_hw=torch.tensor([grid])).pooler_output[0]
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert got.shape[0] == announced and got.shape == ref.shape and err <= 1e-5, (name, err)
