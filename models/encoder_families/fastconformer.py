"""NeMo's FastConformer (nemo.collections.asr.modules.ConformerEncoder: dw_striding subsampling, rel-pos
attention), as Parakeet-TDT's encoder. Its embeddings cover the encoder's valid length (NeMo's count); its
parameters go to the checkpoint in transformers' ParakeetEncoder names, renamed one-to-one (same tensors, same
shapes)."""

from __future__ import annotations

import re

from tessera.models.encoder_families.base import register_family
from tessera.models.encoder_families.conformer import ConformerFamily

# NeMo ConformerEncoder name fragment -> transformers ParakeetEncoder name fragment
_NEMO_TO_PARAKEET = [
    (r"^pre_encode\.conv\.", "subsampling.layers."), (r"^pre_encode\.out\.", "subsampling.linear."),
    (r"\.conv\.batch_norm\.", ".conv.norm."), (r"\.self_attn\.pos_bias_([uv])$", r".self_attn.bias_\1"),
    (r"\.self_attn\.linear_q\.", ".self_attn.q_proj."), (r"\.self_attn\.linear_k\.", ".self_attn.k_proj."),
    (r"\.self_attn\.linear_v\.", ".self_attn.v_proj."), (r"\.self_attn\.linear_out\.", ".self_attn.o_proj."),
    (r"\.self_attn\.linear_pos\.", ".self_attn.relative_k_proj."),
]


def nemo_to_parakeet_name(key: str) -> str:
    for pattern, repl in _NEMO_TO_PARAKEET:
        key = re.sub(pattern, repl, key)
    return key


@register_family
class FastConformerFamily(ConformerFamily):
    name, token_frames = "fastconformer", "valid"

    def encoder_class(self):
        from tessera.models.audio import FastConformerEncoder

        return FastConformerEncoder

    def checkpoint_name(self, key):
        return nemo_to_parakeet_name(key)

    def release_issue(self, cfg):
        return ("audio family 'fastconformer' (NeMo's FastConformer) keeps NeMo's embedding count, not the "
                "release's (use a parakeet_hf_* encoder for a model transformers runs alike)")
