"""Fault behaviour under torchrun: a rank that dies mid-step ends the whole job non-zero (no hang), and a
re-launch resumes from the last complete checkpoint, so metrics.jsonl ends with every step exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.hetero.training.metrics import read_metrics

pytestmark = pytest.mark.multiproc
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60  # trainer.timeout_s: the collective timeout the job must not exceed once a rank is gone


def _launch(run_dir: Path, env_extra: dict) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tessera.recipes.train", "--recipe", "nemotron_vl_tiny", "layout=vision=dp2@0-1;language=dp2@0-1",
           "trainer.max_steps=4", "trainer.save_every=1", f"trainer.run_dir={run_dir}",
           f"trainer.timeout_s={TIMEOUT_S}", "trainer.progress=false", "trainer.tensorboard=false",
           "data.seq_length=128"]
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    log = run_dir.parent / f"launch{len(list(run_dir.parent.glob('launch*.log')))}.log"
    t0 = time.monotonic()
    # Output to a file, not a pipe, and the job in its own session: a killed rank's helper processes (the
    # checkpoint writer's multiprocessing manager) would otherwise hold the pipe open; they are reaped below.
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=600)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc, log.read_text(), time.monotonic() - t0


def test_dead_rank_fails_the_job_and_relaunch_resumes(tmp_path):
    run_dir = tmp_path / "run"
    rc, out, _ = _launch(run_dir, {"TESSERA_FAIL_AT_STEP": "2:1"})  # rank 1 dies before the 3rd step
    assert rc != 0, "a dead rank must fail the job"
    assert out.splitlines()[0] == f"run_dir: {run_dir.resolve()}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]

    rc, out, _ = _launch(run_dir, {})
    assert rc == 0, out[-3000:]
    assert "resumed from" in out and "(step 2," in out
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] < rows[0]["loss"]


def test_crash_during_save_keeps_the_last_complete_checkpoint(tmp_path):
    """A save that never completed leaves step_N.partial, which `latest` never names."""
    from tessera.hetero.training.checkpoint import latest_checkpoint

    root = tmp_path / "checkpoints"
    (root / "step_000002").mkdir(parents=True)
    (root / "latest").write_text("step_000002\n")
    (root / "step_000003.partial").mkdir()  # what a crash mid-save leaves behind
    assert latest_checkpoint(root) == root / "step_000002"
    assert latest_checkpoint(tmp_path / "nothing") is None
