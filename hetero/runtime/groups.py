"""Process groups for every module of a heterogeneous layout, built with megatron-core's HyperCommGrid.

Group creation is collective over the whole world: every rank creates every module's groups, in one
deterministic order (modules sorted by key, then a fixed list of dimension sets), and non-members get
None. The backend is never named here: subgroups inherit the default group's (gloo without GPU, NCCL with).

The groups a rank belongs to come back as a megatron-core ProcessGroupCollection per module, which is
what models take (process groups are injected; models never build them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from tessera.hetero.plan.layout import GRID_DIMS, HeteroLayout, ModuleLayout, RankCoord

# (collection field, grid dims); dims listed fastest first as in GRID_DIMS
DENSE_GROUPS = (
    ("tp", ["tp"]),
    ("cp", ["cp"]),
    ("dp", ["dp"]),
    ("pp", ["pp"]),
    ("dp_cp", ["cp", "dp"]),     # gradient reduction of dense parameters
    ("tp_cp", ["tp", "cp"]),
    ("mp", ["tp", "pp"]),        # model-parallel group (tensor + pipeline)
    ("tp_dp_cp", ["tp", "cp", "dp"]),
)
# experts: the cp*dp ranks of each (tp, pp) slice are re-cut into ep x expt_dp, ep fastest (megatron's order)
EXPERT_DIMS = ("tp", "ep", "expt_dp", "pp")
EXPERT_GROUPS = (("ep", ["ep"]), ("expt_dp", ["expt_dp"]), ("tp_ep", ["tp", "ep"]))


@dataclass
class ModuleGroups:
    key: str
    layout: ModuleLayout
    grid: HyperCommGrid
    expert_grid: HyperCommGrid
    coord: RankCoord | None              # None when this rank is not in the module
    pgs: ProcessGroupCollection | None   # None when this rank is not in the module

    @property
    def is_member(self) -> bool:
        return self.coord is not None

    @property
    def first_stage(self) -> bool:
        return self.coord is not None and self.coord.pp == 0

    @property
    def last_stage(self) -> bool:
        return self.coord is not None and self.coord.pp == self.layout.pp - 1


def _create(grid: HyperCommGrid, specs, member: bool) -> dict:
    made = {}
    for name, dims in specs:
        pg = grid.create_pg(dims)
        if member:
            made[name] = pg
    return made


def build_module_groups(layout: HeteroLayout, rank: int | None = None) -> dict[str, ModuleGroups]:
    """Create every module's process groups (collective: call on all ranks with the same layout)."""
    layout.validate(world_size=dist.get_world_size())
    rank = dist.get_rank() if rank is None else rank
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        # megatron's initialize_model_parallel creates it; we build groups without that global state, but the
        # sequence-parallel gathers of the MoE allgather dispatcher (EP > 1) take their buffers from it
        parallel_state._set_global_memory_buffer()
    out = {}
    for key in sorted(layout.modules):
        m = layout.modules[key]
        coord = m.coord(rank)
        grid = HyperCommGrid(m.shape, list(GRID_DIMS), rank_offset=m.first)
        made = _create(grid, DENSE_GROUPS, coord is not None)
        # built for ep=1 too (size-1 ep groups), so MoE layers always find their groups
        expert_grid = HyperCommGrid([m.tp, m.ep, m.cp * m.dp_size // m.ep, m.pp], list(EXPERT_DIMS),
                                    rank_offset=m.first)
        made.update(_create(expert_grid, EXPERT_GROUPS, coord is not None))
        pgs = None
        if coord is not None:
            pgs = ProcessGroupCollection(expt_tp=made["tp"], **made)
        out[key] = ModuleGroups(key, m, grid, expert_grid, coord, pgs)
    return out


def destroy_module_groups(groups: dict[str, ModuleGroups]) -> None:
    """Destroy the subgroups of a previous layout (before building another in the same processes)."""
    for g in groups.values():
        for grid in (g.grid, g.expert_grid):
            for pg in grid._pgs.values():
                if pg is not None:
                    dist.destroy_process_group(pg)
