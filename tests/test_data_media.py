"""The fast decode paths keep what the model sees: tiles/frames within rounding of PIL's bicubic resize,
reduced-scale JPEG decoding close to the full decode with the same tile count, resampling identical to
scipy's default, and media arriving from loader workers through shared memory unchanged.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_data_media.py -x -q
"""

from __future__ import annotations

import io
import pickle
import random
import tarfile

import av
import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

import tessera.data.media as media
from tessera.data.loader import ChatTaskEncoder, build_loader, close_loader
from tessera.data.media import choose_grid, decode_audio, decode_image, decode_video, probe_image, sample_indices
from tessera.data.packing import SHARE_MIN_BYTES, _reduce_ndarray
from tessera.data.tokens import EncoderTokens
from tessera.data.prepare import make_synthetic, synth_video


def _picture(w, h, seed=0):
    """Smooth shapes on a gradient, lightly blurred: photo-like enough for resampling comparisons."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    img = Image.fromarray(np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 127 // (w + h) + 64], -1).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = int(rng.integers(0, w - w // 5)), int(rng.integers(0, h - h // 5))
        draw.ellipse((x, y, x + w // 5, y + h // 6), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return img.filter(ImageFilter.GaussianBlur(1))


def _encode(img, fmt):
    buf = io.BytesIO()
    img.save(buf, format=fmt, quality=92)
    return buf.getvalue()


def _pil_tiles(img, tile, max_tiles):
    """The reference: PIL BICUBIC resize to the grid, row-major tiles, then a thumbnail (the old decoder)."""
    g = choose_grid(img.width, img.height, max_tiles, True, tile)
    big = np.asarray(img.convert("RGB").resize((g.cols * tile, g.rows * tile), Image.BICUBIC))
    tiles = [big[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(g.rows) for c in range(g.cols)]
    if g.thumbnail:
        tiles.append(np.asarray(img.convert("RGB").resize((tile, tile), Image.BICUBIC)))
    return np.stack(tiles).transpose(0, 3, 1, 2)


# Sizes that need no reduced decode at tile 128 (a source under twice the grid); see the next test for those.
@pytest.mark.parametrize("size,fmt", [((640, 480), "PNG"), ((200, 500), "JPEG"), ((200, 200), "PNG"), ((1400, 300), "PNG")])
def test_tiles_match_pil_bicubic(size, fmt):
    data = _encode(_picture(*size), fmt)
    got = decode_image(data, tile=128, max_tiles=6)
    want = _pil_tiles(Image.open(io.BytesIO(data)), 128, 6)
    assert got.shape == want.shape and got.dtype == np.uint8
    diff = np.abs(got.astype(int) - want)
    assert diff.max() <= 2 and diff.mean() < 0.05, (diff.max(), diff.mean())


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_large_images_decode_reduced_with_the_same_tiles(fmt, monkeypatch):
    """2400x1800 for a 3x2 grid of 256-px tiles (768x512): JPEG decodes at half scale (DCT), PNG is box-
    reduced by 2 before the bicubic pass. Tile count as the header predicts, pixels close to full decode."""
    from PIL import JpegImagePlugin

    data = _encode(_picture(2400, 1800, seed=1), fmt)
    scales = []
    real = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        out = real(self, mode, size)
        scales.append(self.decoderconfig[0])
        return out

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    got = decode_image(data, tile=256, max_tiles=6)
    assert scales == ([2] if fmt == "JPEG" else [])  # half scale still covers the grid; a quarter would not
    g = choose_grid(*probe_image(data), 6, True, 256)
    assert got.shape[0] == g.num_tiles == 7  # the tile count (so the token count) is the header's
    diff = np.abs(got.astype(int) - _pil_tiles(Image.open(io.BytesIO(data)), 256, 6))
    assert diff.mean() < 0.5 and np.percentile(diff, 99) <= 4, (diff.mean(), np.percentile(diff, 99))


def test_video_frames_match_pil_bicubic_and_tolerate_a_size_change(monkeypatch):
    data, _, _ = synth_video(random.Random(4))
    frames, stamps = decode_video(data, frames=4, tile=64)
    with av.open(io.BytesIO(data)) as c:
        decoded = list(c.decode(video=0))
    keep = sample_indices(len(decoded), 4)
    want = np.stack([np.asarray(decoded[i].to_image().resize((64, 64), Image.BICUBIC)) for i in keep]).transpose(0, 3, 1, 2)
    assert frames.shape == want.shape and np.abs(frames.astype(int) - want).max() <= 2
    assert np.allclose(stamps, [decoded[i].time for i in keep])

    # A stream whose resolution changes mid-way: resized frame by frame, same output shape.
    real = media._rgb24
    calls = iter(range(100))
    monkeypatch.setattr(media, "_rgb24", lambda f: real(f)[: -2 * (next(calls) % 2) or None])
    odd, _ = decode_video(data, frames=4, tile=64)
    assert odd.shape == frames.shape and np.array_equal(odd[0], frames[0])


@pytest.mark.parametrize("rate,channels", [(22050, 2), (44100, 2), (48000, 1), (8000, 1)])
def test_audio_is_what_librosa_gives_a_16k_model(rate, channels):
    """librosa.load(sr=16000)'s path (to_mono, then resample with its default soxr_hq): the preprocessing NeMo
    and the usual Parakeet/Omni pipelines apply; same length as probe_audio predicts from the header."""
    import librosa
    import soundfile as sf

    from tessera.data.media import probe_audio

    wave = np.random.default_rng(0).standard_normal((rate + 137, channels)).astype(np.float32) * 0.1
    buf = io.BytesIO()
    sf.write(buf, wave, rate, format="WAV", subtype="FLOAT")
    got = decode_audio(buf.getvalue())
    want = librosa.resample(librosa.to_mono(wave.T), orig_sr=rate, target_sr=16000, res_type="soxr_hq")
    assert got.dtype == np.float32 and got.shape == want.shape == (probe_audio(buf.getvalue()),)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # the channel mean's summation order differs


_HEADER_FORMATS = [("WAV", s) for s in ("PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE", "ULAW",
                                         "IMA_ADPCM")] + [("WAVEX", "PCM_16"), ("WAVEX", "FLOAT"), ("RF64", "PCM_16"),
                                                          ("FLAC", "PCM_16"), ("FLAC", "PCM_24"), ("OGG", "VORBIS")]


@pytest.mark.parametrize("fmt,subtype", _HEADER_FORMATS)
def test_audio_header_reads_what_libsndfile_reads(fmt, subtype):
    """The fast header read (plain WAV/FLAC) gives libsndfile's frame count and rate, or defers to it; the
    formats it must read itself are read, and a data chunk cut short is left to libsndfile."""
    import soundfile as sf

    from tessera.data.media import audio_header, probe_audio

    for channels, rate, frames in [(1, 8000, 1), (2, 44100, 12345), (3, 48000, 800), (1, 22050, 7)]:
        if subtype == "IMA_ADPCM" and channels > 2:
            continue  # libsndfile writes IMA ADPCM in mono or stereo only
        buf = io.BytesIO()
        sf.write(buf, np.full((frames, channels), 0.1, np.float32), rate, format=fmt, subtype=subtype)
        data = buf.getvalue()
        info = sf.info(io.BytesIO(data))
        head = audio_header(data)
        assert head in (None, (info.frames, info.samplerate)), (fmt, subtype, channels, rate, frames)
        if subtype in ("PCM_16", "PCM_24", "FLOAT") and fmt != "RF64":
            assert head is not None  # the formats users store are read without libsndfile
        assert probe_audio(data) == -(-info.frames * 16000 // info.samplerate)
    if fmt == "WAV" and subtype == "PCM_16":  # data chunk declared longer than the bytes present
        buf = io.BytesIO()
        sf.write(buf, np.full((1000, 2), 0.1, np.float32), 8000, format=fmt, subtype=subtype)
        cut = buf.getvalue()[:-10]
        assert audio_header(cut) is None and probe_audio(cut) == 2 * sf.info(io.BytesIO(cut)).frames


@pytest.mark.parametrize("fmt,codec", [("mp4", "mpeg4"), ("mov", "mpeg4"), ("matroska", "mpeg4"),
                                       ("webm", "libvpx-vp9"), ("avi", "mpeg4")])
def test_video_demuxer_named_from_magic_bytes_is_ffmpegs_choice(fmt, codec, monkeypatch):
    """The demuxer picked from the first bytes is the one ffmpeg's own probing picks, and the frames and
    timestamps decoded through it equal those decoded with ffmpeg's detection."""
    import av

    from tessera.data import media

    if codec not in av.codecs_available:
        pytest.skip(f"{codec} not in this ffmpeg build")
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as c:
        s = c.add_stream(codec, rate=8)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for t in range(6):
            f = av.VideoFrame.from_ndarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), format="rgb24")
            f.pts = t
            c.mux(s.encode(f))
        c.mux(s.encode())
    data = buf.getvalue()
    with media._open_video(data) as hinted, av.open(io.BytesIO(data)) as probed:
        assert hinted.format.name in probed.format.name.split(",")  # "mp4" names the "mov,mp4,..." demuxer
    got = decode_video(data, frames=4, tile=32)
    monkeypatch.setattr(media, "_open_video", lambda d: av.open(io.BytesIO(d)))
    want = decode_video(data, frames=4, tile=32)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_large_arrays_pickle_as_shared_tensors_with_layout_kept():
    tiles = np.ascontiguousarray(np.random.default_rng(0).integers(0, 256, (3, 256, 256, 3), dtype=np.uint8))
    view = tiles.transpose(0, 3, 1, 2)  # what decode_image returns: channels-last strides
    assert view.nbytes >= SHARE_MIN_BYTES
    fn, args = _reduce_ndarray(view)
    back = fn(*args)
    assert type(back) is np.ndarray and back.strides == view.strides and np.array_equal(back, view)
    small = np.arange(10)
    assert _reduce_ndarray(small) == small.__reduce__()
    assert np.array_equal(pickle.loads(pickle.dumps(view)), view)  # plain pickling is untouched


def test_media_from_a_worker_arrive_through_shared_memory_unchanged(tmp_path):
    import torch

    make_synthetic(tmp_path, samples=8, seed=9, shard_size=8, prefix="w")
    raw = {}
    with tarfile.open(next(tmp_path.glob("shard-*.tar"))) as tf:
        for m in tf.getmembers():
            raw[m.name] = tf.extractfile(m).read()
    enc = EncoderTokens(tile=256, patch=64)
    te = ChatTaskEncoder(tmp_path / "tokenizer.model", 4096, enc)
    ld = build_loader(tmp_path, te, 2, num_workers=1, shuffle_buffer=None, repeat=False)
    seen = 0
    for b in ld:
        for keys, row in zip(b.keys, b.media):
            images = [x for k, x in row.get("vision", []) if k == "image"]
            mine = [decode_image(raw[n], 256, enc.max_tiles) for key in keys for n in sorted(raw)
                    if n.startswith(key + ".img")]
            assert len(images) == len(mine)
            for got, want in zip(images, mine):
                assert type(got) is np.ndarray and np.array_equal(got, want)
                if got.nbytes >= SHARE_MIN_BYTES:
                    assert isinstance(got.base, torch.Tensor)  # came as a shared-memory tensor, not pickled
                    seen += 1
    close_loader(ld)
    assert seen > 0
