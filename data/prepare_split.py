"""The train/val split of a prepared dataset (`prepare_data.py --val-ratio R`): which shards are held out, smaller
shards when there are too few to hold any out, and how many shards and samples each split got.

    fit_shards_to_split(out, 0.2)   # one shard of 10 samples -> five of 2 (a split of whole shards needs 2+)
    write_split(out, 0.2)           # .nv-meta/split.yaml: the last round(R x shards) shards (1 or more) are val
    split_counts(out)               # {"train": (shards, samples), "val": (...)}

Energon splits whole shards, and its own ratio rule (floor of shards x share, in float) gives one shard of ten
images at 0.2 to `val` and leaves `train` empty, which every rank then reports as an 80-line EmptyDatasetError.
So the split is decided here, once, and written in energon's own split.yaml format; train always keeps a shard.
"""

from __future__ import annotations

import math
import tarfile
from pathlib import Path


class SplitError(ValueError):
    """A --val-ratio that no split of the dataset's samples can honour; the message names the numbers."""


def shard_names(out: Path) -> list[str]:
    return sorted(p.name for p in Path(out).glob("*.tar"))


def _sample_keys(shard: Path) -> list[str]:
    """The shard's sample keys in order: a member's name up to its first dot, as webdataset groups members."""
    keys: list[str] = []
    with tarfile.open(shard, mode="r:") as tar:
        for m in tar:
            if m.isfile():
                key = m.name.split(".", 1)[0]
                if not keys or keys[-1] != key:
                    keys.append(key)
    return keys


def val_shards(shards: int, val_ratio: float) -> int:
    """How many of `shards` (2 or more) are held out: round(shards x share), at least 1, and never all of them."""
    return min(shards - 1, max(1, round(shards * val_ratio)))


def fit_shards_to_split(out: Path, val_ratio: float) -> str | None:
    """With a val share and fewer than two shards, rewrite the samples as smaller shards (the members' bytes and
    order unchanged) so that train and val each get one: about 1/val_ratio shards. Returns what was done, in words
    (None: nothing to do); SplitError when there are fewer than two samples to split."""
    names = shard_names(out)
    if not val_ratio or len(names) >= 2:
        return None
    samples = sum(len(_sample_keys(out / n)) for n in names)
    if samples < 2:
        raise SplitError(f"--val-ratio {val_ratio} holds out whole shards, and {out} has {samples} sample(s): a "
                         f"train and a val split need at least 2; add samples or drop --val-ratio")
    target = max(2, round(1 / val_ratio))
    size = max(1, math.ceil(samples / target))
    _reshard(out, names, size)
    got = len(shard_names(out))
    return (f"--val-ratio {val_ratio}: {samples} samples made {len(names)} shard, and a split of whole shards needs "
            f"two; rewrote them as {got} shards of up to {size} samples (set --shard-size to choose)")


def _reshard(out: Path, names: list[str], size: int) -> None:
    """The samples of `names` (in order) as shard-NNNNNN.tar files of `size` samples each; the old ones removed."""
    import io

    samples: list[list[tuple[tarfile.TarInfo, bytes]]] = []
    for name in names:
        with tarfile.open(out / name, mode="r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key = m.name.split(".", 1)[0]
                if not samples or samples[-1][0][0].name.split(".", 1)[0] != key:
                    samples.append([])
                samples[-1].append((m, tar.extractfile(m).read()))
    written = []
    for i in range(0, len(samples), size):
        tmp = out / f"shard-{i // size:06d}.tar.tmp"
        with tarfile.open(tmp, "w") as tar:
            for group in samples[i:i + size]:
                for m, body in group:
                    tar.addfile(m, io.BytesIO(body))
        written.append(tmp)
    for name in names:
        (out / name).unlink()
    for tmp in written:
        tmp.rename(tmp.with_suffix(""))


def write_split(out: Path, val_ratio: float) -> None:
    """.nv-meta/split.yaml (energon's WebdatasetSplits): every shard in train, or with a val share the last
    val_shards(...) shards in val (the shards in name order, as energon lists them)."""
    import yaml
    from megatron.energon.flavors.webdataset.structs import WebdatasetSplits
    from megatron.energon.typed_converter import to_json_object

    names = shard_names(out)
    held = val_shards(len(names), val_ratio) if val_ratio and len(names) >= 2 else 0
    if val_ratio and not held:
        raise SplitError(f"--val-ratio {val_ratio}: {out} has {len(names)} shard(s); a train and a val split need 2 "
                         f"or more (lower --shard-size)")
    split = WebdatasetSplits(split_parts={"train": names[:len(names) - held], "val": names[len(names) - held:],
                                          "test": []})
    with open(Path(out) / ".nv-meta" / "split.yaml", "w") as f:
        yaml.dump(to_json_object(split), f, sort_keys=False)


def split_parts(path: Path) -> dict[str, list[str]] | None:
    """{split: shard names} from a prepared dataset's .nv-meta/split.yaml, or None when it has none."""
    import yaml

    split = Path(path) / ".nv-meta" / "split.yaml"
    if not split.is_file():
        return None
    return (yaml.safe_load(split.read_text()) or {}).get("split_parts") or {}


def split_counts(out: Path) -> dict[str, tuple[int, int]]:
    """{split: (shards, samples)} for each non-empty split of the dataset's split.yaml (train always listed)."""
    from braceexpand import braceexpand  # energon writes runs of names collapsed: shard-{000000..000003}.tar

    counts = {}
    for part, names in (split_parts(out) or {}).items():
        names = [n for pattern in names for n in braceexpand(pattern)]
        if names or part == "train":
            counts[part] = (len(names), sum(len(_sample_keys(Path(out) / n)) for n in names))
    return counts


def describe_splits(out: Path) -> str:
    """`train 4 shards 8 samples, val 1 shard 2 samples`: the summary line's split part."""
    def plural(n, what):
        return f"{n} {what}{'' if n == 1 else 's'}"

    return ", ".join(f"{part} {plural(s, 'shard')} {plural(n, 'sample')}" for part, (s, n) in split_counts(out).items())
