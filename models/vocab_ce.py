"""Cross entropy over vocab-parallel logits, megatron-core's maths with the reductions injected.

megatron-core 0.16.1's `vocab_parallel_cross_entropy` reduces over parallel_state's global TP group
(tensor_parallel/cross_entropy.py:131/151/157), which a heterogeneous run does not have: each module has its own
TP group. This autograd function runs megatron's own per-shard maths (VocabParallelCrossEntropy's static helpers)
and takes the three reductions from a `VocabReduce`: `LOCAL` (the whole vocabulary on this rank: no
communication, HybridLM's default at TP=1) or a process group's all-reduces (hetero/parallel/vocab_parallel_ce.py,
which models/ does not import: models never touch torch.distributed).

    loss = vocab_cross_entropy(logits [.., V/tp], target [..], reduce)   # per-token loss [..]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as VPCE
from megatron.core.tensor_parallel.utils import VocabUtility


def _keep(t: torch.Tensor) -> None:
    """A reduction over one rank: nothing to do."""


@dataclass(frozen=True)
class VocabReduce:
    """In-place reductions over the ranks that share the vocabulary, and this rank's place among them."""
    max_: Callable[[torch.Tensor], None] = _keep
    sum_: Callable[[torch.Tensor], None] = _keep
    rank: int = 0
    size: int = 1


LOCAL = VocabReduce()


class _VocabCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, reduce: VocabReduce):
        logits, logits_max = VPCE.calculate_logits_max(logits)
        reduce.max_(logits_max)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.size(-1), reduce.rank, reduce.size)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = VPCE.calculate_predicted_logits(
            logits, target, logits_max, start, end)
        reduce.sum_(predicted)
        reduce.sum_(sum_exp)
        softmax, loss = VPCE.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = VPCE.prepare_gradient_calculation_operands(softmax, target_mask)
        return VPCE.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output), None, None


def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduce: VocabReduce = LOCAL) -> torch.Tensor:
    """(logits [.., V/size] of rank `reduce.rank`, target [..]) -> per-token loss [..]."""
    return _VocabCE.apply(logits, target, reduce)
