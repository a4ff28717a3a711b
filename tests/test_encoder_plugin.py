"""Adding an encoder family as a user does (README "Add an encoder", issue 48 item 3): the README's code block, run
here as written, defines a ViT family and registers it and a sized entry of it, without a change to the project.
That entry then trains on four gloo ranks in a heterogeneous layout (the ViT tp2 on ranks 0-1, the LLM dp2 on
ranks 2-3) and matches the homogeneous layout (every module dp4) step by step, and the export holds its tower in
the family's own checkpoint layout, exactly the tensors the family writes.

Each rank gets the family as a user's run does: the block saved as a module that $TESSERA_ENCODER_MODULES names
(the HF export's subprocess too). In this process the block runs per test and the registries are restored after,
since other tests enumerate them.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.training.metrics import read_metrics
from tessera.models.encoder_families.base import EncoderFamily, register_family
from tessera.models.encoders import (FAMILIES, MODULES_ENV, REGISTRY, encoder_config, family_of, import_user_modules,
                                     register_encoder)
from tests._run_curves import check_first_step, curves, rel

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_family_source() -> str:
    """The python block of the README's "Add an encoder" section."""
    section = README.read_text().split("\n## Add an encoder\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def define_readme_family() -> dict:
    """Run the README's block in this process (registers "my_vit" and "my_vit_tiny"); its namespace."""
    namespace = {"__name__": "my_vit"}
    exec(compile(readme_family_source(), str(README), "exec"), namespace)
    return namespace


@pytest.fixture
def readme_family():
    """The README's family for one test; the registries are restored after (other tests enumerate them)."""
    families, registry = dict(FAMILIES), dict(REGISTRY)
    try:
        yield define_readme_family()
    finally:
        FAMILIES.clear()
        FAMILIES.update(families)
        REGISTRY.clear()
        REGISTRY.update(registry)


HOMOGENEOUS, HETERO = "", "vision=tp2@0-1;language=dp2@2-3"
STEPS = 3


def _runs(root: str) -> None:
    """On every rank: the README's block, saved as the user's module my_vit.py, named in TESSERA_ENCODER_MODULES
    (this rank's environment, so the HF export's subprocess imports it too), then both runs."""
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    os.environ[MODULES_ENV] = "my_vit"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
    sys.path.insert(0, root)
    import_user_modules()  # (this rank imported the registry before the variable was set)

    for name, layout in (("homogeneous", HOMOGENEOUS), ("hetero", HETERO)):
        trainer = TrainerConfig(max_steps=STEPS, run_dir=str(Path(root) / name), progress=False, tensorboard=False,
                                export_hf=str(Path(root) / name / "export"))
        train(ModelConfig(vision="my_vit_tiny", audio=None),
              DataConfig(seq_length=128, rows_per_microbatch=4, microbatches=2),
              OptimConfig(lr=2e-3, warmup_steps=0), trainer, layout=layout, name=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin")
    (root / "my_vit.py").write_text(readme_family_source())
    run_on_ranks(4, _runs, str(root), timeout=900)
    return root


def test_the_readme_family_is_registered_with_its_entry(readme_family):
    cfg = encoder_config("my_vit_tiny")
    assert isinstance(family_of(cfg), readme_family["MyViT"])
    assert cfg.family == "my_vit" and cfg.modality == "vision"
    assert family_of(cfg).tensor_parallel and family_of(cfg).tokens(cfg).tokens_per_tile == 4  # (32/8/2)^2


@pytest.mark.multiproc
def test_a_user_family_trains_in_a_heterogeneous_layout_as_in_the_homogeneous_one(runs):
    loss_h, norm_h = curves(runs / "homogeneous")
    loss, norm = curves(runs / "hetero")
    assert len(loss) == len(loss_h) == STEPS
    check_first_step("hetero", loss, loss_h, norm, norm_h)
    assert rel(loss, loss_h) <= 1e-5 and rel(norm, norm_h) <= 1e-5, (loss, loss_h, norm, norm_h)
    assert all(r["boundary_bytes"] > 0 for r in read_metrics(runs / "hetero")), "the boundary moved no data"


@pytest.mark.multiproc
def test_the_export_holds_the_tower_in_the_familys_layout(runs, readme_family):
    from safetensors.torch import load_file

    from tessera.models.vision import VisionTransformer
    from tests._mcore_cpu import single_rank_world

    cfg, family, root = encoder_config("my_vit_tiny"), readme_family["MyViT"](), readme_family["ROOT"]
    exported = load_file(str(runs / "hetero" / "export" / "model.safetensors"))
    tower = {k: v for k, v in exported.items() if k.startswith("vision_model.")}
    want = family.export_tensors(cfg, [VisionTransformer(cfg, single_rank_world()).state_dict()])
    assert tower.keys() == want.keys() and all(k.startswith(root) for k in tower)
    assert all(tower[k].shape == want[k].shape for k in want)
    # the tp2 shards were merged back: the import of one rank's half and the export of both halves round-trip
    halves = [family.import_tensors(cfg, tower, None, r, 2) for r in range(2)]
    assert all(torch.equal(a, tower[k]) for k, a in family.export_tensors(cfg, halves).items())


def test_a_family_that_breaks_the_contract_is_refused_by_name(readme_family):
    @dataclass
    class HalfConfig:
        hidden: int

    class Half(EncoderFamily):
        name, modality, Config = "half", "vision", HalfConfig

        def tokens(self, cfg):
            raise AssertionError("never built")

    with pytest.raises(TypeError, match=r"Half does not define build, checkpoint_module, export_tensors, "
                                        r"import_tensors, planner_fields, preprocessor"):
        register_family(Half)
    with pytest.raises(TypeError, match=r"encoder 'x' of family 'my_vit': .*'hiden'.*its fields: patch, hidden"):
        register_encoder("x", "my_vit", **dict(asdict(readme_family["MY_VIT_TINY"]), hiden=3))
    with pytest.raises(ImportError, match=r"TESSERA_ENCODER_MODULES: cannot import 'no_such_family_module'"):
        import_user_modules("no_such_family_module")
