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
with its factors; audio goes through the feature extractor itself (the modules: models/hf_towers.py). Tokens per item:
a tile's patches (pixel shuffle 1); a clip's encoder rows over its valid samples, counted by the conv stack that
makes them (models/media_tokens.EncoderTokens.audio_convs: Whisper's hop framing and stride-2 conv, truncated to
its window; wav2vec2's feature-encoder convs). The projector takes the tower's hidden size. FLOPs are torch's
FlopCounterMode on a meta-device forward of the tower (planner_fields). Dropout, LayerDrop and SpecAugment are
switched off at load, so training is deterministic and a layout equals one device. Layouts: data parallel, and
the vision towers pipeline by layers (their encoder.layers is a plain list); tp1, cp1, audio pp1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from tessera.models.encoder_families.base import EncoderFamily, register_family
from tessera.models.release_layouts import layout_of
from tessera.models.released import PREFIX  # `hf:`, both forms' prefix
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
    tower_class: str      # the transformers class loaded from the directory
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
    tower_class: str
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


@functools.lru_cache(maxsize=None)
def is_transformers_encoder(name: str) -> bool:
    """Whether `name` (hf:DIR or hf:DIR#modality) names an encoder of this file, not a release's: told apart by
    DIR/config.json's model_type (read once per process: every encoder lookup asks). A DIR that is neither raises
    HFEncoderError naming what each form takes."""
    if not name.startswith(PREFIX):
        return False
    directory, modality = _split(name)
    config = _config_json(directory)
    model_type = config.get("model_type")
    if model_type in VISION_TYPES or model_type in AUDIO_TYPES:
        return True
    if layout_of(config) is not None:
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
    return HFVisionConfig(str(directory.resolve()), model_type, VISION_TYPES[model_type][0], v.hidden_size,
                          v.num_hidden_layers, v.num_attention_heads, v.intermediate_size, patch, tile,
                          VISION_TYPES[model_type][1], 1,
                          float(proc.rescale_factor if proc.do_rescale else 1.0),
                          tuple(proc.image_mean) if proc.do_normalize else (0.0,) * 3,
                          tuple(proc.image_std) if proc.do_normalize else (1.0,) * 3, None)


def _audio(directory: Path, model_type: str) -> HFAudioConfig:
    from transformers import AutoConfig, AutoFeatureExtractor

    config = AutoConfig.from_pretrained(directory)
    fe = AutoFeatureExtractor.from_pretrained(directory)
    if model_type == "whisper":
        # hop framing of the window (the feature extractor's mask), then conv1 (k3 s1 p1) and conv2 (k3 s2 p1)
        return HFAudioConfig(str(directory.resolve()), model_type, AUDIO_TYPES[model_type], config.d_model,
                             config.encoder_layers, config.encoder_attention_heads, config.encoder_ffn_dim,
                             fe.sampling_rate, fe.n_samples,
                             ((1, fe.hop_length, 0), (3, 1, 1), (3, 2, 1)), None)
    convs = tuple((k, s, 0) for k, s in zip(config.conv_kernel, config.conv_stride))
    return HFAudioConfig(str(directory.resolve()), model_type, AUDIO_TYPES[model_type], config.hidden_size,
                         config.num_hidden_layers, config.num_attention_heads, config.intermediate_size,
                         fe.sampling_rate, 0, convs, None)


# -- planner: FLOPs counted by torch on a meta-device forward ---------------------------------------------------

BF16 = 2  # bytes per activation element the planner prices (hetero/planner/model.py's unit)


def _meta_flops(cfg: dict, samples: int = 0) -> tuple[int, float]:
    """(tower parameters, forward FLOPs of one item: a tile, or a clip of `samples` samples) by torch's
    FlopCounterMode on the tower built and run on the meta device (no weights read, nothing computed)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from tessera.models.hf_towers import HFVisionTower, load_transformers_model
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
        # (a pipeline stage asks for its own tensors; the whole set is checked against the model's beforehand,
        # hetero/training/model_build.check_checkpoint_tensors)
        keys = stored if module_keys is None else list(module_keys)
        missing = sorted(set(keys) - set(stored))
        if missing:
            raise KeyError(f"encoder {cfg['name']!r}: the checkpoint lacks {[root + k for k in missing[:8]]}")
        return {k: hf[root + k] for k in keys}

    def export_tensors(self, cfg, shards):
        root = CHECKPOINT_ROOT[self.modality]
        return {root + k: v.detach().clone() for k, v in shards[0].items()}

    def release_issue(self, cfg):
        return (f"{self.modality} encoder {cfg['name']!r} is a transformers {cfg['model_type']} model, not the "
                f"released Omni model's {self.modality} encoder")

    def stage(self, cfg, pg_collection, core_attention) -> tuple[int, int]:
        """(pp, stage) of this rank; a split the tower cannot run (token CP; audio PP) is refused, naming the fix."""
        sizes = {k: getattr(pg_collection, k).size() for k in ("cp", "pp") if getattr(pg_collection, k, None)}
        refused = [f"{k}{n}" for k, n in sizes.items() if n > 1 and (k == "cp" or not self.pipeline_parallel)]
        if refused or core_attention is not None:
            allowed = "dp and pp" if self.pipeline_parallel else "dp"
            raise ValueError(f"encoder {cfg['name']!r} (transformers {cfg['model_type']}) runs {allowed} only, not "
                             f"{', '.join(refused) or 'context parallel'}: give model.{self.modality} a layout of "
                             f"{allowed} (e.g. {self.modality}=dp2@0-1)")
        pp_group = getattr(pg_collection, "pp", None)
        return (pp_group.size(), pp_group.rank()) if pp_group is not None else (1, 0)


@register_family
class HFVisionFamily(_HFFamily):
    name, modality, Config = "hf_vision", "vision", HFVisionConfig
    pipeline_parallel = True  # its layers are a plain list (HFVisionTower)

    def build(self, cfg, pg_collection, *, recompute="none", core_attention=None):
        from tessera.models.hf_towers import HFVisionEncoder

        return HFVisionEncoder(cfg, recompute, *self.stage(cfg, pg_collection, core_attention))

    def preprocessor(self, cfg):
        from tessera.models.hf_towers import HFPixels

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
        from tessera.models.hf_towers import HFAudioEncoder

        self.stage(cfg, pg_collection, core_attention)
        return HFAudioEncoder(cfg, recompute)

    def preprocessor(self, cfg):
        from tessera.models.hf_towers import HFAudioFeatures

        return HFAudioFeatures(cfg)

    def tokens(self, cfg):
        from tessera.models.media_tokens import EncoderTokens

        return EncoderTokens(audio_rate=cfg["sample_rate"], audio_convs=tuple(map(tuple, cfg["convs"])),
                             audio_window=cfg["window_samples"])

    def checkpoint_module(self, encoder):
        return encoder.encoder


HF_AUDIO = HFAudioFamily()
FAMILY_OF = {"vision": HFVisionFamily.name, "audio": HFAudioFamily.name}
