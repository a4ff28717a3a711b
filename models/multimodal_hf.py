"""Hugging Face import/export of the encoders and projectors in the NemotronH_Nano_VL_V2 / Omni key layout.

    vision (radio)   vision_model.radio_model.model.{patch_generator.{embedder,pos_embed,cls_token.token,
                     video_embedder}, blocks.N.{norm1,attn.qkv,attn.proj,layer_scale1.lambda1,norm2,mlp.fc1,
                     mlp.fc2,layer_scale2.lambda1}}, vision_model.radio_model.{summary_idxs,
                     input_conditioner.norm_{mean,std}} (buffers, as the config says: radio_buffers), and
                     vision_projector.vision_final_layernorm.{weight,bias} (the Omni model's norm on
                     RadioModel's features, only with final_norm; transformers loads it as
                     `vision_final_layernorm`)
    vision (siglip)  vision_model.{embeddings.{patch_embedding,position_embedding},
                     encoder.layers.N.{layer_norm1,self_attn.{q,k,v,out}_proj,layer_norm2,mlp.fc1,mlp.fc2},
                     post_layernorm}   (a transformers SiglipVisionModel stored as the tower `vision_model`)
    projector        mlp1.{0,1,3}.weight          sound projector  sound_projection.{norm,linear1,linear2}.weight
    sound encoder    sound_encoder.encoder.*  in transformers' ParakeetEncoder names; NeMo's ConformerEncoder
                     names are renamed one-to-one (same tensors, same shapes)
The language model goes through models/nemotron_h_hf under `language_model.`.

QKV: HF stores [q; k; v] (all heads each); megatron's linear_qkv stores per head [q_h; k_h; v_h], so a TP
rank's contiguous row block holds whole heads. Column-parallel rows and row-parallel columns split evenly;
biases of row-parallel linears, norms and layer scales are replicated. `vision_from_hf(..., tp_rank, tp)` gives
one rank's shard, `vision_to_hf([shard per tp rank])` merges them back, bit-exactly.
"""

from __future__ import annotations

import re

import torch

RADIO_ROOT, SIGLIP_ROOT = "vision_model.radio_model.model.", "vision_model."
RADIO_TOWER = "vision_model.radio_model."  # RadioModel's buffers live here (summary_idxs, input_conditioner.*)
# NemotronH_Omni_Reasoning_V3's LayerNorm on RadioModel's features (its top-level `vision_final_layernorm`),
# stored under the released name (transformers' conversion_mapping renames it on load, back on save)
RADIO_FINAL_NORM = "vision_projector.vision_final_layernorm."
PROJECTOR_ROOT = {"vision": "mlp1.", "audio": "sound_projection."}
SOUND_ROOT = "sound_encoder.encoder."

# our layer scales (the bda modules of models/vision.py) -> RadioLayer's, one [hidden] tensor each
_LAYER_SCALE = {"self_attn_bda.lambda1": "layer_scale1.lambda1", "mlp_bda.lambda1": "layer_scale2.lambda1"}

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


def _embed_keys(cfg: dict) -> dict[str, str]:
    """Our names -> HF names of the tower's tensors outside its layers, those this config has."""
    if cfg["family"] == "radio":
        g = RADIO_ROOT + "patch_generator."
        keys = {"embedder.weight": g + "embedder.weight", "pos_embed": g + "pos_embed"}
        if cfg["prefix_tokens"]:
            keys["prefix"] = g + "cls_token.token"
        if cfg["temporal_patch"]:
            keys["video_embedder.weight"] = g + "video_embedder.weight"
        norm = RADIO_FINAL_NORM
    else:
        e = SIGLIP_ROOT + "embeddings."
        keys = {"embedder.weight": e + "patch_embedding.weight", "embedder.bias": e + "patch_embedding.bias",
                "pos_embed": e + "position_embedding.weight"}
        norm = SIGLIP_ROOT + "post_layernorm."
    if cfg["final_norm"]:
        keys.update({"final_norm.weight": norm + "weight", "final_norm.bias": norm + "bias"})
    return keys


def radio_buffers(cfg: dict) -> dict[str, torch.Tensor]:
    """The RADIO tower's non-parameter checkpoint tensors as transformers' RadioModel builds them from its config:
    summary_idxs (int64) and, where the layout stores it, input_conditioner.norm_{mean,std} (float32 [3, 1, 1])."""
    out = {}
    if cfg["summary_idxs"] is not None:
        out[RADIO_TOWER + "summary_idxs"] = torch.tensor(cfg["summary_idxs"], dtype=torch.long)
    if cfg["input_conditioner"]:
        for name, values in (("norm_mean", cfg["mean"]), ("norm_std", cfg["std"])):
            out[f"{RADIO_TOWER}input_conditioner.{name}"] = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)
    return out


# buffer -> (config field, why a different stored value cannot be loaded)
_RADIO_BUFFERS = {
    "summary_idxs": ("summary_idxs", "set summary_idxs to the checkpoint's value"),
    "input_conditioner.norm_mean": ("input_conditioner", "Tessera normalises pixels with the config's mean/std, as "
                                    "the Omni processor does; this tower was trained with other statistics"),
    "input_conditioner.norm_std": ("input_conditioner", "Tessera normalises pixels with the config's mean/std, as "
                                   "the Omni processor does; this tower was trained with other statistics"),
}


class _Reader:
    """HF tensors read by name; remembers what was read so that a tensor nobody reads can be named."""

    def __init__(self, hf: dict, cfg: dict):
        self.hf, self.read, self.owner = hf, set(), f"encoder {cfg.get('name', cfg['family'])!r}"

    def __call__(self, key: str) -> torch.Tensor:
        if key not in self.hf:
            fix = ": set final_norm=False for an Omni checkpoint whose LLM has no MTP layers" \
                if key.startswith(RADIO_FINAL_NORM) else ""
            raise KeyError(f"{key} is missing from the checkpoint ({self.owner} has that tensor{fix})")
        self.read.add(key)
        return self.hf[key]

    def check_radio_buffers(self, cfg: dict) -> None:
        """Consume summary_idxs / input_conditioner: stored exactly when the config says so, with exactly its
        values. Nothing is computed from them (no summary output; the Omni model's RadioModel has its
        conditioner made external), so the config is the one source and export writes them back from it."""
        want = radio_buffers(cfg)
        for name, (field, why) in _RADIO_BUFFERS.items():
            key = RADIO_TOWER + name
            if (key in self.hf) != (key in want):
                raise KeyError(f"{key} is {'in' if key in self.hf else 'missing from'} the checkpoint, but "
                               f"{self.owner} has {field}={cfg[field]!r}: set {field} to match the checkpoint")
            if key in want:
                got = self(key)
                if got.dtype != want[key].dtype or got.shape != want[key].shape or not torch.equal(got, want[key]):
                    raise ValueError(f"{key} = {got.flatten().tolist()} ({got.dtype}) differs from "
                                     f"{want[key].flatten().tolist()} ({want[key].dtype}) of {self.owner}: {why}")

    def check_all_read(self, cfg: dict) -> None:
        # a final norm the config does not have (final_norm=False), or under transformers' own name
        # (`vision_final_layernorm.`, not the released one), is refused rather than dropped
        roots = (SIGLIP_ROOT,) if cfg["family"] == "siglip" else (SIGLIP_ROOT, "vision_projector.",
                                                                  "vision_final_layernorm.")
        left = sorted(k for k in self.hf if k.startswith(roots) and k not in self.read)
        if left:
            raise KeyError(f"checkpoint tensors {left[:8]}{' ...' if len(left) > 8 else ''} have no place in "
                           f"{self.owner} (final_norm={cfg['final_norm']}, layer_scale={cfg['layer_scale']})")


def vision_adapter_targets(name: str, b: torch.Tensor, cfg: dict) -> list[tuple[str, torch.Tensor]]:
    """(HF module, rows of B) of a LoRA adapter on the ViT layer linear `layers.N.<megatron suffix>` (one-rank
    B [out, r]), for PEFT's adapter files: the HF module the weight converters map that linear to (RADIO's
    blocks.N.attn.qkv / attn.proj / mlp.fc1 / mlp.fc2, SigLIP's self_attn.{q,k,v}_proj / out_proj / mlp.fc*), a
    fused qkv's rows reordered from megatron's per-head [q_h; k_h; v_h] to HF's [q; k; v] as the weight is, so
    that W_hf + (alpha/r) B_hf A is the merged export."""
    _, i, suffix = name.split(".", 2)
    family, root = cfg["family"], _layer_root(cfg["family"], int(i))
    if suffix == "self_attention.linear_qkv":
        b = _qkv_major(b, cfg["heads"])
        if family == "radio":
            return [(root + "attn.qkv", b)]
        return [(f"{root}self_attn.{x}_proj", t) for x, t in zip("qkv", b.chunk(3))]
    return [(root + _LAYER[suffix][0][family], b)]


def vision_from_hf(hf: dict, cfg: dict, tp_rank: int = 0, tp: int = 1) -> dict[str, torch.Tensor]:
    """One TP rank's VisionTransformer state dict from HF-layout tensors. Every tensor the config's tower has must
    be there and every tower tensor in `hf` must be read (else KeyError naming it), the Omni model's final norm
    (final_norm, RADIO) too: transformers >= 5.24 reads it from the checkpoint as well."""
    family, heads, p, d = cfg["family"], cfg["heads"], cfg["patch"], cfg["hidden"]
    take, out = _Reader(hf, cfg), {}
    for ours, theirs in _embed_keys(cfg).items():
        out[ours] = take(theirs)
    if family == "siglip":  # Conv2d [D, 3, p, p] and table [N, D] -> our linear [D, 3pp] and [1, N, D]
        out["embedder.weight"] = out["embedder.weight"].reshape(d, 3 * p * p)
        out["pos_embed"] = out["pos_embed"][None]
    else:
        take.check_radio_buffers(cfg)
    for i in range(cfg["layers"]):
        root, mine = _layer_root(family, i), f"layers.{i}."
        for kind in ("weight", "bias"):
            if family == "radio":
                qkv = take(f"{root}attn.qkv.{kind}")
            else:
                qkv = torch.cat([take(f"{root}self_attn.{x}_proj.{kind}") for x in "qkv"])
            out[f"{mine}self_attention.linear_qkv.{kind}"] = _head_major(qkv, heads).chunk(tp)[tp_rank]
            for ours, (names, split) in _LAYER.items():
                t = take(f"{root}{names[family]}.{kind}")
                if split == "col" or (split == "row" and kind == "weight"):
                    t = t.chunk(tp, dim=0 if split == "col" else 1)[tp_rank]
                out[f"{mine}{ours}.{kind}"] = t
        if cfg["layer_scale"] is not None:  # [hidden], replicated on every TP rank
            for ours, theirs in _LAYER_SCALE.items():
                out[mine + ours] = take(root + theirs)
    take.check_all_read(cfg)
    return {k: v.clone() for k, v in out.items()}


def vision_to_hf(shards: list[dict], cfg: dict) -> dict[str, torch.Tensor]:
    """Merge per-TP-rank VisionTransformer state dicts (index = tp rank) into HF-layout tensors."""
    family, heads, p, first = cfg["family"], cfg["heads"], cfg["patch"], shards[0]
    out = {theirs: first[ours] for ours, theirs in _embed_keys(cfg).items()}
    if family == "siglip":
        e = SIGLIP_ROOT + "embeddings."
        out[e + "patch_embedding.weight"] = first["embedder.weight"].reshape(cfg["hidden"], 3, p, p)
        out[e + "position_embedding.weight"] = first["pos_embed"][0]
    else:
        out.update(radio_buffers(cfg))
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
        if cfg["layer_scale"] is not None:  # replicated: every rank holds the same tensor
            for ours, theirs in _LAYER_SCALE.items():
                out[root + theirs] = first[mine + ours]
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


def media_to_hf(key: str, mod, tp_shards: list[dict] | None = None) -> dict[str, torch.Tensor]:
    """HF-layout tensors of one media module (encoder + projector); tp_shards: the vision tower's per-TP-rank
    state dicts when it ran with TP>1."""
    sd = {k: v.detach().clone() for k, v in mod.projector.state_dict().items()}
    out = {PROJECTOR_ROOT[key] + k: v for k, v in sd.items()}
    if mod.cfg["modality"] == "vision":
        out.update(vision_to_hf([_params_only(s) for s in tp_shards or [mod.encoder.vit.state_dict()]], mod.cfg))
    else:
        out.update(sound_to_hf(_params_only(mod.encoder.encoder.state_dict()), mod.cfg["family"]))
    return out


def export_hf(model, tp_shards: dict[str, list[dict]] | None = None) -> dict[str, torch.Tensor]:
    """HF-layout tensors of a MultimodalModel's encoders, projectors and (TP=1) LLM.
    tp_shards: module key -> per-TP-rank vision tower state dicts, when the tower ran with TP>1."""
    from tessera.models.nemotron_h_hf import megatron_to_hf

    out = {}
    for key, mod in model.media.items():
        out.update(media_to_hf(key, mod, (tp_shards or {}).get(key)))
    llm = megatron_to_hf({(0, 0, 0): model.llm.state_dict()}, model.llm.config)
    out.update({"language_model." + k: v for k, v in llm.items()})
    return out


def import_hf(model, hf: dict, tp_rank: int = 0) -> None:
    """Load HF-layout tensors into a MultimodalModel (this rank's TP shard); every parameter must be given."""
    from tessera.models.nemotron_h_hf import PrefixView, load_into

    tp = model.llm.pg_collection.tp.size()
    for key, mod in model.media.items():
        root = PROJECTOR_ROOT[key]
        mod.projector.load_state_dict({k[len(root):]: hf[k] for k in hf if k.startswith(root)})
        if mod.cfg["modality"] == "vision":
            _load_params(mod.encoder.vit, vision_from_hf(hf, mod.cfg, tp_rank, tp))
        else:
            inner = mod.encoder.encoder
            _load_params(inner, sound_from_hf(hf, _params_only(inner.state_dict()).keys(), mod.cfg["family"]))
    lm = PrefixView(hf, "language_model.")  # read on access: a LazyCheckpoint reads only what is used
    load_into(model.llm, lm, tp_rank, 0)


def _params_only(sd: dict) -> dict:
    """Drop megatron's `_extra_state` entries (fp8 metadata, None here): not model weights."""
    return {k: v for k, v in sd.items() if not k.endswith("_extra_state")}


def _load_params(module, sd: dict) -> None:
    missing, unexpected = module.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"{type(module).__name__}: missing {missing[:8]}, unexpected {unexpected[:8]}")
