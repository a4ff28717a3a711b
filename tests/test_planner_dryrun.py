"""Dry run at 1024 ranks: every recipe default passes its groups, boundary plans and schedule, memory is
counted on the real modules (meta device) next to the cost model; broken plans and layouts fail with the reason."""

import dataclasses
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from tessera.hetero.plan.boundary_plan import plan_boundary
from tessera.hetero.plan.layout import HeteroLayout, LayoutError
from tessera.recipes import full_size as defaults
from tessera.hetero.plan.layout import scale_layout
from tessera.hetero.planner.dryrun import check_boundary_plan, check_groups, dry_run, probe_ranks, synthetic_batch

WORLD = 1024


def test_scale_layout_grows_data_parallelism():
    big = scale_layout("audio=dp4@0-3;vision=tp2,dp14@4-31;language=tp2,dp14,ep2@4-31", 1024)
    assert str(big) == "audio=dp128@0-127;vision=tp2,dp448@128-1023;language=tp2,dp448,ep2@128-1023"
    assert big.placement == "mixed"
    with pytest.raises(LayoutError, match="not a multiple"):
        scale_layout("vision=dp4@0-3;language=tp4@4-7", 1001)


@pytest.mark.parametrize("name", sorted(defaults.RECIPES))
def test_recipe_default_passes_at_1024_ranks(name):
    """Boundary plans, schedules and memory pass: every default fits an 80 GB GPU with what the recipes turn on
    (ZeRO-1, full recompute), by the cost model here and by the meta-device count below."""
    r = defaults.RECIPES[name]
    HeteroLayout.parse(r.layout).validate(world_size=r.gpus)
    report = dry_run(r.layout, WORLD, 4, r.model(), r.workload, groups=False, meta=False)  # groups: below
    assert report.ok, str(report)
    assert report.world == WORLD and report.memory_gib
    assert any(n.startswith("schedule: 4 microbatches") for n in report.notes), report.notes
    assert report.seconds["total"] < 20
    print(report)


def test_dry_run_prints_meta_device_memory_per_module_and_rank():
    """The real modules built on the meta device, per rank: params, grads, optimizer, measured activations per
    module and in total, next to the cost model's with the difference; a rank over 0.9 x 80 GB fails."""
    r = defaults.RECIPES["nemotron_vl_12b"]
    report = dry_run(r.layout, None, 4, r.model(), r.workload, groups=False)
    text = str(report)
    assert "memory per rank, GiB (meta-device build" in text and "ZeRO-1" in text
    rows = [line.split() for line in report.memory_lines if line.split()[0] in ("language", "vision", "total")]
    assert [row[0] for row in rows] == ["language", "vision", "total"]
    assert all("measured," in line for line in report.memory_lines if line.split()[0] in ("language", "vision"))
    assert {(c.key, c.stage) for c in report.params} == {("language", 0), ("vision", 0)}
    assert all(abs(c.rel) < 0.05 for c in report.params), report.params
    total = float(rows[-1][rows[-1].index("=") + 1])
    assert total <= 0.9 * 79.6 and report.ok, text  # the default fits the usable memory of an 80 GB GPU
    assert report.seconds["meta"] < 120


def _groups_of_every_default():
    return {name: check_groups(str(scale_layout(r.layout, WORLD)), WORLD, probe_ranks(scale_layout(r.layout, WORLD)))
            for name, r in defaults.RECIPES.items()}


def test_recipe_default_process_groups_at_1024_ranks():
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:  # fresh process: fake world only
        problems = pool.submit(_groups_of_every_default).result(timeout=300)
    assert problems == {name: [] for name in defaults.RECIPES}


def test_broken_boundary_plan_is_caught():
    lay = HeteroLayout.parse("vision=dp4@0-3;language=tp2,cp2@4-7")
    batch = synthetic_batch(4, 2)
    plan = plan_boundary(lay["vision"], lay["language"], batch)
    assert check_boundary_plan(plan, lay["vision"], lay["language"], batch) == []
    dropped = dataclasses.replace(plan, forward=dataclasses.replace(plan.forward,
                                                                    transfers=plan.forward.transfers[1:]))
    found = check_boundary_plan(dropped, lay["vision"], lay["language"], batch)
    assert any("rows never" in p for p in found), found
    t = plan.backward.transfers[0]
    wrong = dataclasses.replace(t, src_index=np.roll(t.src_index, 1)) if len(t.src_index) > 1 else t
    doubled = dataclasses.replace(plan, backward=dataclasses.replace(plan.backward,
                                                                     transfers=plan.backward.transfers + (wrong,)))
    found = check_boundary_plan(doubled, lay["vision"], lay["language"], batch)
    assert any("more than once" in p for p in found), found


def test_bad_layouts_fail_with_the_reason():
    r = defaults.RECIPES["nemotron_vl_12b"]
    bad_tp = dry_run("vision=dp4@0-3;language=tp3,dp4@4-15", None, 4, r.model(), r.workload, groups=False,
                     meta=False)
    assert not bad_tp.ok and any("tp=3 does not divide its 40 attention heads" in p for p in bad_tp.problems)
    bad_world = dry_run(r.layout, 1000, groups=False)
    assert not bad_world.ok and "not a multiple" in bad_world.problems[0]
    overlap = dry_run("vision=dp4@0-3;language=tp2@2-5", groups=False)
    assert not overlap.ok and "partly overlap" in overlap.problems[0]


def test_the_dry_run_prices_the_recipes_recompute_and_says_so(capsys):
    """Issue 62 item 7: the dry run priced nemotron_vl_12b without recompute (45.6 GiB of activations) while the
    recipe trains with model.recompute=full; it now prices the recipe's and names where that came from."""
    from tessera.scripts import dryrun

    assert dryrun.main(["--recipe", "nemotron_vl_12b", "--no-meta"]) == 0
    assert "recompute language,vision (model.recompute=full)" in capsys.readouterr().out
    from tessera.hetero.planner.dryrun import _priced_recompute

    layout = HeteroLayout.parse("vision=dp2@0-1;language=dp2@0-1")
    assert _priced_recompute("language=selective,vision=full", layout) == (
        ("vision",), "model.recompute=language=selective,vision=full; selective (language) priced as none")
