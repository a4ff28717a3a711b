"""Vocab-parallel cross entropy over an *injected* TP group.

megatron-core 0.16.1's `vocab_parallel_cross_entropy` reduces over parallel_state's global TP group
(tensor_parallel/cross_entropy.py:131/151/157), which a heterogeneous run does not have: each module has
its own TP group. This autograd function runs megatron's own per-shard maths
(VocabParallelCrossEntropy's static helpers) and only does the three all-reduces on the group it is given.

    ce = vocab_parallel_cross_entropy_for(pg_collection.tp)    # HybridLM(..., cross_entropy=ce)
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as VPCE
from megatron.core.tensor_parallel.utils import VocabUtility


class _GroupVocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        logits, logits_max = VPCE.calculate_logits_max(logits)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.size(-1), group.rank(), group.size())
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = VPCE.calculate_predicted_logits(
            logits, target, logits_max, start, end)
        dist.all_reduce(predicted, group=group)
        dist.all_reduce(sum_exp, group=group)
        softmax, loss = VPCE.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = VPCE.prepare_gradient_calculation_operands(softmax, target_mask)
        return VPCE.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output), None, None


def _ce(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    return _GroupVocabParallelCE.apply(logits, target, group)


def vocab_parallel_cross_entropy_for(group):
    """(logits [.., V/tp], target [..]) -> per-token loss [..], reducing over `group`."""
    return functools.partial(_ce, group=group)
