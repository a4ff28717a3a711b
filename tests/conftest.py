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


# Files that take minutes of wall time (a real Slurm's scheduler and requeue; torchrun agents restarting an elastic
# job, ~3 min): collected first, so that under scripts/test.sh's `--dist loadfile` one worker starts them while the
# other runs everything else, instead of running them alone at the end (longest first).
SLOW_FIRST = ("test_slurm.py", "test_elastic.py")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.path.name not in SLOW_FIRST)  # stable: the rest keep their order


def pytest_collection_finish(session):
    """Every test module is imported: freeze what exists (hetero/runtime/world.freeze_live_objects says why), so the
    full collections during in-process tests walk only what the tests make."""
    from tessera.hetero.runtime.world import freeze_live_objects

    freeze_live_objects()
