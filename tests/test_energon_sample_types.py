"""Datasets prepared with energon's own `energon prepare` train as they are (issue 47 item 3, data/sample_types.py):
each standard sample type gives exactly the ids, loss mask and media of the same conversation written in the project's
schema; a sample type without a conversation is refused before launch naming the supported ones; a blend of an
energon CaptioningSample set and a prepare_data set trains in a heterogeneous layout on gloo ranks.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_energon_sample_types.py -x -q
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from _energon_sets import energon_set, jpeg

from tessera.data.loader import ChatTaskEncoder, build_loader
from tessera.data.formats import PROMPTS
from tessera.data.prepare import energon_prepare, synth_video, write_shards
from tessera.data.sample_types import UnsupportedSampleType, check_sample_types
from tessera.data.tokens import EncoderTokens, Tokenizer, train_sentencepiece

ENC = EncoderTokens(patch=64)  # 16 tokens per tile keeps rows small; the arithmetic is the same
SEQ, ROWS, N = 384, 2, 8


def _images(n: int, seed: int) -> list[tuple[bytes, str]]:
    rng = random.Random(seed)
    return [jpeg(rng) for _ in range(n)]


def _cases() -> dict:
    """sample type -> (energon members per sample, field map, the same sample as (conversation, [(kind, ext, bytes)]))"""
    imgs, rng = _images(N, 5), random.Random(6)
    vids = [synth_video(rng) for _ in range(N)]
    cases = {}
    rows = []
    for i, (img, text) in enumerate(imgs):
        rows.append(({"jpg": img, "txt": text},
                     [{"role": "user", "content": PROMPTS["image"]}, {"role": "assistant", "content": text}],
                     [("image", "jpg", img)]))
    cases["CaptioningSample"] = (rows, {"image": "jpg", "caption": "txt"}, None)
    rows = [(m, [{"role": "user", "content": "<image>\nWhat shape is it?"}, *conv[1:]], media)
            for m, conv, media in cases["CaptioningSample"][0]]
    cases["CaptioningSample+prompt"] = (rows, {"image": "jpg", "caption": "txt"}, "What shape is it?")
    rows = []
    for i, (img, text) in enumerate(imgs):
        q = {"question": f"Question {i}: which colours?", "answers": ["no idea", text], "weights": [0.25, 0.75]}
        rows.append(({"jpg": img, "json": json.dumps(q)},
                     [{"role": "user", "content": f"<image>\n{q['question']}"},
                      {"role": "assistant", "content": text}], [("image", "jpg", img)]))
    cases["VQASample"] = (rows, {"image": "jpg", "context": "json[question]", "answers": "json[answers]",
                                 "answer_weights": "json[weights]"}, None)
    rows = []
    for i, (img, text) in enumerate(imgs):
        q = {"q": f"Which caption fits <image> best? ({i})", "choices": ["A cat.", text, "Nothing."], "right": 1}
        rows.append(({"jpg": img, "json": json.dumps(q)},
                     [{"role": "user", "content": f"{q['q']}\nA. A cat.\nB. {text}\nC. Nothing."},
                      {"role": "assistant", "content": f"B. {text}"}], [("image", "jpg", img)]))
    cases["MultiChoiceVQASample"] = (rows, {"image": "jpg", "context": "json[q]", "choices": "json[choices]",
                                            "correct_choice_idx": "json[right]"}, None)
    rows = []
    for i, (vid, _, text) in enumerate(vids):
        rows.append(({"mp4": vid, "json": json.dumps({"q": "What happens?", "a": [text]})},
                     [{"role": "user", "content": "<video>\nWhat happens?"}, {"role": "assistant", "content": text}],
                     [("video", "mp4", vid)]))
    cases["VidQASample"] = (rows, {"video": "mp4", "context": "json[q]", "answers": "json[a]"}, None)
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    texts = [t["content"] for rows, _, _ in CASES.values() for _, conv, _ in rows for t in conv]
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    train_sentencepiece(texts * 4 + ["user\n", "assistant\n", "system\n"], prefix, vocab_size=400)
    return Tokenizer(prefix.with_suffix(".model"))


def _batches(path: Path, tok: Tokenizer, caption_prompt=None) -> list:
    te = ChatTaskEncoder(tok, SEQ, ENC, caption_prompt=caption_prompt, modules={"vision"})
    return list(build_loader(path, te, ROWS, repeat=False, shuffle_buffer=None))


@pytest.mark.parametrize("case", list(CASES))
def test_sample_type_gives_the_ids_mask_and_media_of_the_same_conversation(case, tok, tmp_path):
    rows, field_map, prompt = CASES[case]
    sample_type = case.partition("+")[0]
    theirs = energon_set(tmp_path / "energon", [{"__key__": f"s{i:03d}", **m} for i, (m, _, _) in enumerate(rows)],
                         sample_type, field_map)
    assert check_sample_types(theirs) == {str(theirs): sample_type}
    _assert_same_batches(theirs, rows, tok, prompt, tmp_path)


INTERLEAVED_LOADER = """
def sample_loader(raw: dict) -> dict:
    return dict(__sources__=raw["__sources__"], sequence=["Here: ", raw["jpg"], " " + raw["txt"], raw["png"], "."])

def part_filter(part: str) -> bool:
    return part in ("jpg", "png", "txt")
"""


def test_interleaved_samples_from_a_sample_loader_are_one_document(tok, tmp_path):
    """InterleavedSample through the user's own sample_loader.py (what `energon prepare` writes for it): its texts
    and images in order, as one assistant turn, exactly as that conversation in the project's schema."""
    imgs = _images(8, 13)
    rows = [({"jpg": a, "txt": text, "png": b},
             [{"role": "assistant", "content": f"Here: <image> {text}<image>."}], [("image", "jpg", a), ("image", "png", b)])
            for (a, text), (b, _) in zip(imgs[:4], imgs[4:])]
    theirs = energon_set(tmp_path / "energon", [{"__key__": f"s{i:03d}", **m} for i, (m, _, _) in enumerate(rows)],
                         "InterleavedSample", None)
    (theirs / ".nv-meta" / "sample_loader.py").write_text(INTERLEAVED_LOADER)
    _assert_same_batches(theirs, rows, tok, None, tmp_path)


def _assert_same_batches(theirs: Path, rows: list, tok: Tokenizer, prompt, tmp_path: Path) -> None:
    """The batches of `theirs` (an energon typed set of `rows`) == those of the rows' conversations in the project's
    schema, written by prepare (data/prepare.write_shards): ids, labels (the loss mask), media meta and pixels."""
    keys = [f"s{i:03d}" for i in range(len(rows))]
    ours = tmp_path / "ours"
    write_shards(iter([(k, conv, media) for k, (_, conv, media) in zip(keys, rows)]), ours, shard_size=4)
    energon_prepare(ours, media_meta=True)
    got, want = _batches(theirs, tok, prompt), _batches(ours, tok)
    assert len(got) == len(want) > 0 and sum(len(k) for b in got for k in b.keys) == len(rows)
    for a, b in zip(got, want):
        assert a.keys == b.keys and a.skipped == b.skipped == {}
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
        assert a.media_meta == b.media_meta
        for x, y in zip(a.media, b.media):
            assert x.keys() == y.keys() == {"vision"}
            for (ka, va), (kb, vb) in zip(x["vision"], y["vision"]):
                va, vb = (va[0], vb[0]) if isinstance(va, tuple) else (va, vb)
                assert ka == kb and torch.equal(torch.as_tensor(va), torch.as_tensor(vb))


def test_unusable_typed_samples_are_skipped_and_counted(tok, tmp_path):
    """A VQASample without answers (a test split) has nothing to learn: skipped by reason, the rest train."""
    (img, text), (img2, _) = _images(2, 9)
    samples = [{"__key__": "good", "jpg": img, "json": json.dumps({"q": "What?", "a": [text]})},
               {"__key__": "bad", "jpg": img2, "json": json.dumps({"q": "What?", "a": []})}]
    path = energon_set(tmp_path / "vqa", samples, "VQASample", {"image": "jpg", "context": "json[q]",
                                                                  "answers": "json[a]"})
    batches = _batches(path, tok)
    assert [k for b in batches for row in b.keys for k in row] == ["good"]
    assert sum((Counter(b.skipped) for b in batches), Counter()) == Counter({"unusable_sample": 1})


def test_a_sample_type_without_a_conversation_is_refused_before_launch(tok, tmp_path):
    from tessera.hetero.runspec.config import DataConfig
    from tessera.recipes.prelaunch import check_data

    (img, _), = _images(1, 11)
    path = energon_set(tmp_path / "classes", [{"__key__": "a", "jpg": img, "cls": "3"}], "ImageClassificationSample",
                       {"image": "jpg", "label": "cls"})
    good = energon_set(tmp_path / "captions", [{"__key__": "b", "jpg": img, "txt": "red"}], "CaptioningSample",
                       {"image": "jpg", "caption": "txt"})
    blend = tmp_path / "blend.yaml"
    blend.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
                     "      - weight: 1\n        path: captions\n      - weight: 1\n        path: classes\n")
    supported = r"CaptioningSample, VQASample, MultiChoiceVQASample, VidQASample, InterleavedSample"
    for given in (path, blend):
        with pytest.raises(ValueError, match=rf"data\.path={given}: {path} is ImageClassificationSample: .*{supported}"):
            check_data(DataConfig(path=str(given), tokenizer=str(tok.path)))
    with pytest.raises(UnsupportedSampleType, match="ImageClassificationSample"):  # a direct loader user too
        build_loader(blend, ChatTaskEncoder(tok, SEQ, ENC), ROWS)
    assert check_sample_types(good) == {str(good): "CaptioningSample"}
    check_data(DataConfig(path=str(good), tokenizer=str(tok.path)))


# ---- a blend of an energon CaptioningSample set and a LLaVA set prepared by prepare_data, in a heterogeneous layout

HOMOGENEOUS, COLOCATED = "", "vision=dp4@0-3;language=tp2,dp2@0-3"  # COLOCATED: nemotron_vl_tiny's layout
STEPS = 2


def _train_blend(root: str) -> None:
    """Both layouts, one launch, from the same seeded weights (hetero/build/seeded_init.py)."""
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    for name, layout in (("homogeneous", HOMOGENEOUS), ("colocated", COLOCATED)):
        data = DataConfig(path=f"{root}/blend.yaml", tokenizer=f"{root}/ours/tokenizer.model", seq_length=256,
                          rows_per_microbatch=4, microbatches=2, caption_prompt="Describe the image.",
                          val_path="auto")  # the blend's val split: ours' held-out shard
        trainer = TrainerConfig(max_steps=STEPS, run_dir=f"{root}/{name}", progress=False, tensorboard=False)
        train(ModelConfig(vision="radio_vit_tiny"), data, OptimConfig(lr=1e-3, warmup_steps=1), trainer,
              layout=layout, name="blend")


@pytest.mark.multiproc
def test_blend_of_an_energon_set_and_a_prepared_llava_set_trains_in_a_heterogeneous_layout(tmp_path):
    from tessera.hetero.tools.spawn import run_on_ranks
    from tessera.hetero.training.metrics import read_metrics
    from tessera.hetero.runspec.config import DataConfig
    from tessera.recipes.prelaunch import check_data
    from tessera.scripts import prepare_data

    imgs = _images(24, 21)
    energon_set(tmp_path / "theirs", [{"__key__": f"t{i:03d}", "jpg": img, "txt": text}
                                      for i, (img, text) in enumerate(imgs[:12])],
                "CaptioningSample", {"image": "jpg", "caption": "txt"})
    folder = tmp_path / "llava"  # the user's other set: LLaVA's own JSON array, as its repository ships it
    folder.mkdir()
    records = []
    for i, (img, text) in enumerate(imgs[12:]):
        (folder / f"o{i:03d}.jpg").write_bytes(img)
        records.append({"id": f"o{i:03d}", "image": f"o{i:03d}.jpg", "conversations": [
            {"from": "human", "value": "<image>\nDescribe the image."}, {"from": "gpt", "value": text}]})
    (folder / "llava.json").write_text(json.dumps(records, indent=2))
    assert prepare_data.main(["--manifest", str(folder / "llava.json"), "--out", str(tmp_path / "ours"),
                              "--shard-size", "4", "--val-ratio", "0.3"]) == 0  # its last shard of three held out
    (tmp_path / "blend.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        "      - weight: 1\n        path: theirs\n      - weight: 1\n        path: ours\n  val:\n    path: ours\n")
    check_data(DataConfig(path=str(tmp_path / "blend.yaml"), tokenizer=str(tmp_path / "ours" / "tokenizer.model")))
    run_on_ranks(4, _train_blend, str(tmp_path), timeout=900)
    runs = {name: read_metrics(tmp_path / name) for name in ("homogeneous", "colocated")}
    for name, rows in runs.items():
        assert len(rows) == STEPS and all(r["loss"] > 0 for r in rows), (name, rows)
        assert not any(r.get("skipped_by_reason") for r in rows), (name, rows)
    for a, b in zip(runs["homogeneous"], runs["colocated"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    val = {name: read_metrics(tmp_path / name, "val") for name in runs}
    assert [r["step"] for r in val["colocated"]] == [STEPS] and set(val["colocated"][0]["val"]) == {"val"}
    loss_h, loss_c = (val[name][0]["val"]["val"]["loss"] for name in ("homogeneous", "colocated"))
    assert loss_c > 0 and abs(loss_h - loss_c) <= 1e-5 * loss_h, (loss_h, loss_c)


def test_index_leaves_an_energon_typed_dataset_alone(tmp_path, capsys):
    """`prepare_data --index` on a CaptioningSample set: refused by name (exit 2), its shards and .nv-meta untouched
    (it used to be re-prepared over as a CrudeWebdataset, which then had no JSON member to read)."""
    from tessera.scripts import prepare_data

    (img, text), = _images(1, 17)
    path = energon_set(tmp_path / "caps", [{"__key__": "a", "jpg": img, "txt": text}], "CaptioningSample",
                       {"image": "jpg", "caption": "txt"})
    before = {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    assert prepare_data.main(["--index", "--out", str(path)]) == 2
    assert "is a CaptioningSample dataset as `energon prepare` wrote it" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()} == before
