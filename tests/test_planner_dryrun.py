"""Dry run at 1024 ranks: every recipe default passes (groups, boundary plans, schedule, memory); broken
plans and layouts fail with the reason."""

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
    r = defaults.RECIPES[name]
    HeteroLayout.parse(r.layout).validate(world_size=r.gpus)
    report = dry_run(r.layout, WORLD, 4, r.model(), r.workload, groups=False)  # groups: one process below
    assert report.ok, str(report)
    assert report.world == WORLD and report.memory_gib
    assert any(n.startswith("schedule: 4 microbatches") for n in report.notes), report.notes
    assert report.seconds["total"] < 20


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
    bad_tp = dry_run("vision=dp4@0-3;language=tp3,dp4@4-15", None, 4, r.model(), r.workload, groups=False)
    assert not bad_tp.ok and any("tp=3 does not divide its 40 attention heads" in p for p in bad_tp.problems)
    bad_world = dry_run(r.layout, 1000, groups=False)
    assert not bad_world.ok and "not a multiple" in bad_world.problems[0]
    overlap = dry_run("vision=dp4@0-3;language=tp2@2-5", groups=False)
    assert not overlap.ok and "partly overlap" in overlap.problems[0]
