"""What the conformer families (NeMo's FastConformer, transformers' Parakeet) share: 16 kHz waveforms through
NeMo's mel front end (models/audio.mel_preprocessor) into a FastConformer body (models/audio.py), replicated
across TP ranks, split over pipeline stages at layer boundaries; the data side's count of embeddings per clip;
the planner's cost per second of audio; and the checkpoint layout sound_encoder.encoder.* in transformers'
ParakeetEncoder names. A conformer family says what differs: its module class (encoder_class), which mel frames
its embeddings cover (token_frames) and how its own parameter names map to the checkpoint's (checkpoint_name).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, replace

from tessera.models.encoder_families.base import BF16, EncoderFamily

SOUND_ROOT = "sound_encoder.encoder."


@dataclass
class ConformerConfig:
    n_mels: int
    hidden: int
    layers: int
    heads: int
    ff_expansion: int
    conv_kernel: int
    subsampling: int            # dw-striding factor (a power of 2)
    subsampling_channels: int
    sample_rate: int
    window_size: float          # seconds
    window_stride: float        # seconds (the mel hop)
    n_fft: int
    # transformers' ParakeetEncoderConfig (NeMo's defaults): the released Omni sound encoder has neither
    # attention biases nor input scaling (models/released.py reads them from its config.json)
    attention_bias: bool
    convolution_bias: bool
    scale_input: bool
    projector_hidden: int | None  # None = 4x the encoder width (Omni: 1024 -> 4096)


FASTCONFORMER_PARAKEET_0_6B = ConformerConfig(  # Parakeet-TDT-0.6B-v2 encoder
    n_mels=128, hidden=1024, layers=24, heads=8, ff_expansion=4, conv_kernel=9, subsampling=8,
    subsampling_channels=256, sample_rate=16000, window_size=0.025, window_stride=0.01, n_fft=512,
    attention_bias=True, convolution_bias=True, scale_input=True, projector_hidden=None,
)
# Test size: every width divides by TP=2 and by the head count.
FASTCONFORMER_TINY = replace(FASTCONFORMER_PARAKEET_0_6B, n_mels=16, hidden=32, layers=2, heads=2, ff_expansion=2,
                             subsampling_channels=8)


class ConformerFamily(EncoderFamily):
    modality, Config = "audio", ConformerConfig
    pipeline_parallel = True
    token_frames: str  # models/media_tokens.EncoderTokens.audio_token_frames: which mel frames the count covers

    @abc.abstractmethod
    def encoder_class(self):
        """The models/audio.py module class this family builds."""

    def checkpoint_name(self, key: str) -> str:
        """The checkpoint's name (under SOUND_ROOT) of the inner conformer's parameter `key`."""
        return key

    def build(self, cfg, pg_collection, *, recompute="none", core_attention=None):
        pp_group = getattr(pg_collection, "pp", None)
        pp, stage = (pp_group.size(), pp_group.rank()) if pp_group is not None else (1, 0)
        return self.encoder_class()(cfg, recompute=recompute, pp=pp, stage=stage)

    def preprocessor(self, cfg):
        from tessera.models.audio import MelFeatures

        return MelFeatures(cfg)

    def tokens(self, cfg):
        from tessera.models.media_tokens import EncoderTokens

        return EncoderTokens(audio_rate=cfg.sample_rate, audio_hop=round(cfg.window_stride * cfg.sample_rate),
                             audio_n_fft=cfg.n_fft, audio_subsampling=cfg.subsampling,
                             audio_token_frames=self.token_frames)

    def planner_fields(self, cfg, llm_hidden):
        c = cfg
        h, L, K, sub, C = c.hidden, c.layers, c.conv_kernel, c.subsampling, c.subsampling_channels
        F, f = c.n_mels, h * c.ff_expansion
        mel_fps = 1.0 / c.window_stride
        fps = mel_fps / sub
        # dw-striding: conv(1->C, 3x3, s2) then log2(sub)-1 x [depthwise 3x3 s2 + pointwise C->C], then linear
        stages = sub.bit_length() - 1
        pre, area = 0.0, F * mel_fps  # (freq x time) positions per second before each stage
        for i in range(stages):
            area /= 4
            pre += 2 * area * C * 9 if i == 0 else 2 * area * C * (9 + C)
        pre += 2 * fps * (C * F // sub) * h + 2 * mel_fps * F * (c.n_fft // 2 + 1)  # + the mel filterbank
        # two half FFNs, 5 LayerNorms, conv module (pointwise 2h, depthwise, BatchNorm, pointwise), rel-pos MHSA
        # (q, k, v, out with biases, bias-free pos projection, pos_bias_u/v)
        layer_params = 2 * (2 * h * f + f + h) + 10 * h + (2 * h * h + 2 * h + K * h + h + 2 * h + h * h + h) \
            + (4 * h * h + 4 * h + h * h + 2 * h)
        proj_hidden = c.projector_hidden or 4 * h  # models.multimodal: sound projector hidden = 4x the width
        proj_params = h + h * proj_hidden + proj_hidden * llm_hidden
        sub_params = 9 * C + C + (stages - 1) * (9 * C + C + C * C + C) + C * F // sub * h + h
        per_frame = (L * 2 * (2 * 2 * h * f + 4 * h * h + 2 * h * h + 2 * h * h + K * h + h * h)
                     + 2 * (h * proj_hidden + proj_hidden * llm_hidden))
        # subsampling activations per mel frame: 2 tensors at the first stage's resolution, 3 at each later one
        pre_act = sum(BF16 * C * F * (2 if i == 0 else 3) / 4 ** (i + 1) for i in range(stages)) + BF16 * F
        layer = 44 * h + 8 * f  # 2 half FFNs, 5 LayerNorm inputs, q/k/v/pos/out, GLU conv module
        params = L * layer_params + proj_params + sub_params
        return dict(
            key="audio", kind="conformer", params=int(params), replicated_params=int(params), expert_params=0,
            edge_params=0, layers=L, hidden=h, out_hidden=llm_hidden, linear_flops=per_frame,
            attn_flops=8.0 * h * L, head_flops=0.0, act_bytes=0.0, act_replicated=L * layer, act_unsplit=0.0,
            act_bytes_recompute=BF16 * h * L, act_peak=(("L", layer, 0.0, 0.0),),
            act_edge=pre_act * sub + 4 * (h + proj_hidden), act_ctx=L * (4 * c.heads + 1.0), logits_bytes=0.0,
            tp_collectives=4 * L, attn_layers=0, mamba_layers=0, state_bytes=0, moe_layers=0, topk=0,
            kv_width=2 * h, tp_divides=(c.heads,), frames_per_second=fps, pre_flops_per_second=pre)

    def checkpoint_module(self, encoder):
        return encoder.encoder

    def import_tensors(self, cfg, hf, module_keys, tp_rank=0, tp=1):
        return {k: hf[SOUND_ROOT + self.checkpoint_name(k)].clone() for k in module_keys}

    def export_tensors(self, cfg, shards):
        return {SOUND_ROOT + self.checkpoint_name(k): v.detach().clone() for k, v in shards[0].items()}
