"""Elastic launches (trainer.elastic_min_nodes = MIN > 0, issue 36): torchrun's elastic agent, on top of nemo-run.

    nemo tessera finetune --factory "nemotron_vl_12b(gpus=16)" run.executor=slurm run.executor.nodes=2 \
        run.executor.gpus_per_node=8 trainer.elastic_min_nodes=1 --yes

A job of MAX = run.executor.nodes nodes keeps training when nodes die, down to MIN, and grows back when they return:
torchrun's agents (one per node) re-rendezvous and restart their workers with the new WORLD_SIZE, and each rank
resolves the run again for that world (recipes/train.py). nemo-run 0.11.1 launches none of this by itself: its
SlurmExecutor.nodes is an int, its torchrun component passes `--nnodes nnodes()`, its srun line hard-codes
`--kill-on-bad-exit=1` (one dead task kills the rest) and sbatch asks for exactly `nodes`. So, before launch:
  - make_elastic: run.executor.nodes becomes ["MIN:MAX"], nemo-run's per-group form of the field, whose first
    entry its nnodes() returns, so its torchrun component writes `torchrun --rdzv-backend c10d --rdzv-endpoint
    $head:PORT --nnodes MIN:MAX` (c10d: its default); (a field survives nemo-run's copies of the executor, which
    rebuild it from its fields, and a subclass is refused: nemo-run dispatches on the exact class); sbatch `--nodes=MIN-MAX` (a requeued job starts on what is free) and `--no-kill` (a dead node does
    not end the allocation); srun `--kill-on-bad-exit=0 --no-kill --wait=0` after nemo-run's own options (srun
    takes the last value of an option: `srun -v` prints kill-on-bad-exit 0, wait 0), so the surviving agents
    live on; PET_MAX_RESTARTS (torchrun's --max-restarts: failures it restarts from; a node joining costs none);
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (ELASTIC_ENV: else a node that comes back never joins); and MIN checked
    against the allocation and the run (a world of MIN nodes must train).
Limits: the c10d rendezvous store lives in the agent of the job's first node (nemo-run's endpoint); losing that
node ends the job, which Slurm requeues (run.executor.retries) on MIN-MAX nodes and which resumes from its
checkpoint. A local run (run.executor=local) is one node: MIN must be 1, and failures restart its workers.
"""

from __future__ import annotations

import os
import signal

import nemo_run as run

# srun options after nemo-run's "--wait=60 --kill-on-bad-exit=1" (the last value wins): a task that ends (its node
# died, or its agent gave up) neither kills the others nor starts a 60 s countdown to killing them
ELASTIC_SRUN_ARGS = ("--kill-on-bad-exit=0", "--no-kill", "--wait=0")
# torch 2.13's agents share one TCP store with the workers, and the agent of group rank 0 publishes its address
# (MASTER_ADDR) under the first round only: an agent that joins a later round (a node coming back) waits for it
# until the store times out and the grow fails (measured: tests/test_elastic.py hung 60 s, then both agents
# exited). Without the sharing, rank 0's agent publishes a fresh address every round.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def max_nodes(executor) -> int:
    """A SlurmExecutor's nodes (MAX of an elastic one: nodes ["MIN:MAX"]; a heterogeneous job's first group)."""
    nodes = executor.nodes
    return nodes if isinstance(nodes, int) else int(str(nodes[0]).rpartition(":")[2])


def make_elastic(executor, min_nodes: int, max_restarts: int) -> tuple[int, int]:
    """Launch `executor` (sized by fit_executor first) elastically over min_nodes..its nodes; returns (MIN, MAX)
    nodes. ValueError naming the field when it cannot: no executor, MIN above the allocation, a local MIN > 1."""
    if executor is None:
        raise ValueError(f"trainer.elastic_min_nodes={min_nodes} needs a launcher that restarts workers: add "
                         f"run.executor=slurm (or run.executor=local)")
    executor.env_vars.update(ELASTIC_ENV, PET_MAX_RESTARTS=str(max_restarts))  # torchrun's --max-restarts default
    if isinstance(executor, run.LocalExecutor):
        if min_nodes > 1:
            raise ValueError(f"trainer.elastic_min_nodes={min_nodes} but run.executor=local is one node: set "
                             f"trainer.elastic_min_nodes=1, or run on run.executor=slurm")
        return 1, 1
    if not isinstance(executor, run.SlurmExecutor):
        raise ValueError(f"trainer.elastic_min_nodes needs run.executor=slurm or local, not {type(executor).__name__}")
    nodes = max_nodes(executor)
    if min_nodes > nodes:
        raise ValueError(f"trainer.elastic_min_nodes={min_nodes} is more than the job's run.executor.nodes={nodes}: "
                         f"the job would never start; set trainer.elastic_min_nodes <= {nodes} (or more nodes)")
    executor.nodes = [f"{min_nodes}:{nodes}"]  # torchx's "[MIN:]MAX" (j="{nnodes}x{nproc}": parse_nnodes)
    executor.additional_parameters = {**(executor.additional_parameters or {}), "nodes": f"{min_nodes}-{nodes}",
                                      "no_kill": True}
    executor.srun_args = [*(a for a in executor.srun_args or [] if a not in ELASTIC_SRUN_ARGS), *ELASTIC_SRUN_ARGS]
    return min_nodes, nodes


# ---- a fixed layout under an elastic launcher ---------------------------------------------------------------

def torchelastic_restarts() -> tuple[int, int] | None:
    """(this start's restart count, the agent's --max-restarts) when torchrun's elastic agent started this process
    (its TORCHELASTIC_* variables), else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def fixed_layout_message(world: int, layout: str, layout_world: int, restart: int) -> str:
    """What a rank says when torchrun (re)started a run whose layout is fixed (trainer.elastic_min_nodes=0) on
    another world than the layout's."""
    how = f"restarted this job elastically (restart {restart})" if restart else "started this job"
    return (f"elastic: torchrun {how} on {world} ranks, but the run's layout is fixed to {layout_world} ranks "
            f"(layout={layout}) because trainer.elastic_min_nodes is 0. Set trainer.elastic_min_nodes=MIN (the "
            f"fewest nodes to train on) to re-plan the layout on every restart, or launch exactly {layout_world} "
            f"ranks (a fixed --nnodes). Not retried: every restart on {world} ranks would fail the same way.")


def stop_elastic_agent() -> None:
    """End this node's torchrun agent now, so that a failure no retry can fix is not retried: the agent restarts
    failed workers until --max-restarts runs out (measured: ~8 minutes of re-rendezvous for a fixed layout on a
    shrunk world) and a worker has no exit status that says "final". Its SIGTERM handler stops the workers and
    exits non-zero. Only the node's local rank 0 signals (one signal per agent), and only its parent: the agent
    that started it (torchrun runs workers as its direct children)."""
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.getppid() > 1:
        os.kill(os.getppid(), signal.SIGTERM)
