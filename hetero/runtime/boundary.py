"""Boundary communicator: runs a boundary plan as an autograd op (thin executor of hetero.plan.boundary_plan).

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

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tessera.hetero.plan.boundary_plan import (BoundaryBatch, BoundaryPlan, DirectionPlan, Transfer, minimum_rows,
                                  plan_boundary)
from tessera.hetero.plan.layout import ModuleLayout


MIN_SEGMENT_ROWS = 16  # below this mean run length, one gathered message beats many small ones


def _rows(index: np.ndarray) -> slice | np.ndarray:
    """A contiguous run of rows as a slice (a view: no gather/scatter copy), else the index array."""
    if len(index) and index[-1] - index[0] + 1 == len(index) and np.all(np.diff(index) == 1):
        return slice(int(index[0]), int(index[-1]) + 1)
    return index


def _segments(t: Transfer) -> list[tuple[slice, slice]] | None:
    """Split a transfer into runs contiguous on both sides, if runs are long enough to send as views.

    Both sides derive the same split from the same transfer, so their messages pair up in order."""
    breaks = np.flatnonzero((np.diff(t.src_index) != 1) | (np.diff(t.dst_index) != 1)) + 1
    if len(t.src_index) < MIN_SEGMENT_ROWS * (len(breaks) + 1):
        return None
    starts, ends = np.r_[0, breaks], np.r_[breaks, len(t.src_index)]
    return [(slice(int(t.src_index[a]), int(t.src_index[b - 1]) + 1),
             slice(int(t.dst_index[a]), int(t.dst_index[b - 1]) + 1)) for a, b in zip(starts, ends)]


@dataclass(frozen=True)
class RankProgram:
    """One rank's part of one direction of a plan. Each message is a view of a contiguous run where the
    rows allow it (no gather/scatter copies), else one gathered buffer."""

    out_rows: int
    sends: tuple[tuple[int, slice | np.ndarray], ...]            # (peer, rows of the input), in order
    recvs: tuple[tuple[int, slice | np.ndarray], ...]            # (peer, rows of the output), in order
    copies: tuple[tuple[slice | np.ndarray, slice | np.ndarray], ...]  # (input rows, output rows)
    covers_all_rows: bool                                        # every output row is written

    @classmethod
    def build(cls, plan: DirectionPlan, rank: int) -> "RankProgram":
        sends, recvs, copies = [], [], []
        for t in plan.transfers:
            if rank not in (t.src_rank, t.dst_rank):
                continue
            if t.local:
                copies.append((_rows(t.src_index), _rows(t.dst_index)))
                continue
            segs = _segments(t)
            mine = [(s if t.src_rank == rank else d) for s, d in segs] if segs else \
                [_rows(t.src_index if t.src_rank == rank else t.dst_index)]
            if t.src_rank == rank:
                sends += [(t.dst_rank, rows) for rows in mine]
            else:
                recvs += [(t.src_rank, rows) for rows in mine]
        out_rows = plan.out_rows.get(rank, 0)
        written = sum(len(t.dst_index) for t in plan.transfers if t.dst_rank == rank)
        return cls(out_rows, tuple(sends), tuple(recvs), tuple(copies), written == out_rows)


def _take(x: torch.Tensor, rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, torch.as_tensor(rows, device=x.device))


def _put(out: torch.Tensor, rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = value
    else:
        out.index_copy_(0, torch.as_tensor(rows, device=out.device), value)


@dataclass
class Exchange:
    """One rank's program in flight: its output (`out` in the caller's shape, `flat` its [rows, hidden] view; rows
    still arriving), the requests, the gathered receive buffers to scatter once they arrived, and the gathered
    send buffers, kept alive until sent."""

    out: torch.Tensor
    flat: torch.Tensor
    reqs: list
    scatter: list
    keep: list
    sent: int

    def finish(self) -> torch.Tensor:
        """Wait for every message, then place the gathered receives: `out` is complete from here on."""
        for r in self.reqs:
            r.wait()
        with torch.no_grad():  # fills the exchange's own buffer, outside any graph
            for rows, buf in self.scatter:
                _put(self.flat, rows, buf)
        self.reqs, self.scatter, self.keep = [], [], []
        return self.out


def start_program(prog: RankProgram, x: torch.Tensor, shape: tuple[int, ...] | None = None) -> Exchange:
    """Issue one rank's program: post every receive and send, copy the rows that stay on the rank while the
    messages move, and return without waiting. x: [in_rows, hidden]; the output has `shape` (default [out_rows])
    + [hidden]. Contiguous runs are sent from and received into views: no extra copies."""
    hidden = x.shape[-1]
    shape = (*(shape or (prog.out_rows,)), hidden)
    # rows nobody writes (dense format: text positions) must read as zeros
    out = x.new_empty(shape) if prog.covers_all_rows else x.new_zeros(shape)
    flat = out.view(-1, hidden)
    ops, scatter, keep, sent = [], [], [], 0
    for peer, rows in prog.recvs:
        buf = flat[rows] if isinstance(rows, slice) else x.new_empty(len(rows), hidden)
        if not isinstance(rows, slice):
            scatter.append((rows, buf))
        ops.append(dist.P2POp(dist.irecv, buf, peer))
    for peer, rows in prog.sends:
        buf = _take(x, rows).contiguous()
        sent += buf.numel() * buf.element_size()
        keep.append(buf)
        ops.append(dist.P2POp(dist.isend, buf, peer))
    # batch_isend_irecv coalesces on NCCL (needed to avoid ordering deadlocks) and loops on gloo
    reqs = dist.batch_isend_irecv(ops) if ops else []
    for src_rows, dst_rows in prog.copies:
        _put(flat, dst_rows, _take(x, src_rows))
    return Exchange(out, flat, reqs, scatter, keep, sent)


def run_program(prog: RankProgram, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Execute one rank's program and wait for it: the [out_rows, hidden] output and the bytes this rank sent."""
    ex = start_program(prog, x)
    return ex.finish(), ex.sent


class _BoundaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: "BoundaryCommunicator", plan: BoundaryPlan, defer: bool):
        ctx.comm, ctx.plan, ctx.in_shape = comm, plan, x.shape
        t0 = time.perf_counter()
        # the output is the exchange's own tensor, not a view of it: a deferred finish() may still scatter into it
        ex = start_program(comm.program(plan, "forward"), x.reshape(-1, comm.hidden), plan.dst_shape.get(comm.rank, (0,)))
        if defer:  # finished by comm.finish(), before anything reads the output
            comm._pending.append(ex)
        else:
            ex.finish()
        comm.bytes_sent, comm.seconds = comm.bytes_sent + ex.sent, comm.seconds + time.perf_counter() - t0
        return ex.out

    @staticmethod
    def backward(ctx, grad_out):
        comm, t0 = ctx.comm, time.perf_counter()
        grad_in, sent = run_program(comm.program(ctx.plan, "backward"), grad_out.reshape(-1, comm.hidden).contiguous())
        comm.bytes_sent, comm.seconds = comm.bytes_sent + sent, comm.seconds + time.perf_counter() - t0
        return grad_in.view(ctx.in_shape), None, None, None


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
        # host seconds in the exchanges, waiting for peers included (a GPU's NCCL waits return at once): the exposed
        # boundary time; a deferred exchange counts its posting and its finish()
        self.seconds = 0.0
        self._cache: tuple[tuple, BoundaryPlan] | None = None
        self._programs: dict[tuple[int, str], RankProgram] = {}
        self._written: torch.Tensor | None = None  # of the cached plan
        self._pending: list[Exchange] = []  # deferred forward exchanges in flight (__call__(defer=True))

    def plan(self, batch: BoundaryBatch) -> BoundaryPlan:
        # consecutive microbatches often share metadata (fixed media tokens): reuse the plan
        key = (batch.seq_length, tuple(p.tobytes() for p in batch.positions),
               None if batch.sources is None else tuple(s.tobytes() for s in batch.sources))
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, plan_boundary(self.src, self.dst, batch, self.dst_format))
            self._programs, self._written = {}, None
        return self._cache[1]

    def program(self, plan: BoundaryPlan, direction: str) -> RankProgram:
        key = (id(plan), direction)
        if key not in self._programs:
            self._programs[key] = RankProgram.build(getattr(plan, direction), self.rank)
        return self._programs[key]

    def written(self, batch: BoundaryBatch) -> torch.Tensor:
        """This rank's output rows the forward writes (bool, the output's shape without hidden), on the device."""
        plan = self.plan(batch)
        if self._written is None:
            self._written = torch.from_numpy(plan.written(self.rank)).to(self.device)
        return self._written

    def minimum_bytes(self, batch: BoundaryBatch) -> int:
        fwd, bwd = minimum_rows(self.src, self.dst, batch)
        return (fwd + bwd) * self.hidden * torch.empty((), dtype=self.dtype).element_size()

    def __call__(self, x: torch.Tensor | None, batch: BoundaryBatch, defer: bool = False) -> torch.Tensor:
        """This rank's slice of the boundary output. defer: return once the messages are posted, so the rank
        computes (the next microbatch's encoder) while they move; the output may be read only after finish()."""
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
        return _BoundaryFn.apply(x, self, plan, defer)

    def finish(self) -> None:
        """Complete every deferred forward exchange, oldest first (their outputs are whole from here on); the time
        spent waiting counts as exposed boundary time (`seconds`)."""
        t0 = time.perf_counter()
        while self._pending:
            self._pending.pop(0).finish()
        self.seconds += time.perf_counter() - t0

    @staticmethod
    def backward_from(out: torch.Tensor) -> None:
        """On a rank whose boundary output feeds nothing (a pure source rank, or a colocated rank off the
        destination's first stage): run the backward exchange, receiving this rank's encoder gradient."""
        torch.autograd.backward(out, torch.zeros_like(out))
