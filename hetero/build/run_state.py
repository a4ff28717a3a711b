"""One rank's run, built in one function: what every step of hetero/training/loop.py reads.

    run = build_run(cfg, resolved, run_dir, device)   # inputs -> groups, modules, weights, optimizers -> resume

The order is the one a fine-tune needs: the tokenizer and the LLM's shape are known (resolve_inputs) before
anything is built; weights come from the run directory's own checkpoint when resuming, else from
model.checkpoint, else from the seed; the optimizers exist before the resumed state is read into them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.energon.savable_loader import SavableDataLoaderState

from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout
from tessera.hetero.plan.recompute import parse_recompute
from tessera.hetero.plan.resolved_run import ResolvedRun
from tessera.hetero.runspec.config import RunConfig
from tessera.hetero.runspec.modules import ModuleSpec, encoder_names, module_specs
from tessera.hetero.runtime.groups import ModuleGroups, build_module_groups
from tessera.hetero.checkpoint.sharded import latest_checkpoint, load_checkpoint, parameter_counts
from tessera.hetero.checkpoint.source import RUN, CheckpointSource, checkpoint_source
from tessera.hetero.optim.grad_buckets import overlapped_modules
from tessera.hetero.checkpoint.loader_state import decode_loader_state
from tessera.hetero.build.lora import apply_lora, lora_settings
from tessera.hetero.optim.lr_schedule import LRSchedule
from tessera.hetero.build.model_build import (build_rank_modules, check_checkpoint_tensors, llm_fields,
                                                 load_full_state, module_configs)
from tessera.hetero.optim.optimizers import ModuleOptimizers
from tessera.hetero.build.seeded_init import SeededState
from tessera.models.hybrid_llm import HybridConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # model.dtype -> what the run computes in


class StepCosts(Protocol):
    """The run's model FLOPs (hetero/planner/flops.StepFlops, handed in by recipes/train.py: training code never
    imports the cost model)."""

    def item_flops(self, module: str, kind: str, units) -> float: ...

    def record(self, batches: list, step_time_s: float, world: int) -> dict[str, Any]: ...


@dataclass(frozen=True)
class RunInputs:
    """What the run reads before it builds anything."""

    cfg: RunConfig  # data.tokenizer set to the tokenizer the run trains with (the export ships that one)
    data_path: str  # the dataset (or blend) the run trains on: data.path, or the synthetic set rank 0 made
    tok_path: str
    hf_fields: dict[str, Any]  # the LLM's NemotronH config fields (the checkpoint's when fine-tuning)
    chat_template: str | None  # the release's, which the conversations are written in (None: the project's)
    source: CheckpointSource | None  # what model.checkpoint is (hetero/checkpoint/source.py); None: from scratch


@dataclass(frozen=True)
class RunState:
    """One rank's run: its config and layout, its modules and optimizers, and where it starts."""

    cfg: RunConfig
    resolved: ResolvedRun  # the run's layout and batch split on this world (hetero/plan/resolved_run.py)
    run_dir: Path
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    data_path: str
    tok_path: str
    hf_fields: dict[str, Any]
    specs: dict[str, ModuleSpec]  # module key -> registry name, frozen, lr, TP (hetero/runspec/modules.py)
    groups: dict[str, ModuleGroups]
    configs: dict[str, HybridConfig]  # module key -> its megatron config (the LLM's carries TP/PP/CP/EP)
    modules: dict[str, torch.nn.Module]  # the modules (or LLM pipeline stage) this rank hosts
    opt: ModuleOptimizers | None  # None: a forward-only run (the parity tools)
    lr_schedule: LRSchedule | None
    start: int = 0  # optimizer steps already taken (a resume)
    saved_on: tuple[int, str] | None = None  # (world, layout) the resumed checkpoint was saved on; None without one
    loader_state: SavableDataLoaderState | None = None  # the resumed loader position
    step_flops: StepCosts | None = None  # None: no FLOPs in the metrics
    chat_template: str | None = None  # the release's, which the conversations are written in (None: the project's)

    @property
    def layout(self) -> HeteroLayout:
        return self.resolved.layout

    @property
    def encoders(self) -> dict[str, str]:
        """module key -> encoder registry name, for the run's encoders."""
        return {k: s.name for k, s in self.specs.items() if k != LANGUAGE}

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"


def _dataset(cfg: RunConfig, rank: int):
    """(dataset path, TokenizerChoice): the configured dataset, or the synthetic one (made by rank 0), and the
    tokenizer data/run_tokenizer.run_tokenizer picks (data.tokenizer, else the checkpoint's, else the dataset's)."""
    from tessera.data.pipeline import synthetic_dataset, synthetic_kinds, synthetic_root
    from tessera.data.run_tokenizer import run_tokenizer

    path = cfg.data.path
    if path is None:
        root, kinds = synthetic_root(), synthetic_kinds(encoder_names(cfg.model))  # only the model's media
        if rank == 0:
            synthetic_dataset(root, kinds=kinds)
        dist.barrier()
        path = str(synthetic_dataset(root, kinds=kinds)[0])
    return path, run_tokenizer(cfg.data.tokenizer, cfg.model.checkpoint, path)


def resolve_inputs(cfg: RunConfig, rank: int) -> RunInputs:
    """Data set, tokenizer (refused when it disagrees with the checkpoint's ids or vocabulary) and the LLM's
    shape (from the checkpoint when fine-tuning)."""
    from tessera.data.run_tokenizer import check_agreement, run_chat_template
    from tessera.data.tokens import Tokenizer

    data_path, choice = _dataset(cfg, rank)
    tok = Tokenizer(choice.path)
    source = checkpoint_source(cfg.model.checkpoint)  # what model.checkpoint is, decided once for the run
    hf_fields = (source.llm_fields() if source is not None else None) or llm_fields(cfg.model, tok.vocab_size)
    check_agreement(tok, cfg.model.checkpoint, hf_fields["vocab_size"], choice.source)
    # the saved config names the tokenizer the run trained with, so its export ships that one (hf_export.py)
    return RunInputs(replace(cfg, data=replace(cfg.data, tokenizer=choice.path)), data_path, choice.path, hf_fields,
                     run_chat_template(cfg.data.chat_template, cfg.model.checkpoint), source)


def _initial_weights(cfg: RunConfig, source: CheckpointSource | None, specs: dict, modules: dict, groups: dict,
                     configs: dict, hf_fields: dict) -> None:
    """This rank's modules' first weights: a Tessera checkpoint's, a release's (each rank reads only the tensors
    of its shards), or the seed's (only the units this rank's shards read are built, one at a time)."""
    if source is not None and source.kind == RUN:
        load_checkpoint(source.step, modules, None, groups, configs)
        return
    if source is not None:  # an HF layout (the launch refused any other directory: recipes/prelaunch.py)
        from tessera.models.nemotron_h_hf import LazyCheckpoint

        full = LazyCheckpoint(source.given)
        check_checkpoint_tensors(source.given, full, cfg.model, hf_fields)
    else:
        full = SeededState(cfg.model, hf_fields, cfg.trainer.seed, specs=specs)
    load_full_state(modules, full, groups)


def _optimizers(cfg: RunConfig, resolved: ResolvedRun, specs: dict, modules: dict, groups: dict,
                dtype: torch.dtype) -> ModuleOptimizers:
    """Per-module optimizers; casts the modules to `dtype` (bf16 keeps fp32 master weights, taken before the
    cast, and fp32 grads)."""
    o, t, keys = cfg.optim, cfg.trainer, list(resolved.layout.modules)
    overlap = (overlapped_modules(keys, parse_recompute(cfg.model.recompute), LANGUAGE)
               if t.overlap_grad_reduce else ())
    return ModuleOptimizers(modules, groups, {k: specs[k].lr for k in keys}, o.clip_grad, o.weight_decay, o.betas,
                            o.eps, all_keys=keys, param_dtype=dtype, distributed=o.use_distributed_optimizer,
                            overlap_modules=overlap, bucket_elements=t.grad_bucket_elements,
                            backwards_per_step=resolved.microbatches)


def build_run(cfg: RunConfig, resolved: ResolvedRun, run_dir: Path, device: torch.device,
              step_flops=None) -> RunState:
    """This rank's run of `cfg` (resolved on this world as `resolved`): inputs, process groups, modules with their
    first weights (LoRA applied), optimizers and LR schedule, then the run directory's last complete checkpoint
    (model, optimizer, loader position) when trainer.resume. Collective: every rank calls it.
    `step_flops`: hf_fields -> the run's StepCosts, or None."""
    rank = dist.get_rank()
    inputs = resolve_inputs(cfg, rank)
    cfg, hf_fields = inputs.cfg, inputs.hf_fields
    specs, dtype = module_specs(cfg.model, cfg.optim), DTYPES[cfg.model.dtype]
    groups = build_module_groups(resolved.layout)
    configs = module_configs(resolved.layout, hf_fields, cfg.model.moe_aux_loss_coeff)
    modules = build_rank_modules(cfg.model, resolved.layout, groups, configs, specs)
    _initial_weights(cfg, inputs.source, specs, modules, groups, configs, hf_fields)
    # LoRA (model.lora.rank > 0): base weights frozen, adapters on the targeted layers; only they get
    # optimizer state and gradients, and checkpoints store them next to the (unchanged) base weights
    apply_lora(modules, groups, cfg.model, cfg.trainer.seed)
    lora = lora_settings(cfg.model)
    if lora is not None:  # (every rank: the count is collective; a rank may hold no adapter)
        trainable, total = parameter_counts(modules, groups, configs, device)
        if rank == 0:
            print(f"lora: rank {lora.rank} on {', '.join(lora.targets)}: {trainable:,} of {total:,} "
                  f"parameters train ({100 * trainable / total:.2f}%)", flush=True)
    for m in modules.values():
        m.to(device=device).train()
    opt = _optimizers(cfg, resolved, specs, modules, groups, dtype)
    o = cfg.optim
    schedule = LRSchedule(o.lr_schedule, cfg.trainer.max_steps, o.warmup_steps, o.min_lr_ratio, o.lr_wsd_decay_steps,
                          o.lr_wsd_decay_style)
    run = RunState(cfg, resolved, run_dir, rank, resolved.world, device, dtype, inputs.data_path, inputs.tok_path,
                   hf_fields, specs, groups, configs, modules, opt, schedule,
                   step_flops=step_flops(hf_fields) if step_flops is not None else None,
                   chat_template=inputs.chat_template)
    last = latest_checkpoint(run.ckpt_root) if cfg.trainer.resume else None
    if last is None:
        return run
    common = load_checkpoint(last, modules, opt, groups, configs)
    if rank == 0:
        print(f"resumed from {last} (step {common['step']}, saved in layout {common['layout']})", flush=True)
    return replace(run, start=common["step"], loader_state=decode_loader_state(common["loader"]),
                   saved_on=(common["world"], common["layout"]))
