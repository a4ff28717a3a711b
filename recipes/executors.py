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
       With container_image the container's Python runs the job and nothing of the host's: TesseraPackager
       ships the code into the job directory (nemo-run mounts it at /nemo_run, the workdir /nemo_run/code
       holds tessera/...), and mount_run_paths mounts the run's data, checkpoint and run directories.
       World size nodes x tasks per node (tasks = ntasks_per_node, else gpus_per_node, else layout/nodes) must
       equal the layout's, checked here with a message naming the fields to change.
`run.executor.x=v` sets a factory argument when x is one (recipes/cli.py routes them, since the tunnel and
packager follow from ssh_host) and otherwise a field of the built executor (any run.SlurmExecutor field,
e.g. run.executor.mem=0 or run.executor.exclusive=true), as nemo-run does.
"""

import os
import re
import shlex
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import nemo_run as run
from nemo_run.core.packaging import GitArchivePackager

from tessera.recipes.elastic import max_nodes
from tessera.recipes.slurm_signal import shutdown_grace_s

CPU_DEFAULT_WORLD = 4  # layout "" on a machine without GPUs: the 4-rank CPU layouts of the tiny recipes
# Slurm defaults (nemo-run's SlurmExecutor fields): a 4-hour allocation (a common partition maximum; a 20,000-step
# recipe spans several), requeued up to 3 times (nemo-run's sbatch script runs `scontrol requeue` after a
# non-zero exit while SLURM_RESTART_COUNT < retries, and REQUEUE_ON_EXIT below when that command fails; it submits
# with --requeue, so preemption requeues too),
# and SIGTERM to the ranks 5 minutes before the limit (--signal=TERM@300): they save the step they are in and
# exit non-zero, so the job is requeued instead of being killed with its batch script. A requeued job keeps its
# id, and recipes/train.py names the run directory after it, so it resumes from that checkpoint.
DEFAULT_TIME = "04:00:00"
DEFAULT_RETRIES = 3
DEFAULT_SIGNAL = "TERM@300"
# The requeue, made sure of (issue 61). nemo-run's sbatch script requeues after srun exits non-zero with retries
# left, but under `set -e`: an `scontrol requeue` that fails (slurmctld slow to answer on a loaded cluster) ends the
# script there, the job FAILED and never requeued. This EXIT trap, set before srun (setup_lines), runs however the
# script ends. An allocation that ended non-zero (torchrun exits 1 when it dies of the signal, 143 or 137 when it is
# killed: every way but success) with retries left and no requeue counted by Slurm for it yet (scontrol's Restarts
# still SLURM_RESTART_COUNT) is requeued, the RPC retried for about a minute while slurmctld does not answer.
REQUEUE_ON_EXIT = r"""
tessera_requeue_on_exit() {
    local rc=$? restarts try
    set +e
    [ "$rc" -ne 0 ] && [ "${TORCHX_MAX_RETRIES:-0}" -gt "${SLURM_RESTART_COUNT:-0}" ] || return 0
    for try in 1 2 3 4 5 6; do
        restarts=$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'Restarts=[0-9]*' | cut -d= -f2)
        if [ -n "$restarts" ]; then
            [ "$restarts" -gt "${SLURM_RESTART_COUNT:-0}" ] && return 0
            scontrol requeue "$SLURM_JOB_ID" && echo "tessera: job $SLURM_JOB_ID requeued (exit $rc)" && return 0
        fi
        sleep $((try * 3))
    done
    echo "tessera: could not requeue job $SLURM_JOB_ID after exit $rc" >&2
}
trap tessera_requeue_on_exit EXIT"""
# On SIGTERM (or SIGUSR1) the ranks save and exit; torchrun must wait for them and forward SIGUSR1
# (recipes/slurm_signal.py says how long, from the job's --signal).
LOCAL_GRACE_S = 300
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def gpu_count() -> int:
    import torch  # lazily: only layout "" needs it, and importing torch costs seconds

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_world() -> int:
    return gpu_count() or CPU_DEFAULT_WORLD


# Quiet logs (issue 33): torchrun's agent logs its launch configuration and rendezvous at INFO (40 lines a job;
# its warnings and errors stay), and libraries draw progress bars of their own on every rank (energon's "Filling
# reading buffer"; tqdm reads TQDM_DISABLE when imported, so it is set for the job's processes: the run's own bar,
# hetero/training/metrics.py, is enabled explicitly).
QUIET = {"LOGLEVEL": "WARNING", "TQDM_DISABLE": "1"}


def plugin_env() -> dict[str, str]:
    """The user's encoder families (models/encoders.MODULES_ENV, README "Add an encoder") as the launching shell
    names them: every rank and the export's subprocess must import them too, and a container or another machine
    (ssh_host) does not inherit this shell's environment."""
    from tessera.models.encoders import MODULES_ENV

    return {MODULES_ENV: os.environ[MODULES_ENV]} if os.environ.get(MODULES_ENV) else {}


@run.cli.factory(name="local")
def local(ntasks_per_node: int = 0) -> run.Config[run.LocalExecutor]:
    """torchrun on this machine; ntasks_per_node 0 = the layout's world size."""
    env = {} if gpu_count() else {"OMP_NUM_THREADS": "1"}
    env.update(TORCH_ELASTIC_SHUTDOWN_TIMEOUT=str(LOCAL_GRACE_S), PET_SIGNALS_TO_HANDLE=TORCHRUN_SIGNALS, **QUIET,
               **plugin_env())
    # `.venv/bin/nemo` runs without an activated venv: torchrun (the launcher) must still resolve
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"
    return run.Config(run.LocalExecutor, ntasks_per_node=ntasks_per_node, launcher="torchrun", env_vars=env)


@run.cli.factory(name="slurm")
def slurm(account: str = "", partition: Optional[str] = None, nodes: int = 1, gpus_per_node: Optional[int] = None,
          time: str = DEFAULT_TIME, retries: int = DEFAULT_RETRIES, signal: Optional[str] = DEFAULT_SIGNAL,
          container_image: Optional[str] = None, ssh_host: str = "", ssh_user: str = "",
          ssh_identity: Optional[str] = None, remote_job_dir: str = "") -> run.Config[run.SlurmExecutor]:
    """sbatch + torchrun; LocalTunnel on the cluster, SSHTunnel when ssh_host is set. time: the job's limit;
    retries: requeues after a failed, timed-out or preempted run (each resumes from the last checkpoint);
    signal: sent to the ranks ahead of the limit: they save the step they are in and exit non-zero, and the job
    is requeued (torchrun is given the time in between to wait for them: shutdown_grace_s)."""
    env = {} if gpus_per_node else {"OMP_NUM_THREADS": "1"}
    env.update(TORCH_ELASTIC_SHUTDOWN_TIMEOUT=str(shutdown_grace_s(signal)), PET_SIGNALS_TO_HANDLE=TORCHRUN_SIGNALS,
               **QUIET, **plugin_env())
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
        if not container_image:  # the batch step's shell does not see this venv: torchrun must be on its PATH
            env["PATH"] = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"
    if container_image:  # the image's torchrun and Python run the code shipped with the job (module docstring)
        packager = run.Config(TesseraPackager)
    # ntasks_per_node=0: filled in from the layout (or gpus_per_node) by fit_executor before submission
    return run.Config(run.SlurmExecutor, account=account, partition=partition, nodes=nodes,
                      gpus_per_node=gpus_per_node, ntasks_per_node=0, time=time, retries=retries, signal=signal,
                      container_image=container_image, launcher="torchrun", tunnel=tunnel, packager=packager,
                      env_vars=env, setup_lines=REQUEUE_ON_EXIT.strip())


EXECUTORS = {"local": local, "slurm": slurm}


# ---- Slurm with a container: the code and the run's paths go in, no host path ------------------------------

def code_dirs() -> dict[str, str]:
    """{path in the package: folder here} of the code the ranks import. pyproject's package-dir maps the repo's
    folders to `tessera.*` (hetero -> tessera/hetero), so the repo itself is not importable as `tessera`; an
    installed (non-editable) tessera is one folder already."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return {"tessera": str(root)}
    dirs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    return {name.replace(".", "/"): str(root / folder) for name, folder in dirs.items()}


def _no_cache(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if "__pycache__" in info.name.split("/") or info.name.endswith(".pyc") else info


@dataclass(kw_only=True)
class TesseraPackager(run.Packager):
    """nemo-run's packager interface: the archive it returns is extracted into JOB_DIR/code, which a container
    sees as its workdir /nemo_run/code; holding tessera/<package>/..., it is first on the ranks' sys.path
    (torchrun runs `python -m`), so the job imports the code as it was at submission, with the image's Python."""

    def package(self, path, job_dir: str, name: str) -> str:
        out = os.path.join(job_dir, f"{name}.tar.gz")
        with tarfile.open(out, "w:gz") as tar:
            for arcname, folder in code_dirs().items():
                tar.add(folder, arcname=arcname, filter=_no_cache)
        return out


# (config, field, what the container must see): a file's folder (a blend YAML's datasets are relative to it,
# a tokenizer sits with its dataset), a folder itself; outputs are created by the batch script before srun
_RUN_PATHS = (("data", "path", "input"), ("data", "tokenizer", "file"), ("model", "checkpoint", "input"),
              ("trainer", "run_dir", "output"), ("trainer", "export_hf", "output"))


def mount_run_paths(executor, task) -> list[str]:
    """With run.executor.container_image: every path of the run (_RUN_PATHS) mounted at the same path in the
    container, so the task's paths mean there what they mean here; relative ones made absolute first (the job's
    workdir is /nemo_run/code). Returns the mounts added. Paths of an SSH-tunnelled executor are the cluster's:
    taken as given."""
    if not isinstance(executor, run.SlurmExecutor) or not executor.container_image:
        return []
    remote = type(executor.tunnel).__name__ == "SSHTunnel"
    added, outputs = [], []
    for section, name, kind in _RUN_PATHS:
        cfg = getattr(task, section)
        value = getattr(cfg, name, None)
        if not value:
            continue
        path = Path(value) if remote else Path(value).expanduser().resolve()
        setattr(cfg, name, str(path))
        blend = kind == "input" and path.suffix in (".yaml", ".yml")
        folder = str(path.parent if kind == "file" or blend else path)
        if kind == "output":
            outputs.append(folder)
        mount = f"{folder}:{folder}"
        if mount not in executor.container_mounts:
            executor.container_mounts.append(mount)
            added.append(mount)
    if outputs:  # a mount's source must exist before srun starts the container
        mkdir = "mkdir -p " + " ".join(shlex.quote(o) for o in outputs)
        executor.setup_lines = f"{executor.setup_lines}\n{mkdir}" if executor.setup_lines else mkdir
    return added


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
    nodes = max_nodes(ex)
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



def request_gpus(executor, model) -> None:
    """GPUs per node for a Slurm job, from the layout: a GPU recipe (full-size model, or bf16) without
    run.executor.gpus_per_node requests one GPU per rank (the ranks per node fit_executor derived from the
    layout); one with gpus_per_node=0 is refused. A CPU recipe without it runs on CPUs, and says so."""
    if not isinstance(executor, run.SlurmExecutor):
        return
    from tessera.recipes.prelaunch import is_full_size

    gpu_recipe = is_full_size(model) or model.dtype != "float32"
    tasks = executor.ntasks_per_node
    if executor.gpus_per_node is None and not executor.gpus_per_task:
        if gpu_recipe:
            if not tasks:
                raise ValueError(f"{model.llm} ({model.dtype}) is a GPU recipe but run.executor=slurm knows no "
                                 f"GPUs per node: set run.executor.gpus_per_node=N")
            executor.gpus_per_node = tasks
            executor.env_vars.pop("OMP_NUM_THREADS", None)
            print(f"slurm: requesting {tasks} GPUs per node (one per rank of the layout); "
                  f"run.executor.gpus_per_node=N overrides", file=sys.stderr, flush=True)
        else:
            print(f"slurm: no GPUs requested ({model.llm} is a CPU-sized recipe); set "
                  f"run.executor.gpus_per_node={tasks or 'N'} to run it on GPUs", file=sys.stderr, flush=True)
    elif executor.gpus_per_node == 0 and gpu_recipe:
        raise ValueError(f"{model.llm} ({model.dtype}) is a GPU recipe but run.executor.gpus_per_node=0; set it to "
                         f"the GPUs per node ({tasks or 'N'}: one per rank)")


# ---- the outcome of a launched job ------------------------------------------------------------------------

_LINE_PREFIX = re.compile(r"^(?:\S+/\d+ )?\[default(\d+)\]:(?:\[rank\d+\]:)?")  # "role/0 [default1]:[rank1]: "
_ROOT = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\).*?exitcode\s*:\s*(-?\d+)", re.S)


def failing_rank_report(logs: str, tail: int = 15) -> str:
    """From a torchrun job's combined log: the root-cause rank (torchrun's summary), its exit code and its
    last lines, plus the last error line of every other rank that raised."""
    lines = logs.splitlines()
    m = _ROOT.search(logs)
    out = []
    by_rank: dict[int, list[str]] = {}
    for line in lines:
        pm = _LINE_PREFIX.match(line.strip("\r"))
        if pm:
            text = line[pm.end():].rstrip()
            if text.strip():
                by_rank.setdefault(int(pm.group(1)), []).append(text)
    if m:
        rank, local, code = int(m.group(1)), int(m.group(2)), int(m.group(3))
        how = (f"killed by signal {-code}" + (" (SIGKILL: out of memory, or killed from outside?)" if code == -9 else "")
               if code < 0 else f"exit code {code}")
        out.append(f"failing rank {rank} (torchrun's first failure): {how}; its last lines:")
        out += [f"  [rank {rank}] {t}" for t in by_rank.get(local, [])[-tail:]] or ["  (it printed nothing)"]
    for r, texts in sorted(by_rank.items()):
        errs = [t for t in texts if re.match(r"^\s*[\w.]*(Error|Exception|Interrupt)\b.*:", t)]
        if errs and not (m and r == int(m.group(2))):
            out.append(f"  rank {r} raised: {errs[-1].strip()[:300]}")
    if not out:  # not a torchrun summary (the launcher itself failed): the log's last lines
        out = ["last lines of the job's log:"] + [f"  {t}" for t in [l for l in lines if l.strip()][-tail:]]
    return "\n".join(out)


def slurm_controller_state(tunnel, app_id: str) -> tuple[str | None, int | None]:
    """(JobState, Restarts) of a job as slurmctld holds it now: no accounting lag, and Restarts counts the requeues
    so far. ("FORGOTTEN", None) once slurmctld has dropped the finished job (MinJobAge, 5 minutes by default);
    (None, None) when it did not answer (busy: try again)."""
    out = tunnel.run(f"scontrol -o show job {app_id}", hide=True, warn=True)
    text = out.stdout + out.stderr
    if not out.ok:
        return ("FORGOTTEN", None) if "Invalid job id" in text else (None, None)
    state, restarts = re.search(r"\bJobState=(\S+)", text), re.search(r"\bRestarts=(\d+)", text)
    return (state.group(1) if state else None), (int(restarts.group(1)) if restarts else None)


def slurm_allocations(tunnel, app_id: str) -> list[str]:
    """sacct's state of each allocation of a job, oldest first (-D: a requeued job keeps its id, and each earlier
    allocation reads REQUEUED); [] when accounting does not know the job (yet)."""
    out = tunnel.run(f"sacct -D -X -n -P -j {app_id} --format=JobID,State", hide=True, warn=True)
    rows = [line.split("|") for line in out.stdout.splitlines() if "|" in line] if out.ok else []
    return [state.split()[0] for job_id, state, *_ in rows if job_id == app_id and state.strip()]


def _app_state(slurm_state: str):
    from torchx.schedulers.slurm_scheduler import SLURM_STATES
    from torchx.specs import AppState

    return next((s for prefix, s in SLURM_STATES.items() if slurm_state.startswith(prefix)), AppState.UNKNOWN)


def wait_out_requeues(exp, poll_s: float = 2.0, settle_s: float = 60.0,
                      unreachable_s: float = 900.0) -> dict[str, list[str]]:
    """Wait until every Slurm job of a launched Experiment has ended its last allocation, and set its state from
    that allocation. Returns {job id: sacct's state of each allocation} (printed when the job was requeued).

    nemo-run's wait (exp.run(detach=False)) ends on the first final state sacct reports, and a job that requeues
    itself (a failed try below run.executor.retries, the time-limit signal, a preemption: see DEFAULT_RETRIES) is
    final only after its last allocation. sacct lags slurmctld by seconds both ways, and squeue (pending,
    running and completing jobs) answers nothing both for a finished job and when slurmctld is too busy to
    answer. So slurmctld itself is asked (scontrol: the job's state and its requeue count, Restarts): the job
    is done when slurmctld reads it final on two polls in a row (or has forgotten it) and sacct has caught up:
    one record per allocation (Restarts + 1), the last one final. A cluster without accounting never catches up:
    after settle_s, slurmctld's final state is the outcome. Neither slurmctld nor sacct answering for
    unreachable_s (the cluster is down) ends the wait with nemo-run's state, and says so."""
    from torchx.specs import is_terminal

    outcomes = {}
    for job in exp.jobs:
        if not isinstance(job.executor, run.SlurmExecutor) or not getattr(job, "handle", None):
            continue
        app_id = job.handle.partition("://")[2].split("/")[1]
        tunnel, finals, final_since, answered = job.executor.tunnel, 0, None, time.monotonic()
        while True:
            ctld_state, restarts = slurm_controller_state(tunnel, app_id)
            allocations = slurm_allocations(tunnel, app_id)
            if ctld_state is not None or allocations:
                answered = time.monotonic()
            elif time.monotonic() - answered > unreachable_s:
                print(f"slurm: neither slurmctld nor sacct answered about job {app_id} for {unreachable_s:.0f} s; "
                      f"its state is nemo-run's last read, {job.state}", file=sys.stderr, flush=True)
                break
            ctld_final = ctld_state == "FORGOTTEN" or (ctld_state is not None and is_terminal(_app_state(ctld_state)))
            finals = finals + 1 if ctld_final else 0
            final_since = (final_since or time.monotonic()) if ctld_final else None
            caught_up = bool(allocations) and is_terminal(_app_state(allocations[-1])) and (
                restarts is None or len(allocations) > restarts)
            if finals >= 2 and caught_up:
                job.state = _app_state(allocations[-1])
                break
            if finals >= 2 and ctld_state != "FORGOTTEN" and time.monotonic() - final_since > settle_s:
                job.state = _app_state(ctld_state)  # no accounting (or it is far behind): slurmctld's word
                allocations = (allocations or []) + [f"{ctld_state} (slurmctld; sacct did not catch up)"]
                break
            if ctld_state == "FORGOTTEN" and not allocations and time.monotonic() - final_since > settle_s:
                break  # neither knows the job: nemo-run's state stays
            time.sleep(poll_s)
        outcomes[job.id] = allocations
        if len(allocations) > 1:
            print(f"slurm: job {app_id} ran {len(allocations)} allocations (sacct: {', '.join(allocations)}); "
                  f"the outcome is its last one's, {allocations[-1]}", file=sys.stderr, flush=True)
    return outcomes


def last_allocation_log(job) -> str | None:
    """The log of a Slurm job's last allocation: srun writes one per allocation (log-..._<id>_<restart>.out), and
    nemo-run reads back only the first it lists, the first allocation's; None when none is found."""
    app_id = job.handle.partition("://")[2].split("/")[1]
    tunnel = job.executor.tunnel
    listed = tunnel.run(f"find {shlex.quote(job.executor.job_dir)} -maxdepth 2 -name 'log*_{app_id}_*.out'",
                        hide=True, warn=True)
    logs = [p for p in listed.stdout.split() if re.search(rf"_{app_id}_\d+\.out$", p)] if listed.ok else []
    if not logs:
        return None
    last = max(logs, key=lambda p: int(re.search(r"_(\d+)\.out$", p).group(1)))
    text = tunnel.run(f"cat {shlex.quote(last)}", hide=True, warn=True)
    return text.stdout if text.ok else None


def job_failure(exp) -> str | None:
    """None when every job of a finished nemo-run Experiment SUCCEEDED; else a message with the failing
    rank's last lines (printed to stderr as well). States come from nemo-run (torchrun's exit code for
    run.LocalExecutor) or, for run.SlurmExecutor, from the job's last allocation (wait_out_requeues), whose log
    the report reads."""
    import io

    from nemo_run.run.logs import get_logs
    from torchx.specs import AppState

    problems = []
    for job in exp.jobs:
        states = list(getattr(job, "states", None) or [getattr(job, "state", None)])
        if states and all(s == AppState.SUCCEEDED for s in states):
            continue
        handles = list(getattr(job, "handles", None) or [job.handle])
        report = ""
        last_log = last_allocation_log(job) if isinstance(job.executor, run.SlurmExecutor) else None
        for handle in handles:
            buf = io.StringIO()
            if last_log is not None:  # a requeued job's outcome is its last allocation's
                buf.write(last_log)
            else:
                try:
                    get_logs(buf, identifier=handle, regex=None, should_tail=False)
                except Exception as e:  # no logs to read back (never started): say so, the state still counts
                    buf.write(f"(could not read the job's logs: {e})")
            report += failing_rank_report(buf.getvalue())
        state = ", ".join(str(s).split(".")[-1] for s in states)
        problems.append(f"job {job.id} ended {state} (logs: {job.executor.job_dir})\n{report}")
    if not problems:
        return None
    text = "\n".join(problems)
    print(text, file=sys.stderr, flush=True)
    return f"the job did not succeed: {text.splitlines()[0]}"
