"""Per-module gradient sync, one global grad-norm clip across modules, one optimizer per module.

    opt = ModuleOptimizers(modules, groups, lrs={"language": 1e-3, "vision": 2e-4}, clip_grad=1.0, ...)
    ... hetero_step(...)                       # backward of every microbatch
    stats = opt.step(lr_scale)                 # sync, clip, update, zero; returns grad norm and lrs

Why not megatron's DistributedDataParallel + get_megatron_optimizer (hetero/runtime/cpu_shims.py notes): on CPU
their optimizer creates tensors on 'cuda' (optimizer.py:481/907) and clip_grads asserts CUDA tensor types
(clip_grads.py:167); their grad norm combines only the groups of one model, while modules on disjoint rank
sets need a norm across modules; and their sharded optimizer state is keyed by parameter identity, which
our checkpoint's split of fused Mamba projections (hetero/training/checkpoint.py) cannot give. What they
would do here is small: one all-reduce per module over a flat buffer, a norm, torch's AdamW.

Gradients: each rank's loss share is already divided by the step's global token count
(hetero/training/stages.py), so the right gradient is the SUM over the module's DP x CP group — for every
module, whatever its DP size. Averaging instead (DDP's default) would scale each module's gradient by
1/its own DP size: the silent encoder-gradient bug of heterogeneous layouts.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tessera.hetero.runtime.groups import ModuleGroups


def lr_at(step: int, max_steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at `step` (0-based): linear warm-up, then cosine to min_ratio."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(max_steps - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _counts_once(p: torch.nn.Parameter, tp_rank: int) -> bool:
    """A parameter's gradient enters the norm once: TP shards on every TP rank, replicas on TP rank 0."""
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0


class ModuleOptimizers:
    def __init__(self, modules: dict[str, torch.nn.Module], groups: dict[str, ModuleGroups],
                 lrs: dict[str, float], clip_grad: float = 1.0, weight_decay: float = 0.0,
                 betas=(0.9, 0.95), eps: float = 1e-8, all_keys: list[str] | None = None):
        self.modules, self.groups, self.clip = modules, groups, clip_grad
        self.all_keys = sorted(all_keys or modules)  # every module of the model, hosted here or not
        self.params = {k: [p for p in m.parameters() if p.requires_grad] for k, m in modules.items()}
        self.peak_lr = dict(lrs)
        self.optimizers = {}
        for key, params in self.params.items():
            if not params:  # a frozen module gets no optimizer and no state
                continue
            decay = [p for p in params if p.dim() >= 2]
            no_decay = [p for p in params if p.dim() < 2]
            self.optimizers[key] = torch.optim.AdamW(
                [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                lr=lrs[key], betas=tuple(betas), eps=eps, foreach=True)

    def sync_gradients(self) -> None:
        """Sum every module's gradients over its own DP x CP group: one flat all-reduce per module."""
        for key in sorted(self.params):
            params, group = self.params[key], self.groups[key].pgs.dp_cp
            if not params or group.size() == 1:
                continue
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)

    def grad_norm(self) -> float:
        """L2 norm of the whole model's gradient (every module, every shard once), known on every rank."""
        sq = torch.zeros(len(self.all_keys), dtype=torch.float64)
        for key, params in self.params.items():
            pgs = self.groups[key].pgs
            tp_rank = pgs.tp.rank()
            local = sum((p.grad.double().pow(2).sum() for p in params
                         if p.grad is not None and _counts_once(p, tp_rank)), torch.zeros((), dtype=torch.float64))
            dist.all_reduce(local, group=pgs.mp)  # this module's TP shards and PP stages
            sq[self.all_keys.index(key)] = local
        # members of one module agree on its value, non-members hold 0: MAX combines modules on any ranks
        dist.all_reduce(sq, op=dist.ReduceOp.MAX)
        return float(sq.sum().sqrt())

    def step(self, lr_scale: float = 1.0) -> dict:
        self.sync_gradients()
        norm = self.grad_norm()
        coef = self.clip / (norm + 1e-6) if self.clip and norm > self.clip else 1.0
        for key, opt in self.optimizers.items():
            for p in self.params[key]:
                if p.grad is not None and coef != 1.0:
                    p.grad.mul_(coef)
            for group in opt.param_groups:
                group["lr"] = self.peak_lr[key] * lr_scale
            opt.step()
        for params in self.params.values():
            for p in params:
                p.grad = None
        return {"grad_norm": norm, "lr": {k: self.peak_lr[k] * lr_scale for k in self.all_keys if k in self.peak_lr}}

    def state_tensors(self) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
        """module -> param index -> {exp_avg, exp_avg_sq, step} (materialised, zeros before the first step)."""
        out = {}
        for key, opt in self.optimizers.items():
            per = {}
            for i, p in enumerate(self.params[key]):
                st = opt.state[p]
                if not st:
                    st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                              exp_avg_sq=torch.zeros_like(p))
                per[i] = st
            out[key] = per
        return out
