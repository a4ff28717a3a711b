"""HybridLM vs transformers' NemotronH: Mamba-2 kernel, logits parity (TP=1 in-process, TP=2 / PP=2 on
real gloo ranks), exact HF export, published parameter counts.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_models_hybrid.py -q
"""

from __future__ import annotations

import pytest
import torch
from _mcore_cpu import module_pgs, single_rank_world

from tessera.models import configs
from tessera.models.hybrid_llm import HybridLM
from tessera.models.mamba2 import ssd_chunk_scan
from tessera.models.nemotron_h_hf import (
    hf_to_megatron,
    hybrid_config_from_hf,
    load_hf_state_dict,
    load_into,
    mamba_to_megatron,
    megatron_to_hf,
    save_hf,
)
from tessera.hetero.tools.parity import compare
from tessera.hetero.tools.spawn import run_on_ranks
from tessera.models.hf_reference import fixed_batch, reference_logits

TOL = 1e-4



@pytest.fixture(scope="module")
def pg():
    return single_rank_world()


def _ours(hf_dir, pg):
    model = HybridLM(hybrid_config_from_hf(hf_dir), pg).eval()
    load_into(model, load_hf_state_dict(hf_dir), 0, 0)
    return model


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_mamba2_mixer_matches_transformers(pg):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    torch.manual_seed(0)
    hf_cfg = NemotronHConfig(**configs.TINY_DENSE)
    ref = NemotronHMamba2Mixer(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.3 * torch.randn_like(p))
        ref.dt_bias[:2] = -12.0  # softplus -> 6e-6: these heads hit the time_step_min clamp
    model = HybridLM(hybrid_config_from_hf(configs.TINY_DENSE), pg).eval()
    ours = model.layers[0].mixer
    ours.load_state_dict(mamba_to_megatron(ref.state_dict(), model.config))
    x = torch.randn(2, 29, 64)  # 29 = 3 full chunks of 8 + a padded one
    with torch.no_grad():
        expected = ref(x)
        got, _ = ours(x.transpose(0, 1).contiguous())
    assert _rel(got.transpose(0, 1), expected) < 1e-5


def test_ssd_state_carries_across_sequence_splits():
    # The property a context-parallel Mamba needs: scanning [a|b] equals scanning a, then b from a's state.
    torch.manual_seed(0)
    b, length, h, p, g, n = 2, 40, 4, 8, 2, 16
    x, dt = torch.randn(b, length, h, p), torch.rand(b, length, h) * 0.5
    A, B, C = -torch.rand(h) - 0.1, torch.randn(b, length, g, n), torch.randn(b, length, g, n)
    full, full_state = ssd_chunk_scan(x, dt, A, B, C, chunk_size=8)
    first, state = ssd_chunk_scan(x[:, :17], dt[:, :17], A, B[:, :17], C[:, :17], chunk_size=8)
    second, end_state = ssd_chunk_scan(x[:, 17:], dt[:, 17:], A, B[:, 17:], C[:, 17:], chunk_size=8,
                                       initial_state=state)
    assert _rel(torch.cat([first, second], 1), full) < 1e-5
    assert _rel(end_state, full_state) < 1e-5


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_parity_tp1(ckpts, pg, kind):
    assert 0 < compare(ckpts[kind], pg) <= TOL  # 0 exactly would mean nothing (or the reference) compared


def test_parity_refuses_to_compare_nothing(ckpts, pg, monkeypatch):
    # compare() must not report 0.0 when no rank computed logits (every rank a non-last PP stage) or when
    # the logits only broadcast against transformers' (one row of the batch)
    from tessera.hetero.tools import parity

    forward = parity.pipeline_forward
    monkeypatch.setattr(parity, "pipeline_forward", lambda *a: None)
    with pytest.raises(RuntimeError, match="parity: 0 logits compared"):
        compare(ckpts["dense"], pg)
    monkeypatch.setattr(parity, "pipeline_forward", lambda *a: forward(*a)[:1])
    with pytest.raises(RuntimeError, match="parity: -1 logits compared"):
        compare(ckpts["dense"], pg)


def test_parity_detects_a_wrong_tensor(ckpts, pg):
    # Guard against a parity check that cannot fail: one corrupted parameter must show.
    model = _ours(ckpts["moe"], pg)
    ids = fixed_batch(model.config.vocab_size)
    ref = reference_logits(ckpts["moe"], ids)
    with torch.no_grad():
        assert _rel(model(ids), ref) <= TOL
        model.layers[3].mlp.router.expert_bias.mul_(-20.0)  # changes which experts fire
        assert _rel(model(ids), ref) > 1e-3


def test_backward_reduces_loss_tp1(ckpts, pg):
    model = _ours(ckpts["moe"], pg).train()
    ids = fixed_batch(model.config.vocab_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(3):
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert losses[2] < losses[0]


def test_export_reloads_identically_in_transformers(ckpts, pg, tmp_path):
    from transformers import NemotronHForCausalLM

    for kind, hf_dir in ckpts.items():
        model = _ours(hf_dir, pg)
        save_hf(megatron_to_hf({(0, 0, 0): model.state_dict()}, model.config), hf_dir, tmp_path / kind)
        original = load_hf_state_dict(hf_dir)
        reloaded = NemotronHForCausalLM.from_pretrained(str(tmp_path / kind)).state_dict()
        reference = NemotronHForCausalLM.from_pretrained(hf_dir).state_dict()
        assert set(load_hf_state_dict(tmp_path / kind)) == set(original)
        assert reloaded.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(reloaded[key], value), key


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp2_pp2_shards_merge_back_exactly(ckpts, kind):
    hf = load_hf_state_dict(ckpts[kind])
    config = hybrid_config_from_hf(ckpts[kind], tp=2, pp=2)
    shards = {(t, p, 0): hf_to_megatron(hf, config, t, p) for t in range(2) for p in range(2)}
    assert shards[(0, 0, 0)]["embedding.weight"].shape[0] == config.padded_vocab_size // 2  # 128 padded to 256 at TP2
    merged = megatron_to_hf(shards, config)
    assert merged.keys() == hf.keys()
    for key, value in hf.items():
        assert torch.equal(merged[key], value), key


@pytest.mark.parametrize("name", ["nemotron_nano_12b_v2", "nemotron_nano_9b_v2", "nemotron_3_nano_30b_a3b"])
def test_published_parameter_counts(pg, name):
    config = hybrid_config_from_hf(configs.hf_fields(name), dtype=torch.bfloat16)
    with torch.device("meta"):
        model = HybridLM(config, pg)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / configs.REGISTRY[name]["published_params"] - 1) < 0.01, count


def _parity_rank(tp, pp, dirs):
    pg_collection = module_pgs(f"tp{tp},pp{pp}")
    return {kind: compare(d, pg_collection) for kind, d in dirs.items()}


@pytest.mark.multiproc
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_parity_two_gloo_ranks(ckpts, tp, pp):
    errors, other = run_on_ranks(2, _parity_rank, tp, pp, ckpts)
    assert errors == other  # compare() all-reduces: every rank knows the verdict
    assert errors.keys() == ckpts.keys()
    assert all(0 < e <= TOL for e in errors.values()), errors  # compare() also raises if nothing compared
