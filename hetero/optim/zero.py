"""ZeRO-1, megatron's distributed optimizer: fp32 master weights and Adam states sharded over each DP group.

    part = ShardedPart(params, group, masters)   # one per gradient bucket of a module's reduction group (dense:
    ...backward...                               #   DP x CP, experts: expert-DP; grad_buckets.py); params'
    work = part.start_reduce_scatter()           #   main_grad become views of part.grad. Starts summing this
    work.wait()                                  #   rank's shard only (work None: a group of one)
    sq = part.sq_norm(tp_rank)                   # this shard's share of the grad norm (sum over the group)
    AdamW(part.master_views) .step()             # fp32 masters and states of the shard only
    part.gather_params()                         # updated shard -> every rank's parameters (param dtype)

A part's parameters share one flat fp32 main-grad buffer of N elements, padded to a multiple of the group size
g; rank r owns elements [r*N/g, (r+1)*N/g) (a part is one gradient bucket: several buckets are sharded each,
as megatron shards per bucket). The reduce-scatter sums exactly what the replicated optimizer's all-reduce
sums, and Adam is elementwise, so every element gets the replicated optimizer's arithmetic: steps
equal it up to the collective's summation order, while optimizer memory falls from 12 to 12/g bytes per
parameter (fp32 master + exp_avg + exp_avg_sq) plus the 4-byte main grad.

Why not megatron's DistributedOptimizer: hetero/optim/optimizers.py (CUDA-only type checks and buffers).

Checkpoints stay in parameter space, as megatron's "fully reshardable" format, without gathering anything:
`flat_slices(...)` hands the checkpoint each rank's contiguous range of each parameter as a `FlatSlice` (a view
of the live shard and where it starts in the parameter), which hetero/checkpoint/sharded.py writes as the
rectangles that tile it (hetero/plan/flat_boxes.py) and loads back in place. A save therefore adds no
optimizer memory, and a checkpoint still moves between ZeRO and the replicated optimizer and between DP sizes
(the store reshards by global offsets). Before this, a save all-gathered every part's fp32 master and Adam
states whole on every rank: about 78 GiB more per rank for nemotron_vl_12b, which did not fit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class FlatSlice(NamedTuple):
    """Elements [start, start + data.numel()) of a parameter's flattened (TP-local) tensor: `data` is a 1-D
    view of a ZeRO shard (master or Adam state), written and loaded in place by the checkpoint."""

    data: torch.Tensor
    start: int


class ShardedPart:
    def __init__(self, params: list[torch.nn.Parameter], group, masters: list[torch.Tensor]):
        """params: the part's trainable parameters (already in the param dtype); masters: their fp32 values."""
        self.params, self.group = params, group
        g, r = group.size(), group.rank()
        device = params[0].device
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.size = -(-n // g) * g
        self.shard_len = self.size // g
        lo, hi = r * self.shard_len, (r + 1) * self.shard_len
        self.grad = torch.zeros(self.size, dtype=torch.float32, device=device)  # every rank: whole part
        for p, o in zip(params, self.offsets):
            p.main_grad = self.grad[o:o + p.numel()].view_as(p)
        self.grad_shard = torch.zeros(self.shard_len, dtype=torch.float32, device=device)
        self.master = torch.zeros(self.shard_len, dtype=torch.float32, device=device)
        # (param index, first and last+1 element within the flat param, first element within the shard)
        self.segments = []
        for i, (p, o) in enumerate(zip(params, self.offsets)):
            a, b = max(o, lo), min(o + p.numel(), hi)
            if a < b:
                self.segments.append((i, a - o, b - o, a - lo))
        for i, a, b, s in self.segments:
            self.master[s:s + b - a].copy_(masters[i].reshape(-1)[a:b])
        # what AdamW steps: 1-D views of the master shard, each with the matching view of the gradient shard
        self.master_views = []
        for i, a, b, s in self.segments:
            view = self.master[s:s + b - a]
            view.grad = self.grad_shard[s:s + b - a]
            self.master_views.append(view)

    def segment_params(self) -> list[torch.nn.Parameter]:
        """The parameter of each master view (for weight-decay groups and the grad norm)."""
        return [self.params[i] for i, *_ in self.segments]

    def start_reduce_scatter(self):
        """Start summing the part's gradient over the group into this rank's shard; returns the Work to wait for
        (None: a group of one, copied already)."""
        if self.group.size() == 1:
            self.grad_shard.copy_(self.grad)
            return None
        return dist.reduce_scatter_tensor(self.grad_shard, self.grad, group=self.group, async_op=True)

    def sq_norm(self, counts) -> torch.Tensor:
        """Squared L2 norm of this rank's gradient shard over the elements whose parameter `counts(p)`
        (fp64); summed over the group it is the part's."""
        total = torch.zeros((), dtype=torch.float64, device=self.grad.device)
        for view, p in zip(self.master_views, self.segment_params()):
            if counts(p):
                total += view.grad.double().pow(2).sum()
        return total

    def gather_params(self) -> None:
        """Every rank's parameters = the updated master shards, cast to the parameter dtype."""
        dtype = self.params[0].dtype
        full = torch.empty(self.size, dtype=dtype, device=self.master.device)
        if self.group.size() == 1:
            full.copy_(self.master)
        else:
            dist.all_gather_into_tensor(full, self.master.to(dtype), group=self.group)
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets):
                p.copy_(full[o:o + p.numel()].view_as(p))

    def zero_grad(self) -> None:
        self.grad.zero_()
        self.grad_shard.zero_()

    def flat_slices(self, shard_of) -> list[FlatSlice | None]:
        """Per parameter of the part: this rank's range of it as a FlatSlice of `shard_of(view_index)` (a 1-D
        tensor shaped like that master view), or None where this rank holds none of the parameter."""
        out: list[FlatSlice | None] = [None] * len(self.params)
        for k, (i, a, b, s) in enumerate(self.segments):
            out[i] = FlatSlice(shard_of(k), a)
        return out
