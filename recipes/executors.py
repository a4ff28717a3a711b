"""Executors by name for `run.executor=NAME`, sized from the run's layout before anything is submitted.

    nemo tessera finetune --factory nemotron_vl_tiny run.executor=local --yes
    nemo tessera finetune --factory "nemotron_vl_12b(gpus=16)" run.executor=slurm run.executor.account=ACC \
        run.executor.partition=batch run.executor.nodes=2 run.executor.gpus_per_node=8 --yes
    # over SSH from a laptop: add run.executor.ssh_host=login.cluster run.executor.ssh_user=me \
    #   run.executor.remote_job_dir=/lustre/me/nemo-jobs   (code shipped with GitArchivePackager: commit first)

local: run.LocalExecutor with torchrun; ntasks_per_node=0 (the default) means "the layout's world size"
       (layout "" -> GPU count, or 4 on CPU). OMP_NUM_THREADS=1 on CPU: N ranks x all cores oversubscribes.
slurm: run.SlurmExecutor with torchrun; LocalTunnel + run.Packager() (shared filesystem: the installed tree
       runs in place, PATH passed so torchrun resolves) unless ssh_host is set (SSHTunnel + GitArchivePackager).
       World size nodes x tasks per node (tasks = ntasks_per_node, else gpus_per_node, else layout/nodes) must
       equal the layout's, checked here with a message naming the fields to change.
`run.executor.x=v` sets a factory argument when x is one (recipes/cli.py routes them, since the tunnel and
packager follow from ssh_host) and otherwise a field of the built executor (any run.SlurmExecutor field,
e.g. run.executor.mem=0 or run.executor.exclusive=true), as nemo-run does.
"""

import os
import sys
from typing import Optional

import nemo_run as run
from nemo_run.core.packaging import GitArchivePackager

CPU_DEFAULT_WORLD = 4  # layout "" on a machine without GPUs: the 4-rank CPU layouts of the tiny recipes


def gpu_count() -> int:
    import torch  # lazily: only layout "" needs it, and importing torch costs seconds

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_world() -> int:
    return gpu_count() or CPU_DEFAULT_WORLD


@run.cli.factory(name="local")
def local(ntasks_per_node: int = 0) -> run.Config[run.LocalExecutor]:
    """torchrun on this machine; ntasks_per_node 0 = the layout's world size."""
    env = {} if gpu_count() else {"OMP_NUM_THREADS": "1"}
    # `.venv/bin/nemo` runs without an activated venv: torchrun (the launcher) must still resolve
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"
    return run.Config(run.LocalExecutor, ntasks_per_node=ntasks_per_node, launcher="torchrun", env_vars=env)


@run.cli.factory(name="slurm")
def slurm(account: str = "", partition: Optional[str] = None, nodes: int = 1, gpus_per_node: Optional[int] = None,
          time: str = "01:00:00", container_image: Optional[str] = None, ssh_host: str = "", ssh_user: str = "",
          ssh_identity: Optional[str] = None, remote_job_dir: str = "") -> run.Config[run.SlurmExecutor]:
    """sbatch + torchrun; LocalTunnel on the cluster, SSHTunnel when ssh_host is set."""
    env = {} if gpus_per_node else {"OMP_NUM_THREADS": "1"}
    if ssh_host:
        if not remote_job_dir:
            raise ValueError("run.executor.ssh_host is set: also set run.executor.remote_job_dir (a folder on the "
                             "cluster's shared filesystem for job scripts and logs)")
        tunnel = run.Config(run.SSHTunnel, host=ssh_host, user=ssh_user or os.environ.get("USER", ""),
                            job_dir=remote_job_dir, identity=ssh_identity)
        packager = run.Config(GitArchivePackager)  # another filesystem: ship the committed tree
    else:
        # job_dir="" is required: LocalTunnel then uses $NEMORUN_HOME/experiments, the only place its sbatch
        # step finds the script it wrote (another job_dir: "Unable to open file ..._sbatch.sh")
        tunnel = run.Config(run.LocalTunnel, job_dir="")
        packager = run.Config(run.Packager)  # same filesystem: the installed tree runs in place
        # the batch step's shell does not see this venv: torchrun (the launcher) must be on its PATH
        env["PATH"] = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"
    # ntasks_per_node=0: filled in from the layout (or gpus_per_node) by fit_executor before submission
    return run.Config(run.SlurmExecutor, account=account, partition=partition, nodes=nodes,
                      gpus_per_node=gpus_per_node, ntasks_per_node=0, time=time, container_image=container_image,
                      launcher="torchrun", tunnel=tunnel, packager=packager, env_vars=env)


EXECUTORS = {"local": local, "slurm": slurm}


def fit_executor(executor, layout_world: int | None) -> int:
    """Set the executor's ranks from the layout (layout_world None = layout "") and return the world size.

    Raises ValueError naming the fields to change when the executor cannot launch the layout's ranks."""
    if executor is None:  # --direct / no run.executor: train() runs in this one process
        if layout_world not in (None, 1):
            raise ValueError(f"the layout needs {layout_world} ranks but no executor was chosen (one process); "
                             f"add run.executor=local (torchrun, {layout_world} ranks) or run.executor=slurm")
        return 1
    if isinstance(executor, run.SlurmExecutor):
        return _fit_slurm(executor, layout_world)
    if isinstance(executor, run.LocalExecutor):
        n = executor.ntasks_per_node or layout_world or default_world()
        if layout_world is not None and n != layout_world:
            raise ValueError(f"the layout needs {layout_world} ranks but run.executor.ntasks_per_node={n}; "
                             f"drop the override (0 = from the layout) or change the layout's rank ranges")
        executor.ntasks_per_node = n
        return n
    raise ValueError(f"executor {type(executor).__name__} is not one of Tessera's: {', '.join(EXECUTORS)}")


def _fit_slurm(ex, layout_world: int | None) -> int:
    nodes = ex.nodes if isinstance(ex.nodes, int) else ex.nodes[0]
    tasks = ex.torchrun_nproc_per_node or ex.ntasks_per_node or ex.gpus_per_node or 0
    if not tasks:
        if layout_world is None:
            raise ValueError('layout "" on run.executor=slurm needs the ranks per node: set '
                             'run.executor.gpus_per_node=N or run.executor.ntasks_per_node=N')
        if layout_world % nodes:
            raise ValueError(f"the layout needs {layout_world} ranks, which {nodes} nodes cannot split evenly; "
                             f"set run.executor.nodes to a divisor of {layout_world}")
        tasks = layout_world // nodes
    if layout_world is not None and nodes * tasks != layout_world:
        raise ValueError(
            f"the layout needs {layout_world} ranks but run.executor=slurm launches nodes x tasks per node = "
            f"{nodes} x {tasks} = {nodes * tasks}; set run.executor.nodes / run.executor.gpus_per_node (or "
            f"ntasks_per_node) so they multiply to {layout_world}, or change the layout")
    ex.ntasks_per_node = tasks  # torchrun launcher turns this into 1 task running `torchrun --nproc-per-node tasks`
    return nodes * tasks
