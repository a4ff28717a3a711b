"""Fault behaviour under torchrun: a rank that dies mid-step ends the whole job non-zero (no hang), and a
re-launch resumes from the last complete checkpoint, so metrics.jsonl ends with every step exactly once.
However a run ends (normal end, a rank that exits, a rank killed with SIGKILL) no process it started is left
behind: every launch carries a marker in its environment, which all its processes inherit, and afterwards
no process with that marker may be alive (recipes/train.py's reaper)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tessera.hetero.training.metrics import read_metrics

pytestmark = pytest.mark.multiproc
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60  # trainer.timeout_s: the collective timeout the job must not exceed once a rank is gone


MARKER = "TESSERA_TEST_MARKER"


def _marked(marker: str) -> dict[int, str]:
    """{pid: command line} of every live process whose environment holds MARKER=marker."""
    want, found = f"{MARKER}={marker}".encode(), {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if want in (p / "environ").read_bytes().split(b"\0"):
                found[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass
    return found


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return 0


def _survivors(marker: str, wait_s: float = 20.0) -> dict[int, str]:
    """The marked processes still alive `wait_s` after the launcher ended (the reaper's grace is 3 s);
    SIGKILLed afterwards so a failing test leaves nothing behind either."""
    end = time.monotonic() + wait_s
    while (left := _marked(marker)) and time.monotonic() < end:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _cmd(run_dir: Path, steps: int = 4, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "tessera.recipes.train", "--recipe", "nemotron_vl_tiny", "layout=vision=dp2@0-1;language=dp2@0-1",
            f"trainer.max_steps={steps}", "trainer.save_every=1", f"trainer.run_dir={run_dir}",
            f"trainer.timeout_s={TIMEOUT_S}", "trainer.progress=false", "trainer.tensorboard=false",
            "data.seq_length=128", *extra]


@contextlib.contextmanager
def _job(cmd: list[str], log: Path, env: dict):
    """The job with its output in a file, not a pipe, and in its own session (a leftover process holding a
    pipe open would hang the test instead of failing it); whatever is left of it is killed on the way out: the
    launcher's process group, and, when the test failed inside, every process carrying the job's marker (torchrun's
    workers lead sessions of their own: an orphaned rank would train on through the rest of the suite)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        except BaseException:
            if MARKER in env:
                _survivors(env[MARKER], wait_s=0)  # SIGKILLs them
            raise
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _launch(run_dir: Path, env_extra: dict, steps: int = 4, *extra: str) -> tuple[int, str, dict]:
    """Run the job to its end; (exit code, output, processes of the job still alive afterwards)."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra, **{MARKER: marker})
    log = run_dir.parent / f"launch{len(list(run_dir.parent.glob('launch*.log')))}.log"
    # Output to a file, not a pipe, and the job in its own session: a leftover process holding the pipe open
    # would hang the test instead of failing it.
    with _job(_cmd(run_dir, steps, *extra), log, env) as proc:
        rc = proc.wait(timeout=600)
    return rc, log.read_text(), _survivors(marker)


def test_sigkilled_rank_leaves_no_process_behind(tmp_path):
    """SIGKILL one rank once it has checkpointed (the checkpoint writer's multiprocessing helpers exist by
    then, and a SIGKILLed rank cannot stop them); after torchrun ends, nothing of the job may be alive."""
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", **{MARKER: marker})
    with _job(_cmd(run_dir, steps=200), tmp_path / "launch.log", env) as proc:
        end = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "latest").exists():
            assert proc.poll() is None and time.monotonic() < end, (tmp_path / "launch.log").read_text()[-3000:]
            time.sleep(0.2)
        job = _marked(marker)
        # torchrun's workers (their parent is the agent), not the workers' forks (which show the same command line)
        ranks = [pid for pid in job if "tessera.recipes.train" in job[pid] and "torch.distributed.run" not in job[pid]
                 and "torch.distributed.run" in job.get(_parent(pid), "")]
        # what the ranks started: the checkpoint writer's queue server (a fork of the rank on this CPU box:
        # hetero/training/preemption.checkpoint_queue_start_method), not the reaper (python -I -S)
        helpers = {pid: c for pid, c in job.items() if _parent(pid) in ranks and " -I -S -c" not in c}
        assert helpers, f"no helper processes to test with: {job}"
        rank0 = [pid for pid in ranks if b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")]
        assert len(rank0) == 1, job
        os.kill(rank0[0], signal.SIGKILL)  # rank 0: the run directory's lock stays behind, held by a dead pid
        rc = proc.wait(timeout=300)
    assert rc != 0
    left = _survivors(marker)
    assert not left, f"left behind after rank 0 was SIGKILLed (helpers were {sorted(helpers)}): {left}"

    # the same job again, with trainer.max_steps at the checkpoint it left: it takes the dead job's lock over
    # (this host says the pid is gone), says so, and has nothing to do
    from tessera.hetero.checkpoint.source import latest_step

    step = latest_step(run_dir / "checkpoints")
    rc, out, left = _launch(run_dir, {}, step)
    assert rc == 0 and not left, out[-3000:]
    assert (f"took over the run directory {run_dir.resolve()} from pid {rank0[0]} on {socket.gethostname()} "
            f"(torchrun, since ") in out and f"its process ({rank0[0]} on {socket.gethostname()}) has ended" in out, out
    assert f"nothing to do: {run_dir.resolve()} holds checkpoint step {step} and trainer.max_steps={step}" in out, out
    assert not (run_dir / "tessera.lock").exists()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_crash_during_save_keeps_the_last_complete_checkpoint(tmp_path, mode):
    """Rank 0 dies inside the checkpoint writer while saving step 2 (TESSERA_FAIL_IN_SAVE, in
    hetero/checkpoint/sharded.py): the dead rank fails the whole job (no hang, no process left), every shard
    of step 2 is on disk, nothing is published. `latest` still names step 1, the half-saved step is never
    taken, and a relaunch resumes from step 1 and finishes with every step in metrics.jsonl exactly once.
    (One scenario for "a dead rank fails the job" and "relaunch resumes": two launches instead of four.)
    async: the same with trainer.async_save, where the shards are written by forked helpers while training goes
    on and the rank dies when the helpers are done, in the publish: nothing half-written is published either."""
    from tessera.hetero.checkpoint.sharded import latest_checkpoint

    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    extra = ("trainer.async_save=true",) if mode == "async" else ()
    rc, out, left = _launch(run_dir, {"TESSERA_FAIL_IN_SAVE": "2:0"}, 3, *extra)
    assert rc != 0, "a rank that died while saving must fail the job"
    assert not left, f"processes left behind by a job whose rank died in a save: {left}"
    assert out.splitlines()[0] == f"run_dir: {run_dir.resolve()}"
    assert (root / "latest").read_text().strip() == "step_000001"
    assert latest_checkpoint(root) == root / "step_000001"
    assert not (root / "step_000002").exists(), "a save that never completed was published"
    assert any((root / "step_000002.partial").iterdir()), "the save was not interrupted after writing shards"
    crashed = read_metrics(run_dir)
    # step 2 was trained, only its save was lost (async: step 3 trains while step 2 is written, unless the write
    # was already done at the check right after it, and the rank dies publishing step 2)
    assert [r["step"] for r in crashed] in ([[1, 2]] if mode == "sync" else [[1, 2], [1, 2, 3]])

    rc, out, left = _launch(run_dir, {}, 3, *extra)
    assert rc == 0, out[-3000:]
    assert not left, f"processes left behind by a job that ended normally: {left}"
    assert "resumed from" in out and "(step 1," in out, out[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["loss"] == crashed[1]["loss"], "step 2 redone from step 1's checkpoint must repeat exactly"
    assert latest_checkpoint(root) == root / "step_000003"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002", "step_000003"]
    assert latest_checkpoint(tmp_path / "nothing") is None


HANG_TIMEOUT_S = 20  # the hang test's collective timeout: the survivor reports once it has waited this long


def test_a_stopped_rank_is_named_and_a_rerun_resumes_bitwise(tmp_path):
    """Rank 1 stops (SIGSTOP: a read that never returns, a deadlock) at the start of step 4, after checkpoint step 2.
    Rank 0's collective times out and names it: its rank, the modules and grid places it holds, where it stopped,
    its host and pid, and the checkpoint a re-run resumes from. torchrun ends the job non-zero with nothing left
    running; the same command resumes from step 2 and redoes step 3 bitwise."""
    run_dir = tmp_path / "run"
    env = {"TESSERA_FAIL_AT_STEP": "3:1:stop"}
    rc, out, left = _launch(run_dir, env, 4, "trainer.save_every=2", f"trainer.timeout_s={HANG_TIMEOUT_S}")
    assert rc != 0, out[-3000:]
    assert not left, f"processes left behind by a job with a stopped rank: {left}"
    pid = out.split("rank 1 (pid ", 1)[1].split(")", 1)[0]
    assert f"hang: rank 0's collective waited {HANG_TIMEOUT_S} s (trainer.timeout_s) for:" in out, out[-3000:]
    named = [line for line in out.splitlines() if "hang:   rank 1 (" in line]
    assert len(named) == 1, out[-3000:]
    assert "rank 1 (vision tp0 cp0 dp1 pp0, language tp0 cp0 dp1 pp0) stopped answering " in named[0], named
    assert named[0].endswith(f"in step 4, data: host {socket.gethostname()}, pid {pid}"), named
    assert (f"resumes from {run_dir.resolve() / 'checkpoints' / 'step_000002'}") in out, out[-3000:]
    stopped = read_metrics(run_dir)
    assert [r["step"] for r in stopped] == [1, 2, 3]

    rc, out, left = _launch(run_dir, {}, 4, "trainer.save_every=2", f"trainer.timeout_s={HANG_TIMEOUT_S}")
    assert rc == 0 and not left, out[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["loss"] == stopped[2]["loss"], "step 3 redone from step 2's checkpoint must repeat exactly"


def test_two_jobs_on_one_run_directory_one_refuses_and_a_finished_run_has_nothing_to_do(tmp_path):
    """The same command launched twice at once (a double submit): one job holds the run directory, the other
    refuses before writing anything, naming the directory and the holder; the holder finishes with every step
    logged once. Launched again after it ended, the job has nothing to do: exit 0, not a byte written."""
    run_dir = tmp_path / "run"
    markers = [uuid.uuid4().hex, uuid.uuid4().hex]
    with contextlib.ExitStack() as stack:
        # trainer.progress=true: the bar is for a terminal; in these logs (as under nemo-run or Slurm) it never draws
        procs = [stack.enter_context(_job(_cmd(run_dir, 4, "trainer.progress=true"), tmp_path / f"job{i}.log",
                                          dict(os.environ, OMP_NUM_THREADS="1", **{MARKER: m})))
                 for i, m in enumerate(markers)]
        rcs = [p.wait(timeout=600) for p in procs]
    logs = [(tmp_path / f"job{i}.log").read_text() for i in range(2)]
    assert sorted(rc == 0 for rc in rcs) == [False, True], (rcs, [log[-2000:] for log in logs])
    refused = logs[rcs.index(next(rc for rc in rcs if rc != 0))]
    lock = run_dir.resolve() / "tessera.lock"
    assert (f"refused: the run directory {run_dir.resolve()} is in use by another job: pid ") in refused, refused
    assert f"holds {lock}" in refused and "step 1/" not in refused, refused
    assert not any(_survivors(m) for m in markers)
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4], "a step logged twice: both jobs trained"
    assert not lock.exists(), "the finished job left its lock"
    # the winner ends with its summary (hetero/rundir/summary.py), and no progress bar drew in its log
    won = logs[rcs.index(0)]
    summary = won[won.index("done: steps=4 "):].splitlines()
    assert summary[1].startswith("  loss: train ") and summary[2].startswith("  time: "), summary
    assert summary[3] == f"  run_dir: {run_dir.resolve()} (metrics.jsonl, loss.png)", summary
    assert summary[4] == (f"  checkpoints: step_000004 (latest), step_000003, step_000002, step_000001 in "
                          f"{run_dir.resolve() / 'checkpoints'}"), summary
    assert "step/s" not in won and "%|" not in won, won[-3000:]

    def files():
        return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*")) if p.is_file()}

    before = files()
    rc, out, left = _launch(run_dir, {}, 4)
    assert rc == 0 and not left, out[-3000:]
    assert f"nothing to do: {run_dir.resolve()} holds checkpoint step 4 and trainer.max_steps=4" in out, out[-3000:]
    assert files() == before, "a run with nothing to do wrote into its run directory"
