"""Saves that keep a job's work: on SIGTERM (Slurm's --signal, scancel, a preemption), asynchronously, within a
bounded number of checkpoints, and with a clear outcome when the disk is full.

(a) torchrun, 2 ranks, the tiny VL recipe with no periodic save (save_every=0): SIGTERM to rank 1 only, twice,
    mid-run (a signal can reach some ranks first; tests/test_slurm.py signals every process as Slurm does). Both
    ranks finish the step they are in, agree on the stop (rank 0 saw no signal), save that step, and the job
    exits non-zero (so Slurm requeues it) with nothing left running; the second signal changes nothing. The same
    command resumes there and finishes; the curve, stitched, equals an uninterrupted run's bitwise.
(b) async saves (trainer.async_save) with keep_last / keep_every: the same curve as synchronous saves, exactly
    the checkpoints the policy keeps, and a resume from an asynchronously written step is bitwise.
(c) a full file system (a 1 MiB tmpfs): the save fails on every rank with an error naming the fix, `latest`
    still names the last complete step, and the unpublished `.partial` is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.training.metrics import read_metrics
from tests.test_train_fault import MARKER, _job, _marked, _survivors

pytestmark = pytest.mark.multiproc


def _args(run_dir: Path, steps: int) -> list[str]:
    return ["--recipe", "nemotron_vl_tiny", "layout=vision=dp2@0-1;language=dp2@0-1", f"trainer.max_steps={steps}",
            "trainer.save_every=0", f"trainer.run_dir={run_dir}", "trainer.timeout_s=120", "trainer.progress=false",
            "trainer.tensorboard=false", "data.seq_length=128"]


def _cmd(run_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "tessera.recipes.train", *_args(run_dir, steps)]


def _env(marker: str) -> dict:
    # what recipes/executors.py gives a job: torchrun waits this long for its workers after a SIGTERM
    return dict(os.environ, OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="120", **{MARKER: marker})


def _run(run_dir: Path, steps: int, log: Path) -> tuple[int, str]:
    with _job(_cmd(run_dir, steps), log, _env(uuid.uuid4().hex)) as proc:
        rc = proc.wait(timeout=600)
    return rc, log.read_text()


def test_sigterm_saves_the_step_exits_nonzero_and_resumes_bitwise(tmp_path):
    from tessera.recipes.train import main as train_main

    steps = 6
    # the uninterrupted run: the entry point's main on 2 forked ranks (the stopped and resumed runs are torchrun's)
    run_on_ranks(2, train_main, _args(tmp_path / "whole", steps), timeout=600)
    whole = [r["loss"] for r in read_metrics(tmp_path / "whole")]

    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    log = tmp_path / "stopped.log"
    with _job(_cmd(run_dir, steps), log, _env(marker)) as proc:
        end = time.monotonic() + 300
        while len(read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []) < 2:
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.2)
        rank1 = [pid for pid, cmd in _marked(marker).items() if "tessera.recipes.train" in cmd
                 and "torch.distributed.run" not in cmd
                 and b"RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")]
        assert len(rank1) == 1, _marked(marker)
        for _ in range(2):
            os.kill(rank1[0], signal.SIGTERM)
            time.sleep(0.2)
        rc = proc.wait(timeout=300)
    out = log.read_text()
    assert rc != 0, "a run stopped before its last step must exit non-zero (Slurm requeues it)"
    assert not _survivors(marker), "processes left behind after a SIGTERM"
    stopped = [r["step"] for r in read_metrics(run_dir)]
    assert 2 <= stopped[-1] < steps, (stopped, out[-3000:])
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped[-1]:06d}", (latest, stopped, out[-3000:])
    # rank 0 prints the summary: it stopped on rank 1's signal
    assert f"stopped by a signal another rank received after step {stopped[-1]}" in out, out[-3000:]
    assert "received SIGTERM again" in out, "the second signal should reach a rank already stopping"
    assert not list((run_dir / "checkpoints").glob("*.partial")), "a save on the signal did not complete"

    rc, out = _run(run_dir, steps, tmp_path / "resumed.log")
    assert rc == 0, out[-3000:]
    assert f"(step {stopped[-1]}," in out, out[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in rows] == whole, "the stopped and resumed run must equal the uninterrupted one"


# ---- (b) async saves, bounded disk ------------------------------------------------------------------------

def _train(run_dir: str, steps: int, **trainer):
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    model = ModelConfig(llm="nemotron_h_tiny_dense", vision="radio_vit_tiny")
    data = DataConfig(seq_length=128, rows_per_microbatch=2, microbatches=1)
    cfg = TrainerConfig(max_steps=steps, run_dir=run_dir, progress=False, tensorboard=False, **trainer)
    return train(model, data, OptimConfig(lr=2e-3, min_lr_ratio=1.0), cfg, layout="vision=dp2@0-1;language=tp2@0-1",
                 name="async")


def _async_runs(root: str) -> None:
    import shutil

    import torch.distributed as dist

    root = Path(root)
    _train(str(root / "sync"), 8, save_every=2)
    _train(str(root / "async"), 8, save_every=2, async_save=True, keep_last=2, keep_every=4)
    if dist.get_rank() == 0:
        (root / "resumed" / "checkpoints").mkdir(parents=True)
        shutil.copytree(root / "async" / "checkpoints" / "step_000006", root / "resumed" / "checkpoints" / "step_000006")
        (root / "resumed" / "checkpoints" / "latest").write_text("step_000006\n")
    dist.barrier()
    _train(str(root / "resumed"), 8, async_save=True)


def test_async_saves_keep_the_curve_and_only_the_checkpoints_kept(tmp_path):
    run_on_ranks(2, _async_runs, str(tmp_path), timeout=600)
    sync, asyn = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "async")
    assert [r["loss"] for r in asyn] == [r["loss"] for r in sync], "an async save changed training"
    ckpts = tmp_path / "async" / "checkpoints"
    # keep_last=2 (steps 6, 8) and keep_every=4 (step 4, and 8); step 2 deleted; nothing half-written
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000004", "step_000006", "step_000008"]
    assert (ckpts / "latest").read_text().strip() == "step_000008"
    assert sorted(p.name for p in (tmp_path / "sync" / "checkpoints").iterdir()) == [
        "latest", *(f"step_{s:06d}" for s in (2, 4, 6, 8))], "the default keeps every checkpoint"
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [7, 8]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in sync[6:]], "resume from an async checkpoint"


# ---- (c) a full disk -------------------------------------------------------------------------------------

def _save_until_full(mount: str) -> dict:
    import torch
    import torch.distributed as dist

    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.runtime.groups import build_module_groups, destroy_module_groups
    from tessera.hetero.checkpoint.sharded import SaveFailed, latest_checkpoint, save_checkpoint

    groups = build_module_groups(HeteroLayout.parse("language=dp2@0-1"))
    torch.manual_seed(0)
    module = torch.nn.Linear(256, 256)  # 257 KiB of fp32 weights: one save fits in 1 MiB, then the disk fills
    root = Path(mount) / "checkpoints"
    save_checkpoint(root, 1, {"language": module}, None, groups, {"language": None}, {"n": "1"})
    if dist.get_rank() == 0:  # leave less room than one more checkpoint needs
        free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
        (Path(mount) / "ballast").write_bytes(b"\0" * max(0, free - 64 * 1024))
    dist.barrier()
    try:
        save_checkpoint(root, 2, {"language": module}, None, groups, {"language": None}, {"n": "2"})
        error = None
    except SaveFailed as e:
        error = str(e)
    dist.barrier()
    destroy_module_groups(groups)
    return {"error": error, "latest": latest_checkpoint(root).name,
            "entries": sorted(p.name for p in root.iterdir())}


def test_a_full_disk_fails_the_save_with_the_fix_and_keeps_the_last_checkpoint(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {res.stderr.strip()}")
    try:
        per_rank = run_on_ranks(2, _save_until_full, str(mount), timeout=300)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    for r in per_rank:
        assert r["error"] is not None, "the save into a full file system did not fail on every rank"
        assert "checkpoint step 2" in r["error"] and "file system is full" in r["error"], r["error"]
        assert "trainer.keep_last" in r["error"] and "step_000001, is intact" in r["error"], r["error"]
        assert r["latest"] == "step_000001"
        assert r["entries"] == ["latest", "step_000001"], r["entries"]
