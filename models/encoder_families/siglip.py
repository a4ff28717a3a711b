"""SigLIP: a ViT with a conv patch embedding with bias (stored here as the equivalent linear over flattened
patches), no prefix tokens, tanh-GELU, the position table of its training grid and a final LayerNorm
(post_layernorm), stored as transformers' SiglipVisionModel under the tower name `vision_model`:

    vision_model.{embeddings.{patch_embedding,position_embedding},
    encoder.layers.N.{layer_norm1,self_attn.{q,k,v,out}_proj,layer_norm2,mlp.fc1,mlp.fc2}, post_layernorm}
"""

from __future__ import annotations

from dataclasses import replace

from tessera.models.encoder_families.base import register_family
from tessera.models.encoder_families.vit import ViTConfig, ViTFamily

SIGLIP_ROOT = "vision_model."

SIGLIP_SO400M = ViTConfig(
    patch=14, hidden=1152, layers=27, heads=16, ffn=4304, eps=1e-6, act="gelu_tanh",
    prefix_tokens=0, pos_grid=27, pos_interp="bicubic", pos_resize="plain",  # trained at 384 px = 27x27 patches
    # 448-px tiles give 32x32 patches, so pixel shuffle 0.5 yields 256 tokens per tile as for RADIO.
    tile=448, pixel_shuffle=2, temporal_patch=0, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
    projector_hidden=None,
    final_norm=True, layer_scale=None,  # SigLIP's post_layernorm; no layer scale
)
SIGLIP_TINY = replace(SIGLIP_SO400M, hidden=32, layers=2, heads=4, ffn=64, pos_grid=4, tile=56)


@register_family
class SiglipFamily(ViTFamily):
    name, Config = "siglip", ViTConfig
    patch_bias, fused_qkv, qkv_name = True, False, "self_attn."
    layer_names = {"input_layernorm": "layer_norm1", "self_attention.linear_proj": "self_attn.out_proj",
                   "pre_mlp_layernorm": "layer_norm2", "mlp.linear_fc1": "mlp.fc1", "mlp.linear_fc2": "mlp.fc2"}
    tower_roots = (SIGLIP_ROOT,)

    def layer_root(self, i):
        return f"{SIGLIP_ROOT}encoder.layers.{i}."

    def embed_keys(self, cfg):
        e = SIGLIP_ROOT + "embeddings."
        keys = {"embedder.weight": e + "patch_embedding.weight", "embedder.bias": e + "patch_embedding.bias",
                "pos_embed": e + "position_embedding.weight"}
        if cfg.final_norm:
            keys.update({"final_norm.weight": SIGLIP_ROOT + "post_layernorm.weight",
                         "final_norm.bias": SIGLIP_ROOT + "post_layernorm.bias"})
        return keys

    def import_embed(self, cfg, out):
        # Conv2d [D, 3, p, p] and table [N, D] -> our linear [D, 3pp] and [1, N, D]
        out["embedder.weight"] = out["embedder.weight"].reshape(cfg.hidden, 3 * cfg.patch ** 2)
        out["pos_embed"] = out["pos_embed"][None]

    def export_embed(self, cfg, out):
        e, p = SIGLIP_ROOT + "embeddings.", cfg.patch
        out[e + "patch_embedding.weight"] = out[e + "patch_embedding.weight"].reshape(cfg.hidden, 3, p, p)
        out[e + "position_embedding.weight"] = out[e + "position_embedding.weight"][0]

    def release_issue(self, cfg):
        return "vision family 'siglip': the release's vision tower is RADIO (use a radio_* encoder)"
