"""The step schedule as data: deadlock-free for many layouts, 1F1B memory bound, encoders running ahead,
and a broken schedule is caught with a message naming the blocked ranks. Pure Python, milliseconds."""

from __future__ import annotations

import itertools

import pytest

from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout
from tessera.hetero.plan.schedule_plan import Op, ScheduleError, build_schedule, check_schedule, one_f_one_b


def _layouts():
    """Colocated and non-colocated layouts with PP on either side, one or two encoders."""
    out = []
    for lang in ("dp4", "tp2,pp2", "pp4", "cp2,pp2", "tp2,dp2"):
        out.append(f"vision=dp4@0-3;language={lang}@0-3")
        out.append(f"vision=dp4@0-3;audio=dp4@0-3;language={lang}@0-3")
        out.append(f"vision=dp2@4-5;language={lang}@0-3")
        out.append(f"vision=dp2,pp2@4-7;audio=dp2@8-9;language={lang}@0-3")
        out.append(f"vision=dp2@4-5;audio=dp2@4-5;language={lang}@0-3")
        out.append(f"vision=dp4@0-3;audio=dp2@4-5;language={lang}@0-3")  # one colocated, one not
        # a colocated encoder pipeline: earlier stages on LLM first-stage ranks join the boundary
        out.append(f"vision=pp2,dp2@0-3;language={lang}@0-3")
        out.append(f"vision=pp4@0-3;audio=dp4@0-3;language={lang}@0-3")
    return out


@pytest.mark.parametrize("spec", _layouts())
def test_every_layout_is_deadlock_free(spec):
    layout = HeteroLayout.parse(spec).validate()
    for m in (1, 2, 3, 5):
        schedules = build_schedule(layout, m)
        ran = check_schedule(schedules, layout)
        assert ran == sum(len(ops) for ops in schedules.values())
        for rank, ops in schedules.items():  # every module on this rank runs each microbatch forward once
            for key in layout.modules_of_rank(rank):
                fwd = [op.mb for op in ops if op.kind == "fwd" and op.module == key]
                assert sorted(fwd) == list(range(m)), (spec, rank, key)


@pytest.mark.parametrize("stages,microbatches", list(itertools.product([1, 2, 4], [1, 3, 8])))
def test_1f1b_keeps_at_most_stages_minus_rank_microbatches_in_flight(stages, microbatches):
    for s in range(stages):
        events, live, peak = one_f_one_b(stages, s, microbatches), 0, 0
        for kind, _ in events:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert live == 0 and peak == min(stages - s, microbatches)
        assert [m for k, m in events if k == "B"] == list(range(microbatches))


def test_non_colocated_encoder_runs_ahead_of_the_llm():
    layout = HeteroLayout.parse("vision=dp2@0-1;language=pp2@2-3").validate()
    ops = build_schedule(layout, 4)[0]
    # the encoder's forward of microbatch 1 happens before the backward exchange of microbatch 0
    assert ops.index(Op("fwd", "vision", 1)) < ops.index(Op("boundary_bwd", "vision", 0))


def test_colocated_step_is_three_phases():
    layout = HeteroLayout.parse("vision=dp4@0-3;language=pp2,dp2@0-3").validate()
    ops = build_schedule(layout, 3)[0]
    first_llm = min(i for i, op in enumerate(ops) if op.module == LANGUAGE)
    last_llm = max(i for i, op in enumerate(ops) if op.module == LANGUAGE)
    enc = [i for i, op in enumerate(ops) if op.module == "vision"]
    assert all(i < first_llm or i > last_llm for i in enc)
    assert [ops[i].kind for i in enc] == ["fwd", "boundary_fwd"] * 3 + ["boundary_bwd"] * 3


def test_a_broken_schedule_is_reported():
    layout = HeteroLayout.parse("vision=dp2@0-1;language=pp2@2-3").validate()
    schedules = build_schedule(layout, 2)
    ops = schedules[3]  # LLM last stage: receive microbatch 1 before microbatch 0 -> out of order
    i, j = ops.index(Op("recv", LANGUAGE, 0, 2, "act")), ops.index(Op("recv", LANGUAGE, 1, 2, "act"))
    ops[i], ops[j] = ops[j], ops[i]
    with pytest.raises(ScheduleError, match="out of order"):
        check_schedule(schedules, layout)
    schedules = build_schedule(layout, 2)
    schedules[0] = [op for op in schedules[0] if op != Op("boundary_fwd", "vision", 1)]  # rank 0 skips one
    with pytest.raises(ScheduleError, match="deadlock; blocked: rank"):
        check_schedule(schedules, layout)


def test_boundary_rendezvous_waits_for_every_participant_in_order():
    """A rendezvous completes only when every participant stands at that very op: two encoder ranks that
    run their boundaries in different microbatch orders deadlock, and a rank outside the boundary's group
    running it is named."""
    layout = HeteroLayout.parse("vision=dp2@0-1;language=dp2@2-3").validate()
    schedules = build_schedule(layout, 2)
    a, b = Op("boundary_fwd", "vision", 0), Op("boundary_fwd", "vision", 1)
    ops = schedules[1]
    i, j = ops.index(a), ops.index(b)
    ops[i], ops[j] = ops[j], ops[i]
    with pytest.raises(ScheduleError, match="deadlock; blocked: rank 0: boundary_fwd"):
        check_schedule(schedules, layout)
    schedules = build_schedule(layout, 2)
    stranger = HeteroLayout.parse("vision=dp2@0-1;language=dp2@2-3;audio=dp1@4-4").validate()
    schedules.update({4: [a]})  # rank 4 (audio) is no participant of the vision boundary
    with pytest.raises(ScheduleError, match="rank 4 runs boundary_fwd\\(vision,mb0\\) but is not one of"):
        check_schedule(schedules, stranger)


@pytest.mark.parametrize("spec", ["vision=dp4@0-3;audio=cp2,dp2@0-3;language=tp2,dp2@0-3",
                                  "vision=tp2,dp2@0-3;audio=dp2@4-5;language=cp2,dp2@0-3"])
def test_colocated_encoders_at_pp1_run_inside_each_microbatch(spec):
    """LLM and colocated encoders at pp 1: each microbatch's encoder forward + boundary right before the LLM's
    forward, boundary backward right after its backward, so one microbatch of encoder activations is alive."""
    layout = HeteroLayout.parse(spec).validate()
    colocated = [k for k in layout.encoders if layout.colocated(k, LANGUAGE)]
    schedules = build_schedule(layout, 3)
    check_schedule(schedules, layout)
    for rank in layout[LANGUAGE].ranks:
        ops = schedules[rank]
        for mb in range(3):
            llm_fwd, llm_bwd = ops.index(Op("fwd", LANGUAGE, mb)), ops.index(Op("bwd", LANGUAGE, mb))
            for k in colocated:
                assert llm_fwd - 4 <= ops.index(Op("boundary_fwd", k, mb)) < llm_fwd
                assert llm_bwd < ops.index(Op("boundary_bwd", k, mb)) <= llm_bwd + 4
        live = peak = 0
        for op in ops:
            live += (op.kind == "fwd" and op.module in colocated) - (op.kind == "boundary_bwd" and op.module in colocated)
            peak = max(peak, live)
        assert live == 0 and peak == len(colocated), (rank, peak)
