"""Frozen means frozen (issue 34 item 3): after a LoRA run and a run with frozen encoders, every tensor of the
export that the run does not train is torch.equal to the base it started from, buffers included: the conformer's
BatchNorm running statistics (the norm layers of a frozen base stay in eval mode, as NeMo's freeze() does) and
the MoE router's expert bias (not updated when its router is frozen).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_frozen.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.hetero.tools.spawn import run_on_ranks

pytestmark = pytest.mark.multiproc
LAYOUT = "vision=dp1@0-0;audio=dp1@0-0;language=dp1@0-0"
RUNS = {"lora": dict(lora=True), "frozen_encoders": dict(freeze_vision=True, freeze_audio=True)}
PROJECTORS = ("mlp1.", "sound_projection.")  # a frozen encoder's projector still trains


def _model_cfg(lora=False, **freeze):
    from tessera.hetero.runspec.config import LoraConfig, ModelConfig

    return ModelConfig(llm="nemotron_h_tiny_moe", vision="radio_vit_tiny", audio="fastconformer_tiny",
                       lora=LoraConfig(rank=4, alpha=8.0) if lora else None, **freeze)


def _runs(root: str):
    """Each run: 3 steps from the seed, exported, with the seed's weights (the base) written beside the export.
    Rows of 512 tokens: shorter ones leave the synthetic audio clips out, and the conformer would never run."""
    from tessera.hetero.build.seeded_init import full_hf_state
    from tessera.hetero.runspec.config import DataConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    for name, kw in RUNS.items():
        export = Path(root) / name / "export"
        trainer = TrainerConfig(max_steps=3, run_dir=str(Path(root) / name / "run"), progress=False,
                                tensorboard=False, export_hf=str(export))
        train(_model_cfg(**kw), DataConfig(seq_length=512, rows_per_microbatch=2, microbatches=1),
              OptimConfig(lr=1e-2, warmup_steps=0), trainer, layout=LAYOUT, name=name)
        fields = json.loads((export / "tessera.json").read_text())["llm_hf_config"]
        save_file(full_hf_state(_model_cfg(**kw), fields, 1234), str(export / "base.safetensors"))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    run_on_ranks(1, _runs, str(root), timeout=900)
    return root


def _changed(export: Path) -> tuple[dict, set[str]]:
    base, trained = load_file(str(export / "base.safetensors")), load_file(str(export / "model.safetensors"))
    assert trained.keys() == base.keys()
    return base, {k for k in base if not torch.equal(base[k], trained[k])}


def test_a_lora_run_changes_only_the_adapted_weights(exports):
    export = exports / "lora" / "export"
    base, changed = _changed(export)
    adapters = load_file(str(export / "adapters" / "adapter_model.safetensors"))
    adapted = {k[len("base_model.model."):-len(".lora_A.weight")] + ".weight" for k in adapters
               if k.endswith(".lora_A.weight")}
    stats = [k for k in base if k.endswith(("running_mean", "running_var"))]
    biases = [k for k in base if k.endswith("e_score_correction_bias")]
    assert stats and biases, "the check needs BatchNorm statistics and MoE expert biases in the model"
    assert changed and changed <= adapted, sorted(changed - adapted)
    # the audio tower ran (its projector's adapted weights trained), so its statistics had the chance to move
    assert any(k.startswith("sound_projection.") for k in changed), sorted(changed)


def test_frozen_encoders_change_no_tensor_of_their_towers(exports):
    base, changed = _changed(exports / "frozen_encoders" / "export")
    outside = {k for k in changed if not k.startswith(("language_model.",) + PROJECTORS)}
    assert not outside, sorted(outside)
    assert any(k.startswith("language_model.") for k in changed)  # the rest did train
    assert any(k.startswith("sound_projection.") for k in changed)  # and the audio tower ran
