"""Validation from the user's data (issue 47 item 4): data.val_path=auto (the tiny recipes') validates on the
dataset's own val split (`prepare_data.py --val-ratio` writes one), on none without one, and on the held-out synthetic
set only when the training data is synthetic.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_val_split.py -x -q
"""

from __future__ import annotations

import pytest

from tessera.data.loader import ChatTaskEncoder, build_loader
from tessera.data.pipeline import AUTO_VAL, SYNTHETIC_VAL, has_val_split, split_of, val_sets
from tessera.data.tokens import EncoderTokens, Tokenizer
from tessera.hetero.training.validation import describe_val_sets
from tessera.scripts import prepare_data


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("val")
    assert prepare_data.main(["--synthetic", "--samples", "16", "--shard-size", "4", "--val-ratio", "0.25",
                              "--out", str(root / "held")]) == 0
    assert prepare_data.main(["--synthetic", "--samples", "8", "--shard-size", "4", "--out", str(root / "all")]) == 0
    return root


def _keys(path, split):
    te = ChatTaskEncoder(Tokenizer(path / "tokenizer.model"), 512, EncoderTokens(patch=64))
    return {k for b in build_loader(path, te, 2, repeat=False, shuffle_buffer=None, split=split)
            for row in b.keys for k in row}


def test_val_ratio_holds_out_whole_shards_that_auto_validates_on(sets):
    held = sets / "held"
    assert has_val_split(held) and not has_val_split(sets / "all")
    got = val_sets(AUTO_VAL, str(held))
    assert got == {"val": str(held)} and split_of(got["val"]) == "val"
    train, val = _keys(held, "train"), _keys(held, split_of(got["val"]))
    assert len(val) == 4 and len(train) == 12 and not train & val  # the last shard of four, held out
    assert describe_val_sets(AUTO_VAL, str(held), got) == f"validation sets: val = {held} (its val split)"


def test_auto_is_synthetic_only_for_synthetic_training_data(sets):
    assert val_sets(AUTO_VAL, None) == {SYNTHETIC_VAL: SYNTHETIC_VAL}
    assert val_sets(AUTO_VAL, str(sets / "all")) == {}  # the user's data without a val split: no synthetic media
    assert "has no val split" in describe_val_sets(AUTO_VAL, str(sets / "all"), {})
    assert split_of(val_sets(str(sets / "all"))["all"]) == "train"  # an explicit val set is read as it trains


def test_a_blend_with_a_val_split_validates_on_it(sets, tmp_path):
    blend = tmp_path / "blend.yaml"
    blend.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    path: "
                     f"{sets / 'all'}\n  val:\n    path: {sets / 'held'}\n")
    assert split_of(val_sets(AUTO_VAL, str(blend))["val"]) == "val"
    blend.write_text(f"__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    path: {sets / 'all'}\n")
    assert val_sets(AUTO_VAL, str(blend)) == {}


def test_val_ratio_out_of_range_is_refused(tmp_path, capsys):
    assert prepare_data.main(["--synthetic", "--val-ratio", "1.5", "--out", str(tmp_path / "x")]) == 2
    assert "--val-ratio 1.5: give a share in [0, 1)" in capsys.readouterr().err


def test_synthetic_data_holds_only_the_models_media(tmp_path):
    """A VL model's synthetic set (training and held-out) has no audio, which it would skip as no_encoder (issue
    47: 31-36 skips every 5 steps); a model with every encoder keeps the set every earlier run used."""
    import json
    import tarfile

    from tessera.data.pipeline import synthetic_dataset, synthetic_kinds

    assert synthetic_kinds({"vision": "radio_vit_tiny"}) == ("image", "video", "chat")
    assert synthetic_kinds({"vision": "v", "audio": "a"}) == ("image", "video", "audio", "chat")
    vl, _ = synthetic_dataset(tmp_path, samples=12, seed=3, kinds=synthetic_kinds({"vision": "radio_vit_tiny"}))
    omni, _ = synthetic_dataset(tmp_path, samples=12, seed=3, kinds=synthetic_kinds({"vision": "v", "audio": "a"}))
    assert omni == synthetic_dataset(tmp_path, samples=12, seed=3)[0] != vl  # the full set: the same folder as before

    def kinds_in(path):
        got = []
        for shard in sorted(path.glob("*.tar")):
            with tarfile.open(shard) as tar:
                got += [it["kind"] for m in tar.getmembers() if m.name.endswith(".json")
                        for it in json.load(tar.extractfile(m))["media"]]
        return got

    assert kinds_in(vl) and "audio" not in kinds_in(vl) and {"image", "video"} <= set(kinds_in(vl))
    assert "audio" in kinds_in(omni)


def test_index_keeps_the_datasets_own_split(tmp_path):
    """`--index` on a dataset prepared without media metadata and with a val split: the metadata is added, energon's
    dataset.yaml and split.yaml stay (no --force-overwrite as one train split), and both splits load."""
    from tessera.data.media_meta import PART_FILTER, has_facts
    from tessera.data.prepare import make_synthetic, shard_media

    root = tmp_path / "old"
    make_synthetic(root, samples=16, seed=4, shard_size=4, media_meta=False, val_ratio=0.25)
    split = (root / ".nv-meta" / "split.yaml").read_text()
    before = {s: _keys(root, s) for s in ("train", "val")}
    assert prepare_data.main(["--index", "--out", str(root)]) == 0
    assert (root / ".nv-meta" / "split.yaml").read_text() == split and has_val_split(root)
    assert PART_FILTER in (root / ".nv-meta" / "dataset.yaml").read_text()
    assert {s: _keys(root, s) for s in ("train", "val")} == before and len(before["val"]) == 4
    import json
    import tarfile

    with tarfile.open(sorted(root.glob("*.tar"))[0]) as tar:
        entries = [it for m in tar.getmembers() if m.name.endswith(".json")
                   for it in json.load(tar.extractfile(m))["media"]]
    assert entries and all(has_facts(it) for it in entries) and shard_media(root)


def test_the_stored_media_facts_at_their_edges():
    """data/media_meta.py: an item whose header cannot be read is kept with its counted reason (undecodable_<kind>
    when the probe names none), and raised again as that MediaError; an entry has facts only with its byte length
    and a probe or an error (an index written before the facts had neither)."""
    from tessera.data.media import MediaError
    from tessera.data.media_meta import facts_of, has_facts, item_entry

    entry = item_entry("image", "img0.jpg", b"not an image")
    assert (entry["bytes"], entry["error"]["reason"]) == (12, "undecodable_image") and "probe" not in entry
    with pytest.raises(MediaError, match="undecodable image header") as e:
        facts_of(entry)
    assert e.value.reason == "undecodable_image" and has_facts(entry)
    assert has_facts({"bytes": 3, "probe": {"width": 1, "height": 1}})
    assert not has_facts({"kind": "image", "field": "img0.jpg", "probe": {"width": 1, "height": 1}})
    assert not has_facts({"bytes": 3})


def test_val_ratio_never_empties_train(tmp_path, capsys):
    """Issue 62 item 1, the user's command: ten images in a messages JSONL at --val-ratio 0.2 made one shard of the
    default 16, which energon's split gave to val (train: [], then EmptyDatasetError on every rank). The shard is
    cut into five, the last held out; the summary says so per split; both splits load, disjoint."""
    import json

    from PIL import Image

    from tessera.data.prepare_split import split_counts

    src = tmp_path / "mine"
    src.mkdir()
    with open(src / "messages.jsonl", "w") as f:
        for i in range(10):
            Image.new("RGB", (64 + 8 * i, 48), (25 * i, 90, 200)).save(src / f"img{i}.png")
            f.write(json.dumps({"messages": [
                {"role": "user", "content": [{"type": "image", "path": f"img{i}.png"},
                                             {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": f"A rectangle, number {i}."}]}) + "\n")
    out = tmp_path / "ds"
    assert prepare_data.main(["--manifest", str(src / "messages.jsonl"), "--val-ratio", "0.2", "--out", str(out)]) == 0
    got = capsys.readouterr()
    assert ("--val-ratio 0.2: 10 samples made 1 shard, and a split of whole shards needs two; rewrote them as 5 "
            "shards of up to 2 samples (set --shard-size to choose)") in got.err
    assert "[prepare] splits: train 4 shards 8 samples, val 1 shard 2 samples" in got.out
    assert split_counts(out) == {"train": (4, 8), "val": (1, 2)}
    train, val = _keys(out, "train"), _keys(out, "val")
    assert len(train) == 8 and len(val) == 2 and not train & val


def test_val_ratio_with_one_sample_is_refused_naming_the_numbers(tmp_path, capsys):
    assert prepare_data.main(["--synthetic", "--samples", "1", "--val-ratio", "0.2", "--out", str(tmp_path)]) == 2
    assert ("--val-ratio 0.2 holds out whole shards, and " + str(tmp_path) + " has 1 sample(s): a train and a val "
            "split need at least 2; add samples or drop --val-ratio") in capsys.readouterr().err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        prepare_data.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "samples per tar shard (default: 16)" in text and "(default: 0.0)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_prelaunch_refuses_an_empty_train_split(sets, tmp_path):
    """A dataset whose train split is empty (as prepare wrote it before, or `energon prepare` with no train share)
    is refused before launch, naming it and the fix."""
    import shutil

    from tessera.hetero.runspec.config import DataConfig
    from tessera.recipes.prelaunch import check_data

    ds = tmp_path / "held"
    shutil.copytree(sets / "held", ds)
    split = ds / ".nv-meta" / "split.yaml"
    split.write_text("split_parts:\n  train: []\n  val:\n  - shard-{000000..000003}.tar\n  test: []\nexclude: []\n")
    with pytest.raises(ValueError) as e:
        check_data(DataConfig(path=str(ds)))
    assert str(e.value).startswith(f"data.path={ds} has no shard in its train split ({split}: its shards are in "
                                   f"val); re-run scripts/prepare_data.py into an empty --out")
    check_data(DataConfig(path=str(sets / "held")))  # the same dataset as prepare wrote it passes
