"""python scripts/prepare_data.py --synthetic --out /tmp/tessera_data

Turn a JSONL manifest, a folder, or a synthetic generator into webdataset shards + energon's index.

    python scripts/prepare_data.py --manifest data.jsonl --out DIR [--shard-size 100] [--workers 4]
    python scripts/prepare_data.py --manifest llava.json --out DIR   # a JSON array: LLaVA's own files
    python scripts/prepare_data.py --hf DATASET --split train --out DIR [--workers 4]
    python scripts/prepare_data.py --folder photos/ --out DIR      # x.jpg|png|mp4|wav|flac + x.txt caption
    python scripts/prepare_data.py --synthetic --out DIR [--samples 96] [--seed 0]
    ... [--val-ratio 0.1]     # hold out a share of the shards as energon's val split (validated on by default)

A manifest is JSONL or a JSON array; each record's format is detected from its keys (data/formats/):
Tessera's own chat record {"conversation": [{"role", "content"}...], "media": [{"kind": "image", "path": p}, ...]}
whose content holds <image>/<video>/<audio> tags, a caption record {"image"|"video"|"audio": path, "caption":
text}, LLaVA / ShareGPT ({"conversations": [{"from", "value"}...], "image": path or list}) or OpenAI / TRL
{"messages": [{"role", "content": str or [{"type": "text"|"image"|..., ...}]}]}, LLaMA-Factory alpaca / sharegpt,
the_cauldron's images + texts, NeMo ASR and spoken-QA manifests (data/formats/: one module each); relative paths
resolve against the manifest's folder (or --media-root DIR: LLaVA's --image_folder). Any other record: --format
MODULE:FUNCTION, your function from one record to Tessera's own record (data/formats/user.py), loaded and tried on
the first record before any shard is written. --hf takes a Hugging Face dataset (a save_to_disk folder, a parquet file or folder, or a
dataset id in the local cache; data/prepare_sources.py) whose rows are records of those formats (TRL's `images` +
`messages`, `image` + `conversations`, ...), media columns read undecoded, or a datasets imagefolder / audiofolder
/ videofolder layout; --columns image=COL,text=COL maps a flat table. --workers N prepares N parts at once.
Each sample becomes KEY.json ({"conversation", "media": [{"kind", "field", "bytes", "crc32", "probe"}]}: each
item's header facts, so the global stream reads no media bytes, data/media_meta.py) plus one member per media
item (KEY.img0.jpg, KEY.vid0.mp4, KEY.aud0.flac). Then `energon prepare` (run in-process) writes
DIR/.nv-meta (tar indexes for random access, split.yaml, dataset.yaml with CrudeWebdataset).
Every dataset gets a tokenizer, which training uses when neither data.tokenizer nor the checkpoint's own is
there (data/run_tokenizer.py): --tokenizer PATH copies a SentencePiece .model to DIR/tokenizer.model or a
tokenizer.json to DIR/tokenizer.json (the model's own); without it a small SentencePiece model (the template
and media tokens as single pieces) is trained on the dataset's texts, which suits the tiny recipes and
training from scratch.
    python scripts/prepare_data.py --index --out DIR [--tokenizer PATH]   # tars already in DIR: index only
(--index also writes the media metadata into a dataset prepared without it: data/media_meta.py; a dataset energon
prepared keeps its dataset.yaml and split, and one of energon's typed samples trains as it is: --index refuses it.)
Records and items that cannot be used are skipped, counted by reason and named (file:line or row, the field,
what was expected); the process never stops on one. The detected format is printed with the counts. A shard that
is cut off or unreadable (interrupted write, full disk, partial copy) is reported by name with what to do, and the
exit status is 2 (1: no usable samples, with the detected format and the first three reasons).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from tessera.data.prepare import (ShardError, add_media_metadata, energon_prepare, index_in_place, make_synthetic,
                                  records_from_folder, write_shards)
from tessera.data.prepare_split import SplitError, describe_splits


def _texts(records, into: list):
    """Pass records through, keeping their texts (for a tokenizer trained on the dataset)."""
    for rec in records:
        into.extend(t["content"] for t in rec[1] if isinstance(t.get("content"), str))
        yield rec


def _tokenizer(out: Path, given: Path | None, texts: list[str]) -> str:
    import shutil

    from tessera.data.run_tokenizer import TOKENIZER_FILES, own_tokenizer

    if given is None and not texts:
        have = own_tokenizer(out)
        return (f"tokenizer {have} (already there)" if have else "no tokenizer written (nothing to train one on): "
                "pass --tokenizer PATH, or set data.tokenizer=PATH when training")
    name = "tokenizer.json" if given is not None and given.suffix == ".json" else "tokenizer.model"
    dest = out / name
    for other in TOKENIZER_FILES:  # a directory's tokenizer.json is chosen before its .model: keep only this one
        if other != name:
            (out / other).unlink(missing_ok=True)
    if given is not None:
        if given.resolve() != dest.resolve():
            shutil.copyfile(given, dest)
        return f"tokenizer {dest} (copied from {given})"
    from tessera.data.tokens import train_sentencepiece

    train_sentencepiece(texts * 4 + ["user\n", "assistant\n", "system\n"], out / "tokenizer", vocab_size=400)
    return (f"tokenizer {dest} (trained on this dataset's texts; to fine-tune a released model pass "
            f"--tokenizer ITS tokenizer.json or .model, or train with model.checkpoint=DIR holding it)")


def _prepare_records(args):
    """--manifest / --hf: (counts, skipped, texts, detected format), or the exit status when nothing is usable."""
    from tessera.data.prepare_parallel import prepare_source
    from tessera.data.prepare_sources import HFSource, ManifestSource, SourceError

    if args.workers < 1:
        print(f"[prepare] --workers {args.workers}: give 1 or more processes", file=sys.stderr)
        return 2
    if args.media_root is not None and not args.media_root.is_dir():
        print(f"[prepare] --media-root {args.media_root}: no such folder (relative media paths resolve against it)",
              file=sys.stderr)
        return 2
    try:
        source = (ManifestSource(args.manifest, args.media_root) if args.manifest
                  else HFSource(args.hf, args.split, args.media_root))
    except SourceError as e:
        print(f"[prepare] {e}", file=sys.stderr)
        return 2
    user_format = None
    # --columns (or a folder builder's layout) is checked against the data's columns before any shard is written
    if args.columns or (getattr(source, "folder_kind", None) and not args.format):
        from tessera.data.formats.columns import Columns, ColumnsError

        try:
            user_format = (Columns.parse(args.columns, source.columns()) if args.columns
                           else Columns.for_folder(source.folder_kind, source.columns()))
        except ColumnsError as e:
            print(f"[prepare] {e}", file=sys.stderr)
            return 2
    if args.format and args.columns:
        print("[prepare] --format and --columns both convert every record: give one", file=sys.stderr)
        return 2
    if args.format:  # loaded and tried on the first record before any shard is written
        from tessera.data.formats.user import FormatLoadError, UserFormat, last_line

        try:
            user_format = UserFormat(args.format)
            _, where, first = next(iter(source.records(0, 1)), (None, None, None))
            if isinstance(first, dict):
                user_format.raw(first)
        except FormatLoadError as e:
            print(f"[prepare] {e}", file=sys.stderr)
            return 2
        except Exception as e:
            print(f"[prepare] --format {args.format} raised on the first record ({where}): {last_line(e)}; nothing "
                  f"was written", file=sys.stderr)
            return 2
    done = prepare_source(source, args.out, args.shard_size, args.workers, user_format)
    if done.counts["samples"] == 0:
        print(f"[prepare] no usable samples in {args.manifest or args.hf} (read as {source.kind}; detected format: "
              f"{done.format}); skipped {dict(done.skipped)}; the first reasons:\n"
              + "\n".join(f"  {r}" for r in done.reasons), file=sys.stderr)
        return 1
    return done.counts, done.skipped, done.texts, done.format


class _HelpWithDefaults(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default (--shard-size 16 is what a --val-ratio split cuts), except the
    sources and switches, whose None/False says nothing."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2], formatter_class=_HelpWithDefaults)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", type=Path, help="JSONL or JSON array of records (Tessera's, caption, LLaVA / "
                     "ShareGPT or OpenAI / TRL messages)")
    src.add_argument("--hf", help="Hugging Face dataset: save_to_disk folder, parquet file or folder, or cached id")
    src.add_argument("--folder", type=Path, help="folder of media files with same-name .txt captions")
    src.add_argument("--synthetic", action="store_true", help="generate a small realistic dataset")
    src.add_argument("--index", action="store_true", help="only index the webdataset tars already in --out")
    ap.add_argument("--tokenizer", type=Path, help="SentencePiece .model or tokenizer.json to copy to "
                    "OUT/tokenizer.model or OUT/tokenizer.json (default: train one on the dataset's texts)")
    ap.add_argument("--out", type=Path, required=True, help="output folder for shard-*.tar and .nv-meta")
    ap.add_argument("--shard-size", type=int, default=16, help="samples per tar shard")
    ap.add_argument("--split", default="train", help="--hf: the split to prepare")
    ap.add_argument("--media-root", type=Path, help="--manifest/--hf: the folder relative media paths resolve against "
                    "(LLaVA's --image_folder; default: the manifest's or dataset's folder)")
    ap.add_argument("--format", metavar="MODULE:FUNCTION", help="--manifest/--hf: your own converter, a function "
                    "from one record to Tessera's {conversation, media} (data/formats/user.py), instead of detecting "
                    "each record's format")
    ap.add_argument("--columns", metavar="ROLE=COL,...", help="--manifest/--hf: a flat table's columns as a caption "
                    "/ transcript sample: image=, video= or audio= (one), text=, and prompt= (a column, or the user "
                    "turn's text); a datasets folder builder's layout takes its media and first text column without "
                    "it")
    ap.add_argument("--workers", type=int, default=1, help="--manifest/--hf: processes preparing parts at once")
    ap.add_argument("--samples", type=int, default=96, help="--synthetic: number of samples")
    ap.add_argument("--seed", type=int, default=0, help="--synthetic: generator seed")
    ap.add_argument("--val-ratio", type=float, default=0.0, help="share of the shards held out as energon's val "
                    "split (whole shards, the last ones; a single shard is first cut into about 1/R smaller ones; "
                    "training validates on it with data.val_path=auto, the tiny recipes')")
    args = ap.parse_args(argv)
    if not 0.0 <= args.val_ratio < 1.0:
        print(f"[prepare] --val-ratio {args.val_ratio}: give a share in [0, 1), e.g. 0.1", file=sys.stderr)
        return 2

    if args.tokenizer is not None and (not args.tokenizer.is_file() or args.tokenizer.suffix not in (".model",
                                                                                                  ".json")):
        print(f"[prepare] --tokenizer {args.tokenizer}: not a SentencePiece .model or a tokenizer.json file",
              file=sys.stderr)
        return 2
    if args.tokenizer is not None:
        from tessera.data.tokens import Tokenizer

        try:  # before any shard is written: a tokenizer without Tessera's special tokens is no use
            Tokenizer(args.tokenizer)
        except Exception as e:
            print(f"[prepare] --tokenizer {args.tokenizer} does not load ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    skipped: Counter = Counter()
    texts: list[str] = []
    try:
        if args.synthetic:
            counts = make_synthetic(args.out, args.samples, args.seed, args.shard_size,
                                    tokenizer=args.tokenizer is None, val_ratio=args.val_ratio)
        elif args.index:
            if not args.out.is_dir() or not any(args.out.glob("*.tar")):
                print(f"[prepare] --index: no .tar shards in {args.out}", file=sys.stderr)
                return 1
            from tessera.data.sample_types import CRUDE, dataset_sample_type

            if (args.out / ".nv-meta" / "dataset.yaml").is_file() and dataset_sample_type(args.out) != CRUDE:
                index_in_place(args.out)  # refused, named, before any shard is touched
            rewritten = add_media_metadata(args.out)
            if rewritten:
                print(f"[prepare] added media metadata to {rewritten} shard(s) in {args.out}", file=sys.stderr)
            index_in_place(args.out)  # an energon-prepared dataset keeps its dataset.yaml and split
            counts = Counter()
        elif args.folder:
            counts = write_shards(_texts(records_from_folder(args.folder, skipped), texts), args.out, args.shard_size)
            if counts["samples"] == 0:
                print(f"[prepare] no usable samples; skipped {dict(skipped)}", file=sys.stderr)
                return 1
            energon_prepare(args.out, media_meta=True, val_ratio=args.val_ratio)
        else:
            done = _prepare_records(args)
            if isinstance(done, int):
                return done
            counts, skipped, texts, fmt = done
            energon_prepare(args.out, media_meta=True, val_ratio=args.val_ratio)
    except (ShardError, SplitError) as e:
        print(f"[prepare] {e}", file=sys.stderr)
        return 2
    tok = (f"tokenizer {args.out / 'tokenizer.model'} (trained on this dataset's texts)"
           if args.synthetic and args.tokenizer is None else _tokenizer(args.out, args.tokenizer, texts))
    shards = len(list(args.out.glob("*.tar")))
    what = "indexed" if args.index else f"wrote {counts['samples']} samples in"
    if args.manifest or args.hf:
        what = f"format {fmt}: {what}"
    print(f"[prepare] {what} {shards} shards in {args.out} "
          + ("" if args.index else f"(image={counts['image']} video={counts['video']} audio={counts['audio']}); "
                                   f"skipped {sum(skipped.values())}" + (f" {dict(skipped)}" if skipped else ""))
          + f"; {tok}")
    print(f"[prepare] splits: {describe_splits(args.out)}")  # a train split left empty would fail every rank
    return 0


if __name__ == "__main__":
    sys.exit(main())
