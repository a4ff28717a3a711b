"""A real single-node Slurm (with accounting) on this machine, and Tessera's `slurm` executor on it.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_slurm.py -x -q      # root + apt; ~2-3 min

The module fixture runs `scripts/slurm_local.sh up` (installs slurm/munge/slurmdbd/MariaDB the first time,
~1 min) and `down` in its finalizer; it skips only where this machine cannot run Slurm at all (not root,
no apt-get). Each test submits through nemo-run exactly as a user would: recipes.executors.slurm() (LocalTunnel,
run.Packager(), PATH in env_vars, torchrun), a fresh NEMORUN_HOME without "/nemo_run" in its path (nemo-run
rewrites that substring in no-container sbatch scripts; job ids restart on a re-created cluster), waits for
SUCCEEDED (status comes from sacct, hence accounting), and reads the job's output back through nemo-run.
"""

import concurrent.futures
import io
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import fiddle as fdl
import pytest

import nemo_run as run
from nemo_run.config import get_nemorun_home, set_nemorun_home
from nemo_run.run.logs import get_logs

from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.training.metrics import read_metrics
from tessera.recipes import executors

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "scripts" / "slurm_local.sh"


@pytest.fixture(scope="module")
def slurm_cluster(request):
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (daemons, /etc/slurm, apt-get)")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip("no apt-get to install slurmctld/slurmd/munge/slurmdbd/mariadb-server, and no Slurm installed")
    t0 = time.monotonic()
    up = subprocess.run(["bash", str(SLURM), "up"], capture_output=True, text=True, timeout=900)
    request.addfinalizer(lambda: subprocess.run(["bash", str(SLURM), "down"], capture_output=True, timeout=120))
    if up.returncode == 2:
        pytest.skip(f"this machine cannot run Slurm: {up.stderr.strip()}")
    assert up.returncode == 0, f"slurm_local.sh up failed:\n{up.stdout}\n{up.stderr}"
    print(f"slurm up in {time.monotonic() - t0:.1f}s")


@pytest.fixture
def nemorun_home(tmp_path, monkeypatch):
    home = tmp_path / "nrhome"
    assert "/nemo_run" not in str(home)
    old = get_nemorun_home()
    set_nemorun_home(str(home))
    # LocalTunnel runs sbatch/sacct through invoke, which reads stdin; pytest's captured stdin raises on read
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        yield home
    set_nemorun_home(old)


def _slurm_executor(world: int, time_limit: str = "00:10:00"):
    ex = fdl.build(executors.slurm(time=time_limit))
    assert executors.fit_executor(ex, world) == world
    return ex


def _submit(task, ex, title: str) -> tuple[str, str]:
    """Run one task to completion; return (final state, the log of the job's last allocation)."""
    state, logs, _ = _submit_job(task, ex, title)
    return state, logs


def _submit_job(task, ex, title: str) -> tuple[str, str, str]:
    """Run one task to completion as `nemo tessera` does (recipes/cli.py: requeues waited out); return (final
    state, the log of the job's last allocation, the Slurm job id)."""
    with run.Experiment(title, executor=ex, log_level="WARN") as exp:
        exp.add(task, name="job")
        exp.run(detach=False)
    executors.wait_out_requeues(exp, poll_s=0.5)
    job = exp.jobs[0]
    logs = executors.last_allocation_log(job)
    if logs is None:
        buf = io.StringIO()
        get_logs(buf, identifier=job.handle, regex=None, should_tail=False)
        logs = buf.getvalue()
    return str(job.state), logs, job.handle.partition("://")[2].split("/")[1]


def _slurm_records(job_id: str) -> str:
    """What Slurm itself recorded of a job, for a failing assertion: sacct's allocations, slurmctld's state and
    requeue count, and slurmctld's log lines about it."""
    sacct = subprocess.run(["sacct", "-D", "-j", job_id, "--format=JobID,JobName%12,State,ExitCode,Start,End"],
                           capture_output=True, text=True).stdout
    ctld = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    ctld_log = Path(os.environ.get("TESSERA_SLURM_DIR", "/tmp/tessera-slurm")) / "log" / "slurmctld.log"
    lines = [ln for ln in ctld_log.read_text(errors="replace").splitlines()
             if f"JobId={job_id} " in ln + " "] if ctld_log.exists() else []
    state = " ".join(w for w in (ctld.stdout + ctld.stderr).split() if w.startswith(("JobState=", "Restarts=")))
    return f"sacct -D:\n{sacct}slurmctld: {state}\nslurmctld.log:\n" + "\n".join(lines[-20:])


def _release_requeued(stop: threading.Event) -> None:
    """Background: a job Slurm requeued is held ~2 minutes (Reason BeginTime); let it start at once."""
    while not stop.wait(0.5):
        job = _job_state()
        if job and job[1] == "PENDING" and job[2] == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job[0]}", "StartTime=now"], check=False)


def test_slurm_runs_a_distributed_task(slurm_cluster, nemorun_home):
    """The whole Slurm path with an importable multi-rank function: 2 torchrun ranks run hetero.tools.verify."""
    from tessera.hetero.tools import verify

    layout = "vision=dp2@0-1;language=tp2@0-1"
    state, logs = _submit(run.Partial(verify.main, argv=["--layout", layout]), _slurm_executor(2), "tessera-verify")
    assert state.endswith("SUCCEEDED"), f"job state {state}; logs:\n{logs}"
    assert "verify: PASS" in logs, logs
    assert "world 2" in logs, logs


def test_training_entry_point_is_importable():
    """No cluster needed: the entry point the Slurm jobs run (recipes.cli.finetune/pretrain import
    tessera.recipes.train lazily, on the ranks) exists. A moved or renamed module fails here, loudly, instead of
    only inside a Slurm job or as a skip."""
    import importlib

    train = importlib.import_module("tessera.recipes.train").train
    assert callable(train)


def test_slurm_trains_tiny_recipe(slurm_cluster, nemorun_home, tmp_path):
    """nemotron_vl_tiny (4 CPU ranks) through the slurm executor: SUCCEEDED, logs read back, loss decreased."""
    from tessera.recipes.cli import as_task, finetune
    from tessera.recipes.registry import recipe

    cfg = recipe("nemotron_vl_tiny")
    cfg.trainer.max_steps = 6
    cfg.trainer.run_dir = str(tmp_path / "run")
    cfg.trainer.progress = False
    cfg.trainer.tensorboard = False
    state, logs = _submit(as_task(cfg, finetune), _slurm_executor(4, "00:15:00"), "tessera-tiny")
    assert state.endswith("SUCCEEDED"), f"job state {state}; logs:\n{logs}"
    assert f"run_dir: {cfg.trainer.run_dir}" in logs, logs
    rows = read_metrics(tmp_path / "run")  # the step records (the validation passes have their own)
    assert rows[-1]["step"] == 6, rows
    losses = [r["loss"] for r in rows]
    assert losses[-1] < losses[0], losses


SBATCH_SCRIPT = """
import fiddle as fdl, nemo_run as run
from tessera.recipes import executors
from tessera.recipes.cli import as_task, finetune
from tessera.recipes.registry import recipe
cfg = recipe("nemotron_vl_12b", gpus=16)
ex = fdl.build(executors.slurm(nodes=2, account="acc"))   # no gpus_per_node, default time/retries/signal
executors.fit_executor(ex, 16)
executors.request_gpus(ex, fdl.build(cfg).model)
with run.Experiment("sbatch", executor=ex, log_level="WARN") as exp:
    exp.add(as_task(cfg, finetune), name="job")
    exp.dryrun()
"""


def test_sbatch_script_of_a_full_size_recipe(tmp_path):
    """No cluster needed: the sbatch script nemo-run writes for nemotron_vl_12b on 2 nodes requests the
    layout's 8 GPUs per node, the default time limit, SIGTERM 5 minutes before it, and requeues (nemo-run's
    `scontrol requeue` while SLURM_RESTART_COUNT < retries, Tessera's EXIT trap when that one fails; `sbatch
    --requeue` for preemption)."""
    (tmp_path / "sbatch.py").write_text(SBATCH_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="250", NEMORUN_HOME=str(tmp_path / "nrhome"))
    res = subprocess.run([sys.executable, str(tmp_path / "sbatch.py")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    for line in ("#SBATCH --gpus-per-node=8", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 f"#SBATCH --time={executors.DEFAULT_TIME}", f"#SBATCH --signal={executors.DEFAULT_SIGNAL}",
                 f"TORCHX_MAX_RETRIES={executors.DEFAULT_RETRIES}", 'scontrol requeue "$SLURM_JOB_ID"',
                 "sbatch --requeue", "--nproc-per-node 8",
                 # Tessera's requeue, whatever ended the allocation (issue 61), set before srun runs
                 "trap tessera_requeue_on_exit EXIT",
                 # torchrun waits for the ranks' save on the signal (300 s lead - 30 s margin) and forwards SIGUSR1
                 "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=270", "PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"):
        assert line in out, f"{line!r} not in:\n{out[-5000:]}"


def test_sbatch_script_with_a_container_runs_the_images_python(tmp_path, nemorun_home, monkeypatch):
    """No cluster needed: with container_image the srun line starts the image (the image's torchrun and Python),
    mounts the job directory (the code, shipped by TesseraPackager to /nemo_run/code, the workdir) and the run's
    data and run directories at their own paths (a relative data.path made absolute), and no host path of this
    venv reaches the script (its PATH was exported into the container)."""
    from tessera.recipes.cli import TesseraRunContext, finetune

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds").mkdir()  # no dataset in it: a dry run only notes that (the mounts are what is checked)
    run_dir = tmp_path / "out" / "run"
    # the CLI's own parse, as `nemo tessera finetune ... run.executor=slurm run.executor.container_image=...`
    ctx = TesseraRunContext(name="t", factory="nemotron_vl_tiny", dryrun=True)
    ctx.parse_args(["executor=slurm", "executor.container_image=nvcr.io/nvidia/pytorch:25.01-py3"])
    task = ctx.parse_fn(finetune, ["data.path=ds", f"trainer.run_dir={run_dir}"])
    ex = ctx.executor
    with run.Experiment("container", executor=ex, log_level="WARN") as exp:
        exp.add(task, name="job")
        exp.dryrun(log=False, delete_exp_dir=False)
    [script] = list(Path(nemorun_home).rglob("*_sbatch.sh"))
    text = script.read_text()
    job_dir = script.parent / "job"
    [srun] = [line for line in text.splitlines() if line.startswith("srun ")]
    assert "--container-image nvcr.io/nvidia/pytorch:25.01-py3" in srun and "--container-workdir /nemo_run/code" in srun
    mounts = srun.split("--container-mounts ")[1].split()[0].split(",")
    data = tmp_path / "ds"
    assert {f"{job_dir}:/nemo_run", f"{data}:{data}", f"{run_dir}:{run_dir}"} <= set(mounts), srun
    assert f"mkdir -p {run_dir}" in text.split("srun ")[-2], text  # a mount's source exists before srun
    assert task.data.path == str(data)
    for host in (os.path.dirname(sys.executable), str(ROOT)):
        assert host not in text, f"host path {host} in the sbatch script:\n{text}"
    # the shipped code is what the ranks import from their workdir (first on sys.path), not this checkout
    # (the container's environment, not a test harness's PYTHONPATH)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([sys.executable, "-c", "import tessera.hetero.plan.layout as m; print(m.__file__)"],
                           cwd=job_dir / "code", env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(job_dir / "code" / "tessera" / "hetero" / "plan" / "layout.py"), where


def test_slurm_failed_job_is_reported(slurm_cluster, nemorun_home):
    """A Slurm job whose rank fails (hetero.tools.verify given an unknown flag: argparse exits 2 on the rank;
    a returned exit code would be dropped by nemo-run's function runner, an exception or SystemExit is not)
    ends FAILED in sacct, and job_failure (what makes `nemo` exit 1) says so; retries=0 so it is not
    requeued."""
    from tessera.hetero.tools import verify

    ex = fdl.build(executors.slurm(time="00:05:00", retries=0))
    executors.fit_executor(ex, 1)
    with run.Experiment("tessera-fail", executor=ex, log_level="WARN") as exp:
        exp.add(run.Partial(verify.main, argv=["--layout", "vision=dp1@0-0;language=dp1@0-0", "--no-such-flag"]),
                name="job")
        exp.run(detach=False)
    failure = executors.job_failure(exp)
    assert failure is not None and "FAILED" in failure, failure


def _job_state() -> tuple[str, str, str] | None:
    """(job id, state, reason) of the one job on this test cluster, or None."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %T %r"], capture_output=True, text=True).stdout.split()
    return tuple(out[:3]) if len(out) >= 3 else None


def _signal_each_allocation(run_dir: Path, allocations: int, steps: int, stop: threading.Event) -> list[int]:
    """Background, as Slurm does at a time limit: in each of `allocations` allocations, once the job trained
    `steps` more steps, SIGTERM to every process of its steps through Slurm (scancel --signal, the delivery path of
    --signal=TERM@S); a requeued job is let start at once (Slurm would hold it 2 minutes). Returns the number of
    steps in metrics.jsonl at each signal."""
    sent, seen = [], 0
    while not stop.wait(0.5) and len(sent) < allocations:
        job = _job_state()
        if job and job[1] == "PENDING" and job[2] == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job[0]}", "StartTime=now"], check=True)
        now = len(_metrics(run_dir))
        if job and job[1] == "RUNNING" and now >= seen + steps:
            subprocess.run(["scancel", "--signal=TERM", job[0]], check=True)
            sent.append(now)
            while not stop.wait(0.5) and (_job_state() or ("", ""))[1] == "RUNNING":
                pass  # until this allocation ended (saved and exited)
            seen = len(_metrics(run_dir))
    return sent


def _metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)  # the step records (a validation pass has its own)


def test_slurm_job_saves_on_its_signal_is_requeued_and_resumes_bitwise(slurm_cluster, nemorun_home, tmp_path):
    """The real path of a long job on a real Slurm: no periodic save (save_every=0), far more steps than it will
    train, one requeue (retries=1). Twice Slurm delivers SIGTERM to every process of the job's steps (scancel
    --signal: what --signal=TERM@S does before a time limit, sent here once an allocation trained 2 steps, so the
    test does not depend on how fast this box starts ranks). Each time the ranks finish their step, save it and
    exit non-zero; after the first, nemo-run's sbatch script requeues the job, which resumes from that step in the
    same run directory (named after the job id); after the second the retries are spent and the job ends FAILED,
    its second save on disk. The stitched curve equals an uninterrupted run's bitwise."""
    from tessera.recipes.cli import as_task, finetune
    from tessera.recipes.registry import recipe

    cfg = recipe("nemotron_vl_tiny")
    cfg.trainer.max_steps, cfg.trainer.save_every = 100_000, 0
    cfg.optim.min_lr_ratio = 1.0  # a constant LR after warm-up: the reference's shorter max_steps gives the same LRs
    cfg.trainer.run_dir = str(tmp_path / "run")
    cfg.trainer.progress = cfg.trainer.tensorboard = False
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        signaller = pool.submit(_signal_each_allocation, tmp_path / "run", 2, 2, stop)
        try:
            # generous on a loaded box (issue 61): an allocation has 30 minutes, and torchrun waits up to 570 s
            # (TERM@600 less the margin) for the ranks' step and save before it SIGKILLs them
            ex = fdl.build(executors.slurm(time="00:30:00", signal="TERM@600", retries=1))
            assert executors.fit_executor(ex, 4) == 4
            state, logs, job_id = _submit_job(as_task(cfg, finetune), ex, "tessera-requeue")
        finally:
            stop.set()
        sent = signaller.result()
    records = _slurm_records(job_id)
    rows = _metrics(tmp_path / "run")
    assert len(sent) == 2, f"signals sent at steps {sent}\n{records}\nlast allocation's log:\n{logs[-5000:]}"
    # Slurm's own record: requeued once (the first allocation REQUEUED), the second the last, ended FAILED, and
    # nemo reports that one; slurmctld counted the requeue
    assert executors.slurm_allocations(ex.tunnel, job_id) == ["REQUEUED", "FAILED"], records
    assert executors.slurm_controller_state(ex.tunnel, job_id)[1] in (1, None), records  # None: forgotten
    assert state.endswith("FAILED"), f"job state {state} (retries spent: FAILED expected)\n{records}\n{logs[-5000:]}"
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert len(saved) == 2 and sent[0] <= saved[0] < sent[1] <= saved[1] == len(rows), (
        f"expected a save right after each signal {sent}, got {saved} after {len(rows)} steps; logs:\n{logs[-5000:]}")
    assert [r["step"] for r in rows] == list(range(1, saved[1] + 1)), "each step once, across the requeue"
    from tessera.recipes.train import main as train_main

    # the uninterrupted run: the entry point's own main on 4 forked ranks (no torchrun: the path under test is the
    # job's, and a fork skips 4 interpreters' imports)
    run_on_ranks(4, train_main, ["--recipe", "nemotron_vl_tiny", f"trainer.max_steps={saved[1]}",
                                 "optim.min_lr_ratio=1.0", "trainer.save_every=0",
                                 f"trainer.run_dir={tmp_path / 'reference'}", "trainer.progress=false",
                                 "trainer.tensorboard=false"], timeout=600)
    assert [r["loss"] for r in rows] == [r["loss"] for r in _metrics(tmp_path / "reference")], (
        "the requeued job's curve differs from one uninterrupted run's")


FAILING_REQUEUE_SCONTROL = """#!/bin/bash
# scontrol whose first `requeue` fails as a busy slurmctld's does (the RPC times out); the rest is Slurm's
if [ "$1" = requeue ] && [ ! -e "{mark}" ]; then
    touch "{mark}"
    echo "slurm_requeue error: Socket timed out on send/recv operation (test)" >&2
    exit 1
fi
exec {scontrol} "$@"
"""


def test_slurm_requeues_when_its_first_requeue_fails(slurm_cluster, nemorun_home, tmp_path):
    """Issue 61: an allocation that ends non-zero with retries left is requeued even when nemo-run's own
    `scontrol requeue` fails (its sbatch script runs it under `set -e`: the job ended FAILED, never requeued);
    Tessera's EXIT trap requeues it. The job fails its first allocation and succeeds in its second, and `nemo`
    reports the last allocation's outcome (SUCCEEDED), with Slurm's records showing the two allocations."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(FAILING_REQUEUE_SCONTROL.format(mark=tmp_path / "failed-once",
                                                                   scontrol=shutil.which("scontrol")))
    (fake / "scontrol").chmod(0o755)
    ex = fdl.build(executors.slurm(time="00:05:00", retries=1))
    ex.launcher = None  # a plain script: the requeue is what is under test, not torchrun
    ex.ntasks_per_node = 1
    ex.env_vars["PATH"] = f"{fake}:{ex.env_vars['PATH']}"
    script = run.Script(inline='echo "allocation ${SLURM_RESTART_COUNT:-0}"; [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]')
    stop = threading.Event()
    releaser = threading.Thread(target=_release_requeued, args=(stop,), daemon=True)
    releaser.start()
    try:
        state, logs, job_id = _submit_job(script, ex, "tessera-requeue-retry")
    finally:
        stop.set()
        releaser.join()
    records = _slurm_records(job_id)
    assert (tmp_path / "failed-once").exists(), f"nemo-run's requeue never ran\n{records}"
    assert executors.slurm_allocations(ex.tunnel, job_id) == ["REQUEUED", "COMPLETED"], records
    assert state.endswith("SUCCEEDED"), f"job state {state}\n{records}\n{logs}"
    assert "allocation 1" in logs, logs  # the last allocation's log is the one read back


class _ScriptedSlurm:
    """A tunnel whose scontrol and sacct answer from a timeline, one entry per poll: (slurmctld's JobState and
    Restarts, or None for "did not answer", or "FORGOTTEN"; sacct's allocation states). No cluster needed."""

    def __init__(self, timeline):
        self.timeline, self.polls = timeline, 0

    def run(self, cmd, hide=True, warn=True):
        ctld, allocations = self.timeline[min(self.polls, len(self.timeline) - 1)]
        if cmd.startswith("scontrol"):
            if ctld is None:
                return _Answer(False, "", "slurm_load_jobs error: Socket timed out on send/recv operation")
            if ctld == "FORGOTTEN":
                return _Answer(False, "", "slurm_load_jobs error: Invalid job id specified")
            return _Answer(True, f"JobId=42 JobName=job JobState={ctld[0]} Reason=None Restarts={ctld[1]} ", "")
        self.polls += 1  # sacct is asked last in a poll
        return _Answer(True, "".join(f"42|{state}\n" for state in allocations), "")


class _Answer:
    def __init__(self, ok, stdout, stderr):
        self.ok, self.stdout, self.stderr = ok, stdout, stderr


@pytest.mark.parametrize("timeline, polls, outcome", [
    # slurmctld too busy to answer while sacct reads the first allocation's FAILED, then pending again (sacct
    # still FAILED) and running: waited out to the last allocation's state
    ([(("RUNNING", 0), ["RUNNING"]), (None, ["FAILED"]), (("PENDING", 1), ["FAILED"]),
      (("RUNNING", 1), ["REQUEUED", "RUNNING"]), (("COMPLETED", 1), ["REQUEUED", "COMPLETED"])], 6,
     ("SUCCEEDED", ["REQUEUED", "COMPLETED"])),
    # requeued between two polls, sacct a poll behind slurmctld: the last allocation's FAILED, not the first's end
    ([(("RUNNING", 0), ["RUNNING"]), (None, ["RUNNING"]), (("PENDING", 1), ["REQUEUED"]),
      (("RUNNING", 1), ["REQUEUED", "RUNNING"]), (("FAILED", 1), ["REQUEUED", "RUNNING"]),
      (("FAILED", 1), ["REQUEUED", "FAILED"])], 6, ("FAILED", ["REQUEUED", "FAILED"])),
    # sacct a whole allocation behind: its FAILED is the first allocation's; slurmctld counted the requeue
    ([(("FAILED", 1), ["FAILED"]), (("FAILED", 1), ["FAILED"]), (("FAILED", 1), ["REQUEUED", "COMPLETED"])], 3,
     ("SUCCEEDED", ["REQUEUED", "COMPLETED"])),
    # one final-looking read between allocations is not the end: final on two polls in a row
    ([(("FAILED", 0), ["FAILED"]), (("PENDING", 1), ["REQUEUED"]), (("COMPLETED", 1), ["REQUEUED", "COMPLETED"])],
     4, ("SUCCEEDED", ["REQUEUED", "COMPLETED"])),
    # slurmctld has forgotten the finished job: sacct's record is the outcome
    ([("FORGOTTEN", ["REQUEUED", "COMPLETED"])], 2, ("SUCCEEDED", ["REQUEUED", "COMPLETED"])),
])
def test_wait_reports_the_last_allocation(timeline, polls, outcome):
    """No cluster needed: wait_out_requeues ends only when slurmctld reads the job final twice in a row and sacct
    holds one final record per allocation, and sets the job's state from the last allocation."""
    from types import SimpleNamespace

    ex = fdl.build(executors.slurm())
    ex.tunnel = _ScriptedSlurm(timeline)
    job = SimpleNamespace(id="job", executor=ex, handle="slurm_tunnel://nemo_run/42", state=None)
    outcomes = executors.wait_out_requeues(SimpleNamespace(jobs=[job]), poll_s=0)
    assert (str(job.state).split(".")[-1], outcomes["job"]) == outcome
    assert ex.tunnel.polls == polls


def test_wait_gives_up_on_a_cluster_that_never_answers():
    """No cluster needed: slurmctld and sacct both down (neither answers) ends the wait after unreachable_s with
    nemo-run's state, instead of polling forever."""
    from types import SimpleNamespace

    ex = fdl.build(executors.slurm())
    ex.tunnel = _ScriptedSlurm([(None, [])])
    job = SimpleNamespace(id="job", executor=ex, handle="slurm_tunnel://nemo_run/42", state="FAILED")
    assert executors.wait_out_requeues(SimpleNamespace(jobs=[job]), poll_s=0.01, unreachable_s=0.3) == {"job": []}
    assert job.state == "FAILED" and ex.tunnel.polls > 1
