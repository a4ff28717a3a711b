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
