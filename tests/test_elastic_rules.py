"""Elastic training's rules without processes (issue 36; the launches themselves: tests/test_elastic.py): a layout
shrunk by DP, the resolution of a restart on another world (scaled, else the planner's; memory checked; a world too
small named with the smallest that fits), the world-change records, and the sbatch script of an elastic job."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import fiddle as fdl
import nemo_run as run
import pytest
from nemo_run.config import get_nemorun_home, set_nemorun_home

from tessera.hetero.plan.layout import HeteroLayout, LayoutError, scale_layout
from tessera.hetero.training.metrics import RunMetrics, read_metrics
from tessera.recipes import elastic, executors
from tessera.recipes.checks import resolve
from tessera.recipes.elastic import WorldTooSmall, resolve_restart
from tessera.hetero.runspec.config import TrainerConfig
from tessera.recipes.registry import recipe


@pytest.mark.parametrize("layout, world, shrunk", [
    ("vision=dp4@0-3;language=tp2,dp2@0-3", 2, "vision=dp2@0-1;language=tp2,dp1@0-1"),
    ("vision=dp2@0-1;audio=dp2@0-1;language=tp2,dp2@2-5", 3, "vision=dp1@0-0;audio=dp1@0-0;language=tp2,dp1@1-2"),
    ("vision=tp4,cp2,dp2@0-15;language=tp4,cp2,dp2@0-15", 8, "vision=tp4,cp2,dp1@0-7;language=tp4,cp2,dp1@0-7"),
])
def test_a_layout_shrinks_by_data_parallelism_and_grows_back(layout, world, shrunk):
    small = scale_layout(layout, world)
    assert str(small) == shrunk and small.world_size == world
    assert scale_layout(small, HeteroLayout.parse(layout).world_size) == HeteroLayout.parse(layout)


@pytest.mark.parametrize("layout, world, module", [
    ("vision=dp4@0-3;audio=dp4@0-3;language=tp2,cp2@0-3", 2, "language"),   # the tiny omni recipe's LLM: dp1
    ("vision=dp1@0-0;audio=dp1@1-1;language=pp2,dp1@2-3", 2, "vision"),
    ("vision=dp3@0-2;language=dp1@3-3", 2, "vision"),
])
def test_a_layout_that_does_not_divide_is_not_shrunk(layout, world, module):
    with pytest.raises(LayoutError, match=f"cannot shrink .* module '{module}'"):
        scale_layout(layout, world)


def _cfg(name: str, **kw):
    return fdl.build(recipe(name, **kw))


def test_a_restart_on_fewer_ranks_scales_the_layout_or_takes_the_planners_and_keeps_the_rows():
    vl = _cfg("nemotron_vl_tiny")
    with pytest.raises(LayoutError, match="exceed the world"):
        resolve(vl, 2)  # a fixed-size run refuses another world, as before
    scaled = resolve_restart(vl, 2, 2)
    assert str(scaled.layout) == "vision=dp2@0-1;language=tp2,dp1@0-1"
    assert scaled.rows_per_step == vl.data.rows_per_microbatch * vl.data.microbatches
    assert str(resolve_restart(vl, 8, 2).layout) == "vision=dp8@0-7;language=tp2,dp4@0-7"  # grown back and beyond
    omni = _cfg("nemotron_omni_tiny")  # its LLM (tp2,cp2, dp1) has no DP to shrink: the planner's best for 2 ranks
    planned = resolve_restart(omni, 2, 2)
    assert str(planned.layout) == "vision=dp2@0-1;audio=dp2@0-1;language=dp2@0-1"
    assert planned.rows_per_step == 8
    big = _cfg("nemotron_vl_12b", gpus=16)  # 16 -> 8 GPUs: dp2 -> dp1, 55.7 GiB predicted of 80
    assert str(resolve_restart(big, 8, 8).layout) == "vision=tp4,cp2,dp1@0-7;language=tp4,cp2,dp1@0-7"


def test_a_world_no_layout_tiles_trains_on_fewer_ranks_and_leaves_the_rest_as_spares():
    """128 rows cannot go over DP 15 or 13 (nor 7 for the tiny omni's 8): the run trains on the largest smaller world
    that works, its lowest ranks, and the rest wait. A world that trains needs no spares."""
    omni = _cfg("nemotron_omni_tiny")  # 3 ranks on one node of 3: nothing tiles 3, the planner's best for 2 does
    run = resolve_restart(omni, 3, 3)
    assert (run.world, run.spares, str(run.layout)) == (2, 1, "vision=dp2@0-1;audio=dp2@0-1;language=dp2@0-1")
    assert run.rows_per_step == 8
    assert resolve_restart(omni, 4, 2).spares == 0
    vl = _cfg("nemotron_vl_12b", gpus=128)  # a 16-node job loses a node: 15 and 14 nodes have no layout either
    run = resolve_restart(vl, 120, 8)
    assert (run.world, run.spares) == (96, 24), (run.world, run.spares)
    assert run.rows_per_step == 128 and run.layout.world_size == 96


def test_a_world_too_small_for_any_layout_names_the_smallest_that_fits():
    """The 30B-A3B omni recipe on 32 GPUs loses half of them: its layout scaled to 16 ranks needs 100 GiB a GPU,
    and nothing the planner proposes fits 16; 32 does. (Nodes of 16 GPUs: one larger world to price.)"""
    omni = _cfg("nemotron_omni_30b_a3b")
    with pytest.raises(WorldTooSmall) as e:
        resolve_restart(omni, 16, 16)
    msg = str(e.value)
    assert "does not fit memory (memory: ranks 0-15 need" in msg, msg
    assert "the smallest world that fits is 32 ranks (2 nodes of 16)" in msg and "checkpoint is intact" in msg, msg


def test_every_world_change_is_recorded_with_the_steps_redone(tmp_path, capsys):
    def steps(first: int, last: int, world: int) -> str:
        return "".join(f'{{"step": {s}, "world": {world}, "loss": 1.0}}\n' for s in range(first, last + 1))

    (tmp_path / "metrics.jsonl").write_text(steps(1, 6, 4))  # a 4-rank run that saved step 4, died after step 6
    m = RunMetrics(tmp_path, 10, first_step=4, progress=False, tensorboard=False)
    change = m.log_world_change(4, 2, "B@0-1", (4, "A@0-3"), spares=1)  # 3 ranks left, one waits as a spare
    assert change == {"old_world": 4, "new_world": 2, "old_layout": "A@0-3", "new_layout": "B@0-1", "spares": 1,
                      "steps_redone": 2}
    m.file.write(steps(5, 7, 2))
    m.file.close()
    assert ("world change at step 4: 4 -> 2 ranks (1 more launched rank waits as a spare), layout A@0-3 -> B@0-1; "
            "2 steps redone") in capsys.readouterr().err
    # the 2-rank run saved step 7 and grows back: the old world is the last change's, not the checkpoint's
    m = RunMetrics(tmp_path, 10, first_step=7, progress=False, tensorboard=False)
    assert m.log_world_change(7, 4, "A@0-3", (4, "A@0-3"))["old_world"] == 2
    m.file.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 8))  # train records only, each once
    assert [(r["step"], r["world_change"]["new_world"]) for r in read_metrics(tmp_path, "world")] == [(4, 2), (7, 4)]
    (tmp_path / "new").mkdir()
    fresh = RunMetrics(tmp_path / "new", 10, first_step=0, progress=False, tensorboard=False)
    assert fresh.log_world_change(0, 4, "A@0-3", None) is None  # a first start changes nothing
    same = RunMetrics(tmp_path, 10, first_step=7, progress=False, tensorboard=False)
    assert same.log_world_change(7, 4, "A@0-3", (2, "B@0-1")) is None  # the last change already says 4 / A


def _children() -> set[int]:
    me, out = str(os.getpid()), set()
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                out.add(int(p.name))
        except (OSError, IndexError):
            pass
    return out


def _blocked(pid: int) -> set:
    """The signals process `pid` blocks (/proc's SigBlk), or {} when it is gone."""
    try:
        line = next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("SigBlk"))
    except (OSError, StopIteration):
        return set()
    bits = int(line.split()[1], 16)
    return {s for s in signal.Signals if bits >> (s - 1) & 1}


@pytest.mark.parametrize("method", ["spawn", "fork"])  # a GPU rank's server, a CPU rank's
def test_the_checkpoint_writers_queue_outlives_a_stop_signal(monkeypatch, method):
    """torchrun stops (and elastically restarts) its workers with SIGTERM to each rank's process group, which holds
    the checkpoint writer's Manager server: it must live on for the save the signal asks for, also when the signal
    reaches it while it is being started (a save that starts as the signal arrives)."""
    import threading

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from tessera.hetero.training import preemption

    monkeypatch.setattr(fa, "_results_queue", None)
    monkeypatch.setattr(fa, "_get_write_results_queue", lambda: None)  # megatron's own again after the test
    # a rank's first save also starts multiprocessing's resource tracker (whose start unblocks SIGTERM): a fresh
    # tracker here, whatever this process ran before (a forked test process inherits its parent's, running)
    from multiprocessing import resource_tracker

    tracker = resource_tracker.ResourceTracker()
    for name in ("ensure_running", "register", "unregister", "getfd"):
        monkeypatch.setattr(resource_tracker, name, getattr(tracker, name))
    monkeypatch.setattr(resource_tracker, "_resource_tracker", tracker)
    preemption.shield_checkpoint_queue(method)
    before, started, hit = _children(), threading.Event(), {}

    def signal_new_children():  # every stop signal, at every child this test starts, from its first moment on
        while True:
            # one last pass after the start returned: a forked server can start between two passes (CI, loaded)
            last = started.is_set()
            for pid in _children() - before:
                hit.setdefault(pid, _blocked(pid))
                for s in preemption.STOP_SIGNALS:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, s)
            if last:
                return
            time.sleep(0.002)

    bomber = threading.Thread(target=signal_new_children)
    bomber.start()
    try:
        queue = fa._get_write_results_queue()
    finally:
        started.set()
        bomber.join()
    manager = preemption._MANAGERS.pop()
    try:
        server = manager._process.pid
        assert server in hit, f"the test signalled no {method}ed server"
        assert set(preemption.STOP_SIGNALS) <= hit[server] and set(preemption.STOP_SIGNALS) <= _blocked(server), (
            "the server must have the stop signals blocked from its first moment (a handler comes too late)")
        for s in preemption.STOP_SIGNALS:
            os.kill(manager._process.pid, s)
        time.sleep(0.5)
        assert manager._process.is_alive(), "a stop signal killed the checkpoint writer's queue"
        queue.put("written")
        assert queue.get(timeout=10) == "written"
    finally:
        manager.shutdown()
        tracker._stop()


def test_elastic_fields_are_checked():
    with pytest.raises(ValueError, match="elastic_min_nodes=-1 must be a whole number"):
        TrainerConfig(elastic_min_nodes=-1)
    assert TrainerConfig(elastic_min_nodes=2).elastic_max_restarts == 3


@pytest.fixture
def nemorun_home(tmp_path, monkeypatch):
    old = get_nemorun_home()
    set_nemorun_home(str(tmp_path / "nrhome"))
    with open("/dev/null") as devnull:  # nemo-run's LocalTunnel reads stdin
        monkeypatch.setattr(sys, "stdin", devnull)
        yield tmp_path / "nrhome"
    set_nemorun_home(old)


def _parse(args: list[str], executor: list[str], factory: str = "nemotron_vl_tiny"):
    from tessera.recipes.cli import TesseraRunContext, finetune

    ctx = TesseraRunContext(name="t", factory=factory, dryrun=True)
    ctx.parse_args(executor)
    return ctx, ctx.parse_fn(finetune, args)


def test_the_sbatch_script_of_an_elastic_job(nemorun_home, tmp_path, capsys):
    """2 nodes of 2 ranks, MIN 1: sbatch asks for 1-2 nodes and keeps the allocation when one dies, srun keeps the
    other tasks (its last option values win, as srun itself reports), torchrun rendezvouses elastically."""
    ctx, task = _parse(["trainer.elastic_min_nodes=1", f"trainer.run_dir={tmp_path / 'run'}"],
                       ["executor=slurm", "executor.nodes=2"])
    assert "elastic: 1-2 nodes, 2 ranks a node; on 2 ranks the run trains in vision=dp2@0-1;language=tp2,dp1@0-1" in \
        capsys.readouterr().out
    with run.Experiment("elastic", executor=ctx.executor, log_level="WARN") as exp:
        exp.add(task, name="job")
        exp.dryrun(log=False, delete_exp_dir=False)
    [script] = list(Path(nemorun_home).rglob("*_sbatch.sh"))
    text = script.read_text()
    assert "#SBATCH --nodes=1-2\n" in text and "#SBATCH --no-kill\n" in text and "#SBATCH --nodes=2\n" not in text
    [srun] = [line for line in text.splitlines() if line.startswith("srun ")]
    assert "--kill-on-bad-exit=1 --kill-on-bad-exit=0 --no-kill --wait=0 " in srun, srun
    for part in ("torchrun --rdzv-backend c10d --rdzv-endpoint", "--nnodes 1:2 --nproc-per-node 2"):
        assert part in srun, srun
    for line in ("export PET_MAX_RESTARTS=3", "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        assert line in text, text
    if shutil.which("srun"):  # srun prints its options before it looks for a controller
        opts = srun.split(" torchrun ")[0].split()[1:]
        try:
            out = subprocess.run(["srun", "-v", *opts, "true"], capture_output=True, text=True, timeout=2).stderr
        except subprocess.TimeoutExpired as e:
            out = (e.stderr or b"").decode()
        assert "kill-on-bad-exit    : 0" in out and "wait                : 0" in out, out


def test_elastic_minimums_the_launch_cannot_keep_are_refused_before_launch(nemorun_home, tmp_path):
    with pytest.raises(ValueError, match="elastic_min_nodes=3 is more than the job's run.executor.nodes=2"):
        _parse(["trainer.elastic_min_nodes=3"], ["executor=slurm", "executor.nodes=2"])
    with pytest.raises(ValueError, match="run.executor=local is one node"):
        _parse(["trainer.elastic_min_nodes=2"], ["executor=local"])
    with pytest.raises(ValueError, match="needs a launcher"):
        elastic.make_elastic(None, 1, 3)
    # the 30B-A3B omni recipe on 2 nodes of 16 GPUs cannot train on one (tests above: nothing fits 16 ranks)
    with pytest.raises(WorldTooSmall, match="cannot train on 16 ranks nor on fewer of them .*: the smallest world "
                                            "that fits is 32 ranks"):
        _parse(["trainer.elastic_min_nodes=1"], ["executor=slurm", "executor.nodes=2", "executor.gpus_per_node=16"],
               "nemotron_omni_30b_a3b")
    local = fdl.build(executors.local())
    executors.fit_executor(local, 4)
    assert elastic.make_elastic(local, 1, 5) == (1, 1) and local.env_vars["PET_MAX_RESTARTS"] == "5"


@pytest.mark.multiproc
def test_a_fixed_layout_under_an_elastic_launcher_says_which_setting_replans_and_is_not_retried(tmp_path):
    """torchrun --nnodes 1:2 with one agent (the other node gone) starts 2 ranks of a run whose layout is fixed to 4
    (trainer.elastic_min_nodes unset): each rank says the launcher started it elastically on 2 ranks, the layout is
    fixed to 4 and trainer.elastic_min_nodes re-plans it; the agent ends non-zero at once, its 3 restarts unused."""
    from tests.test_elastic import RDZV, _free_port

    layout = "vision=dp2@0-1;audio=dp2@0-1;language=tp2@2-3"
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fixed-layout",
           "--rdzv-conf", f"is_host=1,{RDZV}", "--max-restarts", "3", "--monitor-interval", "0.2",
           "-m", "tessera.recipes.train", "--recipe", "nemotron_omni_tiny", f"layout={layout}",
           "trainer.max_steps=2", "trainer.progress=false", f"trainer.run_dir={tmp_path / 'run'}"]
    res = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", **elastic.ELASTIC_ENV), capture_output=True,
                         text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert ("elastic: torchrun started this job on 2 ranks, but the run's layout is fixed to 4 ranks "
            f"(layout={layout})") in out, out[-3000:]
    assert "Set trainer.elastic_min_nodes=MIN" in out, out[-3000:]
    # said once, by rank 0 of the one start: the agent never restarted the ranks (its 3 restarts unused)
    assert out.count("elastic: torchrun") == 1 and "(restart 1)" not in out, out[-3000:]


def test_the_fixed_layout_message_names_the_restart_the_worlds_and_the_setting():
    msg = elastic.fixed_layout_message(2, "vision=dp4@0-3;language=tp2,dp2@0-3", 4, restart=1)
    assert msg.startswith("elastic: torchrun restarted this job elastically (restart 1) on 2 ranks, but the run's "
                          "layout is fixed to 4 ranks (layout=vision=dp4@0-3;language=tp2,dp2@0-3)")
    assert "trainer.elastic_min_nodes=MIN" in msg and "launch exactly 4 ranks" in msg


@pytest.mark.parametrize("device, method", [(None, "fork"), ("cuda:0", "spawn")])  # None: this box's, the CPU
def test_a_rank_starts_its_checkpoint_queue_server_by_its_device(monkeypatch, tmp_path, device, method):
    """The training loop shields the writer's queue before anything is built, with the start method of the rank's
    device: forked on a CPU rank (a spawned server is an interpreter importing the trainer: ~4 CPU-s a rank and
    launch), spawned on a GPU as megatron does (a fork's garbage collector could free the parent's CUDA tensors)."""
    import torch
    import torch.distributed as dist

    from tessera.hetero.runtime.world import one_rank_world
    from tessera.hetero.training import loop

    class Built(Exception):
        pass

    chosen = []
    monkeypatch.setattr(loop, "shield_checkpoint_queue", chosen.append)
    monkeypatch.setattr(loop, "resolve_val_sets", lambda *a, **k: (_ for _ in ()).throw(Built()))  # stop here
    cfg = fdl.build(recipe("nemotron_vl_tiny"))
    cfg.layout = "vision=dp1@0-0;language=dp1@0-0"
    created = one_rank_world(backend="gloo")
    try:
        with pytest.raises(Built):
            loop.run_training(cfg, resolve(cfg, 1), tmp_path, stop=None,
                              device=torch.device(device) if device else None)
    finally:
        if created:
            dist.destroy_process_group()
    assert chosen == [method]
