"""Shared fixtures."""

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
# start early and the short ones fill the gaps, instead of a long file that sorts late in the alphabet starting
# when the other worker is nearly done (longest-processing-time-first scheduling). The elastic torchrun agents and a
# real Slurm's scheduler and requeue are the longest. Order only: every file still runs.
SLOW_FIRST = (
    "test_elastic.py",          # 329 s
    "test_slurm.py",            # 311
    "test_train_fault.py",      # 244
    "test_moe_train.py",        # 215
    "test_readme.py",           # 169
    "test_readme_release.py",   # 166
    "test_encoder_pp.py",       # 147
    "test_train_signals.py",    # 146
    "test_hf_encoders.py",      # 124
    "test_readme_benches.py",   # 115
    "test_released_loss.py",    # 106
    "test_prepare_data.py",     # 101
    "test_encoder_cp.py",       # 98
    "test_train_hetero.py",     # 98
    "test_cli_truth.py",        # 94
    "test_lora.py",             # 89
    "test_hetero_gloo.py",      # 86
    "test_parity_multimodal.py",  # 82
    "test_balance_train.py",    # 82
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: the rest keep their order


def pytest_collection_finish(session):
    """Every test module is imported: freeze what exists (hetero/runtime/world.freeze_imports says why), so the
    full collections during in-process tests walk only what the tests make."""
    from tessera.hetero.runtime.world import freeze_imports

    freeze_imports()
