"""Dataset preparation as library code: samples (a manifest's or a Hugging Face dataset's records, turned into
conversations by data/formats/ and written by data/prepare_parallel.py; a media folder; a synthetic
generator) in, webdataset shards + energon's index out. scripts/prepare_data.py is its command line; the training
loop's synthetic data set (data/pipeline.py) calls make_synthetic directly.

Each sample becomes KEY.json ({"conversation", "media": [{"kind", "field", "bytes", "crc32", "probe"}]}: each
item's header facts, data/media_meta.py) plus one member per media item (KEY.img0.jpg, KEY.vid0.mp4,
KEY.aud0.flac). `energon prepare` (run in-process) then writes DIR/.nv-meta (tar indexes for random access,
split.yaml, dataset.yaml with CrudeWebdataset reading only the JSON member: the loader fetches an item's bytes by
its name through the index, on the ranks that decode it).
Items that cannot be read are skipped and counted with their reason; preparation never stops on one.
"""


from __future__ import annotations

import io
import json
import math
import random
import sys
import time
from collections import Counter
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import soundfile as sf
import webdataset as wds
from PIL import Image, ImageDraw

from tessera.data.formats import caption_chat  # noqa: F401  (re-exported: tests and benchmarks use it)
from tessera.data.media_meta import PART_FILTER, has_facts, item_entry

KIND_OF_EXT = {".jpg": "image", ".jpeg": "image", ".png": "image", ".webp": "image", ".mp4": "video",
               ".mkv": "video", ".webm": "video", ".wav": "audio", ".flac": "audio", ".ogg": "audio"}
FIELD_PREFIX = {"image": "img", "video": "vid", "audio": "aud"}


def _media_item(kind: str, path: Path) -> tuple[str, str, bytes]:
    return kind, path.suffix.lower().lstrip(".").replace("jpeg", "jpg"), path.read_bytes()


def records_from_folder(folder: Path, skipped: Counter):
    for path in sorted(folder.rglob("*")):
        kind = KIND_OF_EXT.get(path.suffix.lower())
        if kind is None:
            if path.is_file() and path.suffix != ".txt":
                skipped["unknown_extension"] += 1
            continue
        caption = path.with_suffix(".txt")
        if not caption.exists():
            skipped["no_caption"] += 1
            print(f"[prepare] skip {path}: no caption file {caption.name}", file=sys.stderr)
            continue
        key = str(path.relative_to(folder).with_suffix("")).replace("/", "_").replace(".", "_")
        yield key, caption_chat(kind, caption.read_text().strip()), [_media_item(kind, path)]


def write_shards(records, out: Path, shard_size: int, media_meta: bool = True) -> Counter:
    """Write samples with webdataset's ShardWriter; returns counts by media kind. media_meta: each item's probe
    facts, byte length and CRC in the JSON member (data/media_meta.py; False: a dataset as written before them).
    Shards of an earlier run that this one did not write are removed (remove_stale_shards)."""
    counts, written = write_part(records, out, shard_size, media_meta)
    for p in remove_stale_shards(out, written):
        print(f"[prepare] removed {p} (left by an earlier run, not written by this one)", file=sys.stderr)
    return counts


def write_part(records, out: Path, shard_size: int, media_meta: bool = True,
               pattern: str = "shard-%06d.tar") -> tuple[Counter, set[str]]:
    """write_shards' writing, into shards named `pattern` (one per worker, data/prepare_parallel.py): returns the
    counts by media kind and the names of the shards written."""
    out.mkdir(parents=True, exist_ok=True)
    counts: Counter = Counter()
    written: set[str] = set()
    # an integer mtime: webdataset's default (time.time(), a float) makes tarfile add a PAX extended header to
    # every member, which energon's random-access reader then parses per sample (~0.3 ms, 10% of a small
    # audio sample's loader time, scripts/bench_loader.py)
    with wds.ShardWriter(str(out / pattern), maxcount=shard_size, verbose=0, mtime=int(time.time()),
                         post=lambda fname: written.add(Path(fname).name)) as sink:
        for key, conversation, media in records:
            sample, fields = {"__key__": key}, []
            for i, (kind, ext, data) in enumerate(media):
                field = f"{FIELD_PREFIX[kind]}{i}.{ext}"
                sample[field] = data
                fields.append(item_entry(kind, field, data) if media_meta else {"kind": kind, "field": field})
                counts[kind] += 1
            sample["json"] = json.dumps({"conversation": conversation, "media": fields}).encode()
            sink.write(sample)
            counts["samples"] += 1
    if not counts["samples"]:  # ShardWriter opens its first shard before any sample: an empty tar, not a shard
        for name in written:
            (out / name).unlink(missing_ok=True)
        written = set()
    return counts, written


class ShardError(ValueError):
    """A shard in the output folder that energon cannot index; the message names it and the fix."""


def check_shard(path: Path) -> str | None:
    """None if `path` is a complete tar with at least one sample; else what is wrong with it, in words.

    Reads member headers only (tarfile seeks over the data); a member whose data runs past the end of the
    file, a header cut in two and an archive with no members are what an interrupted write, a full disk
    or a partial copy leave, and what energon otherwise reports as a bare `Shard ... has no samples`."""
    import tarfile

    size = path.stat().st_size
    members = 0
    try:
        with tarfile.open(path, mode="r:") as tar:
            for m in tar:
                if m.offset_data + m.size > size:
                    return (f"truncated: member {m.name} needs {m.offset_data + m.size} bytes but the file ends at "
                            f"{size}")
                members += m.isfile()
    except (tarfile.TarError, EOFError, OSError) as e:
        return f"unreadable ({type(e).__name__}: {e})" + (f" after {members} complete members" if members else "")
    if members == 0:
        return "no samples (an empty or cut-off tar)"
    return None


def check_shards(out: Path) -> list[str]:
    """One line per bad shard-*.tar in `out`, each naming the shard, the problem and what to do."""
    bad = []
    for shard in sorted(Path(out).glob("*.tar")):
        why = check_shard(shard)
        if why:
            bad.append(f"{shard}: {why}; delete it and re-run scripts/prepare_data.py into an empty --out "
                       f"(or restore the shard from its source), then the index is rebuilt")
    return bad


def remove_stale_shards(out: Path, written: set[str]) -> list[Path]:
    """shard-*.tar files in `out` this run did not write (a previous, larger or interrupted run): removed so
    that energon prepare, which indexes every tar in the folder, sees only this run's shards."""
    stale = [p for p in sorted(Path(out).glob("shard-*.tar")) if p.name not in written]
    for p in stale:
        p.unlink()
    return stale


def add_media_metadata(out: Path) -> int:
    """Write each media item's metadata (data/media_meta.py) into the JSON members of the shards in `out` that lack
    it: a dataset prepared before it. Each shard is rewritten beside itself and renamed over it (never half
    written); members keep their order and bytes. Returns the number of shards rewritten."""
    import os
    import tarfile

    rewritten = 0
    for shard in sorted(out.glob("*.tar")):
        if check_shard(shard) is not None:
            continue  # a shard that cannot be read: energon_prepare reports it by name with the fix
        with tarfile.open(shard) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]
        data = {m.name: b for m, b in members}
        changed = False
        for i, (m, body) in enumerate(members):
            if not m.name.endswith(".json"):
                continue
            key, sample = m.name[:-len(".json")], json.loads(body)
            media = sample.get("media", [])
            if all(has_facts(it) for it in media):
                continue
            sample["media"] = [it if has_facts(it) or f"{key}.{it.get('field')}" not in data
                               else item_entry(it["kind"], it["field"], data[f"{key}.{it['field']}"]) for it in media]
            members[i] = (m, json.dumps(sample).encode())
            changed = True
        if not changed:
            continue
        tmp = shard.with_name(shard.name + ".tmp")
        with tarfile.open(tmp, "w") as tar:
            for m, body in members:
                info = tarfile.TarInfo(m.name)
                info.size, info.mtime, info.mode = len(body), m.mtime, m.mode
                tar.addfile(info, io.BytesIO(body))
        os.replace(tmp, shard)
        rewritten += 1
    return rewritten


def shard_media(out: Path) -> dict[str, list[tuple[str, str, int]]]:
    """sample key -> [(media kind, tar entry name, bytes)] of the shards in `out`, read with python's tarfile (the
    format write_shards writes; what benchmarks and tests count the loader's reads against)."""
    import tarfile

    found = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = tar.getmembers()
            sizes = {m.name: m.size for m in members}
            for m in (m for m in members if m.name.endswith(".json")):
                key = m.name[:-len(".json")]
                media = json.loads(tar.extractfile(m).read()).get("media", [])
                found[key] = [(it["kind"], f"{key}.{it['field']}", sizes[f"{key}.{it['field']}"]) for it in media]
    return found


def energon_prepare(out: Path, media_meta: bool = False, val_ratio: float = 0.0) -> None:
    """`energon prepare` via its click command: CrudeWebdataset samples, a train split and, with val_ratio, a val
    split of about that share of the shards (whole shards; a single shard is first cut into smaller ones, and
    train always keeps one: data/prepare_split.py). media_meta: the shards' JSON members
    carry the media metadata (write_shards, add_media_metadata), so energon's reader takes only them.

    Every tar in `out` is checked first (check_shards): a bad one raises ShardError naming it, instead of
    energon's bare assertion."""
    bad = check_shards(out)
    if bad:
        raise ShardError(f"{len(bad)} shard(s) in {out} cannot be indexed:\n" + "\n".join(f"  {b}" for b in bad))
    import contextlib

    from megatron.energon.tools.prepare import command

    from tessera.data.prepare_split import fit_shards_to_split, write_split

    resharded = fit_shards_to_split(out, val_ratio)  # SplitError when too few samples to split
    if resharded:
        print(f"[prepare] {resharded}", file=sys.stderr)
    # It echoes sample previews meant for interactive use; keep them out of the report unless it fails.
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter):
            command.main([str(out), "--non-interactive", "--split-ratio", "1,0,0",
                          "--sample-type", "CrudeWebdataset",
                          "--force-overwrite", "--no-progress", "--num-workers", "1"], standalone_mode=False)
        write_split(out, val_ratio)  # energon's own ratio rule can leave train empty (data/prepare_split.py)
        if media_meta:  # the global stream then reads each sample's JSON member only (data/media_meta.py)
            with open(out / ".nv-meta" / "dataset.yaml", "a") as f:
                f.write(PART_FILTER + "\n")
    except BaseException as e:
        print(chatter.getvalue(), file=sys.stderr)
        if isinstance(e, AssertionError):  # energon's checks are bare asserts: say where and what to do
            raise ShardError(f"energon prepare failed on {out}: {e} Check the shards (a cut-off or empty tar), "
                             f"or re-run scripts/prepare_data.py into an empty --out") from e
        raise


def index_in_place(out: Path) -> None:
    """`prepare_data --index`: energon's index of the tars in `out` after add_media_metadata. A dataset energon
    prepared already keeps its dataset.yaml and split.yaml (its own train/val split): only the tar indexes are
    rebuilt (the rewritten shards moved their members) and the JSON-only part_filter is added to the project's own
    CrudeWebdataset. One energon prepared as one of its typed samples is refused (ShardError): its media metadata
    would need the project's JSON members, and its dataset.yaml is the user's; it trains as it is."""
    from tessera.data.sample_types import CRUDE, dataset_sample_type

    meta = out / ".nv-meta" / "dataset.yaml"
    if not meta.is_file():
        return energon_prepare(out, media_meta=True)
    kind = dataset_sample_type(out)
    if kind != CRUDE:
        raise ShardError(f"{out} is a {kind} dataset as `energon prepare` wrote it: it trains as it is (every rank "
                         f"then reads its media members), and --index leaves its {meta} alone; for the fast path "
                         f"write it as a manifest and run scripts/prepare_data.py --manifest")
    bad = check_shards(out)
    if bad:
        raise ShardError(f"{len(bad)} shard(s) in {out} cannot be indexed:\n" + "\n".join(f"  {b}" for b in bad))
    import contextlib

    from megatron.energon.tools.prepare import command

    with contextlib.redirect_stdout(io.StringIO()):
        command.main([str(out), "--tar-index-only", "--no-progress", "--num-workers", "1"], standalone_mode=False)
    if PART_FILTER not in meta.read_text():
        with open(meta, "a") as f:
            f.write(PART_FILTER + "\n")


# --- synthetic data: small but real encoded media, varied shapes, rates and channel counts -------------

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
          "white": (245, 245, 245), "black": (15, 15, 15)}
SIZES = [(640, 480), (300, 900), (1024, 256), (200, 200), (800, 600), (480, 640)]


def synth_image(rng: random.Random) -> tuple[bytes, str, str]:
    (w, h), (fg, bg) = rng.choice(SIZES), rng.sample(sorted(COLORS), 2)
    img = Image.new("RGB", (w, h), COLORS[bg])
    draw, shape = ImageDraw.Draw(img), rng.choice(["circle", "square", "stripe"])
    box = (w // 4, h // 4, 3 * w // 4, 3 * h // 4)
    {"circle": draw.ellipse, "square": draw.rectangle, "stripe": lambda b, fill: draw.rectangle(
        (0, h // 2 - h // 10, w, h // 2 + h // 10), fill=fill)}[shape](box, fill=COLORS[fg])
    fmt = rng.choice(["jpg", "png"])
    buf = io.BytesIO()
    img.save(buf, format="JPEG" if fmt == "jpg" else "PNG", quality=85)
    return buf.getvalue(), fmt, f"A {fg} {shape} on a {bg} background, {w} by {h} pixels."


def encode_mp4(frames, fps: int, codec: str = "mpeg4") -> bytes:
    """RGB uint8 frames [h, w, 3] (an iterable; every frame the same size) → an MP4 file's bytes."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = None
        for t, arr in enumerate(frames):
            if stream is None:
                stream = container.add_stream(codec, rate=fps)
                stream.height, stream.width = arr.shape[:2]
                stream.pix_fmt, stream.time_base = "yuv420p", Fraction(1, fps)
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            frame.pts = t
            container.mux(stream.encode(frame))
        if stream is None:  # no frames: a container with an empty stream (which no demuxer accepts)
            stream = container.add_stream(codec, rate=fps)
            stream.width = stream.height = 16
            stream.pix_fmt = "yuv420p"
        container.mux(stream.encode())
    return buf.getvalue()


def synth_video(rng: random.Random) -> tuple[bytes, str, str]:
    frames, (w, h), color = rng.randint(4, 24), rng.choice([(128, 96), (96, 128), (160, 90)]), rng.choice(
        sorted(COLORS))

    def frame(t: int) -> np.ndarray:
        arr = np.zeros((h, w, 3), dtype=np.uint8)
        x = int((w - 24) * t / max(frames - 1, 1))
        arr[h // 2 - 12:h // 2 + 12, x:x + 24] = COLORS[color]
        return arr

    data = encode_mp4((frame(t) for t in range(frames)), fps=8)
    return data, "mp4", f"A {color} square moves from left to right over {frames / 8:.1f} seconds."


def synth_audio(rng: random.Random) -> tuple[bytes, str, str]:
    rate, seconds, channels = rng.choice([16000, 22050, 44100, 8000]), rng.choice([0.5, 1.0, 1.7, 3.0]), rng.choice(
        [1, 2])
    freq = rng.choice([220, 330, 440, 660, 880])
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.3 * np.sin(2 * math.pi * freq * t) * np.minimum(1, 10 * t)
    wave = np.stack([wave] * channels, axis=1).astype(np.float32)
    fmt = rng.choice(["wav", "flac"])
    buf = io.BytesIO()
    sf.write(buf, wave, rate, format=fmt.upper())
    return buf.getvalue(), fmt, f"A steady {freq} hertz tone lasting {seconds} seconds."


SYNTH = {"image": synth_image, "video": synth_video, "audio": synth_audio}


def synthetic_records(n: int, seed: int, prefix: str = "syn", kinds=("image", "video", "audio", "chat")):
    """n samples cycling through captions of each kind and multi-turn chats with two media items."""
    rng = random.Random(seed)
    for i in range(n):
        kind = kinds[i % len(kinds)]
        key = f"{prefix}_{i:06d}"
        if kind != "chat":
            data, ext, text = SYNTH[kind](rng)
            yield key, caption_chat(kind, text), [(kind, ext, data)]
            continue
        pool = [k for k in ("image", "video", "audio") if k in kinds]  # all three: the draws of every earlier set
        a, b = rng.sample(pool, 2) if len(pool) > 1 else pool * 2
        (da, ea, ta), (db, eb, tb) = SYNTH[a](rng), SYNTH[b](rng)
        conversation = [
            {"role": "system", "content": "You are a helpful multimodal assistant."},
            {"role": "user", "content": f"Look at this: <{a}>"},
            {"role": "assistant", "content": ta},
            {"role": "user", "content": f"And this one? <{b}> How do they differ?"},
            {"role": "assistant", "content": f"The second one: {tb}"},
        ]
        yield key, conversation, [(a, ea, da), (b, eb, db)]


def make_synthetic(out: Path, samples: int = 96, seed: int = 0, shard_size: int = 16, prefix: str = "syn",
                   tokenizer: bool = True, media_meta: bool = True, val_ratio: float = 0.0,
                   kinds=("image", "video", "audio", "chat")) -> Counter:
    """Synthetic shards + index (+ tokenizer.model trained on the texts); used by tests and the benchmark.
    media_meta=False: a dataset as prepared before the media metadata (data/media_meta.py). val_ratio:
    energon_prepare's. kinds: synthetic_records'."""
    records = list(synthetic_records(samples, seed, prefix, kinds))
    counts = write_shards(iter(records), out, shard_size, media_meta)
    energon_prepare(out, media_meta, val_ratio)
    if tokenizer:
        from tessera.data.tokens import train_sentencepiece

        texts = [t["content"] for _, conv, _ in records for t in conv] * 4
        train_sentencepiece(texts + ["user\n", "assistant\n", "system\n"], out / "tokenizer", vocab_size=400)
    return counts
