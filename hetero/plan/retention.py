"""Which checkpoints stay on disk: a pure rule, checked before launch and applied after every publish.

    KeepPolicy(last=3, every=5000).to_delete([1000, 2000, 3000, 4000, 5000], latest=5000) == [1000, 2000]

hetero/checkpoint/sharded.py applies it on rank 0 right after a step is published (so the step `latest`
names, the newest, is always kept, and a save still being written is a `.partial` directory it never
touches); recipes/checks.py builds it from trainer.keep_last / trainer.keep_every before anything launches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeepPolicy:
    """Which published checkpoints stay on disk (NeMo's save_top_k by recency, Megatron-Bridge's most_recent_k):
    the newest `last` (None: all) and, permanently, every step divisible by `every` (0: none)."""

    last: int | None = None
    every: int = 0

    def __post_init__(self):
        if self.last is not None and self.last < 1:
            raise ValueError(f"trainer.keep_last={self.last} would delete every checkpoint, the one a resume needs "
                             f"too: set trainer.keep_last>=1 (the newest N stay), or trainer.keep_last=null to keep "
                             f"all")
        if self.every < 0:
            raise ValueError(f"trainer.keep_every={self.every} must be >= 0 (0: no step kept permanently)")

    def to_delete(self, steps: list[int], latest: int | None) -> list[int]:
        """Published steps to delete; never `latest` (what a resume reads)."""
        if self.last is None:
            return []
        keep = set(sorted(steps)[-self.last:]) | {s for s in steps if self.every and s % self.every == 0}
        return sorted(s for s in steps if s not in keep and s != latest)
