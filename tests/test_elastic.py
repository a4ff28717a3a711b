"""Elastic training (issue 36) on this box: two torchrun agents on localhost (2 ranks each, c10d rendezvous on
127.0.0.1, `--nnodes 1:2`) train the tiny VL recipe in a layout whose LLM (tp2,cp2) has no data parallelism to
shrink; after the step-4 checkpoint (once step 5 is logged) one agent and all its processes are SIGKILLed, as a
node dies. The other agent restarts its ranks on a world of 2: they train in the planner's best layout for 2 ranks
(encoder and LLM on a rank each), the step's rows kept, from the step-4 checkpoint (step 5 redone). Once a step on 2
ranks is logged, the killed agent comes back: the survivor's agent restarts its ranks (they save the step they are
in on the way out) and the job grows back to 4 ranks in the run's layout and finishes. One launch; the tests read
what it left. The curve, each step once, equals an uninterrupted 4-rank run's within 1e-5 (fp32, three layouts).
The agent hosting the rendezvous store (is_host=1, as the head node's on Slurm) is the one that survives.
A world that no layout tiles (3 ranks for the tiny omni recipe) trains on its lowest ranks; the rest wait as spares.

Why VL for the node loss and omni for the spares: a fresh omni rank imports NeMo's ASR collection (~19 CPU-s a rank
here against ~7 for VL), and this launch starts 10 ranks; the omni recipe's re-plan (its audio module included) is
tests/test_elastic_rules.py's, its audio resharded on a resume tests/test_train_hetero.py's."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.training.metrics import read_metrics
from tessera.recipes.elastic import ELASTIC_ENV
from tests._run_curves import rel, seed_run_dir
from tests.test_train_fault import MARKER, _job, _survivors

pytestmark = pytest.mark.multiproc

STEPS, SAVE_EVERY = 12, 4
TIMEOUT_S = 30  # trainer.timeout_s: the collective timeout (gloo sees a dead peer's closed socket at once anyway)
# torchrun's rendezvous, short for this box: a dead agent is dropped after 3 missed 1 s keep-alives, and a round
# closes 3 s after it has MIN agents (torch's defaults: 15 s and 30 s)
RDZV = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=3"
COMMON = [f"trainer.max_steps={STEPS}", f"trainer.save_every={SAVE_EVERY}", f"trainer.timeout_s={TIMEOUT_S}",
          "trainer.progress=false", "trainer.tensorboard=false", "trainer.log_every=1", "data.val_path=None"]
# the node loss: the tiny VL recipe with an LLM that does not shrink by DP (tp2,cp2, dp1): the planner re-plans
LAYOUT = "vision=dp4@0-3;language=tp2,cp2@0-3"
RECIPE = ["--recipe", "nemotron_vl_tiny", f"layout={LAYOUT}", *COMMON]
# the spares: the tiny omni recipe, whose 8 rows no layout tiles over 3 ranks (VL's does: language=pp2 on 2 of them)
SPARES_RECIPE = ["--recipe", "nemotron_omni_tiny", *COMMON]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A node that comes back: torchrun started when `go` exists, its imports done before (the grow is then prompt: steps
# on 2 ranks take 0.4 s, and an interpreter importing torch on this box ~5 s)
_WARM = ("import os, sys, time\nimport torch.distributed.run as torchrun\nwhile not os.path.exists(sys.argv[1]):\n"
         "    time.sleep(0.05)\nsys.argv = ['torchrun', *sys.argv[2:]]\ntorchrun.main()\n")


def _agent(port: int, host: bool, run_dir: Path, go: Path | None = None) -> list[str]:
    launcher = ["-c", _WARM, str(go)] if go else ["-m", "torch.distributed.run"]
    return [sys.executable, *launcher, "--nnodes", "1:2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
            "--rdzv-conf", f"is_host={int(host)},{RDZV}", "--max-restarts", "3", "--monitor-interval", "0.2",
            "-m", "tessera.recipes.train", *RECIPE, "trainer.elastic_min_nodes=1", f"trainer.run_dir={run_dir}"]


def _env(marker: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", **ELASTIC_ENV, **{MARKER: marker})


def _wait(what, proc, log: Path, timeout: float = 420.0):
    end = time.monotonic() + timeout
    while not (found := what()):
        assert proc.poll() is None and time.monotonic() < end, log.read_text()[-4000:]
        time.sleep(0.2)
    return found


def _steps(run_dir: Path) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except ValueError:  # a line being written
        return []


def _latest(run_dir: Path) -> str:
    path = run_dir / "checkpoints" / "latest"
    return path.read_text().strip() if path.exists() else ""


def _uninterrupted(tmp_path_factory, recipe: list[str]) -> tuple[Path, float]:
    """The 4-rank run an elastic one is compared with (checkpoints every SAVE_EVERY steps): (run dir, seconds)."""
    base = tmp_path_factory.mktemp("uninterrupted")
    t0 = time.monotonic()
    from tessera.recipes.train import main as train_main

    # the entry point's main on 4 forked ranks: the agents' command, without 4 interpreters' imports
    run_on_ranks(4, train_main, [*recipe, f"trainer.run_dir={base}"], timeout=600)
    return base, time.monotonic() - t0


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, float]:
    return _uninterrupted(tmp_path_factory, RECIPE)


@pytest.fixture(scope="module")
def uninterrupted_omni(tmp_path_factory) -> tuple[Path, float]:
    return _uninterrupted(tmp_path_factory, SPARES_RECIPE)


@pytest.fixture(scope="module")
def elastic(tmp_path_factory, uninterrupted):
    """The uninterrupted run, then the elastic one: (run dir, survivor's log, baseline losses, facts)."""
    root = tmp_path_factory.mktemp("elastic")
    base, seconds = uninterrupted
    facts = {"uninterrupted_s": seconds}

    run_dir, port, marker, go = root / "run", _free_port(), uuid.uuid4().hex, root / "rejoin"
    logs = {n: root / f"agent_{n}.log" for n in "abc"}
    t0 = time.monotonic()
    # the joining agent first: its client waits for the store that the host agent opens moments later, so both
    # are in the first round (4 ranks) well inside its last call
    with contextlib.ExitStack() as jobs:
        try:
            b = jobs.enter_context(_job(_agent(port, False, run_dir), logs["b"], _env(f"{marker}-b")))
            a = jobs.enter_context(_job(_agent(port, True, run_dir), logs["a"], _env(f"{marker}-a")))
            _wait(lambda: _steps(run_dir), a, logs["a"])
            # the node that will come back, warming up meanwhile
            c = jobs.enter_context(_job(_agent(port, False, run_dir, go), logs["c"], _env(f"{marker}-c")))
            _wait(lambda: _latest(run_dir) == f"step_{SAVE_EVERY:06d}" and len(_steps(run_dir)) > SAVE_EVERY,
                  a, logs["a"])
            killed = _survivors(f"{marker}-b", wait_s=0)  # SIGKILLs the agent, its ranks and their helpers
            t_kill = time.monotonic()
            facts["killed"] = len(killed)
            b.wait(timeout=60)
            # no step completes without the dead ranks: what the survivors' restart will redo
            facts["before_kill"] = [r["step"] for r in _steps(run_dir)]
            _wait(lambda: any(r["world"] == 2 for r in _steps(run_dir)), a, logs["a"])
            facts["kill_to_first_step_s"] = time.monotonic() - t_kill
            go.touch()
            facts["rc_a"] = a.wait(timeout=600)
            facts["rc_c"] = c.wait(timeout=120)
        finally:
            facts["left"] = {**_survivors(f"{marker}-a"), **_survivors(f"{marker}-b"), **_survivors(f"{marker}-c")}
    facts["elastic_s"] = time.monotonic() - t0
    print(f"\nelastic: kill to the first step on 2 ranks {facts['kill_to_first_step_s']:.1f} s; uninterrupted run "
          f"{facts['uninterrupted_s']:.0f} s, elastic run {facts['elastic_s']:.0f} s")
    return run_dir, logs["a"].read_text(), [r["loss"] for r in read_metrics(base)], facts


def test_a_lost_node_shrinks_the_job_which_redoes_the_steps_since_the_checkpoint(elastic):
    run_dir, log, uninterrupted, facts = elastic
    assert facts["killed"] >= 3, "the killed agent had no ranks"  # the agent, its 2 ranks (and their reapers)
    assert facts["rc_a"] == 0, log[-4000:]
    assert not facts["left"], f"processes left behind: {facts['left']}"
    shrink = read_metrics(run_dir, "world")[0]
    assert shrink["step"] == SAVE_EVERY, shrink
    change = shrink["world_change"]
    assert (change["old_world"], change["new_world"]) == (4, 2), change
    assert change["old_layout"] == "vision=dp4@0-3;language=tp2,cp2,dp1@0-3"
    assert change["new_layout"] == "vision=dp1@0-0;language=dp1@1-1"  # the planner's: non-colocated
    assert change["steps_redone"] == facts["before_kill"][-1] - SAVE_EVERY >= 1, (change, facts)
    assert f"elastic: 2 ranks (the run's layout has 4): layout {change['new_layout']}, the planner's best" in log
    assert f"world change at step {SAVE_EVERY}: 4 -> 2 ranks" in log
    # steps 1-4 on 4 ranks; step 5 redone on 2 (the run's own records: each step once)
    worlds = {r["step"]: r["world"] for r in read_metrics(run_dir)}
    assert [worlds[s] for s in range(1, SAVE_EVERY + 2)] == [4] * SAVE_EVERY + [2], worlds
    assert facts["kill_to_first_step_s"] < TIMEOUT_S + 30, facts


def test_a_returning_node_grows_the_job_back_and_the_curve_is_the_uninterrupted_one(elastic):
    run_dir, log, uninterrupted, facts = elastic
    assert facts["rc_c"] == 0, facts
    changes = [r["world_change"] | {"step": r["step"]} for r in read_metrics(run_dir, "world")]
    assert len(changes) == 2, changes
    grow = changes[1]
    assert (grow["old_world"], grow["new_world"]) == (2, 4), grow
    assert grow["new_layout"] == changes[0]["old_layout"], "back on 4 ranks: the recipe's own layout"
    assert grow["steps_redone"] == 0, "a grow saves the step the ranks are in: nothing is redone"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    worlds = [r["world"] for r in rows]
    assert worlds[-1] == 4 and 2 in worlds, worlds
    loss = [r["loss"] for r in rows]
    assert loss[:SAVE_EVERY] == uninterrupted[:SAVE_EVERY], "the same layout and world before the kill: bitwise"
    assert rel(loss, uninterrupted) <= 1e-5, f"the elastic curve differs by {rel(loss, uninterrupted):.2e}"
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}").is_dir()


def test_a_world_no_layout_tiles_trains_on_its_lowest_ranks_and_the_rest_wait_as_spares(uninterrupted_omni, tmp_path):
    """One agent of 3 ranks (--nnodes 1:1) resumes the 4-rank run's step-4 checkpoint: no layout of the tiny omni
    tiles 3 ranks with its 8 rows, so ranks 0-1 train in the planner's layout for 2 and rank 2 waits as a spare,
    in no process group, until rank 0 releases it at the end. Every process exits 0, none is left behind, and steps
    5-12 follow the uninterrupted curve."""
    base, _ = uninterrupted_omni
    run_dir, marker, log = tmp_path / "run", uuid.uuid4().hex, tmp_path / "agent.log"
    seed_run_dir(base / "checkpoints" / f"step_{SAVE_EVERY:06d}", run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:1", "--nproc-per-node", "3",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "spares-test",
           "--rdzv-conf", f"is_host=1,{RDZV}", "--max-restarts", "0", "--monitor-interval", "0.2",
           "-m", "tessera.recipes.train", *SPARES_RECIPE, "trainer.elastic_min_nodes=1",
           f"trainer.run_dir={run_dir}"]
    try:
        with _job(cmd, log, _env(marker)) as proc:
            rc = proc.wait(timeout=300)
    finally:
        left = _survivors(marker)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert not left, f"processes left behind: {left}"
    layout = "vision=dp2@0-1;audio=dp2@0-1;language=dp2@0-1"
    assert f"elastic: 3 ranks (the run's layout has 4): layout {layout} on ranks 0-1" in text, text[-4000:]
    assert "no layout of the run tiles 3 ranks: ranks 2-2 wait as spares" in text, text[-4000:]
    # the spare waited for the run (it stays in the job, for the next restart to use), and was let go at its end
    assert text.index(f"step {STEPS}/{STEPS} loss") < text.index("elastic: rank 2 waited as a spare until the run's end (exit "
                                                    "status 0)"), text[-4000:]
    change = read_metrics(run_dir, "world")[0]["world_change"]
    assert (change["old_world"], change["new_world"], change["spares"], change["new_layout"]) == (4, 2, 1, layout)
    rows = read_metrics(run_dir)
    assert [(r["step"], r["world"]) for r in rows] == [(s, 2) for s in range(SAVE_EVERY + 1, STEPS + 1)], rows
    want = [r["loss"] for r in read_metrics(base)][SAVE_EVERY:]
    assert rel([r["loss"] for r in rows], want) <= 1e-5
