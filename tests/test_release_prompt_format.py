"""A run from a release trains in the release's own prompt format (issue 46, item 3).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_release_prompt_format.py -q

The release: scripts/tiny_release.omni_checkpoint(tokenizer=True) (vision + audio, its byte-level BPE
tokenizer.json), shipping a chat template unlike the project's ChatML turns, written here in the manner of the
Nemotron releases (an always-present system turn, assistant turns opened by an empty reasoning block, a generation
prompt that opens one; media given as transformers' content parts, each written on a line of its own). The
oracle is transformers, never Tessera's code:
  - ids: the release tokenizer's apply_chat_template (AutoTokenizer from the release directory, its own
    chat_template.jinja, the conversation with media as parts), then, for media, the released Omni processor
    (NemotronH_Omni_Reasoning_V3Processor) on that text with the waveforms, image grids and video frames, as
    tests/test_prompt_parity.py drives it;
  - loss mask: transformers' assistant mask (return_assistant_tokens_mask) of the same template with
    {% generation %} around what the model writes after the generation prompt.
Tessera's side is the loader's task encoder (data/pipeline.chat_task_encoder) with the chat template a run
resolves (data/run_tokenizer.run_chat_template), on the raw sample bytes.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
# processor: test_prompt_parity's fixture, around this module's tokenizer_json (the release's)
from test_prompt_parity import (ENCODERS, FPS, IMAGE_SIZES, SEQ, VIDEOS, WAVES, _frames, _png_bytes, _sample,
                                processor)  # noqa: F401
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from tessera.data.pipeline import chat_task_encoder
from tessera.data.run_tokenizer import ChatTemplate, TokenizerMismatch, run_chat_template
from tessera.data.tokens import Tokenizer
from tessera.recipes import prelaunch
from tessera.hetero.runspec.config import DataConfig, ModelConfig

# What the model writes after the generation prompt ("<think>\n" opens reasoning; an answered turn closes it
# empty) is the generation block: "</think>", the answer, the tokenizer's eos_token (<|im_end|>, a variable
# apply_chat_template hands the template). A turn with media comes as transformers' parts; the template writes each
# media part as the processor's tag on a line of its own.
ORACLE_TEMPLATE = (
    "{%- macro content(c) -%}{%- if c is string -%}{{ c }}{%- else -%}{%- for p in c -%}"
    "{%- if p['type'] == 'text' -%}{{ p['text'] }}{%- elif p['type'] == 'image' -%}{{ '<image>\\n' }}"
    "{%- elif p['type'] == 'video' -%}{{ '<video>\\n' }}{%- elif p['type'] == 'audio' -%}{{ '<so_embedding>\\n' }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set system = messages[0]['content'] -%}"
    "{%- set messages = messages[1:] -%}{%- else -%}{%- set system = '' -%}{%- endif -%}"
    "{{ '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n<think>' }}{% generation %}{{ '</think>' + m['content'] + eos_token }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + content(m['content']) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}")
#: as the release ships it: no generation markers (Tessera finds the assistant turns by rendering prefixes)
RELEASE_TEMPLATE = re.sub(r"\{%-? *(end)?generation *-?%\}", "", ORACLE_TEMPLATE)
TEXT_ONLY = [{"role": "user", "content": "What is in this picture?"},
             {"role": "assistant", "content": "A red circle on a white background."},
             {"role": "user", "content": "How do they differ?"},
             {"role": "assistant", "content": "A blue square."}]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from tessera.scripts.tiny_release import DENSE_TEXT, omni_checkpoint

    d = tmp_path_factory.mktemp("release") / "omni"
    omni_checkpoint(d, audio=True, text=DENSE_TEXT, tokenizer=True)
    (d / "chat_template.jinja").write_text(RELEASE_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def tokenizer_json(release):
    """test_prompt_parity's processor fixture around the release's tokenizer."""
    return release / "tokenizer.json"


@pytest.fixture(scope="module")
def hf_tokenizer(release):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(release))
    assert tok.chat_template == RELEASE_TEMPLATE  # the release's own file
    return tok


def _task_encoder(release, setting="release", encoders=ENCODERS):
    return chat_task_encoder(Tokenizer(release / "tokenizer.json"), encoders, SEQ, max_tiles=12, video_frames=8,
                             chat_template=run_chat_template(setting, str(release)))


def _messages(turns):
    """The conversation as a processor's apply_chat_template takes it: a turn with media as parts, in order."""
    out = []
    for t in turns:
        pieces = re.split(r"(<image>|<video>|<audio>)", t["content"])
        parts = [{"type": p[1:-1]} if p in ("<image>", "<video>", "<audio>") else {"type": "text", "text": p}
                 for p in pieces if p]
        out.append({"role": t["role"], "content": parts if len(pieces) > 1 else t["content"]})
    return out


def _release_ids(processor, hf_tokenizer, turns, items, te):
    """The release's input_ids: its chat template, then its processor's media expansion and tokenization (images
    at native resolution for the omni family; vl: the grid whose count is the image's tiles', as
    tests/test_prompt_parity._processor_ids hands it)."""
    text = hf_tokenizer.apply_chat_template(_messages(turns), tokenize=False)
    enc = te.enc
    images = [Image.open(io.BytesIO(_png_bytes(IMAGE_SIZES[n]))).convert("RGB") if enc.native_resolution else
              [enc.tile // enc.patch, te._units("image", _png_bytes(IMAGE_SIZES[n]))[0] * enc.tile // enc.patch]
              for k, n in items if k == "image"]
    audio = [WAVES[n] for k, n in items if k == "audio"]
    videos = [torch.from_numpy(_frames(*VIDEOS[n])).permute(0, 3, 1, 2) for k, n in items if k == "video"]
    video_kwargs = {}
    if videos:  # sampled and timed as transformers' loader does (tests/test_prompt_parity._processor_ids)
        (video,) = videos
        meta = VideoMetadata(total_num_frames=len(video), fps=FPS)
        meta.frames_indices = default_sample_indices_fn(meta, num_frames=min(len(video), 8))
        videos, video_kwargs = [video[torch.as_tensor(meta.frames_indices)]], dict(video_metadata=meta,
                                                                                     do_sample_frames=False)
    out = processor(text=text, images=images or None, audio=audio or None, videos=videos or None,
                    sampling_rate=16000, add_special_tokens=False, **video_kwargs)
    return np.asarray(out["input_ids"][0])


def _oracle_mask(hf_tokenizer, turns):
    """(ids, assistant mask) of transformers' apply_chat_template with the generation-marked template; media tags
    as the processor's tags, one token each."""
    out = hf_tokenizer.apply_chat_template(_messages(turns), tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True, chat_template=ORACLE_TEMPLATE)
    return np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=bool)


def test_a_text_conversation_is_the_release_templates_ids_and_assistant_mask(release, hf_tokenizer):
    from tessera.data.release_prompt import encode_release_conversation

    tok = Tokenizer(release / "tokenizer.json")
    shipped = run_chat_template("release", str(release))
    assert shipped == ChatTemplate(RELEASE_TEMPLATE, (("eos_token", "<|im_end|>"), ("pad_token", "<pad>")))
    got = encode_release_conversation(tok, shipped, TEXT_ONLY, [], [], "omni")
    ids, mask = _oracle_mask(hf_tokenizer, TEXT_ONLY)
    np.testing.assert_array_equal(got.tokens, hf_tokenizer.apply_chat_template(TEXT_ONLY, tokenize=True,
                                                                               return_dict=True)["input_ids"])
    np.testing.assert_array_equal(got.tokens, ids)
    assert mask.sum() > 0 and not mask.all()
    np.testing.assert_array_equal(got.target, mask)
    # the template marked with {% generation %} is taken at its word: the same spans
    marked = encode_release_conversation(tok, ChatTemplate(ORACLE_TEMPLATE, shipped.tokens), TEXT_ONLY, [], [], "omni")
    np.testing.assert_array_equal(marked.target, mask)


@pytest.mark.parametrize("conversation,family", [("mixed", "omni"), ("video_audio_image", "omni"), ("image", "vl")])
def test_media_conversations_are_the_release_processors_ids(conversation, family, release, hf_tokenizer, processor):
    turns, items, raw = _sample(conversation)
    te = _task_encoder(release, encoders=ENCODERS if family == "omni" else {"vision": ENCODERS["vision"]})
    assert te.template == family
    encoded = te.preencode_sample(raw)
    want = _release_ids(processor, hf_tokenizer, turns, items, te)
    assert len(encoded.prompt.tokens) == len(want)
    np.testing.assert_array_equal(encoded.prompt.tokens, want)
    # the loss: exactly transformers' assistant tokens (no media in assistant turns: the same ids, in order)
    ids, mask = _oracle_mask(hf_tokenizer, turns)
    np.testing.assert_array_equal(encoded.prompt.tokens[encoded.prompt.target], ids[mask])
    # and never a media token; each module's span is where the processor holds its placeholder id
    for module, tag in (("vision", "<image>"), ("audio", "<so_embedding>")):
        positions = [p for m, s, n, _ in encoded.prompt.spans if m == module for p in range(s, s + n)]
        np.testing.assert_array_equal(positions, np.flatnonzero(want == te.tok.special[tag]))
        assert not encoded.prompt.target[positions].any()


def test_the_project_format_only_when_asked(release, hf_tokenizer, capsys):
    """data.chat_template=project: the project's ChatML turns (not the release's ids), and a note before launch;
    an unknown setting is refused naming the choices."""
    turns, _, raw = _sample("image")
    ours = _task_encoder(release, "project").preencode_sample(raw).prompt.tokens
    theirs = _task_encoder(release).preencode_sample(raw).prompt.tokens
    assert ours[0] == hf_tokenizer.convert_tokens_to_ids("<|im_start|>") and len(ours) < len(theirs)
    prelaunch.check_inputs(SimpleNamespace(model=ModelConfig(checkpoint=str(release)),
                                           data=DataConfig(chat_template="project")))
    assert "note: data.chat_template=project" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"data\.chat_template='chatml' is not one of release, project"):
        DataConfig(chat_template="chatml")


def test_a_template_that_rewrites_earlier_turns_is_refused_before_launch(release, tmp_path):
    rewrites = tmp_path / "rewrites"
    shutil.copytree(release, rewrites)
    # the last assistant turn rendered otherwise than the same turn followed by others
    (rewrites / "chat_template.jinja").write_text(
        "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
        "{%- if loop.last -%}{{ '<|im_end|>' }}{%- endif -%}{%- endfor -%}")
    with pytest.raises(ValueError, match=rf"model.checkpoint={rewrites}: .*cannot be told apart.*data\.chat_template="
                                         r"project"):
        prelaunch.check_inputs(SimpleNamespace(model=ModelConfig(checkpoint=str(rewrites)), data=DataConfig()))


@pytest.mark.parametrize("layout", ["native", "hub"])
def test_a_release_whose_tokenizer_disagrees_is_refused_before_launch_with_synthetic_data(layout, release, tmp_path):
    """Synthetic data (data.path unset): the release's own tokenizer, and for a release that ships none, the
    synthetic set's tokenizer the ranks would train with, both checked against config.json before launch."""
    from tessera.scripts.tiny_release import hub_layout

    d = tmp_path / layout
    shutil.copytree(release, d)
    if layout == "hub":
        hub_layout(d)
    image_key = "img_context_token_id" if layout == "hub" else "image_token_id"
    raw = json.loads((d / "config.json").read_text())
    image = Tokenizer(d / "tokenizer.json").special["<image>"]
    synthetic = SimpleNamespace(model=ModelConfig(checkpoint=str(d)), data=DataConfig())
    prelaunch.check_inputs(synthetic)  # as shipped: agrees
    (d / "config.json").write_text(json.dumps({**raw, image_key: image + 1}))
    with pytest.raises(TokenizerMismatch, match=rf"image_token_id {image + 1} in config.json, but <image> is {image} "
                                                rf"in the tokenizer"):
        prelaunch.check_inputs(synthetic)
    # without a tokenizer of its own: the synthetic set's, whose <image> id is not the release's
    for f in d.glob("tokenizer*"):
        f.unlink()
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(TokenizerMismatch, match=rf"synthetic.*tokenizer\.model \(the synthetic data set's: data\.path "
                                                rf"unset\).*image_token_id {raw[image_key]} in config\.json, but "
                                                rf"<image> is \d+ in the tokenizer"):
        prelaunch.check_inputs(synthetic)
