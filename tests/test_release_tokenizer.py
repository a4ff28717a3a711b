"""The release's tokenizer by default (issue 33, item 5): with model.checkpoint=DIR and no data.tokenizer the run
uses DIR's tokenizer (data/run_tokenizer.py, the one rule the trainer and the pre-launch checks apply); a tokenizer
whose media token ids or vocabulary disagree with DIR/config.json is refused before launch, naming both; the
export of a run from a release ships the release's tokenizer files, chat template and generation_config.json next
to config.json, its weights sharded with model.safetensors.index.json, and transformers generates from it.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_release_tokenizer.py -q

The release: scripts/tiny_release.omni_checkpoint(tokenizer=True), transformers' save_pretrained of a tiny
NemotronH_Omni_Reasoning_V3 with a byte-level BPE tokenizer.json whose ids config.json takes. Oracles: transformers
(from_pretrained, AutoTokenizer, the chat template it renders, generate) and the release directory itself.
The Omni processor cannot be built here (its image processor imports torchvision, absent from this venv,
tests/_omni_image_processor.py): the image prompt is the chat template's text with its <image> tag expanded as the
processor's replace_image_token does (<img> <image> x N </img>), and the pixels are what its image processor makes
of an image already at its patch grid (models/hf_reference.processor_pixels).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tessera.data.run_tokenizer import RELEASE_FILES, TokenizerMismatch, disagreements, run_tokenizer
from tessera.data.tokens import Tokenizer, train_sentencepiece
from tessera.hetero.runspec.config import DataConfig, ModelConfig, RunConfig
from tessera.scripts.tiny_release import DENSE_TEXT, TOKENIZER_TEXTS, omni_checkpoint


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("release") / "omni"
    omni_checkpoint(d, audio=False, text=DENSE_TEXT, tokenizer=True)
    return d


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A prepared dataset's directory as the checks see it (.nv-meta) with its own SentencePiece tokenizer, whose
    <image> id is not the release's."""
    d = tmp_path_factory.mktemp("data") / "ds"
    (d / ".nv-meta").mkdir(parents=True)
    # the dataset.yaml energon prepare writes for the project's schema (the sample type is checked before launch)
    (d / ".nv-meta" / "dataset.yaml").write_text("__module__: megatron.energon\n__class__: CrudeWebdataset\n")
    train_sentencepiece(TOKENIZER_TEXTS * 4, d / "tokenizer", vocab_size=120)
    return d


def test_a_run_from_a_release_uses_its_tokenizer_unless_told(release, dataset):
    from tessera.hetero.build import run_state

    assert (release / "tokenizer.json").is_file() and (dataset / "tokenizer.model").is_file()
    cfg = RunConfig(model=ModelConfig(checkpoint=str(release)), data=DataConfig(path=str(dataset)))
    path, choice = run_state._dataset(cfg, rank=0)  # the trainer's choice (a given data.path: no world needed)
    assert (path, choice.path) == (str(dataset), str(release / "tokenizer.json"))
    assert choice.source == f"model.checkpoint={release}"
    # data.tokenizer still wins; without a checkpoint the dataset's own is used
    given = str(release / "tokenizer.json")
    assert run_tokenizer(given, None, str(dataset)).path == given
    assert run_tokenizer(None, None, str(dataset)).path == str(dataset / "tokenizer.model")
    with pytest.raises(TokenizerMismatch, match=r"tokenizer\.model is missing.*model\.checkpoint=.*data\.tokenizer"):
        run_tokenizer(None, str(dataset / ".nv-meta"), str(dataset / ".nv-meta"))


def test_the_trainer_resolves_the_release_tokenizer_and_records_it(release, dataset, tmp_path):
    from tessera.hetero.build.run_state import resolve_inputs

    cfg = RunConfig(model=ModelConfig(checkpoint=str(release)), data=DataConfig(path=str(dataset)))
    run = resolve_inputs(cfg, rank=0)
    assert run.tok_path == str(release / "tokenizer.json")
    # the saved config (what the export reads) names it; the caller's config is left as given
    assert run.cfg.data.tokenizer == run.tok_path and cfg.data.tokenizer is None
    refused = RunConfig(model=ModelConfig(checkpoint=str(release)),
                        data=DataConfig(path=str(dataset), tokenizer=str(dataset / "tokenizer.model")))
    with pytest.raises(TokenizerMismatch, match=r"image_token_id"):
        resolve_inputs(refused, rank=0)


def test_a_disagreeing_tokenizer_is_refused_before_launch_naming_both(release, dataset):
    from tessera.models.released import read_config
    from tessera.recipes import prelaunch

    theirs, ours = Tokenizer(release / "tokenizer.json"), Tokenizer(dataset / "tokenizer.model")
    config = read_config(release)
    assert ours.special["<image>"] != config["image_token_id"] == theirs.special["<image>"]
    task = SimpleNamespace(model=ModelConfig(checkpoint=str(release)),
                           data=DataConfig(path=str(dataset), tokenizer=str(dataset / "tokenizer.model")))
    with pytest.raises(TokenizerMismatch) as e:
        prelaunch.check_inputs(task)
    msg = str(e.value)
    assert str(dataset / "tokenizer.model") in msg and str(release) in msg, msg
    assert (f"image_token_id {config['image_token_id']} in config.json, but <image> is {ours.special['<image>']}"
            in msg and f"video_token_id {config['video_token_id']}" in msg), msg
    assert f"drop data.tokenizer to use its own, {release / 'tokenizer.json'}" in msg, msg
    # without data.tokenizer the release's own is taken and agrees; so does a registry run's dataset tokenizer
    prelaunch.check_inputs(SimpleNamespace(model=task.model, data=DataConfig(path=str(dataset))))
    prelaunch.check_inputs(SimpleNamespace(model=ModelConfig(), data=task.data))
    # the vocabulary: a tokenizer larger than the model's
    small = {**config, "text_config": {**config["text_config"], "vocab_size": theirs.vocab_size - 1}}
    assert disagreements(theirs, small) == [f"the tokenizer has {theirs.vocab_size} tokens, the model's "
                                            f"vocabulary only {theirs.vocab_size - 1}"]
    assert disagreements(theirs, config) == []


def test_the_export_reads_the_trained_tokenizer_from_the_saved_config(release, dataset, tmp_path):
    from tessera.hetero.export.hf import trained_tokenizer

    named = {"data": {"path": str(dataset), "tokenizer": str(dataset / "tokenizer.model")},
             "model": {"checkpoint": str(release)}}
    assert trained_tokenizer(named) == str(dataset / "tokenizer.model")
    # a checkpoint saved before the config named it: the rule, on the saved settings
    assert trained_tokenizer({"data": {"path": str(dataset)}, "model": {"checkpoint": str(release)}}) == str(
        release / "tokenizer.json")
    assert trained_tokenizer({"data": {"tokenizer": str(tmp_path / "gone.model")}, "model": {}}) is None


def _image_prompt(tokenizer, tokens: int) -> tuple[str, list[int]]:
    """The chat template's prompt for one image and a question, and its ids with the image tag expanded as the
    release's processor expands it."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Describe the image."}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expanded = text.replace("<image>", "<img>" + "<image>" * tokens + "</img>")
    return text, tokenizer(expanded, add_special_tokens=False).input_ids


def test_export_of_a_release_ships_its_tokenizer_sharded_and_generates_from_an_image(release, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, GenerationConfig, NemotronH_Omni_Reasoning_V3

    from tessera.data.templates import IM_START
    from tessera.data.tokens import encode_conversation
    from tessera.hetero.export.hf import write_hf
    from tessera.models.encoders import encoder_config
    from tessera.models.hf_reference import processor_pixels
    from tessera.models.released import encoder_name, llm_fields_of, read_config

    out, limit = tmp_path / "export", 200_000
    full = load_file(str(release / "model.safetensors"))
    write_hf(out, full, ModelConfig(checkpoint=str(release)), llm_fields_of(read_config(release)),
             tokenizer=str(release / "tokenizer.json"), max_shard_size=limit)
    # weights: several shards under the limit, the index maps every tensor to the shard that holds it
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert sorted(index["weight_map"]) == sorted(full) and set(index["weight_map"].values()) == {p.name for p in shards}
    assert all(p.stat().st_size <= limit for p in shards)
    assert all(set(load_file(str(p))) == {k for k, f in index["weight_map"].items() if f == p.name} for p in shards)
    # the release's tokenizer files, chat template and generation defaults, as they are
    shipped = [n for n in RELEASE_FILES if (release / n).is_file()]
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(shipped)
    assert all((out / n).read_bytes() == (release / n).read_bytes() for n in shipped)

    model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(str(out), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert GenerationConfig.from_pretrained(str(out)).to_dict() == GenerationConfig.from_pretrained(
        str(release)).to_dict()

    vcfg = encoder_config(encoder_name(out, "vision"))
    grid, shuffle = 4, vcfg.pixel_shuffle
    image = torch.randint(0, 256, (1, 3, grid * vcfg.patch, grid * vcfg.patch), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    n = grid * grid // shuffle**2
    text, prompt = _image_prompt(tokenizer, n)
    assert text == "<|im_start|>user\n<image> Describe the image.<|im_end|>\n<|im_start|>assistant\n"
    # the ids the chat template gives are the ones Tessera trains on for the same turn
    tok = Tokenizer(out / "tokenizer.json")
    ours = encode_conversation(tok, [{"role": "user", "content": "<image> Describe the image."}], ["image"], [n],
                               template="omni")
    assert prompt == ours.tokens.tolist() + tok.template(IM_START, "assistant\n").tolist()
    assert prompt.count(model.config.image_token_id) == n

    inputs = dict(input_ids=torch.tensor([prompt]), image_grid_hw=torch.tensor([[grid, grid]]),
                  pixel_values=processor_pixels(image, vcfg.patch, vcfg.mean, vcfg.std))
    generated = model.eval().generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (1, len(prompt) + 4) and generated[0, :len(prompt)].tolist() == prompt
    reference = NemotronH_Omni_Reasoning_V3.from_pretrained(str(release)).eval()
    assert torch.equal(reference.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False), generated)
    print(f"\ngenerated from an image prompt: {tokenizer.decode(generated[0, len(prompt):])!r} "
          f"({len(shards)} shards of <= {limit} bytes)")
    # exported over the release it started from: the release's own files stay as they are
    import shutil

    inplace = shutil.copytree(release, tmp_path / "inplace")
    write_hf(inplace, full, ModelConfig(checkpoint=str(inplace)), llm_fields_of(read_config(release)),
             tokenizer=str(inplace / "tokenizer.json"))
    assert all((inplace / n).read_bytes() == (release / n).read_bytes() for n in shipped)


def test_prelaunch_checks_a_release_without_a_tokenizer_against_the_dataset(release, dataset, tmp_path):
    """A checkpoint that ships no tokenizer: the dataset's is used, and still checked against its config.json."""
    import shutil

    from tessera.recipes import prelaunch

    bare = tmp_path / "bare"
    shutil.copytree(release, bare, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    task = SimpleNamespace(model=ModelConfig(checkpoint=str(bare)), data=DataConfig(path=str(dataset)))
    with pytest.raises(TokenizerMismatch, match=rf"{dataset / 'tokenizer.model'} \(data\.path=.*image_token_id"):
        prelaunch.check_inputs(task)


def test_the_project_turns_over_a_release_template_unlike_them_are_noted_before_launch(release, dataset, tmp_path,
                                                                                       capsys):
    """data.chat_template=project with a release whose template renders turns otherwise: a note before launch (the
    default trains in the release's format: no note)."""
    import shutil

    from tessera.data.run_tokenizer import chat_template_note
    from tessera.recipes import prelaunch

    assert chat_template_note(release) is None  # the tiny release's template is the project's turns
    other = tmp_path / "other"
    shutil.copytree(release, other)
    (other / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}")
    prelaunch.check_inputs(SimpleNamespace(model=ModelConfig(checkpoint=str(other)), data=DataConfig(path=str(dataset))))
    assert "note:" not in capsys.readouterr().err
    project = DataConfig(path=str(dataset), chat_template="project")
    prelaunch.check_inputs(SimpleNamespace(model=ModelConfig(checkpoint=str(other)), data=project))
    err = capsys.readouterr().err
    assert f"not as the chat template of {other} renders them, '<|im_start|>system: Be brief." in err, err
