"""A from-scratch Tessera model as a release: the config.json of transformers' NemotronH_Omni_Reasoning_V3 that
describes exactly its exported tensors — the inverse of models/released.py — or why there is none.

    config, why = omni_config(vision_cfg, audio_cfg, llm_hf_fields, shapes)   # shapes: exported key -> shape

A model fine-tuned from a release exports the release's own config.json (hetero/export/hf.py); a model
built from registry names gets this one, so `NemotronH_Omni_Reasoning_V3.from_pretrained(OUT)` loads it too.
Only what the release's architecture computes the same way can be described: each encoder's family says whether
it is the release's encoder of its modality (EncoderFamily.release_issue: RADIO with the release's position rule
and no final norm, transformers' Parakeet with the release's count of embeddings); the fields below are then
those families' fields.
Widths the registry leaves implicit (the projectors' hidden sizes) are read from the exported tensors.
The config carries no media token ids: they belong to the run's tokenizer, and the export sets those of the
tokenizer it ships (hetero/export/hf.media_token_ids).
"""

from __future__ import annotations

from tessera.models.encoder_families.base import EncoderIdentity, family_of

MLP1_HIDDEN, SOUND_HIDDEN = "mlp1.1.weight", "sound_projection.linear1.weight"


def _vision(v: EncoderIdentity, shapes: dict) -> tuple[dict | None, str]:
    why = family_of(v).release_issue(v)
    if why:
        return None, why
    summary = list(v.summary_idxs or (0,))
    cls = max(summary) + 1  # the prefix tokens are one table; the release splits it into cls + registers
    return dict(
        patch_size=v.patch, hidden_size=v.hidden, num_hidden_layers=v.layers,
        num_attention_heads=v.heads, mlp_ratio=v.ffn / v.hidden, layer_norm_eps=v.eps,
        hidden_act="gelu", qkv_bias=True, use_swiglu_ffn=False, num_cls_tokens=cls,
        num_registers=v.prefix_tokens - cls, max_img_size=v.pos_grid * v.patch,
        norm_mean=list(v.mean), norm_std=list(v.std), video_temporal_patch_size=v.temporal_patch or None,
        layerscale_value=v.layer_scale, summary_idxs=summary,
    ), ""


def _audio(a: EncoderIdentity, shapes: dict) -> tuple[dict | None, str]:
    why = family_of(a).release_issue(a)
    if why:
        return None, why
    return dict(
        hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        intermediate_size=a.hidden * a.ff_expansion, num_mel_bins=a.n_mels,
        subsampling_factor=a.subsampling, subsampling_conv_channels=a.subsampling_channels,
        conv_kernel_size=a.conv_kernel, attention_bias=a.attention_bias,
        convolution_bias=a.convolution_bias, scale_input=a.scale_input, hidden_act="silu",
        subsampling_conv_kernel_size=3, subsampling_conv_stride=2,
        projection_hidden_size=shapes[SOUND_HIDDEN][0], projection_bias=False,
    ), ""


def omni_config(vision: EncoderIdentity | None, audio: EncoderIdentity | None, text_fields: dict,
                shapes: dict[str, tuple[int, ...]], video_pruning: float = 0.0) -> tuple[dict | None, str]:
    """(NemotronH_Omni_Reasoning_V3_Config kwargs, "") or (None, why this model has no such config)."""
    if vision is None:
        return None, "no vision encoder: the LLM alone is exported as language_model/ (NemotronHForCausalLM)"
    v, why = _vision(vision, shapes)
    if v is None:
        return None, why
    a = None
    if audio is not None:
        a, why = _audio(audio, shapes)
        if a is None:
            return None, why
    return dict(vision_config=v, audio_config=a, text_config=dict(text_fields), vision_hidden_size=vision.hidden,
                downsample_ratio=1 / vision.pixel_shuffle, projector_hidden_size=shapes[MLP1_HIDDEN][0],
                video_temporal_patch_size=vision.temporal_patch or None, video_pruning_rate=video_pruning), ""
