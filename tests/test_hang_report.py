"""A hang names the rank (hetero/runtime/progress.py): the rule that picks the stalled ranks from every rank's last
published position, the line a user reads, which errors count as a collective failure, and two real gloo ranks of
which one is stopped with SIGSTOP while the other's collective times out. The whole job under torchrun (the
report in its log, nothing left running, a bitwise resume) is tests/test_train_fault.py's."""

from __future__ import annotations

import os
import signal
import socket
import time
from datetime import timedelta

import pytest

from tessera.hetero.runtime.progress import Stall, describe_stall, is_collective_failure, stalled_ranks

NOW = 1000.0


def _rec(step=3, phase="forward", module="language", since=990.0, beat=999.5, pid=11):
    return {"step": step, "phase": phase, "module": module, "since": since, "beat": beat, "host": "n1", "pid": pid}


@pytest.mark.parametrize("records, named, why", [
    # one rank stopped beating (SIGSTOP, killed): it, whatever its position
    ({0: _rec(), 1: _rec(beat=950.0), 2: _rec()}, [1], "stopped answering"),
    ({0: _rec(), 1: _rec(step=9, beat=950.0)}, [1], "stopped answering"),
    # a rank that never published (died at once)
    ({0: _rec(), 1: None}, [1], "stopped answering"),
    # all beating: the rank(s) behind, by step ...
    ({0: _rec(step=4), 1: _rec(step=3), 2: _rec(step=4)}, [1], "behind"),
    # ... then by phase within the step (data before compute before the optimizer before a save)
    ({0: _rec(phase="optimizer"), 1: _rec(phase="data"), 2: _rec(phase="data")}, [1, 2], "behind"),
    ({0: _rec(phase="save"), 1: _rec(phase="backward")}, [1], "behind"),
    # compute phases interleave op by op (1F1B): no order between them, nobody stands out
    ({0: _rec(phase="forward"), 1: _rec(phase="backward"), 2: _rec(phase="boundary")}, [], ""),
    # nobody beats (the store is stale): nothing to tell
    ({0: _rec(beat=900.0), 1: _rec(beat=900.0)}, [], ""),
])
def test_the_stalled_ranks_are_the_silent_ones_else_the_ones_behind(records, named, why):
    stalls = stalled_ranks(records, NOW, stale_s=10.0)
    assert [s.rank for s in stalls] == named
    assert all(s.why == why for s in stalls)


def test_the_line_names_rank_modules_position_host_and_pid():
    rec = _rec(step=3, phase="boundary", module="vision", beat=958.0, pid=4242)
    assert describe_stall(Stall(2, "stopped answering", rec), NOW, "vision tp0 cp0 dp1 pp0") == (
        "rank 2 (vision tp0 cp0 dp1 pp0) stopped answering 42 s ago, in step 4, boundary of vision: host n1, pid 4242")
    rec = _rec(step=0, phase="data", module=None, since=900.0)
    assert describe_stall(Stall(1, "behind", rec), NOW, "language tp1 cp0 dp0 pp0") == (
        "rank 1 (language tp1 cp0 dp0 pp0) has been in step 1, data for 100 s while its peers went further: "
        "host n1, pid 11")
    assert describe_stall(Stall(0, "stopped answering", _rec(phase="build")), NOW, "x") == (
        "rank 0 (x) stopped answering 0 s ago, in the build: host n1, pid 11")


def test_which_errors_are_collective_failures():
    import torch.distributed as dist

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                        "20000ms for recv operation to complete")
    assert is_collective_failure(gloo)
    assert is_collective_failure(dist.DistBackendError("NCCL watchdog timeout"))
    wrapped = RuntimeError("saving checkpoint step 4 failed")  # hetero/checkpoint/sharded.SaveFailed's shape
    wrapped.__cause__ = gloo
    assert is_collective_failure(wrapped)
    assert not is_collective_failure(ValueError("a bad sample"))
    assert not is_collective_failure(RuntimeError("shape mismatch"))
    assert not is_collective_failure(None)


def _rank_1_stops(timeout_s: float):
    """Rank 1 publishes its position, then stops (SIGSTOP); rank 0's collective times out and reports, then lets
    rank 1 go on (SIGCONT) so the test ends."""
    import torch
    import torch.distributed as dist

    from tessera.hetero.runtime.progress import ProgressBeacon, mark

    rank = dist.get_rank()
    short = dist.new_group(timeout=timedelta(seconds=timeout_s))
    beacon = ProgressBeacon(rank, 2, timeout_s, lambda r: f"vision dp{r}")
    try:
        mark("forward", "vision", step=4)
        if rank == 1:
            time.sleep(3 * beacon.beat_s)  # published
            os.kill(os.getpid(), signal.SIGSTOP)
            return None
        try:
            dist.all_reduce(torch.ones(1), group=short)
            return ["the collective did not fail"]
        except RuntimeError as e:
            lines = beacon.report(e, "run/checkpoints/step_000004")
        os.kill(beacon.records()[1]["pid"], signal.SIGCONT)
        return lines
    finally:
        beacon.close()


@pytest.mark.multiproc
def test_a_stopped_rank_is_named_by_its_peer():
    from tessera.hetero.tools.spawn import run_on_ranks

    lines, _ = run_on_ranks(2, _rank_1_stops, 8.0)
    text = "\n".join(lines)
    assert lines[0] == "hang: rank 0's collective waited 8 s (trainer.timeout_s) for:", text
    assert lines[1].startswith("hang:   rank 1 (vision dp1) stopped answering "), text
    head, _, pid = lines[1].rpartition(", pid ")
    assert head.endswith(f"in step 5, forward of vision: host {socket.gethostname()}") and pid.isdigit(), text
    assert lines[2] == ("hang: the job ends; a re-run (the same command, or Slurm's requeue) resumes from "
                        "run/checkpoints/step_000004"), text
    assert lines[3].startswith("hang: this rank's error: RuntimeError: ") and "Timed out" in lines[3], text
