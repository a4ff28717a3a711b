"""Process groups at 512 ranks without processes: torch's fake backend, one rank's view at a time.

Checks every module's TP/CP/DP/PP/DP-CP/EP membership against the layout's rank formula, that non-members
get no group, and that every rank issues the same group creations in the same order (creation is
collective over the world: a different order would hang a real job).
"""

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch.distributed as dist

from tessera.hetero.runtime.groups import DENSE_GROUPS, EXPERT_GROUPS, build_module_groups
from tessera.hetero.runtime.world import fake_world
from tessera.hetero.plan.layout import HeteroLayout

SPEC = "vision=tp2,dp64@0-127;audio=cp2,dp64@128-255;language=tp4,cp2,pp4,dp8,ep4@256-511"
PROBE_RANKS = [0, 1, 127, 128, 201, 256, 300, 389, 511]


def _groups_seen_by(rank, layout, calls):
    with fake_world(rank, 512):
        real = dist.new_subgroups_by_enumeration

        def record(enum, *a, **k):
            calls.append([list(g) for g in enum])
            return real(enum, *a, **k)

        dist.new_subgroups_by_enumeration = record
        try:
            groups = build_module_groups(layout)
        finally:
            dist.new_subgroups_by_enumeration = real
        return {key: (g.coord, None if g.pgs is None else
                      {name: dist.get_process_group_ranks(getattr(g.pgs, name))
                       for name in ("tp", "cp", "dp", "pp", "dp_cp", "ep", "expt_dp")})
                for key, g in groups.items()}


def expected(m, c):
    ranks = lambda **vary: sorted({m.rank_of(**{**c.__dict__, **v}) for v in vary["over"]})  # noqa: E731
    tp = ranks(over=[{"tp": t} for t in range(m.tp)])
    cp = ranks(over=[{"cp": t} for t in range(m.cp)])
    dp = ranks(over=[{"dp": t} for t in range(m.dp_size)])
    pp = ranks(over=[{"pp": t} for t in range(m.pp)])
    dp_cp = ranks(over=[{"dp": d, "cp": k} for d in range(m.dp_size) for k in range(m.cp)])
    # experts: the cp*dp slice re-cut into ep (fastest) x expt_dp
    flat = c.cp + m.cp * c.dp
    slice_ranks = [m.rank_of(c.tp, f % m.cp, f // m.cp, c.pp) for f in range(m.cp * m.dp_size)]
    ep = sorted(slice_ranks[(flat // m.ep) * m.ep:(flat // m.ep + 1) * m.ep])
    expt_dp = sorted(slice_ranks[flat % m.ep::m.ep])
    return {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "dp_cp": dp_cp, "ep": ep, "expt_dp": expt_dp}


def _in_fresh_process(fn):
    """The fake world must be this process's only default group: other tests may hold a real one."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn).result(timeout=300)


def test_group_membership_and_creation_order_at_512_ranks():
    _in_fresh_process(_membership_and_order)


def test_grid_bigger_than_world_is_rejected_before_groups():
    _in_fresh_process(_bigger_than_world)


def _membership_and_order():
    layout = HeteroLayout.parse(SPEC).validate(world_size=512)
    orders = []
    for rank in PROBE_RANKS:
        calls = []
        seen = _groups_seen_by(rank, layout, calls)
        orders.append(calls)
        for key, (coord, pgs) in seen.items():
            m = layout[key]
            if rank not in m.ranks:
                assert coord is None and pgs is None
                continue
            got = {k: sorted(v) for k, v in pgs.items()}
            assert got == expected(m, coord), (rank, key)
    assert all(o == orders[0] for o in orders), "ranks create groups in different orders"
    assert len(orders[0]) == 3 * (len(DENSE_GROUPS) + len(EXPERT_GROUPS))  # every kind, every module


def _bigger_than_world():
    with fake_world(0, 8), pytest.raises(ValueError, match="tile the world of 8 ranks"):
        build_module_groups(HeteroLayout.parse("vision=dp4@0-3;language=tp4,dp2@4-11"))
