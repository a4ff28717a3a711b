"""Several prepared datasets as one: data.path="a=DIR;b=DIR:0.3" (data/blend.py). The YAML a run writes reads as
the metadataset a user writes by hand in energon's own format (the same batches, key by key); its members'
tokenizer is the one they share, different ones are refused naming them; the pre-launch check names a missing
member; and a run trains from the blend it wrote into its run directory."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from _blend import make_blend, take

from tessera.data.blend import BlendMember, blend_members, blend_yaml, is_blend_spec, parse_blend_spec
from tessera.data.run_tokenizer import TokenizerMismatch, run_tokenizer
from tessera.hetero.runspec.config import DataConfig, ModelConfig, TrainerConfig


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    return make_blend(tmp_path_factory.mktemp("blend"), 24, 16)  # a: 24 samples + tokenizer, b: 16, none


def test_the_spec_forms_and_their_errors():
    assert parse_blend_spec("caps=/d/caps;qa=/d/q:a/qa:0.25") == [
        BlendMember("caps", Path("/d/caps"), 1.0), BlendMember("qa", Path("/d/q:a/qa"), 0.25)]
    assert is_blend_spec("a=/x;b=/y") and is_blend_spec("a=/x") and not is_blend_spec("/data/run=3/set")
    for bad, said in [("a=/x;a=/y", "given twice"), ("a=/x:fast", "must be a number"), ("a=/x:0", "> 0"),
                      ("=/x", "is not NAME=DIR"), ("a/b=/x", "is not NAME=DIR")]:
        with pytest.raises(ValueError, match=said):
            parse_blend_spec(bad)


def test_the_written_blend_reads_as_the_one_written_by_hand(blend):
    """tests/_blend.py writes energon's MetadatasetV2 by hand (a weight 3, b weight 1); the spec's YAML gives the
    same samples in the same order."""
    from tessera.data.loader import ChatTaskEncoder, build_loader
    from tessera.data.tokens import EncoderTokens, Tokenizer

    mine = blend / "spec.yaml"
    mine.write_text(blend_yaml(parse_blend_spec(f"a={blend / 'a'}:3;b={blend / 'b'}")))
    assert blend_members(mine) == blend_members(blend / "blend.yaml") == [
        BlendMember("a", blend / "a", 3.0), BlendMember("b", blend / "b", 1.0)]

    def keys(path):
        enc = ChatTaskEncoder(Tokenizer(blend / "a" / "tokenizer.model"), 512, EncoderTokens(patch=64))
        return [k for b in take(build_loader(path, enc, 2), 6) for row in b.keys for k in row]

    want = keys(blend / "blend.yaml")
    assert keys(mine) == want and {k[0] for k in want} == {"a", "b"}


def test_a_blend_uses_the_tokenizer_its_datasets_share_and_refuses_two(blend, tmp_path):
    spec = f"a={blend / 'a'};b={blend / 'b'}"
    choice = run_tokenizer(None, None, spec)  # b carries none: a's
    assert choice.path == str(blend / "a" / "tokenizer.model"), choice
    other = tmp_path / "c"
    shutil.copytree(blend / "b", other)
    (other / "tokenizer.model").write_bytes(b"another tokenizer")
    with pytest.raises(TokenizerMismatch) as e:
        run_tokenizer(None, None, f"{spec};c={other}")
    assert (f"carry different tokenizers (a: {blend / 'a' / 'tokenizer.model'}, c: {other / 'tokenizer.model'})"
            in str(e.value) and "prepare_data.py --tokenizer PATH" in str(e.value)), e.value
    (other / "tokenizer.model").write_bytes((blend / "a" / "tokenizer.model").read_bytes())  # the same file
    assert run_tokenizer(None, None, f"{spec};c={other}").path == str(blend / "a" / "tokenizer.model")
    assert run_tokenizer("/my/tok.model", None, f"{spec};c={other}").path == "/my/tok.model"


def test_the_prelaunch_check_names_a_missing_member(blend, tmp_path):
    from tessera.recipes import prelaunch

    def task(path):
        return SimpleNamespace(model=ModelConfig(), data=DataConfig(path=path), trainer=TrainerConfig())

    prelaunch.check_inputs(task(f"a={blend / 'a'};b={blend / 'b'}:0.5"))
    with pytest.raises(ValueError, match=rf"data.path \(b\)={tmp_path / 'nope'} does not exist") as e:
        prelaunch.check_inputs(task(f"a={blend / 'a'};b={tmp_path / 'nope'}"))
    assert "(or drop data.path for synthetic data)" in str(e.value), e.value  # a training member, not a val set


def _train_on(spec: str, run_dir: str):
    from tessera.hetero.training.metrics import read_metrics
    from tessera.recipes.registry import build_recipe_kwargs
    from tessera.recipes.train import train

    train(**build_recipe_kwargs("nemotron_vl_tiny", ["layout=vision=dp1@0-0;language=dp1@0-0", f"data.path={spec}",
                                                     f"trainer.run_dir={run_dir}", "trainer.max_steps=2",
                                                     "data.val_path=None", "trainer.tensorboard=false"]))
    return [r["step"] for r in read_metrics(run_dir)]


@pytest.mark.multiproc
def test_a_run_trains_from_the_blend_it_writes_into_its_run_directory(blend, tmp_path):
    from tessera.hetero.tools.spawn import run_on_ranks

    spec = f"a={blend / 'a'}:3;b={blend / 'b'}"
    assert run_on_ranks(1, _train_on, spec, str(tmp_path / "run")) == [[1, 2]]
    assert (tmp_path / "run" / "blend.yaml").read_text() == blend_yaml(parse_blend_spec(spec))
