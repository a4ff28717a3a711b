"""What a run's `model.checkpoint` (or run directory) holds, read without building anything.

    latest_checkpoint(run_dir / "checkpoints")   # the last complete checkpoint: what the `latest` marker names
    latest_step(run_dir / "checkpoints")         # its step (a run at trainer.max_steps has nothing to do)
    checkpoint_llm_fields(source)                # the LLM shape a fine-tune from `source` must build

hetero/training/checkpoint.py writes checkpoints and publishes the marker (atomically, after every shard is
written); everything that only needs to know where a run stands reads it here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tessera.models import released

LATEST = "latest"  # the marker file in a checkpoints/ directory: the name of the last complete step directory


def latest_checkpoint(root: str | Path) -> Path | None:
    """The last complete checkpoint under root (what `latest` names), or None."""
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    path = Path(root) / marker.read_text().strip()
    return path if path.is_dir() else None


def latest_step(root: str | Path) -> int | None:
    """The step of the last complete checkpoint under root (its directory's name, step_NNNNNN), or None."""
    path = latest_checkpoint(root)
    m = re.fullmatch(r"step_(\d+)", path.name) if path is not None else None
    return int(m[1]) if m else None


def checkpoint_llm_fields(source: str | None) -> dict | None:
    """The LLM's NemotronH config fields the checkpoint to start from defines, so fine-tuning builds exactly
    that shape: a Tessera export's tessera.json, a released directory's config.json (models/released.py), a
    Tessera checkpoints/ directory's common state; None when there is no checkpoint or it says nothing."""
    if not source:
        return None
    path = Path(source).expanduser()
    if (path / "tessera.json").exists():
        return json.loads((path / "tessera.json").read_text())["llm_hf_config"]
    if released.is_released_checkpoint(path):
        return released.llm_fields_of(released.read_config(path))
    ckpt = latest_checkpoint(path)
    if ckpt is not None:
        from megatron.core import dist_checkpointing

        return json.loads(dist_checkpointing.load_common_state_dict(str(ckpt))["common"]["llm_hf_config"])
    return None
