"""The optimizer and gradient reduction, per module of the model.

    optimizers.py    ModuleOptimizers: per-module gradient sync, one global grad-norm clip, one optimizer per module
    grad_buckets.py  gradient reduction in buckets launched while backward still runs (megatron DDP's overlap)
    zero.py          ZeRO-1: fp32 master weights and Adam states sharded over each DP group
    lr_schedule.py   megatron-core's OptimizerParamScheduler as a multiplier of each module's peak LR

Why not megatron's DistributedOptimizer: it is CUDA-bound (optimizers.py's docstring). May import runtime
(process groups) and runspec (the optimizer config); never models, checkpoints or the loop.
"""
