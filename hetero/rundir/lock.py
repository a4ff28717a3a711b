"""One job per run directory: the first job holds it; a second refuses before it writes anything.

    lock = RunDirLock.acquire(run_dir)   # rank 0, before anything is written there; RunDirBusy when a live job
    ...                                  # holds it; a lock whose holder is gone is taken over (lock.took_over says)
    lock.release()                       # at the end, however the run ended (a SIGKILL leaves it: taken over later)

Why: the same command launched twice on one `trainer.run_dir` (a double submit, a manual restart racing a
requeue) made two jobs resume from the same checkpoint and write each other's partial checkpoint files; each
failed on the other's `.partial` files and metrics.jsonl held steps twice.

The lock is a file, `tessera.lock`, created with os.link from a complete temporary file (atomic on local and
network file systems, where O_EXCL is not always), holding JSON that names its holder: host, boot, pid and the
pid's start time (a pid reused after the holder died is not the holder), launcher, Slurm job id and restart count,
torchrun's run id and restart count. A holder is gone (holder_gone, a pure rule) when it is this process; an
earlier allocation or restart of this very job (a Slurm requeue keeps the job id, torchrun's restarts keep the run
id: neither runs two at once); on this host, its process no longer runs; or its Slurm job is no longer in the
queue. Otherwise it is alive, or cannot be told (another host, no Slurm): the job refuses and names the file to
delete if the user knows that job is gone.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

LOCK_NAME = "tessera.lock"
EXIT_BUSY = 75  # EX_TEMPFAIL (sysexits.h): the run directory is busy; the same command works once it is free


class RunDirBusy(RuntimeError):
    """Another live job holds the run directory."""


@dataclass(frozen=True)
class Holder:
    host: str
    boot_id: str               # the kernel's boot id: the same host after a reboot is another machine's pids
    pid: int
    pid_start: int             # the process's start time in clock ticks since boot (/proc/PID/stat field 22)
    launcher: str              # "slurm", "torchrun" or "python"
    slurm_job_id: str
    slurm_restart: str         # SLURM_RESTART_COUNT: which allocation of a requeued job
    run_id: str                # torchrun's run id (rendezvous id): the same over its elastic restarts
    elastic_restart: str       # TORCHELASTIC_RESTART_COUNT
    token: str                 # this acquisition: a lock read back is known to be ours
    started: str

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"pid {self.pid} on {self.host} ({self.launcher}{job}, since {self.started})"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_start(pid: int) -> int | None:
    """A process's start time in clock ticks since boot, or None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22 of stat; fields 3.. follow the command's ")"


def this_holder() -> Holder:
    env = os.environ
    launcher = "slurm" if env.get("SLURM_JOB_ID") else "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "python"
    return Holder(socket.gethostname(), _boot_id(), os.getpid(), _pid_start(os.getpid()) or 0, launcher,
                  env.get("SLURM_JOB_ID", ""), env.get("SLURM_RESTART_COUNT", "0"),
                  env.get("TORCHELASTIC_RUN_ID", ""), env.get("TORCHELASTIC_RESTART_COUNT", "0"),
                  secrets.token_hex(8), time.strftime("%Y-%m-%d %H:%M:%S"))


# the states after which slurmctld will not run the job again (a requeued one reads PENDING or REQUEUED)
_SLURM_FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "PREEMPTED")


def slurm_job_queued(job_id: str) -> bool | None:
    """True while slurmctld may still run the job, False once it has ended (or has forgotten it), None when there
    is no Slurm to ask or it did not answer. slurmctld itself (`scontrol show job`), not squeue, whose empty answer
    also means "too busy to answer" (recipes/executors.slurm_controller_state reads it the same way)."""
    try:
        res = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode:
        return False if "Invalid job id" in res.stdout + res.stderr else None
    state = re.search(r"\bJobState=(\S+)", res.stdout)
    return None if state is None else state.group(1) not in _SLURM_FINAL


def holder_gone(holder: Holder, me: Holder, pid_start=_pid_start, slurm_queued=slurm_job_queued) -> str | None:
    """Why `holder` no longer holds the run directory (a line for the log), or None when it may still run.
    pid_start(pid) and slurm_queued(job id) ask the machine and Slurm (injected: the rule is tested alone)."""
    same_boot = holder.host == me.host and holder.boot_id == me.boot_id
    if same_boot and (holder.pid, holder.pid_start) == (me.pid, me.pid_start):
        return "it was this process's own earlier run"
    if holder.slurm_job_id and holder.slurm_job_id == me.slurm_job_id and (
            (holder.slurm_restart, holder.elastic_restart) != (me.slurm_restart, me.elastic_restart)):
        return (f"it was an earlier run of this Slurm job {me.slurm_job_id} (restart {holder.slurm_restart}, "
                f"torchrun restart {holder.elastic_restart})")
    if (not holder.slurm_job_id and holder.run_id and holder.run_id == me.run_id
            and holder.elastic_restart != me.elastic_restart):
        return f"it was torchrun restart {holder.elastic_restart} of this job (run id {me.run_id})"
    if same_boot and pid_start(holder.pid) != holder.pid_start:
        return f"its process ({holder.pid} on {holder.host}) has ended"
    if holder.slurm_job_id and slurm_queued(holder.slurm_job_id) is False:
        return f"its Slurm job {holder.slurm_job_id} has ended"
    return None


def _read(path: Path) -> Holder | None:
    try:
        return Holder(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:  # not ours, or written by another version: refuse rather than guess
        raise RunDirBusy(f"{path} exists but is not a lock this version can read ({e}); if no job runs in "
                         f"{path.parent}, delete {path} and launch again") from e


class RunDirLock:
    def __init__(self, path: Path, holder: Holder, took_over: str | None):
        self.path, self.holder, self.took_over = path, holder, took_over

    @classmethod
    def acquire(cls, run_dir: Path, me: Holder | None = None, attempts: int = 5) -> "RunDirLock":
        """Hold run_dir, or raise RunDirBusy naming the directory and the holder."""
        me = me or this_holder()
        path = Path(run_dir) / LOCK_NAME
        tmp = path.with_name(f"{LOCK_NAME}.{me.token}")
        tmp.write_text(json.dumps(asdict(me), indent=1) + "\n")
        took_over = None
        try:
            for _ in range(attempts):
                try:
                    os.link(tmp, path)  # fails when the file exists: the one atomic test-and-create everywhere
                    return cls(path, me, took_over)
                except FileExistsError:
                    pass
                holder = _read(path)
                if holder is None:
                    continue  # released between the two calls: try again
                why = holder_gone(holder, me)
                if why is None:
                    raise RunDirBusy(
                        f"the run directory {run_dir} is in use by another job: {holder.describe()} holds {path}. "
                        f"Wait for it to end, or give this job its own trainer.run_dir; if you know that job is "
                        f"gone (it ran on another machine), delete {path} and launch again")
                # set the stale lock aside under a name of our own, and check it is the one read (a racing job may
                # have taken over in between: then its fresh lock goes back and the next attempt refuses)
                aside = path.with_name(f"{LOCK_NAME}.stale-{me.token}")
                try:
                    os.rename(path, aside)
                except FileNotFoundError:
                    continue
                moved = _read(aside)
                if moved is not None and moved.token != holder.token:
                    try:
                        os.link(aside, path)
                    except FileExistsError:
                        pass
                    aside.unlink(missing_ok=True)
                    continue
                aside.unlink(missing_ok=True)
                took_over = f"took over the run directory {run_dir} from {holder.describe()}: {why}"
            raise RunDirBusy(f"could not take the run directory {run_dir} ({path}) in {attempts} attempts: other "
                             f"jobs keep taking it")
        finally:
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock if it is still ours (a job that took it over after us keeps its own)."""
        try:
            holder = _read(self.path)
        except RunDirBusy:
            return
        if holder is not None and holder.token == self.holder.token:
            self.path.unlink(missing_ok=True)
