"""The one device a rank computes on, chosen once when the process joins its world.

    device = bind_local_device()          # before init_process_group: cuda:LOCAL_RANK (set_device), or cpu

Every launcher (recipes/train.py, hetero/tools/spawn.py, hetero/tools/parity.py) calls it before the
process group exists, so NCCL binds each rank to its own GPU; the training loop receives the device it
returns as a parameter (hetero/training/loop.py run_training) and hands it to the stages and boundary
communicators instead of re-deriving it. A LOCAL_RANK beyond the visible GPUs (more ranks per node than
GPUs, a wrong CUDA_VISIBLE_DEVICES) stops here with a message rather than silently stacking ranks on GPU 0.
"""

from __future__ import annotations

import os

import torch


def bind_local_device(local_rank: int | None = None) -> torch.device:
    """This process's device: cuda:`local_rank` (default: $LOCAL_RANK, else 0), made current, when CUDA
    is available; cpu otherwise. Raises when the local rank has no GPU of its own."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this node shows {count} GPU(s) "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): "
                           f"launch at most {count} ranks per node, one per GPU")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def current_device() -> torch.device:
    """The device bind_local_device() chose for this process (cuda's current device, or cpu)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
