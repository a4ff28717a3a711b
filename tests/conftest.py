"""Shared fixtures."""

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


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: the rest keep their order


def pytest_collection_finish(session):
    """Every test module is imported: freeze what exists (hetero/runtime/world.freeze_live_objects says why), so the
    full collections during in-process tests walk only what the tests make."""
    from tessera.hetero.runtime.world import freeze_live_objects

    freeze_live_objects()
