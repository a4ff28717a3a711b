"""The dry run checks boundary plans and schedules on a layout's distinct block of DP replicas (hetero/plan/replicas.py,
hetero/planner/plan_checks.py): on worlds of 64-512 ranks the block's verdict and counts, times the copies, equal the
check of every rank; a broken plan or schedule fails both ways; layouts whose copies are not translates are not folded.
Groups built as one probe sees them (hetero/planner/fake_groups.py) equal torch's full collective creation."""

import dataclasses
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import pytest

from tessera.hetero.plan import replicas
from tessera.hetero.plan.layout import HeteroLayout, scale_layout
from tessera.hetero.plan.replicas import Fold, dp_fold
from tessera.hetero.planner import plan_checks
from tessera.hetero.planner.dryrun import microbatch_workload
from tessera.hetero.planner.cluster import Workload
from tessera.hetero.planner.plan_checks import check_boundary, check_schedules, synthetic_batch, tile_batch
from tessera.recipes.full_size import RECIPES

# (layout, world): the recipes' defaults, a mixed and a non-colocated layout, colocated modules at the same pp 2
CASES = [(r.layout, 16 * r.gpus) for r in RECIPES.values()] + [
    ("audio=dp4@0-3;vision=tp2,dp14@4-31;language=tp2,dp14,ep2@4-31", 128),
    ("vision=tp2,cp2,dp2@0-7;language=tp4,dp2,pp2@8-23", 192),
    ("vision=pp2,dp4@0-7;language=tp2,pp2,dp2@0-7", 64),
    ("vision=cp2,dp4@0-7;language=tp2,cp2,dp2@0-7", 512),
]


def _folded(spec: str, world: int) -> tuple[HeteroLayout, Fold, int]:
    lay = scale_layout(spec, world)
    w = microbatch_workload(lay, Workload(), 2)
    return lay, dp_fold(lay, min_world=8), w.micro_batch * lay["language"].dp_size


def test_recipes_fold_to_their_own_layout():
    for r in RECIPES.values():
        fold = dp_fold(scale_layout(r.layout, 131072), min_world=r.gpus)
        assert str(fold.layout) == str(HeteroLayout.parse(r.layout)) and fold.copies == 131072 // r.gpus


@pytest.mark.parametrize("spec,world", CASES)
def test_folded_checks_equal_the_check_of_every_rank(spec, world):
    lay, fold, samples = _folded(spec, world)
    assert fold.copies > 1 and fold.layout.world_size * fold.copies == world
    small = fold.layout
    for i, key in enumerate(lay.encoders):
        batch = synthetic_batch(fold.shrink(samples), small["language"].cp, seed=i)
        block = check_boundary(small[key], small["language"], batch).times(fold.copies)
        full = check_boundary(lay[key], lay["language"], tile_batch(batch, fold.copies))
        assert block == full and not full.problems, (key, block, full)
    assert check_schedules(fold, 3) == check_schedules(Fold(lay, 1), 3)


def test_colocated_modules_of_different_pp_are_checked_on_every_rank():
    """Their ranks do not move together between copies: the LLM's first stage holds other samples in every copy."""
    lay = scale_layout("vision=dp8@0-7;language=tp2,pp2,dp2@0-7", 64)
    fold = dp_fold(lay, min_world=8)
    assert fold.copies == 1 and fold.layout == lay and "different pp" in fold.why_not
    base = HeteroLayout.parse("vision=dp8@0-7;language=tp2,pp2,dp2@0-7")  # what folding by 8 would check
    batch = synthetic_batch(8, 1)
    folded = check_boundary(base["vision"], base["language"], batch).times(8)
    full = check_boundary(lay["vision"], lay["language"], tile_batch(batch, 8))
    assert not full.problems and folded.moved != full.moved  # the block's ranks copy rows locally, the copies' not


def _drop_one(plan):
    fwd = plan.forward
    return dataclasses.replace(plan, forward=dataclasses.replace(fwd, transfers=fwd.transfers[:-1]))


@pytest.mark.parametrize("spec,world", [CASES[0], CASES[4]])
def test_a_broken_plan_or_schedule_fails_folded_and_full(spec, world, monkeypatch):
    lay, fold, samples = _folded(spec, world)
    real_plan, real_schedule = plan_checks.plan_boundary, plan_checks.build_schedule
    monkeypatch.setattr(plan_checks, "plan_boundary", lambda *a, **k: _drop_one(real_plan(*a, **k)))
    key = lay.encoders[0]
    batch = synthetic_batch(fold.shrink(samples), fold.layout["language"].cp)
    assert any("rows never" in p for p in check_boundary(fold.layout[key], fold.layout["language"], batch).problems)
    assert any("rows never" in p for p in check_boundary(lay[key], lay["language"], tile_batch(batch, fold.copies))
               .problems)

    def lose_a_message(layout, microbatches):  # rank 0 skips its first send, receive or boundary rendezvous
        s = real_schedule(layout, microbatches)
        first = next(i for i, op in enumerate(s[0]) if op.kind in ("send", "recv") or op.kind.startswith("boundary"))
        s[0] = s[0][:first] + s[0][first + 1:]
        return s
    monkeypatch.setattr(plan_checks, "build_schedule", lose_a_message)
    assert check_schedules(fold, 2).problem and check_schedules(Fold(lay, 1), 2).problem


def test_fold_needs_a_common_dp_factor():
    lay = HeteroLayout.parse("vision=dp3@0-2;language=tp2,dp2@3-6;audio=dp1@7-7")
    assert replicas.fold_factor(lay) == (1, "") and dp_fold(lay, 1).copies == 1


def _memberships(spec: str, world: int, probes: list[int], member_only: bool):
    import torch.distributed as dist

    from tessera.hetero.planner.fake_groups import member_groups_only
    from tessera.hetero.runtime.groups import build_module_groups
    from tessera.hetero.runtime.world import fake_world

    layout, out = HeteroLayout.parse(spec), {}
    for rank in probes:
        with fake_world(rank, world):
            if member_only:
                with member_groups_only():
                    groups = build_module_groups(layout)
            else:
                groups = build_module_groups(layout)
            out[rank] = {(key, n): sorted(dist.get_process_group_ranks(getattr(g.pgs, n)))
                         for key, g in groups.items() if g.pgs is not None
                         for n in ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "mp", "tp_dp_cp", "ep", "expt_dp")}
    return out


def _both_ways():
    spec = str(scale_layout("vision=tp2,cp2,dp2@0-7;language=tp4,dp2,pp2,ep2@8-23", 96))
    probes = [0, 5, 31, 32, 50, 95]
    out = _memberships(spec, 96, probes, True), _memberships(spec, 96, probes, False)
    from tessera.hetero.planner.fake_groups import member_groups_only
    from tessera.hetero.runtime.world import fake_world
    import torch.distributed as dist
    with fake_world(0, 8), member_groups_only():
        try:
            dist.new_subgroups_by_enumeration([[0, 1], [1, 2]])
            overlap = None
        except ValueError as e:
            overlap = str(e)
    return out, overlap


def test_own_groups_equal_torchs_collective_creation():
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:  # fresh process: fake world only
        (fast, full), overlap = pool.submit(_both_ways).result(timeout=300)
    assert fast == full and len(fast) == 6
    assert overlap and "appears twice" in overlap
