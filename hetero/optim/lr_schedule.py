"""The learning-rate schedule: megatron-core's OptimizerParamScheduler, as a multiplier of each module's peak LR.

    schedule = LRSchedule("cosine", max_steps=1000, warmup=100, min_ratio=0.1)   # optim.lr_schedule, ...
    ModuleOptimizers.step(schedule(step))

Styles are megatron's (LR_SCHEDULES): cosine and linear decay to min_ratio at max_steps, constant, inverse square
root, and WSD (warm-up, stable, decay: the peak until the last `wsd_decay_steps` steps, then down to min_ratio in
megatron's lr_wsd_decay_style; default the last 10% of the steps, linearly). One difference, kept from
Tessera's first schedule: during warm-up step s (0-based) trains at megatron's num_steps = s + 1, so the first
step trains at 1/warmup of the peak rather than at init_lr = 0, and after it at num_steps = s.
"""

from __future__ import annotations

from tessera.hetero.runspec.config import check_lr_schedule


class LRSchedule:
    def __init__(self, style: str, max_steps: int, warmup: int, min_ratio: float,
                 wsd_decay_steps: int | None = None, wsd_decay_style: str = "linear"):
        import torch  # here, so that hetero/runspec/config.py checks a schedule's name without importing torch
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        check_lr_schedule(style, wsd_decay_style)
        self.warmup = warmup
        # megatron's scheduler drives an optimizer's param groups: one dummy group at lr 1 gives the multiplier
        dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        decay = max(max_steps, warmup + 1)  # megatron asserts decay steps > warm-up steps
        self.sched = OptimizerParamScheduler(
            dummy, init_lr=0.0, max_lr=1.0, min_lr=min_ratio, lr_warmup_steps=warmup, lr_decay_steps=decay,
            lr_decay_style=style, start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant",
            wsd_decay_steps=(wsd_decay_steps if wsd_decay_steps is not None else max(1, round(0.1 * max_steps)))
            if style == "WSD" else None, lr_wsd_decay_style=wsd_decay_style if style == "WSD" else None)

    def __call__(self, step: int) -> float:
        """Multiplier of the peak LR at `step` (0-based)."""
        self.sched.num_steps = step + 1 if step < self.warmup else step
        return self.sched.get_lr({})
