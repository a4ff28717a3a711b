"""The formats package's door and the formats of the frameworks users come from (issue 58).

Each format is written as its framework publishes it (records as documented, media files written here with
PIL/soundfile) and must prepare into exactly the samples of the same conversation written in Tessera's own schema
(conversation, media kinds and bytes; the ids and loss mask follow from them, tests/test_chat_formats.py). Then the
door for the rest: --format MODULE:FUNCTION (the README's very example), --media-root, and bad input named before
the first shard is written.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

import tests.test_chat_formats as chat  # the own-schema reader (_samples); a module, so its tests are not re-collected
from tessera.data.formats import FORMATS, RecordError, detect
from tessera.scripts.prepare_data import main as prepare

ROOT = Path(__file__).resolve().parents[1]
CAT, DOG = "A grey cat on a red mat.", "A dog, then the same dog again."


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("media")
    Image.new("RGB", (64, 48), (120, 120, 120)).save(d / "cat.jpg")
    Image.new("RGB", (40, 72), (200, 150, 40)).save(d / "dog.png")
    sf.write(d / "tone.wav", (0.3 * np.sin(np.arange(8000) / 5)).astype(np.float32), 16000)
    return d


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _run(*args) -> int:
    return prepare([*map(str, args), "--shard-size", "1"])


def _own(d: Path, conversations, media_lists, name="own") -> list:
    """The samples of `conversations` written in Tessera's own schema, prepared (paths relative to `d`)."""
    recs = [{"conversation": c, "media": [{"kind": k, "path": p} for k, p in m]}
            for c, m in zip(conversations, media_lists)]
    out = d / f"{name}_ds"
    assert _run("--manifest", _jsonl(d / f"{name}.jsonl", recs), "--out", out) == 0
    return chat._samples(out)


# --- the door: --format MODULE:FUNCTION, and unknown_format -----------------------------------------------------

def readme_format_example() -> str:
    """The README's own-format module, as the README shows it."""
    section = (ROOT / "README.md").read_text().split("## Prepare data", 1)[1]
    return re.search(r"```python\n(# my_notes\.py.*?)```", section, flags=re.S).group(1)


def test_readme_format_function_prepares_the_own_schema(media, tmp_path, monkeypatch):
    (tmp_path / "my_notes.py").write_text(readme_format_example())
    notes = _jsonl(media / "notes.jsonl", [{"photo": "cat.jpg", "question": "What is this?", "answer": CAT}])
    own = _own(media, [[{"role": "user", "content": "<image>\nWhat is this?"}, {"role": "assistant", "content": CAT}]],
               [[("image", "cat.jpg")]], "own_notes")
    assert _run("--manifest", notes, "--format", f"{tmp_path / 'my_notes.py'}:convert", "--out", tmp_path / "a") == 0
    assert chat._samples(tmp_path / "a") == own
    monkeypatch.chdir(tmp_path)  # a module name is imported from the current directory first, as python -m does
    assert _run("--manifest", notes, "--format", "my_notes:convert", "--out", tmp_path / "b") == 0
    assert chat._samples(tmp_path / "b") == own


def test_bad_format_is_named_before_any_shard_and_later_raises_are_counted(media, tmp_path, capsys):
    notes = _jsonl(media / "notes2.jsonl", [{"photo": "cat.jpg", "answer": CAT}, {"photo": "dog.png"}])
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    (tmp_path / "strict.py").write_text("def convert(r):\n    return {'conversation': [{'role': 'user', 'content': "
                                        "'<image>'}, {'role': 'assistant', 'content': r['answer']}], 'media': "
                                        "[{'kind': 'image', 'path': r['photo']}]}\n")
    for spec, words in [(f"{tmp_path}/broken.py:convert", "No module named 'no_such_module_here'"),
                        (f"{tmp_path}/strict.py:convrt", "has no function 'convrt' (it has ['convert'])"),
                        ("not_a_module_anywhere:convert", "module 'not_a_module_anywhere' does not import"),
                        (f"{tmp_path}/strict.py", "expected MODULE:FUNCTION")]:
        assert _run("--manifest", notes, "--format", spec, "--out", tmp_path / "x") == 2, spec
        err = capsys.readouterr().err
        assert words in err, (spec, err)
        assert not (tmp_path / "x").exists()
    # raising on the first record stops the run there, with the traceback's last line
    first = _jsonl(media / "notes3.jsonl", [{"photo": "dog.png"}, {"photo": "cat.jpg", "answer": CAT}])
    assert _run("--manifest", first, "--format", f"{tmp_path}/strict.py:convert", "--out", tmp_path / "x") == 2
    err = capsys.readouterr().err
    assert f"raised on the first record ({first}:1): " in err and "strict.py:2 in convert: KeyError: 'answer'" in err
    assert not (tmp_path / "x").exists()
    # on a later record: a counted, named skip
    assert _run("--manifest", notes, "--format", f"{tmp_path}/strict.py:convert", "--out", tmp_path / "y") == 0
    out, err = capsys.readouterr()
    assert "skipped 1 {'format_error': 1}" in out and f"skip {notes}:2: format_error" in err, (out, err)


def test_unknown_format_names_every_format_and_the_option():
    with pytest.raises(RecordError) as e:
        detect({"foo": 1})
    assert e.value.reason == "unknown_format"
    for name in FORMATS:
        assert f"{name}: " in str(e.value) and name in str(e.value).split("formats tried: ")[1], name
    assert "--format MODULE:FUNCTION" in str(e.value)


# --- --media-root -----------------------------------------------------------------------------------------------

def test_media_root_resolves_relative_paths(media, tmp_path, capsys):
    """LLaVA's layout: the JSON in one folder, the images under another given to the trainer (--image_folder)."""
    conv = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": CAT}]
    (tmp_path / "ann").mkdir()
    llava = tmp_path / "ann" / "llava.json"
    llava.write_text(json.dumps([{"id": "0", "image": "cat.jpg", "conversations": conv}]))
    own = _own(media, [[{"role": "user", "content": "<image>\nWhat is this?"}, {"role": "assistant", "content": CAT}]],
               [[("image", "cat.jpg")]], "own_root")
    assert _run("--manifest", llava, "--out", tmp_path / "a") == 1  # default: the manifest's folder
    assert f"{tmp_path / 'ann' / 'cat.jpg'} does not exist" in capsys.readouterr().err
    assert _run("--manifest", llava, "--media-root", media, "--out", tmp_path / "b") == 0
    assert chat._samples(tmp_path / "b") == own
    assert _run("--manifest", llava, "--media-root", tmp_path / "nowhere", "--out", tmp_path / "c") == 2
    assert "--media-root" in capsys.readouterr().err and not (tmp_path / "c").exists()


# --- the formats of the frameworks users come from, each as published --------------------------------------------

SYS, Q0, A0 = "You are a careful describer.", "Hello?", "Hello! Send a picture."


def test_llama_factory_alpaca_and_sharegpt(media, tmp_path):
    """LLaMA-Factory data/README.md: alpaca (instruction + input joined by a newline, system, history pairs, media
    lists with one tag each) and sharegpt (conversations, top-level system, images)."""
    alpaca = _jsonl(tmp_path / "alpaca.json", [
        {"instruction": "<image>What is this?", "input": "", "output": CAT, "system": SYS, "history": [[Q0, A0]],
         "images": ["cat.jpg"]},
        {"instruction": "Transcribe.", "input": "<audio>", "output": "A tone.", "audios": ["tone.wav"]}])
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": Q0}, {"from": "gpt", "value": A0},
                                                       {"from": "human", "value": "<image>What is this?"},
                                                       {"from": "gpt", "value": CAT}],
                                     "system": SYS, "images": ["cat.jpg"]}]))
    first = [{"role": "system", "content": SYS}, {"role": "user", "content": Q0}, {"role": "assistant", "content": A0},
             {"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": CAT}]
    own = _own(media, [first, [{"role": "user", "content": "Transcribe.\n<audio>"},
                               {"role": "assistant", "content": "A tone."}]],
               [[("image", "cat.jpg")], [("audio", "tone.wav")]], "own_lf")
    assert _run("--manifest", alpaca, "--media-root", media, "--out", tmp_path / "a") == 0
    assert chat._samples(tmp_path / "a") == own
    assert _run("--manifest", sharegpt, "--media-root", media, "--out", tmp_path / "s") == 0
    assert chat._samples(tmp_path / "s") == own[:1]


def test_cauldron_rows_put_every_image_before_the_first_user_turn(media, tmp_path):
    """the_cauldron's layout on the Hub: parquet rows of `images` (a list of Image features) and `texts` (a list of
    {user, assistant, source}); in the split's folder (data/train/) and with the split in the file name."""
    import datasets

    rows = {"images": [[{"bytes": (media / n).read_bytes(), "path": None} for n in ("cat.jpg", "dog.png")]],
            "texts": [[{"user": "What are these?", "assistant": DOG, "source": "demo"},
                       {"user": "Which is first?", "assistant": "The cat.", "source": "demo"}]]}
    ds = datasets.Dataset.from_dict(rows).cast_column("images", datasets.List(datasets.Image()))
    (tmp_path / "hub" / "data" / "train").mkdir(parents=True)
    ds.to_parquet(str(tmp_path / "hub" / "data" / "train" / "0000.parquet"))
    (tmp_path / "hub" / "data" / "test").mkdir()
    datasets.Dataset.from_dict({"images": [[]], "texts": [[{"user": "Hi", "assistant": "Hello"}]]}).to_parquet(
        str(tmp_path / "hub" / "data" / "test" / "0000.parquet"))
    (tmp_path / "flat").mkdir()
    ds.to_parquet(str(tmp_path / "flat" / "test-00000-of-00001.parquet"))
    own = _own(media, [[{"role": "user", "content": "<image><image>\nWhat are these?"},
                        {"role": "assistant", "content": DOG}, {"role": "user", "content": "Which is first?"},
                        {"role": "assistant", "content": "The cat."}]],
               [[("image", "cat.jpg"), ("image", "dog.png")]], "own_cauldron")
    assert _run("--hf", tmp_path / "hub", "--out", tmp_path / "a") == 0
    assert chat._samples(tmp_path / "a") == own
    assert _run("--hf", tmp_path / "hub", "--split", "test", "--out", tmp_path / "t") == 0  # the folder's split
    assert chat._samples(tmp_path / "t") == [([{"role": "user", "content": "Hi"}, {"role": "assistant",
                                                                                  "content": "Hello"}], [])]
    assert _run("--hf", tmp_path / "flat", "--split", "test", "--out", tmp_path / "b") == 0
    assert chat._samples(tmp_path / "b") == own


def test_nemo_asr_manifest_as_nemos_reader_reads_it(media, tmp_path, capsys):
    """A NeMo ASR manifest (relative paths against its folder, `offset` + `duration` a span): each sample is the
    transcript and the audio that NeMo's own item_iter says the line means; a span past the end is a named skip."""
    import soundfile as sf
    from nemo.collections.common.parts.preprocessing.manifest import item_iter

    manifest = _jsonl(media / "asr_manifest.json", [
        {"audio_filepath": "tone.wav", "duration": 0.5, "text": "a whole tone"},
        {"audio_filepath": "tone.wav", "offset": 0.125, "duration": 0.25, "text": "a span of it"},
        {"audio_filepath": "tone.wav", "offset": 0.4, "duration": 0.25, "text": "past the end"}])
    assert _run("--manifest", manifest, "--out", tmp_path / "a") == 0
    out, err = capsys.readouterr()
    assert "format nemo_asr: wrote 2 samples" in out and "skipped 1 {'span_past_end': 1}" in out, out
    assert f"skip {manifest}:3: span_past_end" in err and "0.650 s, but" in err and "lasts 0.500 s" in err, err
    got = chat._samples(tmp_path / "a")
    for (conv, [(kind, data)]), item in zip(got, list(item_iter(str(manifest)))[:2]):
        assert conv == [{"role": "user", "content": "<audio>\nTranscribe or describe the audio."},
                        {"role": "assistant", "content": item["text"]}] and kind == "audio"
        rate = sf.info(item["audio_file"]).samplerate
        start = round((item["offset"] or 0) * rate)
        want, _ = sf.read(item["audio_file"], start=start, frames=round(item["duration"] * rate), dtype="int16")
        mine, mine_rate = sf.read(io.BytesIO(data), dtype="int16")
        assert mine_rate == rate and np.array_equal(mine, want) and len(mine) == (8000 if start == 0 else 4000)
    assert got[0][1][0][1] == (media / "tone.wav").read_bytes()  # no offset: the file as it is


def test_partial_records_are_counted_unknown_format_skips(media, tmp_path, capsys):
    """A record matching a format only partly is an unknown_format skip, never a crash; media lists longer or
    shorter than the tags are placeholder_mismatch skips."""
    lines = [{"audio_filepath": "tone.wav", "duration": 0.5},                      # no text
             {"instruction": "<image>What?", "images": ["cat.jpg"]},               # no output
             {"images": ["cat.jpg"]}, {"texts": [{"user": "Hi", "assistant": "Hello"}]},
             {"caption": "a cat"},                                                  # no media
             {"instruction": "<image>What?", "output": CAT, "images": ["cat.jpg", "dog.png"]},   # more items than tags
             {"instruction": "<image><image>?", "output": CAT, "images": ["cat.jpg"]},           # fewer
             {"conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": CAT}], "system": SYS,
              "images": []},
             {"instruction": "What?", "output": CAT}]                               # the one usable record
    manifest = _jsonl(media / "partial.jsonl", lines)
    assert _run("--manifest", manifest, "--out", tmp_path / "a") == 0
    out = capsys.readouterr().out
    assert "skipped 8 {'unknown_format': 5, 'placeholder_mismatch': 3}" in out, out


# --- Hugging Face's folder builders and --columns ----------------------------------------------------------------

def test_folder_builders_as_the_datasets_docs_lay_them_out(media, tmp_path):
    """imagefolder with split folders and metadata.jsonl (file_name, text), audiofolder with metadata.csv
    (file_name, transcription), videofolder with metadata.parquet (file_name, caption): opened by datasets' own
    builders, each row the caption / transcript sample."""
    import datasets

    from tessera.data.prepare import encode_mp4

    img = tmp_path / "imgs"
    for split, name, caption in (("train", "cat.jpg", CAT), ("test", "dog.png", DOG)):
        (img / split).mkdir(parents=True)
        (img / split / name).write_bytes((media / name).read_bytes())
        _jsonl(img / split / "metadata.jsonl", [{"file_name": name, "text": caption}])
    aud = tmp_path / "auds"
    aud.mkdir()
    (aud / "tone.wav").write_bytes((media / "tone.wav").read_bytes())
    (aud / "metadata.csv").write_text("file_name,transcription\ntone.wav,a steady tone\n")
    vid = tmp_path / "vids" / "train"
    vid.mkdir(parents=True)
    (vid / "clip.mp4").write_bytes(encode_mp4((np.full((32, 48, 3), 40 * t, np.uint8) for t in range(4)), fps=4))
    (media / "clip.mp4").write_bytes((vid / "clip.mp4").read_bytes())
    datasets.Dataset.from_dict({"file_name": ["clip.mp4"], "caption": ["It brightens."]}).to_parquet(
        str(vid / "metadata.parquet"))
    prompt = lambda kind: {"image": "<image>\nDescribe the image.", "audio": "<audio>\nTranscribe or describe the "
                           "audio.", "video": "<video>\nWhat happens in this video?"}[kind]
    for folder, split, kind, name, said in ((img, "train", "image", "cat.jpg", CAT), (img, "test", "image", "dog.png",
                                                                                       DOG),
                                            (aud, "train", "audio", "tone.wav", "a steady tone"),
                                            (vid.parent, "train", "video", "clip.mp4", "It brightens.")):
        own = _own(media, [[{"role": "user", "content": prompt(kind)}, {"role": "assistant", "content": said}]],
                   [[(kind, name)]], f"own_{kind}_{split}")
        out = tmp_path / f"{folder.name}_{split}"
        assert _run("--hf", folder, "--split", split, "--out", out) == 0, (folder, split)
        assert chat._samples(out) == own, (folder, split)


def test_columns_map_a_flat_table(media, tmp_path, capsys):
    """--columns on a CommonVoice-style parquet (audio + sentence, a fixed prompt) and a JSONL whose prompt is a
    column; a column the data lacks is named before any shard is written."""
    import datasets

    ds = datasets.Dataset.from_dict({"audio": [{"bytes": (media / "tone.wav").read_bytes(), "path": "tone.wav"}],
                                     "sentence": ["a steady tone"], "up_votes": [2]})
    ds.cast_column("audio", datasets.Audio(decode=False)).to_parquet(str(tmp_path / "cv.parquet"))
    own = _own(media, [[{"role": "user", "content": "<audio>\nWrite down what is said."},
                        {"role": "assistant", "content": "a steady tone"}]], [[("audio", "tone.wav")]], "own_cv")
    assert _run("--hf", tmp_path / "cv.parquet", "--columns", "audio=audio,text=sentence,prompt=Write down what is "
                "said.", "--out", tmp_path / "a") == 0
    assert chat._samples(tmp_path / "a") == own
    table = _jsonl(tmp_path / "cord.jsonl", [{"img": "cat.jpg", "ground_truth": CAT, "ask": "What is this?"}])
    own = _own(media, [[{"role": "user", "content": "<image>\nWhat is this?"}, {"role": "assistant", "content": CAT}]],
               [[("image", "cat.jpg")]], "own_cord")
    assert _run("--manifest", table, "--media-root", media, "--columns", "image=img,text=ground_truth,prompt=ask",
                "--out", tmp_path / "b") == 0
    assert chat._samples(tmp_path / "b") == own
    assert _run("--manifest", table, "--columns", "image=img,text=caption", "--out", tmp_path / "c") == 2
    err = capsys.readouterr().err
    assert "the data has no column 'caption' (for text=); its columns: ['ask', 'ground_truth', 'img']" in err, err
    assert not (tmp_path / "c").exists()


def test_nemo_speech_llm_manifest_has_nemos_turns(media, tmp_path):
    """NeMo's spoken-QA manifest (sqa_as_conversation's documented line): the turns of NeMo's own
    sqa_cut_to_conversation on the same line, the audio where its AudioTurn is, the file or the offset span."""
    import lhotse
    import soundfile as sf
    from nemo.collections.common.data.lhotse.cutset import sqa_cut_to_conversation

    line = {"audio_filepath": "tone.wav", "duration": 0.5, "text": "a tone", "lang": "en", "context": "Listen.",
            "question": "What is heard?", "answer": "A steady tone.", "system_prompt": SYS}
    span = dict(line, offset=0.25, duration=0.125, question="And at the end?")
    manifest = _jsonl(media / "sqa_manifest.json", [line, span])
    assert _run("--manifest", manifest, "--out", tmp_path / "a") == 0
    got = chat._samples(tmp_path / "a")
    for (conv, [(kind, data)]), rec in zip(got, (line, span)):
        cut = lhotse.Recording.from_file(str(media / "tone.wav")).to_cut()
        cut.custom = {k: rec[k] for k in ("context", "question", "answer", "system_prompt")}
        nemo = sqa_cut_to_conversation(cut, audio_locator_tag="<audio>", token_equivalent_duration=0.08)
        assert conv == [{"role": t.role, "content": getattr(t, "value", None) or t.audio_locator_tag}
                        for t in nemo.turns] and kind == "audio"
        rate, start = 16000, round(rec.get("offset", 0) * 16000)
        want, _ = sf.read(media / "tone.wav", start=start, frames=round(rec["duration"] * rate), dtype="int16")
        assert np.array_equal(sf.read(io.BytesIO(data), dtype="int16")[0], want)


def test_the_new_formats_train_two_steps_of_the_tiny_omni_model(media, tmp_path):
    """One manifest holding a record of each new manifest format (detected per record), prepared with nothing
    skipped, loads into packed batches with nothing skipped, and trains 2 steps of the tiny omni model (its vision
    and audio encoders, in one process: tests/test_data_end_to_end.py's model)."""
    import sentencepiece as spm
    import torch

    import tests.test_data_end_to_end as e2e
    from tessera.data.pipeline import build_train_loader

    sf.write(media / "speech.wav", (0.3 * np.sin(np.arange(16000) / 7)).astype(np.float32), 16000)
    lines = [{"instruction": "<image>What is this?", "input": "", "output": CAT, "images": ["cat.jpg"]},
             {"conversations": [{"from": "human", "value": "<image>And this?"}, {"from": "gpt", "value": DOG}],
              "system": SYS, "images": ["dog.png"]},
             {"images": ["cat.jpg", "dog.png"], "texts": [{"user": "Two pictures?", "assistant": "A cat, a dog."}]},
             {"audio_filepath": "speech.wav", "offset": 0.25, "duration": 0.5, "text": "a hum"},
             {"audio_filepath": "speech.wav", "duration": 1.0, "question": "What is it?", "answer": "A hum."}]
    manifest = _jsonl(media / "mixed_new.jsonl", lines * 2)
    out = tmp_path / "ds"
    assert _run("--manifest", manifest, "--out", out) == 0
    assert len(chat._samples(out)) == len(lines) * 2
    vocab = -(-spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model")).get_piece_size() // 64) * 64
    loader = build_train_loader(out, out / "tokenizer.model", e2e.ENCODERS, e2e.SEQ, e2e.ROWS, decode=None, seed=1)
    batches = [b for _, b in zip(range(2), loader)]
    e2e.close_loader(loader)
    assert all(not b.skipped for b in batches), [b.skipped for b in batches]
    kinds = {k for b in batches for row in b.media for items in row.values() for k, _ in items}
    assert kinds == {"image", "audio"}, kinds
    model = e2e._model(vocab).train()
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    losses = []
    for b in batches:
        loss = e2e._loss(model, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)), losses
