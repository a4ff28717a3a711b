"""Audio encoders: NeMo's mel preprocessor + FastConformer (or transformers' ParakeetEncoder), and the
sound projector.

Both families take 16 kHz mono waveforms (data/media.decode_audio) and use NeMo's
AudioToMelSpectrogramPreprocessor (dither off: it would make the features random; pad_to=0, so a batch has
1 + longest // hop frames, as transformers' ParakeetFeatureExtractor gives). How many embeddings a clip keeps is
models/media_tokens.EncoderTokens.audio_tokens_of_frames of its valid mel frames, the rule the data side sizes
placeholders with (one rule, the family's tokens(): models/encoder_families/fastconformer.py and parakeet_hf.py say
which mel frames it covers).
    FastConformerEncoder  nemo.collections.asr.modules.ConformerEncoder (dw_striding subsampling, rel-pos attention)
    ParakeetHFEncoder     transformers' ParakeetEncoder: the same architecture, HF's implementation and key names
                          (what NemotronH Omni checkpoints store under sound_encoder.encoder.*)
The encoders are replicated across TP ranks (they are small next to the LLM; NeMo's module is not
TP-aware); their layout may still give them their own data-parallel ranks.
Activation recompute (`recompute=`, models/recompute.py): "full" recomputes every conformer layer in backward,
"selective" every layer's self-attention block (relative-position scores and softmax over all frame pairs).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.models.encoder_families.base import family_of
from tessera.models.recompute import megatron_fields, recompute_module
from tessera.models.vision import SquaredReLU, vit_stage_layers  # ReLU^2: as the vision projector's


def mel_preprocessor(cfg):
    from nemo.collections.asr.modules import AudioToMelSpectrogramPreprocessor

    return AudioToMelSpectrogramPreprocessor(
        sample_rate=cfg.sample_rate, features=cfg.n_mels, n_fft=cfg.n_fft,
        window_size=cfg.window_size, window_stride=cfg.window_stride, normalize="per_feature", dither=0.0, pad_to=0)


def mel_features(preprocessor, waves: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Waveforms -> (mel features [b, n_mels, frames], valid frames [b]) through NeMo's front end."""
    batch, lengths = _pad_waves(waves)
    with torch.no_grad():  # the mel front end has no trainable parameters
        return preprocessor(input_signal=batch, length=lengths)


class MelFeatures(nn.Module):
    """The conformer families' preprocessing (models/encoder_families/conformer.py) on its own: the mel front end
    an encoder of `cfg` runs, e.g. to feed a reference model the same features."""

    def __init__(self, cfg):
        super().__init__()
        self.preprocessor = mel_preprocessor(cfg)

    def features(self, waves: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return mel_features(self.preprocessor, waves)

    forward = features


def _pad_waves(waves: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, longest] float32 batch and [b] lengths, on the waves' device (the first wave's)."""
    device = torch.as_tensor(waves[0]).device
    lengths = torch.tensor([len(w) for w in waves], dtype=torch.long, device=device)
    batch = torch.zeros(len(waves), int(lengths.max()), dtype=torch.float32, device=device)
    for i, w in enumerate(waves):
        batch[i, : len(w)] = torch.as_tensor(w, dtype=torch.float32, device=device)
    return batch, lengths


def recompute_conformer(layers, mode: str) -> None:
    """Activation recompute for conformer layers (NeMo ConformerLayer or transformers' ParakeetEncoderBlock,
    both with a `self_attn`): their loops are NeMo's / transformers', so the layers themselves recompute."""
    megatron_fields(mode)  # validates the mode
    for layer in layers:
        if mode != "none":
            recompute_module(layer if mode == "full" else layer.self_attn)


def stage_layers(layers: nn.ModuleList, ids: range) -> nn.ModuleList:
    """The layers `ids` of `layers`, still named by their global index (`layers.N.*`, as on one stage, so
    checkpoints stay layout-free). NeMo's and transformers' loops only iterate over them, which visits them in
    order; positional indexing (layers[0]) is what no longer works."""
    kept = nn.ModuleList()
    for i in ids:
        kept.add_module(str(i), layers[i])
    return kept


class _Received(nn.Module):
    """A later pipeline stage's stand-in for transformers' subsampling: its input is the previous stage's output."""

    def forward(self, hidden, attention_mask=None):
        return hidden


class FastConformerEncoder(nn.Module):
    """list of waveforms -> list of [frames_i, hidden] (frames_i = EncoderTokens.audio_tokens(len_i)).

    Pipeline stages (pp > 1, MediaModule.forward_stage): the conformer cut at layer boundaries (megatron's even
    split, models/vision.vit_stage_layers). Stage 0 keeps the subsampling and its layers; a later stage keeps its
    layers only and runs the library's own forward on the received hidden states (NeMo: bypass_pre_encode, no
    second sqrt(d) input scaling; transformers: the subsampling replaced by _Received, input scale 1): positions
    and masks are recomputed from the clip's length, which every stage knows."""

    def __init__(self, cfg, recompute: str = "none", pp: int = 1, stage: int = 0):
        super().__init__()
        from nemo.collections.asr.modules import ConformerEncoder

        self.cfg = cfg
        self.tokens = family_of(cfg).tokens(cfg)
        self.preprocessor = mel_preprocessor(cfg)
        self.encoder = ConformerEncoder(
            feat_in=cfg.n_mels, n_layers=cfg.layers, d_model=cfg.hidden, n_heads=cfg.heads,
            ff_expansion_factor=cfg.ff_expansion, conv_kernel_size=cfg.conv_kernel,
            subsampling="dw_striding", subsampling_factor=cfg.subsampling,
            subsampling_conv_channels=cfg.subsampling_channels, self_attention_model="rel_pos",
            # Dropout off: the encoders we load are fine-tuned or frozen inside the VLM, and parity needs it.
            dropout=0.0, dropout_pre_encoder=0.0, dropout_emb=0.0, dropout_att=0.0,
            # NeMo otherwise all-reduces the max audio length over the WORLD group in every forward
            # (conformer_encoder.py:794): a hidden collective that hangs when only some ranks encode audio.
            sync_max_audio_length=False)
        self._split(pp, stage)
        if not self.first_stage:
            # the first stage computes the mel features, subsamples and scales them by sqrt(d_model)
            self.preprocessor = self.encoder.pre_encode = self.encoder.pos_enc.xscale = None
        recompute_conformer(self.encoder.layers, recompute)

    def _split(self, pp: int, stage: int) -> None:
        self.pp, self.stage = pp, stage
        self.first_stage, self.last_stage = stage == 0, stage == pp - 1
        if pp > 1:
            self.encoder.layers = stage_layers(self.encoder.layers, vit_stage_layers(self.cfg.layers, pp, stage))

    @property
    def out_dim(self) -> int:
        return self.cfg.hidden

    def features(self, waves: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return mel_features(self.preprocessor, waves)

    def encode_features(self, feats: torch.Tensor, feat_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [b, n_mels, t] -> ([b, t', hidden], valid lengths)."""
        out, out_len = self.encoder(audio_signal=feats, length=feat_len)
        return out.transpose(1, 2), out_len

    def encode_received(self, hidden: torch.Tensor, feat_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A later pipeline stage: the previous stage's [b, t', hidden] through this stage's layers; feat_len: the
        clips' valid mel frames."""
        length = torch.tensor([self.tokens.audio_subsampled(n) for n in feat_len.tolist()], device=hidden.device)
        out, out_len = self.encoder(audio_signal=hidden, length=length, bypass_pre_encode=True)
        return out.transpose(1, 2), out_len

    def forward(self, waves: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.pp > 1:
            raise RuntimeError("an audio pipeline stage runs through MediaModule.forward_stage")
        feats, feat_len = self.features(waves)
        return self.keep(*self.encode_features(feats, feat_len), feat_len)

    def keep(self, out: torch.Tensor, out_len: torch.Tensor, feat_len: torch.Tensor) -> list[torch.Tensor]:
        """Each clip's embeddings of the conformer's output [b, t', hidden]."""
        # the rows each clip keeps: the data side's rule on its valid mel frames, never fewer than the encoder's
        # valid length and never past its output
        keep = [self.tokens.audio_tokens_of_frames(n) for n in feat_len.tolist()]
        for k, n in zip(keep, out_len.tolist()):
            if not n <= k <= out.shape[1]:
                name = self.cfg.name or self.cfg.family
                raise RuntimeError(f"{name}: keeping {k} of {out.shape[1]} encoder frames (valid {n}) - the token "
                                   f"rule and the encoder disagree")
        return [out[i, :k] for i, k in enumerate(keep)]


class ParakeetHFEncoder(FastConformerEncoder):
    """The same interface on transformers' ParakeetEncoder (NeMo mel front end, HF conformer body)."""

    def __init__(self, cfg, recompute: str = "none", pp: int = 1, stage: int = 0):
        nn.Module.__init__(self)
        from transformers import ParakeetEncoder, ParakeetEncoderConfig

        self.cfg = cfg
        self.tokens = family_of(cfg).tokens(cfg)
        self.preprocessor = mel_preprocessor(cfg)
        self.encoder = ParakeetEncoder(parakeet_hf_config(cfg, ParakeetEncoderConfig))
        self._split(pp, stage)
        if not self.first_stage:
            # the first stage computes the mel features, subsamples and scales them
            self.preprocessor, self.encoder.subsampling, self.encoder.input_scale = None, _Received(), 1.0
        recompute_conformer(self.encoder.layers, recompute)

    def encode_received(self, hidden, feat_len):
        # the mel-frame mask, which transformers subsamples to the received length itself
        mask = torch.arange(int(feat_len.max()) + 1, device=hidden.device)[None] < feat_len[:, None]
        out = self.encoder(input_features=hidden, attention_mask=mask)
        return out.last_hidden_state, out.attention_mask.sum(-1)

    def encode_features(self, feats, feat_len):
        mask = torch.arange(feats.shape[-1], device=feats.device)[None] < feat_len[:, None]
        out = self.encoder(input_features=feats.transpose(1, 2), attention_mask=mask)
        return out.last_hidden_state, out.attention_mask.sum(-1)


def parakeet_hf_config(cfg, config_cls=None):
    """transformers' ParakeetEncoderConfig for a registry entry (dropouts off, as in FastConformerEncoder)."""
    if config_cls is None:
        from transformers import ParakeetEncoderConfig as config_cls
    return config_cls(
        hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        intermediate_size=cfg.hidden * cfg.ff_expansion, num_mel_bins=cfg.n_mels,
        conv_kernel_size=cfg.conv_kernel, subsampling_factor=cfg.subsampling,
        subsampling_conv_channels=cfg.subsampling_channels, attention_bias=cfg.attention_bias,
        convolution_bias=cfg.convolution_bias, scale_input=cfg.scale_input, dropout=0.0, dropout_positions=0.0,
        attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0)


class SoundProjector(nn.Module):
    """RMSNorm -> Linear -> squared ReLU -> Linear, bias-free: transformers' Omni `embed_audio`
    (NemotronH_Omni_Reasoning_V3MultiModalProjector, ACT2FN["relu2"], projection_bias False in the release).
    Names match the released sound_projection.{norm,linear1,linear2}; the activation has no parameters, so
    the HF key set is unchanged."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, eps: float = 1e-5, dtype=torch.float32):
        super().__init__()
        self.norm = nn.RMSNorm(in_dim, eps=eps, dtype=dtype)
        self.linear1 = nn.Linear(in_dim, hidden, bias=False, dtype=dtype)
        self.act = SquaredReLU()
        self.linear2 = nn.Linear(hidden, out_dim, bias=False, dtype=dtype)

    def forward(self, x):
        return self.linear2(self.act(self.linear1(self.norm(x))))
