"""The 12B/30B recipes start from the releases (issue 46, item 6): `nemotron_vl_12b` and `nemotron_omni_30b_a3b` given
`model.checkpoint=DIR`, DIR a release as downloaded at its published sizes (scripts/full_release.py: hub-layout
config.json, safetensors headers over sparse files, no weight written), build exactly the release's architecture.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_full_release.py -q -p no:cacheprovider

The oracle for the tensor list is transformers: NemotronH_Omni_Reasoning_V3 built on the meta device from the same
config, under the names save_pretrained writes (for Nano V2 VL, which has no transformers class, that class of its
tensors less what the release does not store). Tessera's side is the run's own check (every checkpoint tensor one
the model holds, with its shape, none missing: hetero/build/model_build.check_checkpoint_tensors) on a meta-device
build. Nothing is allocated at full size.
"""

from __future__ import annotations

import json

import pytest

from tessera.scripts.full_release import RELEASES, write_release

RECIPE = {"vl_12b": "nemotron_vl_12b", "omni_30b": "nemotron_omni_30b_a3b"}


@pytest.fixture(scope="module", params=sorted(RELEASES))
def release(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, write_release(d, request.param)


def _run_model(name: str, directory):
    from tessera.recipes.registry import build_recipe_kwargs

    return build_recipe_kwargs(RECIPE[name], [f"model.checkpoint={directory}"])["model"]


def test_recipe_from_the_release_builds_exactly_its_tensors(release):
    from _mcore_cpu import single_rank_world

    from tessera.hetero.build.model_build import check_checkpoint_tensors
    from tessera.hetero.checkpoint.source import checkpoint_llm_fields
    from tessera.hetero.runspec.modules import encoder_names
    from tessera.models import configs
    from tessera.models.nemotron_h_hf import LazyCheckpoint

    name, d, _ = release
    model = _run_model(name, d)
    fields = checkpoint_llm_fields(model.checkpoint)
    assert {k: fields[k] for k in configs.hf_fields(model.llm)} == configs.hf_fields(model.llm)  # the recipe's LLM
    assert sorted(encoder_names(model)) == (["audio", "vision"] if name == "omni_30b" else ["vision"])
    single_rank_world()
    # what the run checks before loading: every tensor of the shards' headers one the model holds, none missing
    check_checkpoint_tensors(str(d), LazyCheckpoint(d), model, fields)


@pytest.mark.parametrize("release", ["vl_12b"], indirect=True)
def test_a_release_missing_a_tensor_is_named(release, tmp_path):
    """The same check on the same headers with one tensor dropped names it (the check reads the shards' headers)."""
    from _mcore_cpu import single_rank_world

    from tessera.hetero.build.model_build import check_checkpoint_tensors
    from tessera.hetero.checkpoint.source import checkpoint_llm_fields
    from tessera.models.nemotron_h_hf import LazyCheckpoint
    from tessera.scripts.full_release import write_sparse_shards

    name, d, tensors = release
    gone = "mlp1.1.weight"
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    write_sparse_shards(tmp_path, {k: v for k, v in tensors.items() if k != gone})
    model = _run_model(name, tmp_path)
    single_rank_world()
    with pytest.raises(ValueError, match=rf"1 missing \(the model needs them\): {gone}"):
        check_checkpoint_tensors(str(tmp_path), LazyCheckpoint(tmp_path), model,
                                 checkpoint_llm_fields(model.checkpoint))


def test_hub_files_are_the_release_layouts(release):
    """config.json is read through the hub layout (remote-code model_type, legacy names), the shards through their
    index, as a downloaded release is."""
    from tessera.models.released import file_layout

    name, d, tensors = release
    assert file_layout(d) == RELEASES[name]["model_type"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(tensors) and len(set(index["weight_map"].values())) > 1


@pytest.mark.parametrize("release", ["vl_12b"], indirect=True)
def test_the_dry_run_prints_memory_at_the_releases_shapes(release, capsys):
    """scripts/dryrun.py --recipe NAME --checkpoint DIR: the recipe's layout with the modules DIR describes, built on
    the meta device in a fake world of the layout's size, memory per rank measured next to the cost model's."""
    from tessera.scripts.dryrun import main

    name, d, _ = release
    assert main(["--recipe", RECIPE[name], "--checkpoint", str(d)]) == 0
    out = capsys.readouterr().out
    assert "memory per rank, GiB (meta-device build of the real modules" in out, out
    assert "language  params" in out and "vision    params" in out and "dry run: PASS" in out, out
    assert "init from the seed" not in out  # a run from a checkpoint loads it
