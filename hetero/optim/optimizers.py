"""Per-module gradient sync, one global grad-norm clip across modules, one optimizer per module.

    opt = ModuleOptimizers(modules, groups, lrs={"language": 1e-3, "vision": 2e-4}, clip_grad=1.0, ...)
    ... hetero_step(...)                       # backward of every microbatch
    stats = opt.step(lr_scale)                 # sync, clip, update, zero; returns grad norm and lrs

Why not megatron's DistributedDataParallel + get_megatron_optimizer (hetero/runtime/cpu_shims.py notes): on CPU
their optimizer creates tensors on 'cuda' (optimizer.py:481/907) and clip_grads asserts CUDA tensor types
(clip_grads.py:167); their grad norm combines only the groups of one model, while modules on disjoint rank
sets need a norm across modules; and their sharded optimizer state is keyed by parameter identity, which
our checkpoint's split of fused Mamba projections (hetero/checkpoint/sharded.py) cannot give. What they
would do here is small: bucketed collectives per module, started during backward with overlap_grad_reduce
(hetero/optim/grad_buckets.py, which says why not megatron's DDP), a norm, torch's AdamW.

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

Expert parallelism (MoE, EP > 1), as megatron's DDP does it: routed-expert parameters (megatron marks them
`allreduce=False`) are distinct on every EP rank and replicated only over the expert-DP group, so their
gradients are summed over expt_dp, not dp_cp (each module's parameters are ordered dense first, experts last,
and the flat main-grad buffer is reduced in those two pieces); the grad norm adds every EP rank's experts.

Gradients: each rank's loss share is already divided by the step's global token count
(hetero/training/stages.py), so the right gradient is the SUM over the module's DP x CP group — for every
module, whatever its DP size. Averaging instead (DDP's default) would scale each module's gradient by
1/its own DP size: the silent encoder-gradient bug of heterogeneous layouts.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tessera.hetero.runtime.groups import ModuleGroups
from tessera.hetero.optim.grad_buckets import DEFAULT_BUCKET_ELEMENTS, GradBucket, GradReducer, split_buckets
from tessera.hetero.optim.zero import ShardedPart


def _counts_once(p: torch.nn.Parameter, tp_rank: int) -> bool:
    """A parameter's gradient enters the norm once: TP shards on every TP rank, replicas on TP rank 0."""
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0


def _routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """MoE routers with an expert bias (aux-loss-free load balancing)."""
    return [r for r in module.modules() if getattr(r, "expert_bias", None) is not None]


def is_expert_param(p: torch.nn.Parameter) -> bool:
    """A routed-expert parameter of an expert-parallel layer (megatron's rule: `allreduce` set False)."""
    return not getattr(p, "allreduce", True)


def sums_over_tp(p: torch.nn.Parameter, tp_size: int) -> bool:
    """A weight every TP rank applies to its own slice of the sequence (sequence parallelism: norms, the router;
    megatron tags them `sequence_parallel`): its gradient is summed over TP first (finalize_model_grads)."""
    return bool(getattr(p, "sequence_parallel", False)) and tp_size > 1


def reduce_gradients(modules: dict[str, torch.nn.Module], groups) -> None:
    """The gradient reduction of ModuleOptimizers.sync_gradients, one parameter at a time, for code that steps no
    optimizer (hetero/tools/verify.py's chain): per module, sequence-parallel weights over TP first, then routed
    experts over expert-DP and everything else over DP x CP. A parameter without a gradient reduces zeros, so every
    rank of a group makes the same calls."""
    for key, module in modules.items():
        pgs = groups[key].pgs
        for p in module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if sums_over_tp(p, pgs.tp.size()):
                dist.all_reduce(p.grad, group=pgs.tp)
            dist.all_reduce(p.grad, group=pgs.expt_dp if is_expert_param(p) else pgs.dp_cp)


def _grad_or_zeros(p: torch.nn.Parameter) -> torch.Tensor:
    """p.grad, made zeros where backward left none (every rank of a group reduces the same tensors)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


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
                 param_dtype: torch.dtype | None = None, distributed: bool = False,
                 overlap_modules=(), bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, backwards_per_step: int = 1):
        """param_dtype: cast the modules to it here; bfloat16 takes fp32 master weights first (the module
        docstring). None leaves the modules as they are (fp32 path). distributed: ZeRO-1, the fp32 masters and
        Adam states sharded over each reduction group (hetero/optim/zero.py); bf16 runs only.
        bucket_elements: gradients reduced in buckets of about that many elements; those of overlap_modules
        each started as soon as backward made it final, i.e. gave it backwards_per_step (the step's
        microbatches) gradients (hetero/optim/grad_buckets.py); bitwise the same sums as after backward."""
        self.modules, self.groups, self.clip = modules, groups, clip_grad
        self.all_keys = sorted(all_keys or modules)  # every module of the model, hosted here or not
        # dense parameters first, routed experts last (stable): each part is reduced over its own DP group
        self.params = {k: sorted((p for p in m.parameters() if p.requires_grad), key=is_expert_param)
                       for k, m in modules.items()}
        self._n_dense = {k: sum(not is_expert_param(p) for p in ps) for k, ps in self.params.items()}
        self.peak_lr = dict(lrs)
        if param_dtype == torch.float16:
            raise ValueError("float16 needs loss scaling, which is not implemented: use bfloat16")
        self.mixed = param_dtype is not None and param_dtype != torch.float32
        if distributed and not self.mixed:
            raise ValueError("optim.use_distributed_optimizer shards the fp32 master weights and Adam states of a "
                             "bf16 run: set model.dtype=bfloat16 (an fp32 run keeps its states on its parameters)")
        # module -> its ZeRO-1 parts, dense and routed experts (distributed optimizer only)
        self.zero: dict[str, list[ShardedPart]] = {}
        self._zero_of: dict[str, list[list[ShardedPart]]] = {}  # module -> [dense parts, expert parts]
        # module -> fp32 master per entry of self.params[module] (mixed precision only)
        self.masters: dict[str, list[torch.Tensor]] = {}
        self._grad_buffers: dict[str, torch.Tensor] = {}  # module -> flat fp32 main-grad buffer
        self._hooks = []
        if self.mixed:
            self.masters = {k: [p.detach().clone().float() for p in ps] for k, ps in self.params.items() if ps}
        if param_dtype is not None:
            for m in modules.values():
                kept = [(r, r.expert_bias.detach().clone(), r.local_tokens_per_expert.detach().clone())
                        for r in _routers(m)]
                m.to(dtype=param_dtype)
                for r, bias, counts in kept:  # the router's bias and token counts stay fp32 (megatron keeps
                    r.expert_bias.data, r.local_tokens_per_expert.data = bias, counts  # the bias fp32 too)
        for key, masters in self.masters.items():
            params = self.params[key]
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_main_grad))
            if distributed:  # one ShardedPart per bucket, in parameter order; _zero_of: those of each part
                n = self._n_dense[key]
                self._zero_of[key] = [[ShardedPart(ps[r.start:r.stop], group, ms[r.start:r.stop])
                                       for r in reversed(split_buckets([p.numel() for p in ps], bucket_elements))]
                                      for (ps, group), ms in zip(self._reduce_parts(key), (masters[:n], masters[n:]))]
                self.zero[key] = [part for parts in self._zero_of[key] for part in parts]
                continue
            buf = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
            self._grad_buffers[key] = buf
            offset = 0
            for p, master in zip(params, masters):
                p.main_grad = buf[offset:offset + p.numel()].view_as(p)
                master.grad = p.main_grad  # AdamW reads the fp32 main grad directly
                offset += p.numel()
        if distributed:
            self.masters = {}  # whole-model masters dropped: each rank keeps its shards
        # after the main-grad hooks: the reducer's hooks see each microbatch's gradient accumulated
        self.reducer = GradReducer(self._bucket_sequences(bucket_elements, set(overlap_modules)), backwards_per_step)
        self.optimizers = {}
        for key, params in self.params.items():
            if not params:  # a frozen module gets no optimizer and no state
                continue
            stepped = self.masters.get(key, params)  # fp32 masters, or the fp32 parameters themselves
            if key in self.zero:  # the master shards' per-parameter views, and their parameters
                stepped = [v for part in self.zero[key] for v in part.master_views]
                params = [q for part in self.zero[key] for q in part.segment_params()]
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
        return p.main_grad if self.mixed else p.grad

    def copy_masters_to_params(self) -> None:
        """Round every fp32 master into its bf16 parameter (after a step, after loading a checkpoint)."""
        for parts in self.zero.values():
            for part in parts:
                part.gather_params()
        with torch.no_grad():
            for key, masters in self.masters.items():
                torch._foreach_copy_([p.data for p in self.params[key]], masters)

    def _reduce_parts(self, key: str):
        """(params, process group) pieces of a module's gradient reduction: dense params over DP x CP, routed
        experts over expert-DP (megatron DDP's expert buffers)."""
        pgs, params, n = self.groups[key].pgs, self.params[key], self._n_dense[key]
        return [(params[:n], pgs.dp_cp), (params[n:], pgs.expt_dp)]

    def _bucket_sequences(self, bucket_elements: int, overlapped: set[str]) -> list[tuple[list[GradBucket], bool]]:
        """Per module and reduction part, its buckets in launch order and whether they start during backward
        (the module in `overlapped`; hetero/optim/grad_buckets.py): each sums
        its sequence-parallel weights over TP first (megatron: finalize_model_grads), then reduces over the part's
        group: a slice of the flat fp32 main-grad buffer (bf16), a ZeRO-1 part (one per bucket), or the flattened
        fp32 `.grad`s."""
        sequences = []
        for key in sorted(self.params):
            tp = self.groups[key].pgs.tp
            start = 0  # of the part in the module's flat main-grad buffer
            for i, (params, group) in enumerate(self._reduce_parts(key)):
                ranges = split_buckets([p.numel() for p in params], bucket_elements)
                zero = self._zero_of[key][i][::-1] if key in self._zero_of else [None] * len(ranges)
                offsets = [start + sum(p.numel() for p in params[:j]) for j in range(len(params) + 1)]
                seq = []
                for r, part in zip(ranges, zero):
                    ps = params[r.start:r.stop]
                    if part is not None:
                        start_dp, land = part.start_reduce_scatter, None
                    elif key in self._grad_buffers:
                        start_dp, land = self._all_reduce_start(
                            self._grad_buffers[key][offsets[r.start]:offsets[r.stop]], group), None
                    else:
                        start_dp, land = self._fp32_bucket(ps, group)
                    seq.append(GradBucket(ps, self._reduced_grad, start_dp,
                                          [p for p in ps if sums_over_tp(p, tp.size())], tp, land))
                sequences.append((seq, key in overlapped))
                start = offsets[-1]
        return sequences

    def _reduced_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """What a bucket reduces of p: the fp32 main grad (mixed precision), or p.grad (zeros where None)."""
        return p.main_grad if self.mixed else _grad_or_zeros(p)

    @staticmethod
    def _all_reduce_start(flat: torch.Tensor, group):
        return lambda: dist.all_reduce(flat, group=group, async_op=True) if group.size() > 1 else None

    @staticmethod
    def _fp32_bucket(params, group):
        """(start, land) of an fp32 bucket: its `.grad`s (zeros where None) flattened and all-reduced, then copied
        back (a group of one: nothing)."""
        held = {}

        def start():
            if group.size() == 1:
                return None
            grads = held["grads"] = [_grad_or_zeros(p) for p in params]
            held["flat"] = _flatten_dense_tensors(grads)
            return dist.all_reduce(held["flat"], group=group, async_op=True)

        def land():
            if held:
                torch._foreach_copy_(held["grads"], _unflatten_dense_tensors(held["flat"], held["grads"]))
                held.clear()
        return start, land

    def sync_gradients(self) -> None:
        """Sum every module's gradients over its own DP x CP group (experts: expert-DP), bucket by bucket; under
        sequence parallelism the gradients of weights every TP rank applies to its own slice of the sequence
        (norms, router) are summed over TP first (megatron: finalize_model_grads). With overlap_grad_reduce most
        buckets started during backward: this waits for them."""
        self.reducer.finish()

    def grad_norm(self) -> float:
        """L2 norm of the whole model's gradient (every module, every shard once), known on every rank."""
        device = self._device()
        sq = torch.zeros(len(self.all_keys), dtype=torch.float64, device=device)
        for key, params in self.params.items():
            pgs = self.groups[key].pgs
            tp_rank = pgs.tp.rank()
            parts = []
            for (part, group), shards in zip(self._reduce_parts(key), self._zero_of.get(key, [None, None])):
                if shards:  # ZeRO-1: this rank's shard of each bucket, summed over the part's group
                    parts.append(sum(shard.sq_norm(lambda p: _counts_once(p, tp_rank)) for shard in shards))
                    dist.all_reduce(parts[-1], group=group)
                    continue
                parts.append(sum((g.double().pow(2).sum() for p, g in ((p, self._grad(key, p)) for p in part)
                                  if g is not None and _counts_once(p, tp_rank)),
                                 torch.zeros((), dtype=torch.float64, device=device)))
            dense, experts = parts
            if pgs.ep.size() > 1:
                dist.all_reduce(experts, group=pgs.ep)  # every EP rank holds other experts
            local = dense + experts
            dist.all_reduce(local, group=pgs.mp)  # this module's TP shards and PP stages
            sq[self.all_keys.index(key)] = local
        # members of one module agree on its value, non-members hold 0: MAX combines modules on any ranks
        dist.all_reduce(sq, op=dist.ReduceOp.MAX)
        return float(sq.sum().sqrt())

    def update_router_expert_bias(self) -> None:
        """Aux-loss-free load balancing, as megatron's finalize_model_grads does once per global batch
        (moe_utils.get_updated_expert_bias): every router's token counts summed over the module's TP x DP x CP
        ranks, bias += rate * sign(mean count - count), counts reset. A router whose weight is frozen (a frozen
        LLM, LoRA's base) keeps its bias: frozen means no tensor changes, and the adapters are exported alone.
        (megatron's function is not called: it all-reduces over parallel_state's global TP x DP x CP group, which
        a heterogeneous layout never sets; each module here has its own.)"""
        for key in sorted(self.params):
            every = _routers(self.modules[key])
            routers = [r for r in every if r.weight.requires_grad]
            if routers:
                counts = torch.stack([r.local_tokens_per_expert.float() for r in routers])
                dist.all_reduce(counts, group=self.groups[key].pgs.tp_dp_cp)
                offset = counts.mean(dim=-1, keepdim=True) - counts
                with torch.no_grad():
                    for r, off in zip(routers, offset):
                        r.expert_bias.add_(torch.sign(off) * r.config.moe_router_bias_update_rate)
            with torch.no_grad():  # every router's counts restart each step, a frozen one's too
                for r in every:
                    r.local_tokens_per_expert.zero_()

    def step(self, lr_scale: float = 1.0) -> dict:
        self.sync_gradients()
        self.update_router_expert_bias()
        norm = self.grad_norm()
        coef = self.clip / (norm + 1e-6) if self.clip and norm > self.clip else 1.0
        for key, opt in self.optimizers.items():
            grads = ([part.grad_shard for part in self.zero[key]] if key in self.zero
                     else [self._grad(key, p) for p in self.params[key]])
            for g in grads:
                if g is not None and coef != 1.0:
                    g.mul_(coef)
            for group in opt.param_groups:
                group["lr"] = self.peak_lr[key] * lr_scale
            opt.step()  # mixed precision: steps the fp32 masters with their fp32 main grads
        self.copy_masters_to_params()
        for buf in self._grad_buffers.values():
            buf.zero_()
        for parts in self.zero.values():
            for part in parts:
                part.zero_grad()
        for params in self.params.values():
            for p in params:
                p.grad = None
        return {"grad_norm": norm, "lr": {k: self.peak_lr[k] * lr_scale for k in self.all_keys if k in self.peak_lr}}

    def _adam_state(self, opt, t: torch.Tensor) -> dict:
        """AdamW's state of a stepped tensor, materialised (zeros before the first step)."""
        st = opt.state[t]
        if not st:
            st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(t),
                      exp_avg_sq=torch.zeros_like(t))
        return st

    def param_space(self) -> dict[str, list[dict]]:
        """What a checkpoint stores besides the weights, per module and trainable parameter (aligned with
        self.params[key]): 'optim.master' (mixed precision), 'optim.exp_avg', 'optim.exp_avg_sq' (fp32), each
        the live tensor shaped like its parameter - or, under ZeRO-1, this rank's FlatSlice of it (a view of
        the shard; a parameter this rank holds none of gets no entry). No copies: a checkpoint reads and loads
        these tensors in place."""
        out = {}
        for key, opt in self.optimizers.items():
            if key in self.zero:
                per = []
                for part in self.zero[key]:
                    states = [self._adam_state(opt, v) for v in part.master_views]
                    fields = {"optim.master": part.flat_slices(lambda k, part=part: part.master_views[k])}
                    for f in ("exp_avg", "exp_avg_sq"):
                        fields[f"optim.{f}"] = part.flat_slices(lambda k, f=f: states[k][f])
                    per += [{} if ts[0] is None else dict(zip(fields, ts)) for ts in zip(*fields.values())]
                out[key] = per
                continue
            stepped = self.masters.get(key, self.params[key])  # what AdamW steps
            per = [{f"optim.{f}": self._adam_state(opt, t)[f] for f in ("exp_avg", "exp_avg_sq")} for t in stepped]
            if key in self.masters:
                for d, m in zip(per, self.masters[key]):
                    d["optim.master"] = m
            out[key] = per
        return out

    def load_param_space(self, step: int) -> None:
        """After a checkpoint was loaded into the tensors of param_space() (in place, ZeRO-1 shards included):
        every Adam state's step count is set, and the params are re-derived from the masters."""
        for opt in self.optimizers.values():
            for st in opt.state.values():
                st["step"].fill_(float(step))
        self.copy_masters_to_params()  # bf16 params = the loaded fp32 masters, rounded (as after a step)
