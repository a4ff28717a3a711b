"""How a process joins a world: the one place the default process group is created.

    created = join_world(timeout_s=600)     # torchrun's / Slurm's world (RANK set), else a one-rank world
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

import os
import tempfile
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from tessera.hetero.runtime.cpu_shims import default_backend
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


def join_world(timeout_s: float | None = None) -> bool:
    """The launcher's world (torchrun, Slurm: RANK and its peers in the environment), or a one-rank world for a
    plain `python -m`. Returns True if this call created the default group (the caller destroys it)."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        return one_rank_world(timeout_s)
    bind_local_device()  # cuda:LOCAL_RANK (checked against the GPU count) before NCCL binds a device
    dist.init_process_group(default_backend(), **_timeout(timeout_s))
    return True


@contextmanager
def fake_world(rank: int, world: int):
    """The default group of torch's fake backend, as rank `rank` of `world`; destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
