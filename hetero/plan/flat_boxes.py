"""A contiguous range of a tensor's row-major elements as rectangular boxes (pure; no torch).

ZeRO-1 (hetero/optim/zero.py) gives each rank a contiguous range [a, b) of a parameter's flattened
elements: an arbitrary slice, not a rectangle. A checkpoint stores tensors as rectangles with offsets
(dist_checkpointing's ShardedTensor; megatron-core 0.16.1 refuses `flattened_range`), so each rank's range
is written as the few rectangles that tile it exactly - a partial first row, a block of whole rows, a
partial last row, recursively inside the rows - each of them a contiguous run of the range, so the data
of every box is a view of the rank's own 1-D state, never a copy. At most 2 * ndim - 1 boxes per range.

    flat_boxes((4, 3), 2, 10) == [((0, 2), (1, 1), 2), ((1, 0), (2, 3), 3), ((3, 0), (1, 1), 9)]
                                   offset   shape   first element of the box within [a, b) + a
"""

from __future__ import annotations

from math import prod

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offset, shape, flat index of its first element)


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Rectangles tiling elements [start, stop) of a row-major tensor of `shape`, in element order."""
    shape = tuple(shape)
    total = prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"range [{start}, {stop}) is outside a tensor of {total} elements {shape}")
    if start == stop:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (stop - start,) * len(shape), start)]
    row = prod(shape[1:])
    if row == 0:
        return []
    (r0, c0), (r1, c1) = divmod(start, row), divmod(stop, row)

    def in_row(r: int, a: int, b: int) -> list[Box]:
        return [((r,) + off, (1,) + shp, r * row + first) for off, shp, first in flat_boxes(shape[1:], a, b)]

    if r0 == r1:
        return in_row(r0, c0, c1)
    out = []
    if c0:
        out += in_row(r0, c0, row)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:], r0 * row))
    if c1:
        out += in_row(r1, 0, c1)
    return out
