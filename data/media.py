"""Media decoding for the loader: raw shard bytes in, encoder-ready arrays out.

Each decoder takes the bytes of one tar member and returns exactly what the encoder consumes, so that the
number of LLM placeholder tokens can be computed from the decoded result (see data/tokens.py):

- image → dynamic tiles: a grid of `tile`×`tile` crops chosen by aspect ratio (at most `max_tiles`), plus a
  thumbnail of the whole image when the grid has more than one tile. uint8 [T, 3, tile, tile].
- video → `frames` uniformly spaced frames, each resized to one tile, with their timestamps in seconds
  (PyAV; no torchvision). uint8 [F, 3, tile, tile], float64 [F].
- audio → 16 kHz mono float32 waveform (soundfile + polyphase resampling; no torchaudio), the input of the
  NeMo AudioToMelSpectrogramPreprocessor.

Each kind also has a cheap `probe_*` that reads only headers/packets and predicts the decoded shape, so the
task encoder can size placeholders and pack before paying for the decode (energon's pre-/post-encode split);
the decode then checks the prediction. Every failure raises MediaError with a short reason; the task encoder turns it into a counted skip.
Arrays stay uint8 until the encoder normalises them: 4× less memory through the worker queues.

Speed (scripts/bench_loader.py): resizing dominates, so images are resized once to the whole tile grid and
videos in one batched call, with torch's uint8 antialiased bicubic on channels-last data (PIL's filter,
pixels within ±2 of PIL's BICUBIC); large JPEGs decode at 1/2-1/8 scale (draft) when that still covers
the grid. Tiles and frames are therefore [T, 3, tile, tile] views of interleaved [T, tile, tile, 3]
memory (channels-last strides), which the encoders read like any tensor.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import soundfile as sf
import torch
from PIL import Image

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


def _resize(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [N, 3, h, w] → uint8 [N, 3, height, width], bicubic with antialiasing, channels-last in and out.

    torch's uint8 kernel matches PIL's BICUBIC resize (same antialiased filter; measured max difference 2/255,
    mean 0.001) at 3-10x its speed with one thread. It works on interleaved RGB, so channels-last input and
    output skip two layout conversions (each costs more than the resize of a small source)."""
    if x.shape[-2:] == (height, width):
        return x
    return torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", antialias=True)


def _hwc_to_nchw(arr: np.ndarray) -> torch.Tensor:
    """A contiguous [h, w, 3] or [n, h, w, 3] uint8 array as an [n, 3, h, w] channels-last view (no copy).

    The batch axis is added before the permute so that its stride is h*w*3: with stride 3 torch no longer
    recognises the layout as channels-last and returns a channel-first result (a 2 ms conversion per image)."""
    t = torch.from_numpy(arr)
    return (t[None] if t.ndim == 3 else t).permute(0, 3, 1, 2)


def decode_image(data: bytes, tile: int = 512, max_tiles: int = 6, use_thumbnail: bool = True) -> np.ndarray:
    """Image bytes (JPEG/PNG/...) → uint8 tiles [T, 3, tile, tile], grid tiles row-major, thumbnail last."""
    try:
        img = Image.open(io.BytesIO(data))
        # The grid comes from the stored size (what probe_image saw), never from a reduced decode.
        grid = choose_grid(img.width, img.height, max_tiles, use_thumbnail, tile)
        gw, gh = grid.cols * tile, grid.rows * tile
        if img.format == "JPEG":
            # DCT-domain downscaling by 2/4/8 while decoding, only as far as the result still covers the
            # grid (and so the thumbnail): a large photo decodes several times faster; a small image is
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
        src = _hwc_to_nchw(np.array(img))  # a writable copy: torch refuses read-only buffers with a warning
    except MediaError:
        raise
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError...)
        raise MediaError(f"undecodable image: {type(e).__name__}: {e}") from None
    # One resize for the whole grid, then the tiles are cut by a single copy into the output, whose memory
    # is [T, tile, tile, 3]: every copied run is a whole tile row of interleaved RGB. The result is the
    # [T, 3, tile, tile] view of it (channels-last strides; the encoders accept any strides).
    n = grid.cols * grid.rows
    out = torch.empty((n + int(grid.thumbnail), tile, tile, 3), dtype=torch.uint8)
    big = _resize(src, gh, gw)[0].permute(1, 2, 0)  # [gh, gw, 3] view of channels-last memory
    out[:n].view(grid.rows, grid.cols, tile, tile, 3).copy_(
        big.view(grid.rows, tile, grid.cols, tile, 3).permute(0, 2, 1, 3, 4))
    if grid.thumbnail:
        out[n] = _resize(src, tile, tile)[0].permute(1, 2, 0)
    return out.permute(0, 3, 1, 2).numpy()


def sample_indices(total: int, wanted: int) -> list[int]:
    """`wanted` frame indices spread uniformly over `total` frames (segment centres), all when fewer."""
    if total <= wanted:
        return list(range(total))
    return [min(total - 1, int((i + 0.5) * total / wanted)) for i in range(wanted)]


def _rgb24(frame) -> np.ndarray:
    """frame.to_ndarray(format="rgb24") with a single-threaded swscale context. The default (threads=0,
    "auto") starts a thread pool for every frame: 0.4-6 ms of set-up for a 30 us conversion, and a context
    with threads must never be used in a forked loader worker. Same pixels."""
    return frame.reformat(format="rgb24", threads=1).to_ndarray()


def _count_packets(container, stream) -> int:
    return sum(1 for p in container.demux(stream) if p.size > 0)


def probe_video(data: bytes) -> int:
    """Number of video frames, counted from demuxed packets (no decoding; headers often omit it)."""
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError("video member has no video stream")
            total = _count_packets(container, container.streams.video[0])
    except MediaError:
        raise
    except Exception as e:
        raise MediaError(f"undecodable video container: {type(e).__name__}: {e}") from None
    if total == 0:
        raise MediaError("video stream has no frames")
    return total


def decode_video(data: bytes, frames: int = 8, tile: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Video bytes → (uint8 [F, 3, tile, tile], float64 timestamps [F]) with F = min(frames, frames in file).

    Packets are demuxed once, without decoding, to learn the frame count (container headers often omit it)
    and then decoded from memory up to the last chosen frame; only the chosen frames are converted to RGB
    (at their stored size), and all of them are resized to the tile in one batched call."""
    try:
        with av.open(io.BytesIO(data)) as container:
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
    if len({a.shape for a in rgb}) == 1:  # the usual case: one batched resize, channels-last like the images
        out = _resize(_hwc_to_nchw(np.stack(rgb)), tile, tile)
    else:  # a stream that changes resolution mid-way
        out = torch.cat([_resize(_hwc_to_nchw(a), tile, tile).permute(0, 2, 3, 1) for a in rgb]).permute(0, 3, 1, 2)
    return out.numpy(), np.asarray(stamps, dtype=np.float64)


def blank_item(kind: str, units: int, enc) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """A stand-in of the predicted shape for an item that failed to decode after it was packed: black
    tiles/frames or silence, so the encoder still produces exactly the planned number of embeddings."""
    if kind == "audio":
        return np.zeros(units, dtype=np.float32)
    tiles = np.zeros((units, 3, enc.tile, enc.tile), dtype=np.uint8)
    return (tiles, np.zeros(units, dtype=np.float64)) if kind == "video" else tiles


@functools.lru_cache(maxsize=64)
def _polyphase_filter(up: int, down: int) -> np.ndarray:
    """The low-pass FIR scipy's resample_poly designs for (up, down) with its default window; designing it
    took half of the resampling time, and a data set has only a handful of distinct rates."""
    from scipy.signal import firwin

    m = max(up, down)
    return firwin(2 * 10 * m + 1, 1.0 / m, window=("kaiser", 5.0)).astype(np.float32)


def resample(wave: np.ndarray, rate: int, target: int = AUDIO_RATE) -> np.ndarray:
    """Polyphase resampling (scipy), exact length ceil(n * target / rate) for rational rate ratios."""
    if rate == target:
        return wave
    from scipy.signal import resample_poly  # scipy comes with nemo-toolkit[asr]; imported lazily for start-up

    g = math.gcd(rate, target)
    up, down = target // g, rate // g
    # Same result as resample_poly(wave, up, down): the cached filter is exactly the one it would design.
    out = resample_poly(wave.astype(np.float32, copy=False), up, down, window=_polyphase_filter(up, down))
    return out.astype(np.float32, copy=False)


def resampled_length(n: int, rate: int, target: int = AUDIO_RATE) -> int:
    g = math.gcd(rate, target)
    return n if rate == target else -(-n * (target // g) // (rate // g))


def probe_audio(data: bytes, target_rate: int = AUDIO_RATE) -> int:
    """Number of samples the decoded waveform will have at `target_rate`, from the header only."""
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as e:
        raise MediaError(f"undecodable audio header: {type(e).__name__}: {e}") from None
    if info.frames <= 0:
        raise MediaError("audio has no samples", reason="too_short")
    return resampled_length(info.frames, info.samplerate, target_rate)


def decode_audio(data: bytes, target_rate: int = AUDIO_RATE, min_samples: int = 0) -> np.ndarray:
    """Audio bytes (WAV/FLAC/OGG) → float32 mono waveform at `target_rate`, zero-padded at the end to
    `min_samples` (the released front end pads clips shorter than 0.1 s: EncoderTokens.audio_min_samples)."""
    try:
        wave, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises LibsndfileError / RuntimeError
        raise MediaError(f"undecodable audio: {type(e).__name__}: {e}") from None
    if wave.shape[0] == 0:
        raise MediaError("audio has no samples", reason="too_short")
    out = resample(wave.mean(axis=1), rate, target_rate)
    return np.pad(out, (0, min_samples - len(out))) if len(out) < min_samples else out

