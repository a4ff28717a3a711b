"""Audio tokens per clip are the release's for every clip length (issue 15, item 4).

transformers' NemotronH_Omni_Reasoning_V3 (the oracle) counts the centre-padded STFT frames of a clip, n + 1
for n = samples // 160 valid mel frames: its processor writes subsample(1 + samples // hop) `<so_embedding>`
placeholders and `get_audio_features` keeps subsample(input_features_mask.sum(-1) + 1) embeddings, one more
than the Parakeet encoder's valid length ceil(n / 8) when n is a multiple of 8 (a 1.28 s clip: 17, not 16).
Here, on a tiny release written offline (scripts/tiny_release.py) and loaded as `hf:<dir>#audio`:
  - the data side's placeholder count (data/pipeline.encoder_tokens, what the loader sizes placeholders with,
    and the audio module's own num_tokens) equals the release processor's count of audio tokens in input_ids;
  - Tessera's audio module (NeMo mel front end, ParakeetEncoder, sound projector) gives as many embeddings as
    get_audio_features on the processor's features of the same waveform, equal in fp32 (rel err <= 1e-5),
    clip by clip and as one padded batch of clips, BatchNorm in eval and in training mode;
  - a 22.05 kHz stereo file: Tessera's decoder (resampling) and header probe against the processor loading the
    same file itself;
  - NeMo's own FastConformer family keeps NeMo's count (the encoder's valid length).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_audio_token_count.py -q
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

# 16 kHz samples of each clip and its mel frame count n = samples // 160
CLIPS = {
    "1.28s": 20480,      # n = 128, a multiple of 8: release 17 = ceil(129 / 8), encoder valid length 16
    "1.28s+79": 20559,   # n = 128 too, the samples not a multiple of the hop
    "1.30s": 20800,      # n = 130: 17 either way
    "0.5s": 8000,        # n = 50: 7
    "2.56s": 40960,      # n = 256: release 33, encoder valid length 32
    "3s": 48000,         # n = 300: 38
}
RELEASE_COUNTS = {"1.28s": 17, "1.28s+79": 17, "1.30s": 17, "0.5s": 7, "2.56s": 33, "3s": 38}
TOL = 1e-5


def _wave(samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / 16000
    return (0.2 * np.sin(2 * math.pi * 440 * t) + 0.05 * rng.standard_normal(samples)).astype(np.float32)


WAVES = {name: _wave(n, i) for i, (name, n) in enumerate(CLIPS.items())}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(directory, transformers model in eval): a tiny random release whose constant parameters and BatchNorm
    statistics are perturbed, so no norm is an identity."""
    from tessera.scripts.tiny_release import omni_checkpoint

    d = tmp_path_factory.mktemp("omni_release")
    model = omni_checkpoint(d, seed=7)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 and p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(0.2 * torch.randn_like(p))
        for name, b in model.audio_tower.named_buffers():
            if "running" in name:
                b.add_(0.3 * torch.rand_like(b))
    model.save_pretrained(str(d))
    return str(d), model.eval()


class _AudioOnlyProcessor:
    """Built lazily: transformers' NemotronH_Omni_Reasoning_V3Processor without its image / video processors
    (their modules need torchvision, absent here); the audio path is the release's own code."""

    def __new__(cls, tokenizer, feature_extractor, **kwargs):
        from transformers import NemotronH_Omni_Reasoning_V3Processor

        class AudioOnly(NemotronH_Omni_Reasoning_V3Processor):
            def check_argument_for_proper_class(self, argument_name, argument):
                if argument_name in ("image_processor", "video_processor") and argument is None:
                    return None
                return super().check_argument_for_proper_class(argument_name, argument)

        return AudioOnly(tokenizer=tokenizer, feature_extractor=feature_extractor, **kwargs)


@pytest.fixture(scope="module")
def processor(release):
    """The release's processor (Parakeet feature extractor at the checkpoint's mel bins, the config's
    subsampling) around a word-level tokenizer that knows its special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import ParakeetFeatureExtractor, PreTrainedTokenizerFast

    audio_config = release[1].config.audio_config
    specials = ["<image>", "<video>", "<so_embedding>", "<so_start>", "<so_end>", "<img>", "</img>"]
    vocab = {t: i for i, t in enumerate(["<unk>", *specials, "listen", "to", "this"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", additional_special_tokens=specials)
    return _AudioOnlyProcessor(tok, ParakeetFeatureExtractor(feature_size=audio_config.num_mel_bins),
                               audio_subsampling_factor=audio_config.subsampling_factor)


@pytest.fixture(scope="module")
def audio_module(release):
    """Tessera's audio module for `hf:<dir>#audio`, the release's tensors loaded as import_hf loads them."""
    from safetensors.torch import load_file

    from tessera.models.multimodal import build_media_module
    from tessera.models.multimodal_hf import PROJECTOR_ROOT, sound_from_hf
    from tessera.models.released import encoder_name

    d, model = release
    mod = build_media_module(encoder_name(d, "audio"), model.config.text_config.hidden_size, None).eval()
    hf = load_file(f"{d}/model.safetensors")
    root = PROJECTOR_ROOT["audio"]
    mod.projector.load_state_dict({k[len(root):]: v for k, v in hf.items() if k.startswith(root)})
    inner = mod.encoder.encoder
    inner.load_state_dict(sound_from_hf(hf, inner.state_dict().keys(), mod.cfg.family), strict=True)
    return mod


def _release(processor, model, audio) -> tuple[int, torch.Tensor]:
    """(audio placeholders in the processor's input_ids, get_audio_features' embeddings) for one clip or a
    list of clips (arrays, or file paths the processor loads itself)."""
    clips = audio if isinstance(audio, list) else [audio]
    out = processor(text="listen to this " + " ".join(["<so_embedding>"] * len(clips)), audio=audio,
                    sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        embeds = model.get_audio_features(out["input_features"], out["input_features_mask"]).pooler_output
    return int((out["input_ids"] == processor.audio_token_id).sum()), embeds


def test_placeholder_count_equals_release_processor(release, processor, audio_module):
    from tessera.data.pipeline import encoder_tokens
    from tessera.models.released import encoder_name

    enc = encoder_tokens({"audio": encoder_name(release[0], "audio")})  # the loader's EncoderTokens
    counts = {}
    for name, wave in WAVES.items():
        theirs, _ = _release(processor, release[1], wave)
        ours = enc.tokens("audio", enc.audio_padded_samples(len(wave)))
        counts[name] = (ours, theirs)
        assert ours == theirs == audio_module.num_tokens("audio", wave) == RELEASE_COUNTS[name], (name, ours, theirs)
    print("\nplaceholders (tessera, release):", counts)


@pytest.mark.parametrize("batchnorm", ["eval", "train"])
def test_embeddings_equal_get_audio_features(release, processor, audio_module, batchnorm):
    """Clip by clip (both BatchNorm modes: a training step normalises with the clip's own statistics), then all
    clips as one padded batch (eval): an extra embedding is a padded position of the encoder's output, whose
    value depends on the batch's padded length in the release too."""
    model, mod = release[1], audio_module
    if batchnorm == "train":
        model, mod = copy.deepcopy(model), copy.deepcopy(mod)
        for m in [*model.modules(), *mod.modules()]:
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.train()
    errs = {}
    with torch.no_grad():
        for name, wave in WAVES.items():
            n_ref, ref = _release(processor, model, wave)
            got = mod([("audio", wave)])
            assert got.shape == ref.shape and len(got) == n_ref, (name, got.shape, ref.shape, n_ref)
            errs[name] = _rel(got, ref)
        if batchnorm == "eval":
            n_ref, ref = _release(processor, model, list(WAVES.values()))
            got = mod([("audio", w) for w in WAVES.values()])
            assert got.shape == ref.shape and len(got) == n_ref == sum(RELEASE_COUNTS.values())
            errs["batch"] = _rel(got, ref)
    print(f"\nembeddings vs get_audio_features (BatchNorm {batchnorm}), max rel err:",
          {k: f"{v:.1e}" for k, v in errs.items()})
    assert max(errs.values()) <= TOL, errs


def test_resampled_22050_hz_file(release, processor, audio_module, tmp_path):
    """A 1.28 s stereo clip at 22.05 kHz: 28,224 samples resample to 20,480 (n = 128). Tessera probes and
    decodes the file's bytes (data/media.py); the release's processor loads the same file."""
    import soundfile as sf

    from tessera.data.media import decode_audio, probe_audio
    from tessera.data.pipeline import encoder_tokens
    from tessera.models.released import encoder_name

    t = np.arange(28224) / 22050
    left = 0.3 * np.sin(2 * math.pi * 330 * t)
    stereo = np.stack([left, 0.5 * left + 0.05 * np.sin(2 * math.pi * 3000 * t)], axis=1).astype(np.float32)
    path = tmp_path / "clip.flac"
    sf.write(path, stereo, 22050, format="FLAC")
    data = path.read_bytes()

    enc = encoder_tokens({"audio": encoder_name(release[0], "audio")})
    samples = enc.audio_padded_samples(probe_audio(data, enc.audio_rate))
    wave = decode_audio(data, enc.audio_rate, enc.audio_min_samples)
    n_ref, ref = _release(processor, release[1], str(path))
    with torch.no_grad():
        got = audio_module([("audio", wave)])
    assert samples == len(wave) == 20480
    assert enc.tokens("audio", samples) == n_ref == len(got) == 17
    err = _rel(got, ref)
    print(f"\n22.05 kHz clip: {n_ref} tokens, max rel err {err:.1e}")
    assert got.shape == ref.shape and err <= TOL


def test_fastconformer_keeps_nemo_count():
    """NeMo's own family is unchanged: its embeddings are the encoder's valid length, ceil(n / 8), as NeMo's
    ConformerEncoder reports it, and the data side announces the same."""
    from tessera.data.pipeline import encoder_tokens
    from tessera.models.audio import FastConformerEncoder
    from tessera.models.encoders import encoder_config

    torch.manual_seed(0)
    fc = FastConformerEncoder(encoder_config("fastconformer_tiny")).eval()
    enc = encoder_tokens({"audio": "fastconformer_tiny"})
    waves = [torch.from_numpy(w) for w in WAVES.values()]
    with torch.no_grad():
        out = fc(waves)
        _, valid = fc.encode_features(*fc.features(waves))
    expected = [math.ceil((n // 160) / 8) for n in CLIPS.values()]
    assert [len(o) for o in out] == valid.tolist() == [enc.audio_tokens(n) for n in CLIPS.values()] == expected
