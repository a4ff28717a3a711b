"""The releases' config.json as downloaded (issue 46 items 1, 4): the hub's remote-code layouts read as
transformers' native one (models/release_layouts.py), and `model.checkpoint=ORG/NAME[@REV]` found in the local
Hugging Face cache (models/hub_cache.py). Exact logits on the hub layout: tests/test_parity_multimodal.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_release_layouts.py -q -p no:cacheprovider
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tessera.models.encoders import encoder_config
from tessera.models.released import (CheckpointConfigError, encoder_name, llm_fields_of, media_token_ids,
                                     modalities_of, read_config)
from tessera.scripts.tiny_release import (DENSE_TEXT, HUB_OMNI_NAMES, NANO_VL_PREFIX_TOKENS, NOT_IN_NANO_VL,
                                          hub_layout, nano_vl_checkpoint, nano_vl_config, omni_checkpoint)


@pytest.fixture(scope="module")
def native_and_hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    native, hub = root / "native", root / "hub"
    omni_checkpoint(native, tokenizer=True)
    shutil.copytree(native, hub)
    hub_layout(hub, sound_model_type="parakeet")  # as the hub file types its Parakeet
    return native, hub


def _encoders(directory) -> dict:
    out = {}
    for m in modalities_of(read_config(directory)):
        out[m] = dataclasses.replace(encoder_config(encoder_name(directory, m)), name="")  # (the directory's own)
    return out


def test_hub_omni_reads_as_transformers_native(native_and_hub):
    """Only config.json differs (legacy names, hub model_type, auto_map, sound_config typed `parakeet`): the
    LLM, both encoders and the media token ids Tessera reads are the native file's, field for field."""
    native, hub = native_and_hub
    raw = json.loads((hub / "config.json").read_text())
    assert raw["model_type"] == "NemotronH_Nano_Omni_Reasoning_V3" and set(HUB_OMNI_NAMES.values()) <= set(raw)
    assert not {"text_config", "audio_config", "image_token_id"} & set(raw)
    a, b = read_config(native), read_config(hub)
    assert llm_fields_of(b) == llm_fields_of(a)
    assert modalities_of(b) == modalities_of(a) == ["vision", "audio"]
    assert media_token_ids(b) == media_token_ids(a) and set(media_token_ids(b)) == {"image", "video", "audio"}
    assert _encoders(hub) == _encoders(native)


def test_hub_omni_every_tensor_consumed_and_exported_back(native_and_hub):
    from test_released_checkpoint import _tessera_model
    from safetensors.torch import load_file

    from tessera.models.multimodal_hf import export_hf, import_hf

    _, hub = native_and_hub
    released = load_file(str(hub / "model.safetensors"))
    model = _tessera_model(hub)
    import_hf(model, released)
    again = export_hf(model)
    assert sorted(again) == sorted(released)
    assert [k for k in released if not torch.equal(again[k], released[k])] == []


def test_transformers_native_class_reads_the_hub_file_as_tessera_does(native_and_hub):
    """The oracle side: transformers' class called directly on the hub file (legacy names remapped there) has
    the token ids and sizes Tessera reads (sound_config typed as transformers writes it: 5.24 cannot parse
    `parakeet`, which Tessera reads; tests above)."""
    from transformers import NemotronH_Omni_Reasoning_V3_Config

    _, hub = native_and_hub
    raw = NemotronH_Omni_Reasoning_V3_Config._dict_from_json_file(hub / "config.json")  # transformers' reader
    raw["sound_config"]["model_type"] = "parakeet_encoder"
    ref = NemotronH_Omni_Reasoning_V3_Config(**{k: v for k, v in raw.items() if k != "model_type"})
    ids = media_token_ids(read_config(hub))
    assert (ref.image_token_id, ref.video_token_id, ref.audio_token_id) == (ids["image"], ids["video"], ids["audio"])
    assert ref.text_config.hybrid_override_pattern == llm_fields_of(read_config(hub))["hybrid_override_pattern"]
    assert ref.audio_config.hidden_size == _encoders(hub)["audio"].hidden


# ---- Nemotron Nano V2 VL as downloaded (NemotronH_Nano_VL_V2: no transformers class) --------------------------

def test_nano_vl_hub_config_gives_every_module_its_shape(tmp_path):
    nano_vl_config(tmp_path)
    config = read_config(tmp_path)
    assert modalities_of(config) == ["vision"] and media_token_ids(config) == {"image": 18}
    llm = llm_fields_of(config)
    assert {k: llm[k] for k in DENSE_TEXT} == DENSE_TEXT
    v = encoder_config(encoder_name(tmp_path, "vision"))
    # vit_small_patch16_224: 384 wide, 12 layers, 6 heads, MLP 1536; cpe_max_size 256 / 16-px patches = 16
    assert (v.family, v.hidden, v.layers, v.heads, v.ffn, v.patch, v.pos_grid) == (
        "radio", 384, 12, 6, 1536, 16, 16)
    assert (v.prefix_tokens, v.pixel_shuffle, v.temporal_patch, v.projector_hidden, v.tile) == (
        NANO_VL_PREFIX_TOKENS, 2, 0, 96, 64)
    assert (v.mean, v.std, v.final_norm) == ((0.48, 0.46, 0.41), (0.27, 0.26, 0.28), False)
    # neither RadioModel buffer nor a layer scale is in these weights, so the model holds none
    assert (v.summary_idxs, v.input_conditioner, v.layer_scale) == (None, False, None)


@pytest.mark.parametrize("over, match", [
    (dict(ps_version="v1"), r"ps_version 'v1'.*v2"),
    (dict(use_thumbnail=False), r"use_thumbnail false.*thumbnail"),
    (dict(llm_config=None), r"lacks llm_config"),
    (dict(vit_hidden_size=1280), r"vit_hidden_size 1280 but args.model 'vit_small_patch16_224' is 384 wide"),
    (dict(vision_config=dict(args=dict(model="eva02_large"))), r"args.model 'eva02_large' is not a ViT.*vit_huge"),
    (dict(vision_config=dict(patch_size=16)), r"vision_config has no args.model"),
])
def test_nano_vl_bad_config_names_the_field(tmp_path, over, match):
    nano_vl_config(tmp_path, **over)
    with pytest.raises(CheckpointConfigError, match=match):
        read_config(tmp_path)


def test_nano_vl_without_prefix_table_names_the_tensor(tmp_path):
    nano_vl_config(tmp_path)
    save_file({"mlp1.0.weight": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointConfigError, match=r"patch_generator.cls_token.token"):
        read_config(tmp_path)


def test_hub_omni_remote_radio_that_disagrees_is_refused(native_and_hub, tmp_path):
    _, hub = native_and_hub
    shutil.copytree(hub, tmp_path / "c")
    raw = json.loads((tmp_path / "c" / "config.json").read_text())
    raw["vision_config"]["args"] = {"model": "vit_huge_patch16_224"}  # the tiny fields say 48 wide
    (tmp_path / "c" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointConfigError, match=r"vit_huge_patch16_224.*\(1280, 32, 16, 5120\).*\(48, 2, 4, 96\)"):
        read_config(tmp_path / "c")


def test_other_architecture_names_every_supported_layout(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "internvl_chat",
                                                      "architectures": ["InternVLChatModel"]}))
    with pytest.raises(CheckpointConfigError) as e:
        read_config(tmp_path)
    for name in ("internvl_chat", "InternVLChatModel", "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_VL_V2",
                 "nemotron_h_omni", "nemotron_h"):
        assert name in str(e.value)


def test_hub_layout_with_a_missing_shard_names_the_file(native_and_hub, tmp_path):
    from tessera.hetero.runspec.config import ModelConfig
    from tessera.recipes.prelaunch import check_checkpoint

    _, hub = native_and_hub
    d = tmp_path / "sharded"
    shutil.copytree(hub, d)
    index = {"metadata": {}, "weight_map": {"mlp1.0.weight": "model-00001-of-00002.safetensors",
                                            "mlp1.1.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"names 2 shard\(s\) but 1 is missing: model-00002-of-00002"):
        check_checkpoint(ModelConfig(checkpoint=str(d)))


def test_a_truncated_safetensors_file_is_named_with_both_sizes_before_launch(native_and_hub, tmp_path):
    """Issue 62 item 5: an interrupted download stopped the run on every rank with safetensors' "incomplete
    metadata, file not fully covered", no file named. The pre-launch check reads each header and names the file,
    the size its header describes, the size it has, and the command that fetches it again."""
    from safetensors import safe_open

    from tessera.hetero.runspec.config import ModelConfig
    from tessera.models.hub_cache import local_checkpoint
    from tessera.recipes.prelaunch import check_checkpoint

    _, hub = native_and_hub
    check_checkpoint(ModelConfig(checkpoint=str(hub)))  # whole files pass
    repo, commit = "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16", "c" * 40
    snap = _cache_snapshot(tmp_path / "hub", repo, commit)
    shutil.copytree(hub, snap, dirs_exist_ok=True)
    f = snap / "model.safetensors"
    full = f.stat().st_size
    f.write_bytes(f.read_bytes()[:full - 1000])
    with pytest.raises(Exception, match="incomplete metadata, file not fully covered"):
        safe_open(str(f), "pt")  # what a rank said before
    with pytest.raises(ValueError) as e:
        check_checkpoint(ModelConfig(checkpoint=local_checkpoint(repo, tmp_path / "hub")))
    assert (f"{f}: {full - 1000:,} bytes, but its header describes {full:,} (truncated, an interrupted download or "
            f"copy): re-download it: `hf download {repo} model.safetensors --revision {commit} --force-download`"
            ) in str(e.value)
    assert str(e.value).startswith(f"1 of the 1 *.safetensors file(s) in {snap} is not whole:")
    f.write_bytes(b"\x10\x00")  # cut inside the header's length
    with pytest.raises(ValueError, match=r"model.safetensors: not a whole safetensors file \(2 bytes, shorter than a "
                                         r"safetensors header's 8-byte length\): re-download it"):
        check_checkpoint(ModelConfig(checkpoint=str(snap)))


# ---- hub ids through the local cache ---------------------------------------------------------------------------

def _cache_snapshot(cache, repo: str, commit: str, refs: tuple[str, ...] = ("main",)):
    """The layout `hf download` leaves in HF_HUB_CACHE: models--ORG--NAME/{refs/REF, snapshots/COMMIT/...}."""
    base = cache / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    for ref in refs:  # refs/pr/3 and release/v1.0 are folders below refs/, as huggingface_hub writes them
        (base / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (base / "refs" / ref).write_text(commit)
    return snap


def test_hub_id_resolves_through_the_local_cache(tmp_path, monkeypatch):
    from tessera.models.hub_cache import HubCacheMiss, local_checkpoint

    cache, repo = tmp_path / "hub", "nvidia/Nemotron-Nano-VL-12B-V2"
    main = _cache_snapshot(cache, repo, "a" * 40)
    assert local_checkpoint(repo, cache) == str(main)
    assert local_checkpoint(f"{repo}@{'a' * 40}", cache) == str(main)
    with pytest.raises(HubCacheMiss) as e:
        local_checkpoint(f"{repo}@v2", cache)  # a revision never downloaded
    assert f"hf download {repo} --revision v2" in str(e.value) and str(cache) in str(e.value)
    with pytest.raises(HubCacheMiss) as e:
        local_checkpoint("nvidia/other", cache)
    assert "`hf download nvidia/other`" in str(e.value) and f"cache {cache} holds no snapshot" in str(e.value)
    # an existing local path of that spelling wins; a path that is no hub id is left to the checks after
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nvidia" / "other").mkdir(parents=True)
    assert local_checkpoint("nvidia/other", cache) == "nvidia/other"
    assert local_checkpoint("./no/such", cache) == "./no/such"
    assert local_checkpoint("/abs/no/such", cache) == "/abs/no/such"


def test_every_revision_form_the_hub_takes_resolves_from_the_cache_or_is_named(tmp_path):
    """Issue 62 item 5: branches and tags with `/`, `refs/pr/N`, a commit; a miss lists what the cache holds; an
    empty revision and a repo id huggingface_hub refuses are named or left to the directory checks."""
    from tessera.models.hub_cache import HubCacheMiss, local_checkpoint

    cache, repo, commit = tmp_path / "hub", "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16", "d" * 40
    snap = _cache_snapshot(cache, repo, commit, refs=("main", "refs/pr/3", "release/v1.0", "v1.0"))
    for rev in ("", "@main", "@refs/pr/3", "@release/v1.0", "@v1.0", f"@{commit}"):
        assert local_checkpoint(repo + rev, cache) == str(snap), rev
    with pytest.raises(HubCacheMiss) as e:
        local_checkpoint(f"{repo}@refs/pr/4", cache)
    assert (f"holds no snapshot of {repo}@refs/pr/4; it holds {repo} at main, refs/pr/3, release/v1.0, v1.0 = "
            f"{commit}; run `hf download {repo} --revision refs/pr/4`") in str(e.value)
    with pytest.raises(HubCacheMiss, match=r"model.checkpoint=nvidia/x@: nothing after `@`"):
        local_checkpoint("nvidia/x@", cache)
    assert local_checkpoint("nvidia/bad--name", cache) == "nvidia/bad--name"  # no hub id: the directory checks'


def test_the_cli_gives_every_rank_the_cached_directory(tmp_path, monkeypatch, capsys):
    """Before any check reads it, `nemo tessera ... model.checkpoint=ORG/NAME` becomes the snapshot directory of
    the cache huggingface_hub is configured with (HF_HOME / HF_HUB_CACHE)."""
    from types import SimpleNamespace

    from huggingface_hub import constants

    from tessera.recipes import cli
    from tessera.hetero.runspec.config import ModelConfig

    repo = "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16"
    snap = _cache_snapshot(tmp_path / "hub", repo, "b" * 40, refs=("main", "v1"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    task = SimpleNamespace(model=ModelConfig(checkpoint=f"{repo}@v1"))
    cli._resolve_hub_id(task, None)
    assert task.model.checkpoint == str(snap)
    assert f"model.checkpoint: {repo}@v1 -> {snap}" in capsys.readouterr().out


# ---- tensors a release holds that no Tessera module computes with (MTP, the featurizer): carried -------------

def _release_with_carried(directory, tokenizer: bool = False) -> dict:
    """A tiny hub-layout Omni whose LLM has one MTP layer (so transformers' model adds vision_final_layernorm),
    with mtp.* and featurizer tensors added to its weights as the released file holds them; returns those.
    tokenizer: also the release's tokenizer files (scripts/tiny_release.release_tokenizer)."""
    from safetensors.torch import load_file

    from tessera.scripts.tiny_release import TEXT

    omni_checkpoint(directory, text=dict(TEXT, num_nextn_predict_layers=1), tokenizer=tokenizer)
    hub_layout(directory)
    hidden = TEXT["hidden_size"]
    g = torch.Generator().manual_seed(3)
    carried = {"mtp.layers.0.enorm.weight": torch.randn(hidden, generator=g),
               "mtp.layers.0.hnorm.weight": torch.randn(hidden, generator=g),
               "mtp.layers.0.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g),
               "mtp.layers.0.mixer.q_proj.weight": torch.randn(hidden, hidden, generator=g).bfloat16(),
               "sound_encoder.encoder.feature_extractor.featurizer.fb": torch.randn(1, 16, 257, generator=g),
               "sound_encoder.encoder.feature_extractor.featurizer.window": torch.hann_window(400)}
    path = str(directory / "model.safetensors")
    save_file({**load_file(path), **carried}, path, metadata={"format": "pt"})
    return carried


def test_mtp_and_featurizer_tensors_are_carried_into_the_export_unchanged(tmp_path):
    """The tensor check accepts them (no 'left over'), the model is built without them (HybridLM builds no MTP;
    the vision final norm the MTP LLM implies is loaded), and the export holds every tensor of the release,
    torch.equal and in its dtype, with the release's config.json."""
    from _mcore_cpu import single_rank_world
    from safetensors.torch import load_file

    from test_released_checkpoint import _tessera_model
    from tessera.hetero.export.hf import write_hf
    from tessera.hetero.build.model_build import check_checkpoint_tensors
    from tessera.models.multimodal_hf import export_hf, import_hf
    from tessera.models.nemotron_h_hf import LazyCheckpoint
    from tessera.models.released import is_carried
    from tessera.hetero.runspec.config import ModelConfig

    src = tmp_path / "release"
    carried = _release_with_carried(src)
    released = load_file(str(src / "model.safetensors"))
    fields = llm_fields_of(read_config(src))
    assert fields["num_nextn_predict_layers"] == 1
    model_cfg = ModelConfig(checkpoint=str(src))
    single_rank_world()
    check_checkpoint_tensors(str(src), LazyCheckpoint(src), model_cfg, fields)
    model = _tessera_model(src)
    import_hf(model, {k: v for k, v in released.items() if not is_carried(k)})
    out = write_hf(tmp_path / "export", export_hf(model), model_cfg, fields)
    again = load_file(str(out / "model.safetensors"))
    assert sorted(again) == sorted(released) and set(carried) <= set(again)
    assert [k for k in released if not (torch.equal(again[k], released[k]) and again[k].dtype == released[k].dtype)
            ] == []
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_hub_layout_release_tokenizer_that_disagrees_is_refused_before_launch(native_and_hub, tmp_path):
    """The hub file's legacy id names are the ids the release's tokenizer must have, checked before launch also
    with synthetic data (data.path unset): a config.json whose img_context_token_id is not its tokenizer's
    <image> is refused naming both; the release as shipped passes."""
    from types import SimpleNamespace

    from tessera.data.run_tokenizer import TokenizerMismatch
    from tessera.data.tokens import Tokenizer
    from tessera.recipes import prelaunch
    from tessera.hetero.runspec.config import DataConfig, ModelConfig

    _, hub = native_and_hub
    synthetic = DataConfig()
    prelaunch.check_inputs(SimpleNamespace(model=ModelConfig(checkpoint=str(hub)), data=synthetic))
    d = tmp_path / "wrong_ids"
    shutil.copytree(hub, d)
    raw = json.loads((d / "config.json").read_text())
    image = Tokenizer(d / "tokenizer.json").special["<image>"]
    raw["img_context_token_id"] = image + 1
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(TokenizerMismatch) as e:
        prelaunch.check_inputs(SimpleNamespace(model=ModelConfig(checkpoint=str(d)), data=synthetic))
    msg = str(e.value)
    assert f"image_token_id {image + 1} in config.json, but <image> is {image} in the tokenizer" in msg, msg
    assert str(d / "tokenizer.json") in msg and f"the checkpoint {d}" in msg, msg


def test_nano_vl_release_every_tensor_consumed_and_exported_back(tmp_path):
    """A tiny Nano V2 VL in the release's key layout (transformers' RadioModel + NemotronHForCausalLM + mlp1 saved
    under the released names, less what that release does not store): Tessera builds exactly its tensors from
    the hub config.json, imports them and exports them back torch.equal."""
    from _mcore_cpu import single_rank_world
    from safetensors.torch import load_file

    from test_released_checkpoint import _tessera_model
    from tessera.models.multimodal_hf import export_hf, import_hf

    nano_vl_checkpoint(tmp_path / "vl")
    released = load_file(str(tmp_path / "vl" / "model.safetensors"))
    assert "mlp1.1.weight" in released and not [k for k in released if any(p in k for p in NOT_IN_NANO_VL)]
    single_rank_world()
    model = _tessera_model(tmp_path / "vl")
    import_hf(model, released)
    again = export_hf(model)
    assert sorted(again) == sorted(released)
    assert [k for k in released if not torch.equal(again[k], released[k])] == []


def _release_tile_grid(width: int, height: int, max_num: int, image_size: int, use_thumbnail: bool):
    """Nano V2 VL's fixed-tile rule as its processor publishes it, reimplemented (InternVL's dynamic_preprocess /
    find_closest_aspect_ratio, which vLLM's transformers_utils/processors/nano_nemotron_vl.py tiles with through
    get_internvl_target_ratios; InternVL2.5 model card "Inference with Transformers"): every (i, j) grid of
    min_num=1..max_num tiles sorted by tile count, the aspect ratio closest to the image's, an exact tie going
    to the later grid only if the image's area exceeds half the grid's; a thumbnail when more than one tile."""
    aspect = width / height
    ratios = sorted({(i, j) for n in range(1, max_num + 1) for i in range(1, n + 1) for j in range(1, n + 1)
                     if 1 <= i * j <= max_num}, key=lambda x: x[0] * x[1])
    best_diff, best = float("inf"), (1, 1)
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and width * height > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
            best = ratio
    return best[0], best[1], use_thumbnail and best[0] * best[1] != 1


def test_nano_vl_tiles_follow_the_release_rule():
    """Tessera's tile grid (data/media.choose_grid, which the fixed-tile data path cuts with) is the release's for
    every image shape: 512-px tiles, at most 12, a thumbnail beside more than one (sizes from 1 px to 8k, and the
    exact aspect ratios of every grid, where the tie rule decides)."""
    from tessera.data.media import choose_grid

    sizes = {(w, h) for w in range(16, 8200, 397) for h in range(16, 8200, 411)}
    sizes |= {(c * k, r * k) for c in range(1, 13) for r in range(1, 13) if c * r <= 12 for k in (100, 256, 512, 700)}
    sizes |= {(c * k, r * k) for c, r in ((1, 1), (2, 1), (1, 3)) for k in range(100, 2100, 37)}  # ties by area
    sizes |= {(1, 1), (1, 4000), (4000, 1), (2 * 512, 1 * 512 + 1)}
    for w, h in sorted(sizes):
        g = choose_grid(w, h, 12, True, 512)
        assert (g.cols, g.rows, g.thumbnail) == _release_tile_grid(w, h, 12, 512, True), (w, h)


def test_a_snapshot_of_the_hub_cache_is_named_by_its_hub_id(tmp_path):
    """What a fine-tune's adapters name as their base (peft_export.adapter_base): the user's hub id, recovered from
    the snapshot directory local_checkpoint resolved it to; any other directory is no hub id."""
    from tessera.models.hub_cache import hub_id_of

    snap = tmp_path / "hub" / "models--nvidia--Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16" / "snapshots" / "0123abc"
    assert hub_id_of(snap) == "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16"
    assert hub_id_of(tmp_path / "hub" / "models--gpt2" / "snapshots" / "f00") == "gpt2"
    assert hub_id_of(tmp_path / "release") is None and hub_id_of(tmp_path / "snapshots" / "x") is None
