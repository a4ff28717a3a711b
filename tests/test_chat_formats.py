"""The chat formats users already have, prepared by scripts/prepare_data.py (issue 47, items 1, 2, 5, bad input).

The same two conversations (a system turn, two user turns with two images and a clip of audio, two assistant
turns; then a video question) are written in every format: Tessera's own schema, LLaVA as a JSON array and as
JSONL, OpenAI / TRL messages with media parts holding paths and with string content + the row's media lists, a
Hugging Face save_to_disk dataset in TRL's VLM columns (`images` of Image features, `audio` an Audio feature,
`videos`, `messages`) and a parquet file in LLaVA's columns (`image`, `conversations`). Each must prepare into
exactly the samples of the own schema (conversation, media kinds and bytes), hence the same ids and loss mask;
and the ids are those of transformers' apply_chat_template with the release's chat template and tokenizer
(scripts/tiny_release.release_tokenizer), the media tags expanded as the released processor expands them.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from tessera.data.prepare import encode_mp4
from tessera.data.tokens import Tokenizer, encode_conversation
from tessera.scripts.prepare_data import main as prepare

SYSTEM = "You are a helpful assistant."
Q1, A1 = "\nWhat is in the picture?", "A red circle."
Q2A, Q2B, A2 = "And this one? ", " Listen too: ", "A blue square, and a steady tone."
QV, AV = "\nWhat happens?", "A grey square fades in."
OWN = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "<image>" + Q1},
        {"role": "assistant", "content": A1}, {"role": "user", "content": Q2A + "<image>" + Q2B + "<audio>"},
        {"role": "assistant", "content": A2}],
       [{"role": "user", "content": "<video>" + QV}, {"role": "assistant", "content": AV}]]
TOKENS = {"image": 3, "video": 4, "audio": 2}  # placeholder counts (the encoders' business, not the format's)


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("media")
    Image.new("RGB", (64, 48), (220, 40, 40)).save(d / "a.jpg")
    Image.new("RGB", (40, 72), (40, 70, 220)).save(d / "b.png")
    sf.write(d / "tone.wav", (0.3 * np.sin(np.arange(8000) / 5)).astype(np.float32), 16000)
    (d / "clip.mp4").write_bytes(encode_mp4((np.full((32, 48, 3), 30 * t, np.uint8) for t in range(4)), fps=4))
    return d


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _own(d):
    return _jsonl(d / "own.jsonl", [
        {"conversation": OWN[0], "media": [{"kind": "image", "path": "a.jpg"}, {"kind": "image", "path": "b.png"},
                                           {"kind": "audio", "path": "tone.wav"}]},
        {"conversation": OWN[1], "media": [{"kind": "video", "path": "clip.mp4"}]}])


def _llava_records():
    turns = lambda conv: [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[t["role"]],
                           "value": t["content"]} for t in conv]
    return [{"id": "first.1", "image": ["a.jpg", "b.png"], "audio": "tone.wav", "conversations": turns(OWN[0])},
            {"id": "second/2", "video": "clip.mp4", "conversations": turns(OWN[1])}]


def _messages(path_parts: bool) -> list[dict]:
    part = lambda kind, path: {"type": kind, kind: path} if path_parts else {"type": kind}
    text = lambda t: {"type": "text", "text": t}
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": [part("image", "a.jpg"), text(Q1)]},
             {"role": "assistant", "content": A1},
             {"role": "user", "content": [text(Q2A), part("image", "b.png"), text(Q2B), part("audio", "tone.wav")]},
             {"role": "assistant", "content": [text(A2)]}],
            [{"role": "user", "content": [part("video", "clip.mp4"), text(QV)]}, {"role": "assistant", "content": AV}]]


def _hf_trl(d: Path, media: Path) -> Path:
    """save_to_disk, TRL's VLM columns: images (Image features, bytes), audio (Audio feature), videos, messages."""
    import datasets

    msgs = _messages(path_parts=False)
    for conv in msgs:  # Arrow gives every part every key, as a loaded dataset has them
        for t in conv:
            t["content"] = ([{"type": p["type"], "text": p.get("text")} for p in t["content"]]
                            if isinstance(t["content"], list) else [{"type": "text", "text": t["content"]}])
    rows = {"images": [[{"bytes": (media / n).read_bytes(), "path": None} for n in ("a.jpg", "b.png")], []],
            "audio": [{"bytes": (media / "tone.wav").read_bytes(), "path": "tone.wav"}, None],
            "videos": [[], [str(media / "clip.mp4")]], "messages": msgs}
    ds = datasets.Dataset.from_dict(rows).cast_column("images", datasets.List(datasets.Image()))
    ds.cast_column("audio", datasets.Audio(decode=False)).save_to_disk(str(d / "trl"))
    return d / "trl"


def _hf_llava_parquet(d: Path, media: Path) -> Path:
    import datasets

    recs = _llava_records()
    rows = {"id": [r["id"] for r in recs], "conversations": [r["conversations"] for r in recs],
            "image": [[{"bytes": (media / n).read_bytes(), "path": n} for n in recs[0]["image"]], []],
            "audio": [{"bytes": None, "path": str(media / "tone.wav")}, None], "video": [None, str(media / "clip.mp4")]}
    ds = datasets.Dataset.from_dict(rows).cast_column("image", datasets.List(datasets.Image()))
    ds = ds.cast_column("audio", datasets.Audio(decode=False))
    (d / "llava_pq").mkdir()
    ds.to_parquet(str(d / "llava_pq" / "train-00000-of-00001.parquet"))
    return d / "llava_pq"


def _samples(out: Path) -> list[tuple[list, list]]:
    """(conversation, [(kind, bytes)]) of every prepared sample, in key order (the records' order)."""
    members = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members.update({m.name: tar.extractfile(m).read() for m in tar if m.isfile()})
    found = []
    for name in sorted(n for n in members if n.endswith(".json")):
        key, sample = name[:-5], json.loads(members[name])
        found.append((sample["conversation"], [(it["kind"], members[f"{key}.{it['field']}"]) for it in sample["media"]]))
    return found


def _encode(tok, conversation, items, template="omni"):
    kinds = [k for k, _ in items]
    return encode_conversation(tok, conversation, kinds, [TOKENS[k] for k in kinds], template)


@pytest.fixture(scope="module")
def prepared(media, tmp_path_factory):
    """Each format's source, prepared: {name: (output folder, exit status)}."""
    out = tmp_path_factory.mktemp("prepared")
    (media / "llava.json").write_text(json.dumps(_llava_records(), indent=2))  # pretty-printed, as LLaVA ships it
    sources = {
        "own": ["--manifest", _own(media)],
        "llava_json": ["--manifest", media / "llava.json"],
        "llava_jsonl": ["--manifest", _jsonl(media / "llava.jsonl", _llava_records())],
        "messages_paths": ["--manifest", _jsonl(media / "msgs.jsonl", [{"messages": m} for m in _messages(True)]),
                           "--workers", "2"],  # JSONL lines dealt to 2 workers
        "messages_lists": ["--manifest", _jsonl(media / "trl.jsonl", [
            {"messages": [dict(t, content="".join(p.get("text") or f"<{p['type']}>" for p in t["content"])
                               if isinstance(t["content"], list) else t["content"]) for t in m], **lists}
            for m, lists in zip(_messages(False), [{"images": ["a.jpg", "b.png"], "audios": ["tone.wav"]},
                                                   {"videos": ["clip.mp4"]}])])],
        "hf_trl_disk": ["--hf", _hf_trl(media, media), "--workers", "2"],
        "hf_llava_parquet": ["--hf", _hf_llava_parquet(media, media)],
    }
    return {name: (out / name, prepare([*map(str, args), "--out", str(out / name), "--shard-size", "1"]))
            for name, args in sources.items()}


@pytest.mark.parametrize("fmt", ["llava_json", "llava_jsonl", "messages_paths", "messages_lists", "hf_trl_disk",
                                 "hf_llava_parquet"])
def test_each_format_prepares_the_samples_of_the_own_schema(prepared, fmt):
    (own_dir, own_rc), (out, rc) = prepared["own"], prepared[fmt]
    assert own_rc == 0 and rc == 0
    own, theirs = _samples(own_dir), _samples(out)
    assert [c for c, _ in own] == OWN
    assert theirs == own  # conversations, media kinds in order, media bytes
    tok = Tokenizer(own_dir / "tokenizer.model")
    for (conv, items), (conv_o, items_o) in zip(theirs, own):
        mine, ref = _encode(tok, conv, items), _encode(tok, conv_o, items_o)
        assert np.array_equal(mine.tokens, ref.tokens) and np.array_equal(mine.target, ref.target)
        assert mine.spans == ref.spans
        # every assistant turn is a target, and nothing else: its text and closing <|im_end|>
        want = [i for t in conv if t["role"] == "assistant" for i in tok.encode(t["content"]) + [tok.special["<|im_end|>"]]]
        assert mine.tokens[mine.target].tolist() == want


def test_ids_are_the_release_chat_templates(prepared, tmp_path):
    """The prepared conversation's ids (omni template) against transformers' apply_chat_template with the release's
    tokenizer and chat template on the messages as the user wrote them, the media tags expanded as the released
    processor expands them (<img> <image>xN </img>, <so_start> <so_embedding>xN <so_end>). Video is left out: the
    processor's per-tubelet frame labels need the clip's frame times (tests/test_prompt_parity.py covers them)."""
    from transformers import AutoTokenizer

    from tessera.scripts.tiny_release import release_tokenizer

    release_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer(tmp_path / "tokenizer.json")
    conv, items = _samples(prepared["messages_paths"][0])[0]
    prompt = _encode(ours, conv, items)
    text = hf.apply_chat_template(_messages(path_parts=False)[0], tokenize=False)
    expanded = re.sub("<image>|<so_embedding>", lambda m: {
        "<image>": "<img>" + "<image>" * TOKENS["image"] + "</img>",
        "<so_embedding>": "<so_start>" + "<so_embedding>" * TOKENS["audio"] + "<so_end>"}[m.group()], text)
    assert prompt.tokens.tolist() == hf(expanded, add_special_tokens=False).input_ids
    want = [i for a in (A1, A2) for i in hf(a + "<|im_end|>", add_special_tokens=False).input_ids]
    assert prompt.tokens[prompt.target].tolist() == want


def test_unusable_records_are_counted_and_named(media, tmp_path, capsys):
    """Each unusable record is a counted skip naming file:line, the field and what was expected, never a bare
    KeyError/StopIteration; the good records around them are prepared."""
    good = _llava_records()[1]
    lines = [json.dumps(good), "{not json", json.dumps({"foo": 1}),
             json.dumps({"image": "a.jpg", "conversations": [{"from": "human", "value": "<image><image> Two?"},
                                                             {"from": "gpt", "value": "One."}]}),
             json.dumps({"image": "gone.jpg", "conversations": [{"from": "human", "value": "<image>"},
                                                                {"from": "gpt", "value": "Gone."}]}),
             json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": "https://x.org/a.jpg"}]},
                                      {"role": "assistant", "content": "Far."}]}),
             json.dumps({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}),
             json.dumps({"conversations": [{"from": "human", "value": "<video>" + QV}], "video": "clip.mp4"}),
             json.dumps({"image": "a.jpg", "caption": "A red circle."})]
    manifest = media / "mixed.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    assert prepare(["--manifest", str(manifest), "--out", str(tmp_path / "ds")]) == 0
    err, out = capsys.readouterr()[::-1]
    assert "format llava (4), messages (2), caption (1): wrote 2 samples" in out, out
    assert ("skipped 7 {'bad_json': 1, 'unknown_format': 1, 'placeholder_mismatch': 1, 'missing_media': 1, "
            "'url_media': 1, 'malformed_turn': 1, 'no_assistant_turn': 1}") in out, out
    for line, words in [(2, "bad_json"), (3, "formats tried: tessera, caption, llava, messages"),
                        (4, "'conversations': expected one <image> per image item: 2 placeholder(s) for 1"),
                        (5, f"an existing file: {media / 'gone.jpg'} does not exist"),
                        (6, "the URL https://x.org/a.jpg"), (7, "'messages[0].role': expected one of"),
                        (8, "no_assistant_turn")]:
        assert re.search(rf"skip {re.escape(str(manifest))}:{line}: .*{re.escape(words)}", err), (line, err)
    assert "Traceback" not in err and "StopIteration" not in err


def test_nothing_usable_exits_naming_the_format_and_first_reasons(media, tmp_path, capsys):
    bad = {"image": ["a.jpg", "b.png"], "conversations": [{"from": "human", "value": "<image>"},
                                                           {"from": "gpt", "value": "One tag, two images."}]}
    array = media / "array.jsonl"  # a JSON array where JSONL was expected: read as the array
    array.write_text(json.dumps([bad] * 4))
    assert prepare(["--manifest", str(array), "--out", str(tmp_path / "ds")]) == 1
    err = capsys.readouterr().err
    assert f"no usable samples in {array} (read as JSON array; detected format: llava)" in err, err
    first = err.split("the first reasons:\n", 1)[1].splitlines()
    assert [l.split(" at ")[0].strip() for l in first[:3]] == ["placeholder_mismatch"] * 3, err
    assert [f"{array}[{i}]" in first[i] for i in range(3)] == [True] * 3 and not list((tmp_path / "ds").glob("*.tar"))
    # a parquet file is no manifest, and a split the dataset lacks is named with the ones it has
    parquet = _hf_llava_parquet(tmp_path, media) / "train-00000-of-00001.parquet"
    assert prepare(["--manifest", str(parquet), "--out", str(tmp_path / "ds")]) == 2
    assert "--hf" in capsys.readouterr().err
    assert prepare(["--hf", str(parquet), "--split", "test", "--out", str(tmp_path / "ds")]) == 2
    assert "no parquet file of split 'test' (found ['train'] by file name): pass --split NAME" in capsys.readouterr().err


def test_a_dataset_id_is_read_from_the_local_cache(prepared, media, tmp_path, monkeypatch, capsys):
    """--hf ID: the dataset as an earlier online load_dataset("someone/tiny_vlm") left it in the HF cache (config
    `default`, files named after the dataset), read offline."""
    import datasets
    import huggingface_hub
    from datasets.packaged_modules.parquet.parquet import Parquet

    cache = tmp_path / "hf-cache"
    parquet = next((media / "llava_pq").glob("*.parquet"))
    Parquet(cache_dir=str(cache), dataset_name="someone___tiny_vlm", hash="0123abcd",
            data_files={"train": [str(parquet)]}).download_and_prepare()
    built = next((cache / "someone___tiny_vlm").glob("default-*"))
    built.rename(built.with_name("default"))
    for f in (cache / "someone___tiny_vlm" / "default").rglob("someone___tiny_vlm-*.arrow"):
        f.rename(f.with_name(f.name.replace("someone___", "")))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    # imported by this module before prepare_data set the offline switches: no hub request from a test
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert prepare(["--hf", "someone/tiny_vlm", "--out", str(tmp_path / "ds")]) == 0, capsys.readouterr().err
    assert _samples(tmp_path / "ds") == _samples(prepared["own"][0])
    assert prepare(["--hf", "someone/not_cached", "--out", str(tmp_path / "ds2")]) == 2
    assert "--hf someone/not_cached (split 'train') does not open" in capsys.readouterr().err
