"""Test helpers: single-process and spawned gloo worlds with megatron's parallel_state, on a free port.
The megatron-core CPU shims themselves live in hetero/runtime/cpu_shims.py."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from tessera.hetero.runtime.cpu_shims import apply_cpu_shims


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(rank: int, world: int, port: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1):
    """gloo world + megatron groups; returns megatron's ProcessGroupCollection for this rank."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    apply_cpu_shims()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        context_parallel_size=cp,
    )
    return ProcessGroupCollection.use_mpu_process_groups()


def close_world():
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def single_rank_world():
    """A one-process gloo world for in-process TP=1/PP=1 tests (file store: no port race)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from tessera.hetero.runtime.world import one_rank_world

    apply_cpu_shims()
    one_rank_world(backend="gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    return ProcessGroupCollection.use_mpu_process_groups()
