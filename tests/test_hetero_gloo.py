"""Real gloo processes: heterogeneous forward/backward == single device, and exact boundary data movement.

One spawn per world size runs several layouts back to back (each launch costs seconds of imports).
"""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.hetero.tools.spawn import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]

PARITY_LAYOUTS = {
    2: [
        "vision=tp2@0-1;language=dp2@0-1",                       # colocated: TP -> DP
        "vision=dp1@0-0;language=dp1@1-1",                       # non-colocated, simplest
    ],
    4: [
        "vision=dp4@0-3;language=tp2,dp2@0-3",                   # colocated TP/DP change
        "vision=dp4@0-3;audio=tp2,dp2@0-3;language=tp2,cp2@0-3",  # colocated, destination CP, two encoders
        "vision=dp2@0-1;language=tp2@2-3",                       # non-colocated fan-in (dp 2 -> 1)
        "vision=tp2@0-1;language=dp2@2-3",                       # non-colocated fan-out (dp 1 -> 2)
        "vision=cp2@0-1;language=cp2@2-3",                       # CP on both sides, non-colocated
        "vision=cp2,dp2@0-3;language=cp2,tp2@0-3",               # CP on both sides, colocated
        "vision=dp2@0-1;language=pp2@2-3",                       # destination PP=2, non-colocated
        "vision=dp4@0-3;language=tp2,pp2@0-3",                   # destination PP=2, colocated
        "vision=pp2@0-1;language=cp2@2-3",                       # source PP=2 -> destination CP
        # three microbatches through hetero.runtime.step_executor (gradient accumulation), both placements with PP
        ("vision=pp2@0-1;language=cp2@2-3", 3),
        ("vision=cp2,dp2@0-3;audio=tp2,dp2@0-3;language=tp2,pp2@0-3", 3),
    ],
    8: [
        "vision=tp2,cp2,dp2@0-7;audio=cp4,dp2@0-7;language=tp2,cp2,pp2@0-7",  # mixed, colocated
        "vision=pp2,tp2@0-3;audio=cp2@4-5;language=dp2@6-7",    # three disjoint modules
    ],
}


def _verify_all(cases, balance: bool = False):
    from tessera.hetero.tools.verify import run_verify

    cases = [c if isinstance(c, tuple) else (c, 1) for c in cases]
    return [{k: v for k, v in run_verify(s, microbatches=m, balance=balance).items() if k != "errors"}
            for s, m in cases]


# Encoder items dealt to DP ranks by cost (issue 35): a sample's items encoded on several ranks, the boundary
# fetching each from where it was encoded; encoder TP, vision-style token CP, item CP, PP; both placements.
BALANCED_LAYOUTS = [
    "vision=dp4@0-3;language=tp2,cp2@0-3",                     # colocated, LLM CP
    ("vision=tp2,dp2@0-3;audio=dp4@0-3;language=tp2,pp2@0-3", 2),  # encoder TP, LLM PP, two microbatches
    "vision=cp2,dp2@0-3;audio=cp2,dp2@0-3;language=dp4@0-3",   # encoder CP under balancing
    "vision=dp2@0-1;audio=dp2@0-1;language=cp2@2-3",           # non-colocated
    ("vision=pp2,dp2@0-3;language=tp2,dp2@0-3", 2),            # encoder PP
]


@pytest.mark.multiproc
def test_items_balanced_over_encoder_ranks_match_single_device():
    """hetero.tools.verify --balance: loss and every gradient equal the one-device model (float64) within 1e-5,
    at the minimum boundary bytes, with items encoded away from their samples' DP rank."""
    results = run_on_ranks(4, _verify_all, BALANCED_LAYOUTS, True)[0]
    for spec, res in zip(BALANCED_LAYOUTS, results):
        assert res["max_rel_err"] <= 1e-5 and res["bytes"] == res["min_bytes"] > 0 and res["ok"], (spec, res)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", sorted(PARITY_LAYOUTS))
def test_hetero_matches_single_device(world):
    results = run_on_ranks(world, _verify_all, PARITY_LAYOUTS[world])[0]
    for spec, res in zip(PARITY_LAYOUTS[world], results):
        assert res["max_rel_err"] <= 1e-5, (spec, res)
        assert res["bytes"] == res["min_bytes"] > 0, (spec, res)
        assert res["ok"], (spec, res)


# ------------------------------------------------------------------ exact boundary movement, any dtype
def _exact_boundary(spec, dtype_name, dst_format, uniform, defer=False):
    """Forward rows and backward gradient rows must arrive bit-exactly where the oracle says; with `defer`, the
    forward returns with its messages posted and its output is whole once finish() ran (what the trainer does)."""
    import torch.distributed as dist

    from tessera.hetero.runtime.boundary import BoundaryCommunicator
    from tessera.hetero.plan.boundary_plan import BoundaryBatch, plan_boundary, source_shard
    from tessera.hetero.plan.layout import HeteroLayout
    from tests.test_boundary_plan import oracle_dest_rows

    dtype = getattr(torch, dtype_name)
    layout = HeteroLayout.parse(spec)
    src, dst, rank, hidden = layout["vision"], layout["language"], dist.get_rank(), 8
    rng = np.random.default_rng(7)
    n, seq = 4, 16
    counts = [6] * n if uniform else [int(c) for c in rng.integers(1, seq, n)]
    batch = BoundaryBatch.from_lists(seq, [np.sort(rng.choice(seq, c, replace=False)) for c in counts])
    total = sum(counts)
    g = torch.Generator().manual_seed(3)
    values = torch.randn(total, hidden, generator=g).to(dtype)
    grads = torch.randn(total, hidden, generator=g).to(dtype)

    comm = BoundaryCommunicator(src, dst, hidden, dtype, dst_format=dst_format)
    c = src.coord(rank)
    x = None
    if c is not None and c.pp == src.pp - 1:
        rows = torch.as_tensor(source_shard(src, batch, c.dp, c.cp))
        x = values[rows].clone()
        if uniform:  # [samples, tokens, hidden]
            x = x.view(n // src.dp_size, -1, hidden)
        x.requires_grad_()
    out = comm(x, batch, defer=defer)
    if defer:
        assert len(comm._pending) == 1, "a deferred forward must leave its exchange pending"
        comm.finish()
        assert not comm._pending
    table = oracle_dest_rows(dst, batch, dst_format).get(rank)
    if table is not None:
        flat = out.reshape(-1, hidden)
        want = torch.zeros_like(flat)
        grad_out = torch.zeros_like(flat)
        for row, g_id in table.items():
            want[row], grad_out[row] = values[g_id], grads[g_id]
        assert torch.equal(flat, want), f"rank {rank}: forward rows differ"
        torch.autograd.backward(out, grad_out.view_as(out))
    else:
        BoundaryCommunicator.backward_from(out)
    if x is not None:
        assert torch.equal(x.grad.reshape(-1, hidden), grads[rows]), f"rank {rank}: gradient rows differ"
    plan = plan_boundary(src, dst, batch, dst_format)
    moved = torch.tensor([comm.bytes_sent])
    dist.all_reduce(moved)
    expect = (plan.forward.rows_moved() + plan.backward.rows_moved()) * hidden * values.element_size()
    assert moved.item() == expect == comm.minimum_bytes(batch)
    return True


EXACT_CASES = [
    ("vision=dp2,tp2@0-3;language=cp2,tp2@0-3", "bfloat16", "tokens", False),
    ("vision=dp2,tp2@0-3;language=cp2,tp2@0-3", "float32", "dense", True),
    ("vision=cp2@0-1;language=dp2@2-3", "bfloat16", "dense", False),
    ("vision=pp2,dp1@0-1;language=cp2@2-3", "float32", "tokens", True),
    # deferred: gathered receives scattered by finish(), colocated local copies, both formats
    ("vision=dp2,tp2@0-3;language=cp2,tp2@0-3", "float32", "dense", False, True),
    ("vision=dp4@0-3;language=tp4@0-3", "bfloat16", "tokens", False, True),
    ("vision=cp2@0-1;language=dp2@2-3", "float32", "dense", True, True),
]


@pytest.mark.multiproc
def test_boundary_moves_rows_exactly_in_fp32_and_bf16():
    assert all(run_on_ranks(4, _run_exact_cases, EXACT_CASES))


def _run_exact_cases(cases):
    return all(_exact_boundary(*case) for case in cases)


@pytest.mark.multiproc
def test_verify_cli_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tessera.hetero.tools.verify", "--layout", "vision=tp2@0-1;language=cp2@0-1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"verify: PASS max_rel_err=(\S+) bytes=(\d+) min_bytes=(\d+)", last)
    assert m and float(m.group(1)) <= 1e-5 and m.group(2) == m.group(3), last


def test_verify_cli_rejects_a_bad_layout_before_any_work():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tessera.hetero.tools.verify", "--layout", "vision=tp2@0-1;language=tp3@0-1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "module 'language'" in proc.stderr + proc.stdout
