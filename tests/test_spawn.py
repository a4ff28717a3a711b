"""hetero.tools.spawn.run_on_ranks: workers forked from a preloaded forkserver behave like spawned ones."""

from __future__ import annotations

import os

import pytest

from tessera.hetero.tools.spawn import run_on_ranks

pytestmark = pytest.mark.multiproc


def _env_and_rank(name: str):
    import torch.distributed as dist

    return os.environ.get(name), dist.get_rank(), dist.get_world_size()


def _fail_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("rank one broke")
    return "fine"


def test_workers_see_the_environment_of_the_call_not_of_the_server_start(monkeypatch):
    name = "TESSERA_SPAWN_PROBE"
    monkeypatch.delenv(name, raising=False)
    assert run_on_ranks(2, _env_and_rank, name) == [(None, 0, 2), (None, 1, 2)]  # the server runs from here on
    monkeypatch.setenv(name, "after-start")
    assert run_on_ranks(2, _env_and_rank, name) == [("after-start", 0, 2), ("after-start", 1, 2)]


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(AssertionError, match=r"rank 1 failed:(.|\n)*RuntimeError: rank one broke"):
        run_on_ranks(2, _fail_on_rank_1, timeout=60)


def _fail_while_a_rank_holds_a_child(pid_file: str):
    import multiprocessing
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(8)  # rank 1 has started its child by then
        raise RuntimeError("rank 0 fails")
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    child.start()
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(600)  # blocked, as a rank waiting in a collective for the failed one


def test_a_failed_run_leaves_no_grandchild_behind(tmp_path):
    import psutil

    pid_file = tmp_path / "child.pid"
    with pytest.raises(AssertionError, match="rank 0 fails"):
        run_on_ranks(2, _fail_while_a_rank_holds_a_child, str(pid_file), timeout=120)
    child = int(pid_file.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE, \
        "the blocked rank's child outlived the run"
