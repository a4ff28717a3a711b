"""What `model.checkpoint` (or a run directory) holds, decided here once and read without building anything.

    source = checkpoint_source(model.checkpoint)   # None when no checkpoint is given
    source.kind                                    # RELEASE | EXPORT | WEIGHTS | RUN | None (none of these)
    source.llm_fields()                            # the LLM shape a fine-tune from it must build
    latest_checkpoint(run_dir / "checkpoints")     # the last complete checkpoint: what the `latest` marker names
    latest_step(run_dir / "checkpoints")           # its step (a run at trainer.max_steps has nothing to do)

The four kinds, by the files in the directory (torchtitan's one decision "initial load from HF or own resume"):
  RELEASE  config.json, no tessera.json: a released checkpoint (or an export of one); its config.json defines the
           model, the encoders included (models/released.py reads it)
  EXPORT   tessera.json: a Tessera export of a model built from registry names (hetero/export/hf.py writes it);
           it defines the LLM's shape, the run's config names the encoders
  WEIGHTS  *.safetensors and neither file: weights in the HF layout; the run's config defines the whole model
  RUN      a Tessera checkpoints/ directory: its last complete step (hetero/checkpoint/sharded.py writes it)
Everything that needs to know which one reads `kind` here: the launch checks (recipes/prelaunch.py), the layout
resolution (hetero/runspec/modules.py), the initial weights (hetero/build/run_state.py), both exports.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tessera.models import released

LATEST = "latest"  # the marker file in a checkpoints/ directory: the name of the last complete step directory
RELEASE, EXPORT, WEIGHTS, RUN = "release", "export", "weights", "run"
HF_LAYOUT = (RELEASE, EXPORT, WEIGHTS)  # read tensor by tensor (models/nemotron_h_hf.LazyCheckpoint)


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


@dataclass(frozen=True)
class CheckpointSource:
    given: str         # as the user wrote it (a hub id is a cache directory by now: recipes/cli.py)
    path: Path
    kind: str | None   # RELEASE | EXPORT | WEIGHTS | RUN, None: the directory is none of them
    step: Path | None  # RUN: the last complete step directory

    @property
    def is_release(self) -> bool:
        return self.kind == RELEASE

    def release_config(self) -> dict:
        """A release's config.json (RELEASE only)."""
        assert self.is_release, f"{self.given} is a {self.kind} checkpoint, not a release"
        return released.read_config(self.path)

    def llm_fields(self) -> dict | None:
        """The LLM's NemotronH config fields this checkpoint defines, so fine-tuning builds exactly that shape:
        an export's tessera.json, a release's config.json, a run's common state; None for WEIGHTS (the run's
        config defines them)."""
        if self.kind == EXPORT:
            return json.loads((self.path / "tessera.json").read_text())["llm_hf_config"]
        if self.kind == RELEASE:
            return released.llm_fields_of(self.release_config())
        if self.kind == RUN:
            from megatron.core import dist_checkpointing

            return json.loads(dist_checkpointing.load_common_state_dict(str(self.step))["common"]["llm_hf_config"])
        return None


def checkpoint_source(given: str | Path | None) -> CheckpointSource | None:
    """What `given` (model.checkpoint) is: None when no checkpoint is given. A Tessera file decides before an HF
    one, an HF one before the `latest` marker."""
    if not given:
        return None
    path = Path(given).expanduser()
    step = None
    if (path / "tessera.json").is_file():
        kind = EXPORT
    elif (path / "config.json").is_file():
        kind = RELEASE
    elif (step := latest_checkpoint(path)) is not None:
        kind = RUN
    elif path.is_dir() and any(path.glob("*.safetensors")):
        kind = WEIGHTS
    else:
        kind = None
    return CheckpointSource(str(given), path, kind, step)


def checkpoint_llm_fields(given: str | None) -> dict | None:
    """The LLM fields model.checkpoint defines (CheckpointSource.llm_fields), None without a checkpoint."""
    source = checkpoint_source(given)
    return source.llm_fields() if source is not None else None
