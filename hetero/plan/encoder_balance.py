"""Which encoder DP rank encodes which media item: by cost, not by row (issue 35; pure, no torch).

    owner = balanced_assignment(costs, ranks=8, memory=act_bytes, cap=cap_bytes)   # owner[i]: item i's rank
    owner = row_owned_assignment(item_rows, rows=16, ranks=8)                       # the rows' owners, for comparison
    loads = rank_loads(costs, owner, 8); imbalance(loads)                           # max / mean
    ItemAssignment({"vision": 4, "audio": 2}, cost).owners(batch.media_meta)        # a run's microbatch, every encoder

Rows are packed by LLM tokens, not by encoder cost, and an item's cost varies by two orders of magnitude (a
12-tile scan, a 1-tile photo, a 32-frame clip, two minutes of audio), so under row ownership (each DP rank
encodes the items of its rows: resolved_run.dp_rows) the rank that drew the heavy rows sets the step.
balanced_assignment is longest-processing-time first: items by decreasing cost (ties: by index), each to the
least-loaded rank (ties: the lowest) that has room under the activation-memory cap. Its largest load is at most
4/3 - 1/(3 ranks) of the best possible (Graham 1969), and within one item of the mean: max <= mean + the
largest item. It is a function of the costs alone, so every rank computes the same assignment from the
microbatch's metadata (which every rank holds) with no communication. Costs are the encoder's FLOPs per item
(hetero/planner/flops.media_item_flops: a native-resolution image or a tubelet attends over all its patches, so
its cost grows with their square); the caller computes them, this layer only assigns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tessera.hetero.plan.resolved_run import dp_owner, dp_rows


class ItemTooLarge(ValueError):
    """An item needs more activation memory than one rank's cap."""


def balanced_assignment(costs: Sequence[float], ranks: int, memory: Sequence[float] | None = None,
                        cap: float | None = None) -> list[int]:
    """owner[i] in range(ranks) for every item i: longest-processing-time first under an optional per-rank
    activation-memory cap (module docstring). ItemTooLarge names an item no rank can hold, and the case where
    the items' memory does not fit in ranks x cap at all; ranks without items stay idle."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: an encoder has at least one DP rank")
    memory = list(memory) if memory is not None else [0.0] * len(costs)
    if len(memory) != len(costs):
        raise ValueError(f"{len(costs)} costs but {len(memory)} memory sizes")
    if cap is not None:
        for i, m in enumerate(memory):
            if m > cap:
                raise ItemTooLarge(f"media item {i} needs {m / 2**30:.2f} GiB of activations, more than a rank's "
                                   f"cap of {cap / 2**30:.2f} GiB: split it (fewer tiles or frames per item) or "
                                   f"give the encoder more memory per rank (recompute, a smaller micro-batch)")
    load, used, owner = [0.0] * ranks, [0.0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        fits = [r for r in range(ranks) if cap is None or used[r] + memory[i] <= cap]
        if not fits:  # the greedy order can strand an item even when a packing exists: both are named
            raise ItemTooLarge(f"media item {i} ({memory[i] / 2**30:.2f} GiB) fits on no rank: the microbatch's "
                               f"items need {sum(memory) / 2**30:.2f} GiB of activations for {ranks} ranks x "
                               f"{cap / 2**30:.2f} GiB, placed largest first; use fewer rows per microbatch or "
                               f"more encoder ranks")
        r = min(fits, key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
        used[r] += memory[i]
    return owner


def row_owned_assignment(item_rows: Sequence[int], rows: int, ranks: int) -> list[int]:
    """owner[i]: the DP rank whose rows (resolved_run.dp_rows: contiguous blocks) hold item i's row."""
    owner_of_row = {r: d for d in range(ranks) for r in dp_rows(rows, ranks, d)}
    return [owner_of_row[r] for r in item_rows]


def rank_loads(costs: Sequence[float], owner: Sequence[int], ranks: int) -> list[float]:
    loads = [0.0] * ranks
    for c, r in zip(costs, owner, strict=True):
        loads[r] += c
    return loads


def imbalance(loads: Sequence[float]) -> float:
    """Largest load over the mean (1.0: perfectly even; the step waits for the largest)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class ItemAssignment:
    """How a run deals each encoder's media items of a microbatch to the encoder's DP ranks.

    dp_sizes: every encoder of the layout -> its DP size (an LLM-only rank needs every encoder's owners too:
    they are the boundary plan's sources). cost(module, kind, units) -> the item's encoder FLOPs
    (hetero/planner/flops.StepFlops.item_flops, handed in by the trainer); None keeps row ownership. The result
    depends on the metadata alone (PackedBatch.media_meta, the same on every rank), so the loader of every rank
    computes the same owners without communicating (data/loader.py). Every item is encoded on its own
    (hetero/training/stages.py), so which rank encodes it changes no number: only who waits for whom."""

    dp_sizes: Mapping[str, int]
    cost: Callable[[str, str, object], float] | None = None

    def owners(self, media_meta: Sequence[Mapping[str, Sequence]]) -> dict[str, tuple[int, tuple[tuple[int, ...], ...]]]:
        """encoder -> (its DP size, per row the DP rank that encodes each of the row's items of it, in order)."""
        return {key: (dp, self.module_owners(media_meta, key, dp)) for key, dp in sorted(self.dp_sizes.items())}

    def module_owners(self, media_meta, key: str, dp: int) -> tuple[tuple[int, ...], ...]:
        """Per row, each item's DP rank. By cost under a memory cap: no rank holds more of the encoder's tokens
        (its activations grow with them) than the fullest rank would under row ownership in this microbatch, so
        balancing never needs memory that row ownership did not; where largest-first strands an item under that
        cap (rare: 2 of 240 microbatches of the bench's mixes), the microbatch keeps its rows' split."""
        rows = row_owners(media_meta, key, dp)
        if self.cost is None or dp == 1:
            return rows
        items = [m for meta in media_meta for m in meta.get(key, [])]
        tokens, by_row = [float(m[2]) for m in items], [o for own in rows for o in own]
        try:
            owner = balanced_assignment([self.cost(key, m[0], m[1]) for m in items], dp, memory=tokens,
                                        cap=max(rank_loads(tokens, by_row, dp)))
        except ItemTooLarge:
            return rows
        out, at = [], 0
        for meta in media_meta:
            n = len(meta.get(key, []))
            out.append(tuple(owner[at:at + n]))
            at += n
        return tuple(out)


def row_owners(media_meta: Sequence[Mapping[str, Sequence]], key: str, dp: int) -> tuple[tuple[int, ...], ...]:
    """Per row, each item's DP rank under row ownership: the row's owner (resolved_run.dp_owner)."""
    n = len(media_meta)
    return tuple((dp_owner(r, n, dp),) * len(meta.get(key, [])) for r, meta in enumerate(media_meta))
