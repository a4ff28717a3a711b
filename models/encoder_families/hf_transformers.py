"""Any transformers vision or audio encoder by path: `model.vision=hf:DIR`, `model.audio=hf:DIR`.

DIR is a local transformers directory (save_pretrained's config.json + weights, and the model's image processor or
feature extractor). Its config.json tells the two `hf:` forms apart: a release Tessera loads (models/released.py)
names one of its encoders as `hf:DIR#vision` / `hf:DIR#audio`; any other model is an encoder of its own, `hf:DIR`
(a `#modality` suffix, if given, must be its modality), taken by contract (models/encoder_families/hf_contract.py:
AutoModel builds it, its own processor's output through its forward gives last_hidden_state per item, the
encoder found by the model's own accessors) and measured on the meta device where no fact below is listed.

Facts per model type, what a forward cannot show (the table; every other type: AutoModel):
    vision  siglip, siglip2 (NaFlex), clip and their *_vision_model: the tower class (SigLIP's attention-pooling
            head is not built), CLIP's class token, and their stages for pipeline parallelism
    audio   whisper (the encoder of the encoder-decoder model; mel frames of a fixed window through a stride-2
            conv), wav2vec2, hubert
Measured for any type: the hidden size, class/register tokens before the patches (a forward's tokens less the
tile's patches), a clip's rows (the config's conv_kernel / conv_stride stack, checked at several lengths), and for
the planner the parameters, FLOPs and activation bytes.

What the data side feeds comes from the processor (AutoImageProcessor / AutoFeatureExtractor, the PIL-based ones:
torchvision is not installed): images are cut into square tiles of the processor's own output size (SigLIP2: the
largest square grid within max_num_patches), on which its resize is the identity, then rescaled and normalised
with its factors; audio goes through the feature extractor itself (the modules: models/hf_towers.py). Tokens per item:
a tile's patches (pixel shuffle 1); a clip's encoder rows over its valid samples, counted by the conv stack that
makes them (models/media_tokens.EncoderTokens.audio_convs). The projector takes the tower's hidden size. Dropout,
drop path, LayerDrop and SpecAugment are switched off at load, so training is deterministic and a layout equals
one device. Layouts: data parallel; vision towers also pipeline by layers where the list of layers is found and
embeddings -> layers -> final norm is the model's forward (the table's, and any other whose stages are checked to
compose to it, hf_contract.pipeline_stages); tp1, cp1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from tessera.models.encoder_families import hf_contract
from tessera.models.encoder_families.base import FAMILIES, EncoderFamily, register_family
from tessera.models.encoder_families.hf_contract import HFEncoderError, refuse
from tessera.models.release_layouts import layout_of
from tessera.models.released import PREFIX  # `hf:`, both forms' prefix
# model_type -> (transformers class loaded from DIR, class tokens before the patches); a dual model's config.json
# has its tower's under vision_config, which these classes' from_pretrained read
VISION_TYPES = {"siglip": ("SiglipVisionModel", 0), "siglip_vision_model": ("SiglipVisionModel", 0),
                "siglip2": ("Siglip2VisionModel", 0), "siglip2_vision_model": ("Siglip2VisionModel", 0),
                "clip": ("CLIPVisionModel", 1), "clip_vision_model": ("CLIPVisionModel", 1)}
AUDIO_TYPES = {"whisper": "WhisperModel", "wav2vec2": "Wav2Vec2Model", "hubert": "HubertModel"}
CHECKPOINT_ROOT = {"vision": "vision_tower.", "audio": "audio_tower."}  # this family's tensors in Tessera's files

__all__ = ["HFEncoderError", "encoder_config_of", "is_transformers_encoder"]


@dataclasses.dataclass
class HFVisionConfig:
    directory: str        # the transformers directory (config.json, weights, preprocessor_config.json)
    model_type: str       # config.json's model_type
    tower_class: str      # the transformers class loaded from the directory (AutoModel outside VISION_TYPES)
    submodule: str        # the tower inside what tower_class builds ("" itself, "vision_model": a dual model's)
    pipeline: bool        # pipeline parallel by layers: the table's types, and others whose stages compose to their
                          # forward (hf_contract.pipeline_stages)
    layer_list: str       # the tower's list of layers ("encoder.layers"; DINOv2: "encoder.layer")
    final_norm: str       # the norm after the layers in last_hidden_state ("" none: CLIP's is the pooled output's)
    hidden: int
    layers: int
    heads: int
    patch: int
    tile: int             # square tile side the processor keeps as it is
    prefix_tokens: int    # class / register tokens dropped from the output (CLIP: 1; others measured)
    pixel_shuffle: int    # 1: one token per patch
    rescale: float        # the processor's rescale_factor (1/255)
    mean: tuple
    std: tuple
    projector_hidden: int | None  # None = 4x the tower's hidden size (models/multimodal's default)


@dataclasses.dataclass
class HFAudioConfig:
    directory: str
    model_type: str
    tower_class: str
    submodule: str        # "encoder": an encoder-decoder's encoder (get_encoder())
    hidden: int
    layers: int
    heads: int
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
    DIR/config.json (read once per process: every encoder lookup asks). Whether a model is an encoder Tessera
    takes is encoder_config_of's check (the contract, hf_contract.py)."""
    if not name.startswith(PREFIX):
        return False
    directory, modality = _split(name)
    config = _config_json(directory)
    if layout_of(config) is not None:
        if not modality:
            raise HFEncoderError(f"{name!r}: {directory} is a release; name one of its encoders: "
                                 f"hf:{directory}#vision or hf:{directory}#audio")
        return False
    return True


@functools.lru_cache(maxsize=None)
def _derived(name: str) -> tuple[str, HFVisionConfig | HFAudioConfig]:
    directory, modality = _split(name)
    model_type = _config_json(directory).get("model_type")
    config = hf_contract.auto_config(directory, model_type)
    if model_type in VISION_TYPES or model_type in AUDIO_TYPES:  # the table's classes are the towers (Whisper's:
        where = "encoder" if model_type == "whisper" else ""      # the encoder of the encoder-decoder)
    else:  # the contract decides (a causal LM is refused before its processor is read)
        where = hf_contract.submodule(directory, model_type, config)
    own, proc = hf_contract.processor(directory, model_type)
    if modality and modality != own:
        raise HFEncoderError(f"{name!r}: {directory} holds a {own} encoder ({model_type}), not a {modality} one")
    build = _vision if own == "vision" else _audio
    return own, build(directory.resolve(), model_type, config, proc, where)


def encoder_config_of(name: str):
    """The config (models/encoders.py's form: its family's Config with family, modality, name) of `hf:DIR`."""
    modality, raw = _derived(name)
    return FAMILIES[FAMILY_OF[modality]].config(name, **{f.name: getattr(raw, f.name)
                                                         for f in dataclasses.fields(raw)})


def _tile(directory: Path, model_type: str, proc, patch: int) -> int:
    if getattr(proc, "max_num_patches", None):  # SigLIP2 NaFlex: the largest square patch grid within its budget
        return math.isqrt(proc.max_num_patches) * patch
    size = proc.crop_size if getattr(proc, "do_center_crop", False) else proc.size
    sides = {size.get(k) for k in ("height", "width", "shortest_edge") if size.get(k)}
    if len(sides) != 1:
        raise refuse(directory, model_type, f"the image processor's output size {dict(size)} is not square; "
                                            f"Tessera tiles images into squares")
    return sides.pop()


def _vision(directory: Path, model_type: str, config, proc, where: str) -> HFVisionConfig:
    v = getattr(config, "vision_config", None) or config
    patch = getattr(v, "patch_size", None)
    if not isinstance(patch, int):
        raise refuse(directory, model_type, f"its (vision) config has no square patch_size ({patch!r})")
    if proc.model_input_names[0] != "pixel_values":
        raise refuse(directory, model_type, f"its image processor gives {proc.model_input_names[0]}, not "
                                            f"pixel_values")
    tile = _tile(directory, model_type, proc, patch)
    if tile % patch:
        raise refuse(directory, model_type, f"the processor's {tile}-px output is not a multiple of patch {patch}")
    known = VISION_TYPES.get(model_type)
    cfg = HFVisionConfig(str(directory), model_type, known[0] if known else "AutoModel", where, known is not None,
                         "encoder.layers", "" if model_type.startswith("clip") else "post_layernorm",
                         getattr(v, "hidden_size", 0), getattr(v, "num_hidden_layers", 0),
                         getattr(v, "num_attention_heads", 1), patch, tile, known[1] if known else 0, 1,
                         float(proc.rescale_factor if proc.do_rescale else 1.0),
                         tuple(proc.image_mean) if proc.do_normalize else (0.0,) * 3,
                         tuple(proc.image_std) if proc.do_normalize else (1.0,) * 3, None)
    if known is None:  # hidden size, layers and leading class/register tokens from a meta forward of one tile
        (_, tokens, hidden), tower = hf_contract.meta_forward(cfg)
        patches = (tile // patch) ** 2
        if tokens < patches:
            raise refuse(directory, model_type, f"a {tile}-px tile gives {tokens} tokens, fewer than its "
                                                f"{patches} patches of {patch} px")
        cfg = dataclasses.replace(cfg, hidden=hidden, layers=hf_contract.layer_count(tower),
                                  prefix_tokens=tokens - patches)
        stages = hf_contract.pipeline_stages(cfg, tower)
        cfg = dataclasses.replace(cfg, pipeline=stages is not None, layer_list=(stages or ("", ""))[0],
                                  final_norm=(stages or ("", ""))[1])
    return cfg


def _audio(directory: Path, model_type: str, config, fe, where: str) -> HFAudioConfig:
    if model_type == "whisper":
        # hop framing of the window (the feature extractor's mask), then conv1 (k3 s1 p1) and conv2 (k3 s2 p1)
        return HFAudioConfig(str(directory), model_type, AUDIO_TYPES[model_type], where, config.d_model,
                             config.encoder_layers, config.encoder_attention_heads, fe.sampling_rate, fe.n_samples,
                             ((1, fe.hop_length, 0), (3, 1, 1), (3, 2, 1)), None)
    if fe.model_input_names[0] != "input_values":
        raise refuse(directory, model_type, f"its feature extractor gives {fe.model_input_names[0]}; hf:DIR runs "
                                            f"encoders of the waveform (input_values) and Whisper")
    cfg = HFAudioConfig(str(directory), model_type, AUDIO_TYPES.get(model_type, "AutoModel"), where,
                        getattr(config, "hidden_size", 0), getattr(config, "num_hidden_layers", 0),
                        getattr(config, "num_attention_heads", 1), fe.sampling_rate, 0, (), None)
    if model_type in AUDIO_TYPES:
        return dataclasses.replace(cfg, convs=tuple((k, s, 0) for k, s in zip(config.conv_kernel,
                                                                              config.conv_stride)))
    convs = hf_contract.audio_convs(directory, model_type, config, cfg)
    (_, _, hidden), tower = hf_contract.meta_forward(cfg, fe.sampling_rate)
    return dataclasses.replace(cfg, hidden=hidden, layers=hf_contract.layer_count(tower), convs=convs)


# -- the families -----------------------------------------------------------------------------------------------

class _HFFamily(EncoderFamily):
    """What both modalities share: no TP/CP/PP, a planner from measured FLOPs, the tower's own tensor names."""

    def planner_fields(self, cfg, llm_hidden):
        return hf_contract.planner_fields(cfg, llm_hidden, self.tokens(cfg))

    def import_tensors(self, cfg, hf, module_keys, tp_rank=0, tp=1):
        root = CHECKPOINT_ROOT[self.modality]
        stored = [k[len(root):] for k in hf if k.startswith(root)]
        # (a pipeline stage asks for its own tensors; the whole set is checked against the model's beforehand,
        # hetero/build/model_build.check_checkpoint_tensors)
        keys = stored if module_keys is None else list(module_keys)
        missing = sorted(set(keys) - set(stored))
        if missing:
            raise KeyError(f"encoder {cfg.name!r}: the checkpoint lacks {[root + k for k in missing[:8]]}")
        return {k: hf[root + k] for k in keys}

    def export_tensors(self, cfg, shards):
        root = CHECKPOINT_ROOT[self.modality]
        return {root + k: v.detach().clone() for k, v in shards[0].items()}

    def release_issue(self, cfg):
        return (f"{self.modality} encoder {cfg.name!r} is a transformers {cfg.model_type} model, not the "
                f"released Omni model's {self.modality} encoder")

    def stage(self, cfg, pg_collection, core_attention) -> tuple[int, int]:
        """(pp, stage) of this rank; a split the tower cannot run (token CP; audio PP) is refused, naming the fix."""
        sizes = {k: getattr(pg_collection, k).size() for k in ("cp", "pp") if getattr(pg_collection, k, None)}
        pipeline = self.pipeline_parallel and getattr(cfg, "pipeline", True)  # (stages known: the table's types)
        refused = [f"{k}{n}" for k, n in sizes.items() if n > 1 and (k == "cp" or not pipeline)]
        if refused or core_attention is not None:
            allowed = "dp and pp" if pipeline else "dp"
            raise ValueError(f"encoder {cfg.name!r} (transformers {cfg.model_type}) runs {allowed} only, not "
                             f"{', '.join(refused) or 'context parallel'}: give model.{self.modality} a layout of "
                             f"{allowed} (e.g. {self.modality}=dp2@0-1)")
        pp_group = getattr(pg_collection, "pp", None)
        return (pp_group.size(), pp_group.rank()) if pp_group is not None else (1, 0)


@register_family
class HFVisionFamily(_HFFamily):
    name, modality, Config = "hf_vision", "vision", HFVisionConfig
    pipeline_parallel = True  # where cfg.pipeline: the layers are a plain list (HFVisionTower)

    def build(self, cfg, pg_collection, *, recompute="none", core_attention=None):
        from tessera.models.hf_towers import HFVisionEncoder

        return HFVisionEncoder(cfg, recompute, *self.stage(cfg, pg_collection, core_attention))

    def preprocessor(self, cfg):
        from tessera.models.hf_towers import HFPixels

        return HFPixels(cfg)

    def tokens(self, cfg):
        from tessera.models.media_tokens import EncoderTokens

        return EncoderTokens(tile=cfg.tile, patch=cfg.patch, pixel_shuffle=1)

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

        return EncoderTokens(audio_rate=cfg.sample_rate, audio_convs=tuple(map(tuple, cfg.convs)),
                             audio_window=cfg.window_samples)

    def checkpoint_module(self, encoder):
        return encoder.encoder


FAMILY_OF = {"vision": HFVisionFamily.name, "audio": HFAudioFamily.name}
