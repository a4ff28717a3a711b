"""Issue 5 "done when": prepare_data.py --synthetic + the loader feed a tiny multimodal model end to end on
CPU, with placeholder sizes from the same encoder configs the model is built from; plus the training-loop
helpers of data/pipeline.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_data_end_to_end.py -x -q
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from _mcore_cpu import single_rank_world

import tessera.data.pipeline as pipeline
from tessera.data.loader import close_loader
from tessera.data.packing import IGNORE
from tessera.data.pipeline import build_train_loader, encoder_tokens, synthetic_dataset
from tessera.data.tokens import MODULE_OF_KIND
from tessera.models import configs
from tessera.models.encoders import encoder_config, tokens_config

ROOT = Path(__file__).resolve().parents[1]
ENCODERS = {"vision": "radio_vit_tiny", "audio": "fastconformer_tiny"}
SEQ, ROWS, STEPS, SAMPLES = 256, 2, 8, 32


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """scripts/prepare_data.py --synthetic run as a user would, its report checked against the shards."""
    out = tmp_path_factory.mktemp("e2e") / "ds"
    res = subprocess.run([sys.executable, "scripts/prepare_data.py", "--synthetic", "--out", str(out),
                          "--samples", str(SAMPLES), "--shard-size", "8"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(l for l in res.stdout.splitlines() if l.startswith("[prepare] wrote"))
    m = re.fullmatch(r"\[prepare\] wrote (\d+) samples in (\d+) shards in (\S+) "
                     r"\(image=(\d+) video=(\d+) audio=(\d+)\); skipped 0; tokenizer (\S+) .*", line)
    assert m, line
    counts, keys = Counter(), set()
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tf:
            for name in tf.getnames():
                key, field = name.split(".", 1)
                keys.add(key)
                counts[{"img": "image", "vid": "video", "aud": "audio"}.get(field[:3], "other")] += 1
    assert (int(m[1]), int(m[2]), m[3]) == (SAMPLES, len(list(out.glob("shard-*.tar"))), str(out)) == (len(keys), 4, str(out))
    assert (int(m[4]), int(m[5]), int(m[6])) == (counts["image"], counts["video"], counts["audio"])
    assert (out / ".nv-meta" / "index.sqlite").exists() and (out / "tokenizer.model").exists()
    assert m[7] == str(out / "tokenizer.model")
    return out


def _model(vocab: int):
    from tessera.models.hybrid_llm import HybridLM
    from tessera.models.multimodal import MultimodalModel, build_media_module
    from tessera.models.nemotron_h_hf import hybrid_config_from_hf

    pg = single_rank_world()
    torch.manual_seed(0)
    cfg = dict(configs.TINY_DENSE, vocab_size=vocab)
    llm = HybridLM(hybrid_config_from_hf(cfg), pg)
    from tessera.models.encoders import video_temporal  # the omni family's video in tubelets, as the trainer builds it

    tubelets = {"vision": video_temporal(ENCODERS) > 1}
    return MultimodalModel(llm, {m: build_media_module(name, cfg["hidden_size"], pg, tubelets=tubelets.get(m, False))
                                 for m, name in ENCODERS.items()})


def _loss(model, b):
    per_token = model(b.tokens, b.media, b.positions, labels=b.labels, keys=[",".join(k) for k in b.keys])
    return per_token.sum() / (b.labels != IGNORE).sum()


def test_prepared_data_trains_a_tiny_multimodal_model(prepared):
    import sentencepiece as spm

    vocab = -(-spm.SentencePieceProcessor(model_file=str(prepared / "tokenizer.model")).get_piece_size() // 64) * 64
    enc = encoder_tokens(ENCODERS)  # the placeholder arithmetic comes from the registry configs
    v, a = tokens_config(encoder_config(ENCODERS["vision"])), tokens_config(encoder_config(ENCODERS["audio"]))
    assert (enc.tile, enc.patch, enc.pixel_shuffle, enc.max_tiles, enc.video_frames) == (v.tile, v.patch, v.pixel_shuffle, 2, 4)
    assert (enc.audio_hop, enc.audio_n_fft, enc.audio_subsampling) == (a.audio_hop, a.audio_n_fft, a.audio_subsampling)

    loader = build_train_loader(prepared, prepared / "tokenizer.model", ENCODERS, SEQ, ROWS, decode=None, seed=1)
    batches = []
    for b in loader:
        batches.append(b)
        if len(batches) == STEPS:
            break
    close_loader(loader)

    model = _model(vocab).train()
    count = lambda kind, item: model.media[MODULE_OF_KIND[kind]].num_tokens(kind, item)  # noqa: E731
    kinds = Counter(k for b in batches for row in b.media for items in row.values() for k, _ in items)
    assert set(kinds) == {"image", "video", "audio"}, kinds  # real batches with every modality
    for b in batches:
        b.check(count)  # per row and module: embeddings the encoders will produce == placeholder positions
        assert b.tokens.shape == (ROWS, SEQ) and int(b.tokens.max()) < vocab

    opt = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    with torch.no_grad():
        before = _loss(model, batches[0]).item()
    losses = []
    for b in batches:  # scatter_media raises if any count disagrees, so each step re-checks alignment
        loss = _loss(model, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        after = _loss(model, batches[0]).item()
    print(f"\nsteps {', '.join(f'{x:.3f}' for x in losses)}; batch 0 {before:.3f} -> {after:.3f}")
    assert all(np.isfinite(losses)), losses
    assert after < 0.9 * before, (before, after, losses)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses


def test_decode_plan_limits_decoding_to_the_ranks_rows(prepared):
    """build_train_loader passes the rank's decode plan through: same global batch, only its rows decoded."""
    args = (prepared, prepared / "tokenizer.model", ENCODERS, SEQ, ROWS)
    full_loader = build_train_loader(*args, decode=None, seed=4)
    part_loader = build_train_loader(*args, decode={"vision": range(1, 2)}, seed=4)
    full, part = next(iter(full_loader)), next(iter(part_loader))
    close_loader(full_loader)
    close_loader(part_loader)
    assert full.keys == part.keys and torch.equal(full.tokens, part.tokens) and full.media_meta == part.media_meta
    assert part.media[0] == {} and set(part.media[1]) == {"vision"} & set(full.media[1])
    for (ka, xa), (kb, xb) in zip(full.media[1].get("vision", []), part.media[1].get("vision", [])):
        assert ka == kb and np.array_equal(xa[0] if ka == "video" else xa, xb[0] if kb == "video" else xb)


def test_encoder_modality_must_match_module():
    with pytest.raises(ValueError, match="fastconformer_tiny.*audio encoder, not a 'vision'"):
        encoder_tokens({"vision": "fastconformer_tiny"})


def test_synthetic_dataset_is_built_once_and_a_losing_racer_keeps_the_winner(tmp_path, monkeypatch):
    path, tok = synthetic_dataset(tmp_path, samples=8, seed=3)
    assert path.parent == tmp_path and path.name.startswith("synthetic-8-3-")  # + the special tokens' digest
    assert tok == path / "tokenizer.model" and tok.exists()
    assert len(list(path.glob("shard-*.tar"))) == 1 and (path / ".nv-meta" / "index.sqlite").exists()
    stamp = (path / ".nv-meta" / "index.sqlite").stat().st_mtime_ns

    import tessera.scripts.prepare_data as prep

    def must_not_run(*a, **k):
        raise AssertionError("the data set was generated again")

    monkeypatch.setattr(prep, "make_synthetic", must_not_run)
    assert synthetic_dataset(tmp_path, samples=8, seed=3) == (path, tok)  # idempotent: nothing regenerated

    # A rank that checked before the winner's rename finished: it builds its own copy, loses the rename
    # race, and must return the winner's set untouched and remove its own copy.
    checks = iter([False])
    monkeypatch.setattr(pipeline, "_complete", lambda p: next(checks, True))
    monkeypatch.setattr(prep, "make_synthetic", lambda out, **k: (out / "loser.txt").write_text("x"))
    assert synthetic_dataset(tmp_path, samples=8, seed=3) == (path, tok)
    assert not (path / "loser.txt").exists() and (path / ".nv-meta" / "index.sqlite").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary folder left behind


def test_samples_for_a_missing_encoder_are_skipped_and_counted(prepared):
    """A vision-only model never sees audio placeholders: such samples are skipped as no_encoder."""
    loader = build_train_loader(prepared, prepared / "tokenizer.model", {"vision": "radio_vit_tiny"}, SEQ, ROWS,
                                decode=None, seed=4)
    skipped, batches = Counter(), []
    for b, _ in zip(loader, range(4)):
        batches.append(b)
        skipped.update(b.skipped)
    close_loader(loader)
    assert all(set(row) <= {"vision"} for b in batches for row in b.positions)
    assert skipped["no_encoder"] > 0


@pytest.mark.parametrize("rate", [0.0, 0.25, 0.5])
def test_video_placeholders_follow_the_encoders_pruning(rate):
    from tessera.models.media_tokens import evs_kept_tokens

    tokens = encoder_tokens({"vision": "radio_vit_tiny"}, video_frames=4, video_pruning=rate)
    for frames in (1, 3, 4):
        assert tokens.video_tokens(frames) == evs_kept_tokens(frames, tokens.tokens_per_tile, rate)
