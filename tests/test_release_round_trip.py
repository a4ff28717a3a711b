"""Out in the layout it came in (issue 46, item 5): a run from a release as downloaded (hub layout: remote code named
by config.json's auto_map, MTP layers and the Parakeet featurizer that no Tessera module computes with) trains and
exports; the export is the release's layout again, and reads back as the same model.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_release_round_trip.py -q -p no:cacheprovider

import (model.checkpoint=) -> train 2 steps, both encoders frozen -> trainer.export_hf -> import again. The oracles
are the release's own files: every tensor it holds is exported, those nothing trained (frozen encoders, carried MTP
and featurizer) torch.equal and in their dtype; config.json and the remote code byte for byte.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tessera.hetero.tools.spawn import run_on_ranks

pytestmark = pytest.mark.multiproc
LAYOUT = "vision=dp1@0-0;audio=dp1@0-0;language=dp1@0-0"
STEPS = 2
UNTRAINED = ("vision_model.", "vision_projector.", "sound_encoder.", "mtp.")  # frozen towers, carried tensors


def _train(release: str, run_dir: str, export: str) -> None:
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    model = ModelConfig(checkpoint=release, freeze_vision=True, freeze_audio=True)
    trainer = TrainerConfig(max_steps=STEPS, run_dir=run_dir, progress=False, tensorboard=False, export_hf=export)
    data = DataConfig(seq_length=256, rows_per_microbatch=2, microbatches=1)
    train(model, data, OptimConfig(lr=1e-2, warmup_steps=0), trainer, layout=LAYOUT, name="round_trip")


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    from test_release_layouts import _release_with_carried

    root = tmp_path_factory.mktemp("round_trip")
    carried = _release_with_carried(root / "release", tokenizer=True)
    run_on_ranks(1, _train, str(root / "release"), str(root / "run"), str(root / "export"), timeout=600)
    return root / "release", root / "export", carried


def test_export_keeps_the_hub_layout_and_its_remote_code(round_trip):
    from tessera.models.released import remote_code_files
    from tessera.scripts.tiny_release import HUB_REMOTE_CODE

    release, export, _ = round_trip
    assert (export / "config.json").read_bytes() == (release / "config.json").read_bytes()
    code = remote_code_files(release)
    assert code == sorted(HUB_REMOTE_CODE)  # the auto_map targets and the module they import (evs.py)
    assert {n: (export / n).read_bytes() for n in code} == {n: (release / n).read_bytes() for n in code}
    assert json.loads((export / "config.json").read_text())["auto_map"]


def test_every_release_tensor_is_exported_untrained_ones_unchanged(round_trip):
    release, export, carried = round_trip
    before, after = load_file(str(release / "model.safetensors")), load_file(str(export / "model.safetensors"))
    assert sorted(after) == sorted(before) and set(carried) <= set(after)
    untrained = [k for k in before if k.startswith(UNTRAINED) or k in carried]
    assert len(untrained) > len(carried)
    changed = [k for k in untrained if not (torch.equal(after[k], before[k]) and after[k].dtype == before[k].dtype)]
    assert changed == []
    assert any(not torch.equal(after[k], before[k]) for k in before if k.startswith("language_model.")), "not trained"


def test_the_export_imports_as_the_model_it_was(round_trip):
    """model.checkpoint=EXPORT reads the same config and builds the same model; its tensors, imported and exported
    again, are the export's bit for bit."""
    from _mcore_cpu import single_rank_world

    from test_released_checkpoint import _tessera_model
    from tessera.hetero.build.model_build import check_checkpoint_tensors
    from tessera.models.multimodal_hf import export_hf, import_hf
    from tessera.models.nemotron_h_hf import LazyCheckpoint
    from tessera.hetero.checkpoint.source import checkpoint_source
    from tessera.models.released import is_carried, llm_fields_of, read_config
    from tessera.hetero.runspec.config import ModelConfig

    release, export, _ = round_trip
    assert checkpoint_source(export).is_release and read_config(export) == read_config(release)
    fields = llm_fields_of(read_config(export))
    single_rank_world()
    check_checkpoint_tensors(str(export), LazyCheckpoint(export), ModelConfig(checkpoint=str(export)), fields)
    exported = {k: v for k, v in load_file(str(export / "model.safetensors")).items() if not is_carried(k)}
    model = _tessera_model(export)
    import_hf(model, exported)
    again = export_hf(model)
    assert sorted(again) == sorted(exported)
    assert [k for k in exported if not torch.equal(again[k], exported[k])] == []
