"""`model.vision=hf:DIR` / `model.audio=hf:DIR`: a local transformers encoder as a family of its own
(models/encoder_families/hf_transformers.py). Tiny SigLIP2, CLIP, Whisper, wav2vec2 and HuBERT models are built
offline (random init, save_pretrained with their PIL image processor or feature extractor); Tessera's encoder must
give the transformers model's own output on the processor's own input, and the data side's token count must be its
length."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.models.encoder_families import hf_contract, hf_transformers as hft
from tessera.models.encoder_families.base import family_of
from tests.test_hf_any_encoder import build_tiny


def _siglip2(out: Path) -> Path:
    from transformers import Siglip2Config, Siglip2ImageProcessorPil, Siglip2Model

    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=16,
                  num_patches=16)
    Siglip2Model(Siglip2Config(text_config=text, vision_config=vision)).save_pretrained(out)
    Siglip2ImageProcessorPil(patch_size=16, max_num_patches=16).save_pretrained(out)  # 64-px tiles: 4x4 patches
    return out


def _clip(out: Path) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

    torch.manual_seed(1)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=64,
                  patch_size=16)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision)).save_pretrained(out)
    CLIPImageProcessorPil(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(out)
    return out


def _whisper(out: Path) -> Path:
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperModel

    torch.manual_seed(2)
    config = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                           decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, num_mel_bins=16,
                           max_source_positions=50, max_target_positions=16, vocab_size=64, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    WhisperModel(config).save_pretrained(out)
    # a 1-second window: 100 mel frames, 50 encoder rows (max_source_positions)
    WhisperFeatureExtractor(feature_size=16, chunk_length=1).save_pretrained(out)
    return out


def _wav2vec2(out: Path) -> Path:
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

    torch.manual_seed(3)
    config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                            conv_dim=(16, 16, 16), conv_kernel=(10, 3, 3), conv_stride=(5, 2, 2),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=32)
    Wav2Vec2Model(config).save_pretrained(out)
    Wav2Vec2FeatureExtractor(do_normalize=True).save_pretrained(out)
    return out


def _hubert(out: Path) -> Path:
    from transformers import HubertConfig, HubertModel, Wav2Vec2FeatureExtractor

    torch.manual_seed(4)
    config = HubertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
                          num_conv_pos_embedding_groups=4, vocab_size=32)
    HubertModel(config).save_pretrained(out)
    Wav2Vec2FeatureExtractor(do_normalize=False).save_pretrained(out)
    return out


BUILDERS = {"siglip2": _siglip2, "clip": _clip, "whisper": _whisper, "wav2vec2": _wav2vec2, "hubert": _hubert,
            # types the code never names (tests/test_hf_any_encoder.py): for the layouts below
            **{k: functools.partial(build_tiny, k) for k in ("dinov2", "dinov2_with_registers", "deit", "beit",
                                                             "wavlm", "data2vec-audio", "sew")}}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_encoders")
    return {kind: build(root / kind) for kind, build in BUILDERS.items()}


def _reference_vision(directory: Path, tiles: np.ndarray) -> torch.Tensor:
    """The transformers model's own vision features of `tiles` through its own processor: [n, patches, hidden]."""
    from transformers import AutoImageProcessor, AutoModel

    model, proc = AutoModel.from_pretrained(directory), AutoImageProcessor.from_pretrained(directory)
    inputs = proc(images=[t.transpose(1, 2, 0) for t in tiles], return_tensors="pt")
    with torch.no_grad():
        out = model.vision_model(**inputs).last_hidden_state
    return out[:, 1:] if model.config.model_type == "clip" else out


def _reference_audio(directory: Path, wave: np.ndarray) -> torch.Tensor:
    """The transformers encoder's rows over the clip, from its own feature extractor: [rows, hidden]."""
    from transformers import AutoFeatureExtractor, AutoModel

    model, fe = AutoModel.from_pretrained(directory), AutoFeatureExtractor.from_pretrained(directory)
    inputs = fe(wave, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
    with torch.no_grad():
        if model.config.model_type == "whisper":
            frames = int(inputs["attention_mask"].sum())
            return model.encoder(inputs["input_features"]).last_hidden_state[0, :(frames - 1) // 2 + 1]
        out = model(inputs["input_values"]).last_hidden_state[0]
    assert len(out) == int(model._get_feat_extract_output_lengths(len(wave)))
    return out


@pytest.mark.parametrize("kind", ["siglip2", "clip"])
def test_vision_features_equal_the_models_own_forward_through_its_processor(dirs, kind):
    """Built as training builds it (train mode: dropout is off, so it is deterministic), on two random tiles."""
    name = f"hf:{dirs[kind]}"
    cfg = hft.encoder_config_of(name)
    assert (cfg.family, cfg.modality, cfg.tile, cfg.patch) == ("hf_vision", "vision", 64, 16)
    family = family_of(cfg)
    tiles = np.random.default_rng(0).integers(0, 256, (2, 3, 64, 64), dtype=np.uint8)
    encoder = family.build(cfg, None)
    ours = encoder(torch.from_numpy(tiles))
    ref = _reference_vision(dirs[kind], tiles)
    tokens = family.tokens(cfg)
    assert ours.shape == (2 * tokens.tokens_per_tile, 32) == (ref.shape[0] * ref.shape[1], ref.shape[2])
    torch.testing.assert_close(ours, ref.flatten(0, 1), rtol=0, atol=1e-5)
    assert encoder.to(torch.bfloat16)(torch.from_numpy(tiles)).dtype == torch.bfloat16  # runs in the run's dtype
    if kind == "clip":  # a fixed position table: a native-resolution grid is refused, naming the fix
        with pytest.raises(ValueError, match=r"takes 64-px tiles, got 96x32 images: use it with tiled images"):
            encoder(torch.zeros(1, 3, 32, 96, dtype=torch.uint8))


@pytest.mark.parametrize("kind", ["siglip2", "clip"])
def test_vision_pipeline_stages_compose_to_the_models_forward(dirs, kind):
    """Two pipeline stages (a layer each, named by their global index) run as MediaModule.forward_stage runs them:
    embed and stage 0's layer, stage 1's layer and head == the whole tower's forward."""
    from tessera.models.hf_towers import HFVisionEncoder

    cfg = hft.encoder_config_of(f"hf:{dirs[kind]}")
    whole, first, last = (HFVisionEncoder(cfg, pp=pp, stage=stage) for pp, stage in ((1, 0), (2, 0), (2, 1)))
    assert {re.search(r"layers\.(\d+)\.", k)[1] for k in last.vit.state_dict() if ".layers." in k} == {"1"}
    assert not any("embeddings" in k for k in last.vit.state_dict())
    tiles = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (2, 3, 64, 64), dtype=np.uint8))
    hidden = first.vit.run_stage_layers(first.vit.embed(first.normalize(tiles)).transpose(0, 1))
    grid = last.vit.head(last.vit.run_stage_layers(hidden), 4, 4)
    torch.testing.assert_close(grid, whole.grid_tokens(tiles), rtol=0, atol=1e-6)


def test_a_split_the_tower_cannot_run_is_refused_naming_the_fix(dirs):
    from types import SimpleNamespace

    def groups(**sizes):
        return SimpleNamespace(**{k: SimpleNamespace(size=lambda n=n: n, rank=lambda: 0) for k, n in sizes.items()})

    audio = hft.encoder_config_of(f"hf:{dirs['whisper']}")
    with pytest.raises(ValueError, match=r"runs dp only, not pp2: give model.audio a layout of dp"):
        family_of(audio).build(audio, groups(pp=2, cp=1))
    vision = hft.encoder_config_of(f"hf:{dirs['clip']}")
    with pytest.raises(ValueError, match=r"runs dp and pp only, not cp2"):
        family_of(vision).build(vision, groups(pp=1, cp=2))
    assert family_of(vision).build(vision, groups(pp=2, cp=1)).vit.pp == 2


@pytest.mark.parametrize("kind", ["whisper", "wav2vec2", "hubert"])
def test_audio_features_equal_the_models_own_forward_through_its_feature_extractor(dirs, kind):
    """Two clips in one batch, one shorter than Whisper's 1-s window and one cut by it; the rows kept are the data
    side's count (EncoderTokens.audio_tokens)."""
    cfg = hft.encoder_config_of(f"hf:{dirs[kind]}#audio")
    family = family_of(cfg)
    rng = np.random.default_rng(1)
    waves = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (5_923, 21_000)]
    ours = family.build(cfg, None)([torch.from_numpy(w) for w in waves])
    for wave, got in zip(waves, ours):
        ref = _reference_audio(dirs[kind], wave)
        assert got.shape == ref.shape and len(got) == family.tokens(cfg).audio_tokens(len(wave))
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    if kind == "whisper":
        assert [len(o) for o in ours] == [19, 50]  # ceil(ceil(5923 / 160) / 2); the whole window


def test_name_forms_are_told_apart_by_the_directorys_config_json(dirs, tmp_path):
    from tessera.models import encoders

    assert hft.is_transformers_encoder(f"hf:{dirs['whisper']}")
    assert hft.is_transformers_encoder(f"hf:{dirs['siglip2']}#vision")
    release = tmp_path / "release"
    release.mkdir()
    (release / "config.json").write_text(json.dumps({"model_type": "nemotron_h_omni"}))
    assert not hft.is_transformers_encoder(f"hf:{release}#vision")  # a release's encoder: models/released.py
    with pytest.raises(hft.HFEncoderError, match=r"is a release; name one of its encoders: hf:.*#vision"):
        hft.is_transformers_encoder(f"hf:{release}")
    with pytest.raises(hft.HFEncoderError, match=r"holds a audio encoder \(whisper\), not a vision one"):
        hft.encoder_config_of(f"hf:{dirs['whisper']}#vision")
    assert encoders.encoder_config(f"hf:{dirs['siglip2']}").family == "hf_vision"


def test_a_directory_hf_dir_cannot_take_is_refused_naming_it_and_why(tmp_path):
    """Any model type is tried by contract (tests/test_hf_any_encoder.py); one transformers does not know, or one
    with no processor to feed it, is refused naming DIR, its model type and the reason."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert hft.is_transformers_encoder(f"hf:{tmp_path}")  # (not a release: the contract decides)
    with pytest.raises(hft.HFEncoderError) as e:
        hft.encoder_config_of(f"hf:{tmp_path}")
    assert f"hf:{tmp_path} (model_type 'bert')" in str(e.value) and "preprocessor_config.json not found" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_type"}))
    with pytest.raises(hft.HFEncoderError, match=r"'no_such_type'.*AutoConfig does not build it"):
        hft.encoder_config_of(f"hf:{tmp_path}#audio")
    with pytest.raises(hft.HFEncoderError, match="config.json not found"):
        hft.is_transformers_encoder(f"hf:{tmp_path / 'missing'}")


# (recipe, override, model, layout on 2 ranks): colocated (the tower's two pipeline stages on the LLM's TP ranks)
# and non-colocated (the encoders on rank 0, the LLM on rank 1), for table types and for two the code never names
# (class + register tokens; a squeezed conv stack); each run is minutes of shared CPU, so one each
TRAIN_CASES = [
    ("nemotron_vl_tiny", "vision", "siglip2", "vision=pp2@0-1;language=tp2@0-1"),
    ("nemotron_omni_tiny", "audio", "whisper", "vision=dp1@0-0;audio=dp1@0-0;language=dp1@1-1"),
    # every type tests/test_hf_any_encoder.py builds, which the code never names, non-colocated
    *[("nemotron_vl_tiny", "vision", k, "vision=dp1@0-0;language=dp1@1-1")
      for k in ("dinov2", "dinov2_with_registers", "deit", "beit")],
    *[("nemotron_omni_tiny", "audio", k, "vision=dp1@0-0;audio=dp1@0-0;language=dp1@1-1")
      for k in ("wavlm", "data2vec-audio", "sew")],
]


def _verify(argv: list[str]) -> tuple[int, str]:
    """tessera.recipes.verify's main on this rank: (exit code, what it printed)."""
    import contextlib
    import io

    from tessera.recipes import verify

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = verify.main(argv)
    return code, out.getvalue()


@pytest.mark.multiproc
@pytest.mark.parametrize("recipe,key,kind,layout", TRAIN_CASES)
def test_recipe_trains_with_one_override_equal_to_one_device(dirs, tmp_path, recipe, key, kind, layout):
    """`model.<key>=hf:DIR` in a tiny recipe: one step through the trainer in the layout (tessera.recipes.verify's
    main on 2 forked ranks; the command under torchrun: tests/test_verify_trainer.py) has the same loss and every
    Adam moment as on one device (fp32, 1e-5); the tower's moments are among them and not zero (its gradient
    crossed the boundary), and it started from DIR's weights."""
    from tessera.hetero.tools.spawn import run_on_ranks

    argv = ["--recipe", recipe, "--out", str(tmp_path), f"layout={layout}", f"model.{key}=hf:{dirs[kind]}",
            "data.seq_length=128"]
    (code, out), _ = run_on_ranks(2, _verify, argv, timeout=900)
    assert code == 0, out[-3000:]
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"verify: PASS max_rel_err=(\S+) compared=(\d+) loss=(\S+) ref_loss=(\S+) layout=(\S+)", last)
    assert m and float(m.group(1)) <= 1e-5, last
    whole = torch.load(tmp_path / "layout" / "whole.pt", weights_only=True)
    cfg = hft.encoder_config_of(f"hf:{dirs[kind]}")
    tower = family_of(cfg).checkpoint_module(family_of(cfg).build(cfg, None))  # DIR's weights, via transformers
    root = f"{key}.encoder.{'vit' if key == 'vision' else 'encoder'}."
    moments = [whole[f"optim.exp_avg.{root}{k}"] for k, _ in tower.named_parameters()]
    assert max(float(t.abs().max()) for t in moments) > 0, f"no {key} tower gradient"
    # one Adam step moves a weight by at most about the lr (1e-3 in the tiny recipes): a fresh init differs by more
    drift = max(float((whole[f"model.{root}{k}"] - v).abs().max()) for k, v in tower.state_dict().items())
    assert drift <= 2e-3, f"the {key} tower did not start from {dirs[kind]}'s weights (drift {drift:.3g})"


@pytest.mark.parametrize("vision_kind,audio_kind", [("siglip2", "wav2vec2"), ("dinov2_with_registers", "sew")])
def test_planner_counts_the_built_parameters_and_torchs_flops(dirs, vision_kind, audio_kind):
    """The planner's module descriptions (family.planner_fields): parameters = the built encoder + projector's;
    FLOPs per item = FlopCounterMode's count of the tower's meta forward plus the projector, and activation bytes =
    what autograd saves in it, for audio at a clip length the rows x (linear + attn x rows) fit was not solved at."""
    from tessera.hetero.planner.flops import media_item_flops
    from tessera.hetero.planner.model import describe_model
    from tessera.models.multimodal import build_media_module

    vision, audio = f"hf:{dirs[vision_kind]}", f"hf:{dirs[audio_kind]}"
    desc = describe_model("nemotron_h_tiny_dense", vision, audio)
    llm = desc["language"].hidden
    for key, name in (("vision", vision), ("audio", audio)):
        built = build_media_module(name, llm, None)
        assert desc[key].params == sum(p.numel() for p in built.parameters()), key
    cfg = hft.encoder_config_of(audio)
    tok, samples = family_of(cfg).tokens(cfg), 24_000
    rows, proj = tok.audio_encoder_rows(samples), 2.0 * (32 * 128 + 128 * llm)
    _, flops, act = hf_contract.measured_cost(cfg, samples)
    assert media_item_flops(desc["audio"], tok, "audio", samples) == pytest.approx(flops + rows * proj, rel=0.01)
    assert rows * (desc["audio"].act_replicated + desc["audio"].act_ctx * rows) == pytest.approx(act, rel=0.02)
    vcfg = hft.encoder_config_of(vision)
    _, flops, act = hf_contract.measured_cost(vcfg)
    assert media_item_flops(desc["vision"], family_of(vcfg).tokens(vcfg), "image", 1) == pytest.approx(
        flops + 16 * proj)
    assert desc["vision"].tokens_per_tile * desc["vision"].act_replicated == pytest.approx(act) and act > 0
