"""`hf:DIR` takes any transformers encoder by contract (issue 59), not by a list of model types: six types the code
never names (DINOv2, DINOv2 with registers, DeiT, BEiT; WavLM, Data2Vec-Audio, SEW), built tiny offline with their
own processors, give the model's own features through its own processor; what is not listed is measured on the
meta device (class/register tokens, hidden size, a clip's rows checked against the conv stack); a model that is
not an encoder, or a directory the data side could not feed, is refused before launch naming DIR, its type and why.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.models.encoder_families import hf_transformers as hft
from tessera.models.encoder_families.base import family_of
from tessera.models.encoder_families.hf_contract import HFEncoderError

VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
WAVE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16, 16),
            conv_kernel=(10, 3, 3), conv_stride=(5, 2, 2), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4, vocab_size=32)
TILE = dict(size={"height": 32, "width": 32}, crop_size={"height": 32, "width": 32})
# model type -> (builder of the model and its processor, the class/register tokens its output starts with)
VISION = {
    "dinov2": (lambda t: (t.Dinov2Model(t.Dinov2Config(**VIT, mlp_ratio=2, drop_path_rate=0.3)),
                          t.BitImageProcessorPil(size={"shortest_edge": 32}, crop_size=TILE["crop_size"])), 1),
    "dinov2_with_registers": (lambda t: (
        t.Dinov2WithRegistersModel(t.Dinov2WithRegistersConfig(**VIT, mlp_ratio=2, num_register_tokens=3,
                                                               hidden_dropout_prob=0.2)),
        t.BitImageProcessorPil(size={"shortest_edge": 32}, crop_size=TILE["crop_size"])), 4),
    "deit": (lambda t: (t.DeiTModel(t.DeiTConfig(**VIT, intermediate_size=64, attention_probs_dropout_prob=0.2)),
                        t.DeiTImageProcessorPil(**TILE)), 2),  # class + distillation token
    "beit": (lambda t: (t.BeitModel(t.BeitConfig(**VIT, intermediate_size=64, use_relative_position_bias=True,
                                                 drop_path_rate=0.2)),
                        t.BeitImageProcessorPil(**TILE, do_center_crop=False)), 1),
}
AUDIO = {  # SEW: another conv stack, squeezed and upsampled around its layers; Data2Vec-Audio: layer-normed convs
    # (every one 320 samples a row, as the released models: the tiny omni recipe's clips fit its 128-token rows, so
    # the recipe trains each by one override: tests/test_hf_encoders.py's TRAIN_CASES)
    "wavlm": lambda t: t.WavLMModel(t.WavLMConfig(**dict(WAVE, conv_kernel=(10, 8, 8), conv_stride=(5, 8, 8)),
                                                  num_buckets=16, max_bucket_distance=64, layerdrop=0.5)),
    "data2vec-audio": lambda t: t.Data2VecAudioModel(t.Data2VecAudioConfig(
        **dict(WAVE, num_conv_pos_embeddings=5, conv_kernel=(8, 8, 10), conv_stride=(4, 8, 10)), mask_time_prob=0.5)),
    # (320 samples a row, as the released models: the tiny recipes' clips then fit their 128-token rows)
    "sew": lambda t: t.SEWModel(t.SEWConfig(**dict(WAVE, conv_kernel=(10, 8, 4), conv_stride=(5, 8, 8)),
                                            squeeze_factor=2)),
}


def build_tiny(kind: str, out: Path) -> Path:
    """A random tiny model of `kind` with its processor, saved as a user's checkpoint directory is."""
    import transformers

    torch.manual_seed(len(kind))
    if kind in VISION:
        model, proc = VISION[kind][0](transformers)
    else:
        model, proc = AUDIO[kind](transformers), transformers.Wav2Vec2FeatureExtractor(do_normalize=True)
    model.save_pretrained(out)
    proc.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_any")
    return {kind: build_tiny(kind, root / kind) for kind in (*VISION, *AUDIO)}


def test_the_types_are_never_named_by_the_code():
    """No string of the code names them: nothing branches on them (comments may give them as examples)."""
    source = "".join(p.read_text() for p in Path(hft.__file__).parent.glob("hf_*.py"))
    source += Path(hft.__file__).parents[1].joinpath("hf_towers.py").read_text()
    assert not [k for k in (*VISION, *AUDIO) if re.search(rf"[\"']{k}", source, flags=re.I)]


@pytest.mark.parametrize("kind", list(VISION))
def test_vision_features_equal_the_models_own_forward_through_its_processor(dirs, kind):
    """Built as training builds it (train mode, dropout and drop path set in the config), on two random tiles; the
    class / register tokens (measured: the forward's tokens less the tile's patches) are what is dropped."""
    from transformers import AutoImageProcessor, AutoModel

    cfg = hft.encoder_config_of(f"hf:{dirs[kind]}")
    assert (cfg.family, cfg.tile, cfg.patch, cfg.hidden, cfg.layers) == ("hf_vision", 32, 8, 32, 2)
    assert cfg.prefix_tokens == VISION[kind][1] and cfg.pipeline == (kind != "beit")
    tiles = np.random.default_rng(0).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
    ours = family_of(cfg).build(cfg, None).train()(torch.from_numpy(tiles))
    model, proc = AutoModel.from_pretrained(dirs[kind]).eval(), AutoImageProcessor.from_pretrained(dirs[kind])
    with torch.no_grad():
        ref = model(**proc(images=[t.transpose(1, 2, 0) for t in tiles], return_tensors="pt")).last_hidden_state
    assert ours.shape == (2 * family_of(cfg).tokens(cfg).tokens_per_tile, 32) == (2 * 16, 32)
    torch.testing.assert_close(ours, ref[:, VISION[kind][1]:].flatten(0, 1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", list(AUDIO))
def test_audio_features_equal_the_models_own_forward_through_its_feature_extractor(dirs, kind):
    """Two clips of other lengths in one batch; each gives the model's own rows, as many as the data side counts."""
    from transformers import AutoFeatureExtractor, AutoModel

    cfg = hft.encoder_config_of(f"hf:{dirs[kind]}")
    family = family_of(cfg)
    assert (cfg.family, cfg.hidden, cfg.layers) == ("hf_audio", 32, 2)
    waves = [np.random.default_rng(1).standard_normal(n).astype(np.float32) * 0.1 for n in (5_923, 21_000)]
    ours = family.build(cfg, None).train()([torch.from_numpy(w) for w in waves])
    model, fe = AutoModel.from_pretrained(dirs[kind]).eval(), AutoFeatureExtractor.from_pretrained(dirs[kind])
    for wave, got in zip(waves, ours):
        with torch.no_grad():
            ref = model(fe(wave, sampling_rate=16000, return_tensors="pt")["input_values"]).last_hidden_state[0]
        assert len(ref) == int(model._get_feat_extract_output_lengths(len(wave)))  # the model's own count
        assert got.shape == ref.shape and len(got) == family.tokens(cfg).audio_tokens(len(wave))
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["dinov2", "dinov2_with_registers", "deit"])
def test_vision_pipeline_stages_compose_to_the_models_forward(dirs, kind):
    """Where the list of layers is found (and embeddings -> layers -> final norm is the forward, checked when the
    config is made), two stages of a layer each run as MediaModule.forward_stage runs them == the whole tower."""
    from tessera.models.hf_towers import HFVisionEncoder

    cfg = hft.encoder_config_of(f"hf:{dirs[kind]}")
    assert (cfg.layer_list, cfg.final_norm) == ("layers" if kind == "deit" else "encoder.layer", "layernorm")
    whole, first, last = (HFVisionEncoder(cfg, pp=pp, stage=stage) for pp, stage in ((1, 0), (2, 0), (2, 1)))
    kept = {re.search(r"layers?\.(\d+)\.", k)[1] for k in last.vit.state_dict() if re.search(r"layers?\.\d", k)}
    assert kept == {"1"}  # named by their global index
    assert not any("embeddings" in k for k in last.vit.state_dict())
    assert not any(k.startswith("model.layernorm.") for k in first.vit.state_dict())  # the final norm: last stage
    tiles = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8))
    hidden = first.vit.run_stage_layers(first.vit.embed(first.normalize(tiles)).transpose(0, 1))
    grid = last.vit.head(last.vit.run_stage_layers(hidden), 4, 4)
    torch.testing.assert_close(grid, whole.grid_tokens(tiles), rtol=0, atol=1e-6)


def test_measuring_a_model_leaves_the_processs_random_state_alone(dirs, tmp_path):
    """The checks run models at random weights; a rank's own initialisation after them must not depend on them."""
    import shutil

    fresh = shutil.copytree(dirs["dinov2"], tmp_path / "dinov2")  # (a new path: not the cached config)
    before = torch.random.get_rng_state()
    assert hft.encoder_config_of(f"hf:{fresh}").pipeline
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_split_a_tower_cannot_run_is_refused_naming_the_layout_that_works(dirs):
    """BEiT's layers take its relative position bias: no stage split, dp only; no untabled type splits tokens."""
    from types import SimpleNamespace

    def groups(**sizes):
        return SimpleNamespace(**{k: SimpleNamespace(size=lambda n=n: n, rank=lambda: 0) for k, n in sizes.items()})

    beit = hft.encoder_config_of(f"hf:{dirs['beit']}")
    with pytest.raises(ValueError, match=r"runs dp only, not pp2: give model.vision a layout of dp"):
        family_of(beit).build(beit, groups(pp=2, cp=1))
    dinov2 = hft.encoder_config_of(f"hf:{dirs['dinov2']}")
    with pytest.raises(ValueError, match=r"runs dp and pp only, not cp2"):
        family_of(dinov2).build(dinov2, groups(pp=1, cp=2))
    wavlm = hft.encoder_config_of(f"hf:{dirs['wavlm']}")
    with pytest.raises(ValueError, match=r"runs dp only, not pp2: give model.audio a layout of dp"):
        family_of(wavlm).build(wavlm, groups(pp=2, cp=1))


def _save(directory: Path, model, processor=None) -> str:
    model.save_pretrained(directory)
    if processor is not None:
        processor.save_pretrained(directory)
    return f"hf:{directory}"


def test_a_model_that_is_not_an_encoder_is_refused_naming_what_was_checked(tmp_path):
    import transformers as t

    lm = _save(tmp_path / "gpt2", t.GPT2Model(t.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64)))
    with pytest.raises(HFEncoderError, match=r"gpt2.*model_type 'gpt2'.*a causal language model .*checked for a "
                                             r"vision tower"):
        hft.encoder_config_of(lm)
    # an image model with patches but no per-item hidden states: a CNN's last_hidden_state is a feature map
    cnn = _save(tmp_path / "convnext", t.ConvNextModel(t.ConvNextConfig(patch_size=4, num_stages=2,
                                                                        hidden_sizes=[8, 16], depths=[1, 1])),
                t.ConvNextImageProcessorPil(size={"shortest_edge": 32}))
    with pytest.raises(HFEncoderError, match=r"'convnext'.*gives last_hidden_state of shape \[1, 16, 4, 4\], not "
                                             r"the per-item hidden states \[1, tokens, hidden\] of an encoder"):
        hft.encoder_config_of(cnn)


def test_a_directory_the_data_side_cannot_feed_is_refused_naming_dir_type_and_reason(tmp_path, dirs):
    import shutil

    import transformers as t

    bert = _save(tmp_path / "bert", t.BertModel(t.BertConfig(hidden_size=32, num_hidden_layers=1,
                                                             num_attention_heads=4, intermediate_size=64)))
    with pytest.raises(HFEncoderError, match=rf"hf:{tmp_path}/bert \(model_type 'bert'\) .*preprocessor_config"
                                             r"\.json not found"):
        hft.encoder_config_of(bert)
    ocr = tmp_path / "ocr"  # a processor whose OCR step needs pytesseract, which the data side does not have
    shutil.copytree(dirs["dinov2"], ocr)
    t.LayoutLMv2ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(ocr)
    with pytest.raises(HFEncoderError, match=r"'dinov2'.*its image processor \(LayoutLMv2ImageProcessor.*\) needs "
                                             r"pytesseract, which is not installed \(pip install pytesseract\)"):
        hft.encoder_config_of(f"hf:{ocr}")
    # an adapter that strides the encoder's output again: its rows are not the conv stack's, the data side could
    # not count its tokens
    strided = _save(tmp_path / "strided", t.Data2VecAudioModel(t.Data2VecAudioConfig(
        **dict(WAVE, num_conv_pos_embeddings=5), add_adapter=True, adapter_stride=2, num_adapter_layers=1,
        output_hidden_size=32)), t.Wav2Vec2FeatureExtractor())
    with pytest.raises(HFEncoderError, match=r"'data2vec-audio'.*output length for a clip cannot be determined: "
                                             r"16000 samples give 400 rows, its conv stack 799"):
        hft.encoder_config_of(strided)
