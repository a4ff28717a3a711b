"""The LR schedule (hetero/training/optim.lr_at) where it lives, against megatron-core's OptimizerParamScheduler
(issue 34 item 4): warm-up edges, cosine decay, its end and the floor, in milliseconds.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_lr_schedule.py -q
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from tessera.hetero.training.optim import lr_at

# (warmup steps, max steps, min LR ratio)
CASES = [(0, 10, 0.1), (3, 10, 0.0), (5, 20, 0.5), (1, 2, 0.1), (0, 1, 0.0), (10, 11, 0.25), (2, 1000, 0.01)]


def _megatron(warmup: int, steps: int, min_ratio: float) -> OptimizerParamScheduler:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=min_ratio, lr_warmup_steps=warmup,
                                   lr_decay_steps=steps, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=1, wd_incr_style="constant")


@pytest.mark.parametrize("warmup,steps,min_ratio", CASES)
def test_lr_schedule_is_megatrons_cosine_with_warmup_one_step_ahead(warmup, steps, min_ratio):
    """After warm-up, step s is megatron's at num_steps = s (the cosine from the peak to min_lr over the decay
    steps, then min_lr); during warm-up it is megatron's at s + 1, so the first step trains at lr / warmup where
    megatron's trains at init_lr = 0."""
    sched = _megatron(warmup, steps, min_ratio)
    for s in range(steps + 3):
        sched.num_steps = s + 1 if s < warmup else s
        want = sched.get_lr({})
        assert lr_at(s, steps, warmup, min_ratio) == pytest.approx(want, abs=1e-12), (s, want)
    assert lr_at(steps + 5, steps, warmup, min_ratio) == pytest.approx(min_ratio)
    if warmup:
        assert lr_at(0, steps, warmup, min_ratio) == pytest.approx(1 / warmup)
        assert lr_at(warmup - 1, steps, warmup, min_ratio) == 1.0
