"""The busiest encoder DP rank, as the planner prices it: the expected maximum over DP ranks, not the mean (issue 35).

    busiest_rank_factor(dp=8, rows_per_rank=2, items_per_rank=4, spread=(0.8, 0.57), balanced=True)   # ~1.03
    busiest_rank_factor(dp=8, rows_per_rank=2, items_per_rank=4, spread=(0.8, 0.57), balanced=False)  # ~1.79

A microbatch's embeddings cross the boundary when its slowest encoder rank is done, so an encoder's time is its
busiest DP rank's cost, E[max over ranks] = mean x this factor. `spread` is the media mix's (row, item) coefficient
of variation of encoder FLOPs: how much one packed row's media cost varies from row to row, and one item's from
item to item (scripts/bench_balance.py measures both for a mix; 0 prices every row alike, the mean).

  row ownership   a rank's cost is the sum of its rows', so for n rows per rank its spread is cv_row / sqrt(n), and
                  the largest of dp such sums is about the mean + z(dp) of those spreads, z(dp) the expected maximum
                  of dp standard normals (Blom's approximation: inv_cdf((dp - 0.375) / (dp + 0.25))).
  by cost         largest first (hetero/plan/encoder_balance.balanced_assignment) ends within about one small item
                  of the mean: measured over the bench's mixes the excess falls like 1 / (2 k^2) for k items per
                  rank; it cannot beat the largest single item, mean x (1 + cv_item z(dp k)) / k of a rank's mean
                  load, and it is never priced above row ownership.
Checked against the bench's simulation of both assignments (tests/test_encoder_balance.py): row ownership within
5% of the measured max/mean for the image mixes and within 15% for heavy-tailed audio (dp64: 2.34 priced, 2.62
measured: the sums' right tail is longer than a normal's); balanced within 0.03 (0.06 for audio at dp2, where one long clip can outweigh a rank's share).

MIXED_SPREAD is the bench's document/video/audio mix as measured (its table's "cv row / item" column): the spread a
run is priced with when nothing better is known (hetero/planner/run_layout.py, recipes/full_size.py).
"""

from __future__ import annotations

import math
from statistics import NormalDist


#: (row, item) coefficient of variation of encoder FLOPs per modality (the media mix's, whatever family encodes it),
#: scripts/bench_balance.py's mixed set
MIXED_SPREAD = {"vision": (0.14, 0.62), "audio": (0.83, 0.57)}


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (Blom 1958); 0 for one."""
    return 0.0 if n <= 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def row_owned_factor(dp: int, rows_per_rank: float, row_cv: float) -> float:
    if dp <= 1 or rows_per_rank <= 0:
        return 1.0
    return 1.0 + expected_max_normal(dp) * row_cv / math.sqrt(rows_per_rank)


def balanced_factor(dp: int, items_per_rank: float, item_cv: float, row_factor: float) -> float:
    if dp <= 1 or items_per_rank <= 0:
        return 1.0
    k = items_per_rank
    largest = (1.0 + item_cv * expected_max_normal(max(1, round(dp * k)))) / k
    return min(row_factor, max(1.0 + 1.0 / (2.0 * k * k), largest))


def busiest_rank_factor(dp: int, rows_per_rank: float, items_per_rank: float, spread: tuple[float, float],
                        balanced: bool) -> float:
    """E[busiest encoder DP rank's cost] / the mean rank's, for the media mix's (row, item) spread."""
    row_cv, item_cv = spread
    if row_cv <= 0 and item_cv <= 0:
        return 1.0
    owned = row_owned_factor(dp, rows_per_rank, row_cv)
    return balanced_factor(dp, items_per_rank, item_cv, owned) if balanced else owned
