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
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import soundfile as sf
from PIL import Image

AUDIO_RATE = 16_000


class MediaError(ValueError):
    """A media member that cannot be decoded; the message is the reason logged with the skip."""


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
    except Exception as e:
        raise MediaError(f"undecodable image header: {type(e).__name__}: {e}") from None
    tail = data[-256:]
    if (fmt == "JPEG" and b"\xff\xd9" not in tail) or (fmt == "PNG" and b"IEND" not in tail):
        raise MediaError(f"truncated {fmt} image: end marker missing ({len(data)} bytes)")
    return size


def _chw(img: Image.Image) -> np.ndarray:
    return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)


def decode_image(data: bytes, tile: int = 512, max_tiles: int = 6, use_thumbnail: bool = True) -> np.ndarray:
    """Image bytes (JPEG/PNG/...) → uint8 tiles [T, 3, tile, tile], grid tiles row-major, thumbnail last."""
    try:
        img = Image.open(io.BytesIO(data))
        img.load()  # forces the full decode here, so a truncated file fails now and not inside the encoder
        img = img.convert("RGB")
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError...)
        raise MediaError(f"undecodable image: {type(e).__name__}: {e}") from None
    grid = choose_grid(img.width, img.height, max_tiles, use_thumbnail, tile)
    # One resize for the whole grid, then the tiles are cut by a single reshape/transpose copy (per-tile
    # PIL crops + np.stack cost ~10% of the image path in the benchmark profile).
    n = grid.cols * grid.rows + int(grid.thumbnail)
    out = np.empty((n, 3, tile, tile), dtype=np.uint8)
    big = np.asarray(img.resize((grid.cols * tile, grid.rows * tile), Image.BICUBIC), dtype=np.uint8)
    out[:grid.cols * grid.rows] = big.reshape(grid.rows, tile, grid.cols, tile, 3).transpose(0, 2, 4, 1, 3).reshape(
        -1, 3, tile, tile)
    if grid.thumbnail:
        out[-1] = _chw(img.resize((tile, tile), Image.BICUBIC))
    return out


def sample_indices(total: int, wanted: int) -> list[int]:
    """`wanted` frame indices spread uniformly over `total` frames (segment centres), all when fewer."""
    if total <= wanted:
        return list(range(total))
    return [min(total - 1, int((i + 0.5) * total / wanted)) for i in range(wanted)]


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

    Packets are demuxed once without decoding to learn the frame count (container headers often omit it),
    then only the chosen frames are converted to RGB, which is where the time goes."""
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError("video member has no video stream")
            stream = container.streams.video[0]
            total = _count_packets(container, stream)
            if total == 0:
                raise MediaError("video stream has no frames")
            keep = set(sample_indices(total, frames))
            container.seek(0)
            out, stamps = [], []
            base = stream.time_base or Fraction(1, 1)
            for i, frame in enumerate(container.decode(stream)):
                if i in keep:
                    img = frame.to_image().convert("RGB").resize((tile, tile), Image.BICUBIC)
                    out.append(_chw(img))
                    stamps.append(float((frame.pts or 0) * base))
                if len(out) == len(keep):
                    break
    except MediaError:
        raise
    except Exception as e:  # av raises its own error family (InvalidDataError, ...)
        raise MediaError(f"undecodable video: {type(e).__name__}: {e}") from None
    if len(out) != len(keep):
        raise MediaError(f"video decoded {len(out)} of {len(keep)} sampled frames (truncated stream?)")
    return np.stack(out), np.asarray(stamps, dtype=np.float64)


def blank_item(kind: str, units: int, enc) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """A stand-in of the predicted shape for an item that failed to decode after it was packed: black
    tiles/frames or silence, so the encoder still produces exactly the planned number of embeddings."""
    if kind == "audio":
        return np.zeros(units, dtype=np.float32)
    tiles = np.zeros((units, 3, enc.tile, enc.tile), dtype=np.uint8)
    return (tiles, np.zeros(units, dtype=np.float64)) if kind == "video" else tiles


def resample(wave: np.ndarray, rate: int, target: int = AUDIO_RATE) -> np.ndarray:
    """Polyphase resampling (scipy), exact length ceil(n * target / rate) for rational rate ratios."""
    if rate == target:
        return wave
    from scipy.signal import resample_poly  # scipy comes with nemo-toolkit[asr]; imported lazily for start-up

    g = math.gcd(rate, target)
    return resample_poly(wave, target // g, rate // g).astype(np.float32)


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
        raise MediaError("audio has no samples")
    return resampled_length(info.frames, info.samplerate, target_rate)


def decode_audio(data: bytes, target_rate: int = AUDIO_RATE) -> np.ndarray:
    """Audio bytes (WAV/FLAC/OGG) → float32 mono waveform at `target_rate`."""
    try:
        wave, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises LibsndfileError / RuntimeError
        raise MediaError(f"undecodable audio: {type(e).__name__}: {e}") from None
    if wave.shape[0] == 0:
        raise MediaError("audio has no samples")
    return resample(wave.mean(axis=1), rate, target_rate)

