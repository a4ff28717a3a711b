"""One job per run directory (hetero/rundir/lock.py): who may take over a lock (the pure rule, over every
kind of holder), the lock file itself (a live holder refuses naming it, a dead one is taken over, a release leaves
a newer holder's lock alone, an unreadable lock is refused), and several processes racing for one directory. The
jobs themselves (two launches at once, a SIGKILLed job's lock) are in tests/test_train_fault.py."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest

from tessera.hetero.rundir.lock import LOCK_NAME, Holder, RunDirBusy, RunDirLock, holder_gone, this_holder


def _holder(**kw) -> Holder:
    base = Holder(host="n1", boot_id="b1", pid=100, pid_start=5000, launcher="torchrun", slurm_job_id="",
                  slurm_restart="0", run_id="r1", elastic_restart="0", token="t", started="now")
    return dataclasses.replace(base, **kw)


def _alive(pid):  # the pid_start every holder below was recorded with: its process still runs
    return 5000


def _dead(pid):
    return None


def _queued(job):
    return True


@pytest.mark.parametrize("holder, me, pid_start, queued, gone", [
    # this very process (an earlier run of train() in it)
    (_holder(), _holder(token="u"), _alive, _queued, "this process's own earlier run"),
    # a live process on this host: busy, whatever else matches
    (_holder(pid=7), _holder(run_id="r2"), _alive, _queued, None),
    # the same host, the process ended (or its pid was reused by a process that started later)
    (_holder(pid=7), _holder(run_id="r2"), _dead, _queued, "its process (7 on n1) has ended"),
    (_holder(pid=7), _holder(run_id="r2"), lambda pid: 9999, _queued, "its process (7 on n1) has ended"),
    # a reboot since: the same host name and pid are not the holder
    (_holder(pid=7), _holder(boot_id="b2", run_id="r2"), _alive, lambda job: None, None),
    # another host, no Slurm to ask: cannot tell, busy
    (_holder(host="n2", pid=7), _holder(run_id="r2"), _dead, lambda job: None, None),
    # a Slurm requeue: the same job id, the next restart count, on any host
    (_holder(host="n2", slurm_job_id="42", slurm_restart="0"), _holder(slurm_job_id="42", slurm_restart="1"),
     _alive, _queued, "an earlier run of this Slurm job 42"),
    # torchrun's elastic restart inside one Slurm allocation
    (_holder(host="n2", slurm_job_id="42", elastic_restart="0"), _holder(slurm_job_id="42", elastic_restart="1"),
     _alive, _queued, "an earlier run of this Slurm job 42"),
    # torchrun's restart without Slurm: same run id, next restart
    (_holder(host="n2", elastic_restart="0"), _holder(elastic_restart="1"), _alive, _queued, "torchrun restart 0"),
    # two launches of torchrun (their own run ids) on another host: busy
    (_holder(host="n2"), _holder(run_id="r2", elastic_restart="1"), _dead, lambda job: None, None),
    # another Slurm job (a double submit): busy while Slurm lists it, gone once it is out of the queue
    (_holder(host="n2", slurm_job_id="41"), _holder(slurm_job_id="42"), _alive, _queued, None),
    (_holder(host="n2", slurm_job_id="41"), _holder(slurm_job_id="42"), _alive, lambda job: False,
     "its Slurm job 41 has ended"),
    (_holder(host="n2", slurm_job_id="41"), _holder(slurm_job_id="42"), _alive, lambda job: None, None),
])
def test_who_may_take_over_a_lock(holder, me, pid_start, queued, gone):
    why = holder_gone(holder, me, pid_start=pid_start, slurm_queued=queued)
    assert (why is None) == (gone is None), why
    if gone:
        assert gone in why


def _live_other() -> Holder:
    """A holder that is another live process on this host (the test's parent: pytest's launcher)."""
    me = this_holder()
    pid = os.getppid()
    from tessera.hetero.rundir.lock import _pid_start

    return dataclasses.replace(me, pid=pid, pid_start=_pid_start(pid), run_id="another", token="other")


def test_a_live_holder_refuses_naming_the_directory_and_the_holder(tmp_path):
    held = RunDirLock.acquire(tmp_path, _live_other())
    with pytest.raises(RunDirBusy) as e:
        RunDirLock.acquire(tmp_path)
    msg = str(e.value)
    assert f"the run directory {tmp_path} is in use by another job: pid {os.getppid()} on " in msg
    assert f"holds {tmp_path / LOCK_NAME}" in msg and "trainer.run_dir" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME], "a refusal leaves no file behind"
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "other"
    held.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_dead_holders_lock_is_taken_over_and_released(tmp_path):
    proc = subprocess.Popen(["true"])
    proc.wait()  # a pid that no longer runs
    dead = dataclasses.replace(this_holder(), pid=proc.pid, pid_start=1, run_id="another", token="dead")
    (tmp_path / LOCK_NAME).write_text(json.dumps(dataclasses.asdict(dead)))
    lock = RunDirLock.acquire(tmp_path)
    assert lock.took_over == (f"took over the run directory {tmp_path} from {dead.describe()}: its process "
                              f"({proc.pid} on {dead.host}) has ended")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.holder.token
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]
    lock.release()
    assert list(tmp_path.iterdir()) == []


def test_a_release_leaves_a_newer_holders_lock(tmp_path):
    lock = RunDirLock.acquire(tmp_path)
    (tmp_path / LOCK_NAME).write_text(json.dumps(dataclasses.asdict(_live_other())))  # taken over since
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "other"


def test_an_unreadable_lock_is_refused_with_the_fix(tmp_path):
    (tmp_path / LOCK_NAME).write_text("not json")
    with pytest.raises(RunDirBusy, match=f"delete {tmp_path / LOCK_NAME} and launch again"):
        RunDirLock.acquire(tmp_path)


def _contend(run_dir: str, start, results) -> None:
    start.wait()
    try:
        lock = RunDirLock.acquire(Path(run_dir))
        results.put("held")
        start.wait()  # hold it until every contender has tried
        lock.release()
    except RunDirBusy:
        results.put("busy")
        start.wait()


def test_processes_racing_for_one_directory_one_wins(tmp_path):
    ctx, n = multiprocessing.get_context("fork"), 6
    start, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path), start, results)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(results.get(timeout=5) for _ in range(n)) == ["busy"] * (n - 1) + ["held"]
    assert list(tmp_path.iterdir()) == []  # released, no temporary file left
