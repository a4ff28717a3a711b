"""The pure rules of checkpoints at scale, in milliseconds: a ZeRO range as rectangles (hetero/plan/flat_boxes.py),
which checkpoints stay (hetero/plan/retention.py), Slurm's signal lead turned into the launcher's grace
(recipes/executors.py)."""

from __future__ import annotations

import itertools
from math import prod

import numpy as np
import pytest

from tessera.hetero.plan.flat_boxes import flat_boxes
from tessera.hetero.plan.retention import KeepPolicy

SHAPES = [(), (7,), (1, 1), (4, 3), (3, 1, 5), (2, 3, 4), (5, 1), (1, 6), (2, 2, 2, 3), (0, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_boxes_tile_every_range_exactly_in_order(shape):
    """Every [a, b) of every shape: the boxes cover exactly its elements, once, each box a contiguous run of
    the range starting where its flat index says (so its data is a view of the rank's 1-D shard), in order,
    none empty (a range ending one element into the row after a partial one has no block of whole rows),
    each with one offset per dimension, and at most 2 * ndim - 1 of them."""
    n = prod(shape)
    index = np.arange(n).reshape(shape) if shape else np.arange(1).reshape(())
    for a, b in itertools.combinations_with_replacement(range(n + 1), 2):
        boxes = flat_boxes(shape, a, b)
        got, cursor = [], a
        for off, shp, first in boxes:
            assert first == cursor, (shape, a, b, boxes)
            assert len(off) == len(shp) == len(shape) and prod(shp) > 0, (shape, a, b, boxes)  # no empty box
            block = index[tuple(slice(o, o + s) for o, s in zip(off, shp))]
            assert block.shape == tuple(shp)
            assert block.reshape(-1).tolist() == list(range(first, first + prod(shp))), (shape, a, b, off, shp)
            got += block.reshape(-1).tolist()
            cursor += prod(shp)
        assert got == list(range(a, b)), (shape, a, b, boxes)
        assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, a, b, boxes)


def test_boxes_of_ranks_tile_a_parameter():
    """The ZeRO ranges of 4 ranks over a 10 x 6 parameter (15 elements each) give 60 distinct elements."""
    seen = np.zeros((10, 6), dtype=int)
    for r in range(4):
        for off, shp, _ in flat_boxes((10, 6), 15 * r, 15 * (r + 1)):
            seen[off[0]:off[0] + shp[0], off[1]:off[1] + shp[1]] += 1
    assert (seen == 1).all()


def test_boxes_reject_a_range_outside_the_tensor():
    with pytest.raises(ValueError, match=r"range \[3, 13\) is outside a tensor of 12 elements"):
        flat_boxes((4, 3), 3, 13)


@pytest.mark.parametrize("last,every,steps,latest,gone", [
    (None, 0, [1, 2, 3], 3, []),                       # default: keep everything
    (1, 0, [1, 2, 3], 3, [1, 2]),
    (2, 0, [10, 20, 30, 40], 40, [10, 20]),
    (2, 20, [10, 20, 30, 40, 50], 50, [10, 30]),       # every 20th stays for good
    (1, 0, [10, 20, 30], 20, [10]),                    # `latest` is never deleted, even if not the newest
    (3, 0, [5], 5, []),
])
def test_keep_policy(last, every, steps, latest, gone):
    assert KeepPolicy(last, every).to_delete(steps, latest) == gone


@pytest.mark.parametrize("last,every,msg", [(0, 0, "keep_last=0 would delete every checkpoint"),
                                            (-2, 0, "keep_last=-2"), (None, -1, "keep_every=-1")])
def test_keep_policy_refuses_what_would_lose_the_resume_point(last, every, msg):
    with pytest.raises(ValueError, match=msg):
        KeepPolicy(last, every)


# ---- Slurm: signal, time limit, grace ---------------------------------------------------------------------

def test_slurm_signal_and_time_limit_parsing():
    from tessera.recipes.slurm_signal import shutdown_grace_s, slurm_signal, slurm_time_s

    assert slurm_signal("TERM@300") == ("TERM", 300) and shutdown_grace_s("TERM@300") == 270
    assert slurm_signal("R:SIGUSR1@90") == ("USR1", 90) and slurm_signal("15@100") == ("TERM", 100)
    assert slurm_signal("TERM") == ("TERM", 60)  # Slurm's default lead
    assert slurm_signal("B:USR1@120") == (None, None)  # the batch shell only: the ranks never see it
    assert [slurm_time_s(t) for t in ("30", "2:30", "04:00:00", "1-00", "1-2:03", "1-02:03:04")] == [
        1800, 150, 14400, 86400, 93780, 93784]


def _trainer(**kw):
    from tessera.hetero.runspec.config import TrainerConfig

    return TrainerConfig(**kw)


def test_save_schedule_for_the_12b_defaults_as_the_issue_counted():
    """nemotron_vl_12b's old settings: 30.6 s steps, save_every=1000 -> the first save after 8.5 h, past a 4 h
    limit: without a signal no checkpoint is ever written (error naming the fix); with TERM@300 the signal's
    save fits the 270 s grace but is the only one (warning naming save_interval_minutes)."""
    from tessera.recipes.prelaunch import save_schedule_problems

    t = _trainer(save_every=1000)
    errors, warnings = save_schedule_problems(t, 4 * 3600, None, 30.6, 12.0)
    assert len(errors) == 1 and "no checkpoint would be written" in errors[0] and "8.5 h" in errors[0], errors
    assert "run.executor.signal=TERM@300" in errors[0] and "trainer.save_interval_minutes=60" in errors[0], errors
    errors, warnings = save_schedule_problems(t, 4 * 3600, "TERM@300", 30.6, 12.0)
    assert errors == [] and len(warnings) == 1 and "trainer.save_interval_minutes=60" in warnings[0], warnings
    # an interval under the limit: nothing to say
    assert save_schedule_problems(_trainer(save_every=1000, save_interval_minutes=60), 4 * 3600, "TERM@300",
                                  30.6, 12.0) == ([], [])
    # a step plus a save longer than the grace: raise the signal's lead
    errors, _ = save_schedule_problems(_trainer(save_interval_minutes=60), 4 * 3600, "TERM@60", 30.6, 12.0)
    assert len(errors) == 1 and "leaves the ranks 30 s" in errors[0] and "run.executor.signal=TERM@120" in errors[0]
    # a signal the ranks do not save on counts as none
    errors, _ = save_schedule_problems(t, 4 * 3600, "INT@300", 30.6, 12.0)
    assert errors and "SIGINT, which the ranks do not save on" in errors[0], errors
