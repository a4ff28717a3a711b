"""Several prepared datasets trained as one: `data.path="caps=DIR;qa=DIR:0.3"`, or an energon metadataset YAML.

    members = blend_members("caps=/d/caps;qa=/d/qa:0.3")   # [BlendMember("caps", /d/caps, 1.0), (..., 0.3)]
    text = blend_yaml(members)                             # energon's MetadatasetV2: the blend a run reads
    path = shared_tokenizer(members)                       # the one tokenizer its datasets carry, or refused

The spec is the form data.val_path already takes (NAME=DIR;NAME=DIR), with an optional `:WEIGHT` (energon's
sampling weight, default 1). A run writes the YAML into its run directory (recipes/train.py) and trains from it,
so the blend it trained on stays next to its checkpoints; a user's own YAML (splits: train: blend: [{weight,
path}]) works as before. Its val split holds the members that have one (`prepare_data.py --val-ratio`).

Which tokenizer: a dataset carries the one `prepare_data.py` trained on its texts (or copied with --tokenizer);
a blend uses its members' tokenizer when they all carry the same file (same bytes), so prepare every member with
one `--tokenizer PATH`. Members with different tokenizers and no data.tokenizer are refused naming them: a
token id would mean one word in one dataset and another in the next.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from tessera.data.prepare_split import split_parts


@dataclass(frozen=True)
class BlendMember:
    name: str
    path: Path
    weight: float


def is_blend_spec(value: str | None) -> bool:
    """data.path="NAME=DIR[:W];...": a blend written out by the run (a plain path has no '=' before its first '/')."""
    return bool(value) and "=" in str(value).split("/", 1)[0]


def parse_blend_spec(spec: str) -> list[BlendMember]:
    """The members of `spec`, each NAME=DIR with an optional :WEIGHT (> 0); ValueError naming the part at fault."""
    members: list[BlendMember] = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        name, eq, rest = part.partition("=")
        name, rest = name.strip(), rest.strip()
        path, colon, weight = rest.rpartition(":")
        if not colon or "/" in weight:  # no weight given (a ':' inside the path is part of it)
            path, weight = rest, "1"
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"data.path: {part!r}: the weight after ':' must be a number, e.g. {name}={path}:0.5"
                             ) from None
        if not eq or not name or "/" in name or not path:
            raise ValueError(f"data.path: {part!r} is not NAME=DIR or NAME=DIR:WEIGHT (blend several: "
                             f"\"a=DIR;b=DIR:0.5\")")
        if not w > 0:
            raise ValueError(f"data.path: {part!r}: a weight must be > 0")
        if any(m.name == name for m in members):
            raise ValueError(f"data.path: the name {name!r} is given twice; name each dataset once: a=DIR;b=DIR")
        members.append(BlendMember(name, Path(path).expanduser(), w))
    if not members:
        raise ValueError(f"data.path={spec!r} names no dataset")
    return members


def blend_members(value: str | Path | None) -> list[BlendMember] | None:
    """The datasets a blend trains on: a spec's, or a metadataset YAML's train blend (its paths relative to the
    YAML's folder); None for a single dataset directory."""
    if is_blend_spec(str(value) if value else None):
        return parse_blend_spec(str(value))
    path = Path(str(value)).expanduser() if value else None
    if path is None or not path.is_file() or path.suffix not in (".yaml", ".yml"):
        return None
    import yaml

    train = ((yaml.safe_load(path.read_text()) or {}).get("splits") or {}).get("train") or {}
    out = []
    for i, entry in enumerate(train.get("blend") or []):
        if isinstance(entry, dict) and "path" in entry:
            p = Path(entry["path"]).expanduser()
            out.append(BlendMember(p.name or f"dataset{i}", p if p.is_absolute() else path.parent / p,
                                   float(entry.get("weight", 1))))
    return out


def blend_yaml(members: list[BlendMember]) -> str:
    """energon's MetadatasetV2 for the members: their train splits blended by weight, and a val split of those
    that hold one out."""
    def entries(ms):
        return "".join(f"      - weight: {m.weight:g}\n        path: {m.path.resolve()}\n" for m in ms)

    text = "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n" + entries(members)
    val = [m for m in members if (split_parts(m.path) or {}).get("val")]
    if val:
        text += "  val:\n    blend:\n" + entries(val)
    return text


def write_blend(spec: str, out_dir: Path) -> Path:
    """The spec's YAML as out_dir/blend.yaml (the run directory: it stays with the run); returns its path."""
    path = Path(out_dir) / "blend.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(blend_yaml(parse_blend_spec(spec)))
    tmp.replace(path)
    return path


def shared_tokenizer(members: list[BlendMember], own_tokenizer) -> Path | None:
    """The tokenizer file every member that carries one carries (same bytes), or None when none does; ValueError
    naming the members when they differ. own_tokenizer(DIR) -> DIR's tokenizer file or None (data/run_tokenizer)."""
    found = {m.name: own_tokenizer(m.path) for m in members}
    found = {name: p for name, p in found.items() if p is not None}
    digests = {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in found.items()}
    if len(set(digests.values())) > 1:
        listed = ", ".join(f"{name}: {found[name]}" for name in found)
        raise ValueError(f"the blended datasets carry different tokenizers ({listed}): set data.tokenizer=PATH to "
                         f"the one the model uses, or prepare every dataset with the same one "
                         f"(scripts/prepare_data.py --tokenizer PATH)")
    return next(iter(found.values()), None)
