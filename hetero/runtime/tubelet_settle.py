"""EVS-pruned clips in tubelet chunks: the boundary's participants learn how many tokens each tubelet kept and
settle their batch's layout before the boundary plan is built.

The omni family writes a clip as one `<img> ... </img>` chunk per tubelet (data/templates.py, the release's
layout). Under EVS only the clip's total of kept tokens is known before encoding, so the data side writes the
chunks at nominal counts (models/media_tokens.evs_nominal_tubelet_counts); which tubelet keeps how many is
decided by the vision encoder's last stage, for its DP rows only (models/multimodal.MediaModule.project). The
LLM's first stage, which embeds each row's tokens and places the embeddings at the row's positions, needs the
counts of every row it holds, and the boundary plan needs the final positions on every participant.

So, inside the boundary op of each microbatch (where the participants already meet, in the schedule's order,
hetero/plan/schedule_plan.boundary_participants): one all-reduce (sum) of every chunked clip's counts over the
participants, to which only the clip's encoding rank contributes (its TP rank 0; EVS needs vision cp 1, so
each clip has exactly one), then every participant moves its copy of the chunks
(data/packing.PackedBatch.settle_tubelet_chunks) and builds the boundary batch from the settled positions.
Ranks outside the boundary read no token or media position of the rows (later LLM stages read labels and
document ids, which settling leaves unchanged).

The order, per microbatch, is the one correctness rests on:
  1. the vision encoder's last stage encodes the clips and records what each tubelet kept (its forward);
  2. `settle` (inside the vision boundary op): the counts are summed over the participants, every participant's
     copy of the batch moves its chunks (tokens, positions, metadata), and the boundary batch is built from the
     settled positions, so the plan places the embeddings where the settled tokens expect them;
  3. the LLM's first stage embeds the settled tokens. It calls `require_settled(mb)` first: a schedule that ran it
     before step 2 fails there, instead of training on the nominal layout.

    settle = TubeletSettle(layout, "vision", device)        # every rank, at set-up (it creates a group)
    batches[mb]["vision"] = settle.lazy(batch, mb)          # hetero_step calls it with the rank's stage
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist

from tessera.hetero.plan.layout import HeteroLayout
from tessera.hetero.plan.schedule_plan import boundary_participants


class TubeletSettle:
    def __init__(self, layout: HeteroLayout, key: str, device: torch.device):
        self.key, self.device = key, device
        self.ranks = sorted(boundary_participants(layout, key))
        self.group = dist.new_group(self.ranks)  # collective over the world: every rank builds it, in order
        self.pending: set[int] = set()  # microbatches handed out by `lazy` and not settled yet

    def lazy(self, batch, mb: int):
        """What hetero_step takes in place of microbatch mb's boundary batch: called with this rank's encoder
        stage of the key (None where the rank holds none), it settles `batch` and returns its boundary batch."""
        self.pending.add(mb)
        return functools.partial(self.settle, batch, mb)

    def settle(self, batch, mb: int, stage) -> object:
        kept = stage.tubelet_kept(mb) if stage is not None else {}
        items = batch.chunked_items(self.key)
        if items:
            sizes = [len(chunks) for _, _, chunks in items]
            starts = np.cumsum([0, *sizes])
            counts = torch.zeros(int(starts[-1]), dtype=torch.int64)
            if stage is not None and stage.coord.tp == 0:  # one contributor per clip: sum, never double
                for (r, j, _), a, n in zip(items, starts, sizes):
                    if (r, j) in kept:
                        counts[a:a + n] = torch.as_tensor(kept[(r, j)])
            counts = counts.to(self.device)
            dist.all_reduce(counts, group=self.group)
            counts = counts.cpu().tolist()
            batch.settle_tubelet_chunks(self.key, {(r, j): counts[a:a + n]
                                                   for (r, j, _), a, n in zip(items, starts, sizes)})
        self.pending.discard(mb)
        return batch.boundary_batches([self.key])[self.key]

    def require_settled(self, mb: int) -> None:
        """Step 3's guard: microbatch mb's tokens are read only after its chunks settled (step 2)."""
        if mb in self.pending:
            raise RuntimeError(f"microbatch {mb}: the LLM reads its tokens before the {self.key} boundary settled its "
                               f"EVS tubelet chunks; the schedule must run the boundary forward first")

    def close(self) -> None:
        """Destroy the participants' group (with the module groups, before another layout in the same processes)."""
        if dist.get_rank() in self.ranks:
            dist.destroy_process_group(self.group)
