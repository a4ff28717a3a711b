"""The training loss is the oracle's (issue 15, item 5): on the same samples, the first-step loss Tessera's
trainer logs in a heterogeneous layout equals the loss transformers' NemotronH_Omni_Reasoning_V3 gives them
(fp32, relative error <= 1e-4).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_released_loss.py -q -s

The run: a tiny random Omni checkpoint (save_pretrained, image/audio token ids = the Tessera tokenizer's
`<image>` / `<so_embedding>` (the omni prompt template's), vocabulary = the tokenizer's), a small data set of image-only, audio-only and
text+image conversations, one step on 4 gloo ranks (vision and audio dp2 on ranks 0-1, the LLM tp2 on
ranks 2-3); the loss of step 1 is computed before the update.
The oracle: the same first microbatch rebuilt in this process by the trainer's loader (same data set, seed
and arguments as hetero/training/step_parts.run_loader, every row decoded); every packed document on its own
(packing restarts attention and Mamba state at each document) through the Omni model's forward:
  input_ids       the document's tokens, media placeholders being the config's image/audio token ids
  pixel_values    every tile Tessera encoded as one image of (tile/patch)^2 patches, normalised with the
  image_grid_hw   config's mean/std, flattened as transformers' image processor does (packed patches)
  input_features  the mel features Tessera's audio encoder computes from the same waveform (NeMo front end;
                  the Omni processor's own features are input parity, not this test), with their mask
then cross entropy of its logits against Tessera's labels at the same positions, summed over every target
token of the microbatch and divided by their count (Tessera's normaliser, hetero/training/stages.py).
The oracle runs in eval mode except for the Parakeet conformer's BatchNorm: a training step normalises each
clip with its own statistics (Tessera encodes every media item alone), so transformers' BatchNorm is in
training mode too (in eval it would use the running statistics: another function).
Video with EVS (video pruning 0.5, test_first_step_loss_with_pruned_video_equals_transformers_omni): a data set
of video documents (square frames: the release's forward prunes square frame grids only; its EVS takes every
image-token position of a document as the clip's, so a clip has a document of its own). The trainer writes each
clip's tubelet chunks at nominal counts and settles them to the counts its EVS chose at the vision boundary; the
oracle gives transformers the release's ids (every chunk widened to its tubelet's tokens,
models/hf_reference.release_video_tokens), which its forward prunes with its own retention mask. Transformers
computes no loss under EVS (it prunes the logits, not its labels), so the cross entropy is taken of its logits
against Tessera's labels, which settling never moves (the chunks are never targets).
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from tessera.scripts.tiny_release import AUDIO, VISION

from tessera.data.templates import TEMPLATES
from tessera.models import configs
from tessera.models.hf_reference import omni_forward_inputs, release_video_pixels, release_video_tokens

OMNI = TEMPLATES["omni"]  # the template the loader uses for a model with an audio encoder

LAYOUT = "vision=dp2@0-1;audio=dp2@0-1;language=tp2@2-3"
# The first microbatch must hold every kind of document and a clip whose mel frame count is a multiple of 8
# (asserted below); which documents packing puts there depends on their lengths, so on the image token counts:
# since the omni family takes images at native resolution (one patch grid, not 2 tiles + thumbnail) that needs
# 4 rows and loader seed 2 (with 2 rows and the default seed the first microbatch has no audio).
SEQ, ROWS, LOADER_SEED = 384, 4, 2
VIDEO_FRAMES = 6  # three tubelets: EVS at 0.5 keeps one and a half, so the last two share what it keeps
TOL = 1e-4
# The pruned-video run agrees to 4.6e-9 (fp32, one microbatch); the same run with its chunks left at their nominal
# counts is off by 1.9e-5 (the captions see the clip's tokens through attention and Mamba state only): 1e-6 tells
# the release's layout from the unsettled one.
TOL_EVS = 1e-6


KINDS = ("image", "audio", "chat", "audio")


def _kind(key: str) -> str:
    """image (caption), audio (caption) or chat (text + image, two turns) from a sample key."""
    return KINDS[int(key.rsplit("_", 1)[1]) % len(KINDS)]


def _tone(rng: random.Random) -> tuple[bytes, str, str]:
    """A 5-8 s tone at 16 or 22.05 kHz, mono or stereo (22.05 kHz is resampled by the loader); long, so that
    the audio documents pack into the first microbatch. 5.12 s and 7.68 s have a mel frame count n = samples //
    160 that is a multiple of 8 (also after resampling), where the Omni model keeps ceil((n + 1) / 8) audio
    embeddings, one more than the encoder's valid length (tests/test_audio_token_count.py); 6.1 s is not."""
    import io
    import math

    import soundfile as sf

    rate, seconds, channels = rng.choice([16000, 22050]), rng.choice([5.12, 6.1, 7.68]), rng.choice([1, 2])
    freq = rng.choice([220, 330, 440, 660, 880])
    t = np.arange(round(rate * seconds)) / rate
    wave = (0.3 * np.sin(2 * math.pi * freq * t) + 0.05 * np.sin(2 * math.pi * 3.1 * freq * t)) * np.minimum(1, 10 * t)
    buf = io.BytesIO()
    sf.write(buf, np.stack([wave] * channels, axis=1).astype(np.float32), rate, format="FLAC")
    return buf.getvalue(), "flac", f"A steady {freq} hertz tone with a faint overtone, {seconds} seconds long."


def _records(n: int = 12, seed: int = 3):
    """(key, conversation, media) cycling through KINDS."""
    from tessera.data.prepare import caption_chat, synth_image

    rng = random.Random(seed)
    for i in range(n):
        kind = _kind(key := f"loss_{i:04d}")
        if kind != "chat":
            data, ext, text = {"image": synth_image, "audio": _tone}[kind](rng)
            yield key, caption_chat(kind, text), [(kind, ext, data)]
            continue
        data, ext, text = synth_image(rng)
        conversation = [
            {"role": "system", "content": "You are a helpful multimodal assistant."},
            {"role": "user", "content": "Look at this: <image>"},
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Which shape is it, and how large is the picture?"},
            {"role": "assistant", "content": f"The shape is described above: {text.lower()}"},
        ]
        yield key, conversation, [("image", ext, data)]


def _clip(rng: random.Random) -> tuple[bytes, str, str]:
    """A 6-frame 64x64 clip: a square moves for four frames, then the picture stays still."""
    from tessera.data.prepare import COLORS, encode_mp4

    color, size = rng.choice(sorted(COLORS)), 16
    frames = np.zeros((6, 64, 64, 3), dtype=np.uint8)
    for t in range(6):
        x = 12 * min(t, 3)
        frames[t, 24:24 + size, x:x + size] = COLORS[color]
    return encode_mp4(frames, fps=8), "mp4", f"A {color} square moves right, then stops."


def _video_records(n: int = 8, seed: int = 5):
    from tessera.data.prepare import caption_chat

    rng = random.Random(seed)
    for i in range(n):
        data, ext, text = _clip(rng)
        yield f"loss_{i:04d}", caption_chat("video", text), [("video", ext, data)]


def _dataset(root, records=None):
    """Shards + energon index + a SentencePiece tokenizer (root/tokenizer.model) trained on the texts."""
    from tessera.data.prepare import energon_prepare, write_shards
    from tessera.data.tokens import Tokenizer, train_sentencepiece

    records = list(records if records is not None else _records())
    write_shards(iter(records), root, shard_size=6)
    energon_prepare(root)
    texts = [t["content"] for _, conv, _ in records for t in conv] * 4
    train_sentencepiece(texts + ["user\n", "assistant\n", "system\n"], root / "tokenizer", vocab_size=400)
    return Tokenizer(root / "tokenizer.model")


def _checkpoint(directory, tok, **config) -> None:
    """A random tiny Omni model whose media token ids and vocabulary are the tokenizer's, shipped with it as a
    release ships its tokenizer (so the run takes it by default: data/run_tokenizer.py); every parameter
    that starts constant (norm weights, biases, layer scales, BatchNorm affine) is perturbed, so none is an
    identity that would hide a mistake."""
    from transformers import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    cfg = NemotronH_Omni_Reasoning_V3_Config(
        vision_config=dict(VISION), audio_config=dict(AUDIO),
        text_config=dict(configs.TINY_DENSE, vocab_size=tok.vocab_size),  # not a multiple of 128: padded rows
        vision_hidden_size=VISION["hidden_size"], downsample_ratio=0.5, projector_hidden_size=72,
        image_token_id=tok.special[OMNI.media["image"].context],
        audio_token_id=tok.special[OMNI.media["audio"].context], **config)
    torch.manual_seed(0)
    model = NemotronH_Omni_Reasoning_V3(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # unit gain instead of std 0.02, so the media reach the predictions measurably
                p.normal_(0.0, p[0].numel() ** -0.5 if p.shape[0] > 1 else 0.5)
            elif p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(0.2 * torch.randn_like(p))
        model.language_model.lm_head.weight.mul_(4.0)  # confident predictions: the loss moves with the logits
    model.save_pretrained(str(directory))
    shutil.copyfile(tok.path, Path(directory) / "tokenizer.model")


def _configs(ckpt: str, data_path: str, video_pruning: float = 0.0):
    from tessera.hetero.runspec.config import DataConfig, ModelConfig

    return ModelConfig(checkpoint=ckpt, video_pruning=video_pruning), DataConfig(
        path=data_path, seq_length=SEQ, rows_per_microbatch=ROWS, microbatches=1, seed=LOADER_SEED,
        video_frames=VIDEO_FRAMES)


def _first_step(ckpt: str, data_path: str, run_dir: str, export: str, video_pruning: float = 0.0):
    """On every rank: one training step from the checkpoint in LAYOUT, then the HF export."""
    from tessera.hetero.runspec.config import OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    model, data = _configs(ckpt, data_path, video_pruning)
    trainer = TrainerConfig(max_steps=1, run_dir=run_dir, progress=False, tensorboard=False, export_hf=export)
    return train(model, data, OptimConfig(lr=1e-3), trainer, layout=LAYOUT, name="released_loss")


def _first_batch(model, data):
    """The trainer's first microbatch (hetero/training/step_parts.run_loader's arguments on the CPU), with the
    media of every row decoded (decode=None) instead of this rank's share."""
    from tessera.data.loader import close_loader
    from tessera.data.pipeline import build_train_loader
    from tessera.data.run_tokenizer import run_tokenizer
    from tessera.hetero.runspec.modules import encoder_names

    tok = run_tokenizer(data.tokenizer, model.checkpoint, data.path).path  # the release's, as the trainer takes
    loader = build_train_loader(data.path, tok, encoder_names(model), data.seq_length, data.rows_per_microbatch,
                                decode=None, num_workers=data.num_workers, seed=data.seed, max_tiles=data.max_tiles,
                                video_frames=data.video_frames, video_pruning=model.video_pruning, state=None,
                                defer_upscale=False)
    try:
        return next(iter(loader))
    finally:
        close_loader(loader)


def _documents(batch):
    """Every packed document of the microbatch: tokens, labels and its media items in order."""
    docs = []
    for r in range(batch.tokens.shape[0]):
        cu = batch.cu_seqlens[r].tolist()
        spans = {m: [] for m in batch.media_meta[r]}  # module -> [(first, last position, kind, item)]
        for m, meta in batch.media_meta[r].items():
            pos, k = batch.positions[r][m], 0
            for (kind, units, n, *chunks), (kind2, item) in zip(meta, batch.media[r][m], strict=True):
                # units: tiles, (the omni family's native resolution) one image's (rows, cols) patch grid, or a
                # clip's (frames, rows, cols); a clip in tubelet chunks has their ((start, count), ...)
                assert kind == kind2 and len(item[0] if kind == "video" else item) == (
                    units if isinstance(units, int) else units[0] if kind == "video" else 1)
                spans[m].append((int(pos[k]), int(pos[k + n - 1]), kind, item, chunks[0] if chunks else None))
                k += n
            assert k == len(pos)
        for j, key in enumerate(batch.keys[r]):
            a, b = cu[j], cu[j + 1]
            media = {m: [(kind, item) for lo, hi, kind, item, _ in s if a <= lo <= hi < b] for m, s in spans.items()}
            chunks = [tuple((c - a, n) for c, n in ch) for s in spans.values() for lo, hi, _, _, ch in s
                      if ch and a <= lo <= hi < b]
            docs.append(dict(key=key, tokens=batch.tokens[r, a:b], labels=batch.labels[r, a:b], chunks=chunks,
                             **media))
    assert sum(len(d.get(m, [])) for d in docs for m in ("vision", "audio")) == sum(
        len(v) for row in batch.media for v in row.values()), "a media item outside its document"
    return docs


def _oracle_inputs(doc, vcfg, audio_encoder) -> dict:
    """The forward's inputs; a clip's document gets the release's ids (its chunks widened to every tubelet's
    tokens) and the clip's frames, packed into tubelets as the video processor packs them."""
    from tessera.models.encoders import tokens_config

    videos = [item for kind, item in doc.get("vision", []) if kind == "video"]
    if not videos:
        return omni_forward_inputs(doc["tokens"], [item for _, item in doc.get("vision", [])],
                                   [item for _, item in doc.get("audio", [])], vcfg, audio_encoder, doc["key"])
    (frames, _), = videos  # a clip's document holds nothing else (module docstring)
    (chunks,) = doc["chunks"]
    per_tubelet = tokens_config(vcfg).grid_tokens(frames.shape[-2] // vcfg.patch, frames.shape[-1] // vcfg.patch)
    tokens = release_video_tokens(doc["tokens"], chunks, per_tubelet)
    inputs = omni_forward_inputs(tokens, [], [], vcfg, audio_encoder, doc["key"])
    return {**inputs, "pixel_values_videos": release_video_pixels(frames, vcfg)}


def oracle_loss(ckpt: str, batch) -> tuple[float, int, dict]:
    """(loss, target tokens, documents per kind) of transformers' Omni model on the microbatch."""
    from transformers import NemotronH_Omni_Reasoning_V3

    from tessera.models.encoders import encoder_config, family_of
    from tessera.models.released import encoder_name

    model = NemotronH_Omni_Reasoning_V3.from_pretrained(ckpt, dtype=torch.float32).eval()
    for m in model.modules():  # a training step: BatchNorm with the clip's own statistics (module docstring)
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.train()
    vcfg, acfg = encoder_config(encoder_name(ckpt, "vision")), encoder_config(encoder_name(ckpt, "audio"))
    audio_encoder = family_of(acfg).preprocessor(acfg)  # the encoder's mel front end
    total, count, kinds = torch.zeros((), dtype=torch.float64), 0, {}
    with torch.no_grad():
        for doc in _documents(batch):
            kind = "video" if doc["chunks"] else _kind(doc["key"])
            kinds[kind] = kinds.get(kind, 0) + 1
            logits = model(**_oracle_inputs(doc, vcfg, audio_encoder)).logits[0]
            assert logits.shape == (len(doc["tokens"]), model.config.text_config.vocab_size)
            labels = doc["labels"]
            total += torch.nn.functional.cross_entropy(logits.double(), labels, ignore_index=-100, reduction="sum")
            count += int((labels != -100).sum())
    return float(total / count), count, kinds


@pytest.mark.multiproc
@pytest.mark.parametrize("config_layout", ["transformers", "hub"])
def test_first_step_loss_equals_transformers_omni(tmp_path, config_layout):
    """(and the trained model's export loads in transformers as the release does); config.json in transformers'
    layout or as the hub ships it (scripts/tiny_release.hub_layout: transformers' class, called directly, remaps
    the legacy names itself)"""
    from tessera.hetero.tools.spawn import run_on_ranks
    from tessera.hetero.training.metrics import read_metrics
    from tessera.scripts.tiny_release import hub_layout

    data_path, ckpt = tmp_path / "data", tmp_path / "released"
    _checkpoint(ckpt, _dataset(data_path))
    if config_layout == "hub":
        hub_layout(ckpt)
    out = tmp_path / "export"
    run_on_ranks(4, _first_step, str(ckpt), str(data_path), str(tmp_path / "run"), str(out), timeout=300)
    (record,) = read_metrics(tmp_path / "run")

    batch = _first_batch(*_configs(str(ckpt), str(data_path)))
    frames = [len(item) // 160 for row in batch.media for _, item in row.get("audio", [])]
    assert any(n % 8 == 0 for n in frames), frames  # clips where the release keeps one more embedding
    ref, count, kinds = oracle_loss(str(ckpt), batch)
    # the rebuilt microbatch is the trainer's: same target-token count, and every kind of document is in it
    assert count == record["target_tokens"], (count, record["target_tokens"])
    assert set(kinds) == {"image", "audio", "chat"}, kinds
    err = abs(record["loss"] - ref) / abs(ref)
    print(f"\nfirst-step loss: tessera {record['loss']:.8f}  transformers {ref:.8f}  rel err {err:.2e}  "
          f"({count} target tokens, documents {kinds}, audio mel frames {frames})")
    assert err <= TOL

    # the export of the trained model is what transformers loads as it loads the release (the release's
    # config.json, the vocabulary padding stripped), every tensor as written, with the release's tokenizer the run
    # trained with (its saved config names it) and its generation defaults
    from safetensors.torch import load_file
    from transformers import NemotronH_Omni_Reasoning_V3

    for name in ("tokenizer.model", "generation_config.json"):
        assert (out / name).read_bytes() == (ckpt / name).read_bytes(), name

    before, after = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after) and any(not torch.equal(before[k], after[k]) for k in before)
    model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(str(out), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        again = load_file(f"{d}/model.safetensors")
    assert sorted(again) == sorted(after) and all(torch.equal(again[k], after[k]) for k in after)


def _settled_away_from_nominal(ckpt: str, batch) -> int:
    """Clips of the microbatch whose per-tubelet counts under transformers' own retention mask differ from the
    nominal counts the data side wrote (where the test would pass without settling, it must not count)."""
    from transformers import NemotronH_Omni_Reasoning_V3
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import compute_retention_mask

    from tessera.models.encoders import encoder_config
    from tessera.models.released import encoder_name

    model = NemotronH_Omni_Reasoning_V3.from_pretrained(ckpt, dtype=torch.float32).eval()
    vcfg, moved = encoder_config(encoder_name(ckpt, "vision")), 0
    with torch.no_grad():
        for doc in _documents(batch):
            for (kind, (frames, _)), chunks in zip(doc.get("vision", []), doc["chunks"]):
                pixels = release_video_pixels(frames, vcfg)  # [1, T, 2C, H, W]
                (video,) = model.get_video_features(pixels).pooler_output  # [T * P, d]
                keep = compute_retention_mask(video, pixels.shape[1], model.config.video_pruning_rate)
                moved += keep.view(pixels.shape[1], -1).sum(-1).tolist() != [n for _, n in chunks]
    return moved


@pytest.mark.multiproc
def test_first_step_loss_with_pruned_video_equals_transformers_omni(tmp_path):
    """EVS: the trainer settles each clip's tubelet chunks at the boundary (hetero/runtime/tubelet_settle.py) to
    the release's layout, in the same heterogeneous layout; the loss is transformers' on the release's ids."""
    from tessera.hetero.tools.spawn import run_on_ranks
    from tessera.hetero.training.metrics import read_metrics

    data_path, ckpt, rate = tmp_path / "data", tmp_path / "released", 0.5
    _checkpoint(ckpt, _dataset(data_path, _video_records()), video_pruning_rate=rate)
    run_on_ranks(4, _first_step, str(ckpt), str(data_path), str(tmp_path / "run"), "", rate, timeout=300)
    (record,) = read_metrics(tmp_path / "run")

    batch = _first_batch(*_configs(str(ckpt), str(data_path), rate))
    assert _settled_away_from_nominal(str(ckpt), batch) > 0, "every clip kept its nominal counts: no bite"
    ref, count, kinds = oracle_loss(str(ckpt), batch)
    assert count == record["target_tokens"], (count, record["target_tokens"])
    err = abs(record["loss"] - ref) / abs(ref)
    print(f"\nfirst-step loss with EVS: tessera {record['loss']:.8f}  transformers {ref:.8f}  rel err {err:.2e}  "
          f"({count} target tokens, {kinds})")
    assert err <= TOL_EVS
