"""No single sample ends a job: media a decoder accepts but an encoder cannot take.

The data side knows each encoder's limits from its config (models/media_tokens.EncoderTokens): audio shorter
than 0.1 s is zero-padded to 0.1 s as the released Parakeet front end does (so it gives at least 2 encoder
frames; one frame alone in a rank's microbatch makes the conformer's BatchNorm raise in training), a clip
that still gives fewer frames than the encoder needs and empty audio are skipped as `too_short`, images over PIL's decompression-bomb limit as `too_large`, prompts over the row as `too_long`;
each skip is counted by reason in the training metrics. The shortest/smallest media each encoder accepts
and the first ones it does not go through the training entry point on 4 gloo ranks."""

from __future__ import annotations

import dataclasses
import io
import math
import random
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from tessera.data.loader import ChatTaskEncoder, build_loader, close_loader
from tessera.data.media import decode_audio
from tessera.data.pipeline import build_train_loader, encoder_tokens
from tessera.data.prepare import caption_chat, encode_mp4, energon_prepare, write_shards
from tessera.data.tokens import train_sentencepiece
from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.training.metrics import read_metrics
from tessera.models.media_tokens import EncoderTokens
from tessera.hetero.runspec.config import DataConfig

ENCODERS = {"vision": "radio_vit_tiny", "audio": "fastconformer_tiny"}
SEQ = 96
# audio on its own two DP ranks, two rows per microbatch and (by the long captions) one sample per row: each
# audio rank encodes exactly one clip per microbatch, the case where a one-frame clip used to end the job
LAYOUT = "vision=dp2@0-1;audio=dp2@2-3;language=dp2@0-1"


def _wav(samples: int, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    t = np.arange(samples) / rate
    sf.write(buf, (0.3 * np.sin(2 * math.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def _png(w: int, h: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h)).save(buf, format="PNG")
    return buf.getvalue()


def _mp4(frames: int) -> bytes:
    return encode_mp4((np.full((16, 16, 3), 90, np.uint8) for _ in range(frames)), fps=8)


# key -> (kind, ext, bytes-maker, expected fate)
MEDIA = {
    "audio_one_sample": ("audio", "wav", lambda: _wav(1), "kept"),           # shortest audio: padded to 0.1 s
    "audio_50ms": ("audio", "wav", lambda: _wav(800), "kept"),               # the clip that ended a 4-rank job
    "audio_0_1s": ("audio", "wav", lambda: _wav(1600), "kept"),
    "audio_empty": ("audio", "wav", lambda: _wav(0), "too_short"),           # first one not accepted
    "audio_60s": ("audio", "wav", lambda: _wav(60 * 16_000), "too_long"),    # 750 tokens > the row
    "image_1x1": ("image", "png", lambda: _png(1, 1), "kept"),               # smallest image
    "image_bomb": ("image", "png", lambda: _png(18_000, 10_000, "1"), "too_large"),  # 180 MP > PIL's guard
    "video_one_frame": ("video", "mp4", lambda: _mp4(1), "kept"),            # shortest video
    # no container writes a video stream without frames that demuxes: the first video not accepted is undecodable
    "video_no_frames": ("video", "mp4", lambda: _mp4(0), "undecodable_video"),
}


# the clips that are one conformer frame unpadded come several times, so that the training run below meets
# them early (packing groups samples of similar length, and the image/video samples are the longest)
COPIES = {"audio_one_sample": 4, "audio_50ms": 4}
STEPS = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    rng = random.Random(0)
    words = ["tone", "pixel", "frame", "short", "clip", "image", "video", "sound", "quiet", "bright"]
    records = []
    for key, (kind, ext, make, _) in MEDIA.items():
        for copy in range(COPIES.get(key, 1)):
            # a caption longer than half a row: every row holds one sample
            caption = " ".join(rng.choice(words) for _ in range(40))
            records.append((f"{key}-{copy}", caption_chat(kind, caption), [(kind, ext, make())]))
    write_shards(iter(records), root, shard_size=16)
    energon_prepare(root)
    texts = [t["content"] for _, conv, _ in records for t in conv] * 4
    tok = train_sentencepiece(texts + ["user\n", "assistant\n", "system\n"], root / "tokenizer", vocab_size=300)
    return root, tok


def _one_epoch(root, tok):
    te = ChatTaskEncoder(tok, SEQ, encoder_tokens(ENCODERS), modules=set(ENCODERS))
    loader = build_loader(root, te, 1, repeat=False, shuffle_buffer=None)
    skipped, rows = {}, []
    for b in loader:
        for k, v in b.skipped.items():
            skipped[k] = skipped.get(k, 0) + v
        rows += [(keys, media) for keys, media in zip(b.keys, b.media)]
    close_loader(loader)
    return skipped, rows


def test_each_encoder_limit_is_kept_padded_or_skipped_with_its_reason(dataset):
    skipped, rows = _one_epoch(*dataset)
    expected = {}
    for key, (_, _, _, fate) in MEDIA.items():
        if fate != "kept":
            expected[fate] = expected.get(fate, 0) + COPIES.get(key, 1)
    assert skipped == expected
    kept = sorted(k.split("-")[0] for keys, _ in rows for k in keys)
    assert kept == sorted(k for k, v in MEDIA.items() if v[3] == "kept" for _ in range(COPIES.get(k, 1)))
    assert all(len(keys) == 1 for keys, _ in rows), "the captions must fill more than half a row"
    waves = [item for _, media in rows for kind, item in media.get("audio", [])]
    enc = EncoderTokens()
    assert sorted(len(w) for w in waves) == [1600] * 9  # 1 and 800 samples padded to 0.1 s
    assert all(enc.audio_tokens(len(w)) == 2 for w in waves)


def test_padding_is_zeros_after_the_clip():
    wave = decode_audio(_wav(800), min_samples=1600)
    assert wave.shape == (1600,) and np.array_equal(wave[:800], decode_audio(_wav(800))) and not wave[800:].any()


def test_a_clip_the_encoder_cannot_take_even_padded_is_skipped_too_short(dataset):
    """With 16x subsampling 0.1 s gives one frame: padding is not enough, the sample is skipped, not trained."""
    root, tok = dataset
    enc = dataclasses.replace(encoder_tokens(ENCODERS), audio_subsampling=16)
    assert enc.audio_tokens(enc.audio_padded_samples(800)) == 1
    loader = build_loader(root, ChatTaskEncoder(tok, SEQ, enc), 1, repeat=False, shuffle_buffer=None)
    skipped = {}
    for b in loader:
        for k, v in b.skipped.items():
            skipped[k] = skipped.get(k, 0) + v
    close_loader(loader)
    assert skipped["too_short"] == 10  # the 9 short clips and the empty one (audio_60s stays too_long)


def _conformer_on_one_clip(samples: int, min_samples: int) -> tuple[str | None, tuple | None]:
    """(the error, or None; the output shape) of NeMo's conformer in training mode on one clip."""
    from tessera.hetero.build.model_build import single_rank_pgs
    from tessera.models.multimodal import build_media_module

    audio = build_media_module("fastconformer_tiny", 32, single_rank_pgs()).train()
    try:
        out = audio([("audio", decode_audio(_wav(samples), min_samples=min_samples))])  # (kind, item) as batches hold
    except ValueError as e:
        return str(e), None
    return None, (tuple(out.shape), bool(torch.isfinite(out).all()))


def _conformer_cases():
    return [_conformer_on_one_clip(800, 0), _conformer_on_one_clip(800, EncoderTokens().audio_min_samples)]


def test_the_conformer_cannot_train_on_one_frame_and_can_on_a_padded_clip():
    """Why the padding: NeMo's conformer in training mode on one unpadded 50 ms clip (1 frame) raises."""
    (err, _), (ok, (shape, finite)) = run_on_ranks(1, _conformer_cases)[0]
    assert err is not None and "more than 1 value per channel" in err
    assert ok is None and shape == (2, 32) and finite


def _train(run_dir: str, data: str, tok: str):
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    return train(ModelConfig(**ENCODERS), DataConfig(path=data, tokenizer=tok, seq_length=SEQ, rows_per_microbatch=2,
                                                     microbatches=1),
                 OptimConfig(lr=1e-3), TrainerConfig(max_steps=STEPS, run_dir=run_dir, progress=False, tensorboard=False),
                 layout=LAYOUT, name="limits")


def test_training_on_four_ranks_survives_every_limit_and_counts_the_skips(dataset, tmp_path):
    root, tok = dataset
    # the trainer's stream (same loader, seed and buffers): some microbatch gives an audio rank one row whose
    # only clip is a one-frame-unpadded one, i.e. the run below meets the case that used to end the job
    loader = build_train_loader(root, tok, ENCODERS, SEQ, 2, decode=None, seed=DataConfig().seed)
    it = iter(loader)
    first = [next(it).keys for _ in range(STEPS)]
    close_loader(loader)
    assert any(k.startswith(("audio_50ms", "audio_one_sample")) for rows_ in first for keys in rows_ for k in keys)

    run_on_ranks(4, _train, str(tmp_path / "run"), str(root), str(tok), timeout=600)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and all(math.isfinite(r["loss"]) for r in rows)
    reasons = {}
    for r in rows:
        for k, v in r["skipped_by_reason"].items():
            reasons[k] = reasons.get(k, 0) + v
    assert set(reasons) == {"too_short", "too_large", "too_long", "undecodable_video"}, reasons
