"""Audio encoders: our FastConformer wrapper equals NeMo's own modules called directly; NeMo's conformer
loaded from a transformers ParakeetEncoder checkpoint (sound_encoder.encoder.* layout) gives the HF
model's output; exact HF round trips; frame counts equal data/tokens.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_encoders_audio.py -q
"""

from __future__ import annotations

import pytest
import torch

from tessera.models.audio import FastConformerEncoder, ParakeetHFEncoder, SoundProjector
from tessera.models.encoders import encoder_config, tokens_config
from tessera.models.multimodal_hf import SOUND_ROOT, sound_from_hf, sound_to_hf

WAVES = [torch.randn(16000, generator=torch.Generator().manual_seed(0)),
         torch.randn(23456, generator=torch.Generator().manual_seed(1))]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def parakeet():
    """A random transformers ParakeetEncoder with BatchNorm statistics moved off their init."""
    torch.manual_seed(0)
    enc = ParakeetHFEncoder(encoder_config("parakeet_hf_tiny")).eval()
    with torch.no_grad():
        for name, b in enc.encoder.named_buffers():
            if "running" in name:
                b.copy_(b + 0.3 * torch.rand_like(b))
        for p in enc.encoder.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return enc


def test_wrapper_equals_nemo_modules_called_directly():
    torch.manual_seed(0)
    ours = FastConformerEncoder(encoder_config("fastconformer_tiny")).eval()
    batch = torch.zeros(2, len(WAVES[1]))
    batch[0, : len(WAVES[0])], batch[1] = WAVES[0], WAVES[1]
    lengths = torch.tensor([len(w) for w in WAVES])
    with torch.no_grad():
        feats, feat_len = ours.preprocessor(input_signal=batch, length=lengths)
        ref, ref_len = ours.encoder(audio_signal=feats, length=feat_len)
        got = ours(WAVES)
    for i, g in enumerate(got):
        assert g.shape == (int(ref_len[i]), 32)
        assert torch.equal(g, ref[i, :, : int(ref_len[i])].T)


def test_frame_counts_equal_data_side(parakeet):
    for enc in (FastConformerEncoder(encoder_config("fastconformer_tiny")).eval(), parakeet):
        with torch.no_grad():
            out = enc(WAVES + [torch.randn(4000)])
        tokens = tokens_config(enc.cfg)
        assert [len(o) for o in out] == [tokens.audio_tokens(n) for n in (16000, 23456, 4000)]


def test_nemo_conformer_matches_transformers_parakeet(parakeet):
    hf = sound_to_hf(parakeet.encoder.state_dict(), "parakeet_hf")
    assert all(k.startswith(SOUND_ROOT) for k in hf)
    nemo = FastConformerEncoder(encoder_config("fastconformer_tiny")).eval()
    nemo.encoder.load_state_dict(sound_from_hf(hf, nemo.encoder.state_dict().keys(), "fastconformer"))
    with torch.no_grad():
        ref, got = parakeet(WAVES), nemo(WAVES)
    errs = [_rel(g, r) for g, r in zip(got, ref)]
    print(f"NeMo FastConformer vs transformers Parakeet rel err {max(errs):.2e}")
    assert [g.shape for g in got] == [r.shape for r in ref] and max(errs) < 1e-5
    # Exact round trip: NeMo names -> HF layout gives back the very tensors HF saved.
    again = sound_to_hf(nemo.encoder.state_dict(), "fastconformer")
    assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k]) for k in hf)


def test_sound_projector_shapes_and_grads():
    proj = SoundProjector(32, 128, 64)
    assert set(proj.state_dict()) == {"norm.weight", "linear1.weight", "linear2.weight"}
    x = torch.randn(5, 32, requires_grad=True)
    proj(x).sum().backward()
    assert proj(x).shape == (5, 64) and x.grad.abs().sum() > 0
