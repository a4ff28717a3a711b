"""Slurm's time limit and --signal as numbers: what the ranks receive, when, and how long the launcher waits.

    slurm_signal("TERM@300") == ("TERM", 300); slurm_time_s("04:00:00") == 14400; shutdown_grace_s("TERM@300") == 270

Plain data (no nemo-run, no torch): recipes/executors.py sets torchrun's grace from it, recipes/prelaunch.py
checks a job's save schedule against it.
"""

from __future__ import annotations

from tessera.hetero.training.preemption import STOP_SIGNALS as RANK_SIGNALS  # stdlib only

# On SIGTERM (or SIGUSR1) the ranks finish their step, save it and exit (hetero/training/preemption.py). torchrun
# forwards the signal and SIGKILLs its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (30 by default:
# about one full-recipe step, no time for a save), and dies on a SIGUSR1 it was not told to handle. So every
# job gets the grace below (Slurm: the signal's lead time minus SLURM_MARGIN_S, in which torchrun exits and the
# batch script requeues the job before the limit) and torchrun forwards SIGUSR1 too.
SLURM_MARGIN_S = 30
STOP_SIGNALS = tuple(s.name.removeprefix("SIG") for s in RANK_SIGNALS)  # what the ranks save on: TERM, USR1


def slurm_signal(spec: str | None) -> tuple[str | None, int | None]:
    """(signal name, seconds before the limit) that the job's ranks receive from `--signal=spec`
    ([{R|B}:]SIG[@SECONDS], SECONDS 60 when left out); (None, None) when only the batch shell gets it (B:)
    or there is none."""
    if not spec:
        return None, None
    flags, _, rest = spec.rpartition(":")
    if "B" in flags.upper():
        return None, None
    sig, _, secs = rest.partition("@")
    sig = sig.upper().removeprefix("SIG")
    names = {"15": "TERM", "10": "USR1"}
    return names.get(sig, sig), int(secs) if secs else 60


def slurm_time_s(limit: str) -> int:
    """Seconds of a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    days, _, rest = limit.rpartition("-") if "-" in limit else ("0", "", limit)
    parts = [int(p) for p in rest.split(":")]
    if "-" in limit:  # D-HH[:MM[:SS]]
        h, m, sec = (parts + [0, 0])[:3]
    else:  # MM | MM:SS | HH:MM:SS
        h, m, sec = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return ((int(days) * 24 + h) * 60 + m) * 60 + sec


def shutdown_grace_s(signal_spec: str | None) -> int:
    """torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT for a Slurm job: the ranks' time between the signal and the
    limit, less the margin the launcher and the requeue need."""
    _, lead = slurm_signal(signal_spec)
    return max(30, (lead or 0) - SLURM_MARGIN_S)
