"""LoRA: low-rank adapters on the LLM's linear layers and the media projectors; base weights frozen.

    adapters = apply_lora(modules, groups, model_cfg, seed)   # after the base weights are loaded
    ... train: only adapter parameters have requires_grad (ModuleOptimizers gives nothing else state)
    merge_lora(modules)                                       # export: W += (alpha/r) B A, adapters removed

A targeted layer computes y = W x + (alpha/r) B (A x) (dropout 0). Targets (model.lora.targets, names from
hetero/plan/lora.py, Megatron-Bridge's plus Tessera's) are layer names: linear_qkv / linear_proj (attention),
linear_fc1 / linear_fc2 (MLP, MoE shared experts), in_proj / out_proj (Mamba), projector (every nn.Linear of
the media projectors mlp1 / sound_projection). linear_fc1 / linear_fc2 include every routed MoE expert (as
Megatron-Bridge's LoRA does): each expert its own adapter, named by its global expert id, reduced over expert-DP
like the expert. `vision` adapts the vision tower: every ViT layer's linear_qkv / linear_proj / linear_fc1 /
linear_fc2 (megatron column / row parallel layers on the tower's own TP group, named by global layer index under
vision PP; summed over the tower's DP x CP like its other gradients). The audio tower (NeMo's / transformers'
conformer, plain torch layers) is not adapted.

Tensor parallelism, sharded so that every TP size computes the same numbers:
  ColumnParallelLinear W [out/tp, in]: A replicated [r, in], B column-parallel [out/tp, r]. Each rank's
    output shard uses its B rows; the replicated A only sees this rank's share of dL/d(Ax), so A x goes
    through copy_to_tensor_model_parallel_region (identity forward, TP all-reduce backward).
  RowParallelLinear W [out, in/tp] (input split over TP): A row-parallel [r, in/tp], A x all-reduced over TP
    (reduce_from_tensor_model_parallel_region), B replicated [out, r].
  Under sequence parallelism (an MoE LLM at TP > 1) the layers take / give a sequence slice per rank: the column
    adapter all-gathers A x over the sequence, the row adapter reduce-scatters it (megatron's own SP mappings), and
    the replicated factor (A, resp. B) sees one slice: marked sequence_parallel, its gradient is summed over TP.
The sharded factor carries megatron's tensor_model_parallel/partition_dim attributes, so the grad norm counts
it once per shard and checkpoints store it by offsets like any weight (any layout in/out). A Mamba in_proj
shard is [z_r|x_r|B_r|C_r|dt_r], so its B splits into those parts exactly like its weight (checkpoint.py).

The adapter is a child module `adapter` of the wrapped layer, applied by a forward hook: the base layer keeps
its identity and state-dict keys (`...linear_qkv.weight`), the adapter's are `...linear_qkv.adapter.lora_A`.
Initialisation: A xavier-uniform from a generator seeded by (seed, the layer's global name), drawn full-size
and sliced, so every layout starts from identical adapters; B zero, so step 0 is the frozen base model bit for
bit (frozen, not trainable: megatron multiplies a frozen weight on another path, ~1 ulp apart).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from torch import nn

from tessera.hetero.plan.layout import LANGUAGE
from tessera.hetero.plan.lora import lora_targets, validate_lora
from tessera.hetero.checkpoint.sharded import checkpoint_name, expert_id_offset
from tessera.models.nemotron_h_hf import mamba_parts

LLM_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")
VIT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # target `vision`: every ViT layer's


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    export: str = "both"


def lora_settings(model_cfg) -> LoraSettings | None:
    """The run's LoRA settings (validated), or None when LoRA is off. Reads recipes' LoraConfig or the plain
    dict a checkpoint's saved config holds (this layer does not import recipes/)."""
    cfg = getattr(model_cfg, "lora", None)
    if cfg is None:
        return None
    fields = dict(cfg) if isinstance(cfg, dict) else {f: getattr(cfg, f) for f in LoraSettings.__dataclass_fields__}
    fields["targets"] = lora_targets(fields["targets"])
    validate_lora(**fields)
    return LoraSettings(**fields) if fields["rank"] > 0 else None


class LoraAdapter(nn.Module):
    """lora_A [r, in(/tp)] and lora_B [out(/tp), r] of one layer; forward(x) is the delta (alpha/r) B A x."""

    def __init__(self, kind: str, in_features: int, out_features: int, rank: int, alpha: float,
                 tp_group=None, parts: list[int] | None = None, sequence_parallel: bool = False,
                 expert: bool = False):
        super().__init__()
        self.expert = expert
        self.kind, self.rank, self.scale, self.parts = kind, rank, alpha / rank, parts
        self.tp_group = tp_group if tp_group is not None and tp_group.size() > 1 else None
        self.tp = self.tp_group.size() if self.tp_group is not None else 1
        self.tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
        self.full_in, self.full_out = in_features, out_features  # unsharded sizes
        a_in = in_features // self.tp if kind == "row" else in_features
        b_out = out_features // self.tp if kind == "column" else out_features
        self.lora_A = nn.Parameter(torch.zeros(rank, a_in))
        self.lora_B = nn.Parameter(torch.zeros(b_out, rank))
        sharded = {"row": (self.lora_A, 1), "column": (self.lora_B, 0)}.get(kind)
        if sharded is not None and self.tp > 1:
            sharded[0].tensor_model_parallel, sharded[0].partition_dim, sharded[0].partition_stride = True, sharded[1], 1
        # sequence parallelism: the replicated factor sees only this rank's slice of the sequence, so its gradient
        # is summed over TP like the norms' (hetero/optim/optimizers.sync_gradients reads the attribute). A routed
        # expert's linears do no TP communication (megatron's explicit_expert_comm: the MoE layer's dispatch and
        # combine do), so its replicated factor likewise gets a partial gradient on each TP rank.
        self.sequence_parallel = (sequence_parallel or expert) and self.tp > 1
        if self.sequence_parallel:
            replicated = {"row": self.lora_B, "column": self.lora_A}[kind]
            replicated.sequence_parallel = True
        if expert:  # distinct per EP rank: reduced over expert-DP, like the expert's weights (optim.is_expert_param)
            self.lora_A.allreduce = self.lora_B.allreduce = False

    def shard(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's TP slices of unsharded A [r, in] and B [out, r] (or of their gradients)."""
        if self.kind == "row":
            a = a.chunk(self.tp, dim=1)[self.tp_rank]
        if self.kind == "column" and self.parts:  # fused Mamba in_proj: 1/tp of every part
            b = torch.cat([p.chunk(self.tp)[self.tp_rank] for p in b.split(self.parts)])
        elif self.kind == "column":
            b = b.chunk(self.tp, dim=0)[self.tp_rank]
        return a, b

    def set_full(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Load unsharded A [r, in] and B [out, r]: this rank keeps its TP slices."""
        a, b = self.shard(a, b)
        with torch.no_grad():
            self.lora_A.copy_(a)
            self.lora_B.copy_(b)

    def delta_weight(self) -> torch.Tensor:
        """(alpha/r) B A in fp32, shaped like this rank's shard of the wrapped weight."""
        return self.scale * (self.lora_B.float() @ self.lora_A.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.linear(x.to(self.lora_A.dtype), self.lora_A)
        if self.expert:  # as the expert's own linear: local matmuls, the MoE layer sums over TP
            pass
        elif self.sequence_parallel and self.kind == "column":
            # x is this rank's sequence slice and the layer's output the whole sequence: gather A x ([s, b, r])
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
        elif self.sequence_parallel and self.kind == "row":
            # the layer's output is this rank's sequence slice of the TP sum: reduce-scatter A x the same way
            h = reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        elif self.tp_group is not None and self.kind == "column":
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.tp_group is not None and self.kind == "row":
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return nn.functional.linear(h, self.lora_B) * self.scale


def _add_delta(module, args, output):
    """Forward hook: the base layer's output plus its adapter's delta (megatron layers return (out, bias))."""
    if isinstance(output, tuple):
        return (output[0] + module.adapter(args[0]).to(output[0].dtype),) + tuple(output[1:])
    return output + module.adapter(args[0]).to(output.dtype)


def target_layers(key: str, module: nn.Module, targets) -> list[tuple[str, nn.Module, str]]:
    """(local name, layer, kind) of every layer of module `key` that `targets` selects."""
    out = []
    if key == LANGUAGE:
        for name, m in module.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in targets or leaf not in LLM_TARGETS:
                continue
            if ".experts." in name and not isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                raise ValueError(f"LoRA on {name}: routed experts as {type(m).__name__} (grouped GEMM) are not "
                                 f"supported; use megatron's SequentialMLP experts or drop linear_fc1/linear_fc2")
            kind = _parallel_kind(name, m)
            if kind is not None:
                out.append((name, m, kind))
    else:
        if key == "vision" and "vision" in targets:
            if module.frozen:
                raise ValueError("model.lora.targets has 'vision' but model.freeze_vision is set: a frozen tower runs "
                                 "without gradients, so its adapters could not train; drop one of the two")
            # the ViT's own layers only (module.encoder.vit: the video path shares them), global layer names
            for name, m in module.encoder.vit.named_modules():
                if name.rsplit(".", 1)[-1] in VIT_TARGETS:
                    kind = _parallel_kind(f"encoder.vit.{name}", m)
                    if kind is None:
                        raise ValueError(f"LoRA on encoder.vit.{name}: a {type(m).__name__} is not a megatron "
                                         f"column/row parallel linear")
                    out.append((f"encoder.vit.{name}", m, kind))
        if "projector" in targets and module.projector is not None:  # (an encoder pipeline's last stage only)
            out += [(f"projector.{n}", m, "plain") for n, m in module.projector.named_modules()
                    if isinstance(m, nn.Linear)]
    return out


def _parallel_kind(name: str, m: nn.Module) -> str | None:
    """'column' / 'row' for a megatron parallel linear an adapter can shard with, None for any other module;
    a ValueError for the parallel layouts it cannot (gathered outputs, non-parallel inputs)."""
    if isinstance(m, ColumnParallelLinear):
        if m.gather_output:
            raise ValueError(f"LoRA on {name}: gathered outputs are not supported")
        return "column"
    if isinstance(m, RowParallelLinear):
        if not m.input_is_parallel:
            raise ValueError(f"LoRA on {name}: only input-parallel rows")
        return "row"
    return None


def _init_a(adapter: LoraAdapter, global_name: str, seed: int) -> None:
    """Xavier-uniform A drawn full-size from (seed, name): identical in every layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
    bound = math.sqrt(6.0 / (adapter.rank + adapter.full_in))
    a = torch.empty(adapter.rank, adapter.full_in).uniform_(-bound, bound, generator=g)
    adapter.set_full(a, torch.zeros(adapter.full_out, adapter.rank))


def apply_lora(modules: dict[str, nn.Module], groups, model_cfg, seed: int) -> dict[str, LoraAdapter]:
    """Freeze every module's base weights and wrap the targeted layers of this rank's modules; returns global
    name -> adapter (empty when LoRA is off: nothing is changed then)."""
    cfg = lora_settings(model_cfg)
    if cfg is None:
        return {}
    adapters = {}
    for key, module in modules.items():
        module.requires_grad_(False)
        pgs = groups[key].pgs
        expert_offset = expert_id_offset(key, getattr(module, "config", None), groups[key])
        for name, layer, kind in target_layers(key, module, cfg.targets):
            expert = ".experts.local_experts." in name
            tp_group = pgs.expt_tp if expert else pgs.tp
            tp = tp_group.size() if kind != "plain" else 1
            if kind == "column":
                full_in, full_out = layer.weight.shape[1], layer.weight.shape[0] * tp
            elif kind == "row":
                full_in, full_out = layer.weight.shape[1] * tp, layer.weight.shape[0]
            else:
                full_in, full_out = layer.in_features, layer.out_features
            parts = mamba_parts(module.config) if name.endswith("mixer.in_proj") else None
            adapter = LoraAdapter(kind, full_in, full_out, cfg.rank, cfg.alpha, tp_group if kind != "plain" else None,
                                  parts, getattr(layer, "sequence_parallel", False) and not expert, expert)
            # (a routed expert by its global id: every EP layout draws the same A)
            gname = checkpoint_name(key, name, getattr(module, "layer_offset", 0), expert_offset)
            _init_a(adapter, gname, seed)
            layer.adapter = adapter.to(device=layer.weight.device, dtype=layer.weight.dtype)
            layer._lora_hook = layer.register_forward_hook(_add_delta)
            adapters[gname] = layer.adapter
    return adapters  # may be empty on a rank (a vision-only rank without `projector`): nothing trains there


def adapted_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(getattr(m, "adapter", None), LoraAdapter)]


def merge_lora(modules: dict[str, nn.Module]) -> None:
    """W += (alpha/r) B A on every adapted layer (this rank's shard, in fp32), then drop the adapters: the
    modules are plain base modules again (what the HF converters read)."""
    with torch.no_grad():
        for module in modules.values():
            for _, layer in adapted_layers(module):
                layer.weight.copy_((layer.weight.float() + layer.adapter.delta_weight()).to(layer.weight.dtype))
                layer._lora_hook.remove()
                del layer.adapter, layer._lora_hook
