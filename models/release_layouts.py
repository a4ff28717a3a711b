"""A release's config.json, whatever its layout, in transformers' native layout: the one place that knows them.

    native = native_layout(config, directory)   # models/released.read_config calls it; nothing else sees layouts

Layouts (the remote-code ones as the hub files are read by Megatron-Bridge's NemotronOmniBridge /
NemotronVLBridge, vLLM's nano_nemotron_vl.py + transformers_utils/configs/radio.py, and transformers'
configuration_nemotron_h_omni.py):
  nemotron_h, nemotron_h_omni      transformers' own: returned as they are
  NemotronH_Nano_Omni_Reasoning_V3 Nemotron 3 Nano Omni as downloaded: transformers' legacy names
                                   (NemotronH_Omni_Reasoning_V3_Config._legacy_field_names: llm_config,
                                   sound_config, img/video/sound_context_token_id, vit_hidden_size) renamed as
                                   that class renames them, so Tessera reads what transformers' class reads
  NemotronH_Nano_VL_V2             Nemotron Nano V2 VL as downloaded (no transformers class): llm_config, a RADIO
                                   remote-code vision_config (`args.model` a timm ViT name, `args.cpe_max_size`,
                                   patch_size), force_image_size (the tile), downsample_ratio, ps_version,
                                   norm_mean/std, vit_hidden_size, projector_hidden_size, img_context_token_id,
                                   use_thumbnail (true: Tessera's tiles have the thumbnail); written as the Omni
                                   config of the same tensors (no audio) plus Tessera's `tile` and
                                   `video_embedder` (False: none)
The prefix-token table of a remote-code RADIO is not in its config (the ViT's class and register tokens depend
on the teachers it was distilled from): its size is read from the checkpoint's own cls_token tensor.
"""

from __future__ import annotations

from pathlib import Path

OMNI, NEMOTRON_H = "nemotron_h_omni", "nemotron_h"
HUB_OMNI, HUB_VL = "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_VL_V2"
LAYOUTS = (NEMOTRON_H, OMNI, HUB_OMNI, HUB_VL)
RADIO_PREFIX = "vision_model.radio_model.model.patch_generator.cls_token.token"
# timm ViT name -> (hidden, layers, heads, ffn): the remote RADIO's `args.model` (vLLM configs/radio.py's
# VIT_TIMM_DIM_BY_NAME, the same dims timm's vit_*_patch16_224 builders set)
TIMM_VIT = {"vit_small_patch16_224": (384, 12, 6, 1536), "vit_base_patch16_224": (768, 12, 12, 3072),
            "vit_large_patch16_224": (1024, 24, 16, 4096), "vit_huge_patch16_224": (1280, 32, 16, 5120)}


class ReleaseLayoutError(ValueError):
    """config.json is of a layout, or holds a value, that Tessera cannot read as a model."""


def layout_of(config: dict) -> str | None:
    """Which of LAYOUTS config.json is (model_type, else its architectures), None for another model."""
    names = [config.get("model_type"), *(config.get("architectures") or [])]
    return next((n for n in names if n in LAYOUTS), None)


def native_layout(config: dict, directory: str | Path) -> dict:
    layout = layout_of(config)
    if layout in (OMNI, NEMOTRON_H):
        return config
    if layout == HUB_OMNI:
        out = _renamed(config)
        _check_remote_radio(out.get("vision_config") or {}, where=f"{directory}/config.json vision_config")
        return out
    return _nano_vl(config, directory)


def _renamed(config: dict) -> dict:
    """The legacy names under transformers' own; a config holding both keeps the native one, as there."""
    from transformers import NemotronH_Omni_Reasoning_V3_Config

    out = {k: v for k, v in config.items() if k not in ("architectures", "auto_map")}
    for legacy, name in NemotronH_Omni_Reasoning_V3_Config._legacy_field_names.items():
        if legacy in out:
            value = out.pop(legacy)
            out.setdefault(name, value)
    audio = out.get("audio_config")
    if isinstance(audio, dict) and audio.get("model_type") == "parakeet":
        # the hub file's Parakeet type, which transformers registers under no name: the encoder's config class
        # reads the fields (what NemotronH_Omni_Reasoning_V3_Config.__post_init__ means to do, but 5.24 keeps the
        # type and fails: "Unrecognized model type for subconfig: parakeet")
        out["audio_config"] = {k: v for k, v in audio.items() if k != "model_type"}
    out["model_type"] = OMNI
    return out


def _vit_dims(vision: dict, where: str) -> tuple[int, int, int, int] | None:
    name = (vision.get("args") or {}).get("model")
    if name is None:
        return None
    if name not in TIMM_VIT:
        raise ReleaseLayoutError(f"{where}: RADIO args.model {name!r} is not a ViT Tessera knows the shape of "
                                 f"({', '.join(TIMM_VIT)})")
    return TIMM_VIT[name]


def _check_remote_radio(vision: dict, where: str) -> None:
    """A remote RADIO config beside the native fields transformers reads must describe the same ViT."""
    from transformers import RadioConfig

    dims = _vit_dims(vision, where)
    if dims is None:
        return
    native = RadioConfig(**{k: v for k, v in vision.items() if k in RadioConfig.__dataclass_fields__})
    got = (native.hidden_size, native.num_hidden_layers, native.num_attention_heads,
           int(native.hidden_size * native.mlp_ratio))
    if got != dims:
        raise ReleaseLayoutError(f"{where}: args.model {vision['args']['model']!r} is a ViT of (hidden, layers, "
                                 f"heads, ffn) {dims}, but its fields say {got}; fix one of them")


def _prefix_tokens(directory: str | Path, where: str) -> int:
    from safetensors import safe_open

    from tessera.models.nemotron_h_hf import safetensors_files

    for f in safetensors_files(directory):
        with safe_open(str(f), "pt") as st:
            if RADIO_PREFIX in st.keys():
                return st.get_slice(RADIO_PREFIX).get_shape()[0]
    raise ReleaseLayoutError(f"{where}: a remote-code RADIO does not state its class/register tokens and the "
                             f"checkpoint holds no {RADIO_PREFIX} to read them from")


def _nano_vl(config: dict, directory: str | Path) -> dict:
    where = f"{Path(directory)}/config.json ({HUB_VL})"
    missing = [k for k in ("llm_config", "vision_config", "img_context_token_id") if config.get(k) is None]
    if missing:
        raise ReleaseLayoutError(f"{where} lacks {', '.join(missing)}: a Nano V2 VL config.json as released "
                                 f"holds llm_config, vision_config and img_context_token_id")
    vision = config["vision_config"]
    dims = _vit_dims(vision, f"{where} vision_config")
    if dims is None:
        raise ReleaseLayoutError(f"{where}: vision_config has no args.model (the RADIO ViT it builds)")
    if config.get("ps_version", "v2") != "v2":
        raise ReleaseLayoutError(f"{where}: ps_version {config['ps_version']!r}: Tessera's pixel shuffle is v2's "
                                 f"(v1 leaves the feature grid transposed)")
    if not config.get("use_thumbnail", True):
        raise ReleaseLayoutError(f"{where}: use_thumbnail false: Tessera's fixed-tile path adds the whole image as a "
                                 f"thumbnail beside more than one tile (the released Nano V2 VL does)")
    hidden, layers, heads, ffn = dims
    if config.get("vit_hidden_size", hidden) != hidden:
        raise ReleaseLayoutError(f"{where}: vit_hidden_size {config['vit_hidden_size']} but args.model "
                                 f"{vision['args']['model']!r} is {hidden} wide")
    prefix = _prefix_tokens(directory, where)
    args = vision["args"]
    cls = len(args.get("teachers") or [None]) if args.get("cls_token_per_teacher") else 1
    patch = vision.get("patch_size", config.get("patch_size", 16))
    radio = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, mlp_ratio=ffn / hidden,
                 patch_size=patch, max_img_size=args.get("cpe_max_size", 2048), num_cls_tokens=min(cls, prefix),
                 num_registers=prefix - min(cls, prefix), summary_idxs=list(range(min(cls, prefix))),
                 qkv_bias=True, layer_norm_eps=args.get("layer_norm_eps", 1e-6), video_temporal_patch_size=2)
    if config.get("norm_mean") is not None:
        radio.update(norm_mean=list(config["norm_mean"]), norm_std=list(config["norm_std"]))
    tile = config.get("force_image_size") or (vision.get("preferred_resolution") or [512])[0]
    return dict(model_type=OMNI, text_config=dict(config["llm_config"]), vision_config=radio, audio_config=None,
                vision_hidden_size=hidden, downsample_ratio=config.get("downsample_ratio", 0.5),
                projector_hidden_size=config["projector_hidden_size"], image_token_id=config["img_context_token_id"],
                force_image_size=tile, tile=tile,
                # no video embedder (frames are tiles); transformers' class cannot say so (its temporal patch is an
                # int both configs must share), so Tessera's own key does
                video_embedder=False)
