"""A two-dataset energon blend (metadataset YAML, weights 3:1) of synthetic data, for loader tests."""

from pathlib import Path

from tessera.data.loader import close_loader
from tessera.data.prepare import make_synthetic


def make_blend(root: Path, samples_a: int, samples_b: int) -> Path:
    make_synthetic(root / "a", samples=samples_a, seed=1, shard_size=8, prefix="a")
    make_synthetic(root / "b", samples=samples_b, seed=2, shard_size=8, prefix="b", tokenizer=False)
    (root / "blend.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        f"      - weight: 3\n        path: {root / 'a'}\n      - weight: 1\n        path: {root / 'b'}\n")
    return root


def take(loader, n: int, close: bool = True) -> list:
    """The first n batches; the loader's workers are stopped unless close=False (see close_loader)."""
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    if close:
        close_loader(loader)
    return out
