"""Layout-aware sharding of a global microbatch: which rows each rank of each module keeps.

Every rank holds the same global microbatch of N rows — tokens, positions and per-item media metadata
(data/loader.py) — but decoded media only for the rows it encodes: `decode_plan` tells the loader of one
rank which rows each of its encoder modules needs, so decoding is never repeated across ranks. Module m with data-parallel size D
gives DP rank d the rows [d*N/D, (d+1)*N/D); TP/CP/PP peers of one DP rank keep the same rows. So for any
layout, colocated or not, the union over a module's DP ranks is the whole microbatch with no duplicates,
and an encoder rank and the LLM rank that consumes its embeddings agree on which global row is which.
hetero.plan.layout.HeteroLayout.validate(ModelShapes(samples_per_microbatch=N)) rejects N not divisible by
every module's DP size; dp_rows repeats that check so a direct caller gets the same clear error. Both rules
live in hetero/plan/resolved_run.py; this module applies them to a PackedBatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.hetero.plan.layout import HeteroLayout
# the row-ownership rule and the decode plan are the resolved run's (hetero/plan/resolved_run.py)
from tessera.hetero.plan.resolved_run import decode_rows as decode_plan, dp_rows  # noqa: F401

from tessera.data.packing import PackedBatch


@dataclass
class ModuleShard:
    """What one rank feeds to one module: its DP coordinate, global row range and the rows themselves.

    For an encoder module `batch.media[i][module]` are the items to encode and `batch.positions[i][module]`
    where their embeddings land in global row `rows.start + i`. For the language module, the token rows."""

    module: str
    dp_rank: int
    dp_size: int
    rows: range
    batch: PackedBatch

    @property
    def keys(self) -> list[str]:
        return [k for row in self.batch.keys for k in row]

    def media(self) -> list[list]:
        """Per kept row, the items of this module in position order (empty for the language module)."""
        return [row.get(self.module, []) for row in self.batch.media]


def shard_for_rank(batch: PackedBatch, layout: HeteroLayout, rank: int) -> dict[str, ModuleShard]:
    """module key -> this rank's shard, for every module placed on `rank` (colocated ranks get several)."""
    n = batch.tokens.shape[0]
    out = {}
    for key in layout.modules_of_rank(rank):
        module = layout[key]
        coord = module.coord(rank)
        rows = dp_rows(n, module.dp_size, coord.dp)
        out[key] = ModuleShard(key, coord.dp, module.dp_size, rows, batch.rows(rows.start, rows.stop))
    return out


