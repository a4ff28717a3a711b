"""Media decoding for the loader: raw shard bytes in, encoder-ready arrays out.

Each decoder takes the bytes of one tar member and returns exactly what the encoder consumes, so that the
number of LLM placeholder tokens can be computed from the decoded result (see data/tokens.py):

- image → dynamic tiles: a grid of `tile`×`tile` crops chosen by aspect ratio (at most `max_tiles`), plus a
  thumbnail of the whole image when the grid has more than one tile. uint8 [T, 3, tile, tile]. The omni
  family instead takes each image at native resolution (decode_native_image): one uint8 [1, 3, H, W] image
  resized to the released Omni processor's patch grid (models/media_tokens.native_patch_grid).
- video → `frames` uniformly spaced frames, each resized to one tile, with their timestamps in seconds
  (PyAV; no torchvision). uint8 [F, 3, tile, tile], float64 [F]. The omni family resizes every frame to the
  released Omni video processor's grid instead (the clip's aspect ratio, a tile's patches:
  models/media_tokens.video_frame_grid).
- audio → 16 kHz mono float32 waveform (soundfile + libsoxr resampling as librosa does; no torchaudio),
  the input of the NeMo AudioToMelSpectrogramPreprocessor.

Each kind also has a cheap `probe_*` that reads only headers/packets and predicts the decoded shape, so the
task encoder can size placeholders and pack before paying for the decode (energon's pre-/post-encode split);
the decode then checks the prediction. Every failure raises MediaError with a short reason; the task encoder turns it into a counted skip.
Arrays stay uint8 until the encoder normalises them: 4× less memory through the worker queues.

Speed (scripts/bench_loader.py): resizing dominates, so images are resized once to the whole tile grid and
videos in one batched call, with torch's uint8 antialiased bicubic on channels-last data (PIL's filter,
pixels within ±2 of PIL's BICUBIC); large JPEGs decode at 1/2-1/8 scale (draft) when that still covers
the grid. Tiles and frames are therefore [T, 3, tile, tile] views of interleaved [T, tile, tile, 3]
memory (channels-last strides), which the encoders read like any tensor. The resize rule itself lives in
models/tiling.py; with `defer_upscale` (a run on GPUs) media smaller than their tiles leave the loader as
TileSource (decoded pixels + grid) and are resized on the GPU after the (smaller) transfer.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import soundfile as sf
import torch
from PIL import Image

from tessera.models.tiling import TileSource, cut_tiles, hwc_to_nchw, resize

AUDIO_RATE = 16_000


class MediaError(ValueError):
    """A media member that cannot be decoded or that no encoder can take; the message is the reason logged
    with the skip, `reason` its counted category (None: `undecodable_<kind>`)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TileGrid:
    cols: int
    rows: int
    thumbnail: bool

    @property
    def num_tiles(self) -> int:
        return self.cols * self.rows + int(self.thumbnail)


def choose_grid(width: int, height: int, max_tiles: int, use_thumbnail: bool = True, tile: int = 512) -> TileGrid:
    """The cols×rows grid (cols*rows <= max_tiles) whose aspect ratio is closest to the image's.

    Ties go to the larger grid only while the image has enough pixels to fill it at least half way, so a
    small image is not blown up into many blurry tiles (the rule InternVL-style tilers use)."""
    if width <= 0 or height <= 0:
        raise MediaError(f"image has an empty size {width}x{height}")
    aspect = width / height
    grids = sorted({(c, r) for n in range(1, max_tiles + 1) for c in range(1, n + 1) for r in range(1, n + 1)
                    if c * r <= max_tiles}, key=lambda g: (g[0] * g[1], g))
    best, best_diff = (1, 1), float("inf")
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff - 1e-12:
            best, best_diff = (c, r), diff
        elif abs(diff - best_diff) <= 1e-12 and width * height > 0.5 * tile * tile * c * r:
            best = (c, r)
    cols, rows = best
    return TileGrid(cols, rows, thumbnail=use_thumbnail and cols * rows > 1)


def probe_image(data: bytes) -> tuple[int, int]:
    """(width, height) from the image header, without decoding pixels.

    Also rejects JPEG/PNG files whose end marker is missing (EOI / IEND): a truncated download or copy is
    the most common undecodable image, and catching it here, on every rank, costs no decode."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            size, fmt = img.size, img.format
    except Image.DecompressionBombError as e:  # PIL's guard: > 2 x MAX_IMAGE_PIXELS (~179 M pixels)
        raise MediaError(f"image too large to decode safely: {e}", reason="too_large") from None
    except Exception as e:
        raise MediaError(f"undecodable image header: {type(e).__name__}: {e}") from None
    tail = data[-256:]
    if (fmt == "JPEG" and b"\xff\xd9" not in tail) or (fmt == "PNG" and b"IEND" not in tail):
        raise MediaError(f"truncated {fmt} image: end marker missing ({len(data)} bytes)")
    return size


def _decode_rgb(data: bytes, plan):
    """(plan(stored width, height)[0], uint8 [h, w, 3] pixels) of image bytes, decoded no larger than needed:
    plan returns (the caller's layout, (width, height) in pixels of what the pixels will be resized to)."""
    try:
        img = Image.open(io.BytesIO(data))
        # The layout comes from the stored size (what probe_image saw), never from a reduced decode.
        layout, (gw, gh) = plan(img.width, img.height)
        if img.format == "JPEG":
            # DCT-domain downscaling by 2/4/8 while decoding, only as far as the result still covers the
            # target (and so the thumbnail): a large photo decodes several times faster; a small image is
            # untouched. The reduced decode differs from full decode + bicubic only by a few levels.
            img.draft("RGB", (gw, gh))
        img.load()  # forces the full decode here, so a truncated file fails now and not inside the encoder
        if img.mode != "RGB":
            img = img.convert("RGB")
        # Other formats: integer box reduction down to twice the target first (PIL's reducing_gap=2),
        # so the bicubic pass does not filter a huge source.
        k = min(img.width // (2 * gw), img.height // (2 * gh))
        if k >= 2:
            img = img.reduce(k)
        return layout, np.array(img)  # a writable copy: torch refuses read-only buffers with a warning
    except MediaError:
        raise
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError...)
        raise MediaError(f"undecodable image: {type(e).__name__}: {e}") from None


def decode_image(data: bytes, tile: int = 512, max_tiles: int = 6, use_thumbnail: bool = True,
                 defer_upscale: bool = False) -> np.ndarray | TileSource:
    """Image bytes (JPEG/PNG/...) → uint8 tiles [T, 3, tile, tile], grid tiles row-major, thumbnail last.
    defer_upscale: when the tiles hold more pixels than the decoded image, return it as a TileSource whose
    tiles are cut on the encoding device (models/tiling.py)."""
    def plan(width, height):
        grid = choose_grid(width, height, max_tiles, use_thumbnail, tile)
        return grid, (grid.cols * tile, grid.rows * tile)

    grid, arr = _decode_rgb(data, plan)
    if defer_upscale and grid.num_tiles * tile * tile > arr.shape[0] * arr.shape[1]:
        return TileSource(arr, grid.cols, grid.rows, grid.thumbnail, tile)
    return cut_tiles(hwc_to_nchw(arr), grid.cols, grid.rows, grid.thumbnail, tile).numpy()


def native_grid(width: int, height: int, enc) -> tuple[int, int]:
    """(rows, cols) patches of a width x height image at native resolution (EncoderTokens.image_grid, the
    released Omni processor's rule); an image without such a grid is a MediaError."""
    try:
        return enc.image_grid(width, height)
    except ValueError as e:
        raise MediaError(str(e), reason="no_patch_grid") from None


def decode_native_image(data: bytes, enc, defer_upscale: bool = False) -> np.ndarray | TileSource:
    """Image bytes → one uint8 [1, 3, rows * patch, cols * patch] image at its native-resolution grid
    (native_grid), the omni family's image; with defer_upscale an image smaller than its grid comes as a
    TileSource resized on the encoding device.

    The grid is the release's; the pixels are close to but not exactly the release's: its image processor
    resizes with torchvision (tvF.resize, bicubic, antialias=True) on float32 pixels and keeps the bicubic
    overshoot below 0 and above 255 into its normalisation, while Tessera resizes here with the data path's
    one resize (models/tiling.resize: torch's uint8 antialiased bicubic, PIL's BICUBIC filter in two passes,
    each rounded and clamped to uint8), and a large JPEG may decode reduced (draft) or be box-reduced first.
    Smooth regions agree to rounding (half a level); at sharp edges the clamped overshoot can differ by tens of
    levels. An image already at its grid's size is not resized by either."""
    def plan(width, height):
        rows, cols = native_grid(width, height, enc)
        return (rows, cols), (cols * enc.patch, rows * enc.patch)

    (rows, cols), arr = _decode_rgb(data, plan)
    height, width = rows * enc.patch, cols * enc.patch
    if defer_upscale and height * width > arr.shape[0] * arr.shape[1]:
        return TileSource.native_image(arr, height, width)
    return resize(hwc_to_nchw(arr), height, width).numpy()


def sample_indices(total: int, wanted: int) -> list[int]:
    """`wanted` frame indices spread uniformly over `total` frames, all when fewer: the released processor's rule
    (transformers 5.24 video_utils.default_sample_indices_fn, l.353: arange(wanted) * total // wanted, the first
    frame of each of `wanted` equal segments), so a clip trains on the frames it is served with."""
    if total <= wanted:
        return list(range(total))
    return [i * total // wanted for i in range(wanted)]


def _rgb24(frame) -> np.ndarray:
    """frame.to_ndarray(format="rgb24") with a single-threaded swscale context. The default (threads=0,
    "auto") starts a thread pool for every frame: 0.4-6 ms of set-up for a 30 us conversion, and a context
    with threads must never be used in a forked loader worker. Same pixels."""
    return frame.reformat(format="rgb24", threads=1).to_ndarray()


def _count_packets(container, stream) -> int:
    return sum(1 for p in container.demux(stream) if p.size > 0)


def _open_video(data: bytes):
    """av.open with the demuxer named from the file's magic bytes when they are unambiguous: ffmpeg's own
    format probing tries every demuxer and took a third of opening a small clip (~0.14 of 0.4 ms), and each
    clip is opened twice (probe, decode). Other files are left to ffmpeg's detection."""
    fmt = ("mp4" if data[4:8] == b"ftyp" else "matroska" if data[:4] == b"\x1aE\xdf\xa3" else
           "avi" if data[:4] == b"RIFF" and data[8:12] == b"AVI " else None)
    return av.open(io.BytesIO(data), format=fmt)


@dataclass(frozen=True)
class VideoHeader:
    """What a clip's container says before decoding: frames counted from demuxed packets (headers often omit
    them), the frame size and the stream's average frame rate (None when the container has none)."""

    frames: int
    width: int
    height: int
    fps: float | None


def probe_video(data: bytes) -> VideoHeader:
    """The clip's VideoHeader, without decoding a frame."""
    try:
        with _open_video(data) as container:
            if not container.streams.video:
                raise MediaError("video member has no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate
            total = _count_packets(container, stream)
    except MediaError:
        raise
    except Exception as e:
        raise MediaError(f"undecodable video container: {type(e).__name__}: {e}") from None
    if total == 0:
        raise MediaError("video stream has no frames")
    return VideoHeader(total, width, height, float(rate) if rate else None)


def decode_video(data: bytes, frames: int = 8, tile: int = 512, defer_upscale: bool = False,
                 size: tuple[int, int] | None = None) -> tuple[np.ndarray | TileSource, np.ndarray]:
    """Video bytes → (uint8 [F, 3, tile, tile], float64 timestamps [F]) with F = min(frames, frames in file);
    `size` (height, width): frames of that size instead of one tile (the omni family's frame grid,
    EncoderTokens.video_grid); with defer_upscale, frames smaller than that come as a TileSource (resized on the
    encoding device).

    Packets are demuxed once, without decoding, to learn the frame count (container headers often omit it)
    and then decoded from memory up to the last chosen frame; only the chosen frames are converted to RGB
    (at their stored size), and all of them are resized to the tile in one batched call."""
    try:
        with _open_video(data) as container:
            if not container.streams.video:
                raise MediaError("video member has no video stream")
            stream = container.streams.video[0]
            packets = list(container.demux(stream))  # the final empty packet flushes the decoder
            total = sum(1 for p in packets if p.size > 0)
            if total == 0:
                raise MediaError("video stream has no frames")
            keep = sample_indices(total, frames)
            wanted, rgb, stamps = set(keep), [], []
            base = stream.time_base or Fraction(1, 1)
            i = 0
            for packet in packets:
                for frame in stream.decode(packet):
                    if i in wanted:
                        rgb.append(_rgb24(frame))
                        stamps.append(float((frame.pts or 0) * base))
                    i += 1
                if len(rgb) == len(keep):
                    break
    except MediaError:
        raise
    except Exception as e:  # av raises its own error family (InvalidDataError, ...)
        raise MediaError(f"undecodable video: {type(e).__name__}: {e}") from None
    if len(rgb) != len(keep):
        raise MediaError(f"video decoded {len(rgb)} of {len(keep)} sampled frames (truncated stream?)")
    stamps = np.asarray(stamps, dtype=np.float64)
    height, width = size or (tile, tile)
    if len({a.shape for a in rgb}) == 1:  # the usual case: one batched resize, channels-last like the images
        src = np.stack(rgb)
        if defer_upscale and height * width > src.shape[1] * src.shape[2]:
            return (TileSource(src, 1, 1, False, tile) if size is None else
                    TileSource.native_image(src, height, width)), stamps
        return resize(hwc_to_nchw(src), height, width).numpy(), stamps
    # a stream that changes resolution mid-way
    out = torch.cat([resize(hwc_to_nchw(a), height, width).permute(0, 2, 3, 1) for a in rgb]).permute(0, 3, 1, 2)
    return out.numpy(), stamps


def blank_item(kind: str, units, enc) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """A stand-in of the predicted shape for an item that failed to decode after it was packed: black
    tiles/frames, a black native-resolution image (units = its (rows, cols) grid) or clip (units = (frames, rows,
    cols)), or silence, so the encoder still produces exactly the planned number of embeddings."""
    if kind == "audio":
        return np.zeros(units, dtype=np.float32)
    if kind == "video":  # frames, or (frames, rows, cols) at native resolution
        frames, h, w = (units, enc.tile, enc.tile) if isinstance(units, int) else \
            (units[0], units[1] * enc.patch, units[2] * enc.patch)
        return np.zeros((frames, 3, h, w), dtype=np.uint8), np.zeros(frames, dtype=np.float64)
    if isinstance(units, tuple):
        return np.zeros((1, 3, units[0] * enc.patch, units[1] * enc.patch), dtype=np.uint8)
    return np.zeros((units, 3, enc.tile, enc.tile), dtype=np.uint8)


def resample(wave: np.ndarray, rate: int, target: int = AUDIO_RATE) -> np.ndarray:
    """float32 mono `wave` at `rate` → `target` Hz as librosa.resample does by default (res_type="soxr_hq":
    libsoxr's HQ filter, output fixed to ceil(n * target / rate) samples), i.e. what NeMo's and the usual
    Parakeet/Omni preprocessing give a 16 kHz model. ~3x faster than scipy's polyphase filter, with a steeper
    anti-aliasing cut (tests/test_data_media.py checks it against librosa)."""
    if rate == target:
        return wave
    import soxr  # imported lazily: only audio needs it

    out = soxr.resample(wave, rate, target, quality="HQ").astype(np.float32, copy=False)
    n = resampled_length(len(wave), rate, target)
    return out[:n] if len(out) >= n else np.pad(out, (0, n - len(out)))


def resampled_length(n: int, rate: int, target: int = AUDIO_RATE) -> int:
    return n if rate == target else -(-n * target // rate)


def _mono(wave: np.ndarray) -> np.ndarray:
    """[n, channels] → [n]: the channel mean (librosa.to_mono), as a BLAS product: numpy's mean over a
    short trailing axis walks the array with strides and took longer than decoding."""
    if wave.shape[1] == 1:
        return wave[:, 0]
    return wave @ np.full(wave.shape[1], 1.0 / wave.shape[1], dtype=np.float32)


_WAV_LINEAR = {1, 3}  # WAVE_FORMAT_PCM, WAVE_FORMAT_IEEE_FLOAT: frames = data bytes / block align


def audio_header(data: bytes) -> tuple[int, int] | None:
    """(frames, sample rate) read straight from a plain WAV (PCM/float) or FLAC header, or None for anything
    else (OGG, RF64, ADPCM, FLAC behind an ID3 tag or without a sample count, a data chunk running past the
    end, ...), which libsndfile then probes. Opening libsndfile costs ~0.3 ms per clip, as much as decoding a
    short one, and the header alone sizes the placeholders; tests/test_data_media.py checks the two agree."""
    if data[:4] == b"fLaC" and len(data) >= 42 and data[4] & 0x7F == 0:  # first block: STREAMINFO
        bits = int.from_bytes(data[18:26], "big")  # rate:20 channels-1:3 bits-1:5 total samples:36
        rate, frames = bits >> 44, bits & (1 << 36) - 1
        return (frames, rate) if frames and rate else None
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos, block, rate = 12, 0, 0
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "little")
        if cid == b"fmt " and size >= 16:
            fmt = int.from_bytes(data[pos + 8:pos + 10], "little")
            if fmt == 0xFFFE and size >= 40:  # WAVE_FORMAT_EXTENSIBLE: the subformat GUID starts with the code
                fmt = int.from_bytes(data[pos + 32:pos + 34], "little")
            if fmt not in _WAV_LINEAR:
                return None
            rate, block = int.from_bytes(data[pos + 12:pos + 16], "little"), int.from_bytes(data[pos + 20:pos + 22], "little")
        elif cid == b"data":
            if not (block and rate) or pos + 8 + size > len(data):
                return None
            return size // block, rate
        pos += 8 + size + (size & 1)
    return None


def probe_audio_header(data: bytes) -> tuple[int, int]:
    """(frames, sample rate) of an audio member from its header only (libsndfile where the plain parse cannot)."""
    head = audio_header(data)
    if head is None:
        try:
            info = sf.info(io.BytesIO(data))
        except Exception as e:
            raise MediaError(f"undecodable audio header: {type(e).__name__}: {e}") from None
        head = info.frames, info.samplerate
    return head


def audio_samples(frames: int, rate: int, target_rate: int = AUDIO_RATE) -> int:
    """Samples the decoded waveform will have at `target_rate`; a clip without samples is refused."""
    if frames <= 0:
        raise MediaError("audio has no samples", reason="too_short")
    return resampled_length(frames, rate, target_rate)


def probe_audio(data: bytes, target_rate: int = AUDIO_RATE) -> int:
    """Number of samples the decoded waveform will have at `target_rate`, from the header only."""
    return audio_samples(*probe_audio_header(data), target_rate)


def decode_audio(data: bytes, target_rate: int = AUDIO_RATE, min_samples: int = 0) -> np.ndarray:
    """Audio bytes (WAV/FLAC/OGG) → float32 mono waveform at `target_rate`, zero-padded at the end to
    `min_samples` (the released front end pads clips shorter than 0.1 s: EncoderTokens.audio_min_samples)."""
    try:
        wave, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises LibsndfileError / RuntimeError
        raise MediaError(f"undecodable audio: {type(e).__name__}: {e}") from None
    if wave.shape[0] == 0:
        raise MediaError("audio has no samples", reason="too_short")
    out = resample(np.ascontiguousarray(_mono(wave)), rate, target_rate)
    return np.pad(out, (0, min_samples - len(out))) if len(out) < min_samples else out

