"""Run a function on N local processes and collect what each returns.

For tests and benchmarks on one machine: file-based rendezvous (a fresh temp file per run), so no ports
to race for. Each worker uses one thread, applies the megatron-core CPU shims and initialises the default
group with the run's backend (gloo without GPU; with GPUs NCCL, rank r bound to cuda:r). Real jobs use torchrun.

Workers come from a forkserver (multiprocessing's "forkserver" start method) that imported the heavy
libraries once (torch, megatron-core, NeMo's ASR modules, the trainer): a spawned interpreter spends ~7 s
importing them per rank (~27 s for 4 ranks on 2 cores), a fork of the server ~0.1 s. The server is single-
threaded and has run nothing but imports, so forking it is as safe as spawning. It lives as long as the
calling process. Each worker gets the caller's environment as it is at the call (a forked server would
otherwise hand out the environment of the moment it started).
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch.multiprocessing as mp


# imported once by the forkserver and inherited by every worker (a failed import here only costs speed)
PRELOAD = ["torch", "torch.distributed", "megatron.core", "nemo.collections.asr.modules",
           "tessera.hetero.training.loop", "tessera.hetero.tools.verify"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first run), no-op after
    return ctx


def _shield_checkpoint_queue() -> None:
    """megatron's checkpoint writer (dist_checkpointing, torch_dist) hands its write results back through a
    multiprocessing Manager queue, created at a process's first save. The rank's device decides how its server
    starts, as in the training loop (preemption.checkpoint_queue_start_method): forked from a CPU rank (~0.05 s),
    spawned on a GPU as megatron does. Shielded here too because a worker may save outside run_training."""
    from tessera.hetero.runtime.device import current_device
    from tessera.hetero.training.preemption import checkpoint_queue_start_method, shield_checkpoint_queue

    shield_checkpoint_queue(checkpoint_queue_start_method(current_device()))


def _worker(rank, world, store, fn, args, queue, environ):
    os.environ.clear()
    os.environ.update(environ)
    import torch.distributed as dist

    from tessera.hetero.runtime.world import process_world

    os.environ["OMP_NUM_THREADS"] = "1"  # ranks share the machine's cores
    try:
        with process_world(rank=rank, world_size=world, store=store):
            try:
                _shield_checkpoint_queue()  # the rank's device is bound now
                result = fn(*args)
                dist.barrier()
            except BaseException:
                # in the pipe before this rank's connections close (leaving the group below), so the parent
                # reads this traceback first, not a peer's "connection closed" that it causes
                queue.put((rank, "error", traceback.format_exc()))
                queue.close()
                queue.join_thread()
                return
        queue.put((rank, "ok", result))
    except BaseException:  # report, never hang the parent
        queue.put((rank, "error", traceback.format_exc()))


def kill_tree(pid: int) -> None:
    """Kill a process and every descendant (psutil: a pyproject dependency)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        family = proc.children(recursive=True) + [proc]
    except psutil.NoSuchProcess:
        return
    for q in family:
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)  # SIGKILL is asynchronous: return once they are gone


def run_on_ranks(world: int, fn, *args, timeout: float = 240.0) -> list:
    """fn(*args) on `world` gloo ranks; returns the per-rank results; raises with the first traceback."""
    ctx = _context()
    queue = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="tessera_pg_")
    os.close(fd)
    os.unlink(store)  # the file store must not exist yet
    # not daemonic: dist_checkpointing's torch_dist saver starts a multiprocessing Manager in each rank,
    # which daemonic processes may not do; the finally-block below still stops every worker
    procs = [ctx.Process(target=_worker, args=(r, world, store, fn, args, queue, dict(os.environ)), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            (results.__setitem__(rank, payload) if status == "ok" else errors.append((rank, payload)))
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                kill_tree(p.pid)  # with its own children (a checkpoint writer's Manager): a kill skips their shutdown
        if os.path.exists(store):
            os.unlink(store)
    if errors:
        rank, tb = errors[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    return [results[r] for r in range(world)]
