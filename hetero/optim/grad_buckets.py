"""Gradient reduction in buckets, each launched while backward still runs (megatron DDP's overlap_grad_reduce).

    reducer = GradReducer(sequences, backwards_per_step=microbatches)  # built by ModuleOptimizers
    ...backward of every microbatch...          # a bucket whose gradients are final starts its collective
    reducer.finish()                            # starts what is left (in order), waits for every bucket

A module's reduction part (dense parameters over DP x CP, routed experts over expert-DP: optim.py) is cut into
buckets of about `bucket_elements` elements at parameter boundaries, from its last parameter backwards (backward
makes the last layers' gradients first: megatron's order). Each bucket is one collective: an all-reduce of a
slice of the fp32 main-grad buffer (bf16), a reduce-scatter into a ZeRO-1 shard (zero.ShardedPart, one per
bucket), or an all-reduce of the bucket's flattened fp32 `.grad`s. Weights every TP rank applies to its own
slice of the sequence are first summed over TP, bucket by bucket (the order of the synchronous path before).

When a gradient is final: a post-accumulate-grad hook counts each parameter's gradients of the step; the
`backwards_per_step`-th (one per microbatch) is its last. A bucket starts when all its parameters are final and
every earlier bucket of its sequence has started, so each process group sees its buckets in one order on every
rank whatever the timing (gloo and NCCL match collectives by issue order). A bucket with a parameter that got
fewer gradients (an expert no token reached, an unused weight) starts in finish(), in order; one that would get
more (a weight used by two backward calls of one microbatch) raises instead of reducing a partial gradient.
That count is known for the LLM, with or without recompute (one recompute segment per layer and microbatch),
not for an encoder with recompute: megatron's reentrant checkpoint runs a nested backward per segment, and an
encoder runs once per media item (hetero/training/stages.py), so each weight in a recomputed segment (every layer
under "full"; audio's self-attention block under "selective") gets one gradient per item of the microbatch,
a data-dependent count. overlapped_modules() leaves an encoder with recompute to finish() (measured:
radio_vit_tiny with full recompute got 3 gradients in a 2-microbatch step).

A sequence without overlap runs the same buckets, in the same order, with the same collectives, all from
finish(): the overlapped step is bitwise the synchronous one (tests/test_grad_overlap.py). With one bucket per
part (the default size, 40M elements, megatron's) both make the collectives this project made before buckets,
but for the TP sum of sequence-parallel weights, now one per part instead of one per module.

Why not megatron-core's DistributedDataParallel (0.16.1), although its buckets and overlap do run on CPU gloo
with a module's own process groups (checked: ProcessGroupCollection of the module's dp/dp_cp/expt_dp groups,
overlap_grad_reduce=True, 2 ranks, both use_distributed_optimizer settings): (1) with use_distributed_optimizer
it reduce-scatters into shards of its own buffer (params 64-element aligned, buckets padded to lcm(dp, 128):
param_and_grad_buffer.py:652-665) that only megatron's DistributedOptimizer reads, and that optimizer rejects
CPU tensors (distrib_optimizer.py:361/420-435; optim.py's docstring): ZeRO-1 here would keep its shards and
checkpoint layout on a buffer megatron owns and may re-pad; (2) it turns every gradient into `main_grad` of its
buffer, the fp32 path included, which this project keeps on `.grad` bit for bit; (3) it sums over DP only
with a TransformerConfig(calculate_per_token_loss=True) per module (distributed_data_parallel.py:174/254),
encoders that are no megatron modules included; (4) it learns when a gradient is final from the first step's
counts under `no_sync()` around every backward but the last microbatch's (param_and_grad_buffer.py:174-210,
distributed_data_parallel.py:451), a context the heterogeneous schedule (hetero/runtime/step_executor.py),
whose backward of one microbatch runs in several ops and modules, would have to thread through, and counts that
an encoder with recompute does not repeat from step to step. What it would add is the ~150 lines below.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

DEFAULT_BUCKET_ELEMENTS = 40_000_000  # megatron DDP's default bucket size


def split_buckets(sizes: list[int], bucket_elements: int) -> list[range]:
    """Indices of parameters with these element counts cut into buckets of at least bucket_elements (all but the
    bucket holding the first parameters), last parameters first: megatron's order, as backward makes them."""
    if bucket_elements < 1:
        raise ValueError(f"trainer.grad_bucket_elements must be >= 1, got {bucket_elements}")
    buckets, end, n = [], len(sizes), 0
    for i in range(len(sizes) - 1, -1, -1):
        n += sizes[i]
        if n >= bucket_elements:
            buckets.append(range(i, end))
            end, n = i, 0
    if end > 0:
        buckets.append(range(0, end))
    return buckets


def overlapped_modules(modules, recompute: dict[str, str], language: str) -> list[str]:
    """The modules whose buckets start during backward: the LLM always, an encoder only without recompute (it
    runs once per item: the module docstring)."""
    return [k for k in modules if k == language or recompute.get(k, "none") == "none"]


def flat_all_reduce(tensors: list[torch.Tensor], group) -> None:
    """Sum tensors over group with one collective on their flattened copy, written back in place."""
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    torch._foreach_copy_(tensors, _unflatten_dense_tensors(flat, tensors))


class GradBucket:
    def __init__(self, params: list[torch.nn.Parameter], grad_of: Callable, start_dp: Callable,
                 tp_summed: list[torch.nn.Parameter], tp_group, land: Callable | None = None):
        """grad_of(p): the gradient the bucket reduces (main_grad, or .grad made zeros where None);
        start_dp(): starts the DP collective, returns its Work (None: nothing to reduce, a group of one);
        tp_summed: the bucket's parameters summed over tp_group first; land(): after the wait (copies back)."""
        self.params, self.grad_of, self.start_dp, self.land = params, grad_of, start_dp, land
        self.tp_summed, self.tp_group = tp_summed, tp_group
        self.work = None
        self.started = False

    def start(self) -> None:
        if self.tp_summed:
            flat_all_reduce([self.grad_of(p) for p in self.tp_summed], self.tp_group)
        self.work = self.start_dp()
        self.started = True

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.land is not None:
            self.land()
        self.work, self.started = None, False


class GradReducer:
    def __init__(self, sequences: list[tuple[list[GradBucket], bool]], backwards_per_step: int):
        """sequences: per process group sequence (module and part), its buckets in launch order and whether they
        start from backward hooks (registered here, after any main-grad hook, so they see the accumulated
        gradient); backwards_per_step: gradients a parameter gets per step (the step's microbatches)."""
        if backwards_per_step < 1:
            raise ValueError(f"backwards_per_step must be >= 1 (the step's microbatches), got {backwards_per_step}")
        kept = [(seq, overlap) for seq, overlap in sequences if seq]
        self.sequences = [seq for seq, _ in kept]
        self.buckets = sum(len(s) for s in self.sequences)
        self.target = backwards_per_step
        self._where = {}  # parameter of an overlapped sequence -> (sequence, bucket index)
        for si, (seq, overlap) in enumerate(kept):
            for bi, bucket in enumerate(seq if overlap else []):
                for p in bucket.params:
                    self._where[p] = (si, bi)
        self._count: dict[torch.nn.Parameter, int] = {}
        self._pending = [[len(b.params) for b in seq] for seq in self.sequences]  # params not yet final
        self._next = [0] * len(self.sequences)  # the first bucket of each sequence not started
        self.started_in_backward = 0  # buckets started by hooks in this step
        self.last_started_in_backward = 0  # ... in the last finished step (the metrics record's)
        self.exposed_s = 0.0  # seconds the last finish() took: the reduction not hidden behind backward
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._where]

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        si, bi = self._where[p]
        n = self._count.get(p, 0) + 1
        self._count[p] = n
        if n > self.target or self.sequences[si][bi].started:
            raise RuntimeError(
                f"trainer.overlap_grad_reduce: a parameter of shape {tuple(p.shape)} got gradient {n} of a step "
                f"with {self.target} microbatches, after its bucket's reduction had started (it is used by more "
                f"than one backward call per microbatch): set trainer.overlap_grad_reduce=false")
        if n == self.target:
            self._pending[si][bi] -= 1
            self._start_ready(si)

    def _start_ready(self, si: int) -> None:
        seq = self.sequences[si]
        while self._next[si] < len(seq) and self._pending[si][self._next[si]] == 0:
            seq[self._next[si]].start()
            self._next[si] += 1
            self.started_in_backward += 1

    def finish(self) -> None:
        """Start every bucket not started yet (each sequence in order), wait for all; the gradients are summed."""
        t0 = time.perf_counter()
        for si, seq in enumerate(self.sequences):
            for bucket in seq[self._next[si]:]:
                bucket.start()
        for seq in self.sequences:
            for bucket in seq:
                bucket.wait()
        self.exposed_s = time.perf_counter() - t0
        self.last_started_in_backward = self.started_in_backward
        self._count.clear()
        self._pending = [[len(b.params) for b in seq] for seq in self.sequences]
        self._next = [0] * len(self.sequences)
        self.started_in_backward = 0
