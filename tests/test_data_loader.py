"""The energon-backed loader end to end on real shards: alignment, blending, exact resume, bad input."""

import io
import json
import logging
from collections import Counter

import numpy as np
import pytest
from _blend import make_blend, take
import webdataset as wds
from PIL import Image

from tessera.data.loader import ChatTaskEncoder, SkipStats, build_loader, close_loader
from tessera.data.packing import IGNORE
from tessera.data.templates import TEMPLATES
from tessera.data.tokens import EncoderTokens, Tokenizer
from tessera.data.prepare import (FIELD_PREFIX, caption_chat, energon_prepare, synth_audio,
                                  synth_image, synth_video)

ENC = EncoderTokens(patch=64)  # 16 tokens per tile keeps rows small; the arithmetic is the same
SEQ, ROWS = 512, 2


def count_tokens(kind, item):
    units = item[0].shape[0] if kind == "video" else item.shape[0]
    return ENC.tokens(kind, units)


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    return make_blend(tmp_path_factory.mktemp("blend"), 24, 16)


def _encoder(root, strict=False):
    return ChatTaskEncoder(Tokenizer(root / "a" / "tokenizer.model"), SEQ, ENC, strict=strict)




def test_batches_are_aligned_packed_and_masked(blend):
    tok = Tokenizer(blend / "a" / "tokenizer.model")
    for b in take(build_loader(blend / "a", _encoder(blend), ROWS), 3):
        b.check(count_tokens)  # embeddings produced == positions to fill, per row and module
        assert b.tokens.shape == (ROWS, SEQ)
        for r in range(ROWS):
            cu = b.cu_seqlens[r].tolist()
            assert cu[0] == 0 and cu[-1] == SEQ and len(b.keys[r]) in (len(cu) - 1, len(cu) - 2)
            # No loss crosses a sample boundary, and every loss target is a real token of the same sample.
            for end in cu[1:]:
                assert b.labels[r, end - 1] == IGNORE
            tgt = b.labels[r] != IGNORE
            assert bool((b.labels[r, :-1][tgt[:-1]] == b.tokens[r, 1:][tgt[:-1]]).all())
            media_ids = {tok.special[t] for t in TEMPLATES["omni"].special_tokens}  # placeholders, wrappers
            assert not any(int(t) in media_ids for t in b.labels[r][tgt])


def test_blend_follows_weights(blend):
    keys = [k for b in take(build_loader(blend / "blend.yaml", _encoder(blend), ROWS), 28) for row in b.keys for k in row]
    share = Counter(k[0] for k in keys)
    assert len(keys) > 120  # enough samples for the share to be measured (videos: ~23 tokens a frame, timed labels)
    assert 0.65 < share["a"] / len(keys) < 0.85, share


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_gives_identical_batches(blend, workers):
    path = blend / "blend.yaml"
    straight = take(build_loader(path, _encoder(blend), ROWS, num_workers=workers, seed=7), 6)
    first = build_loader(path, _encoder(blend), ROWS, num_workers=workers, seed=7)
    head = take(first, 3, close=False)
    state = first.save_state_rank()
    close_loader(first)
    tail = take(build_loader(path, _encoder(blend), ROWS, num_workers=workers, seed=7, state=state), 3)
    for a, b in zip(straight, head + tail):
        assert a.keys == b.keys
        assert torch_equal(a.tokens, b.tokens) and torch_equal(a.labels, b.labels)
        for pa, pb in zip(a.positions, b.positions):
            assert pa.keys() == pb.keys() and all(np.array_equal(pa[m], pb[m]) for m in pa)
        for ma, mb in zip(a.media, b.media):
            for m in ma:
                for (ka, xa), (kb, xb) in zip(ma[m], mb[m]):
                    assert ka == kb and np.array_equal(xa[0] if ka == "video" else xa, xb[0] if kb == "video" else xb)


def test_resume_with_other_worker_count_is_a_clear_error(blend):
    """energon 7.4.1 restores only with the saved number of workers (SavableDatasetWrapper.restore_checkpoint
    asserts len(worker_states) == num_workers; the 0-worker path expects one FlexState)."""
    first = build_loader(blend / "a", _encoder(blend), ROWS, num_workers=1, seed=3)
    take(first, 2, close=False)
    state = first.save_state_rank()
    close_loader(first)
    for other in (0, 2):
        with pytest.raises(ValueError, match=f"saved with num_workers=1 but this loader has num_workers={other}"):
            build_loader(blend / "a", _encoder(blend), ROWS, num_workers=other, seed=3, state=state)


def torch_equal(a, b):
    return bool((a == b).all())


def _garbled_png():
    """Header and IEND intact, pixel data zeroed: passes every probe, fails only the full decode."""
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(0).randint(0, 255, (240, 320, 3), dtype=np.uint8)).save(buf, format="PNG")
    data = buf.getvalue()
    return data[:200] + bytes(500) + data[700:]


def _jpeg(w=320, h=240):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def bad(tmp_path_factory, blend):
    """One shard mixing good samples with one example of every failure the loader must survive."""
    import random

    root = tmp_path_factory.mktemp("bad")
    rng = random.Random(0)
    chat = lambda kind: json.dumps({"conversation": caption_chat(kind, "A caption."),  # noqa: E731
                                    "media": [{"kind": kind, "field": f"{FIELD_PREFIX[kind]}0.x"}]}).encode()
    two = [{"kind": "image", "field": "img0.jpg"}, {"kind": "image", "field": "img1.jpg"}]
    samples = [{"__key__": f"good{i}", "json": chat("image"), "img0.x": synth_image(rng)[0]} for i in range(4)]
    samples += [{"__key__": "goodv", "json": chat("video"), "vid0.x": synth_video(rng)[0]},
                {"__key__": "gooda", "json": chat("audio"), "aud0.x": synth_audio(rng)[0]}]
    samples += [
        {"__key__": "bad_json", "json": b'{"conversation": [trunc', "img0.x": _jpeg()},
        {"__key__": "bad_image", "json": chat("image"), "img0.x": b"\xff\xd8 definitely not a jpeg"},
        # Header intact, pixels cut: the probe's end-marker check catches it on every rank.
        {"__key__": "cut_image", "json": chat("image"), "img0.x": _jpeg()[:len(_jpeg()) * 2 // 3]},
        # Fails only the full decode, after packing placed it on every rank: blank-filled, kept, counted.
        {"__key__": "garbled_image", "json": chat("image"), "img0.x": _garbled_png()},
        {"__key__": "bad_video", "json": chat("video"), "vid0.x": b"\x00\x00\x00\x18ftypmp42 garbage"},
        {"__key__": "bad_audio", "json": chat("audio"), "aud0.x": b"RIFF\x10\x00\x00\x00WAVEjunk"},
        {"__key__": "no_member", "json": chat("audio")},
        {"__key__": "no_media", "json": json.dumps({"conversation": caption_chat("image", "x")}).encode()},
        {"__key__": "extra_media", "json": json.dumps({"conversation": caption_chat("image", "x"), "media": two}).encode(),
         "img0.jpg": _jpeg(), "img1.jpg": _jpeg()},
        {"__key__": "too_long", "json": json.dumps({"conversation": caption_chat("image", "word " * 900), "media": [
            {"kind": "image", "field": "img0.x"}]}).encode(), "img0.x": _jpeg()},
    ]
    with wds.TarWriter(str(root / "bad-000000.tar")) as sink:
        for s in samples:
            sink.write(s)
    energon_prepare(root)
    return root


EXPECTED_SKIPS = {"corrupt_member": 1, "undecodable_image": 2, "undecodable_image_blanked": 1, "undecodable_video": 1, "undecodable_audio": 1,
                  "missing_modality": 2, "extra_media": 1, "too_long": 1}


def test_bad_input_is_skipped_counted_and_logged(blend, bad, caplog):
    stats, keys = SkipStats(), []
    with caplog.at_level(logging.WARNING, logger="tessera.data"):
        for b in build_loader(bad, _encoder(blend), 1, repeat=False, shuffle_buffer=None):
            stats.add(b)
            b.check(count_tokens)
            keys += [k for row in b.keys for k in row]
    assert dict(stats) == EXPECTED_SKIPS
    assert sorted(keys) == sorted(["good0", "good1", "good2", "good3", "goodv", "gooda", "garbled_image"])
    assert "skipped sample: shard=bad-000000.tar key=bad_json reason=corrupt_member" in caplog.text
    assert "key=extra_media reason=extra_media: more media than placeholders" in caplog.text
    assert "key=garbled_image reason=undecodable_image_blanked" not in caplog.text
    assert "key=garbled_image reason=undecodable_image: undecodable image" in caplog.text
    assert "blank-filled to keep the packed alignment" in caplog.text


def test_strict_mode_raises_on_first_bad_sample(blend, bad):
    with pytest.raises(Exception, match="strict mode"):
        for _ in build_loader(bad, _encoder(blend, strict=True), 1, repeat=False, shuffle_buffer=None):
            pass
