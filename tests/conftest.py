"""Shared fixtures, the files' order, and the quick tier."""

import ast
from functools import cache
from pathlib import Path

import pytest

from tessera.models import configs
from _hf_tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """Tiny random NemotronH checkpoints (dense "M-M*-M-" and MoE "M*ME") written locally with transformers."""
    root = tmp_path_factory.mktemp("nemotron_h")
    return {
        "dense": str(make_tiny_checkpoint(configs.TINY_DENSE, root / "dense", seed=0)),
        "moe": str(make_tiny_checkpoint(configs.TINY_MOE, root / "moe", seed=1)),
    }


# The files that take longest (seconds on one of scripts/test.sh's 2 workers, measured in a full run), collected
# first and longest first: under `--dist loadfile` a worker takes the next file when it is free, so the long ones
# start early and the short ones fill the gaps (longest-processing-time-first). Without it the longest files ran
# last: pytest-xdist orders files by their number of tests unless told `--no-loadscope-reorder` (scripts/test.sh
# does), and these have 1-9 tests each, so one worker ran the README release chain alone for its last ~3 minutes.
# Order only: every file still runs.
SLOW_FIRST = (
    "test_elastic.py",            # 328 s: torchrun agents, a node killed and back
    "test_slurm.py",              # 294: a real Slurm (mostly waiting on its scheduler: pairs well with the above)
    "test_train_fault.py",        # 205
    "test_readme_release.py",     # 160
    "test_encoder_pp.py",         # 155
    "test_moe_train.py",          # 150
    "test_readme.py",             # 132
    "test_readme_benches.py",     # 120
    "test_train_signals.py",      # 110
    "test_encoder_cp.py",         # 102
    "test_released_loss.py",      # 98
    "test_hetero_gloo.py",        # 92
    "test_recipes.py",            # 91
    "test_prepare_data.py",       # 90
    "test_parity_multimodal.py",  # 83
    "test_train_hetero.py",       # 75
    "test_hf_encoders.py",        # 65
    "test_verify_trainer.py",     # 60
    "test_balance_train.py",      # 60
    "test_trained_is_exported.py",  # 59
)


_stale = [name for name in SLOW_FIRST if not (Path(__file__).parent / name).is_file()]
assert not _stale, f"tests/conftest.py SLOW_FIRST names files that do not exist: {_stale}"


# The quick tier: `bash scripts/test.sh --quick` (pytest -m quick), the rules and the one-process tests in minutes
# for whoever changes the code; the full suite (scripts/test.sh with no arguments, what .ci/run runs) runs them all.
# A test is quick unless it starts processes: marked multiproc (gloo ranks), or it (or a function or fixture of its
# file that it reaches) names one of STARTS_PROCESSES: a command, a recipe's trainer, torchrun, a Slurm job, the
# spawn launcher; each new interpreter costs seconds of imports. So a new test is quick by default and one that
# starts a process is not; one that starts processes the rule cannot see (a DataLoader's workers) or takes long in
# one process goes in LEFT_OUT, by function or by parametrized id.
STARTS_PROCESSES = {"subprocess", "Popen", "executable", "run_on_ranks", "multiprocessing", "get_context"}
LEFT_OUT = {  # file: tests (seconds alone on one core of the 2-core box, the quick tier's whole being ~380 s)
    "test_data_loader.py": ("test_resume_gives_identical_batches[2]",),  # 38: three loaders' 2 worker processes
}


@cache
def _starting_functions(path: Path) -> frozenset[str]:
    """The functions of a test file (tests, helpers, fixtures) that start processes, directly or through another
    function of the file they name."""
    names: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            used = names.setdefault(node.name, set())
            used |= {a.arg for a in node.args.args}  # its fixtures
            used |= {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name)}
            used |= {sub.attr for sub in ast.walk(node) if isinstance(sub, ast.Attribute)}
    starting = {name for name, used in names.items() if used & STARTS_PROCESSES}
    while grown := {name for name, used in names.items() if name not in starting and used & starting}:
        starting |= grown
    return frozenset(starting)


def is_quick(item) -> bool:
    function = getattr(item, "originalname", item.name)
    left_out = LEFT_OUT.get(item.path.name, ())
    return (item.get_closest_marker("multiproc") is None and function not in left_out and item.name not in left_out
            and function not in _starting_functions(item.path))


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick tier (tests/conftest.py is_quick: starts no process, "
                                       "not in LEFT_OUT); scripts/test.sh --quick")


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers
def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: the rest keep their order
    for item in items:
        if is_quick(item):
            item.add_marker(pytest.mark.quick)


def pytest_collection_finish(session):
    """Every test module is imported: freeze what exists (hetero/runtime/world.freeze_live_objects says why), so the
    full collections during in-process tests walk only what the tests make."""
    from tessera.hetero.runtime.world import freeze_live_objects

    freeze_live_objects()
