"""Search: contains the homogeneous baseline, ranks by predicted throughput, gains are relative to the best
homogeneous layout, the best layout is a valid layout string; the CLI prints the table."""

import pytest

from tessera.hetero.plan.layout import HeteroLayout
from tessera.hetero.planner import Workload, best_layout, cluster, describe_model, plan_layouts, predict, search
from tessera.hetero.planner.__main__ import main

MODEL = describe_model("nemotron_nano_12b_v2", "radio_vit_h")
WORK = Workload(seq_length=8192, global_batch=64, tiles=16)


@pytest.fixture(scope="module")
def ranked():
    return search(MODEL, WORK, cluster("h100", 16), 16)


def test_search_covers_every_placement_and_the_baseline(ranked):
    placements = {p.placement for p in ranked if p.feasible}
    assert {"homogeneous", "colocated", "non-colocated"} <= placements
    homogeneous = [p for p in ranked if p.placement == "homogeneous" and p.feasible]
    assert "vision=tp4,dp4@0-15;language=tp4,dp4@0-15" in {p.layout for p in homogeneous}
    assert max(homogeneous, key=lambda p: p.tokens_per_s).gain == 0.0


def test_ranking_is_by_predicted_throughput_and_reproducible(ranked):
    feasible = [p for p in ranked if p.feasible]
    assert [p.tokens_per_s for p in feasible] == sorted((p.tokens_per_s for p in feasible), reverse=True)
    assert all(not p.feasible for p in ranked[len(feasible):])     # infeasible ones last, with a reason
    assert all(p.reason for p in ranked[len(feasible):])
    base = max((p for p in feasible if p.placement == "homogeneous"), key=lambda p: p.tokens_per_s)
    for p in feasible[:5]:
        assert p.gain == pytest.approx(p.tokens_per_s / base.tokens_per_s - 1)
        again = predict(p.layout, MODEL, Workload(**{**WORK.__dict__, "micro_batch": p.micro_batch,
                                                     "global_batch": p.global_batch}), cluster("h100", 16),
                        baseline=p.baseline)
        assert again.step_s == pytest.approx(p.step_s)                # ranked numbers are predict()'s


def test_every_llm_layout_is_priced_as_megatrons_baseline_and_as_tessera_trains_it(ranked):
    """Megatron's baseline (encoders whole on the LLM's first stage, replicated over its CP) is the gains'
    reference; the same string given to Tessera is trained colocated, encoders split like the LLM."""
    same = [p for p in ranked if p.baseline]
    assert same and all(p.placement == "homogeneous" for p in same)
    ours = {p.layout: p for p in ranked if not p.baseline}
    for p in same:
        assert ours[p.layout].placement == "colocated"
    split = [p for p in same if p.feasible and ours[p.layout].feasible and "pp2" in p.layout]
    assert split and all(ours[p.layout].step_s != p.step_s for p in split)


def test_plan_layouts_and_best_layout():
    top = plan_layouts(MODEL, WORK, cluster("h100", 16), 16, top=3)
    assert len(top) in (3, 4) and any(p.placement == "homogeneous" for p in top)
    assert not any(p.baseline for p in top[:3]) and all(p.baseline for p in top[3:])  # the reference comes last
    best = best_layout(MODEL, WORK, cluster("h100", 16), 16)
    assert best == top[0].layout
    HeteroLayout.parse(best).validate(world_size=16)


def test_cli_prints_the_table_and_the_best_layout(capsys):
    assert main(["--llm", "nemotron_nano_12b_v2", "--vision", "radio_vit_h", "--gpus", "16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "homogeneous" in out and out.strip().splitlines()[-1].startswith("best: vision=")
