"""Process groups in torch's fake world as one rank sees them, at the cost of that rank's groups only.

Group creation is collective: megatron's HyperCommGrid enumerates every group of a dimension and
torch.distributed.new_subgroups_by_enumeration calls new_group once per group, on every rank. In the dry run's
fake world one probe rank does all of that alone: ~16 groups per rank of the world per probe (a million
new_group calls at 65,536 ranks, minutes), yet for every group the probe is not in, new_group only checks the
rank list and hands back GroupMember.NON_GROUP_MEMBER. `member_groups_only()` keeps what the probe can observe:
* megatron's enumerations are built by megatron (HyperCommGrid._gen_rank_enum), once per distinct grid and
  dimensions while the context lasts - they depend on nothing else, so every probe and representative rank
  gets the same one - and kept as an array (W ints), not a list of lists;
* every rank list is checked as torch checks it: ranks inside the world, none twice in one group or in two
  groups of one enumeration (new_group's and new_subgroups_by_enumeration's checks);
* torch's new_group creates the probe's own group from its list; the other groups are not created. What
  differs from a real world is only the number torch gives the groups in their names.
`record(digest)` sees a fingerprint of every enumeration in creation order, to compare orders across probes.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable

import numpy as np
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid


class Enumeration:
    """One enumeration of equal-sized groups (rows of `groups`) with its fingerprint, checked against a world."""

    def __init__(self, groups, world: int):
        self.groups = np.asarray(groups, dtype=np.int64)
        if self.groups.ndim != 2 or not self.groups.size:
            raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty, and its groups must be equal-sized")
        self.digest = hashlib.sha1(repr(self.groups.shape).encode() + self.groups.tobytes()).hexdigest()
        flat = self.groups.reshape(-1)
        if flat.min() < 0 or flat.max() >= world:
            bad = int(flat[(flat < 0) | (flat >= world)][0])
            raise ValueError(f"Rank {bad} is out of range. Valid ranks are 0 to {world - 1} (world_size={world})")
        if np.bincount(flat, minlength=world).max() > 1:
            raise ValueError("a rank appears twice in one enumeration of process groups (within a group or in two)")

    def __repr__(self) -> str:  # megatron logs the enumeration on rank 0: numpy's summary, not a 100,000-item list
        return repr(self.groups)

    # read as the list of lists megatron returns, should anything else take it
    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self):
        return iter(self.groups.tolist())

    def __getitem__(self, i):
        return self.groups[i].tolist()


_made: dict[tuple, Enumeration] | None = None  # the enumerations of the outermost active block


@contextlib.contextmanager
def member_groups_only(record: Callable[[str], None] | None = None):
    """Within the block, dist.new_subgroups_by_enumeration creates only the calling rank's group (see above).
    Nested blocks share the outermost one's enumerations."""
    global _made
    real_new, real_enum = dist.new_subgroups_by_enumeration, HyperCommGrid._gen_rank_enum
    outer = _made
    made = _made = outer if outer is not None else {}

    def enumeration(grid, dims):  # megatron's, once per distinct grid and dims
        key = (tuple(grid.shape), tuple(grid.dim_names), grid.rank_offset, tuple(dims), dist.get_world_size())
        if key not in made:
            made[key] = Enumeration(real_enum(grid, dims), dist.get_world_size())
        return made[key]

    def own_group(ranks_per_subgroup_list, timeout=None, backend=None, pg_options=None, group_desc=None):
        enum = ranks_per_subgroup_list
        if not isinstance(enum, Enumeration):
            enum = Enumeration(enum, dist.get_world_size())
        if record is not None:
            record(enum.digest)
        at = np.flatnonzero((enum.groups == dist.get_rank()).any(axis=1))
        if not len(at):
            return None, []
        mine = dist.new_group(ranks=enum.groups[at[0]].tolist(), timeout=timeout, backend=backend,
                              pg_options=pg_options, group_desc=group_desc)
        return mine, [mine]

    dist.new_subgroups_by_enumeration, HyperCommGrid._gen_rank_enum = own_group, enumeration
    try:
        yield
    finally:
        dist.new_subgroups_by_enumeration, HyperCommGrid._gen_rank_enum = real_new, real_enum
        _made = outer
