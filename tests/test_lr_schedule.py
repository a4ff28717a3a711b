"""The LR schedule (hetero/optim/lr_schedule.LRSchedule) where it lives, against megatron-core's
OptimizerParamScheduler step by step (issues 33 and 34): warm-up edges, cosine decay, its end and the floor, WSD's
plateau and decay, in milliseconds.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_lr_schedule.py -q
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from tessera.hetero.optim.lr_schedule import LRSchedule

# (warmup steps, max steps, min LR ratio)
CASES = [(0, 10, 0.1), (3, 10, 0.0), (5, 20, 0.5), (1, 2, 0.1), (0, 1, 0.0), (10, 11, 0.25), (2, 1000, 0.01)]


def _megatron(warmup: int, steps: int, min_ratio: float, style: str = "cosine", **wsd) -> OptimizerParamScheduler:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=min_ratio, lr_warmup_steps=warmup,
                                   lr_decay_steps=steps, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=1, wd_incr_style="constant", **wsd)


@pytest.mark.parametrize("warmup,steps,min_ratio", CASES)
def test_lr_schedule_is_megatrons_cosine_with_warmup_one_step_ahead(warmup, steps, min_ratio):
    """After warm-up, step s is megatron's at num_steps = s (the cosine from the peak to min_lr over the decay
    steps, then min_lr); during warm-up it is megatron's at s + 1, so the first step trains at lr / warmup where
    megatron's trains at init_lr = 0."""
    sched, lr_at = _megatron(warmup, steps, min_ratio), LRSchedule("cosine", steps, warmup, min_ratio)
    for s in range(steps + 3):
        sched.num_steps = s + 1 if s < warmup else s
        want = sched.get_lr({})
        assert lr_at(s) == pytest.approx(want, abs=1e-12), (s, want)
    assert lr_at(steps + 5) == pytest.approx(min_ratio)
    if warmup:
        assert lr_at(0) == pytest.approx(1 / warmup)
        assert lr_at(warmup - 1) == 1.0


@pytest.mark.parametrize("decay_steps, style", [(None, "linear"), (4, "cosine"), (10, "exponential")])
def test_wsd_holds_the_peak_then_decays_in_its_last_steps(decay_steps, style):
    """WSD: warm-up, the peak until the last decay_steps (default the last 10% of max_steps), then megatron's
    decay style down to min_ratio at max_steps."""
    steps, warmup, floor = 50, 5, 0.1
    lr_at = LRSchedule("WSD", steps, warmup, floor, decay_steps, style)
    decay = decay_steps if decay_steps is not None else 5
    sched = _megatron(warmup, steps, floor, "WSD", wsd_decay_steps=decay, lr_wsd_decay_style=style)
    for s in range(warmup, steps + 2):
        sched.num_steps = s
        assert lr_at(s) == pytest.approx(sched.get_lr({}), abs=1e-12), s
    assert all(lr_at(s) == 1.0 for s in range(warmup, steps - decay + 1))
    assert lr_at(steps - decay + 1) < 1.0 and lr_at(steps) == pytest.approx(floor)


@pytest.mark.parametrize("style", ["constant", "linear", "inverse-square-root"])
def test_other_megatron_styles(style):
    sched, lr_at = _megatron(3, 20, 0.1, style), LRSchedule(style, 20, 3, 0.1)
    for s in range(3, 22):
        sched.num_steps = s
        assert lr_at(s) == pytest.approx(sched.get_lr({}), abs=1e-12), s


def test_unknown_schedule_is_refused_when_the_config_is_built():
    from tessera.hetero.runspec.config import OptimConfig

    with pytest.raises(ValueError, match="optim.lr_schedule='cosin': choose one of cosine, linear"):
        OptimConfig(lr_schedule="cosin")
