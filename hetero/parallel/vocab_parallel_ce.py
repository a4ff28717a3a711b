"""Vocab-parallel cross entropy over an *injected* TP group: models/vocab_ce.py's maths (megatron-core's own)
with its three reductions done as all-reduces on the group it is given, not parallel_state's global TP group.

    ce = vocab_parallel_cross_entropy_for(pg_collection.tp)    # HybridLM(..., cross_entropy=ce)
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from tessera.models.vocab_ce import LOCAL, VocabReduce, vocab_cross_entropy


def group_reduce(group) -> VocabReduce:
    if group is None or group.size() == 1:
        return LOCAL
    return VocabReduce(max_=functools.partial(dist.all_reduce, op=dist.ReduceOp.MAX, group=group),
                       sum_=functools.partial(dist.all_reduce, group=group), rank=group.rank(), size=group.size())


def vocab_parallel_cross_entropy_for(group):
    """(logits [.., V/tp], target [..]) -> per-token loss [..], reducing over `group`."""
    return functools.partial(vocab_cross_entropy, reduce=group_reduce(group))
