"""A layout as copies of a smaller one: the DP replicas that at-scale checks need not repeat. Pure; no torch.

`scale_layout` grows a layout by data parallelism, so a recipe's layout at 131,072 ranks is thousands of copies
of one small block of DP replicas, each copy on its own ranks and its own samples. `dp_fold(layout)` finds
that block: the layout L0 and count k such that `layout` is k copies of L0 - every module's DP size and rank
range divided by k (k divides every module's DP size, so every range boundary, a sum of module sizes, too).
Copy b of the layout is, in every module, the DP ranks [b*dp0, (b+1)*dp0) (dp0: the module's DP in L0) and
the samples [b*N/k, (b+1)*N/k) of a microbatch of N samples.

Why checking L0 checks the layout (hetero/planner/dryrun.py relies on it):
* one rank, one copy: in module m a rank sits at offset tp + TP*(cp + CP*(dp + DP*pp)) of its range; shifting
  its DP coordinate into copy b moves it by TP*CP*dp0_m * (b + (k-1)*pp) ranks. Modules on disjoint ranges move
  independently; modules on one range (colocated) move every shared rank by the same amount exactly when they
  have the same PP (TP*CP*dp0 is then the range's size over k*PP for each). So a rank that is in two modules
  is in the same copy of both, at the same coordinates relative to it. When colocated modules differ in PP
  this fails and dp_fold returns the layout itself (k = 1): the checks then visit every rank, as before.
* boundary plans (hetero/plan/boundary_plan.py) route each element (sample, media token) from the source DP
  shard that holds it to the destination DP shards that need it. DP cuts the samples into equal contiguous
  parts (dp_owner), so copy b's samples live only on copy b's DP ranks of both modules: the plan is k
  independent plans, and for the batch repeated k times copy b's is copy 0's with every rank moved as above
  (local copies included: a rank holds the same shards of both modules relative to its copy). Rows moved,
  transfers and the minimum are k times L0's. (The dry run's synthetic batches are row-owned; a run's items
  dealt by cost may cross copies - hetero/plan/encoder_balance.py - and those plans are checked over generated
  layouts in tests/test_boundary_plan.py, not folded.)
* the schedule (hetero/plan/schedule_plan.py): a rank's ops depend on its module coordinates only, pipeline
  sends stay inside one DP replica of one module, and a boundary rendezvous joins every copy at once; copies
  that run the same ops in the same order reach each rendezvous together, so k copies run to the end (no
  deadlock, every message received) exactly when one copy does, with k times the ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.hetero.plan.layout import HeteroLayout, scale_layout

FOLD_MIN_WORLD = 256  # the dry run checks a block of at least this many ranks (or the whole layout, if smaller)


@dataclass(frozen=True)
class Fold:
    layout: HeteroLayout   # L0: the block that is checked
    copies: int            # k: the layout is k copies of L0 (1: nothing folded)
    why_not: str = ""      # when copies is 1 although the DP sizes share a factor: what prevents folding

    def shrink(self, n: int) -> int:
        """A count over the whole layout (samples, ranks) as it is over L0."""
        if n % self.copies:
            raise ValueError(f"{n} does not split into {self.copies} equal copies")
        return n // self.copies


def fold_factor(layout: HeteroLayout) -> tuple[int, str]:
    """(k, why_not): the most copies the layout splits into (the gcd of its DP sizes), or 1 and the reason when a
    range holds modules of different PP (their ranks do not move together between copies; see above)."""
    k = math.gcd(*(m.dp_size for m in layout.modules.values()))
    by_range: dict[tuple[int, int], set[int]] = {}
    for m in layout.modules.values():
        by_range.setdefault((m.first, m.last), set()).add(m.pp)
    mixed = [f"{first}-{last}" for (first, last), pps in by_range.items() if len(pps) > 1]
    if k > 1 and mixed:
        return 1, f"colocated modules of different pp on ranks {', '.join(mixed)}"
    return k, ""


def dp_fold(layout: HeteroLayout, min_world: int = FOLD_MIN_WORLD) -> Fold:
    """The layout as `copies` copies of the smallest block of at least `min_world` ranks (the whole layout when
    it is no larger): every module's DP size and range divided by `copies`, a divisor of fold_factor."""
    k, why = fold_factor(layout)
    copies = min(k, max(1, layout.world_size // min_world))
    while k % copies:
        copies -= 1
    if copies == 1:
        return Fold(layout, 1, why)
    # the block is the layout shrunk by data parallelism, the rule an elastic restart uses (layout.scale_layout)
    return Fold(scale_layout(layout, layout.world_size // copies), copies)
