"""How a process joins a world: the one place the default process group is created.

    with process_world(timeout_s=600) as created:   # every entry point: threads, CPU shims, device, the world
        ...                                          # (trainer, verify, parity, spawn's ranks)
    created = join_world(timeout_s=600)     # torchrun's / Slurm's world (RANK set), else a one-rank world
    exit(wait_as_spare()) / release_spares(n)  # an elastic restart's ranks left out of the world, and rank 0's end
    created = one_rank_world()              # a one-rank world in this process (exports, tools, benches, tests)
    with fake_world(rank=5, world=512):     # torch's fake backend: groups built as rank 5 of 512 sees them
        groups = build_module_groups(layout)

Every world binds the rank's device first (hetero/runtime/device.py: NCCL binds each rank to its own GPU) and
uses the run's backend (cpu_shims.default_backend: NCCL with a GPU, gloo without). A one-rank world uses a file
store in a fresh temporary path, so two processes on one machine never race for a port. The fake world is
torch's (torch.testing._internal.distributed.fake_pg): collectives are no-ops, so the dry run and the memory
count build any rank's process groups and modules of a 1,000-GPU layout in one CPU process.
"""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from tessera.hetero.runtime.cpu_shims import apply_cpu_shims, default_backend
from tessera.hetero.runtime.device import bind_local_device


def _timeout(timeout_s: float | None) -> dict:
    return {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}


def one_rank_world(timeout_s: float | None = None, backend: str | None = None) -> bool:
    """A one-rank world in this process, unless one exists. Returns True if this call created it."""
    if dist.is_initialized():
        return False
    bind_local_device()
    fd, store = tempfile.mkstemp(prefix="tessera_world_")
    os.close(fd)
    os.unlink(store)  # the file store creates it; a stale file from an earlier world would be read as one
    dist.init_process_group(backend or default_backend(), init_method=f"file://{store}", rank=0, world_size=1,
                            **_timeout(timeout_s))
    return True


def join_world(timeout_s: float | None = None, world_size: int | None = None, backend: str | None = None) -> bool:
    """The launcher's world (torchrun, Slurm: RANK and its peers in the environment), or a one-rank world for a
    plain `python -m`. Returns True if this call created the default group (the caller destroys it).
    world_size: the launcher's lowest ranks only (an elastic restart with spares: the others never join).
    backend: the run's (cpu_shims.default_backend) unless given (a CPU benchmark: gloo even beside a GPU)."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        return one_rank_world(timeout_s, backend)
    bind_local_device()  # cuda:LOCAL_RANK (checked against the GPU count) before NCCL binds a device
    subset = {"world_size": world_size, "rank": int(os.environ["RANK"])} if world_size else {}
    dist.init_process_group(backend or default_backend(), **_timeout(timeout_s), **subset)
    return True


def freeze_live_objects() -> None:
    """Move every object alive now (the ~0.8 M of the imported libraries; after the build, the model's) out of the
    cyclic garbage collector's reach (gc.freeze). Python's full collections walk every tracked object: ~0.5 s each
    on an idle core here, three per rank in a 10-step tiny run, each rank at its own moment, so the others wait at
    the next collective (megatron's --manual-gc exists for the same stalls). Objects made later are collected as
    before. Also keeps forked data workers from touching (copying) the parent's pages."""
    gc.freeze()


@contextmanager
def process_world(timeout_s: float | None = None, world_size: int | None = None, *, rank: int | None = None,
                  store: str | None = None, backend: str | None = None, alone: bool = False) -> Iterator[bool]:
    """Every entry point's bootstrap, in the order each needs: CPU threads (OMP_NUM_THREADS, default one per rank:
    ranks share the machine's cores), megatron-core's CPU shims (hetero/runtime/cpu_shims.py), the rank's device
    bound, then the default group: rank `rank` of `world_size` over the file `store` (the test launcher,
    hetero/tools/spawn.py), else the launcher's world (torchrun, Slurm; its lowest `world_size` ranks when given),
    else one rank. `backend`: the run's (NCCL with a GPU, gloo without) unless given (scripts/bench_llm.py, a CPU
    benchmark: gloo). `alone`: one rank whatever the environment says, with the machine's threads: a tool that
    is one process (the export, convert_hf), also when a rank or a job step starts it with the launcher's RANK
    and MASTER_ADDR in its environment. Yields whether it created the group, and destroys the group it created on
    exit."""
    if not alone:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if not torch.cuda.is_available():
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    apply_cpu_shims()
    freeze_live_objects()
    if store is not None:
        if rank is None or world_size is None:
            raise ValueError("a file-store world needs rank and world_size")
        os.environ["LOCAL_RANK"] = str(rank)  # one node: what torchrun would set
        bind_local_device(rank)  # with GPUs: rank r on cuda:r (raises when world > GPUs), before NCCL
        dist.init_process_group(backend or default_backend(), init_method=f"file://{store}", rank=rank,
                                world_size=world_size, **_timeout(timeout_s))
        created = True
    elif alone:
        created = one_rank_world(timeout_s, backend)
    else:
        created = join_world(timeout_s, world_size, backend)
    try:
        yield created
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


# A spare (an elastic restart whose world no layout tiles leaves the highest ranks out) holds no process group:
# it waits on the launcher's store (MASTER_ADDR:MASTER_PORT, which rank 0's process group serves or torchrun's agent)
# until rank 0 releases it at the run's end. The key carries torchrun's restart count, so a restart's spares never
# read an earlier round's release from the agent's store, which outlives the workers.
def _spare_key(what: str) -> str:
    return f"tessera/spares/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{what}"


def _launcher_store(timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def wait_as_spare(timeout_s: float = 600.0, poll_s: float = 0.5) -> int:
    """Wait, as a spare, until the training ranks finish: the exit status rank 0 released the spares with (the
    run's: 0, or the stopped run's), or 1 when the store went away first (the run failed: the launcher restarts or
    ends the job either way)."""
    import time

    try:
        store = _launcher_store(timeout_s)  # rank 0 may still be starting its store: the client retries
        while not store.check([_spare_key("released")]):
            time.sleep(poll_s)
        status = int(store.get(_spare_key("released")))
        store.add(_spare_key("seen"), 1)
        return status
    except (RuntimeError, dist.DistError):
        return 1


def release_spares(spares: int, status: int = 0, timeout_s: float = 30.0) -> None:
    """Rank 0 at the run's end: let the spares go with the run's exit status, and wait (up to timeout_s) until each
    has seen it, so none finds the store gone first."""
    import time

    if not spares:
        return
    store = _launcher_store(timeout_s)
    store.set(_spare_key("released"), str(status))
    end = time.monotonic() + timeout_s
    while store.add(_spare_key("seen"), 0) < spares and time.monotonic() < end:
        time.sleep(0.05)


@contextmanager
def fake_world(rank: int, world: int):
    """The default group of torch's fake backend, as rank `rank` of `world`; destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
