"""Hugging Face import/export of the encoders and projectors in the NemotronH_Nano_VL_V2 / Omni key layout.

    vision (radio)   vision_model.radio_model.model.{patch_generator.{embedder,pos_embed,cls_token.token,
                     video_embedder}, blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}, norm}
    vision (siglip)  vision_model.{embeddings.{patch_embedding,position_embedding},
                     encoder.layers.N.{layer_norm1,self_attn.{q,k,v,out}_proj,layer_norm2,mlp.fc1,mlp.fc2},
                     post_layernorm}   (a transformers SiglipVisionModel stored as the tower `vision_model`)
    projector        mlp1.{0,1,3}.weight          sound projector  sound_projection.{norm,linear1,linear2}.weight
    sound encoder    sound_encoder.encoder.*  in transformers' ParakeetEncoder names; NeMo's ConformerEncoder
                     names are renamed one-to-one (same tensors, same shapes)
The language model goes through models/nemotron_h_hf under `language_model.`.

QKV: HF stores [q; k; v] (all heads each); megatron's linear_qkv stores per head [q_h; k_h; v_h], so a TP
rank's contiguous row block holds whole heads. Column-parallel rows and row-parallel columns split evenly;
biases of row-parallel linears are replicated. `vision_from_hf(..., tp_rank, tp)` gives one rank's shard,
`vision_to_hf([shard per tp rank])` merges them back, bit-exactly.
"""

from __future__ import annotations

import re

import torch

RADIO_ROOT, SIGLIP_ROOT = "vision_model.radio_model.model.", "vision_model."
PROJECTOR_ROOT = {"vision": "mlp1.", "audio": "sound_projection."}
SOUND_ROOT = "sound_encoder.encoder."

# megatron layer suffix -> (HF layer suffix per family, split kind: col / row / None)
_LAYER = {
    "input_layernorm": ({"radio": "norm1", "siglip": "layer_norm1"}, None),
    "self_attention.linear_proj": ({"radio": "attn.proj", "siglip": "self_attn.out_proj"}, "row"),
    "pre_mlp_layernorm": ({"radio": "norm2", "siglip": "layer_norm2"}, None),
    "mlp.linear_fc1": ({"radio": "mlp.fc1", "siglip": "mlp.fc1"}, "col"),
    "mlp.linear_fc2": ({"radio": "mlp.fc2", "siglip": "mlp.fc2"}, "row"),
}
# NeMo ConformerEncoder name fragment -> transformers ParakeetEncoder name fragment
_NEMO_TO_PARAKEET = [
    (r"^pre_encode\.conv\.", "subsampling.layers."), (r"^pre_encode\.out\.", "subsampling.linear."),
    (r"\.conv\.batch_norm\.", ".conv.norm."), (r"\.self_attn\.pos_bias_([uv])$", r".self_attn.bias_\1"),
    (r"\.self_attn\.linear_q\.", ".self_attn.q_proj."), (r"\.self_attn\.linear_k\.", ".self_attn.k_proj."),
    (r"\.self_attn\.linear_v\.", ".self_attn.v_proj."), (r"\.self_attn\.linear_out\.", ".self_attn.o_proj."),
    (r"\.self_attn\.linear_pos\.", ".self_attn.relative_k_proj."),
]


def _layer_root(family: str, i: int) -> str:
    return f"{RADIO_ROOT}blocks.{i}." if family == "radio" else f"{SIGLIP_ROOT}encoder.layers.{i}."


def _head_major(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[q; k; v] -> per head [q_h; k_h; v_h] (weight [3D, D] or bias [3D])."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _qkv_major(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _embed_keys(family: str) -> dict[str, str]:
    if family == "radio":
        g = RADIO_ROOT + "patch_generator."
        return {"embedder.weight": g + "embedder.weight", "pos_embed": g + "pos_embed", "prefix": g + "cls_token.token",
                "video_embedder.weight": g + "video_embedder.weight", "final_norm.weight": RADIO_ROOT + "norm.weight",
                "final_norm.bias": RADIO_ROOT + "norm.bias"}
    e = SIGLIP_ROOT + "embeddings."
    return {"embedder.weight": e + "patch_embedding.weight", "embedder.bias": e + "patch_embedding.bias",
            "pos_embed": e + "position_embedding.weight", "final_norm.weight": SIGLIP_ROOT + "post_layernorm.weight",
            "final_norm.bias": SIGLIP_ROOT + "post_layernorm.bias"}


def vision_from_hf(hf: dict, cfg: dict, tp_rank: int = 0, tp: int = 1) -> dict[str, torch.Tensor]:
    """One TP rank's VisionTransformer state dict from HF-layout tensors."""
    family, heads, p = cfg["family"], cfg["heads"], cfg["patch"]
    out = {}
    for ours, theirs in _embed_keys(family).items():
        if theirs in hf:
            out[ours] = hf[theirs]
    if family == "siglip":  # Conv2d [D, 3, p, p] and table [N, D] -> our linear [D, 3pp] and [1, N, D]
        out["embedder.weight"] = out["embedder.weight"].reshape(cfg["hidden"], 3 * p * p)
        out["pos_embed"] = out["pos_embed"][None]
    for i in range(cfg["layers"]):
        root, mine = _layer_root(family, i), f"layers.{i}."
        for kind in ("weight", "bias"):
            if family == "radio":
                qkv = hf[f"{root}attn.qkv.{kind}"]
            else:
                qkv = torch.cat([hf[f"{root}self_attn.{x}_proj.{kind}"] for x in "qkv"])
            out[f"{mine}self_attention.linear_qkv.{kind}"] = _head_major(qkv, heads).chunk(tp)[tp_rank]
            for ours, (names, split) in _LAYER.items():
                t = hf[f"{root}{names[family]}.{kind}"]
                if split == "col" or (split == "row" and kind == "weight"):
                    t = t.chunk(tp, dim=0 if split == "col" else 1)[tp_rank]
                out[f"{mine}{ours}.{kind}"] = t
    return {k: v.clone() for k, v in out.items()}


def vision_to_hf(shards: list[dict], cfg: dict) -> dict[str, torch.Tensor]:
    """Merge per-TP-rank VisionTransformer state dicts (index = tp rank) into HF-layout tensors."""
    family, heads, p, first = cfg["family"], cfg["heads"], cfg["patch"], shards[0]
    out = {theirs: first[ours] for ours, theirs in _embed_keys(family).items() if ours in first}
    if family == "siglip":
        e = SIGLIP_ROOT + "embeddings."
        out[e + "patch_embedding.weight"] = first["embedder.weight"].reshape(cfg["hidden"], 3, p, p)
        out[e + "position_embedding.weight"] = first["pos_embed"][0]
    for i in range(cfg["layers"]):
        root, mine = _layer_root(family, i), f"layers.{i}."
        for kind in ("weight", "bias"):
            qkv = _qkv_major(torch.cat([s[f"{mine}self_attention.linear_qkv.{kind}"] for s in shards]), heads)
            if family == "radio":
                out[f"{root}attn.qkv.{kind}"] = qkv
            else:
                for x, t in zip("qkv", qkv.chunk(3)):
                    out[f"{root}self_attn.{x}_proj.{kind}"] = t
            for ours, (names, split) in _LAYER.items():
                parts = [s[f"{mine}{ours}.{kind}"] for s in shards]
                if split == "col" or (split == "row" and kind == "weight"):
                    t = torch.cat(parts, dim=0 if split == "col" else 1)
                else:
                    t = parts[0]
                out[f"{root}{names[family]}.{kind}"] = t
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def nemo_to_parakeet_name(key: str) -> str:
    for pattern, repl in _NEMO_TO_PARAKEET:
        key = re.sub(pattern, repl, key)
    return key


def sound_to_hf(encoder_sd: dict, family: str) -> dict[str, torch.Tensor]:
    """State dict of the inner conformer (NeMo ConformerEncoder or ParakeetEncoder) -> sound_encoder.encoder.*"""
    rename = nemo_to_parakeet_name if family == "fastconformer" else (lambda k: k)
    return {SOUND_ROOT + rename(k): v.detach().clone() for k, v in encoder_sd.items()}


def sound_from_hf(hf: dict, encoder_keys, family: str) -> dict[str, torch.Tensor]:
    """The inner conformer's state dict for `encoder_keys` (its own names) from sound_encoder.encoder.*"""
    rename = nemo_to_parakeet_name if family == "fastconformer" else (lambda k: k)
    return {k: hf[SOUND_ROOT + rename(k)].clone() for k in encoder_keys}


def export_hf(model, tp_shards: dict[str, list[dict]] | None = None) -> dict[str, torch.Tensor]:
    """HF-layout tensors of a MultimodalModel's encoders, projectors and (TP=1) LLM.
    tp_shards: module key -> per-TP-rank vision tower state dicts, when the tower ran with TP>1."""
    from tessera.models.nemotron_h_hf import megatron_to_hf

    out = {}
    for key, mod in model.media.items():
        sd = {k: v.detach().clone() for k, v in mod.projector.state_dict().items()}
        out.update({PROJECTOR_ROOT[key] + k: v for k, v in sd.items()})
        if mod.cfg["modality"] == "vision":
            shards = (tp_shards or {}).get(key) or [mod.encoder.vit.state_dict()]
            out.update(vision_to_hf([_params_only(s) for s in shards], mod.cfg))
        else:
            out.update(sound_to_hf(_params_only(mod.encoder.encoder.state_dict()), mod.cfg["family"]))
    llm = megatron_to_hf({(0, 0, 0): model.llm.state_dict()}, model.llm.config)
    out.update({"language_model." + k: v for k, v in llm.items()})
    return out


def import_hf(model, hf: dict, tp_rank: int = 0) -> None:
    """Load HF-layout tensors into a MultimodalModel (this rank's TP shard); every parameter must be given."""
    from tessera.models.nemotron_h_hf import load_into

    tp = model.llm.pg_collection.tp.size()
    for key, mod in model.media.items():
        root = PROJECTOR_ROOT[key]
        mod.projector.load_state_dict({k[len(root):]: v for k, v in hf.items() if k.startswith(root)})
        if mod.cfg["modality"] == "vision":
            _load_params(mod.encoder.vit, vision_from_hf(hf, mod.cfg, tp_rank, tp))
        else:
            inner = mod.encoder.encoder
            _load_params(inner, sound_from_hf(hf, _params_only(inner.state_dict()).keys(), mod.cfg["family"]))
    lm = {k[len("language_model."):]: v for k, v in hf.items() if k.startswith("language_model.")}
    load_into(model.llm, lm, tp_rank, 0)


def _params_only(sd: dict) -> dict:
    """Drop megatron's `_extra_state` entries (fp8 metadata, None here): not model weights."""
    return {k: v for k, v in sd.items() if not k.endswith("_extra_state")}


def _load_params(module, sd: dict) -> None:
    missing, unexpected = module.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"{type(module).__name__}: missing {missing[:8]}, unexpected {unexpected[:8]}")
