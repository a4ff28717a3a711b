"""What the multi-rank training tests read from their run directories (shared by test_train_hetero,
test_moe_train and test_encoder_pp)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tessera.hetero.training.metrics import read_metrics


def curves(run_dir) -> tuple[list[float], list[float]]:
    """(loss, global grad norm) at every logged step."""
    rows = read_metrics(run_dir)
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def rel(a: list[float], b: list[float]) -> float:
    """Largest relative difference of a to b, step by step."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def seed_run_dir(src_ckpt: Path, run_dir: Path) -> None:
    """A fresh run directory whose only (and latest) checkpoint is src_ckpt."""
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(src_ckpt, run_dir / "checkpoints" / src_ckpt.name)
    (run_dir / "checkpoints" / "latest").write_text(src_ckpt.name + "\n")
