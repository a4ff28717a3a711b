"""The training loop: the rank's run (hetero/build/run_state.build_run) -> loader -> steps -> checkpoints and
metrics.

Called by recipes/train.py once torch.distributed is up and the run directory is known (every rank).
Reads top to bottom in the order a step happens; the pieces live next to it in hetero/training/.

Fault behaviour: every collective has the process group's timeout (trainer.timeout_s); when a rank dies or
stops, its peers fail at their next collective (gloo: connection closed or timed out; NCCL: timeout), print which
rank stopped advancing, where, on which host (hetero/runtime/progress.py: each rank's position, published to the
launcher's store) and the checkpoint a re-run resumes from, and exit non-zero; torchrun tears the job down. A
relaunch (or torchrun --max-restarts) resumes from the `latest` checkpoint.
`TESSERA_FAIL_AT_STEP=N[:RANK[:stop]]` makes a rank exit abruptly at step N, or stop (SIGSTOP) there (what the fault
tests use).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from tessera.data.loader import close_loader
from tessera.data.pipeline import synthetic_kinds
from tessera.hetero.plan.resolved_run import ResolvedRun
from tessera.hetero.runspec.modules import encoder_names
from tessera.hetero.runtime.device import current_device
from tessera.hetero.runtime.groups import destroy_module_groups
from tessera.hetero.runtime.progress import ProgressBeacon, mark
from tessera.hetero.runtime.step_executor import hetero_step
from tessera.hetero.runtime.world import freeze_live_objects
from tessera.hetero.checkpoint.sharded import KeepPolicy, finish_async_saves, latest_checkpoint, save_checkpoint
from tessera.hetero.checkpoint.loader_state import encode_loader_state
from tessera.hetero.training.metrics import RunMetrics, peak_memory_gib
from tessera.hetero.training.preemption import (StopSignals, checkpoint_queue_start_method, shield_checkpoint_queue,
                                                signal_name)
from tessera.hetero.build.run_state import RunState, build_run
from tessera.hetero.training.step_parts import StepContext, boundary_batches, rank_stages, run_loader, step_context
from tessera.hetero.training.tracking import make_tracker
from tessera.hetero.training.validation import describe_val_sets, resolve_val_sets, validate


def _export_hf(ckpt_root: Path, out: str) -> None:
    """Rank 0, after the final checkpoint: hetero/export/hf.py in its own one-rank process (what it wrote is
    in the run's summary: hetero/rundir/summary.py)."""
    cmd = [sys.executable, "-m", "tessera.hetero.export.hf", str(ckpt_root), out]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"HF export failed ({' '.join(cmd)}):\n{res.stderr[-3000:]}")


def _maybe_fail(step: int, rank: int) -> None:
    spec = os.environ.get("TESSERA_FAIL_AT_STEP")
    if spec:
        at, who, how = (spec.split(":") + ["", ""])[:3]
        if step == int(at) and rank == int(who or 0):
            if how == "stop":  # a rank that stops answering: a stuck read, a deadlock (the hang test)
                print(f"TESSERA_FAIL_AT_STEP={spec}: rank {rank} (pid {os.getpid()}) stops (SIGSTOP) at step {step}",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            print(f"TESSERA_FAIL_AT_STEP={spec}: rank {rank} exits with 17 at step {step}", file=sys.stderr, flush=True)
            os._exit(17)  # an abrupt death: no cleanup, no collective goodbye


def _train_step(run: RunState, step: int, it, ctx: StepContext, flags=lambda: [0.0, 0.0]) -> tuple[dict, list[bool]]:
    """One optimizer step over the run's microbatches (ResolvedRun.microbatches); returns the metrics record
    (every rank) and `flags()` (this rank's stop requests, read just before the step's one all-reduce, which
    carries them: hetero/training/preemption.py) as the world agreed on them."""
    cfg, layout, groups, comms = run.cfg, run.layout, run.groups, ctx.comms
    t0 = time.perf_counter()
    batches = [next(it) for _ in range(run.resolved.microbatches)]
    data_wait = time.perf_counter() - t0  # the loader's workers not keeping up (plus decoding at num_workers=0)
    enc, lang, total = rank_stages(run, batches, ctx.settle)
    read = sum(b.read_bytes for b in batches)  # data/loader.py counts them per batch
    sent0, boundary0 = sum(c.bytes_sent for c in comms.values()), sum(c.seconds for c in comms.values())
    result = hetero_step(layout, groups, enc, lang, comms, boundary_batches(batches, layout, ctx.settle), ctx.like)
    mark("optimizer")
    stats = run.opt.step(run.lr_schedule(step))
    sums = torch.tensor([float(result.loss) if ctx.hosts_loss else 0.0,
                         sum(c.bytes_sent for c in comms.values()) - sent0, read, *flags()], dtype=torch.float64,
                        device=run.device)  # NCCL reduces device tensors only
    dist.all_reduce(sums)
    agreed = [bool(f > 0) for f in sums[3:].tolist()]  # any rank's request holds for all
    # this rank's peak memory and seconds waiting for the loader, in boundary exchanges (its peers' waits
    # included) and for gradient reductions after backward (what overlap_grad_reduce did not hide), and the largest
    # of each over the ranks: the rank that sets the pace or runs out of memory first
    mine = {"peak_memory_gib": peak_memory_gib(run.device), "data_wait_s": data_wait,
            "boundary_s": sum(c.seconds for c in comms.values()) - boundary0,
            "grad_reduce_s": run.opt.reducer.exposed_s}
    worst = torch.tensor(list(mine.values()), dtype=torch.float64, device=run.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dt = time.perf_counter() - t0
    rows = run.resolved.rows_per_step
    # model FLOPs of these batches (hetero/planner/flops.StepFlops, handed in by recipes/train.py)
    flops = run.step_flops.record(batches, dt, run.world) if run.step_flops is not None else {}
    return {"step": step + 1, "world": run.world, "loss": float(sums[0]), "lr": stats["lr"],
            "grad_norm": stats["grad_norm"],
            "tokens_per_s": rows * cfg.data.seq_length / dt, "samples_per_s": rows / dt,
            "real_tokens_per_s": sum(b.real_tokens() for b in batches) / dt, **flops, **mine,
            "max_over_ranks": dict(zip(mine, worst.tolist())), "target_tokens": total, "step_time_s": dt,
            "boundary_bytes": int(sums[1]), "grad_buckets": run.opt.reducer.buckets,
            "grad_buckets_in_backward": run.opt.reducer.last_started_in_backward,
            # bytes this rank's loader read from the shards (JSON, and the media it decodes), and all ranks'
            "data_read_bytes": read, "data_read_bytes_all_ranks": int(sums[2]),
            "skipped": sum(sum(b.skipped.values()) for b in batches),
            "skipped_by_reason": dict(sum((Counter(b.skipped) for b in batches), Counter()))}, agreed


def _save(run: RunState, step: int, loader, keep: KeepPolicy, queue) -> None:
    """Save `step` (asynchronously when `queue` is given, after the previous save is published)."""
    mark("save")
    finish_async_saves(queue, run.ckpt_root, blocking=True)  # one save in flight at a time
    save_checkpoint(run.ckpt_root, step, run.modules, run.opt, run.groups, run.configs,
                    # all text, so the common state is torch.load(weights_only=True)-safe and the
                    # loader state is data, never a pickle (hetero/checkpoint/loader_state.py)
                    {"loader": encode_loader_state(loader.save_state_rank()), "layout": str(run.layout),
                     "config": json.dumps(asdict(run.cfg)), "llm_hf_config": json.dumps(run.hf_fields)},
                    keep=keep, queue=queue)


def _val_due(trainer, step: int) -> bool:
    """After `step` optimizer steps: every val_every steps, and after the last."""
    return step == trainer.max_steps or bool(trainer.val_every and step % trainer.val_every == 0)


def _save_due(trainer, step: int, agreed: list[bool]) -> bool:
    """After `step` optimizer steps: the last step, every save_every steps, the wall-time interval, or a stop."""
    return (step == trainer.max_steps or (trainer.save_every and step % trainer.save_every == 0)
            or any(agreed))


def _hosted(layout, rank: int) -> str:
    """What a rank computes, for the hang report: each module it is in, with its place in the module's grid."""
    coords = {k: layout[k].coord(rank) for k in layout.modules_of_rank(rank)}
    return ", ".join(f"{k} tp{c.tp} cp{c.cp} dp{c.dp} pp{c.pp}" for k, c in coords.items())


def run_training(cfg, resolved: ResolvedRun, run_dir: Path, stop: StopSignals,
                 device: torch.device | None = None, step_flops=None) -> dict:
    """Train `cfg`, resolved on this world as `resolved` (recipes/checks.resolve), on this rank: data and
    tokenizer, build, resume, then steps with metrics and checkpoints.
    `stop`: the rank's StopSignals, installed by recipes/train.py first thing: SIGTERM / SIGUSR1 end the run after
    a saved step (one that arrives while the model is built or loaded is answered at the end of the first step).
    `device`: where this rank computes; default the one its launcher bound (hetero/runtime/device.py).
    `step_flops`: hf_fields -> the run's hetero/planner/flops.StepFlops (model TFLOPS/GPU and MFU in the metrics),
    handed in by recipes/train.py: training code never imports the cost model."""
    if resolved.world != dist.get_world_size():
        raise ValueError(f"the run was resolved for {resolved.world} ranks but the world has {dist.get_world_size()}")
    device = device or current_device()
    mark("build", step=0)
    # each rank's position where its peers read it without a collective: a collective that fails names the rank
    # that stopped advancing (on a GPU the beacon itself does, before NCCL's watchdog aborts the process)
    beacon = ProgressBeacon(dist.get_rank(), dist.get_world_size(), cfg.trainer.timeout_s,
                            lambda r: _hosted(resolved.layout, r),
                            watch=device.type == "cuda")
    try:
        return _run_training(cfg, resolved, run_dir, stop, device, step_flops)
    except Exception as e:
        last = latest_checkpoint(run_dir / "checkpoints")
        lines = beacon.report(e, str(last) if last else "the start (no checkpoint was saved yet)")
        if not lines:
            raise
        print("\n".join(lines), file=sys.stderr, flush=True)
        raise SystemExit(1) from e  # the report is the message; the timeout's traceback only repeats it
    finally:
        beacon.close()


def _run_training(cfg, resolved: ResolvedRun, run_dir: Path, stop: StopSignals, device: torch.device,
                  step_flops) -> dict:
    keep = KeepPolicy(cfg.trainer.keep_last, cfg.trainer.keep_every)  # a bad policy fails before any work
    # a stop signal to the rank's process group leaves the checkpoint writer alive
    shield_checkpoint_queue(checkpoint_queue_start_method(device))
    val_sets = resolve_val_sets(cfg.data.val_path, dist.get_rank(), cfg.data.path,  # {} without data.val_path
                                synthetic_kinds(encoder_names(cfg.model)))  # a bad val_path fails before any build
    if dist.get_rank() == 0:
        print(describe_val_sets(cfg.data.val_path, cfg.data.path, val_sets), flush=True)
    run = build_run(cfg, resolved, run_dir, device, step_flops)
    freeze_live_objects()  # the model, optimizer and loader live as long as the run
    loader = run_loader(run, run.data_path, state=run.loader_state)
    ctx = step_context(run)
    metrics = RunMetrics(run_dir, cfg.trainer.max_steps, run.start, cfg.trainer.progress, cfg.trainer.tensorboard,
                         cfg.trainer.log_every, make_tracker(cfg.trainer, run_dir, cfg.name, asdict(cfg))
                         ) if run.rank == 0 else None
    if metrics is not None:  # an elastic restart on other ranks (or a resume in another layout) is recorded
        metrics.log_world_change(run.start, run.world, str(run.layout), run.saved_on, resolved.spares)

    queue = AsyncCallsQueue() if cfg.trainer.async_save else None  # async saves write while the next steps train
    it, record, first_loss, last_save, stopped, last_val = iter(loader), {}, None, time.monotonic(), None, {}
    loop_start, blocked, saves = time.perf_counter(), 0.0, 0  # what saves cost the steps (scripts/bench_train.py)
    for step in range(run.start, cfg.trainer.max_steps):
        mark("data", step=step)
        _maybe_fail(step, run.rank)
        record, (stop_now, time_due) = _train_step(run, step, it, ctx, lambda: stop.local_flags(last_save))
        first_loss = record["loss"] if first_loss is None else first_loss
        if metrics is not None:
            metrics.log(record)
        if val_sets and _val_due(cfg.trainer, step + 1) and not stop_now:  # a stop saves first, at once
            mark("validation")
            last_val = validate(run, val_sets, cfg.trainer.val_steps, ctx)
            if metrics is not None:
                metrics.log_val(step + 1, last_val)
        t = time.perf_counter()
        if _save_due(cfg.trainer, step + 1, [stop_now, time_due]):
            _save(run, step + 1, loader, keep, queue)
            last_save, saves = time.monotonic(), saves + 1
        finish_async_saves(queue, run.ckpt_root, blocking=False)  # publish what finished writing
        blocked += time.perf_counter() - t
        if stop_now and step + 1 < cfg.trainer.max_steps:
            stopped = (signal_name(stop.received), step + 1)
            break
    t = time.perf_counter()
    finish_async_saves(queue, run.ckpt_root, blocking=True)
    blocked += time.perf_counter() - t
    loop_s = time.perf_counter() - loop_start

    close_loader(loader)
    plot = metrics.close() if metrics is not None else None
    mark("export")
    if cfg.trainer.export_hf and run.rank == 0 and not stopped:
        _export_hf(run.ckpt_root, cfg.trainer.export_hf)
    dist.barrier()
    if ctx.settle is not None:
        ctx.settle.close()
    destroy_module_groups(run.groups)
    return {"run_dir": str(run_dir), "layout": str(run.layout),
            "steps": stopped[1] if stopped else cfg.trainer.max_steps, "stopped_by": stopped[0] if stopped else None,
            "start": run.start,
            "first_loss": first_loss, "last_loss": record.get("loss"), "loss_png": str(plot) if plot else None,
            "loop_s": loop_s, "saves": saves, "save_blocked_s": blocked, "val_loss": last_val}
