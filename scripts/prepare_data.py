"""python scripts/prepare_data.py --synthetic --out /tmp/tessera_data

Turn a JSONL manifest, a folder, or a synthetic generator into webdataset shards + energon's index.

    python scripts/prepare_data.py --manifest data.jsonl --out DIR [--shard-size 100]
    python scripts/prepare_data.py --folder photos/ --out DIR      # x.jpg|png|mp4|wav|flac + x.txt caption
    python scripts/prepare_data.py --synthetic --out DIR [--samples 96] [--seed 0]

Manifest lines are either a caption record {"image"|"video"|"audio": path, "caption": text} or a chat
record {"conversation": [{"role", "content"}...], "media": [{"kind": "image", "path": p}, ...]} whose
content holds <image>/<video>/<audio> tags; relative paths resolve against the manifest's folder.
Each sample becomes KEY.json ({"conversation", "media": [{"kind", "field"}]}) plus one member per media
item (KEY.img0.jpg, KEY.vid0.mp4, KEY.aud0.flac). Then `energon prepare` (run in-process) writes
DIR/.nv-meta (tar indexes for random access, split.yaml, dataset.yaml with CrudeWebdataset).
--synthetic also trains DIR/tokenizer.model (SentencePiece with the template and media tokens).
Items that cannot be read are skipped and reported with their reason; the process never stops on one.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from tessera.data.prepare import energon_prepare, make_synthetic, records_from_folder, records_from_manifest, write_shards


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", type=Path, help="JSONL manifest (caption or chat records)")
    src.add_argument("--folder", type=Path, help="folder of media files with same-name .txt captions")
    src.add_argument("--synthetic", action="store_true", help="generate a small realistic dataset")
    ap.add_argument("--out", type=Path, required=True, help="output folder for shard-*.tar and .nv-meta")
    ap.add_argument("--shard-size", type=int, default=16, help="samples per tar shard")
    ap.add_argument("--samples", type=int, default=96, help="--synthetic: number of samples")
    ap.add_argument("--seed", type=int, default=0, help="--synthetic: generator seed")
    args = ap.parse_args(argv)

    skipped: Counter = Counter()
    if args.synthetic:
        counts = make_synthetic(args.out, args.samples, args.seed, args.shard_size)
    else:
        records = (records_from_manifest(args.manifest, skipped) if args.manifest
                   else records_from_folder(args.folder, skipped))
        counts = write_shards(records, args.out, args.shard_size)
        if counts["samples"] == 0:
            print(f"[prepare] no usable samples; skipped {dict(skipped)}", file=sys.stderr)
            return 1
        energon_prepare(args.out)
    shards = len(list(args.out.glob("shard-*.tar")))
    print(f"[prepare] wrote {counts['samples']} samples in {shards} shards to {args.out} "
          f"(image={counts['image']} video={counts['video']} audio={counts['audio']}); "
          f"skipped {sum(skipped.values())}" + (f" {dict(skipped)}" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
