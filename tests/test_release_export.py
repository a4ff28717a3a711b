"""A model built from registry names exports as a release (issue 15, item 1): config.json of transformers'
NemotronH_Omni_Reasoning_V3 next to model.safetensors, so transformers loads the export with no missing, left-over
or mis-shaped tensor and holds every exported tensor bit for bit; Tessera's own reading of that config.json
(models/released.py, what `model.checkpoint=OUT` would use) gives back the registry encoders it came from.
Encoders the release's architecture computes differently get no config.json and a line saying why.

The oracle is transformers itself (its config classes and from_pretrained).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests._mcore_cpu import single_rank_world

# architecture fields of a registry entry that the release's config.json carries (not: the data path's tile,
# the name, the mel front end the registry fixes for every audio family)
VISION_FIELDS = ("family", "patch", "hidden", "layers", "heads", "ffn", "eps", "act", "prefix_tokens", "pos_grid",
                 "pos_interp", "pos_resize", "pixel_shuffle", "temporal_patch", "mean", "std", "final_norm",
                 "layer_scale", "summary_idxs")
AUDIO_FIELDS = ("family", "n_mels", "hidden", "layers", "heads", "ff_expansion", "conv_kernel", "subsampling",
                "subsampling_channels", "attention_bias", "convolution_bias", "scale_input")


def _export(tmp_path, llm: str, vision: str | None, audio: str | None, tokenizer: str | None = None,
            vocab: int = 0):
    single_rank_world()
    from tessera.hetero.export.hf import write_hf
    from tessera.hetero.build.model_build import llm_fields
    from tessera.hetero.build.seeded_init import full_hf_state
    from tessera.hetero.runspec.config import ModelConfig

    cfg = ModelConfig(llm=llm, vision=vision, audio=audio)
    fields = llm_fields(cfg, vocab)  # the vocabulary grown to `vocab` tokens, as a run grows it to its tokenizer's
    out = tmp_path / f"{vision}_{audio}"
    write_hf(out, full_hf_state(cfg, fields, seed=5), cfg, fields, tokenizer)
    return out


@pytest.mark.parametrize("llm,audio", [("nemotron_h_tiny_moe", "parakeet_hf_tiny"), ("nemotron_h_tiny_dense", None)])
def test_registry_model_exports_as_a_release_transformers_loads_exactly(tmp_path, llm, audio):
    from transformers import NemotronH_Omni_Reasoning_V3

    from tessera.models.encoders import encoder_config
    from tessera.models.released import encoder_config_of, encoder_name

    out = _export(tmp_path, llm, "radio_vit_tiny", audio)
    model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # what it holds, in the release's key layout: its own save_pretrained (its state_dict names differ)
    model.save_pretrained(str(tmp_path / "resaved"))
    exported, held = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "resaved" / "model.safetensors"))
    assert set(exported) == set(held), set(exported) ^ set(held)
    assert all(torch.equal(held[k], v) for k, v in exported.items())
    # Tessera reads the config back as the encoders it was built from
    for modality, name, fields in (("vision", "radio_vit_tiny", VISION_FIELDS), ("audio", audio, AUDIO_FIELDS)):
        if name is None:
            assert model.config.audio_config is None
            continue
        want, got = encoder_config(name), encoder_config_of(encoder_name(out, modality))
        assert {f: got[f] for f in fields} == {f: getattr(want, f) for f in fields}, modality


@pytest.mark.parametrize("vision,audio,why", [("radio_vit_tiny", "fastconformer_tiny", "fastconformer"),
                                              ("siglip_tiny", None, "siglip")])
def test_encoders_the_release_computes_differently_get_no_config(tmp_path, capsys, vision, audio, why):
    out = _export(tmp_path, "nemotron_h_tiny_dense", vision, audio)
    assert not (out / "config.json").exists()
    assert (out / "tessera.json").exists() and (out / "language_model" / "config.json").exists()
    assert why in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["tokenizer.json", "tokenizer.model"])
def test_export_ships_the_runs_tokenizer_chat_template_and_generation_config(tmp_path, kind):
    """A run not started from a release: its own tokenizer (either kind), the chat template of the turns Tessera
    trains and generation_config.json from config.json's bos/eos/pad, ending turns at <|im_end|>; transformers'
    AutoTokenizer loads them with Tessera's special token ids, and the template renders Tessera's turns. The ids of
    a whole prompt agree for a tokenizer.json (byte-level BPE, as releases ship); a SentencePiece model prefixes
    every piece Tessera tokenizes apart with its dummy "▁", which one string tokenized at once cannot reproduce."""
    from transformers import AutoTokenizer, GenerationConfig

    from tessera.data.templates import CHAT_TEMPLATE, IM_END, IM_START
    from tessera.data.tokens import Tokenizer, encode_conversation, train_sentencepiece
    from tessera.scripts.tiny_release import TOKENIZER_TEXTS, release_tokenizer

    if kind == "tokenizer.json":
        release_tokenizer(tmp_path / "tok")  # the files a release ships; only tokenizer.json is the run's
        path = tmp_path / "tok" / "tokenizer.json"
    else:
        path = train_sentencepiece(TOKENIZER_TEXTS * 4, tmp_path / "tokenizer", vocab_size=120)
    out = _export(tmp_path, "nemotron_h_tiny_dense", "radio_vit_tiny", None, str(path))
    assert (out / kind).read_bytes() == path.read_bytes() and (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    tok, config = Tokenizer(path), json.loads((out / "config.json").read_text())["text_config"]
    generation = GenerationConfig.from_pretrained(str(out))
    assert (generation.bos_token_id, generation.pad_token_id) == (config["bos_token_id"], config["pad_token_id"])
    ends = list(dict.fromkeys([config["eos_token_id"], tok.special[IM_END]]))  # one id when they coincide
    assert generation.eos_token_id == (ends if len(ends) > 1 else ends[0])
    hf = AutoTokenizer.from_pretrained(str(out))
    assert {t: hf.convert_tokens_to_ids(t) for t in tok.special} == tok.special
    assert (hf.eos_token, hf.pad_token_id) == (IM_END, tok.pad_id)  # a turn's end and Tessera's padding
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe the image."}]
    text = hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert text == "".join(f"{IM_START}{t['role']}\n{t['content']}{IM_END}\n" for t in turns) + f"{IM_START}assistant\n"
    if kind == "tokenizer.json":
        ours = encode_conversation(tok, turns, [], []).tokens.tolist() + tok.template(IM_START, "assistant\n").tolist()
        assert hf(text, add_special_tokens=False).input_ids == ours
        # exported again into OUT with OUT's tokenizer: kept; with another: the previous export's files go
        _export(tmp_path, "nemotron_h_tiny_dense", "radio_vit_tiny", None, str(out / kind))
        assert (out / kind).read_bytes() == path.read_bytes()
        spm = train_sentencepiece(TOKENIZER_TEXTS * 4, tmp_path / "tokenizer", vocab_size=120)
        _export(tmp_path, "nemotron_h_tiny_dense", "radio_vit_tiny", None, str(spm))
        assert not (out / kind).exists() and (out / "tokenizer.model").read_bytes() == spm.read_bytes()


def test_registry_export_names_its_class_and_the_media_ids_of_the_tokenizer_it_ships(tmp_path):
    """A run from registry names with the release's towers (RADIO, Parakeet) exports config.json with
    `architectures` (AutoModelForImageTextToText, transformers' auto class of this model type, loads it) and the
    <image> / <video> / <so_embedding> ids of the tokenizer it ships; Tessera reads them back as that tokenizer's
    (the pre-launch check of a tokenizer against a checkpoint finds nothing to refuse). Without a tokenizer the
    export names no ids."""
    from transformers import AutoConfig, AutoModelForImageTextToText, NemotronH_Omni_Reasoning_V3

    from tessera.data.run_tokenizer import disagreements
    from tessera.data.templates import PROCESSOR_TAGS
    from tessera.data.tokens import Tokenizer
    from tessera.models.released import media_token_ids, read_config
    from tessera.scripts.tiny_release import release_tokenizer

    release_tokenizer(tmp_path / "tok")
    path = tmp_path / "tok" / "tokenizer.json"
    out = _export(tmp_path, "nemotron_h_tiny_moe", "radio_vit_tiny", "parakeet_hf_tiny", str(path),
                  Tokenizer(path).vocab_size)
    special = Tokenizer(path).special
    want = {kind: special[tag] for kind, tag in PROCESSOR_TAGS.items()}
    config = AutoConfig.from_pretrained(str(out))
    assert config.architectures == ["NemotronH_Omni_Reasoning_V3"]
    assert {k: getattr(config, f"{k}_token_id") for k in want} == want
    assert media_token_ids(read_config(out)) == want
    assert type(AutoModelForImageTextToText.from_pretrained(str(out))) is NemotronH_Omni_Reasoning_V3
    assert disagreements(Tokenizer(out / "tokenizer.json"), read_config(out)) == []  # the pre-launch id check
    bare = _export(tmp_path / "bare", "nemotron_h_tiny_moe", "radio_vit_tiny", "parakeet_hf_tiny")
    assert json.loads((bare / "config.json").read_text()).get("image_token_id") is None
