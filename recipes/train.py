"""The training entry point every recipe points at (`run.Partial(train, ...)`).

Runs under torchrun (one process per rank; gloo on CPU, NCCL on GPU) or as one process:

    torchrun --standalone --nproc-per-node 4 -m tessera.recipes.train --recipe nemotron_vl_tiny trainer.max_steps=5
    python -m tessera.recipes.train --recipe nemotron_vl_tiny layout="vision=dp1@0-0;language=dp1@0-0"

(`nemo tessera pretrain|finetune --factory ...` is the user-facing command; it ends up here.)
The first line a run prints is `run_dir: <path>`; torch.distributed is set up and the run directory agreed
on before anything heavy is imported, so nothing can print before it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.recipes.config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig


def _init_distributed(timeout_s: int) -> bool:
    """Join torchrun's world, or make a one-rank world. Returns True if this call created the group."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    else:
        store = tempfile.NamedTemporaryFile(prefix="tessera_store_", delete=False).name
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout)
    return True


def _run_dir(name: str, trainer: TrainerConfig) -> Path:
    """Rank 0 chooses (the configured one, or runs/<name>-<time>); every rank gets the same path."""
    choice = [None]
    if dist.get_rank() == 0:
        choice[0] = trainer.run_dir or str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    dist.broadcast_object_list(choice, src=0)
    path = Path(choice[0]).resolve()
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return path


def train(model: ModelConfig, data: DataConfig, optim: OptimConfig, trainer: TrainerConfig, layout: str = "",
          name: str = "tessera") -> dict:
    """Train `model` on `data` in `layout`; returns a summary (run_dir, first/last loss, ...)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    created = _init_distributed(trainer.timeout_s)
    rank = dist.get_rank()
    run_dir = _run_dir(name, trainer)
    if rank == 0:
        print(f"run_dir: {run_dir}", flush=True)
    from tessera.hetero.runtime.cpu_shims import apply_cpu_shims  # heavy imports only after the first line is out

    apply_cpu_shims()
    from tessera.hetero.training.loop import run_training

    try:
        summary = run_training(RunConfig(name, layout, model, data, optim, trainer), run_dir)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(f"done: steps={summary['steps']} first_loss={summary['first_loss']:.4f} "
              f"last_loss={summary['last_loss']:.4f} layout={summary['layout']}", flush=True)
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
