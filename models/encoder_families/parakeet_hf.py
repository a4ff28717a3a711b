"""transformers' ParakeetEncoder: the FastConformer architecture in HF's implementation and key names (what
NemotronH Omni checkpoints store under sound_encoder.encoder.*), the released Omni sound encoder. Its embeddings
are the released model's count: transformers' NemotronH_Omni_Reasoning_V3.get_audio_features and its processor
count one more mel frame, the centre-padded last STFT frame (models/media_tokens.py)."""

from __future__ import annotations

from tessera.models.encoder_families.base import register_family
from tessera.models.encoder_families.conformer import ConformerFamily


@register_family
class ParakeetHFFamily(ConformerFamily):
    name, token_frames = "parakeet_hf", "stft"

    def encoder_class(self):
        from tessera.models.audio import ParakeetHFEncoder

        return ParakeetHFEncoder

    def release_issue(self, cfg):
        return ""
