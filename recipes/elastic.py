"""Elastic training (trainer.elastic_min_nodes = MIN > 0, issue 36): every elastic decision, in one place.

    check_launch(task, executor, world)    the CLI, before launch: the executor made elastic, MIN nodes must train
    resolve_restart(cfg, world, per_node)  a restart's run on the world torchrun gave it (spares when none tiles it)
    restart_before_joining(cfg)            a rank, before joining the world: its restart's run, or wait as a spare
    resolve_on_world(cfg, restart)         a rank, in the world: the run on it (a fixed layout on another world
                                           under torchrun's agent says so and ends the agent)
    run_dir_stamp(trainer)                 the run directory every restart of one elastic job shares

Launch: torchrun's elastic agent, on top of nemo-run.

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

import dataclasses
import os
import signal

import torch.distributed as dist

from tessera.hetero.plan.layout import HeteroLayout, LayoutError
from tessera.hetero.plan.resolved_run import ResolvedRun, scaled_for_restart
from tessera.recipes.checks import resolve

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
    import nemo_run as run  # the launcher's side only: ranks never import nemo-run

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


def check_launch(task, executor, world: int) -> None:
    """The CLI, before launch, for trainer.elastic_min_nodes > 0: the executor launches elastically (make_elastic),
    and the run must train on MIN nodes, as a restart there would resolve it (else refused here, naming the worlds
    that fit)."""
    min_nodes = task.trainer.elastic_min_nodes
    if not min_nodes:
        return
    lo, hi = make_elastic(executor, min_nodes, task.trainer.elastic_max_restarts)
    per_node = world // hi
    smallest = resolve_restart(task, lo * per_node, per_node)
    spares = f" on {smallest.world} of them ({smallest.spares} wait as spares)" if smallest.spares else ""
    print(f"elastic: {lo}-{hi} nodes, {per_node} ranks a node; on {lo * per_node} ranks the run trains in "
          f"{smallest.layout}{spares}", flush=True)


# ---- a restart's run ----------------------------------------------------------------------------------------

class WorldTooSmall(ValueError):
    """An elastic job's world on which no layout of the run trains and fits, nor on any smaller world (ranks left
    as spares); the message names the worlds that do."""


PLANNED_SPARE_WORLDS = 8  # smaller worlds the planner searches for a restart with spares (each a whole search)


def resolve_restart(cfg, world: int, ranks_per_node: int, llm_fields: dict | None = None) -> ResolvedRun:
    """An elastic job's run resolved on the `world` ranks its agents re-rendezvoused with (resolve(elastic=True)).
    When nothing this run can train fits that world: the largest smaller world that it trains on, its lowest ranks
    training and the rest left as spares (ResolvedRun.spares; they wait: restart_before_joining): 128 rows cannot go
    over DP 15, so a 128-GPU job that lost a node trains on 96 of its 120. Smaller worlds are whole nodes fewer
    (single ranks within one node), scaled by DP from the run's layout, or from the planner for the first
    PLANNED_SPARE_WORLDS of them. When none trains: WorldTooSmall naming the smallest larger world of whole nodes
    that does (up to the run's own layout's world, or 4x this one for layout=auto/"")."""
    try:
        return resolve(cfg, world, llm_fields, elastic=True)
    except LayoutError as e:
        first = e
    node = max(ranks_per_node, 1)
    step = node if world > node else 1
    for i, w in enumerate(range(world - step, 0, -step)):
        try:
            run = resolve(cfg, w, llm_fields, elastic=True, planner=i < PLANNED_SPARE_WORLDS)
            return dataclasses.replace(run, spares=world - w)
        except LayoutError:
            continue

    def trains(w: int) -> bool:
        try:
            resolve(cfg, w, llm_fields, elastic=True)
            return True
        except LayoutError:
            return False

    spec = (cfg.layout or "").strip()
    top = HeteroLayout.parse(spec).world_size if spec not in ("", "auto") else 4 * world
    larger = next((w for w in range(world + node, max(top, world) + 1, node) if trains(w)), None)
    where = (f"the smallest world that fits is {larger} ranks ({larger // node} nodes of {node})" if larger
             else f"no world of up to {top} ranks fits either")
    raise WorldTooSmall(f"{first}.\nelastic: this run cannot train on {world} ranks nor on fewer of them (the rest "
                        f"left as spares): {where}. The checkpoint is intact; the job resumes from it when the agents "
                        f"re-rendezvous with enough ranks (or set layout=... / trainer.elastic_min_nodes)") from first


# ---- a rank's start -----------------------------------------------------------------------------------------

def restart_before_joining(cfg) -> ResolvedRun | None:
    """An elastic job's run on whatever world its agents (re)started it with (WORLD_SIZE), before joining it (pure
    and deterministic: every rank alike): the layout scaled by DP, else the planner's best, else on fewer ranks with
    the rest as spares. A spare waits here until rank 0 releases it and exits with the run's status; a world too
    small exits non-zero with the message (rank 0 prints it). None for a fixed-size job."""
    from tessera.hetero.runtime.world import wait_as_spare

    if not cfg.trainer.elastic_min_nodes:
        return None
    world, per_node = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        restart = resolve_restart(cfg, world, per_node)
    except WorldTooSmall as e:  # one message, every rank non-zero
        raise SystemExit(str(e) if os.environ.get("RANK", "0") == "0" else 1) from None
    if int(os.environ.get("RANK", "0")) >= restart.world:
        status = wait_as_spare(cfg.trainer.timeout_s)
        print(f"elastic: rank {os.environ['RANK']} waited as a spare until the run's end (exit status {status})",
              flush=True)
        raise SystemExit(status)
    return restart


def resolve_on_world(cfg, restart: ResolvedRun | None) -> ResolvedRun:
    """The run on the world this rank joined (collective-free: every rank alike). An elastic restart's run is
    described by rank 0 when its layout differs from the configured one. A fixed layout on another world under
    torchrun's elastic agent (a restart on the nodes that are left, with trainer.elastic_min_nodes unset) says so
    and ends the agent: no retry on that world can train."""
    if restart is not None:
        _describe_restart(cfg, restart)
        return restart
    world, spec = dist.get_world_size(), (cfg.layout or "").strip()
    try:
        return resolve(cfg, world)
    except LayoutError:
        restarts = torchelastic_restarts()
        layout_world = HeteroLayout.parse(spec).world_size if spec not in ("", "auto") else world
        if restarts is None or layout_world == world:
            raise
        message = fixed_layout_message(world, spec, layout_world, restarts[0])
        if restarts[0] < restarts[1]:
            stop_elastic_agent()
        raise SystemExit(message if dist.get_rank() == 0 else 1) from None


def _describe_restart(cfg, resolved: ResolvedRun) -> None:
    """Rank 0's line on an elastic start on another world than the layout's: which layout and why, and the spares."""
    spec, world = (cfg.layout or "").strip(), resolved.world
    launched = world + resolved.spares
    if dist.get_rank() == 0 and (resolved.spares or spec not in ("", "auto") and
                                 HeteroLayout.parse(spec).world_size != world):
        scaled, why = scaled_for_restart(spec, world, None) if spec not in ("", "auto") else ("", "")
        how = ("the run's layout scaled by data parallelism" if scaled and HeteroLayout.parse(scaled) == resolved.layout
               else f"the planner's best layout this run trains on {world} ranks ({why or 'the scaled one does not'})")
        has = f" (the run's layout has {HeteroLayout.parse(spec).world_size})" if spec not in ("", "auto") else ""
        spare = (f"; no layout of the run tiles {launched} ranks: ranks {world}-{launched - 1} wait as spares"
                 if resolved.spares else "")
        on = f" on ranks 0-{world - 1}" if resolved.spares else ""
        print(f"elastic: {launched} ranks{has}: layout {resolved.layout}{on}, {how}{spare}; "
              f"{resolved.rows_per_microbatch} rows x {resolved.microbatches} microbatches per step", flush=True)


def run_dir_stamp(trainer) -> str | None:
    """The run directory's suffix an elastic job outside Slurm shares over its restarts (torchrun's run id, so every
    restart of the workers finds its checkpoints), or None (Slurm's job id, or the time, then)."""
    if not os.environ.get("SLURM_JOB_ID") and trainer.elastic_min_nodes and os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"elastic{os.environ['TORCHELASTIC_RUN_ID']}"
    return None
