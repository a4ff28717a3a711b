"""Any transformers vision or audio encoder by path: `model.vision=hf:DIR`, `model.audio=hf:DIR`.

DIR is a local transformers directory (save_pretrained's config.json + weights, and the model's image processor or
feature extractor). Its config.json tells the two `hf:` forms apart: a release Tessera loads (models/released.py)
names one of its encoders as `hf:DIR#vision` / `hf:DIR#audio`; any other model type below is an encoder of its own,
`hf:DIR` (a `#modality` suffix, if given, must be its modality). Supported model types:

    vision  siglip, siglip2 (NaFlex), clip and their *_vision_model: the vision tower of the dual model
            (transformers' SiglipVisionModel / Siglip2VisionModel / CLIPVisionModel), last_hidden_state without
            the CLIP class token; SigLIP's attention-pooling head is not built (no output uses it)
    audio   whisper (the encoder of the encoder-decoder model), wav2vec2, hubert: last_hidden_state, the rows
            that cover the clip's own samples

What the data side feeds comes from the processor (AutoImageProcessor / AutoFeatureExtractor, the PIL-based ones:
torchvision is not installed): images are cut into square tiles of the processor's own output size (SigLIP2: the
largest square grid within max_num_patches), on which its resize is the identity, then rescaled and normalised
with its factors (HFPixels); audio goes through the feature extractor itself (HFAudioFeatures). Tokens per item:
a tile's patches (pixel shuffle 1); a clip's encoder rows over its valid samples, counted by the conv stack that
makes them (models/media_tokens.EncoderTokens.audio_convs: Whisper's hop framing and stride-2 conv, truncated to
its window; wav2vec2's feature-encoder convs). The projector takes the tower's hidden size. FLOPs are torch's
FlopCounterMode on a meta-device forward of the tower (planner_fields). Dropout, LayerDrop and SpecAugment are
switched off at load, so training is deterministic and a layout equals one device; layers split over data
parallel ranks only (tp1, cp1, pp1).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import torch  # (torch only: transformers, the model stack, loads inside the methods)
from torch import nn

from tessera.models.encoder_families.base import EncoderFamily, register_family

PREFIX = "hf:"
# model_type -> (transformers class loaded from DIR, class tokens before the patches); a dual model's config.json
# has its tower's under vision_config, which these classes' from_pretrained read
VISION_TYPES = {"siglip": ("SiglipVisionModel", 0), "siglip_vision_model": ("SiglipVisionModel", 0),
                "siglip2": ("Siglip2VisionModel", 0), "siglip2_vision_model": ("Siglip2VisionModel", 0),
                "clip": ("CLIPVisionModel", 1), "clip_vision_model": ("CLIPVisionModel", 1)}
AUDIO_TYPES = {"whisper": "WhisperModel", "wav2vec2": "Wav2Vec2Model", "hubert": "HubertModel"}
CHECKPOINT_ROOT = {"vision": "vision_tower.", "audio": "audio_tower."}  # this family's tensors in Tessera's files


class HFEncoderError(ValueError):
    """`hf:DIR` names no transformers encoder Tessera takes."""


@dataclasses.dataclass
class HFVisionConfig:
    directory: str        # the transformers directory (config.json, weights, preprocessor_config.json)
    model_type: str       # config.json's model_type (VISION_TYPES)
    hidden: int
    layers: int
    heads: int
    ffn: int              # the layers' MLP width (the planner's activation bytes)
    patch: int
    tile: int             # square tile side the processor keeps as it is
    prefix_tokens: int    # class tokens dropped from the output (CLIP: 1)
    pixel_shuffle: int    # 1: one token per patch
    rescale: float        # the processor's rescale_factor (1/255)
    mean: tuple
    std: tuple
    projector_hidden: int | None  # None = 4x the tower's hidden size (models/multimodal's default)


@dataclasses.dataclass
class HFAudioConfig:
    directory: str
    model_type: str       # AUDIO_TYPES
    hidden: int
    layers: int
    heads: int
    ffn: int
    sample_rate: int      # the feature extractor's sampling_rate
    window_samples: int   # samples one encoder pass takes (Whisper's chunk; 0: any length)
    convs: tuple          # (kernel, stride, padding) of each stage from samples to encoder rows
    projector_hidden: int | None


def _split(name: str) -> tuple[Path, str]:
    directory, _, modality = name[len(PREFIX):].partition("#")
    return Path(directory).expanduser(), modality


def _config_json(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise HFEncoderError(f"{path} not found: `hf:DIR` names a local transformers directory (save_pretrained's "
                             f"config.json, weights and preprocessor_config.json)")
    return json.loads(path.read_text())


def is_transformers_encoder(name: str) -> bool:
    """Whether `name` (hf:DIR or hf:DIR#modality) names an encoder of this file, not a release's: told apart by
    DIR/config.json's model_type. A DIR that is neither raises HFEncoderError naming what each form takes."""
    if not name.startswith(PREFIX):
        return False
    directory, modality = _split(name)
    model_type = _config_json(directory).get("model_type")
    if model_type in VISION_TYPES or model_type in AUDIO_TYPES:
        return True
    from tessera.models.release_layouts import layout_of

    if layout_of(_config_json(directory)) is not None:
        if not modality:
            raise HFEncoderError(f"{name!r}: {directory} is a release; name one of its encoders: "
                                 f"hf:{directory}#vision or hf:{directory}#audio")
        return False
    raise HFEncoderError(f"{name!r}: {directory}/config.json has model_type {model_type!r}, neither a transformers "
                         f"encoder `hf:DIR` takes (vision: {', '.join(sorted(VISION_TYPES))}; audio: "
                         f"{', '.join(sorted(AUDIO_TYPES))}) nor a release `hf:DIR#modality` names "
                         f"(models/released.py)")


@functools.lru_cache(maxsize=None)
def _derived(name: str) -> tuple[str, dict]:
    directory, modality = _split(name)
    config = _config_json(directory)
    model_type = config["model_type"]
    own = "vision" if model_type in VISION_TYPES else "audio"
    if modality and modality != own:
        raise HFEncoderError(f"{name!r}: {directory} holds a {own} encoder ({model_type}), not a {modality} one")
    cfg = _vision(directory, model_type) if own == "vision" else _audio(directory, model_type)
    return own, dataclasses.asdict(cfg)


def encoder_config_of(name: str) -> dict:
    """The config dict (models/encoders.py's form: fields + family, modality, name) of `hf:DIR`."""
    modality, fields = _derived(name)
    return {**fields, "family": FAMILY_OF[modality], "modality": modality, "name": name}


def _vision(directory: Path, model_type: str) -> HFVisionConfig:
    from transformers import AutoConfig, AutoImageProcessor

    config = AutoConfig.from_pretrained(directory)
    v = getattr(config, "vision_config", config)
    proc = AutoImageProcessor.from_pretrained(directory)
    patch = v.patch_size
    if getattr(proc, "max_num_patches", None):  # SigLIP2 NaFlex: the largest square patch grid within its budget
        tile = math.isqrt(proc.max_num_patches) * patch
    else:
        size = proc.crop_size if getattr(proc, "do_center_crop", False) else proc.size
        sides = {size.get(k) for k in ("height", "width", "shortest_edge") if size.get(k)}
        if len(sides) != 1:
            raise HFEncoderError(f"{directory}: the image processor's output size {dict(size)} is not square; "
                                 f"Tessera tiles images into squares")
        tile = sides.pop()
    if tile % patch:
        raise HFEncoderError(f"{directory}: the processor's {tile}-px output is not a multiple of patch {patch}")
    return HFVisionConfig(str(directory.resolve()), model_type, v.hidden_size, v.num_hidden_layers,
                          v.num_attention_heads, v.intermediate_size, patch, tile, VISION_TYPES[model_type][1], 1,
                          float(proc.rescale_factor if proc.do_rescale else 1.0),
                          tuple(proc.image_mean) if proc.do_normalize else (0.0,) * 3,
                          tuple(proc.image_std) if proc.do_normalize else (1.0,) * 3, None)


def _audio(directory: Path, model_type: str) -> HFAudioConfig:
    from transformers import AutoConfig, AutoFeatureExtractor

    config = AutoConfig.from_pretrained(directory)
    fe = AutoFeatureExtractor.from_pretrained(directory)
    if model_type == "whisper":
        # hop framing of the window (the feature extractor's mask), then conv1 (k3 s1 p1) and conv2 (k3 s2 p1)
        return HFAudioConfig(str(directory.resolve()), model_type, config.d_model, config.encoder_layers,
                             config.encoder_attention_heads, config.encoder_ffn_dim, fe.sampling_rate, fe.n_samples,
                             ((1, fe.hop_length, 0), (3, 1, 1), (3, 2, 1)), None)
    convs = tuple((k, s, 0) for k, s in zip(config.conv_kernel, config.conv_stride))
    return HFAudioConfig(str(directory.resolve()), model_type, config.hidden_size, config.num_hidden_layers,
                         config.num_attention_heads, config.intermediate_size, fe.sampling_rate, 0, convs, None)


# -- modules --------------------------------------------------------------------------------------------------

def _deterministic(config) -> None:
    """Dropout, LayerDrop and SpecAugment off (in place): training equal in every layout, as Tessera's encoders."""
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and (key.endswith("dropout") or key.endswith("layerdrop")
                                         or key.startswith("mask_time_prob") or key.startswith("mask_feature_prob")):
            setattr(config, key, 0.0)
    if hasattr(config, "apply_spec_augment"):
        config.apply_spec_augment = False


def load_transformers_model(cfg: dict):
    """The tower of cfg's directory: its weights, or on the meta device (models/meta_device.meta_build) shapes only."""
    import transformers

    directory, model_type = cfg["directory"], cfg["model_type"]
    cls = getattr(transformers, VISION_TYPES[model_type][0] if cfg["modality"] == "vision" else AUDIO_TYPES[model_type])
    config = cls.config_class.from_pretrained(directory)
    _deterministic(config)
    if hasattr(config, "vision_use_head"):
        config.vision_use_head = False  # SigLIP's attention-pooling head: no output Tessera uses
    if torch.empty(0).is_meta:
        model = cls(config)
    else:
        model = cls.from_pretrained(directory, config=config, dtype=torch.float32)
    return model.encoder if model_type == "whisper" else model


class HFPixels(nn.Module):
    """uint8 tiles [n, 3, tile, tile] -> the processor's pixel_values of them: rescaled, normalised (fp32)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.rescale = cfg["rescale"]
        self.register_buffer("mean", torch.tensor(cfg["mean"]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(cfg["std"]).view(1, 3, 1, 1), persistent=False)

    def forward(self, tiles):
        tiles = torch.as_tensor(tiles).to(self.mean.device)
        return (tiles.float() * self.rescale - self.mean) / self.std


class HFVisionTower(nn.Module):
    """Normalised tiles [n, 3, tile, tile] -> the tower's patch features as a grid [n, rows, cols, hidden]."""

    cp = pp = 1
    stage, first_stage, last_stage = 0, True, True

    def __init__(self, cfg: dict, recompute: str):
        super().__init__()
        self.cfg, self.model = cfg, load_transformers_model(cfg)
        if recompute != "none":  # transformers' layer checkpointing: each layer recomputed in backward
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def inputs(self, pixels) -> dict:
        """The tower's forward arguments for normalised tiles: pixel_values, and for SigLIP2 the processor's
        patch rows (convert_image_to_patches' (rows, cols, p, p, c) order) and spatial shapes."""
        if not self.cfg["model_type"].startswith("siglip2"):
            return {"pixel_values": pixels}
        n, c, h, w = pixels.shape
        p = self.cfg["patch"]
        patches = pixels.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(n, -1, p * p * c)
        shapes = torch.tensor([[h // p, w // p]] * n, dtype=torch.long, device=pixels.device)
        # no mask: a tile fills its max_num_patches, so the processor's mask is all ones (no padded patch)
        return {"pixel_values": patches, "pixel_attention_mask": None, "spatial_shapes": shapes}

    def forward(self, pixels):
        n, _, h, w = pixels.shape
        if (h, w) != (self.cfg["tile"],) * 2 and not self.cfg["model_type"].startswith("siglip2"):
            # a fixed-size tower's position table holds the processor's grid only (SigLIP2 resizes its own)
            raise ValueError(f"encoder {self.cfg['name']!r} takes {self.cfg['tile']}-px tiles, got {w}x{h} images: "
                             f"use it with tiled images (the vl recipes), not native-resolution ones (omni)")
        hidden = self.model(**self.inputs(pixels)).last_hidden_state[:, self.cfg["prefix_tokens"]:]
        p = self.cfg["patch"]
        return hidden.reshape(n, h // p, w // p, -1)


class HFVisionEncoder(nn.Module):
    """uint8 tiles [n, 3, tile, tile] -> tokens [n * patches, hidden] (models/vision.VisionEncoder's interface)."""

    def __init__(self, cfg: dict, recompute: str = "none"):
        super().__init__()
        self.cfg, self.pixels, self.vit = cfg, HFPixels(cfg), HFVisionTower(cfg, recompute)

    @property
    def out_dim(self) -> int:
        return self.cfg["hidden"]

    def normalize(self, tiles):
        """Normalised pixels in the tower's dtype (the run's: bf16 on GPUs)."""
        return self.pixels(tiles).to(next(self.vit.parameters()).dtype)

    def grid_tokens(self, tiles):
        return self.vit(self.normalize(tiles))

    def forward(self, tiles):
        return self.grid_tokens(tiles).flatten(0, 2)


class HFAudioFeatures:
    """The model's own feature extractor on a list of waveforms -> (encoder input [b, ...], valid samples [b])."""

    def __init__(self, cfg: dict):
        from transformers import AutoFeatureExtractor

        self.cfg, self.extractor = cfg, AutoFeatureExtractor.from_pretrained(cfg["directory"])

    def __call__(self, waves: list):
        import numpy as np

        device = torch.as_tensor(waves[0]).device
        arrays = [torch.as_tensor(w, dtype=torch.float32).cpu().numpy() for w in waves]
        window = self.cfg["window_samples"]
        lengths = torch.tensor([min(len(a), window) if window else len(a) for a in arrays], device=device)
        if self.cfg["model_type"] == "whisper":
            out = self.extractor(arrays, sampling_rate=self.cfg["sample_rate"], return_tensors="np")
            return torch.from_numpy(np.asarray(out["input_features"])).to(device), lengths
        # wav2vec2 / HuBERT: normalised per clip, each clip its own pass (padding would change group norm)
        out = [self.extractor(a, sampling_rate=self.cfg["sample_rate"], return_tensors="np")["input_values"][0]
               for a in arrays]
        batch = torch.zeros(len(out), int(lengths.max()), device=device)
        for i, a in enumerate(out):
            batch[i, :len(a)] = torch.from_numpy(np.asarray(a))
        return batch, lengths


class HFAudioEncoder(nn.Module):
    """Float waveforms -> per clip [tokens, hidden] (models/audio.FastConformerEncoder's interface, one stage)."""

    pp, stage, first_stage, last_stage = 1, 0, True, True

    def __init__(self, cfg: dict, recompute: str = "none"):
        super().__init__()
        self.cfg, self.tokens = cfg, HF_AUDIO.tokens(cfg)
        self.extract = HFAudioFeatures(cfg)
        self.encoder = load_transformers_model(cfg)
        if recompute != "none":
            self.encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @property
    def out_dim(self) -> int:
        return self.cfg["hidden"]

    def features(self, waves):
        return self.extract(waves)

    def encode_features(self, feats, lengths):
        """Encoder rows [b, rows, hidden] and the rows each clip's samples cover."""
        keep = torch.tensor([self.tokens.audio_tokens(int(n)) for n in lengths], device=feats.device)
        feats = feats.to(next(self.encoder.parameters()).dtype)  # the run's dtype (bf16 on GPUs)
        if self.cfg["model_type"] == "whisper":
            return self.encoder(feats).last_hidden_state, keep
        rows = [self.encoder(feats[i:i + 1, :int(n)]).last_hidden_state[0] for i, n in enumerate(lengths)]
        out = feats.new_zeros(len(rows), max(len(r) for r in rows), self.out_dim)
        return torch.stack([torch.cat([r, out[0, len(r):]]) for r in rows]) if rows else out, keep

    def encode_received(self, hidden, lengths):
        raise ValueError(f"encoder {self.cfg['name']!r} runs on one pipeline stage (pp1)")

    def keep(self, out, out_len, feat_len=None):
        return [o[:int(n)] for o, n in zip(out, out_len)]

    def forward(self, waves):
        hidden, keep = self.encode_features(*self.features(waves))
        return self.keep(hidden, keep)


# -- planner: FLOPs counted by torch on a meta-device forward ---------------------------------------------------

BF16 = 2  # bytes per activation element the planner prices (hetero/planner/model.py's unit)


def _meta_flops(cfg: dict, samples: int = 0) -> tuple[int, float]:
    """(tower parameters, forward FLOPs of one item: a tile, or a clip of `samples` samples) by torch's
    FlopCounterMode on the tower built and run on the meta device (no weights read, nothing computed)."""
    from torch.utils.flop_counter import FlopCounterMode

    from tessera.models.meta_device import meta_build

    with meta_build():
        tower = HFVisionTower(cfg, "none") if cfg["modality"] == "vision" else load_transformers_model(cfg)
    params = sum(p.numel() for p in tower.parameters())
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        if cfg["modality"] == "vision":
            pixels = torch.empty(1, 3, cfg["tile"], cfg["tile"], device="meta")
            inputs = tower.inputs(pixels)
            if "spatial_shapes" in inputs:  # (read as Python ints to size the position embeddings)
                inputs["spatial_shapes"] = torch.tensor([[cfg["tile"] // cfg["patch"]] * 2])
            tower.model(**inputs)
        elif cfg["model_type"] == "whisper":
            tower(torch.empty(1, tower.config.num_mel_bins, 2 * tower.config.max_source_positions, device="meta"))
        else:
            tower(torch.empty(1, samples, device="meta"))
    return params, float(counter.get_total_flops())


@functools.lru_cache(maxsize=None)
def _measured(name: str) -> tuple[int, float, float]:
    """(tower parameters, FLOPs per row or tile token, FLOPs per row and context row)."""
    cfg = encoder_config_of(name)
    if cfg["modality"] == "vision":
        params, flops = _meta_flops(cfg)
        return params, flops / ((cfg["tile"] // cfg["patch"]) ** 2 + cfg["prefix_tokens"]), 0.0
    tok = HF_AUDIO.tokens(cfg)
    if cfg["window_samples"]:  # one pass over the whole window, whatever the clip's length
        params, flops = _meta_flops(cfg)
        return params, flops / tok.audio_encoder_rows(0), 0.0
    # rows x (linear + attn x rows), solved from clips of one and two seconds (the convs ride on linear)
    (params, f1), (_, f2) = _meta_flops(cfg, cfg["sample_rate"]), _meta_flops(cfg, 2 * cfg["sample_rate"])
    r1, r2 = tok.audio_encoder_rows(cfg["sample_rate"]), tok.audio_encoder_rows(2 * cfg["sample_rate"])
    attn = (f2 / r2 - f1 / r1) / (r2 - r1)
    return params, f1 / r1 - attn * r1, attn


def _planner_fields(cfg: dict, llm_hidden: int) -> dict:
    h, L, ffn = cfg["hidden"], cfg["layers"], cfg["ffn"]
    params, linear, attn = _measured(cfg["name"])
    proj_hidden = cfg["projector_hidden"] or 4 * h  # models.multimodal's default
    proj_params = h + h * proj_hidden + proj_hidden * llm_hidden
    proj_flops = 2.0 * (h * proj_hidden + proj_hidden * llm_hidden)
    rep, act = 8 * h, 10 * h + 4 * ffn  # a pre-norm transformer layer: LN in/out | qkv, out x2, fc1/fc2
    common = dict(params=int(params + proj_params), replicated_params=int(params + proj_params), expert_params=0,
                  edge_params=0, layers=L, hidden=h, out_hidden=llm_hidden, head_flops=0.0, act_bytes=L * act,
                  act_replicated=L * rep, act_unsplit=0.0, act_bytes_recompute=BF16 * h * L,
                  act_peak=(("L", rep, act, 0.0),), logits_bytes=0.0, tp_collectives=0, attn_layers=0,
                  mamba_layers=0, state_bytes=0, moe_layers=0, topk=0, kv_width=2 * h, tp_divides=(1,))
    if cfg["modality"] == "vision":
        patches = (cfg["tile"] // cfg["patch"]) ** 2
        return dict(common, key="vision", kind="vit", linear_flops=linear, attn_flops=attn, embed_flops=0.0,
                    out_flops=proj_flops, prefix_tokens=cfg["prefix_tokens"], pixel_shuffle=1,
                    act_edge=BF16 * (3 * patches * cfg["patch"] ** 2 + 2 * (h + proj_hidden) * patches)
                    / (patches + cfg["prefix_tokens"]),
                    tokens_per_tile=patches + cfg["prefix_tokens"], out_per_tile=patches, temporal_patch=0)
    tok = HF_AUDIO.tokens(cfg)
    seconds = (cfg["window_samples"] or cfg["sample_rate"]) / cfg["sample_rate"]
    return dict(common, key="audio", kind="conformer", linear_flops=linear + proj_flops, attn_flops=attn,
                act_edge=4 * (h + proj_hidden), act_ctx=L * 4.0 * cfg["heads"],
                frames_per_second=tok.audio_encoder_rows(cfg["window_samples"] or cfg["sample_rate"]) / seconds,
                pre_flops_per_second=0.0)


# -- the families -----------------------------------------------------------------------------------------------

class _HFFamily(EncoderFamily):
    """What both modalities share: no TP/CP/PP, a planner from measured FLOPs, the tower's own tensor names."""

    def planner_fields(self, cfg, llm_hidden):
        return _planner_fields(cfg, llm_hidden)

    def import_tensors(self, cfg, hf, module_keys, tp_rank=0, tp=1):
        root = CHECKPOINT_ROOT[self.modality]
        stored = [k[len(root):] for k in hf if k.startswith(root)]
        keys = stored if module_keys is None else list(module_keys)
        missing, left = sorted(set(keys) - set(stored)), sorted(set(stored) - set(keys))
        if missing or left:
            raise KeyError(f"encoder {cfg['name']!r}: the checkpoint lacks {[root + k for k in missing[:8]]} and "
                           f"has {[root + k for k in left[:8]]} the tower does not")
        return {k: hf[root + k] for k in keys}

    def export_tensors(self, cfg, shards):
        root = CHECKPOINT_ROOT[self.modality]
        return {root + k: v.detach().clone() for k, v in shards[0].items()}

    def release_issue(self, cfg):
        return (f"{self.modality} encoder {cfg['name']!r} is a transformers {cfg['model_type']} model, not the "
                f"released Omni model's {self.modality} encoder")


@register_family
class HFVisionFamily(_HFFamily):
    name, modality, Config = "hf_vision", "vision", HFVisionConfig

    def build(self, cfg, pg_collection, *, recompute="none", core_attention=None):
        return HFVisionEncoder(cfg, recompute)

    def preprocessor(self, cfg):
        return HFPixels(cfg)

    def tokens(self, cfg):
        from tessera.models.media_tokens import EncoderTokens

        return EncoderTokens(tile=cfg["tile"], patch=cfg["patch"], pixel_shuffle=1)

    def checkpoint_module(self, encoder):
        return encoder.vit


@register_family
class HFAudioFamily(_HFFamily):
    name, modality, Config = "hf_audio", "audio", HFAudioConfig

    def build(self, cfg, pg_collection, *, recompute="none", core_attention=None):
        return HFAudioEncoder(cfg, recompute)

    def preprocessor(self, cfg):
        return HFAudioFeatures(cfg)

    def tokens(self, cfg):
        from tessera.models.media_tokens import EncoderTokens

        return EncoderTokens(audio_rate=cfg["sample_rate"], audio_convs=tuple(map(tuple, cfg["convs"])),
                             audio_window=cfg["window_samples"])

    def checkpoint_module(self, encoder):
        return encoder.encoder


HF_AUDIO = HFAudioFamily()
FAMILY_OF = {"vision": HFVisionFamily.name, "audio": HFAudioFamily.name}
