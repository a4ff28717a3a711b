"""Boundary communicator: runs a boundary plan as an autograd op (thin executor of hetero.boundary_plan).

Forward materialises the destination layout from the source layout; backward routes the gradient back
so every source rank gets exactly the gradient a single-device model would give it. Point-to-point only,
on the default process group, so it works with whatever backend the run uses (gloo, NCCL).

Every rank of the two modules calls it with the same metadata, in the same order:

    comm = BoundaryCommunicator(layout["vision"], layout["language"], hidden=H, dtype=torch.float32)
    out = comm(encoder_output_or_None, batch)   # language first-stage ranks: their slice of the boundary
    ...
    # ranks whose `out` feeds nothing downstream (pure source ranks) start the gradient exchange with
    comm.backward_from(out)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hetero.boundary_plan import BoundaryBatch, BoundaryPlan, DirectionPlan, minimum_rows, plan_boundary
from hetero.layout import ModuleLayout


def run_direction(plan: DirectionPlan, rank: int, x: torch.Tensor, out_rows: int) -> tuple[torch.Tensor, int]:
    """Execute one direction of a plan on this rank. x: [in_rows, hidden] (contiguous rows).

    Returns the [out_rows, hidden] output and the bytes this rank sent.
    """
    hidden = x.shape[-1]
    out = x.new_zeros(out_rows, hidden)
    ops, recv_bufs, sent = [], [], 0
    for t in plan.recvs(rank):
        buf = x.new_empty(len(t.dst_index), hidden)
        recv_bufs.append((t, buf))
        ops.append(dist.P2POp(dist.irecv, buf, t.src_rank))
    for t in plan.sends(rank):
        buf = x.index_select(0, torch.as_tensor(t.src_index, device=x.device))
        sent += buf.numel() * buf.element_size()
        ops.append(dist.P2POp(dist.isend, buf, t.dst_rank))
    # batch_isend_irecv coalesces on NCCL (needed to avoid ordering deadlocks) and loops on gloo
    reqs = dist.batch_isend_irecv(ops) if ops else []
    for t in plan.locals(rank):
        out.index_copy_(0, torch.as_tensor(t.dst_index, device=x.device),
                        x.index_select(0, torch.as_tensor(t.src_index, device=x.device)))
    for r in reqs:
        r.wait()
    for t, buf in recv_bufs:
        out.index_copy_(0, torch.as_tensor(t.dst_index, device=x.device), buf)
    return out, sent


class _BoundaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: "BoundaryCommunicator", plan: BoundaryPlan):
        ctx.comm, ctx.plan, ctx.in_shape = comm, plan, x.shape
        rank = comm.rank
        rows = plan.forward.out_rows.get(rank, 0)
        out, sent = run_direction(plan.forward, rank, x.reshape(-1, comm.hidden), rows)
        comm.bytes_sent += sent
        shape = plan.dst_shape.get(rank, (0,))
        return out.view(*shape, comm.hidden)

    @staticmethod
    def backward(ctx, grad_out):
        comm, plan, rank = ctx.comm, ctx.plan, ctx.comm.rank
        rows = plan.backward.out_rows.get(rank, 0)
        grad_in, sent = run_direction(plan.backward, rank, grad_out.reshape(-1, comm.hidden).contiguous(), rows)
        comm.bytes_sent += sent
        return grad_in.view(ctx.in_shape), None, None


class BoundaryCommunicator:
    """Carries one encoder's output into the language module's layout, and its gradient back.

    src_format of the input is free: any tensor whose rows (all dims but the last) are this rank's
    elements in (sample, token) order, e.g. [tokens, hidden] or [samples, tokens, hidden].
    dst_format: 'tokens' -> [rows, hidden]; 'dense' -> [local samples, seq/cp, hidden], zeros at
    positions that hold no media token of this encoder.
    """

    def __init__(self, src: ModuleLayout, dst: ModuleLayout, hidden: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", dst_format: str = "tokens", rank: int | None = None):
        self.src, self.dst, self.hidden, self.dtype = src, dst, hidden, dtype
        self.device, self.dst_format = torch.device(device), dst_format
        self.rank = dist.get_rank() if rank is None else rank
        self.bytes_sent = 0  # running total on this rank, forward and backward
        self._cache: tuple[tuple, BoundaryPlan] | None = None

    def plan(self, batch: BoundaryBatch) -> BoundaryPlan:
        # consecutive microbatches often share metadata (fixed media tokens): reuse the plan
        key = (batch.seq_length, tuple(p.tobytes() for p in batch.positions))
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, plan_boundary(self.src, self.dst, batch, self.dst_format))
        return self._cache[1]

    def minimum_bytes(self, batch: BoundaryBatch) -> int:
        fwd, bwd = minimum_rows(self.src, self.dst, batch)
        return (fwd + bwd) * self.hidden * torch.empty((), dtype=self.dtype).element_size()

    def __call__(self, x: torch.Tensor | None, batch: BoundaryBatch) -> torch.Tensor:
        plan = self.plan(batch)
        rows = plan.forward.in_rows.get(self.rank)
        if rows is None:
            # not a source rank: an empty leaf that requires grad keeps the op in the autograd graph, so
            # the backward exchange runs when the destination's loss is back-propagated
            x = torch.zeros(0, self.hidden, dtype=self.dtype, device=self.device, requires_grad=True)
        elif x is None or x.numel() != rows * self.hidden or x.shape[-1] != self.hidden:
            got = None if x is None else tuple(x.shape)
            raise ValueError(f"boundary {self.src.first}-{self.src.last} -> {self.dst.first}-{self.dst.last}: "
                             f"rank {self.rank} must pass its {rows} rows x {self.hidden} hidden of encoder "
                             f"output (its samples' media tokens, in order), got {got}")
        if x.dtype != self.dtype:
            raise ValueError(f"boundary expects {self.dtype} activations, got {x.dtype}; cast before the boundary")
        return _BoundaryFn.apply(x, self, plan)

    @staticmethod
    def backward_from(out: torch.Tensor) -> None:
        """On a rank whose boundary output feeds nothing (a pure source rank, or a colocated rank off the
        destination's first stage): run the backward exchange, receiving this rank's encoder gradient."""
        torch.autograd.backward(out, torch.zeros_like(out))
