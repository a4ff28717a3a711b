"""Any vocabulary at any TP: a NemotronH checkpoint with an odd vocabulary (509) against transformers' own
NemotronHForCausalLM (the oracle, fp32, torch path) at TP1 in-process and TP2 on two real gloo ranks.

Megatron's padding (models/hybrid_llm.vocab_size_with_padding) gives the embedding and output layer 512 rows;
what must hold: logits (padding stripped) and the loss with labels equal transformers', the gradients of the
real rows equal transformers', the padding rows get exactly zero gradient, export gives back the imported
tensors bit for bit, a label outside the vocabulary is refused, and a from-scratch text-only recipe with an
odd vocabulary builds, trains and reshards its checkpoint from TP2 (padded 256 rows) to TP1 (128 rows).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_vocab_padding.py -q
"""

from __future__ import annotations

import io

import pytest
import torch
from _hf_tiny import make_tiny_checkpoint
from _mcore_cpu import module_pgs, single_rank_world

from tessera.hetero.tools.spawn import run_on_ranks
from tessera.models import configs
from tessera.models.hf_reference import fixed_batch
from tessera.hetero.plan.resolved_run import IGNORE as IGNORE_INDEX
from tessera.models.hybrid_llm import HybridLM, vocab_size_with_padding
from tessera.models.nemotron_h_hf import hybrid_config_from_hf, load_hf_state_dict, load_into, megatron_to_hf

VOCAB = 509  # prime: divides by no TP size; padded to 512 at TP1 and TP2
LOGIT_TOL = 1e-5
GRAD_TOL = 1e-5  # measured ~1e-6 or less (fp32), as the logits


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def odd_ckpt(tmp_path_factory):
    fields = dict(configs.TINY_DENSE, vocab_size=VOCAB)
    return str(make_tiny_checkpoint(fields, tmp_path_factory.mktemp("odd_vocab") / "dense", seed=3))


def _batch():
    """Input ids, transformers' labels (it shifts them itself) and ours (already shifted), some ignored;
    the last real id appears as input and as label, next to the padding."""
    ids = fixed_batch(VOCAB)
    ids[0, 3] = ids[1, 8] = VOCAB - 1
    hf_labels = ids.clone()
    hf_labels[0, 10:14] = IGNORE_INDEX
    ours = torch.cat([hf_labels[:, 1:], torch.full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)
    return ids, hf_labels, ours


def _reference(hf_dir):
    """transformers' logits, mean loss and the gradients of embeddings / lm_head for _batch()."""
    from transformers import NemotronHForCausalLM

    ref = NemotronHForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids, hf_labels, _ = _batch()
    out = ref(input_ids=ids, labels=hf_labels)
    out.loss.backward()
    return {"logits": out.logits.detach(), "loss": out.loss.item(),
            "lm_head": ref.lm_head.weight.grad, "embed": ref.get_input_embeddings().weight.grad}


def _ours(model):
    """Our logits [b, s, vocab] (gathered, stripped), mean loss, and the local embedding / output grads."""
    ids, _, labels = _batch()
    with torch.no_grad():
        logits = model.full_vocab_logits(model(ids))
    loss = model(ids, labels=labels).sum() / (labels != IGNORE_INDEX).sum()
    loss.backward()
    return {"logits": logits, "loss": loss.item(), "lm_head": model.output_layer.weight.grad.clone(),
            "embed": model.embedding.weight.grad.clone(), "real": model.real_vocab_rows}


def _check_against_reference(ours_by_rank: list[dict], ref: dict) -> dict:
    """The assertions shared by TP1 and TP2; returns the measured errors."""
    ours = ours_by_rank[0]
    for r in ours_by_rank:  # padding rows: none at all at TP1 would make the check vacuous
        assert r["lm_head"].shape[0] - r["real"] in (0, 3) and torch.count_nonzero(r["lm_head"][r["real"]:]) == 0
        assert torch.count_nonzero(r["embed"][r["real"]:]) == 0
    assert sum(r["lm_head"].shape[0] - r["real"] for r in ours_by_rank) == 512 - VOCAB
    lm_head = torch.cat([r["lm_head"] for r in ours_by_rank])[:VOCAB]
    embed = torch.cat([r["embed"] for r in ours_by_rank])[:VOCAB]
    assert ours["logits"].shape == ref["logits"].shape
    errors = {"logits": _rel(ours["logits"], ref["logits"]), "loss": abs(ours["loss"] / ref["loss"] - 1),
              "lm_head grad": _rel(lm_head, ref["lm_head"]), "embed grad": _rel(embed, ref["embed"])}
    assert 0 < errors["logits"] <= LOGIT_TOL, errors  # 0 exactly would mean the reference compared to itself
    assert errors["loss"] <= LOGIT_TOL, errors
    assert errors["lm_head grad"] <= GRAD_TOL and errors["embed grad"] <= GRAD_TOL, errors
    return errors


def test_padding_rule_is_megatrons():
    # multiple of 128 * tp, as megatron.training's _vocab_size_with_padding
    cases = {(509, 1): 512, (509, 2): 512, (509, 8): 1024, (128, 2): 256, (131072, 8): 131072, (1, 3): 384}
    assert {k: vocab_size_with_padding(*k) for k in cases} == cases
    config = hybrid_config_from_hf(dict(configs.TINY_DENSE, vocab_size=VOCAB), tp=2)
    assert (config.vocab_size, config.padded_vocab_size) == (VOCAB, 512)


def test_odd_vocab_tp1_matches_transformers(odd_ckpt, capsys):
    model = HybridLM(hybrid_config_from_hf(odd_ckpt), single_rank_world())
    load_into(model, load_hf_state_dict(odd_ckpt), 0, 0)
    assert model.embedding.weight.shape[0] == 512
    errors = _check_against_reference([_ours(model)], _reference(odd_ckpt))
    with capsys.disabled():
        print(f"\nTP1 vocab {VOCAB}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


def test_label_outside_vocab_is_refused(odd_ckpt):
    model = HybridLM(hybrid_config_from_hf(odd_ckpt), single_rank_world())
    ids, _, labels = _batch()
    labels[1, 4] = VOCAB  # the first padding row
    with pytest.raises(ValueError, match=f"label id {VOCAB} is outside the vocabulary \\[0, {VOCAB}\\)"):
        model(ids, labels=labels)
    labels[1, 4] = -7
    with pytest.raises(ValueError, match="label id -7"):
        model(ids, labels=labels)


def _tp2_rank(hf_dir: str) -> bytes:
    from tessera.hetero.parallel.vocab_parallel_ce import vocab_parallel_cross_entropy_for

    pg = module_pgs("tp2")
    with pytest.raises(ValueError, match="needs cross_entropy= bound to its TP group"):  # never a global group's
        HybridLM(hybrid_config_from_hf(hf_dir, tp=2), pg)
    model = HybridLM(hybrid_config_from_hf(hf_dir, tp=2), pg, cross_entropy=vocab_parallel_cross_entropy_for(pg.tp))
    load_into(model, load_hf_state_dict(hf_dir), pg.tp.rank(), 0)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    out = dict(_ours(model), state=state, rank=pg.tp.rank())
    buf = io.BytesIO()  # plain bytes through the result queue: no shared-memory tensors of an exiting worker
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.multiproc
def test_odd_vocab_tp2_matches_transformers_and_exports_exactly(odd_ckpt, capsys):
    ranks = sorted((torch.load(io.BytesIO(b)) for b in run_on_ranks(2, _tp2_rank, odd_ckpt)),
                   key=lambda r: r["rank"])
    assert [r["real"] for r in ranks] == [256, 253]
    errors = _check_against_reference(ranks, _reference(odd_ckpt))
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    with capsys.disabled():
        print(f"\nTP2 vocab {VOCAB}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    # export after import: exactly the checkpoint's tensors, padding stripped
    config = hybrid_config_from_hf(odd_ckpt, tp=2)
    exported = megatron_to_hf({(r["rank"], 0, 0): r["state"] for r in ranks}, config)
    original = load_hf_state_dict(odd_ckpt)
    assert exported.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(exported[key], value), key


def _recipe_rank(root: str, vocab: int) -> dict:
    """A from-scratch text-only tiny recipe with `vocab` tokens, built and run at TP2 through the training
    code (model_build, the injected TP-group cross entropy), saved, and loaded again at TP1 (DP2)."""
    from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout
    from tessera.hetero.runtime.groups import build_module_groups, destroy_module_groups
    from tessera.hetero.checkpoint.sharded import latest_checkpoint, load_checkpoint, save_checkpoint
    from tessera.hetero.build.seeded_init import full_hf_state
    from tessera.hetero.build.model_build import (build_rank_modules, llm_fields,
                                                     load_full_state, module_configs)
    from tessera.hetero.runspec.config import ModelConfig

    model_cfg = ModelConfig(llm="nemotron_h_tiny_dense", vision=None)
    fields = dict(llm_fields(model_cfg, 0), vocab_size=vocab)
    full = full_hf_state(model_cfg, fields, seed=0)
    ids = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    out = {"hf_rows": full["language_model.lm_head.weight"].shape[0]}
    for step, spec in enumerate(("language=tp2@0-1", "language=dp2@0-1")):
        layout = HeteroLayout.parse(spec)
        groups = build_module_groups(layout)
        configs_ = module_configs(layout, fields)
        modules = build_rank_modules(model_cfg, layout, groups, configs_)
        lm = modules[LANGUAGE]
        if step == 0:
            load_full_state(modules, full, groups)
            save_checkpoint(root, 1, modules, None, groups, configs_, common={})
        else:
            load_checkpoint(latest_checkpoint(root), modules, None, groups, configs_)
            state = {k: v for k, v in lm.state_dict().items() if not k.endswith("_extra_state")}
            exported = megatron_to_hf({(0, 0, 0): state}, lm.config)
            out["reloaded_equal"] = all(torch.equal(exported[k], full["language_model." + k]) for k in exported)
        loss = lm(ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
        out[spec] = {"rows": lm.embedding.weight.shape[0], "loss": loss.item(),
                     "pad_grad": lm.output_layer.weight.grad[lm.real_vocab_rows:].abs().sum().item()}
        destroy_module_groups(groups)
    return out


@pytest.mark.multiproc
def test_from_scratch_recipe_with_odd_vocab_builds_at_tp2_and_reshards(tmp_path):
    vocab = 101  # padded to 128 at TP1 but 256 at TP2: the checkpoint's vocab rows change shape
    results = run_on_ranks(2, _recipe_rank, str(tmp_path / "ckpt"), vocab)
    for r in results:
        tp2, tp1 = r["language=tp2@0-1"], r["language=dp2@0-1"]
        assert r["hf_rows"] == vocab and r["reloaded_equal"]
        assert (tp2["rows"], tp1["rows"]) == (128, 128)  # 256 / 2 per TP2 rank, 128 unsharded
        assert tp2["pad_grad"] == 0 and tp1["pad_grad"] == 0
        assert torch.isfinite(torch.tensor(tp2["loss"])) and abs(tp1["loss"] / tp2["loss"] - 1) < 1e-5
