"""RADIO (C-RADIO, the Nemotron Nano VL / Omni vision tower): a ViT with cls/register prefix tokens, a linear
patch embedding without bias, RADIO's CPE position rule and per-channel layer scales, stored as transformers'
RadioModel under vision_model.radio_model.

    vision_model.radio_model.model.{patch_generator.{embedder,pos_embed,cls_token.token,video_embedder},
    blocks.N.{norm1,attn.qkv,attn.proj,layer_scale1.lambda1,norm2,mlp.fc1,mlp.fc2,layer_scale2.lambda1}},
    vision_model.radio_model.{summary_idxs, input_conditioner.norm_{mean,std}} (buffers, as the config says:
    radio_buffers), and vision_projector.vision_final_layernorm.{weight,bias} (the Omni model's norm on
    RadioModel's features, only with final_norm; transformers loads it as `vision_final_layernorm`)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessera.models.encoder_families.base import register_family
from tessera.models.encoder_families.vit import TensorReader, ViTConfig, ViTFamily

RADIO_ROOT = "vision_model.radio_model.model."
RADIO_TOWER = "vision_model.radio_model."  # RadioModel's buffers live here (summary_idxs, input_conditioner.*)
# NemotronH_Omni_Reasoning_V3's LayerNorm on RadioModel's features (its top-level `vision_final_layernorm`),
# stored under the released name (transformers' conversion_mapping renames it on load, back on save)
RADIO_FINAL_NORM = "vision_projector.vision_final_layernorm."

# Pixel statistics the encoders normalise uint8 tiles with (CLIP's for RADIO).
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@dataclass
class RadioConfig(ViTConfig):
    # Non-parameter tensors of the checkpoint, checked on import and written back on export: summary_idxs
    # (RadioConfig.summary_idxs, transformers' default; RadioModel always saves it; None: not stored) and whether
    # input_conditioner.norm_{mean,std} (= mean/std as float32) is stored: NVIDIA's released files carry it,
    # transformers' Omni (conditioner external) saves none.
    summary_idxs: tuple | None
    input_conditioner: bool


RADIO_VIT_H = RadioConfig(
    patch=16, hidden=1280, layers=32, heads=16, ffn=5120, eps=1e-6, act="gelu",
    # C-RADIO keeps 10 prefix tokens (cls + registers); they are dropped from the output.
    prefix_tokens=10,
    # Learned position table for a 128x128 patch grid (2048 px), interpolated to each input's grid by
    # RADIO's CPE rule: bilinear to a square of the grid's longer side, then its top-left window.
    pos_grid=128, pos_interp="bilinear", pos_resize="cpe",
    # temporal_patch: frames fused by the video tubelet embedder.
    tile=512, pixel_shuffle=2, temporal_patch=2, mean=CLIP_MEAN, std=CLIP_STD,
    projector_hidden=None,  # the projector's hidden width; None = 4x its input (Nano VL: 5120 -> 20480)
    # RadioModel ends at its last block: no final norm. NemotronH_Omni_Reasoning_V3 adds one LayerNorm
    # (`vision_final_layernorm`, on the patch features before pixel shuffle) only when its LLM has MTP layers
    # (text_config.num_nextn_predict_layers > 0); final_norm=True is that model.
    final_norm=False,
    # Every RadioLayer scales its attention and MLP outputs per channel before the residual add (learned
    # blocks.N.layer_scale{1,2}.lambda1); the value is the initial one (RadioConfig.layerscale_value).
    layer_scale=1.0,
    summary_idxs=(0, 1), input_conditioner=True,
)
# Test size: every width divides by TP=2 and by the head count; 64-px tiles of 16-px patches -> 4x4 patches ->
# 4 tokens after pixel shuffle. Laid out as transformers saves it: one cls token (summary_idxs (0,)), no
# conditioner.
RADIO_VIT_TINY = replace(RADIO_VIT_H, hidden=32, layers=2, heads=4, ffn=64, prefix_tokens=2, pos_grid=8, tile=64,
                         summary_idxs=(0,), input_conditioner=False)

# buffer -> (config field, why a different stored value cannot be loaded)
_RADIO_BUFFERS = {
    "summary_idxs": ("summary_idxs", "set summary_idxs to the checkpoint's value"),
    "input_conditioner.norm_mean": ("input_conditioner", "Tessera normalises pixels with the config's mean/std, as "
                                    "the Omni processor does; this tower was trained with other statistics"),
    "input_conditioner.norm_std": ("input_conditioner", "Tessera normalises pixels with the config's mean/std, as "
                                   "the Omni processor does; this tower was trained with other statistics"),
}


def radio_buffers(cfg: ViTConfig) -> dict:
    """The RADIO tower's non-parameter checkpoint tensors as transformers' RadioModel builds them from its config:
    summary_idxs (int64) and, where the layout stores it, input_conditioner.norm_{mean,std} (float32 [3, 1, 1])."""
    import torch

    out = {}
    if cfg.summary_idxs is not None:
        out[RADIO_TOWER + "summary_idxs"] = torch.tensor(cfg.summary_idxs, dtype=torch.long)
    if cfg.input_conditioner:
        for name, values in (("norm_mean", cfg.mean), ("norm_std", cfg.std)):
            out[f"{RADIO_TOWER}input_conditioner.{name}"] = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)
    return out


@register_family
class RadioFamily(ViTFamily):
    name, Config = "radio", RadioConfig
    layer_names = {"input_layernorm": "norm1", "self_attention.linear_proj": "attn.proj",
                   "pre_mlp_layernorm": "norm2", "mlp.linear_fc1": "mlp.fc1", "mlp.linear_fc2": "mlp.fc2"}
    # a final norm the config does not have (final_norm=False), or under transformers' own name
    # (`vision_final_layernorm.`, not the released one), is refused rather than dropped
    tower_roots = ("vision_model.", "vision_projector.", "vision_final_layernorm.")

    def layer_root(self, i):
        return f"{RADIO_ROOT}blocks.{i}."

    def embed_keys(self, cfg):
        g = RADIO_ROOT + "patch_generator."
        keys = {"embedder.weight": g + "embedder.weight", "pos_embed": g + "pos_embed"}
        if cfg.prefix_tokens:
            keys["prefix"] = g + "cls_token.token"
        if cfg.temporal_patch:
            keys["video_embedder.weight"] = g + "video_embedder.weight"
        if cfg.final_norm:
            keys.update({f"final_norm.{k}": RADIO_FINAL_NORM + k for k in ("weight", "bias")})
        return keys

    def missing_hint(self, key):
        return ": set final_norm=False for an Omni checkpoint whose LLM has no MTP layers" \
            if key.startswith(RADIO_FINAL_NORM) else ""

    def extra_import(self, cfg, take: TensorReader):
        """Consume summary_idxs / input_conditioner: stored exactly when the config says so, with exactly its
        values. Nothing is computed from them (no summary output; the Omni model's RadioModel has its
        conditioner made external), so the config is the one source and export writes them back from it."""
        import torch

        want = radio_buffers(cfg)
        for name, (field, why) in _RADIO_BUFFERS.items():
            key = RADIO_TOWER + name
            if (key in take.hf) != (key in want):
                raise KeyError(f"{key} is {'in' if key in take.hf else 'missing from'} the checkpoint, but "
                               f"{take.owner} has {field}={getattr(cfg, field)!r}: set {field} to match the checkpoint")
            if key in want:
                got = take(key)
                if got.dtype != want[key].dtype or got.shape != want[key].shape or not torch.equal(got, want[key]):
                    raise ValueError(f"{key} = {got.flatten().tolist()} ({got.dtype}) differs from "
                                     f"{want[key].flatten().tolist()} ({want[key].dtype}) of {take.owner}: {why}")

    def extra_export(self, cfg):
        return radio_buffers(cfg)

    def release_issue(self, cfg):
        if cfg.pos_interp != "bilinear" or cfg.pos_resize != "cpe" or cfg.act != "gelu" \
                or cfg.final_norm:
            return ("this RADIO differs from the release's (position rule, activation or final norm: "
                    f"{cfg.pos_interp}/{cfg.pos_resize}, {cfg.act}, final_norm={cfg.final_norm})")
        if cfg.layer_scale is None:
            return "a RADIO without layer scales: the release's RadioLayer always has them"
        return ""
