"""OMP_NUM_THREADS=1 python -m tessera.scripts.bench_prepare [--records 1000 10000 100000] [--workers 1]

scripts/prepare_data.py's samples/s per worker and peak memory, on the same tiny media (one image, one clip, one
audio file reused across records: 2 image : 1 video : 1 audio records), for three sources:
  llava     a LLaVA JSON array (paths; parsed once, held whole: the format is one JSON value)
  messages  OpenAI / TRL messages JSONL (media parts with paths)
  parquet   a Hugging Face parquet folder in TRL's columns (`images`: Image features with the bytes, `videos`,
            `audios`: paths, `messages`), read through `datasets` (its Arrow cache is built inside the timing)
against `plain`: a loop over the messages JSONL that only reads each record's media bytes and writes them and the
line with webdataset's ShardWriter (no format detection, no conversion, no probes). `vs plain` is prepare's rate over
plain's; `probe share` is the part of the run's CPU time spent in data/media_meta.item_entry (the header probes and
CRC the loader needs), timed inside the run (one worker), and `vs plain without probes` the ratio with that removed. Rates are per CPU second of the run
(its process and its workers: what the other loads of a shared machine do not move; wall samples/s beside them), so
per worker. Each run is its own process, imports outside the timing: peak RSS is its own ru_maxrss (imports, ~560 MiB,
included; with --workers > 1 the workers' are not in it). The energon index and the tokenizer, once per dataset after the shards, are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

MIX = ("image", "image", "video", "audio")
SOURCES = ("plain", "llava", "messages", "parquet")
QUESTION = {"image": "What is in the picture?", "video": "What happens?", "audio": "What is this sound?"}


def make_media(d: Path) -> dict[str, Path]:
    import numpy as np
    import soundfile as sf
    from PIL import Image

    from tessera.data.prepare import encode_mp4

    d.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 48), (220, 40, 40)).save(d / "a.jpg")
    sf.write(d / "tone.wav", (0.3 * np.sin(np.arange(8000) / 5)).astype(np.float32), 16000)
    (d / "clip.mp4").write_bytes(encode_mp4((np.full((32, 48, 3), 30 * t, np.uint8) for t in range(4)), fps=4))
    return {"image": d / "a.jpg", "video": d / "clip.mp4", "audio": d / "tone.wav"}


def make_sources(d: Path, n: int, media: dict[str, Path]) -> dict[str, Path]:
    """The three sources of `n` records in `d` (written streaming; the parquet folder in files of 10k rows)."""
    import datasets

    kinds = [MIX[i % len(MIX)] for i in range(n)]
    with open(d / "llava.json", "w") as f:
        f.write("[")
        for i, k in enumerate(kinds):
            f.write(("," if i else "") + json.dumps({"id": f"r{i}", k: str(media[k]), "conversations": [
                {"from": "human", "value": f"<{k}>\n{QUESTION[k]}"}, {"from": "gpt", "value": f"Answer {i}."}]}))
        f.write("]")
    with open(d / "messages.jsonl", "w") as f:
        for i, k in enumerate(kinds):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": [{"type": k, k: str(media[k])}, {"type": "text", "text": QUESTION[k]}]},
                {"role": "assistant", "content": f"Answer {i}."}]}) + "\n")
    pq = d / "parquet"
    pq.mkdir(exist_ok=True)
    image = media["image"].read_bytes()
    for start in range(0, n, 10_000):
        rows = kinds[start:start + 10_000]
        ds = datasets.Dataset.from_dict({
            "images": [[{"bytes": image, "path": None}] if k == "image" else [] for k in rows],
            "videos": [[str(media["video"])] if k == "video" else [] for k in rows],
            "audios": [[str(media["audio"])] if k == "audio" else [] for k in rows],
            "messages": [[{"role": "user", "content": [{"type": k, "text": None}, {"type": "text", "text": QUESTION[k]}]},
                          {"role": "assistant", "content": [{"type": "text", "text": f"Answer {start + j}."}]}]
                         for j, k in enumerate(rows)]}).cast_column("images", datasets.List(datasets.Image()))
        ds.to_parquet(str(pq / f"train-{start // 10_000:05d}.parquet"))
    return {"llava": d / "llava.json", "messages": d / "messages.jsonl", "parquet": pq}


def plain(jsonl: Path, root: Path, out: Path, shard_size: int) -> int:
    """Read each record's media bytes and write them with the line: the floor any preparation pays."""
    import webdataset as wds

    n = 0
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=shard_size, verbose=0, mtime=0) as sink, \
            open(jsonl) as f:
        for n, line in enumerate(f, 1):
            part = json.loads(line)["messages"][0]["content"][0]
            sink.write({"__key__": f"r{n:07d}", "json": line.encode(),
                        "m0." + part["type"]: (root / part[part["type"]]).read_bytes()})
    return n


def run_one(source: str, path: Path, root: Path, out: Path, workers: int, shard_size: int) -> dict:
    """One timed run in this process: samples written, seconds, peak RSS (MiB)."""
    from tessera.data.prepare_parallel import prepare_source
    from tessera.data.prepare_sources import HFSource, ManifestSource

    import datasets  # noqa: F401  (imports outside the timing: a per-record rate)
    import webdataset  # noqa: F401

    import tessera.data.prepare as prepare

    probe = [0.0]  # CPU seconds inside item_entry (the probes and CRC), this process (one worker) only
    entry = prepare.item_entry

    def timed_entry(*a):
        t = time.process_time()
        try:
            return entry(*a)
        finally:
            probe[0] += time.process_time() - t

    prepare.item_entry = timed_entry
    out.mkdir(parents=True, exist_ok=True)
    t0, c0 = time.perf_counter(), _cpu()
    if source == "plain":
        samples = plain(path, root, out, shard_size)
    else:
        src = HFSource(str(path)) if source == "parquet" else ManifestSource(path)
        done = prepare_source(src, out, shard_size, workers)
        samples = done.counts["samples"]
    seconds, cpu = time.perf_counter() - t0, _cpu() - c0
    # this process's own peak: RUSAGE_CHILDREN holds a subprocess an import runs (270 MiB), not only the workers
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"samples": samples, "seconds": seconds, "cpu_seconds": cpu, "rss_mib": peak / 1024,
            "probe_share": probe[0] / cpu if workers == 1 else None}


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the workers): on a shared machine a rate per CPU
    second is what other loads do not move."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    ap.add_argument("--records", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path("/tmp/tessera_bench_prepare"))
    ap.add_argument("--one", nargs=3, metavar=("SOURCE", "PATH", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    media_dir = args.out / "media"
    if args.one:  # a child: one timed run, its result as a JSON line
        source, path, out = args.one
        print(json.dumps(run_one(source, Path(path), media_dir, Path(out), args.workers, args.shard_size)))
        return 0
    media = make_media(media_dir)
    rows = []
    for n in args.records:
        d = args.out / f"n{n}"
        d.mkdir(parents=True, exist_ok=True)
        paths = make_sources(d, n, media)
        paths["plain"] = paths["messages"]
        for source in SOURCES:
            out = d / f"out-{source}"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(d / "hf-cache", ignore_errors=True)
            env = dict(os.environ, HF_DATASETS_CACHE=str(d / "hf-cache"))  # no cache of an earlier run reused
            res = subprocess.run([sys.executable, "-m", "tessera.scripts.bench_prepare", "--out", str(args.out),
                                  "--workers", str(args.workers), "--shard-size", str(args.shard_size),
                                  "--one", source, str(paths[source]), str(out)],
                                 env=env, capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(res.stdout.strip().splitlines()[-1])
            assert r["samples"] == n, (source, r)
            r.update(source=source, records=n, rate=n / r["cpu_seconds"], wall_rate=n / r["seconds"])
            rows.append(r)
            print(f"[bench_prepare] {source} {n}: {r['rate']:.0f} samples per CPU second, {r['wall_rate']:.0f} "
                  f"samples/s, {r['rss_mib']:.0f} MiB",
                  file=sys.stderr)
    plain_rate = {r["records"]: r["rate"] for r in rows if r["source"] == "plain"}
    print("| source | records | workers | samples per CPU s (per worker) | vs plain | probe share | vs plain without "
          "probes | wall samples/s | peak RSS MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = r["probe_share"] if r["source"] != "plain" else 0.0
        ratio = r["rate"] / plain_rate[r["records"]]
        print(f"| {r['source']} | {r['records']} | {1 if r['source'] == 'plain' else args.workers} | {r['rate']:.0f} | "
              f"{ratio:.2f} | " + ("n/a | n/a" if share is None else f"{share:.0%} | {ratio / (1 - share):.2f}")
              + f" | {r['wall_rate']:.0f} | {r['rss_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
