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

Mixed precision (param_dtype=torch.bfloat16), as megatron does it (DDP grad buffers +
Float16OptimizerWithFloat16Params): parameters and activations are bf16; each trainable parameter gets an
fp32 `main_grad`, a view into one flat fp32 buffer per module, and a post-accumulate-grad hook adds every
microbatch's bf16 `p.grad` into it in fp32 and frees `p.grad` (megatron DDP's backward post-hook). The DP
all-reduce (that flat buffer, in place), the grad norm and clipping run on the fp32 main grads; torch's AdamW
steps fp32 master weights (taken from the weights as built, before the cast) with fp32 Adam states, and the
masters are copied (rounded) into the bf16 parameters after every step. Without masters an update smaller
than half a bf16 ulp of its weight (2^-9 relative) rounds away every step; with them it accumulates. The
fp32 path (param_dtype None or float32) has no masters and no hooks: the code it ran before, bit for bit.

Why hand-written and not megatron's mixed-precision optimizers (megatron-core 0.16.1, checked on CPU with the
cpu_shims applied): Float16OptimizerWithFloat16Params(AdamW([bf16 param]), OptimizerConfig(bf16=True), None,
...) fails first in its base MixedPrecisionOptimizer.__init__, which for bf16 without a grad scaler creates
`_scale_one = torch.tensor([1.0], device='cuda')` (optimizer.py:485): "AssertionError: Torch not compiled with
CUDA enabled". Past that (literal 'cuda' removed), its own __init__ (optimizer.py:671-700) accepts only
`param.type()` in 'torch.cuda.HalfTensor'/'torch.cuda.BFloat16Tensor'/'torch.cuda.FloatTensor': "TypeError:
Wrapped parameters must be one of torch.cuda.FloatTensor, ... Received torch.BFloat16Tensor".
DistributedOptimizer has the same type check (distrib_optimizer.py:361/420-435), and
clip_grads.clip_grad_by_total_norm_fp32 asserts `param.grad.type() == 'torch.cuda.FloatTensor'`
(clip_grads.py:167) and builds its buffers on device='cuda' (:103/:115). The cpu_shims (torch.cuda.current_device
-> "cpu") reach neither literal 'cuda' strings nor these type names.

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


def _accumulate_main_grad(p: torch.nn.Parameter) -> None:
    """Post-accumulate-grad hook (megatron DDP's backward post-hook): this microbatch's bf16 gradient into the
    fp32 main grad, then free it, so gradients accumulate across microbatches in fp32."""
    if p.grad is not None:
        p.main_grad.add_(p.grad)
        p.grad = None


class ModuleOptimizers:
    def __init__(self, modules: dict[str, torch.nn.Module], groups: dict[str, ModuleGroups],
                 lrs: dict[str, float], clip_grad: float = 1.0, weight_decay: float = 0.0,
                 betas=(0.9, 0.95), eps: float = 1e-8, all_keys: list[str] | None = None,
                 param_dtype: torch.dtype | None = None):
        """param_dtype: cast the modules to it here; bfloat16 takes fp32 master weights first (the module
        docstring). None leaves the modules as they are (fp32 path)."""
        self.modules, self.groups, self.clip = modules, groups, clip_grad
        self.all_keys = sorted(all_keys or modules)  # every module of the model, hosted here or not
        self.params = {k: [p for p in m.parameters() if p.requires_grad] for k, m in modules.items()}
        self.peak_lr = dict(lrs)
        if param_dtype == torch.float16:
            raise ValueError("float16 needs loss scaling, which is not implemented: use bfloat16")
        self.mixed = param_dtype is not None and param_dtype != torch.float32
        # module -> fp32 master per entry of self.params[module] (mixed precision only)
        self.masters: dict[str, list[torch.Tensor]] = {}
        self._grad_buffers: dict[str, torch.Tensor] = {}  # module -> flat fp32 main-grad buffer
        self._hooks = []
        if self.mixed:
            self.masters = {k: [p.detach().clone().float() for p in ps] for k, ps in self.params.items() if ps}
        if param_dtype is not None:
            for m in modules.values():
                m.to(dtype=param_dtype)
        for key, masters in self.masters.items():
            params = self.params[key]
            buf = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
            self._grad_buffers[key] = buf
            offset = 0
            for p, master in zip(params, masters):
                p.main_grad = buf[offset:offset + p.numel()].view_as(p)
                master.grad = p.main_grad  # AdamW reads the fp32 main grad directly
                offset += p.numel()
                self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_main_grad))
        self.optimizers = {}
        for key, params in self.params.items():
            if not params:  # a frozen module gets no optimizer and no state
                continue
            stepped = self.masters.get(key, params)  # fp32 masters, or the fp32 parameters themselves
            decay = [q for p, q in zip(params, stepped) if p.dim() >= 2]
            no_decay = [q for p, q in zip(params, stepped) if p.dim() < 2]
            self.optimizers[key] = torch.optim.AdamW(
                [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                lr=lrs[key], betas=tuple(betas), eps=eps, foreach=True)

    def _device(self) -> torch.device:
        """Where this rank's parameters live (collective buffers go there too)."""
        for params in self.params.values():
            if params:
                return params[0].device
        for m in self.modules.values():
            for t in m.parameters():
                return t.device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _grad(self, key: str, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The gradient the optimizer uses: the fp32 main grad (mixed precision) or p.grad."""
        return p.main_grad if key in self.masters else p.grad

    def copy_masters_to_params(self) -> None:
        """Round every fp32 master into its bf16 parameter (after a step, after loading a checkpoint)."""
        with torch.no_grad():
            for key, masters in self.masters.items():
                torch._foreach_copy_([p.data for p in self.params[key]], masters)

    def sync_gradients(self) -> None:
        """Sum every module's gradients over its own DP x CP group: one flat all-reduce per module."""
        for key in sorted(self.params):
            params, group = self.params[key], self.groups[key].pgs.dp_cp
            if not params or group.size() == 1:
                continue
            if key in self._grad_buffers:  # mixed precision: the fp32 main grads are one flat buffer already
                dist.all_reduce(self._grad_buffers[key], group=group)
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
        device = self._device()
        sq = torch.zeros(len(self.all_keys), dtype=torch.float64, device=device)
        for key, params in self.params.items():
            pgs = self.groups[key].pgs
            tp_rank = pgs.tp.rank()
            grads = [(p, self._grad(key, p)) for p in params]
            local = sum((g.double().pow(2).sum() for p, g in grads
                         if g is not None and _counts_once(p, tp_rank)),
                        torch.zeros((), dtype=torch.float64, device=device))
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
                g = self._grad(key, p)
                if g is not None and coef != 1.0:
                    g.mul_(coef)
            for group in opt.param_groups:
                group["lr"] = self.peak_lr[key] * lr_scale
            opt.step()  # mixed precision: steps the fp32 masters with their fp32 main grads
        self.copy_masters_to_params()
        for buf in self._grad_buffers.values():
            buf.zero_()
        for params in self.params.values():
            for p in params:
                p.grad = None
        return {"grad_norm": norm, "lr": {k: self.peak_lr[k] * lr_scale for k in self.all_keys if k in self.peak_lr}}

    def state_tensors(self) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
        """module -> param index -> {exp_avg, exp_avg_sq, step} (materialised, zeros before the first step;
        fp32, of the master, under mixed precision)."""
        out = {}
        for key, opt in self.optimizers.items():
            per = {}
            for i, p in enumerate(self.masters.get(key, self.params[key])):  # what AdamW steps
                st = opt.state[p]
                if not st:
                    st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                              exp_avg_sq=torch.zeros_like(p))
                per[i] = st
            out[key] = per
        return out
