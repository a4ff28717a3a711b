"""Stop cleanly on a signal: finish the step, agree, save that step, exit non-zero so the job is requeued.

    stop = StopSignals()                       # SIGTERM and SIGUSR1 from now on set a flag instead of killing
    flags = stop.local_flags(last_save_time)   # [signal received here, wall-time save due] -> the step's all-reduce
    ...                                        # every rank sees the summed flags: all stop (and save) at one step
    stop.close()                               # the previous handlers back

Who sends what (measured on torch 2.13 / Slurm 22.05 / nemo-run 0.11.1):
- Slurm's `--signal=TERM@S` (run.executor.signal, default TERM@300) signals every process of the job's steps S
  seconds before the time limit; `scancel` sends SIGTERM the same way; preemption too (with GraceTime).
- torchrun forwards SIGTERM (and SIGUSR1 when `PET_SIGNALS_TO_HANDLE` lists it) to its workers, then SIGKILLs
  them after `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds (default 30, about one full-recipe step):
  recipes/executors.py sets both, so the grace covers a step plus a save (recipes/prelaunch.py checks it).
- The checkpoint writer's forked helpers inherit this handler: a signal during a save only sets their copy of
  the flag, and the save completes. Its results queue's Manager server (spawned on a GPU, forked on a CPU rank)
  ignores the signals instead (shield_checkpoint_queue): torchrun signals each rank's whole process group.

Megatron's `--exit-signal-handler` does the same (a flag, one all-reduce per step); here the flag rides on the
step's existing all-reduce (hetero/training/loop.py), so the agreement costs nothing extra. A second signal
while stopping is acknowledged and changes nothing: the save in progress completes; only a SIGKILL (the
launcher's timeout) can interrupt it, and then the last complete checkpoint stays the one `latest` names.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# exit status of a run that stopped on a signal after saving: 128 + SIGTERM, as a process killed by it would
# report; non-zero so nemo-run's sbatch script requeues the job (and a local run says it did not finish)
EXIT_STOPPED = 128 + signal.SIGTERM


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "a signal another rank received"


class StopSignals:
    def __init__(self, save_interval_minutes: float = 0.0):
        """save_interval_minutes > 0: also ask for a save when that much wall time passed since the last one."""
        self.received: int | None = None
        self.count = 0
        self.interval_s = 60.0 * save_interval_minutes
        # (handlers can only be set from the main thread; elsewhere the signals keep their default action)
        main = threading.current_thread() is threading.main_thread()
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS} if main else {}

    def _handle(self, signum, frame) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = signum
            print(f"received {name}: finishing this step, saving it, then exiting", file=sys.stderr, flush=True)
        else:
            print(f"received {name} again (x{self.count}): already stopping, the save in progress completes",
                  file=sys.stderr, flush=True)

    def local_flags(self, last_save: float) -> list[float]:
        """[a stop signal reached this rank, this rank's clock says a wall-time save is due]."""
        due = self.interval_s > 0 and time.monotonic() - last_save >= self.interval_s
        return [float(self.received is not None), float(due)]

    def close(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


_MANAGERS: list = []  # the results queues' Manager processes, alive as long as the rank


def checkpoint_queue_start_method(device) -> str:
    """How a rank computing on `device` (a torch.device) starts its checkpoint results queue's Manager server.
    "spawn" on a GPU, as megatron does: a forked child's garbage collector could free the parent's CUDA tensors
    (megatron's note on its forked writers). "fork" on a CPU rank, which has none: a spawned server is a fresh
    interpreter that imports the rank's main module (torch, megatron, the trainer) to start, ~4 s of CPU per rank
    and launch (measured: 3.9-5.1 CPU-s a rank under torchrun / nemo-run), a fork ~0.05 s."""
    return "spawn" if device.type == "cuda" else "fork"


def shield_checkpoint_queue(method: str = "spawn") -> None:
    """megatron's checkpoint writer hands write results back through a multiprocessing Manager queue it creates at
    a process's first save (dist_checkpointing's filesystem_async._get_write_results_queue, "spawn"). torchrun's
    agent stops and restarts its workers (a forwarded signal, an elastic restart) with SIGTERM to each rank's whole
    process group, and Slurm's --signal reaches every process of the job: the Manager's server died of it, and the
    save the signal asks for failed (EOFError; tests/test_elastic.py's grow). Here the same queue comes from a
    Manager whose server has the stop signals blocked from its fork on and for life (it ends with the rank: its
    finalizer, or the rank's reaper): a handler installed by the server would come too late, as a spawned server
    spends seconds importing first, and a save that starts as the signal arrives spawned it into the signal
    (measured). The rank still gets the signal: only its forking thread blocks it, and only while forking.
    method: checkpoint_queue_start_method's ("spawn" as megatron on a GPU, "fork" on a CPU rank: the server then
    imports nothing). The first call in a process decides; later ones keep it."""
    from multiprocessing import get_context, resource_tracker
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if not (hasattr(fa, "_get_write_results_queue") and hasattr(fa, "_results_queue")):  # megatron-core 0.16's names
        return
    if getattr(fa._get_write_results_queue, "shielded", False):
        return

    def results_queue():
        if fa._results_queue is None:
            manager = SyncManager(ctx=get_context(method))
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # children inherit the mask
            try:
                if method != "fork":  # spawn's resource tracker (it ignores SIGTERM, SIGUSR1 stays blocked) started
                    resource_tracker.ensure_running()  # here: it unblocks SIGTERM on its way out
                signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # for the server, after the tracker
                manager.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            _MANAGERS.append(manager)
            fa._results_queue = manager.Queue()
        return fa._results_queue

    results_queue.shielded = True
    fa._get_write_results_queue = results_queue
