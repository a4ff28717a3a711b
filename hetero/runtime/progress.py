"""Where every rank is, readable by its peers without a collective: a hung or dead rank is named, not guessed.

    mark("data", step=5)                      # the main thread at each phase change: two attribute writes
    mark("forward", "vision")                 # (hetero/training/loop.py, hetero/runtime/step_executor.py)
    with ProgressBeacon(rank, timeout_s, describe) as beacon:   # a thread publishes this rank's record
        ...
        lines = beacon.report(error)          # after a collective failed: which rank(s) stopped advancing

Why a beacon and not a collective: when a rank stops (SIGSTOP, a filesystem read that never returns, a deadlocked
worker, a killed process) every other rank only learns that *its* collective timed out ("Timed out waiting 60000ms
for recv operation"); at 1,000 GPUs the user needs the one rank that stopped (to drain its node). Each rank's
thread writes {step, phase, module, since, beat, host, pid} to the launcher's key-value store (the one the default
process group was built on: torchrun's agent, or the test launcher's file) every `beat_s`, through its own client
(Store.clone), so a main thread blocked in the store never delays a beat. A rank whose process stopped stops
beating; a rank whose main thread is stuck keeps beating but stays behind its peers. stalled_ranks is the rule,
pure, tested over many records in tests/test_hang_report.py.

Cost: mark() is two attribute writes (a few hundred per step: one per schedule op), plus one store write when
a step begins; the thread does one store write per beat (timeout_s / 20, at least 0.5 s, at most 30 s).
scripts/bench_progress.py measures them against a step.

On a GPU, NCCL's watchdog aborts the process when a collective times out, before Python sees an error, so there the
beacon itself prints the report once this rank has not advanced for 0.9 x timeout_s (on gloo the error path does).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

# a phase's place within a step: a rank in a lower one than its peers at the same step is behind them; the compute
# phases interleave op by op (pipelines, 1F1B), so they share one place
PHASE_ORDER = {"build": 0, "data": 1, "forward": 2, "boundary": 2, "pipeline": 2, "backward": 2, "optimizer": 3,
               "validation": 4, "save": 5, "export": 6, "done": 7}
_KEY = "tessera/progress/{restart}/{rank}"


class _Position:
    """This rank's position, written by the main thread (mark) and read by the beacon thread: a tuple swapped
    in one assignment, so a reader never sees half of an update."""

    def __init__(self):
        self.now = (0, "build", None, time.time())  # step, phase, module, wall time it was entered
        self.on_step = None  # the beacon's publish: a new step is published at once, not at the next beat


_POSITION = _Position()


def mark(phase: str, module: str | None = None, step: int | None = None) -> None:
    """This rank entered `phase` (of `module`, at `step`; the step stays what it was when None). A new step is
    published before this returns (one store write per step), so a rank that stops between two beats is reported
    at the step it stopped in, not the one before."""
    old = _POSITION.now
    if old[1] != phase or old[2] != module or (step is not None and step != old[0]):
        _POSITION.now = (old[0] if step is None else step, phase, module, time.time())
        if step is not None and step != old[0] and _POSITION.on_step is not None:
            _POSITION.on_step()


def position() -> tuple:
    return _POSITION.now


@dataclass(frozen=True)
class Stall:
    rank: int
    why: str               # "stopped answering" or "behind"
    record: dict | None    # its last published record (None: it never published one)


def stalled_ranks(records: dict[int, dict | None], now: float, stale_s: float) -> list[Stall]:
    """The ranks that stopped advancing, from every rank's last record (None where a rank never published):
    first the silent ones (no record, or no beat for stale_s: the process is stopped, dead, or holds the
    interpreter), else, when all are beating, the ones behind the rest (the lowest step, then the lowest phase
    of PHASE_ORDER) while some peer is further; [] when no rank stands out (all in the same place)."""
    silent = [Stall(r, "stopped answering", rec) for r, rec in sorted(records.items())
              if rec is None or now - rec["beat"] > stale_s]
    if silent and len(silent) < len(records):
        return silent
    if silent:  # nobody beats: the store itself is stale (the caller is alive), nothing to tell
        return []

    def place(rec):
        return rec["step"], PHASE_ORDER.get(rec["phase"], 2)

    lowest = min(place(rec) for rec in records.values())
    if all(place(rec) == lowest for rec in records.values()):
        return []
    return [Stall(r, "behind", rec) for r, rec in sorted(records.items()) if place(rec) == lowest]


def describe_stall(stall: Stall, now: float, modules: str) -> str:
    """One line a user can act on: the rank, what it hosts, where it was, its host and pid."""
    rec = stall.record
    if rec is None:
        return f"rank {stall.rank} ({modules}) never reported its progress: it did not start or died at once"
    where = ("the build" if rec["phase"] == "build" else f"step {rec['step'] + 1}, {rec['phase']}"
             + (f" of {rec['module']}" if rec.get("module") else ""))
    if stall.why == "stopped answering":
        what = f"stopped answering {now - rec['beat']:.0f} s ago, in {where}"
    else:
        what = f"has been in {where} for {now - rec['since']:.0f} s while its peers went further"
    return f"rank {stall.rank} ({modules}) {what}: host {rec['host']}, pid {rec['pid']}"


def is_collective_failure(error: BaseException | None) -> bool:
    """A collective (or a save's collective) that timed out or lost its peer, anywhere in the error's chain: NCCL
    raises torch.distributed.DistError; gloo a RuntimeError from its transport (`...gloo/transport/tcp/...: Timed
    out waiting 60000ms for recv operation`, `Connection closed by peer`)."""
    import torch.distributed as dist

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and (
                "gloo" in text or "Timed out waiting" in text or "Connection closed by peer" in text)):
            return True
        error = error.__cause__ or error.__context__
    return False


class ProgressBeacon:
    """The thread that publishes this rank's position; report() reads every rank's and names the stalled ones.
    describe(rank) -> what the rank hosts (the layout's modules and coordinates: the caller knows the layout)."""

    def __init__(self, rank: int, world: int, timeout_s: float, describe=lambda rank: "", watch: bool = False):
        import torch.distributed as dist

        self.rank, self.world, self.describe = rank, world, describe
        self.beat_s = min(max(timeout_s / 20, 0.5), 30.0)
        # a live rank beats every beat_s; one silent for half the collective timeout is not running (its peers'
        # collectives wait the whole timeout for it before they fail)
        self.stale_s = max(timeout_s / 2, 3 * self.beat_s)
        self.timeout_s, self.watch, self.warned = timeout_s, watch, False
        self.restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restart's ranks never read a stale round
        self.store = dist.distributed_c10d._get_default_store().clone()  # the default group's store, own client
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self._publish()
        _POSITION.on_step = self._publish_now
        self._thread = threading.Thread(target=self._run, name="tessera-progress", daemon=True)
        self._thread.start()

    def _key(self, rank: int) -> str:
        return _KEY.format(restart=self.restart, rank=rank)

    def _publish(self) -> None:
        step, phase, module, since = _POSITION.now
        self.store.set(self._key(self.rank), json.dumps(
            {"step": step, "phase": phase, "module": module, "since": since, "beat": time.time(),
             "host": self.host, "pid": self.pid}))

    def _publish_now(self) -> None:
        try:
            self._publish()
        except Exception:  # the store is gone: the job is ending; the collectives say so
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._publish()
            except Exception:  # the store is gone: the job is ending; the collectives say so
                return
            step, phase, module, since = _POSITION.now
            # (not while building: loading a large checkpoint may take longer than a collective waits)
            if self.watch and not self.warned and phase != "build" and time.time() - since > 0.9 * self.timeout_s:
                self.warned = True  # NCCL's watchdog will abort this process at the timeout: report now
                lines = self.report(None, force=True)
                if lines:
                    print("\n".join(lines), file=sys.stderr, flush=True)

    def records(self) -> dict[int, dict | None]:
        """Every rank's last record (None where there is none), read without waiting for missing keys."""
        out = {}
        for r in range(self.world):
            key = self._key(r)
            out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return out

    def report(self, error: BaseException | None, resume_from: str = "", force: bool = False) -> list[str]:
        """After `error`: the lines naming the stalled ranks, or [] when the error is not a collective failure
        or no rank stands out (the caller re-raises the error as it was)."""
        if not force and not is_collective_failure(error):
            return []
        try:
            records, now = self.records(), time.time()
        except Exception:  # the launcher's store went with a rank: nothing to read
            return []
        stalls = stalled_ranks(records, now, self.stale_s)
        if not stalls:
            return []
        lines = [f"hang: rank {self.rank}'s collective waited {self.timeout_s:.0f} s (trainer.timeout_s) for:"]
        lines += ["hang:   " + describe_stall(s, now, self.describe(s.rank)) for s in stalls]
        if resume_from:
            lines.append(f"hang: the job ends; a re-run (the same command, or Slurm's requeue) resumes from "
                         f"{resume_from}")
        if error is not None:
            lines.append(f"hang: this rank's error: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
        return lines

    def close(self) -> None:
        _POSITION.on_step = None
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
