"""transformers' released architectures as test oracles, built offline from Tessera's registry configs.

    radio_model(hf, cfg)       transformers RadioModel loaded from Tessera's HF-layout (released-name) tensors
                               through transformers' own rename rules (conversion_mapping "radio"), preprocessor
                               external as in NemotronH_Omni_Reasoning_V3
    tiny_omni(vision, audio)   a random NemotronH_Omni_Reasoning_V3 and the released-layout tensors its
                               save_pretrained writes (mlp1.*, sound_projection.*, vision_model.*, ...)
Both run in float32 on the torch path; nothing is downloaded.
"""

from __future__ import annotations

import tempfile

import torch
from safetensors.torch import load_file, save_file

from tessera.models import configs
from tessera.models.multimodal_hf import RADIO_ROOT, RADIO_TOWER


def radio_config_fields(cfg) -> dict:
    """RadioConfig fields of a registry "radio" entry: the table covers pos_grid patches, prefix tokens are
    one cls token + registers, summary_idxs / layer scale init / conditioner statistics from the entry."""
    return dict(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                num_attention_heads=cfg.heads, mlp_ratio=cfg.ffn / cfg.hidden, hidden_act="gelu",
                layer_norm_eps=cfg.eps, patch_size=cfg.patch, max_img_size=cfg.pos_grid * cfg.patch,
                num_cls_tokens=1, num_registers=cfg.prefix_tokens - 1,
                summary_idxs=list(cfg.summary_idxs) if cfg.summary_idxs is not None else None,
                layerscale_value=cfg.layer_scale, norm_mean=list(cfg.mean), norm_std=list(cfg.std),
                video_temporal_patch_size=cfg.temporal_patch or None)


def radio_model(hf: dict, cfg):
    """RadioModel (eval, float32) holding the tensors of `hf` (keys vision_model.radio_model.*). The Omni
    model's `vision_final_layernorm` is not RadioModel's: a final_norm config is refused here."""
    from transformers import RadioConfig, RadioModel

    assert not cfg.final_norm, "RadioModel has no final norm (NemotronH_Omni_Reasoning_V3 owns it)"
    released = {k[len("vision_model."):]: v.detach().contiguous() for k, v in hf.items() if k.startswith(RADIO_TOWER)}
    with tempfile.TemporaryDirectory() as d:
        RadioConfig(**radio_config_fields(cfg)).save_pretrained(d)
        save_file(released, f"{d}/model.safetensors")
        model, info = RadioModel.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    # every tensor we wrote must land somewhere; only the conditioner may come from the config
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert set(info["missing_keys"]) <= {"input_conditioner.norm_mean", "input_conditioner.norm_std"}, info
    # RadioModel forgives missing layer scales (_keys_to_ignore_on_load_missing: layerscale_value instead), so
    # check that ours arrived
    for i, layer in enumerate(model.encoder.layer):
        for j in (1, 2):
            want = hf[f"{RADIO_ROOT}blocks.{i}.layer_scale{j}.lambda1"]
            assert torch.equal(getattr(layer, f"layer_scale{j}").lambda1.detach(), want)
    model.make_preprocessor_external()
    return model.eval()


def tiny_omni(vision, audio, seed: int = 0, mtp: bool = False):
    """(NemotronH_Omni_Reasoning_V3, its save_pretrained tensors) with random projector weights, norm weights and
    layer scales around 1 (not the identity init). Projector widths follow Tessera's defaults (4x the input
    width). mtp: the LLM config has MTP layers, so the model builds `vision_final_layernorm`."""
    from transformers import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    from tessera.models.audio import parakeet_hf_config

    shuffle = vision.pixel_shuffle
    audio_fields = None
    if audio is not None:
        audio_fields = parakeet_hf_config(audio).to_dict()
        audio_fields.update(projection_hidden_size=4 * audio.hidden, projection_bias=False)
    text = dict(configs.TINY_DENSE)
    if mtp:  # transformers' NemotronH builds no MTP block; the config alone switches the vision norm on
        text.update(num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "mlp"])
    cfg = NemotronH_Omni_Reasoning_V3_Config(
        vision_config=radio_config_fields(vision), text_config=text,
        audio_config=audio_fields, vision_hidden_size=vision.hidden, downsample_ratio=1 / shuffle,
        projector_hidden_size=4 * vision.hidden * shuffle ** 2)
    torch.manual_seed(seed)
    model = NemotronH_Omni_Reasoning_V3(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed_audio.", "multi_modal_projector.", "vision_model.", "vision_final_layernorm.")):
                around_one = "lambda1" in name or ("norm" in name and name.endswith(".weight"))
                p.copy_((1.0 if around_one else 0.0) + 0.2 * torch.randn_like(p))
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        released = load_file(f"{d}/model.safetensors")
    return model, released
