"""Initialisation from a seed builds only what a rank holds, one unit at a time, and is the same in every layout
(issue 14: no rank holds more than its own shards, also for a from-scratch run).

The oracle for the values is the whole model's state built unit by unit in one pass (`full_hf_state`, what a
one-device run and `scripts/convert_hf.py` use); for what a rank needs, the HF key names themselves (its PP
stage's `backbone.layers.<i>` by megatron's split, its EP rank's `experts.<j>`, the embedding on the first
stage, `norm_f`/`lm_head` on the last), as in tests/test_shard_loading.py. Each rank's shard is cut from the
lazy source by the converter the trainer uses (`hf_to_megatron`, per TP/PP/EP coordinate), so no process group
of the layout is needed: the values are bitwise those of the eager state, and the units built are exactly the
rank's, each once.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests._mcore_cpu import single_rank_world

# a small MoE LLM with two MoE layers (4 experts), Mamba, attention and MLP layers: PP2 puts one MoE layer per stage
PATTERN = "MEM*E-"


@pytest.fixture(scope="module")
def setup():
    single_rank_world()
    from tessera.hetero.training.model_build import llm_fields
    from tessera.hetero.training.seeded_init import full_hf_state
    from tessera.recipes.config import ModelConfig

    cfg = ModelConfig(llm="nemotron_h_tiny_moe", vision="radio_vit_tiny", audio="fastconformer_tiny")
    fields = dict(llm_fields(cfg, 0), hybrid_override_pattern=PATTERN)
    return cfg, fields, full_hf_state(cfg, fields, seed=11)


def _rank_units(layers: int, pp: int, pp_rank: int, experts: int, ep: int, ep_rank: int) -> list[tuple]:
    """The units a rank's LLM shard reads, in the converter's order."""
    per = layers // pp
    first = pp_rank * per
    last = layers if pp_rank == pp - 1 else first + per
    local = experts // ep
    units = [("embedding",)] if pp_rank == 0 else []
    units += [("head",)] if pp_rank == pp - 1 else []
    for i in range(first, last):
        units.append(("layer", i))
        if PATTERN[i] == "E":
            units += [("expert", i, ep_rank * local + j) for j in range(local)]
    return units


@pytest.mark.parametrize("tp,pp,ep", [(2, 2, 2), (1, 2, 4), (2, 1, 1), (1, 1, 2)])
def test_each_rank_builds_only_its_units_once_and_gets_the_eager_values(setup, tp, pp, ep):
    from tessera.hetero.training.seeded_init import SeededState
    from tessera.models.nemotron_h_hf import PrefixView, hf_to_megatron, hybrid_config_from_hf

    cfg, fields, full = setup
    config = hybrid_config_from_hf(fields, tp=tp, pp=pp, ep=ep)
    unit_size: dict[tuple, int] = {}
    probe = SeededState(cfg, fields, seed=11)
    for k in probe:
        unit_size[probe.unit_of(k)] = unit_size.get(probe.unit_of(k), 0) + full[k].numel()
    whole = sum(unit_size.values())
    for tp_rank, pp_rank, ep_rank in itertools.product(range(tp), range(pp), range(ep)):
        lazy = SeededState(cfg, fields, seed=11)
        shard = hf_to_megatron(PrefixView(lazy, "language_model."), config, tp_rank, pp_rank, ep_rank)
        eager = hf_to_megatron(PrefixView(full, "language_model."), config, tp_rank, pp_rank, ep_rank)
        assert shard.keys() == eager.keys()
        assert all(torch.equal(shard[k], eager[k]) for k in shard), (tp_rank, pp_rank, ep_rank)
        want = _rank_units(len(PATTERN), pp, pp_rank, config.num_moe_experts, ep, ep_rank)
        assert sorted(lazy.built) == sorted(want), (tp_rank, pp_rank, ep_rank)
        assert len(lazy.built) == len(set(lazy.built)), f"a unit was built twice: {lazy.built}"
        # never more than one unit in memory; what a rank draws is its units, not the model
        assert lazy.peak_unit_elements == max(unit_size[u] for u in want)
        if pp * ep > 1:
            assert sum(unit_size[u] for u in want) < whole


def test_a_tensor_depends_only_on_the_seed_and_its_unit(setup):
    from tessera.hetero.training.seeded_init import SeededState

    cfg, fields, full = setup
    keys = list(full)
    # any single tensor read first, alone, is the eager value (no dependence on what was built before)
    for k in keys[5::29] + keys[-2:]:  # media, LLM layers, experts, head (a fresh state each: ~1 s apiece)
        assert torch.equal(SeededState(cfg, fields, seed=11)[k], full[k]), k
    other = SeededState(cfg, fields, seed=12)
    assert not any(torch.equal(other[k], full[k]) for k in keys if full[k].numel() > 8 and full[k].std() > 0)
    # units draw from seeds of their own: equal-shaped tensors of different layers / experts differ
    L = "language_model.backbone.layers."
    for a, b in [("1.mixer.experts.0.up_proj.weight", "1.mixer.experts.1.up_proj.weight"),
                 ("1.mixer.experts.0.up_proj.weight", "4.mixer.experts.0.up_proj.weight"),
                 ("0.mixer.in_proj.weight", "2.mixer.in_proj.weight")]:
        assert not torch.equal(full[L + a], full[L + b]), (a, b)
    # the units partition the model: every media module, the embedding, the head, each layer, each expert
    units = {SeededState(cfg, fields, seed=11).unit_of(k) for k in keys}
    experts = [("expert", i, e) for i, s in enumerate(PATTERN) if s == "E" for e in range(4)]
    assert units == {("media", "vision"), ("media", "audio"), ("embedding",), ("head",),
                     *[("layer", i) for i in range(len(PATTERN))], *experts}


def test_the_caller_random_state_is_untouched(setup):
    from tessera.hetero.training.seeded_init import SeededState

    cfg, fields, full = setup
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    SeededState(cfg, fields, seed=11)["language_model.lm_head.weight"]
    assert torch.equal(torch.rand(3), want)


def test_megatron_init_rules_hold_for_each_unit(setup):
    """Units are built by the model's own constructors: norms ones, expert bias zero, matrices N(0, std) and the
    output-side projections N(0, std / sqrt(2 * layers)) (megatron's scaled init for the depth of the whole model,
    not of the one-layer unit)."""
    from tessera.models.nemotron_h_hf import hybrid_config_from_hf

    cfg, fields, full = setup
    std, n = hybrid_config_from_hf(fields).init_method_std, len(PATTERN)
    L = "language_model.backbone.layers."
    assert torch.equal(full[L + "0.norm.weight"], torch.ones_like(full[L + "0.norm.weight"]))
    assert not full[L + "1.mixer.gate.e_score_correction_bias"].any()
    for key, want in [(L + "3.mixer.q_proj.weight", std), (L + "3.mixer.o_proj.weight", std / (2 * n) ** 0.5),
                      (L + "1.mixer.experts.2.down_proj.weight", std / (2 * n) ** 0.5),
                      (L + "1.mixer.experts.2.up_proj.weight", std)]:
        got = full[key].std().item()
        assert abs(got - want) < 0.15 * want, (key, got, want)
