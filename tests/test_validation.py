"""Validation (hetero/training/validation.py): the held-out loss is the same in every layout, a pass changes
nothing it should not (weights, BatchNorm statistics, train/eval modes), repeats exactly, and a run logs it.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_validation.py -x -q

Layouts start from the same seeded weights (hetero/build/seeded_init.py), so their validation losses differ
only by the order of fp32 sums: within 1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.data.pipeline import val_sets
from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.training.metrics import read_metrics

pytestmark = pytest.mark.multiproc

LAYOUTS = {"homogeneous": "", "colocated": "vision=tp2,dp2@0-3;audio=dp4@0-3;language=tp2,pp2@0-3",
           "non_colocated": "vision=dp2@0-1;audio=dp2@0-1;language=cp2@2-3"}


def _config(run_dir: str, layout: str, **trainer):
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig

    return RunConfig("val", layout, ModelConfig(vision="radio_vit_tiny", audio="fastconformer_tiny"),
                     DataConfig(seq_length=128, rows_per_microbatch=4, microbatches=2, val_path="synthetic"),
                     OptimConfig(), TrainerConfig(run_dir=run_dir, progress=False, tensorboard=False, **trainer))


def _validate_layouts(root: str) -> dict:
    """Every layout's validation loss from the seeded weights, twice, and what a pass left changed."""
    import torch
    import torch.distributed as dist

    from tessera.hetero.runtime.groups import destroy_module_groups
    from tessera.hetero.build.run_state import build_run
    from tessera.hetero.training.step_parts import step_context
    from tessera.hetero.training.validation import resolve_val_sets, validate
    from tessera.recipes.checks import resolve

    out = {}
    for name, layout in LAYOUTS.items():
        cfg = _config(str(Path(root) / name), layout)
        run = build_run(cfg, resolve(cfg, dist.get_world_size()), Path(root) / name, torch.device("cpu"))
        ctx = step_context(run)
        sets = resolve_val_sets(cfg.data.val_path, run.rank)
        before = {k: {n: t.clone() for n, t in m.state_dict().items() if torch.is_tensor(t)}
                  for k, m in run.modules.items()}
        # a mixed start, as frozen towers and LoRA bases have (parts in eval mode): a pass restores each part's own
        # mode, not train() for all (every other submodule set alone, children untouched)
        for mod in run.modules.values():
            for i, m in enumerate(mod.modules()):
                m.training = m.training and i % 2 == 0
        modes = {(k, n): m.training for k, mod in run.modules.items() for n, m in mod.named_modules()}
        assert len(set(modes.values())) == 2, "the start has parts in train and in eval mode"
        first = validate(run, sets, 2, ctx)
        second = validate(run, sets, 2, ctx)
        changed = [f"{k}.{n}" for k, m in run.modules.items() for n, t in m.state_dict().items()
                   if torch.is_tensor(t) and not torch.equal(t, before[k][n])]
        flipped = [k for k, mod in run.modules.items() for n, m in mod.named_modules() if m.training != modes[(k, n)]]
        out[name] = {"first": first, "second": second, "changed": changed, "flipped": flipped}
        destroy_module_groups(run.groups)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(4, _validate_layouts, str(tmp_path_factory.mktemp("val")), timeout=900)


def test_validation_loss_is_the_same_in_every_layout(results):
    per_rank = results  # run_on_ranks returns every rank's result: they must agree too
    ref = per_rank[0]["homogeneous"]["first"]
    assert list(ref) == ["synthetic"] and 2.0 < ref["synthetic"] < 20.0, ref
    for rank, res in enumerate(per_rank):
        for name, r in res.items():
            got = r["first"]["synthetic"]
            assert got == pytest.approx(ref["synthetic"], rel=1e-6), (rank, name, got, ref)
            assert r["second"] == r["first"], f"{name}: a second pass read other batches or other weights"
            assert r["changed"] == [], f"{name}: validation changed {r['changed']}"  # BatchNorm statistics too
            assert r["flipped"] == [], f"{name}: validation left {r['flipped']} in another train/eval mode"


def _train_with_val(root: str):
    from tessera.recipes.train import train

    cfg = _config(str(Path(root) / "run"), "vision=dp2@0-1;audio=dp2@0-1;language=cp2@2-3", max_steps=4, val_every=2)
    return train(cfg.model, cfg.data, cfg.optim, cfg.trainer, layout=cfg.layout, name="val")


def test_a_run_validates_every_val_every_steps_and_at_the_end(tmp_path):
    summaries = run_on_ranks(4, _train_with_val, str(tmp_path), timeout=900)
    val = read_metrics(tmp_path / "run", "val")
    assert [r["step"] for r in val] == [2, 4], val
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]  # the train records stay apart
    losses = [r["val"]["synthetic"]["loss"] for r in val]
    assert losses[1] < losses[0], f"validation loss does not fall while training: {losses}"
    assert all(s["val_loss"] == {"synthetic": losses[1]} for s in summaries)
    train_rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in (r for r in train_rows if "val" not in r):  # the step records carry the throughput fields too
        # the throughput fields by hand: 4 ranks, 8 rows of 128 tokens per step, the step's model FLOPs
        assert r["world"] == 4 and r["mfu"] is None  # CPU: no peak, FLOP/s only
        assert r["model_tflops_per_gpu"] == pytest.approx(sum(r["model_flops"].values()) / r["step_time_s"] / 4 / 1e12)
        assert r["tokens_per_s"] == pytest.approx(8 * 128 / r["step_time_s"])
        assert r["samples_per_s"] == pytest.approx(8 / r["step_time_s"])
        assert 0 < r["real_tokens_per_s"] < r["tokens_per_s"]  # the rows' padding left out
        assert r["model_flops"]["language"] > 0 and r["model_flops"]["vision"] > 0, r["model_flops"]
        worst = r["max_over_ranks"]
        assert worst["peak_memory_gib"] >= r["peak_memory_gib"] > 0 and worst["data_wait_s"] >= r["data_wait_s"] >= 0
        assert worst["boundary_s"] > 0  # rank 0 holds no LLM here: it waits in the exchange for the LLM ranks


@pytest.mark.parametrize("spec, want", [
    (None, {}), ("synthetic", {"synthetic": "synthetic"}),
    ("a=synthetic; b=synthetic", {"a": "synthetic", "b": "synthetic"}),
])
def test_val_sets(spec, want):
    assert val_sets(spec) == want


@pytest.mark.parametrize("spec, message", [
    ("a=synthetic;a=synthetic", "given twice"),
    ("/no/such/set", "does not exist"),
    ("=synthetic", "is not PATH or NAME=PATH"),
])
def test_val_sets_refuse(spec, message):
    with pytest.raises(ValueError, match=message):
        val_sets(spec)
