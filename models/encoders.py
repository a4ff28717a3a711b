"""Media encoders as plain config data, registered by name, so a recipe swaps one with a single field.

An entry is a dict of architecture fields plus `family` (which builder reads it) and `modality`
("vision" or "audio", the module key of hetero/plan/layout.py and data/tokens.MODULE_OF_KIND). Variants are
the base dict with fields overridden, as litgpt/torchtitan registries do. `encoder_config(name)` returns a
fresh copy, so a caller may mutate it (e.g. a recipe override) without touching the registry.

Families and their builders:
    radio          models.vision.VisionTransformer  (RADIO ViT: cls/register prefix tokens, linear patch embed)
    siglip         models.vision.VisionTransformer  (SigLIP ViT: conv patch embed with bias, no prefix tokens)
    fastconformer  models.audio.FastConformerEncoder (NeMo ConformerEncoder + NeMo mel preprocessor)
    parakeet_hf    models.audio.ParakeetHFEncoder   (transformers' ParakeetEncoder + NeMo mel preprocessor)
"""

from __future__ import annotations

import copy

from tessera.models.released import PREFIX as CHECKPOINT_PREFIX, encoder_config_of

# Pixel statistics the encoders normalise uint8 tiles with (CLIP's for RADIO, [-1, 1] for SigLIP).
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)

RADIO_VIT_H = dict(
    family="radio", modality="vision",
    patch=16, hidden=1280, layers=32, heads=16, ffn=5120, eps=1e-6, act="gelu",
    # C-RADIO keeps 10 prefix tokens (cls + registers); they are dropped from the output.
    prefix_tokens=10,
    # Learned position table for a 128x128 patch grid (2048 px), interpolated to each input's grid by
    # RADIO's CPE rule: bilinear to a square of the grid's longer side, then its top-left window.
    pos_grid=128, pos_interp="bilinear", pos_resize="cpe",
    # temporal_patch: frames fused by the video tubelet embedder (0: that family has none).
    tile=512, pixel_shuffle=2, temporal_patch=2, mean=_CLIP_MEAN, std=_CLIP_STD,
    projector_hidden=None,  # the projector's hidden width; None = 4x its input (Nano VL: 5120 -> 20480)
    # RadioModel ends at its last block: no final norm. NemotronH_Omni_Reasoning_V3 adds one LayerNorm
    # (`vision_final_layernorm`, on the patch features before pixel shuffle) only when its LLM has MTP layers
    # (text_config.num_nextn_predict_layers > 0); final_norm=True is that model.
    final_norm=False,
    # Every RadioLayer scales its attention and MLP outputs per channel before the residual add (learned
    # blocks.N.layer_scale{1,2}.lambda1); the value is the initial one (RadioConfig.layerscale_value).
    # None: no layer scale (SigLIP).
    layer_scale=1.0,
    # Non-parameter tensors of the checkpoint, checked on import and written back on export
    # (models/multimodal_hf.py): summary_idxs (RadioConfig.summary_idxs, transformers' default; RadioModel
    # always saves it; None: not stored) and whether input_conditioner.norm_{mean,std} (= mean/std above as
    # float32) is stored: NVIDIA's released files carry it, transformers' Omni (conditioner external) saves none.
    summary_idxs=(0, 1), input_conditioner=True,
)
SIGLIP_SO400M = dict(
    family="siglip", modality="vision",
    patch=14, hidden=1152, layers=27, heads=16, ffn=4304, eps=1e-6, act="gelu_tanh",
    prefix_tokens=0, pos_grid=27, pos_interp="bicubic", pos_resize="plain",  # trained at 384 px = 27x27 patches
    # 448-px tiles give 32x32 patches, so pixel shuffle 0.5 yields 256 tokens per tile as for RADIO.
    tile=448, pixel_shuffle=2, temporal_patch=0, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
    projector_hidden=None,
    final_norm=True, layer_scale=None,  # SigLIP's post_layernorm; no layer scale
)
FASTCONFORMER_PARAKEET_0_6B = dict(  # Parakeet-TDT-0.6B-v2 encoder
    family="fastconformer", modality="audio",
    n_mels=128, hidden=1024, layers=24, heads=8, ff_expansion=4, conv_kernel=9, subsampling=8,
    subsampling_channels=256, sample_rate=16000, window_size=0.025, window_stride=0.01, n_fft=512,
    # parakeet_hf only (transformers' ParakeetEncoderConfig; NeMo's defaults): the released Omni sound encoder
    # has neither attention biases nor input scaling (models/released.py reads them from its config.json)
    attention_bias=True, convolution_bias=True, scale_input=True,
    projector_hidden=None,  # None = 4x the encoder width (Omni: 1024 -> 4096)
)
PARAKEET_HF_0_6B = dict(FASTCONFORMER_PARAKEET_0_6B, family="parakeet_hf")

# Test sizes: every width divides by TP=2 and by the head count; tiles stay 32x32 patches' worth of
# structure small (64-px tiles of 16-px patches -> 4x4 patches -> 4 tokens after pixel shuffle).
# The tiny RADIO is laid out as transformers saves it: one cls token (summary_idxs (0,)), no conditioner.
RADIO_VIT_TINY = dict(RADIO_VIT_H, hidden=32, layers=2, heads=4, ffn=64, prefix_tokens=2, pos_grid=8, tile=64,
                      summary_idxs=(0,), input_conditioner=False)
SIGLIP_TINY = dict(SIGLIP_SO400M, hidden=32, layers=2, heads=4, ffn=64, pos_grid=4, tile=56)
FASTCONFORMER_TINY = dict(FASTCONFORMER_PARAKEET_0_6B, n_mels=16, hidden=32, layers=2, heads=2, ff_expansion=2,
                          subsampling_channels=8)
PARAKEET_HF_TINY = dict(FASTCONFORMER_TINY, family="parakeet_hf")

REGISTRY = {
    "radio_vit_h": RADIO_VIT_H,
    "radio_vit_tiny": RADIO_VIT_TINY,
    "siglip_so400m": SIGLIP_SO400M,
    "siglip_tiny": SIGLIP_TINY,
    "fastconformer_parakeet_0_6b": FASTCONFORMER_PARAKEET_0_6B,
    "fastconformer_tiny": FASTCONFORMER_TINY,
    "parakeet_hf_0_6b": PARAKEET_HF_0_6B,
    "parakeet_hf_tiny": PARAKEET_HF_TINY,
}


# Which mel frames an audio family's embeddings cover (EncoderTokens.audio_token_frames): NeMo's FastConformer
# keeps its valid length; parakeet_hf is the released Omni sound encoder, whose model (transformers'
# NemotronH_Omni_Reasoning_V3.get_audio_features) and processor count one more frame, the centre-padded last
# STFT frame (models/media_tokens.py).
AUDIO_TOKEN_FRAMES = {"fastconformer": "valid", "parakeet_hf": "stft"}

# Families whose layers are megatron tensor-parallel (the ViTs); the conformers run with tp1.
TENSOR_PARALLEL_FAMILIES = frozenset({"radio", "siglip"})


def has_tensor_parallel(name: str) -> bool:
    """Whether encoder `name` can be split over tensor-parallel ranks."""
    return encoder_config(name)["family"] in TENSOR_PARALLEL_FAMILIES


def is_known(name: str) -> bool:
    """A registry name, or a checkpoint's encoder (`hf:<dir>#<modality>`, models/released.py)."""
    return name in REGISTRY or name.startswith(CHECKPOINT_PREFIX)


def encoder_config(name: str, **overrides) -> dict:
    """A copy of the registered config `name` (or of the encoder a checkpoint's config.json describes, for
    `hf:<dir>#<modality>`) with `overrides` applied (unknown fields are refused, since a typo would otherwise
    silently build the default architecture)."""
    if name.startswith(CHECKPOINT_PREFIX):
        cfg = encoder_config_of(name)
        base = next(c for c in REGISTRY.values() if c["family"] == cfg["family"])
        if set(cfg) - {"name"} != set(base):  # models/released.py must set exactly a registry entry's fields
            raise KeyError(f"{name}: derived fields {sorted(set(cfg) ^ set(base) - {'name'})} differ from the "
                           f"{cfg['family']} registry entries'")
    elif name not in REGISTRY:
        raise KeyError(f"unknown encoder {name!r}; known encoders: {', '.join(sorted(REGISTRY))}")
    else:
        cfg = copy.deepcopy(REGISTRY[name])
    bad = sorted(set(overrides) - set(cfg))
    if bad:
        raise KeyError(f"encoder {name!r} has no fields {bad}; its fields: {', '.join(sorted(cfg))}")
    cfg.update(overrides)
    cfg["name"] = name
    return cfg


def tokens_config(cfg: dict):
    """The data side's EncoderTokens for a vision or audio encoder config (one source for both sides)."""
    from tessera.models.media_tokens import EncoderTokens

    if cfg["modality"] == "vision":
        return EncoderTokens(tile=cfg["tile"], patch=cfg["patch"], pixel_shuffle=cfg["pixel_shuffle"])
    return EncoderTokens(audio_rate=cfg["sample_rate"], audio_hop=round(cfg["window_stride"] * cfg["sample_rate"]),
                         audio_n_fft=cfg["n_fft"], audio_subsampling=cfg["subsampling"],
                         audio_token_frames=AUDIO_TOKEN_FRAMES[cfg["family"]])
