"""A released-architecture checkpoint (transformers' NemotronH_Omni_Reasoning_V3, saved by save_pretrained as
NVIDIA released it) builds the model its config.json describes, and every tensor it holds is consumed.
Training from one in a heterogeneous layout, and transformers loading the export: tests/test_released_loss.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_released_checkpoint.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from _mcore_cpu import single_rank_world
from safetensors.torch import load_file

from tessera.models.encoders import encoder_config
from tessera.models.released import (CheckpointConfigError, encoder_name, llm_fields_of, modalities_of,
                                     read_config)
# the tiny release: shapes unlike any registry entry, so nothing can come from a registry name
from tessera.scripts.tiny_release import AUDIO, DENSE_TEXT, TEXT, VISION, omni_checkpoint  # noqa: F401


def test_config_json_gives_every_module_its_shape(tmp_path):
    omni_checkpoint(tmp_path)
    config = read_config(tmp_path)
    assert modalities_of(config) == ["vision", "audio"]
    llm = llm_fields_of(config)
    assert {k: llm[k] for k in TEXT} == TEXT and "model_type" not in llm
    v = encoder_config(encoder_name(tmp_path, "vision"))
    assert (v.family, v.hidden, v.layers, v.heads, v.ffn, v.patch, v.pos_grid,
            v.prefix_tokens, v.pixel_shuffle, v.temporal_patch, v.projector_hidden) == (
        "radio", 48, 2, 4, 96, 8, 10, 3, 2, 2, 72)
    a = encoder_config(encoder_name(tmp_path, "audio"))
    assert (a.family, a.hidden, a.layers, a.heads, a.ff_expansion, a.n_mels, a.subsampling,
            a.attention_bias, a.scale_input, a.projector_hidden) == (
        "parakeet_hf", 24, 1, 2, 2, 16, 8, False, False, 40)


def test_vision_only_checkpoint_has_no_audio_module(tmp_path):
    omni_checkpoint(tmp_path, audio=False)
    assert modalities_of(read_config(tmp_path)) == ["vision"]
    with pytest.raises(CheckpointConfigError, match=r"has no audio encoder"):
        encoder_config(encoder_name(tmp_path, "audio"))


def test_other_architectures_and_missing_config_are_named(tmp_path):
    with pytest.raises(CheckpointConfigError, match=r"config.json not found"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "architectures": ["LlavaForX"]}))
    with pytest.raises(CheckpointConfigError, match=r"model_type 'llava' .*LlavaForX.* not a checkpoint Tessera"):
        read_config(tmp_path)


def _tessera_model(directory):
    from tessera.models.hybrid_llm import HybridLM
    from tessera.models.multimodal import MultimodalModel, build_media_module
    from tessera.models.nemotron_h_hf import hybrid_config_from_hf

    pg = single_rank_world()
    config = read_config(directory)
    llm = HybridLM(hybrid_config_from_hf(llm_fields_of(config)), pg)
    media = {m: build_media_module(encoder_name(directory, m), llm.config.hidden_size, pg)
             for m in modalities_of(config)}
    return MultimodalModel(llm, media)


@pytest.mark.parametrize("audio", [True, False])
def test_every_released_tensor_is_consumed_and_exported_back(tmp_path, audio):
    """Import the saved tensors into the model config.json describes, export: the same keys, every tensor
    torch.equal (no key left over, none invented: no final ViT norm, layer scales and summary_idxs kept)."""
    from tessera.models.multimodal_hf import export_hf, import_hf

    omni_checkpoint(tmp_path, audio=audio)
    released = load_file(str(tmp_path / "model.safetensors"))
    model = _tessera_model(tmp_path)
    import_hf(model, released)
    again = export_hf(model)
    assert sorted(again) == sorted(released)
    assert [k for k in released if not torch.equal(again[k], released[k])] == []


def test_wrong_checkpoint_lists_every_mismatch_with_shapes(tmp_path):
    """A checkpoint whose tensors are not the model's: one error naming missing, left-over and wrong-shape
    tensors with their shapes, before anything is loaded."""
    from tessera.hetero.build.model_build import check_checkpoint_tensors
    from tessera.hetero.runspec.config import ModelConfig

    single_rank_world()
    omni_checkpoint(tmp_path)
    full = load_file(str(tmp_path / "model.safetensors"))
    model = ModelConfig(checkpoint=str(tmp_path))
    fields = llm_fields_of(read_config(tmp_path))
    check_checkpoint_tensors(str(tmp_path), full, model, fields)  # the checkpoint itself: nothing to say
    with pytest.raises(ValueError, match=r"1 left over .*summary_idxs_extra \(2,\)"):  # a left-over alone
        check_checkpoint_tensors(str(tmp_path), {**full, "summary_idxs_extra": torch.zeros(2)}, model, fields)
    full["vision_model.radio_model.model.extra.weight"] = torch.zeros(3)
    del full["mlp1.1.weight"]
    full["sound_projection.linear1.weight"] = torch.zeros(7, 24)
    with pytest.raises(ValueError) as e:
        check_checkpoint_tensors(str(tmp_path), full, model, fields)
    msg = str(e.value)
    assert "1 missing" in msg and "mlp1.1.weight (72, 192)" in msg
    assert "1 left over" in msg and "vision_model.radio_model.model.extra.weight (3,)" in msg
    assert "sound_projection.linear1.weight: checkpoint (7, 24), model (40, 24)" in msg
