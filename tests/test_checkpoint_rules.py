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
    and at most 2 * ndim - 1 of them."""
    n = prod(shape)
    index = np.arange(n).reshape(shape) if shape else np.arange(1).reshape(())
    for a, b in itertools.combinations_with_replacement(range(n + 1), 2):
        boxes = flat_boxes(shape, a, b)
        got, cursor = [], a
        for off, shp, first in boxes:
            assert first == cursor, (shape, a, b, boxes)
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
