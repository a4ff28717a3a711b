"""OMP_NUM_THREADS=1 python scripts/bench_loader.py [--samples 48] [--measure 96] [--workers 0 1 2]

Steady-state samples/s and peak RSS of the Tessera loader (decode + tiling/frames/resampling +
tokenization + packing, energon) next to plain webdataset decoding of the same shards (PIL → RGB array,
PyAV → all frames, soundfile → waveform; no tiling, tokens or packing), for image, video, audio and mixed
shards.

Each configuration runs in a fresh subprocess (so peak RSS is its own: the main process' peak plus the
largest worker's peak, ru_maxrss of children). Both loaders repeat the data set; the clock starts after
the first `--warmup` samples have arrived (worker spawn, index open, first fill of the shuffle/packing
buffers are start-up, not throughput) and stops after `--measure` more samples. "start s" is the time to
the end of the warm-up, printed so the start-up cost is visible too. Shards are synthetic
(scripts/prepare_data.py). On a shared machine, --repeat N runs the whole plain/Tessera sequence N times,
interleaved, and keeps each configuration's fastest run (others' load only ever slows a run down).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

KINDS = {"image": ("image",), "video": ("video",), "audio": ("audio",), "mixed": ("image", "video", "audio", "chat")}


def make_sets(out: Path, samples: int) -> None:
    from tessera.data.prepare import energon_prepare, synthetic_records, write_shards
    from tessera.data.tokens import train_sentencepiece

    for name, kinds in KINDS.items():
        path = out / name
        if (path / ".nv-meta" / "index.sqlite").exists():
            continue
        records = list(synthetic_records(samples, seed=11, prefix=name, kinds=kinds))
        write_shards(iter(records), path, shard_size=16)
        energon_prepare(path)
        texts = [t["content"] for _, conv, _ in records for t in conv] * 4
        train_sentencepiece(texts + ["user\n", "assistant\n", "system\n"], path / "tokenizer", vocab_size=400)


def tessera_stream(path: Path, workers: int):
    """Yields the number of samples in each packed batch, forever."""
    from tessera.data.loader import ChatTaskEncoder, build_loader
    from tessera.data.tokens import EncoderTokens

    te = ChatTaskEncoder(path / "tokenizer.model", seq_length=8192, encoder=EncoderTokens())
    for batch in build_loader(path, te, rows_per_microbatch=1, num_workers=workers, repeat=True,
                              shuffle_buffer=None, packing_buffer=8):
        yield sum(len(k) for k in batch.keys)


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
    """Yields 1 per decoded sample, forever (each worker repeats its own shards)."""
    import webdataset as wds

    urls = sorted(str(p) for p in path.glob("shard-*.tar"))
    ds = wds.WebDataset(urls, shardshuffle=False, workersplitter=wds.split_by_worker).repeat().map(_plain_decode)
    for _ in wds.WebLoader(ds, batch_size=None, num_workers=workers):
        yield 1


def _consume(stream, count: int) -> int:
    """Pull samples from a stream until at least `count` came; returns how many did."""
    n = 0
    for k in stream:
        n += k
        if n >= count:
            break
    return n


def one(kind: str, impl: str, workers: int, out: Path, warmup: int, measure: int) -> dict:
    """Run one configuration in this process and return its steady-state measurements."""
    stream = (tessera_stream if impl == "tessera" else plain_stream)(out / kind, workers)
    t0 = time.perf_counter()
    _consume(stream, warmup)
    t1 = time.perf_counter()
    m = _consume(stream, measure)
    dt = time.perf_counter() - t1
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"kind": kind, "impl": impl, "workers": workers, "samples": m, "seconds": dt, "startup": t1 - t0,
            "rate": m / dt, "rss_mb": (own + child) / 1024}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=48, help="samples per data set")
    ap.add_argument("--warmup", type=int, default=16, help="samples consumed before the clock starts")
    ap.add_argument("--measure", type=int, default=96, help="samples timed after the warm-up")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration; the fastest is reported")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--out", type=Path, default=Path("/tmp/tessera_bench"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: "kind,impl,workers" in a subprocess
    args = ap.parse_args(argv)
    if args.one:
        kind, impl, workers = args.one.split(",")
        print(json.dumps(one(kind, impl, int(workers), args.out, args.warmup, args.measure)))
        return 0

    make_sets(args.out, args.samples)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rows = []
    for _, kind, workers, impl in ((r, k, w, i) for r in range(args.repeat) for k in args.kinds
                                   for w in args.workers for i in ("plain", "tessera")):
        cmd = [sys.executable, __file__, "--one", f"{kind},{impl},{workers}", "--out", str(args.out),
               "--warmup", str(args.warmup), "--measure", str(args.measure)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode:
            print(res.stderr[-2000:], file=sys.stderr)
            return 1
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"  {kind:6s} {impl:7s} w={workers}: start-up {r['startup']:.1f}s, then {r['samples']} samples "
              f"in {r['seconds']:.1f}s", file=sys.stderr)

    print(f"\n{'data':7s} {'workers':>7s} {'plain/s':>9s} {'tessera/s':>10s} {'ratio':>6s} "
          f"{'plain start s':>14s} {'tessera start s':>16s} {'plain RSS MB':>13s} {'tessera RSS MB':>15s}")
    for kind in args.kinds:
        for workers in args.workers:
            p, t = (max((r for r in rows if (r["kind"], r["impl"], r["workers"]) == (kind, impl, workers)),
                        key=lambda r: r["rate"]) for impl in ("plain", "tessera"))
            print(f"{kind:7s} {workers:7d} {p['rate']:9.1f} {t['rate']:10.1f} {t['rate'] / p['rate']:6.2f} "
                  f"{p['startup']:14.1f} {t['startup']:16.1f} {p['rss_mb']:13.0f} {t['rss_mb']:15.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
