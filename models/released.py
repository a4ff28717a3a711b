"""A released checkpoint's config.json -> the Tessera module configs that hold exactly its tensors.

    fields = llm_fields_of(config)                   # NemotronH config.json fields of the LLM
    cfg = encoder_config("hf:/ckpt/dir#vision")      # models/encoders.py resolves such names here

Fine-tuning `model.checkpoint=DIR` builds the model DIR describes - any size, any hybrid pattern, with or
without audio - instead of the recipe's registry names (those are for from-scratch runs). read_config gives
every layout a release comes in (models/release_layouts.py: the hub's remote-code NemotronH_Nano_Omni_Reasoning_V3
and NemotronH_Nano_VL_V2, transformers' own) as transformers' native one, so nothing past it sees which:
  nemotron_h        NemotronHForCausalLM: the LLM alone
  nemotron_h_omni   transformers' NemotronH_Omni_Reasoning_V3 (Nemotron 3 Nano Omni): text_config (NemotronH),
                    vision_config (RadioConfig), audio_config (ParakeetEncoderConfig, optional), the projector
                    widths, the pixel-shuffle ratio and the video temporal patch
transformers' own config classes parse the result. An encoder taken from a checkpoint is named
`hf:<absolute dir>#<modality>`: a plain string that every process (launcher, ranks, loader workers, the
planner) resolves to the same config, so the data side sizes placeholders from the very encoder it feeds.

What the config cannot say comes from the registry family it belongs to: the tile size of the fixed-tile
data path (Nano V2 VL's force_image_size; else 512, that release's; native-resolution Omni inputs are issue 15's
input parity) and the mel front end of the audio encoder (NeMo's, at the checkpoint's mel bins). RADIO's layer
scales and buffers (summary_idxs, input conditioner) are held exactly when the checkpoint stores them.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

from tessera.models.release_layouts import (HUB_OMNI, HUB_VL, NEMOTRON_H, OMNI, ReleaseLayoutError, layout_of,
                                            native_layout)

PREFIX = "hf:"  # an encoder named `hf:<dir>#<modality>` is the one <dir>/config.json describes
RADIO_CONDITIONER = "vision_model.radio_model.input_conditioner.norm_mean"
RADIO_SUMMARY = "vision_model.radio_model.summary_idxs"
RADIO_LAYER_SCALE = "vision_model.radio_model.model.blocks.0.layer_scale1.lambda1"
_LLM_ONLY_KEYS = ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "auto_map")


# Tensors of a release that no module Tessera builds computes with: the multi-token-prediction layers (mtp.*;
# HybridLM builds none, so they are not trained) and the Parakeet featurizer's mel filterbank and window (the
# data side computes the mel front end). A run from the release carries them unchanged into its export
# (hetero/export/hf.py), so the release's own loaders take it; the tensor check leaves them out.
CARRIED = ("mtp.", "sound_encoder.encoder.feature_extractor.featurizer.")


def is_carried(key: str) -> bool:
    return key.startswith(CARRIED)


def carried_tensors(directory: str | Path) -> dict:
    """The checkpoint's CARRIED tensors, as stored (dtype included)."""
    from safetensors import safe_open

    from tessera.models.nemotron_h_hf import safetensors_files

    out = {}
    for f in safetensors_files(directory):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys() if is_carried(k)})
    return out


# the JSON files beside config.json whose `auto_map` names remote code too (the processor's and tokenizer's)
AUTO_MAP_FILES = ("config.json", "processor_config.json", "preprocessor_config.json", "tokenizer_config.json",
                  "video_preprocessor_config.json")


def remote_code_files(directory: str | Path) -> list[str]:
    """The remote-code .py files (names in DIR) that the `auto_map` entries of DIR's configs load, with the files
    they import relatively (transformers' own resolution, dynamic_module_utils), those DIR holds. An entry of
    another repository (`org/repo--module.Class`) is not a file of DIR."""
    from transformers import PretrainedConfig
    from transformers.dynamic_module_utils import get_relative_import_files

    d, names = Path(directory).expanduser(), set()
    for config in AUTO_MAP_FILES:
        if not (d / config).is_file():
            continue
        for ref in (PretrainedConfig._dict_from_json_file(d / config).get("auto_map") or {}).values():
            for target in ref if isinstance(ref, (list, tuple)) else [ref]:
                if isinstance(target, str) and "--" not in target:
                    names.add(target.rpartition(".")[0] + ".py")
    files = {n for n in names if (d / n).is_file()}
    for n in list(files):
        files.update(Path(f).name for f in get_relative_import_files(str(d / n)) if Path(f).is_file())
    return sorted(files)


class CheckpointConfigError(ValueError):
    """config.json is missing, unreadable or of an architecture Tessera does not load."""


def read_config(directory: str | Path) -> dict:
    """DIR/config.json in transformers' native layout (module docstring), whatever layout the file is in."""
    path = Path(directory).expanduser() / "config.json"
    from transformers import PretrainedConfig

    try:  # transformers' reader: it also decodes the {"__float__": "Infinity"} its writer emits
        config = PretrainedConfig._dict_from_json_file(path)
    except FileNotFoundError:
        raise CheckpointConfigError(f"{path} not found: an HF checkpoint directory holds config.json next to "
                                    f"its *.safetensors (as save_pretrained writes them)") from None
    except (OSError, ValueError) as e:
        raise CheckpointConfigError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    if layout_of(config) is None:
        raise CheckpointConfigError(
            f"{path}: model_type {config.get('model_type')!r} (architectures {config.get('architectures')}) is not "
            f"a checkpoint Tessera loads; it loads {HUB_OMNI!r} (Nemotron 3 Nano Omni as downloaded), {HUB_VL!r} "
            f"(Nemotron Nano V2 VL as downloaded), {OMNI!r} (transformers' NemotronH_Omni_Reasoning_V3) and "
            f"{NEMOTRON_H!r} (NemotronHForCausalLM, the LLM alone)")
    try:
        return native_layout(config, path.parent)
    except ReleaseLayoutError as e:
        raise CheckpointConfigError(str(e)) from None


def file_layout(directory: str | Path) -> str | None:
    """Which layout DIR/config.json is written in (models/release_layouts.LAYOUTS), as the file has it."""
    from transformers import PretrainedConfig

    return layout_of(PretrainedConfig._dict_from_json_file(Path(directory).expanduser() / "config.json"))


def transformers_config(directory: str | Path):
    """transformers' NemotronH_Omni_Reasoning_V3_Config of the tensors DIR holds, whatever its layout (also for
    Nano V2 VL, whose own file no transformers class reads)."""
    return _omni(read_config(directory))


def _omni(config: dict):
    from transformers import NemotronH_Omni_Reasoning_V3_Config

    return NemotronH_Omni_Reasoning_V3_Config(**{k: v for k, v in config.items() if k not in _TESSERA_KEYS})


# release_layouts' fields that transformers' class has not
_TESSERA_KEYS = ("model_type", "tile", "video_embedder")


def llm_fields_of(config: dict) -> dict:
    """The NemotronH config fields of the checkpoint's language model, as models/configs.py spells them
    (`hybrid_override_pattern`; transformers stores `layers_block_type` lists and keeps the pattern as a
    property): NemotronHConfig's own fields, without the generic PretrainedConfig bookkeeping."""
    from transformers import NemotronHConfig

    if config.get("model_type") == OMNI:
        c = _omni(config).text_config
    else:
        c = NemotronHConfig(**{k: v for k, v in config.items() if k not in _LLM_ONLY_KEYS})
    own = set(NemotronHConfig.__annotations__) - {"layers_block_type", "mtp_layers_block_type", "model_type"}
    fields = {k: v for k, v in c.to_dict().items() if k in own}
    fields["hybrid_override_pattern"] = c.hybrid_override_pattern
    return fields


def modalities_of(config: dict) -> list[str]:
    """Encoder module keys the checkpoint holds ("vision", "audio"), in that order."""
    if config.get("model_type") != OMNI:
        return []
    return ["vision"] + (["audio"] if _omni(config).audio_config is not None else [])


def media_token_ids(config: dict) -> dict[str, int]:
    """{image|video|audio: id} of the media tags the checkpoint's config.json sets (its legacy names such as
    img_context_token_id mean there what transformers reads them as); none for an LLM-only checkpoint."""
    if config.get("model_type") != OMNI:
        return {}
    omni = _omni(config)
    ids = {k: getattr(omni, f"{k}_token_id", None) for k in ("image", "video", "audio")}
    return {k: int(v) for k, v in ids.items() if v is not None}


def encoder_name(directory: str | Path, modality: str) -> str:
    return f"{PREFIX}{Path(directory).expanduser().resolve()}#{modality}"


def encoder_config_of(name: str) -> dict:
    """The fields of the encoder config that `hf:<dir>#<modality>` names (a fresh copy): its family's Config
    fields, `family`, `modality` and `name`, which models/encoders.encoder_config checks and types."""
    return copy.deepcopy(_derived(name))


@functools.lru_cache(maxsize=None)
def _derived(name: str) -> dict:
    """Parsed once per process: every module spec, token count and planner lookup asks for the encoder by
    name, and deriving it reads config.json and the safetensors headers of every shard."""
    directory, _, modality = name[len(PREFIX):].rpartition("#")
    config = read_config(directory)
    if modality not in modalities_of(config):
        raise CheckpointConfigError(f"encoder {name!r}: {directory}/config.json has no {modality} encoder "
                                    f"(it has {modalities_of(config) or 'none'})")
    omni = _omni(config)
    fields = _vision(omni, directory, config) if modality == "vision" else _audio(omni)
    return {**fields, "name": name}


def _stores(directory: str, key: str) -> bool:
    """Whether the checkpoint's safetensors hold `key` (headers only)."""
    from safetensors import safe_open

    from tessera.models.nemotron_h_hf import safetensors_files

    for f in safetensors_files(directory):
        with safe_open(str(f), "pt") as st:
            if key in st.keys():
                return True
    return False


# Every field of a models/encoders.py entry is set below (encoders.encoder_config checks the key sets agree).
def _vision(omni, directory: str, config: dict) -> dict:
    v = omni.vision_config
    if v.use_swiglu_ffn or not v.qkv_bias or v.hidden_act != "gelu":
        raise CheckpointConfigError(f"vision_config: Tessera's RADIO has a GELU MLP and QKV bias "
                                    f"(got use_swiglu_ffn={v.use_swiglu_ffn}, qkv_bias={v.qkv_bias}, "
                                    f"hidden_act={v.hidden_act!r})")
    shuffle = round(1 / omni.downsample_ratio)
    if abs(shuffle * omni.downsample_ratio - 1) > 1e-6:
        raise CheckpointConfigError(f"downsample_ratio {omni.downsample_ratio} is not 1/n")
    return dict(
        family="radio", modality="vision", patch=v.patch_size, hidden=v.hidden_size, layers=v.num_hidden_layers,
        heads=v.num_attention_heads, ffn=int(v.hidden_size * v.mlp_ratio), eps=v.layer_norm_eps, act="gelu",
        prefix_tokens=v.num_cls_tokens + v.num_registers, pos_grid=v.max_img_size // v.patch_size,
        pos_interp="bilinear", pos_resize="cpe", pixel_shuffle=shuffle,
        temporal_patch=(v.video_temporal_patch_size or 0) if config.get("video_embedder", True) else 0,
        mean=tuple(v.norm_mean), std=tuple(v.norm_std),
        projector_hidden=omni.projector_hidden_size,
        # the fixed-tile data path: the release's (Nano V2 VL: force_image_size), else 512-px tiles as the
        # released VL models, or the position table's extent when that is smaller (tiny test checkpoints)
        tile=config.get("tile") or min(512, v.max_img_size),
        # the Omni model's vision_final_layernorm exists only when its LLM has MTP layers
        final_norm=bool(omni.text_config.num_nextn_predict_layers),
        # as the checkpoint stores them: transformers' RadioLayer has layer scales (identity at 1.0), Nano V2 VL's
        # RADIO none (Megatron-Bridge's NemotronVLBridge maps no such tensor); RadioModel's buffers likewise
        layer_scale=v.layerscale_value if _stores(directory, RADIO_LAYER_SCALE) else None,
        summary_idxs=tuple(v.summary_idxs) if _stores(directory, RADIO_SUMMARY) else None,
        input_conditioner=_stores(directory, RADIO_CONDITIONER))


def _audio(omni) -> dict:
    a = omni.audio_config
    if a.hidden_act != "silu" or a.subsampling_conv_kernel_size != 3 or a.subsampling_conv_stride != 2:
        raise CheckpointConfigError(f"audio_config: Tessera's Parakeet encoder has SiLU and 3x3 stride-2 "
                                    f"subsampling convs (got {a.hidden_act}, {a.subsampling_conv_kernel_size}, "
                                    f"{a.subsampling_conv_stride})")
    if getattr(a, "projection_bias", False):
        raise CheckpointConfigError("audio_config.projection_bias=True: the released sound projector has no "
                                    "biases, and Tessera's SoundProjector neither")
    if a.intermediate_size % a.hidden_size:
        raise CheckpointConfigError(f"audio_config.intermediate_size {a.intermediate_size} is not a multiple of "
                                    f"hidden_size {a.hidden_size}")
    return dict(
        family="parakeet_hf", modality="audio", n_mels=a.num_mel_bins, hidden=a.hidden_size,
        layers=a.num_hidden_layers, heads=a.num_attention_heads, ff_expansion=a.intermediate_size // a.hidden_size,
        conv_kernel=a.conv_kernel_size, subsampling=a.subsampling_factor,
        subsampling_channels=a.subsampling_conv_channels, attention_bias=a.attention_bias,
        convolution_bias=a.convolution_bias, scale_input=a.scale_input,
        projector_hidden=getattr(a, "projection_hidden_size", None) or 4 * a.hidden_size,
        # the mel front end (NeMo's, as for every audio encoder here): 16 kHz, 25 ms windows, 10 ms hop
        sample_rate=16000, window_size=0.025, window_stride=0.01, n_fft=512)
