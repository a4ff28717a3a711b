"""`python -m tessera.recipes.verify`: the trainer's own step in a layout == the same step on one device, read
back as whole tensors by torch's DCP tools. The comparison is tested on its own (what it flags, what it only
notes); the command runs once under torchrun on a heterogeneous layout of the tiny VL recipe."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.recipes.verify import NOISE_FLOOR, compare

ROOT = Path(__file__).resolve().parents[1]


def _ckpt(scale: float = 1.0) -> dict:
    g = torch.linspace(-1.0, 1.0, 12).reshape(3, 4) * 1e-3
    return {"model.language.w": torch.ones(3, 4), "optim.exp_avg.language.w": 0.1 * g * scale,
            "optim.exp_avg_sq.language.w": 1e-3 * g * g * scale ** 2,
            "optim.exp_avg.audio.key_bias": torch.full((4,), 3e-13),  # zero in exact arithmetic: noise
            "optim.exp_avg_sq.audio.key_bias": torch.full((4,), 1e-28),
            "model.audio.bn.running_mean": torch.zeros(4), "model.audio.bn.num_batches_tracked": torch.tensor(7)}


def test_compare_flags_wrong_gradients_and_missing_tensors_and_notes_batchnorm_statistics():
    ref = _ckpt()
    assert compare(_ckpt(), ref) == (0.0, [], [])
    err, problems, _ = compare(_ckpt(scale=1.001), ref)  # a gradient 0.1% off
    assert err == pytest.approx(2e-3, rel=1e-3) and not problems  # the second moment: (1.001)^2 - 1
    # a noise tensor's relative error is measured against its family's floor, not its own size
    noisy = _ckpt() | {"optim.exp_avg.audio.key_bias": torch.full((4,), -3e-13)}
    err, _, _ = compare(noisy, ref)
    assert err == pytest.approx(6e-13 / (NOISE_FLOOR * 1e-4), rel=1e-6) and err < 1e-5
    missing = {k: v for k, v in _ckpt().items() if k != "optim.exp_avg.language.w"}
    assert compare(missing, ref)[1] == ["only in the one-device checkpoint: optim.exp_avg.language.w"]
    shaped = _ckpt() | {"model.language.w": torch.ones(4, 3)}
    assert "shape (4, 3) != one device's (3, 4)" in compare(shaped, ref)[1][0]
    bn = _ckpt() | {"model.audio.bn.running_mean": torch.ones(4)}
    err, problems, notes = compare(bn, ref)
    assert err == 0.0 and not problems and "BatchNorm running statistics differ" in notes[0]


@pytest.mark.multiproc
def test_verify_trains_a_heterogeneous_layout_and_matches_one_device(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tessera.recipes.verify", "--recipe", "nemotron_vl_tiny", "--out", str(tmp_path),
           "layout=vision=dp2@0-1;language=tp2@0-1", "data.seq_length=128"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"verify: PASS max_rel_err=(\S+) compared=(\d+) loss=(\S+) ref_loss=(\S+) layout=(\S+)", last)
    assert m and float(m.group(1)) <= 1e-5 and int(m.group(2)) > 50, last
    assert m.group(5) == "vision=dp2@0-1;language=tp2,dp1@0-1", last
    # both runs trained one step and saved it: the layout's on two ranks, the reference on one
    assert (tmp_path / "layout" / "checkpoints" / "step_000001").is_dir()
    assert (tmp_path / "one_device" / "checkpoints" / "step_000001").is_dir()
