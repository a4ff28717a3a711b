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


# Grad-norm tolerance after the first step for a model with the FastConformer (audio): two of its parameters have
# an exact gradient of zero, so their fp32 gradient is rounding noise that depends on the order of the sums —
# the depthwise convolution's bias, which a training-mode BatchNorm cancels, and the attention key bias, which
# the softmax cancels. Measured at step 1 per parameter (omni reference vs audio=pp2): those differ by 0.1-1.1
# relative between layouts at |g| ~ 1e-12..2e-8, every other parameter by <= 1.4e-4 of its largest entry. AdamW
# normalises each entry's gradient, so their updates differ by up to the learning rate, and the grad norm of
# later steps drifts by 1e-5..1e-4 while the loss stays within 1e-6. Step 1 itself (no update yet) is checked to
# STEP1 (measured: 1.4e-8).
AUDIO_NORM_DRIFT, STEP1 = 3e-4, 1e-6


def check_first_step(name: str, loss, loss_ref, norm, norm_ref) -> None:
    """The layout's forward and backward before any optimizer step: loss and grad norm within STEP1."""
    assert rel(loss[:1], loss_ref[:1]) <= STEP1 and rel(norm[:1], norm_ref[:1]) <= STEP1, (
        f"{name}: step 1 loss {loss[0]!r} vs {loss_ref[0]!r}, grad norm {norm[0]!r} vs {norm_ref[0]!r}")


def seed_run_dir(src_ckpt: Path, run_dir: Path) -> None:
    """A fresh run directory whose only (and latest) checkpoint is src_ckpt."""
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(src_ckpt, run_dir / "checkpoints" / src_ckpt.name)
    (run_dir / "checkpoints" / "latest").write_text(src_ckpt.name + "\n")
