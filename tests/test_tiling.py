"""Deferred tiling (models/tiling.py): media smaller than their tiles leave the loader as TileSource and are
resized where they are encoded; what the encoder gets is bit-identical on the CPU, within 2 levels elsewhere."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from tessera.data.loader import ChatTaskEncoder, build_loader, close_loader
from tessera.data.media import decode_image, decode_video
from tessera.data.prepare import synth_video
from tessera.data.tokens import EncoderTokens
from tessera.models.multimodal import _pixels
from tessera.models.tiling import TileSource, resize, resize_float


def _image(w: int, h: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(w * 7 + h)
    arr = (rng.integers(0, 255, (h, w, 3)) * 0.3 + np.linspace(0, 170, w)[None, :, None]).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("w,h", [(1, 1), (200, 200), (640, 480), (300, 900), (1024, 256), (97, 1531)])
def test_deferred_image_tiles_are_the_loaders_tiles_bit_for_bit(w, h):
    data = _image(w, h)
    eager = decode_image(data, tile=512, max_tiles=6)
    deferred = decode_image(data, tile=512, max_tiles=6, defer_upscale=True)
    assert isinstance(deferred, TileSource), "these images are smaller than their tiles"
    assert deferred.shape == eager.shape and len(deferred) == len(eager)
    assert deferred.source.nbytes < eager.nbytes  # what crosses to the device shrinks
    assert torch.equal(deferred.tiles("cpu"), torch.from_numpy(eager))
    assert np.array_equal(np.asarray(deferred), eager)
    assert torch.equal(_pixels(deferred, torch.device("cpu")), _pixels(eager, torch.device("cpu")))


def test_images_larger_than_their_tiles_are_cut_in_the_loader():
    data = _image(1600, 1200, "JPEG")
    out = decode_image(data, tile=128, max_tiles=6, defer_upscale=True)
    assert isinstance(out, np.ndarray) and np.array_equal(out, decode_image(data, tile=128, max_tiles=6))


def test_deferred_video_frames_are_the_loaders_frames_bit_for_bit():
    data, _, _ = synth_video(random.Random(5))  # 96-160 px frames
    (eager, t0), (deferred, t1) = decode_video(data, 4, 256), decode_video(data, 4, 256, defer_upscale=True)
    assert isinstance(deferred, TileSource) and np.array_equal(t0, t1) and deferred.shape == eager.shape
    assert torch.equal(deferred.tiles("cpu"), torch.from_numpy(eager))


def test_float_resize_for_devices_without_the_uint8_kernel_is_within_two_levels():
    """Noise is the worst case for bicubic overshoot; a single unclamped float pass is ~20 levels off here."""
    x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (2, 3, 37, 53), dtype=np.uint8))
    for size in [(128, 128), (20, 90), (16, 16)]:
        a, b = resize(x, *size), resize_float(x, *size)
        d = (a.int() - b.int()).abs()
        assert a.dtype == b.dtype == torch.uint8 and d.max() <= 2 and (d > 0).float().mean() < 0.01


def test_loader_with_deferred_upscale_gives_the_same_batches(tmp_path):
    """Through energon with a worker process (TileSource pickled to the main process)."""
    from tessera.data.prepare import make_synthetic

    make_synthetic(tmp_path, samples=16, shard_size=8)
    enc = EncoderTokens(tile=64, max_tiles=2, video_frames=2)
    got = []
    for defer in (False, True):
        te = ChatTaskEncoder(tmp_path / "tokenizer.model", 256, enc, defer_upscale=defer)
        loader = build_loader(tmp_path, te, 2, num_workers=1, repeat=False, shuffle_buffer=None)
        got.append([(b.keys, [{m: [(k, np.asarray(i[0] if k == "video" else i)) for k, i in items]
                               for m, items in row.items()} for row in b.media]) for b in loader])
        close_loader(loader)
    (plain, deferred), n = got, 0
    assert [k for k, _ in plain] == [k for k, _ in deferred]
    for (_, rows_a), (_, rows_b) in zip(plain, deferred):
        for ra, rb in zip(rows_a, rows_b):
            for m in ra:
                for (ka, a), (kb, b) in zip(ra[m], rb[m]):
                    assert ka == kb and a.shape == b.shape and np.array_equal(a, b)
                    n += ka != "audio"
    assert n > 4


@pytest.mark.parametrize("size", [(512, 512), (96, 300)])
def test_both_resizes_are_within_two_levels_of_pil_bicubic(size):
    """The outside reference for what the encoder sees: PIL's BICUBIC resize (the released VL preprocessing's
    filter). The uint8 kernel (host) and the float path (GPU) are each within 2 levels of it."""
    arr = np.ascontiguousarray(np.random.default_rng(1).integers(0, 256, (61, 83, 3), dtype=np.uint8))
    want = np.asarray(Image.fromarray(arr).resize(size[::-1], Image.BICUBIC)).astype(int)
    x = torch.from_numpy(arr)[None].permute(0, 3, 1, 2)
    for got in (resize(x, *size), resize_float(x.contiguous(), *size)):
        diff = np.abs(got[0].permute(1, 2, 0).numpy().astype(int) - want)
        assert diff.max() <= 2, diff.max()
