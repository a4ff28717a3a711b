"""OMP_NUM_THREADS=1 python -m tessera.scripts.bench_loader [--media camera small] [--workers 1] [--window 10] [--repeat 3]

Steady-state samples/s and peak RSS of the Tessera loader (decode + tiles/frames/resampling + tokenization +
packing, energon) next to plain webdataset decoding of the same shards (PIL → RGB array, PyAV → every frame
as RGB, soundfile → waveform; no tiling, tokens or packing), per media kind, with the same worker count.

Media sets (built once under --out): `camera` is what users train on: photos of 1-12 MP (JPEG, some PNG),
720p H.264 clips of 2-4 s at 30 fps, 5-20 s of 16-48 kHz mono/stereo audio; `small` is the synthetic set the
tests use (images of 0.04-0.5 MP, 96-160 px videos of 4-24 frames, 0.5-3 s tones): there the tiles and frames
the encoders need are larger than the decoded media, so Tessera must upscale what plain decoding never touches.

Method: each run is a fresh subprocess (its own peak RSS: main process + largest worker). The clock starts
after `--warmup` samples (worker start, index open, first buffer fill) and stops at the first sample after
`--window` seconds. Plain and Tessera alternate within each repeat, and repeats run one after another, so
drift on a shared machine hits both alike; the table gives the median of the per-repeat ratios and their
range. The second table is the rate each full recipe needs per GPU at its default layout (the planner's
predicted step time on H100, its media per row, the media per sample of this set) next to the measured
samples/s per worker: the workers one GPU needs to keep up.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

KINDS = {"image": ("image",), "video": ("video",), "audio": ("audio",), "mixed": ("image", "video", "audio", "chat")}
MAX_TILES, VIDEO_FRAMES = 12, 8  # the 12B VL family's tiles per image; frames per video as the tiny recipes


# ---- media sets --------------------------------------------------------------------------------------------

def _photo(rng: random.Random) -> tuple[bytes, str, str]:
    """A camera-like photo: smooth gradients plus sensor-like noise (JPEG does not compress it to nothing)."""
    import numpy as np
    from PIL import Image

    w, h = rng.choice([(4032, 3024), (3000, 2000), (1920, 1080), (1280, 960), (1080, 1920)])
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / rng.uniform(80, 400)), 128 + 100 * np.cos(y / rng.uniform(80, 400)),
                     128 + 80 * np.sin((x + y) / rng.uniform(100, 500))], axis=-1)
    noise = np.random.default_rng(rng.randrange(1 << 30)).normal(0, 12, (h, w, 1)).astype(np.float32)
    img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
    fmt = "png" if rng.random() < 0.2 else "jpg"
    buf = io.BytesIO()
    img.save(buf, format="PNG" if fmt == "png" else "JPEG", quality=90, compress_level=1)
    return buf.getvalue(), fmt, f"A photo of {w} by {h} pixels."


def _clip(rng: random.Random) -> tuple[bytes, str, str]:
    """A 720p H.264 clip at 30 fps, 2-4 s, with moving content."""
    import numpy as np

    from tessera.data.prepare import encode_mp4

    frames, (w, h) = rng.choice([60, 90, 120]), (1280, 720)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    data = encode_mp4((np.stack([128 + 100 * np.sin((x + 8 * t) / 90), 128 + 100 * np.cos((y - 5 * t) / 70),
                                 128 + 60 * np.sin((x + y + 12 * t) / 150)], axis=-1).astype(np.uint8)
                       for t in range(frames)), fps=30, codec="libx264")
    return data, "mp4", f"A moving pattern for {frames / 30:.0f} seconds."


def _recording(rng: random.Random) -> tuple[bytes, str, str]:
    import numpy as np
    import soundfile as sf

    rate, seconds, channels = rng.choice([(48000, 10, 2), (44100, 20, 2), (16000, 5, 1), (22050, 15, 1)])
    t = np.arange(rate * seconds) / rate
    wave = 0.2 * np.sin(2 * math.pi * rng.choice([220, 440, 880]) * t) + 0.05 * np.random.default_rng(0).normal(size=t.size)
    fmt = rng.choice(["wav", "flac"])
    buf = io.BytesIO()
    sf.write(buf, np.stack([wave] * channels, axis=1).astype(np.float32), rate, format=fmt.upper())
    return buf.getvalue(), fmt, f"A tone recorded at {rate} hertz for {seconds} seconds."


CAMERA = {"image": _photo, "video": _clip, "audio": _recording}


def _camera_records(n: int, kinds, seed: int = 11):
    from tessera.data.prepare import caption_chat

    rng = random.Random(seed)
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "chat":  # two media items in one conversation
            kind = rng.choice(["image", "video", "audio"])
        data, ext, text = CAMERA[kind](rng)
        yield f"cam_{i:06d}", caption_chat(kind, text), [(kind, ext, data)]


def make_sets(out: Path, media: str, samples: int, kinds: tuple[str, ...] = tuple(KINDS)) -> None:
    from tessera.data.prepare import energon_prepare, synthetic_records, write_shards
    from tessera.data.tokens import train_sentencepiece

    for name, kinds in ((k, KINDS[k]) for k in kinds):
        path = out / media / name
        if (path / ".nv-meta" / "index.sqlite").exists() and (nometa(path) / ".nv-meta" / "index.sqlite").exists():
            continue
        print(f"  building {media}/{name} ({samples} samples)", file=sys.stderr)
        records = list(_camera_records(samples, kinds) if media == "camera" else
                       synthetic_records(samples, seed=11, prefix=name, kinds=kinds))
        for where, meta in ((path, True), (nometa(path), False)):  # the same samples as prepared before issue 31
            write_shards(iter(records), where, shard_size=8, media_meta=meta)
            energon_prepare(where, media_meta=meta)
        texts = [t["content"] for _, conv, _ in records for t in conv] * 4
        train_sentencepiece(texts + ["user\n", "assistant\n", "system\n"], path / "tokenizer", vocab_size=400)


def nometa(path: Path) -> Path:
    """The set prepared without media metadata (every rank's stream reads and probes the media bytes)."""
    return path.with_name(path.name + "nometa")


# ---- the two loaders ----------------------------------------------------------------------------------------

def encoder_tokens():
    from tessera.data.tokens import EncoderTokens

    return EncoderTokens(max_tiles=MAX_TILES, video_frames=VIDEO_FRAMES)


def tessera_stream(path: Path, workers: int, defer_upscale: bool = True, tokenizer: Path | None = None):
    """Yields (samples, media units by kind) per packed batch, forever. defer_upscale as the trainer sets it
    on GPUs (media smaller than their tiles are resized on the GPU); `tessera_cpu` runs it off (CPU runs);
    `tessera_nometa` reads the set prepared without media metadata (the global stream reads the media bytes)."""
    from tessera.data.loader import ChatTaskEncoder, build_loader

    te = ChatTaskEncoder(tokenizer or path / "tokenizer.model", seq_length=65536, encoder=encoder_tokens(),
                         defer_upscale=defer_upscale)
    for batch in build_loader(path, te, rows_per_microbatch=1, num_workers=workers, repeat=True,
                              shuffle_buffer=None, packing_buffer=8):
        units = {"image": 0, "video": 0, "audio": 0.0}
        for row in batch.media:
            for items in row.values():
                for kind, item in items:
                    units[kind] += (item[0].shape[0] if kind == "video" else
                                    item.shape[0] / 16000 if kind == "audio" else item.shape[0])
        yield sum(len(k) for k in batch.keys), units


def _plain_decode(sample: dict) -> dict:
    import av
    import numpy as np
    import soundfile as sf
    from PIL import Image

    out = {}
    for field, data in sample.items():
        if field.endswith((".jpg", ".png")):
            out[field] = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        elif field.endswith(".mp4"):
            with av.open(io.BytesIO(data)) as c:
                # threads=1: PyAV's default (auto) starts a swscale thread pool per frame, ~10x the conversion;
                # both loaders convert this way, so the ratio measures the pipeline, not that default.
                out[field] = np.stack([f.reformat(format="rgb24", threads=1).to_ndarray() for f in c.decode(video=0)])
        elif field.endswith((".wav", ".flac")):
            out[field] = sf.read(io.BytesIO(data), dtype="float32")[0]
        elif field == "json":
            out[field] = json.loads(data)
    return out


def plain_stream(path: Path, workers: int):
    """Yields (1, {}) per decoded sample, forever (each worker repeats its own shards)."""
    import webdataset as wds

    urls = sorted(str(p) for p in path.glob("shard-*.tar"))
    ds = wds.WebDataset(urls, shardshuffle=False, workersplitter=wds.split_by_worker).repeat().map(_plain_decode)
    for _ in wds.WebLoader(ds, batch_size=None, num_workers=workers):
        yield 1, {}


def one(path: Path, impl: str, workers: int, warmup: int, window: float) -> dict:
    """One configuration in this process: samples/s over at least `window` seconds after `warmup` samples."""
    stream = (plain_stream(path, workers) if impl == "plain" else
              tessera_stream(nometa(path), workers, tokenizer=path / "tokenizer.model") if impl == "tessera_nometa" else
              tessera_stream(path, workers, defer_upscale=impl == "tessera"))
    t0, n = time.perf_counter(), 0
    for k, _ in stream:
        n += k
        if n >= warmup:
            break
    t1, n, units = time.perf_counter(), 0, {}
    for k, u in stream:
        n += k
        for key, v in u.items():
            units[key] = units.get(key, 0) + v
        if time.perf_counter() - t1 >= window:
            break
    dt = time.perf_counter() - t1
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"impl": impl, "samples": n, "seconds": dt, "startup": t1 - t0, "rate": n / dt, "rss_mb": rss / 1024,
            "units": units}


# ---- what the full recipes need -----------------------------------------------------------------------------

# media units per packed row the planner prices (tiles, frames, audio seconds) -> the bench kind that feeds them
RECIPE_KIND = {"nemotron_vl_12b": ("image", "tiles"), "nemotron_video_12b": ("video", "frames"),
               "nemotron_omni_30b_a3b": ("audio", "audio_seconds")}


def required_rates(units_per_sample: dict[str, float]) -> list[dict]:
    """Per full recipe: samples/s per GPU its default layout consumes (planner step time on H100)."""
    from tessera.hetero.planner.cluster import cluster
    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.planner.search import price_layout
    from tessera.recipes.full_size import RECIPES

    out = []
    for name, (kind, field) in RECIPE_KIND.items():
        r = RECIPES[name]
        p = price_layout(HeteroLayout.parse(r.layout), r.model(), r.workload, cluster("h100"))
        # the step time is priced even where the layout does not fit in memory yet (omni: issue 14)
        per_row = getattr(r.workload, field)
        samples = p.global_batch * per_row / units_per_sample[kind]
        out.append({"recipe": name, "kind": kind, "step_s": p.step_s, "per_row": f"{per_row:g} {field}",
                    "per_sample": units_per_sample[kind], "need": samples / p.step_s / r.gpus})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--media", nargs="+", default=["camera", "small"], choices=["camera", "small"])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--workers", type=int, nargs="+", default=[1])
    ap.add_argument("--window", type=float, default=10.0, help="seconds timed per run (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=8, help="samples consumed before the clock starts")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved plain/Tessera pairs per configuration")
    ap.add_argument("--samples", type=int, default=48, help="samples per data set")
    ap.add_argument("--impls", nargs="+", default=["tessera"], choices=["tessera", "tessera_cpu", "tessera_nometa"],
                    help="tessera: upscales deferred to the GPU (the trainer on GPUs); tessera_cpu: all on the CPU")
    ap.add_argument("--out", type=Path, default=Path("/tmp/tessera_bench_loader"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: "path,impl,workers" in a subprocess
    args = ap.parse_args(argv)
    if args.one:
        path, impl, workers = args.one.split(",")
        print(json.dumps(one(Path(path), impl, int(workers), args.warmup, args.window)))
        return 0

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    runs: dict[tuple, list[dict]] = {}
    for media in args.media:
        make_sets(args.out, media, args.samples, kinds=tuple(args.kinds))
    for rep in range(args.repeat):
        for media in args.media:
            for kind in args.kinds:
                for workers in args.workers:
                    for impl in ("plain", *args.impls):
                        cmd = [sys.executable, "-m", "tessera.scripts.bench_loader", "--one",
                               f"{args.out / media / kind},{impl},{workers}", "--warmup", str(args.warmup),
                               "--window", str(args.window)]
                        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
                        if res.returncode:
                            print(res.stderr[-2000:], file=sys.stderr)
                            return 1
                        r = json.loads(res.stdout.strip().splitlines()[-1])
                        runs.setdefault((media, kind, workers, impl), []).append(r)
                        print(f"  [{rep + 1}/{args.repeat}] {media}/{kind} {impl} w={workers}: {r['rate']:.1f}/s "
                              f"({r['samples']} in {r['seconds']:.1f}s)", file=sys.stderr)

    print(f"\n{'media':7s} {'data':6s} {'workers':>7s} {'loader':12s} {'plain/s':>8s} {'loader/s':>9s} {'ratio':>6s} "
          f"{'ratio range':>12s} {'plain RSS MB':>12s} {'loader RSS MB':>13s}")
    per_sample: dict[str, dict[str, float]] = {}
    for media in args.media:
        for kind in args.kinds:
            for w in args.workers:
                p = runs[(media, kind, w, "plain")]
                for impl in args.impls:
                    t = runs[(media, kind, w, impl)]
                    ratios = [b["rate"] / a["rate"] for a, b in zip(p, t)]
                    print(f"{media:7s} {kind:6s} {w:7d} {impl:12s} {statistics.median(r['rate'] for r in p):8.1f} "
                          f"{statistics.median(r['rate'] for r in t):9.1f} {statistics.median(ratios):6.2f} "
                          f"{min(ratios):5.2f}-{max(ratios):<5.2f} {max(r['rss_mb'] for r in p):12.0f} "
                          f"{max(r['rss_mb'] for r in t):13.0f}")
                if kind != "mixed":
                    t = runs[(media, kind, w, args.impls[0])]
                    n, u = sum(r["samples"] for r in t), sum(r["units"].get(kind, 0) for r in t)
                    per_sample.setdefault(media, {})[kind] = u / n
    for media, units in per_sample.items():
        if set(units) != {"image", "video", "audio"}:
            continue
        print(f"\n{media}: what the full recipes need per GPU (H100, default layout) vs one worker here")
        print(f"{'recipe':22s} {'step s':>7s} {'media per row':>18s} {'per sample':>10s} {'need/s':>7s} "
              f"{'worker/s':>8s} {'workers':>7s}")
        for r in required_rates(units):
            got = statistics.median(x["rate"] for x in runs[(media, r["kind"], args.workers[0], args.impls[0])])
            print(f"{r['recipe']:22s} {r['step_s']:7.2f} {r['per_row']:>18s} {r['per_sample']:10.2f} "
                  f"{r['need']:7.2f} {got / args.workers[0]:8.1f} {math.ceil(r['need'] / (got / args.workers[0])):7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
