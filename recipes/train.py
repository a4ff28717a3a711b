"""The training entry point every recipe points at (`run.Partial(train, ...)`).

Runs under torchrun (one process per rank; gloo on CPU, NCCL on GPU) or as one process:

    torchrun --standalone --nproc-per-node 4 -m tessera.recipes.train --recipe nemotron_vl_tiny trainer.max_steps=5
    python -m tessera.recipes.train --recipe nemotron_vl_tiny layout="vision=dp1@0-0;language=dp1@0-0"

(`nemo tessera pretrain|finetune --factory ...` is the user-facing command; it ends up here.)
The first line a run prints is `run_dir: <path>`; torch.distributed is set up and the run directory agreed
on before anything heavy is imported, so nothing can print before it.

A launched rank (RANK in the environment: torchrun, Slurm) leaves no process behind however it ends: it
starts a small reaper first (_start_reaper), which outlives it and, once the rank is gone (normal end,
exception, SIGKILL), kills what the rank started and left running (the checkpoint writer's multiprocessing
children, ...): every process carrying the rank's token in its environment or in the rank's process group.
Under Slurm, run_dir defaults to runs/<name>-slurm<job id>, so a requeued job (time-out, preemption,
run.executor.retries) resumes from its own last checkpoint; an elastic job (trainer.elastic_min_nodes) elsewhere
to runs/<name>-elastic<torchrun's run id>, the same for every restart of its workers.

Elastic (issue 36, recipes/elastic.py launches it): torchrun's agents restart the workers when a node is lost or
joins, with the new WORLD_SIZE; each restarted rank resolves the run again for that world before joining it
(recipes/elastic.resolve_restart: the layout scaled by DP, else the planner's best trainable one, else on fewer
ranks, the step's rows kept), prints what it chose, and resumes from the last complete checkpoint. Ranks beyond
the world it trains on are spares: they join no process group and wait until rank 0 releases them at the run's
end (hetero/runtime/world.py). A world on which nothing fits exits non-zero naming the worlds that do, the
checkpoint untouched.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

# megatron-core's import-time notices (no Transformer Engine / Apex, deprecations) are the same on every rank of a
# job: rank 0 prints them, the others would only repeat them; on a CPU box they only say it has no GPU libraries,
# and so does torch's pin_memory notice of every loader (issue 33: quiet logs)
if os.environ.get("RANK", "0") != "0" or not torch.cuda.is_available():
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
if not torch.cuda.is_available():
    warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true but no accelerator")

from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig


REAPER_TOKEN = "TESSERA_REAPER_TOKEN"  # set by a rank for its descendants: "<rank pid>-<random>"
REAPER_GRACE_S = 3.0  # after the rank is gone, how long its leftovers get to exit on their own

# The reaper: stdlib only (python -I -S: no site, no venv import cost). Ignores the signals a launcher sends
# a process group (torchrun: SIGTERM; Ctrl-C: SIGINT) so it outlives the rank, polls for the rank's death
# (its parent changes), waits REAPER_GRACE_S for helpers to exit on their own, then SIGKILLs the rest: every
# process whose environment holds the token (what the rank exec'd after setting it: spawn/forkserver
# children, subprocesses) or, when the rank led its own session (torchrun workers, Slurm tasks), whose
# process group is the rank's (plain fork children, whose /proc environ is the rank's original one).
_REAPER = r"""
import os, signal, sys, time
rank, entry, group, grace = int(sys.argv[1]), sys.argv[2].encode(), sys.argv[3] == "1", float(sys.argv[4])
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
while os.getppid() == rank:
    time.sleep(0.2)

def leftovers():
    me, out = os.getpid(), []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == me:
            continue
        try:
            if group and os.getpgid(int(p)) == rank:
                out.append(int(p))
                continue
            with open(f"/proc/{p}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    out.append(int(p))
        except OSError:
            pass
    return out

end = time.monotonic() + grace
while leftovers() and time.monotonic() < end:
    time.sleep(0.1)
for pid in leftovers():
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""


def _start_reaper() -> None:
    """Once per launched rank process: the reaper above, and the token its descendants inherit."""
    if "RANK" not in os.environ or not os.path.isdir("/proc"):
        return
    if os.environ.get(REAPER_TOKEN, "").split("-")[0] == str(os.getpid()):
        return  # this process already has one (train() called twice)
    import secrets
    import subprocess

    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    os.environ[REAPER_TOKEN] = token
    leads_session = os.getsid(0) == os.getpid()
    subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, str(os.getpid()), f"{REAPER_TOKEN}={token}",
                      "1" if leads_session else "0", str(REAPER_GRACE_S)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     close_fds=True)


def _run_dir(name: str, trainer: TrainerConfig) -> tuple[Path, bool]:
    """Rank 0 chooses (the configured one, or runs/<name>-<time>); every rank gets the same path, and whether this
    launch created it."""
    choice = [None, False]
    if dist.get_rank() == 0:
        # under Slurm the job id, not the time: a requeued job (same id) resumes from its own checkpoints
        stamp = f"slurm{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else time.strftime(
            "%Y%m%d-%H%M%S")
        from tessera.recipes.elastic import run_dir_stamp

        stamp = run_dir_stamp(trainer) or stamp  # an elastic job: one directory over its restarts
        choice[0] = trainer.run_dir or str(Path("runs") / f"{name}-{stamp}")
        choice[1] = not Path(choice[0]).exists()
        Path(choice[0]).mkdir(parents=True, exist_ok=True)
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]).resolve(), choice[1]


def _hold_run_dir(run_dir: Path):
    """Rank 0 takes the run directory's lock (hetero/rundir/lock.py) and every rank learns the outcome:
    a directory another live job holds ends this job on every rank, before anything is written (EXIT_BUSY).
    Returns rank 0's lock (None elsewhere)."""
    from tessera.hetero.rundir.lock import EXIT_BUSY, RunDirBusy, RunDirLock

    lock, outcome = None, [None]
    if dist.get_rank() == 0:
        try:
            lock = RunDirLock.acquire(run_dir)
            if lock.took_over:
                print(lock.took_over, flush=True)
        except RunDirBusy as e:
            outcome[0] = str(e)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        if dist.get_rank() == 0:
            print(f"refused: {outcome[0]}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BUSY)
    return lock


def _nothing_to_do(run_dir: Path, trainer: TrainerConfig) -> int | None:
    """The step the run directory's last checkpoint holds when it is already trainer.max_steps or more (a finished
    run launched again, a requeue of a job that had just finished), else None."""
    from tessera.hetero.checkpoint.source import latest_step

    step = latest_step(run_dir / "checkpoints") if trainer.resume else None
    return step if step is not None and step >= trainer.max_steps else None


def _remove_if_unused(run_dir: Path) -> None:
    """Rank 0, after a run this launch created failed before its first step: the empty folder goes too (only
    what Tessera writes before a step: the lock is released by then, TensorBoard's empty event files)."""
    import shutil

    from tessera.hetero.training.metrics import read_metrics

    if not (run_dir / "checkpoints").exists() and not read_metrics(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)


def train(model: ModelConfig, data: DataConfig, optim: OptimConfig, trainer: TrainerConfig, layout: str = "",
          name: str = "tessera") -> dict:
    """Train `model` on `data` in `layout`; returns a summary (run_dir, first/last loss, ...)."""
    _start_reaper()
    # from here a SIGTERM / SIGUSR1 (Slurm's signal, scancel, preemption) is answered by saving the step the rank
    # is in, even when it arrives while the model loads (stdlib only: nothing heavy is imported before the first line)
    from tessera.hetero.training.preemption import StopSignals

    stop = StopSignals(trainer.save_interval_minutes)
    try:
        return _train(model, data, optim, trainer, layout, name, stop)
    finally:
        stop.close()


def _step_flops(cfg):
    """hf_fields -> the run's model FLOPs per step (hetero/planner/flops.StepFlops: the planner's count), with the
    peak of the device this rank computes on for MFU (none on CPU: FLOPs/s only)."""
    from tessera.hetero.planner.flops import StepFlops
    from tessera.hetero.runtime.device import current_device
    from tessera.hetero.runspec.modules import encoder_names

    device = current_device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # the run's encoders: a released checkpoint's own when fine-tuning one (its items are priced and balanced too)
    return lambda hf_fields: StepFlops(cfg.model, hf_fields, name, cfg.model.dtype, encoders=encoder_names(cfg.model))


def _train(model, data, optim, trainer, layout: str, name: str, stop) -> dict:
    from tessera.hetero.runtime.world import process_world
    from tessera.recipes.elastic import restart_before_joining
    from tessera.hetero.training.preemption import EXIT_STOPPED

    started = time.monotonic()
    cfg = RunConfig(name, layout, model, data, optim, trainer)
    # an elastic restart is resolved before the world is joined, since on a world that no layout of the run tiles
    # the highest ranks stay out of it and wait as spares (recipes/elastic.py)
    restart = restart_before_joining(cfg)
    # threads, megatron-core's CPU shims, the device bound, then the world (an elastic restart's lowest ranks)
    with process_world(trainer.timeout_s, restart.world if restart else None):
        rank = dist.get_rank()
        run_dir, created = _run_dir(name, trainer)
        if rank == 0:
            print(f"run_dir: {run_dir}", flush=True)
        lock = _hold_run_dir(run_dir)  # one job per run directory: a second one ends here, having written nothing
        try:
            summary = _train_held(cfg, restart, run_dir, stop)
        except BaseException:
            if lock is not None:
                lock.release()
                if created:
                    _remove_if_unused(run_dir)
            raise
        if lock is not None:
            lock.release()
        if summary.get("nothing_to_do"):
            return summary
    if summary.get("stopped_by"):
        if rank == 0:
            print(f"stopped by {summary['stopped_by']} after step {summary['steps']}: checkpoint step "
                  f"{summary['steps']} saved in {run_dir / 'checkpoints'}; the same command (or Slurm's requeue) "
                  f"resumes from it", flush=True)
        raise SystemExit(EXIT_STOPPED)  # not finished: non-zero, so Slurm requeues and `nemo` reports it
    if rank == 0:
        from tessera.hetero.rundir.summary import run_summary

        print(f"done: steps={summary['steps']} first_loss={summary['first_loss']:.4f} "
              f"last_loss={summary['last_loss']:.4f} layout={summary['layout']}", flush=True)
        print("\n".join(run_summary(summary, run_dir, trainer.export_hf, time.monotonic() - started)), flush=True)
    return summary


def _blend_in_run_dir(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """data.path="a=DIR;b=DIR:0.3" (several prepared datasets, data/blend.py): rank 0 writes the energon blend as
    run_dir/blend.yaml, and every rank trains from it (it stays next to the run's checkpoints)."""
    from dataclasses import replace

    from tessera.data.blend import is_blend_spec, write_blend

    if not is_blend_spec(cfg.data.path):
        return cfg
    if dist.get_rank() == 0:
        path = write_blend(cfg.data.path, run_dir)
        print(f"data: the blend {cfg.data.path} is {path}", flush=True)
    dist.barrier()
    return replace(cfg, data=replace(cfg.data, path=str(run_dir / "blend.yaml")))


def _train_held(cfg: RunConfig, restart, run_dir: Path, stop) -> dict:
    """The run, once this job holds run_dir: resolved on this world, then trained (or nothing, when run_dir's
    checkpoint is already at trainer.max_steps)."""
    from tessera.hetero.runtime.world import release_spares
    from tessera.hetero.training.preemption import EXIT_STOPPED
    from tessera.recipes.elastic import resolve_on_world

    rank = dist.get_rank()
    # the run resolved once on this world (every rank alike: pure and deterministic; layout=auto asks the planner)
    resolved = resolve_on_world(cfg, restart)
    done = _nothing_to_do(run_dir, cfg.trainer)
    if done is not None:
        if rank == 0:
            print(f"nothing to do: {run_dir} holds checkpoint step {done} and trainer.max_steps={cfg.trainer.max_steps}"
                  f"; to train further, raise trainer.max_steps (the run resumes from step {done}); for a new run, "
                  f"give it another trainer.run_dir", flush=True)
            release_spares(resolved.spares, 0)
        return {"run_dir": str(run_dir), "steps": done, "nothing_to_do": True}
    cfg = _blend_in_run_dir(cfg, run_dir)
    if rank == 0:
        from tessera.recipes.prelaunch import full_size_warnings

        for line in full_size_warnings(cfg.model, cfg.data):
            print(line, file=sys.stderr, flush=True)
    from tessera.hetero.training.loop import run_training

    summary = run_training(cfg, resolved, run_dir, stop, step_flops=_step_flops(cfg))
    if rank == 0:
        release_spares(resolved.spares, EXIT_STOPPED if summary.get("stopped_by") else 0)
    return summary


def main(argv: list[str]) -> int:
    """`--recipe NAME key=value ...`: a registered recipe with dotted overrides (no nemo-run needed)."""
    from tessera.recipes.registry import build_recipe_kwargs

    if len(argv) < 2 or argv[0] != "--recipe":
        print(__doc__, file=sys.stderr)
        return 2
    train(**build_recipe_kwargs(argv[1], argv[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
