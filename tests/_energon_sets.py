"""Datasets as users have them: webdataset tars written by hand, indexed by energon's own `energon prepare` with one
of its standard sample types and a field map (its click command, in-process: the same code as the CLI)."""

from __future__ import annotations

import contextlib
import io
import random
from pathlib import Path

import webdataset as wds
from PIL import Image

from tessera.data.prepare import synth_image


def jpeg(rng: random.Random) -> tuple[bytes, str]:
    """A synthetic image as JPEG bytes, and its description."""
    data, _, text = synth_image(rng)
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").save(buf, format="JPEG", quality=85)
    return buf.getvalue(), text


def energon_set(root: Path, samples: list[dict], sample_type: str, field_map: dict | None,
                shard_size: int = 4, split_ratio: str = "1,0,0") -> Path:
    """Tars of `samples` (each {"__key__", member: bytes | str}) in `root`, then `energon prepare` as `sample_type`."""
    import json

    from megatron.energon.tools.prepare import command

    root.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(root / "part-%03d.tar"), maxcount=shard_size, verbose=0, mtime=0) as sink:
        for s in samples:
            sink.write({k: v.encode() if isinstance(v, str) and not k.startswith("__") else v for k, v in s.items()})
    args = [str(root), "--non-interactive", "--split-ratio", split_ratio, "--sample-type", sample_type,
            "--no-progress", "--num-workers", "1"]
    if field_map is not None:
        args += ["--field-map", json.dumps(field_map)]
    with contextlib.redirect_stdout(io.StringIO()):
        command.main(args, standalone_mode=False)
    return root
