"""The RADIO tower as transformers' NemotronH_Omni_Reasoning_V3 holds and saves it: image features through the
Omni model's own get_image_features (with and without the `vision_final_layernorm` its MTP-bearing LLM config
adds), every tensor its save_pretrained writes imported and exported back bit-exactly, and the import errors
that name a missing, superfluous or differing tensor (layer scales, summary_idxs, input_conditioner).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_encoders_vision_omni.py -q
"""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from _hf_oracles import radio_config_fields, tiny_omni
from _mcore_cpu import single_rank_world

from tessera.models import configs
from tessera.models.encoders import encoder_config
from tessera.models.multimodal import build_media_module
from tessera.models.multimodal_hf import (PROJECTOR_ROOT, RADIO_FINAL_NORM, RADIO_ROOT, RADIO_TOWER, _load_params,
                                          _params_only, radio_buffers, vision_from_hf, vision_to_hf)
from tessera.models.vision import VisionTransformer, patchify, pixel_shuffle

LLM_HIDDEN = configs.TINY_DENSE["hidden_size"]
GRIDS = [(4, 6), (6, 4), (2, 2)]  # patch grids, even for the pixel shuffle


def _tower(released: dict) -> dict:
    return {k: v for k, v in released.items() if k.startswith(("vision_model.", RADIO_FINAL_NORM))}


def _tessera_vision(cfg: dict, released: dict):
    mod = build_media_module(cfg.name, LLM_HIDDEN, single_rank_world(),
                             **{k: getattr(cfg, k) for k in ("final_norm", "summary_idxs", "input_conditioner")})
    root = PROJECTOR_ROOT["vision"]
    mod.projector.load_state_dict({k[len(root):]: v for k, v in released.items() if k.startswith(root)})
    _load_params(mod.encoder.vit, vision_from_hf(released, cfg))
    return mod.eval()


@pytest.mark.parametrize("mtp", [False, True], ids=["no_mtp", "mtp"])
def test_omni_image_features_and_exact_tower_round_trip(mtp):
    """Tessera's ViT -> pixel shuffle -> projector equals the Omni model's get_image_features (packed images of
    three grids, fp32, rel err <= 1e-5); exporting the imported tower gives back exactly the tensors
    save_pretrained wrote: same keys (no `model.norm.*`; `vision_final_layernorm.*` iff the LLM has MTP
    layers), every tensor torch.equal."""
    cfg = encoder_config("radio_vit_tiny", final_norm=mtp)
    omni, released = tiny_omni(cfg, None, seed=11, mtp=mtp)
    tower = _tower(released)
    assert (RADIO_FINAL_NORM + "weight" in tower) == mtp and (omni.vision_final_layernorm is not None) == mtp
    assert not any(k.startswith(RADIO_ROOT + "norm.") for k in tower)
    assert not any(torch.equal(v, torch.ones_like(v)) for k, v in tower.items() if k.endswith("lambda1"))
    mod = _tessera_vision(cfg, released)

    again = vision_to_hf([_params_only(mod.encoder.vit.state_dict())], cfg)
    assert sorted(again) == sorted(tower)
    assert [k for k in tower if not (again[k].dtype == tower[k].dtype and torch.equal(again[k], tower[k]))] == []

    p, gen = cfg.patch, torch.Generator().manual_seed(2)
    images = [torch.randn(1, 3, r * p, c * p, generator=gen) for r, c in GRIDS]
    with torch.no_grad():
        ref = torch.cat(omni.get_image_features(torch.cat([patchify(x, p)[0] for x in images]),
                                                image_grid_hw=torch.tensor(GRIDS)).pooler_output)
        got = torch.cat([mod.projector(pixel_shuffle(mod.encoder.vit(x), cfg.pixel_shuffle).flatten(0, 2))
                         for x in images])
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"omni image features (mtp={mtp}) vs transformers rel err {err:.2e}")
    assert got.shape == ref.shape and err <= 1e-5


def test_final_norm_is_read_under_the_released_name():
    """The Omni model's final norm is stored as the release names it (`vision_projector.vision_final_layernorm.*`,
    what transformers' save_pretrained writes and its from_pretrained reads into `vision_final_layernorm`):
    Tessera reads those tensors, so both compute the same norm; a checkpoint without them is refused by name."""
    from transformers import NemotronH_Omni_Reasoning_V3

    cfg = encoder_config("radio_vit_tiny", final_norm=True)
    omni, released = tiny_omni(cfg, None, seed=3, mtp=True)
    with tempfile.TemporaryDirectory() as d:
        omni.save_pretrained(d)
        loaded = NemotronH_Omni_Reasoning_V3.from_pretrained(d, dtype=torch.float32)
    theirs = loaded.vision_final_layernorm
    ours = VisionTransformer(cfg, single_rank_world())
    _load_params(ours, vision_from_hf(released, cfg))
    for name in ("weight", "bias"):
        assert torch.equal(getattr(ours.final_norm, name), getattr(theirs, name)), name
    assert not torch.equal(ours.final_norm.weight, torch.ones(cfg.hidden))  # the stored values, not the init
    without = {k: v for k, v in released.items() if not k.startswith(RADIO_FINAL_NORM)}
    with pytest.raises(KeyError, match=re.escape(RADIO_FINAL_NORM) + r".* is missing .* set final_norm=False"):
        vision_from_hf(without, cfg)


def _random_tower(cfg: dict, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    vit = VisionTransformer(cfg, single_rank_world())
    with torch.no_grad():
        for name, prm in vit.named_parameters():
            prm.copy_((1.0 if name.endswith(("norm.weight", "lambda1")) else 0.0) + 0.2 * torch.randn_like(prm))
    return vision_to_hf([vit.state_dict()], cfg)


@pytest.mark.parametrize("key", [f"{RADIO_ROOT}blocks.1.layer_scale2.lambda1",
                                 f"{RADIO_ROOT}blocks.0.layer_scale1.lambda1"])
def test_missing_layer_scale_is_named(key):
    """transformers' RadioModel would silently load a missing layer scale as layerscale_value; Tessera refuses."""
    cfg = encoder_config("radio_vit_tiny")
    hf = _random_tower(cfg)
    del hf[key]
    with pytest.raises(KeyError, match=re.escape(key) + " is missing"):
        vision_from_hf(hf, cfg)


def test_radio_buffers_are_radio_models_own():
    """What export writes for summary_idxs / input_conditioner is what transformers' RadioModel holds (its
    conditioner kept internal, as NVIDIA's released RADIO files store it): same dtype, shape and values."""
    from transformers import RadioConfig, RadioModel

    cfg = encoder_config("radio_vit_tiny", input_conditioner=True, summary_idxs=(0, 1))
    theirs = RadioModel(RadioConfig(**dict(radio_config_fields(cfg), num_cls_tokens=2, num_registers=0))).state_dict()
    ours = radio_buffers(cfg)
    assert len(ours) == 3
    for key, t in ours.items():
        ref = theirs[key[len(RADIO_TOWER):]]
        assert t.dtype == ref.dtype and t.shape == ref.shape and torch.equal(t, ref), key


def test_buffers_and_leftovers_are_checked_by_name():
    cfg = encoder_config("radio_vit_tiny", input_conditioner=True)
    hf = _random_tower(cfg)
    mean, idxs = f"{RADIO_TOWER}input_conditioner.norm_mean", f"{RADIO_TOWER}summary_idxs"
    assert mean in hf and idxs in hf
    vision_from_hf(hf, cfg)  # as exported: accepted

    imagenet = dict(hf, **{mean: torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)})
    with pytest.raises(ValueError, match=re.escape(mean) + r" = .* differs .*normalises pixels with the config"):
        vision_from_hf(imagenet, cfg)
    with pytest.raises(ValueError, match=re.escape(idxs) + r" = \[0, 1\] .* set summary_idxs"):
        vision_from_hf(dict(hf, **{idxs: torch.tensor([0, 1])}), cfg)
    with pytest.raises(KeyError, match=re.escape(mean) + r" is in the checkpoint, but .* input_conditioner=False"):
        vision_from_hf(hf, encoder_config("radio_vit_tiny"))
    without = {k: v for k, v in hf.items() if k != idxs}
    with pytest.raises(KeyError, match=re.escape(idxs) + r" is missing from the checkpoint, but .* summary_idxs"):
        vision_from_hf(without, cfg)
    for extra in (f"{RADIO_ROOT}norm.weight", f"{RADIO_FINAL_NORM}weight", "vision_final_layernorm.bias"):
        with pytest.raises(KeyError, match=re.escape(extra) + r".* have no place"):
            vision_from_hf(dict(hf, **{extra: torch.ones(cfg.hidden)}), cfg)
