"""Where scripts/prepare_data.py's records come from, and their media bytes.

A source is split into contiguous parts, one per worker (data/prepare_parallel.py), each read on its own:

  ManifestSource  a JSONL file, one record a line, streamed; or a JSON array (LLaVA's .json, whatever the file is
                  called: the first character decides), parsed once before the workers start, which share it.
  HFSource        a Hugging Face dataset: a save_to_disk folder, a parquet file or folder, or a dataset id in the
                  local cache (offline), one split. Arrow tables are memory-mapped: nothing is held whole. Media
                  columns (Image, Audio, Video, or lists of them) are read with decode=False, as {"bytes", "path"}:
                  data/media.py decodes them (datasets 5 decodes audio through torchcodec, not installed here).

Each record comes with `where` (file:line, file[index] or dataset[split][row]) for the skip messages.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

from tessera.data.formats import RecordError

SPLIT_NAMES = ("train", "validation", "val", "test")


class SourceError(ValueError):
    """A source that cannot be opened at all; the message names it and what to pass instead."""


def part_range(total: int, part: int, parts: int) -> range:
    """Rows [start, end) of contiguous part `part` of `parts` (sizes differ by at most one)."""
    size, extra = divmod(total, parts)
    start = part * size + min(part, extra)
    return range(start, start + size + (part < extra))


class ManifestSource:
    def __init__(self, path: Path, media_root: Path | None = None):
        # relative media paths resolve against --media-root (LLaVA's --image_folder), else the manifest's folder
        # (NeMo's rule, nemo.collections.common.parts.preprocessing.manifest.get_full_path)
        self.path, self.name = Path(path), Path(path).stem
        self.root = Path(media_root) if media_root is not None else self.path.parent
        if not self.path.is_file():
            raise SourceError(f"--manifest {path}: no such file")
        with open(self.path, "rb") as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        self.array = None
        if head.startswith(b"["):  # a JSON array, also where JSONL was expected: read as the array
            try:
                self.array = json.loads(self.path.read_text(encoding="utf-8-sig"))
            except (ValueError, UnicodeDecodeError) as e:
                raise SourceError(f"--manifest {path}: starts with '[' but is not a JSON array ({e})") from e
        elif head[:1] not in (b"{", b""):
            raise SourceError(f"--manifest {path}: neither JSONL (an object per line) nor a JSON array (it starts "
                              f"with {head[:16]!r}); a parquet file or a Hugging Face dataset goes to --hf")

    @property
    def kind(self) -> str:
        return "JSON array" if self.array is not None else "JSONL"

    def columns(self) -> list[str]:
        """The keys of the first record (what --columns names)."""
        first = next((r for _, _, r in self.records() if isinstance(r, dict)), {})
        return sorted(first)

    @property
    def total(self) -> int | None:
        """The number of records when known without reading the file (a JSONL file's is not)."""
        return None if self.array is None else len(self.array)

    def records(self, part: int = 0, parts: int = 1):
        """(index, where, record or RecordError) of part `part`."""
        if self.array is not None:
            for i in part_range(len(self.array), part, parts):
                yield i, f"{self.path}[{i}]", self.array[i]
            return
        with open(self.path, encoding="utf-8-sig") as f:
            for n, line in enumerate(f):
                if n % parts != part or not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    rec = RecordError("bad_json", "(line)", f"one JSON object per line ({e})")
                yield n, f"{self.path}:{n + 1}", rec


class HFSource:
    def __init__(self, path: str, split: str = "train", media_root: Path | None = None):
        here = Path(path)  # relative media paths in rows resolve against --media-root, else the dataset's folder
        self.root = Path(media_root) if media_root is not None else (
            (here if here.is_dir() else here.parent) if here.exists() else Path.cwd())
        self.split, self.path = split, path
        self.name = re.sub(r"[^A-Za-z0-9_-]", "_", Path(path).stem if Path(path).exists() else path)
        #: imagefolder / audiofolder / videofolder: the media kind of a folder builder's layout (its rows need a
        #: column mapping, data/formats/columns.py), else None
        self.folder_kind = _folder_kind(here) if here.is_dir() else None
        self.dataset = _open_hf(path, split, self.folder_kind)
        self.kind = (f"Hugging Face {self.folder_kind}folder" if self.folder_kind else "Hugging Face dataset") + (
            f" ({len(self.dataset)} rows of split {split!r})")
        self.total = len(self.dataset)

    def columns(self) -> list[str]:
        return list(self.dataset.column_names)

    def records(self, part: int = 0, parts: int = 1):
        rows = part_range(len(self.dataset), part, parts)
        for i, row in zip(rows, self.dataset.select(rows)):
            yield i, f"{self.path}[{self.split}][{i}]", row


#: the metadata files of the datasets folder builders (imagefolder, audiofolder, videofolder)
FOLDER_METADATA = ("metadata.jsonl", "metadata.csv", "metadata.parquet")


def _folder_kind(p: Path) -> str | None:
    """'image' | 'audio' | 'video' when `p` is laid out for a datasets folder builder (media files and a metadata
    file, in p or in its split folders), by the media files' extensions; else None."""
    from tessera.data.prepare import KIND_OF_EXT

    if not any(f.name in FOLDER_METADATA for f in p.rglob("metadata.*")):
        return None
    kinds = {KIND_OF_EXT.get(f.suffix.lower()) for f in p.rglob("*") if f.is_file()} - {None}
    return next((k for k in ("image", "audio", "video") if k in kinds), None)


def _open_hf(path: str, split: str, folder_kind: str | None = None):
    # a dataset id is read from the local cache only; datasets reads these when imported, which on the command
    # line is here (nothing imports it earlier)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    p = Path(path)
    try:
        if p.is_dir() and any((p / f).is_file() for f in ("state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise SourceError(f"--hf {path}: no split {split!r}; it has {sorted(ds)}: pass --split NAME")
                ds = ds[split]
        elif folder_kind:  # datasets' own builder resolves file_name (relative to its metadata file), splits
            builder = datasets.load_dataset_builder(f"{folder_kind}folder", data_dir=str(p))
            if folder_kind != "image":  # its Audio / Video cells are encoded through torchcodec (not installed),
                base = _path_cells(builder.BASE_FEATURE)  # even a path: keep the resolved path, undecoded
                builder._base_feature = lambda: base(decode=False)
            builder.download_and_prepare()
            ds = builder.as_dataset(split=split)
        elif p.suffix == ".parquet" or p.is_dir():
            ds = datasets.load_dataset("parquet", data_files={split: _parquet_files(p, split)}, split=split)
        else:
            ds = datasets.load_dataset(path, split=split)
    except SourceError:
        raise
    except Exception as e:  # datasets' own errors are many classes; say which input and what it accepts
        raise SourceError(f"--hf {path} (split {split!r}) does not open as a Hugging Face dataset ({type(e).__name__}: "
                          f"{str(e)[:300]}); give a save_to_disk folder, a parquet file or folder, or the id of a "
                          f"dataset in the local cache") from e
    return _undecoded(ds)


def _path_cells(feature_type):
    """`feature_type` (datasets.Audio / Video) storing a path cell as {bytes: None, path} without torchcodec, which
    datasets 5 imports to encode any cell; data/media.py decodes the bytes later."""
    class PathCells(feature_type):
        def encode_example(self, value):
            return {"bytes": None, "path": value} if isinstance(value, str) else super().encode_example(value)

    return PathCells


def _parquet_files(p: Path, split: str) -> list[str]:
    files = [p] if p.is_file() else sorted(p.rglob("*.parquet"))
    if not files:
        raise SourceError(f"--hf {p}: no .parquet files in it, and no save_to_disk state.json")

    def split_of(f: Path) -> str | None:  # the Hub's layouts: train-00000-of-00002.parquet, data/test/*.parquet
        rel = str(f.relative_to(p)) if p.is_dir() else f.name
        return next((s for s in SPLIT_NAMES if re.search(rf"(^|[/_.-]){s}([/_.-]|$)", rel)), None)

    named = {f: split_of(f) for f in files}
    if split in named.values():
        return [str(f) for f, s in named.items() if s == split]
    if any(named.values()) or split != "train":
        raise SourceError(f"--hf {p}: no parquet file of split {split!r} (found "
                          f"{sorted({s for s in named.values() if s})} by file name): pass --split NAME")
    return [str(f) for f in files]


def _undecoded(ds):
    """`ds` with every media column (Image, Audio, Video, or a list of them) read as {"bytes", "path"}."""
    import datasets

    media = (datasets.Image, datasets.Audio, datasets.Video)
    for name, feature in ds.features.items():
        inner = getattr(feature, "feature", None) if isinstance(feature, (datasets.List, datasets.LargeList)) else None
        if isinstance(feature, media):
            ds = ds.cast_column(name, type(feature)(decode=False))
        elif isinstance(inner, media):
            ds = ds.cast_column(name, type(feature)(type(inner)(decode=False)))
    return ds


def media_bytes(kind: str, source, root: Path) -> tuple[str, str, bytes]:
    """(kind, extension, bytes) of one media item: a path (relative to `root`), a Hugging Face cell {bytes, path},
    or an audio span {path, offset, duration} (seconds; NeMo's manifests), cut here."""
    if isinstance(source, dict) and "offset" in source:
        return kind, "wav", audio_span(root / source["path"], source["offset"], source["duration"])
    path = source if isinstance(source, str) else source.get("path")
    data = None if isinstance(source, str) else source.get("bytes")
    if data is None:
        if not path:
            raise RecordError("missing_media", kind, "a path or bytes, got neither")
        file = root / path
        try:
            data = file.read_bytes()
        except OSError as e:  # one system call where a check first would be two
            raise RecordError("missing_media", kind, f"an existing file: {file} does not exist" if isinstance(
                e, FileNotFoundError) else f"a readable file: {file} ({type(e).__name__}: {e.strerror})") from e
    ext = Path(path).suffix.lower().lstrip(".") if path else ""
    return kind, (ext.replace("jpeg", "jpg") or _sniffed_ext(kind, data)), data


def _sniffed_ext(kind: str, data: bytes) -> str:
    """The usual extension of bytes without a file name (an HF cell holds only bytes); the loader decodes by content,
    this only names the tar member."""
    if kind == "image":
        from PIL import Image

        try:
            return {"JPEG": "jpg"}.get(fmt := Image.open(io.BytesIO(data)).format, (fmt or "img").lower())
        except Exception:
            return "img"
    if kind == "audio":
        import soundfile as sf

        try:
            return sf.info(io.BytesIO(data)).format.lower()
        except Exception:
            return "audio"
    return "mp4"


def audio_span(file: Path, offset: float, duration: float) -> bytes:
    """The samples [offset, offset + duration) seconds of an audio file, as a WAV of the file's own sample type (no
    sample changes: what a reader of that span of the file decodes). A span past the file's end is a RecordError
    naming both lengths (a few samples of rounding are allowed and clipped)."""
    import soundfile as sf

    try:
        info = sf.info(str(file))
    except FileNotFoundError as e:
        raise RecordError("missing_media", "audio_filepath", f"an existing file: {file} does not exist") from e
    except Exception as e:
        raise RecordError("bad_media", "audio_filepath", f"an audio file soundfile reads: {file} ({e})") from e
    start, frames = round(offset * info.samplerate), round(duration * info.samplerate)
    if start + frames > info.frames + info.samplerate // 1000 or frames <= 0:
        raise RecordError("span_past_end", "offset", f"a span inside the audio: offset {offset} s + duration "
                          f"{duration} s = {offset + duration:.3f} s, but {file} lasts "
                          f"{info.frames / info.samplerate:.3f} s", "nemo_asr")
    frames = min(frames, info.frames - start)
    subtype = info.subtype if sf.check_format("WAV", info.subtype) else "FLOAT"
    dtype = {"PCM_16": "int16", "PCM_32": "int32"}.get(subtype, "float32")
    data, rate = sf.read(str(file), start=start, frames=frames, dtype=dtype, always_2d=True)
    buf = io.BytesIO()
    sf.write(buf, data, rate, format="WAV", subtype=subtype)
    return buf.getvalue()
