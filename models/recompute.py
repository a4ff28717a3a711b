"""Activation recompute (`model.recompute`, parsed by hetero/plan/recompute.py) for our own layer loops.

Builders take one mode per module as plain data ("none" | "selective" | "full"); what it recomputes:

  full       every layer's forward runs again in backward; only each layer's input is kept. megatron's
             recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1 on the module's
             TransformerConfig, carried out by run_layers() in HybridLM's and the ViT's layer loops (they are not
             a megatron TransformerBlock) with megatron's tensor_parallel.checkpoint, which restores the CPU, CUDA
             and RNG-tracker states, so dropout masks repeat exactly. Audio: each conformer layer.
  selective  the memory-heavy, cheap-to-recompute part of a layer:
             attention layers (LLM and ViT): core attention, by megatron itself (recompute_granularity=
                 "selective", recompute_modules=["core_attn"]: SelfAttention checkpoints its core_attention,
                 whichever class is plugged in: SDPA, zigzag CP, TE);
             Mamba-2 layers: the SSD scan (its intra-chunk decay/score tensors are Mamba's attention matrix),
                 by Mamba2Mixer when its kernel keeps those intermediates (not mamba_ssm's fused scan, which
                 saves little more than its inputs);
             MLP and MoE layers: nothing (megatron's default selective set; their activations are per token);
             audio conformer layers: the self-attention block (NeMo/HF have no separate core attention).
Recompute happens only in training mode with grad enabled; eval and no_grad forwards are untouched.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core import tensor_parallel
from torch import nn

from tessera.hetero.plan.recompute import RECOMPUTE_MODES

_FIELDS = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
}


def megatron_fields(mode: str) -> dict:
    """The TransformerConfig fields of one module's recompute mode."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r}: one of {', '.join(RECOMPUTE_MODES)}")
    return {k: list(v) if isinstance(v, list) else v for k, v in _FIELDS[mode].items()}  # configs may append


def with_recompute(config, mode: str):
    """`config` (a megatron TransformerConfig) with `mode`'s fields; "none" keeps the config (and whatever
    recompute fields it was given)."""
    fields = megatron_fields(mode)
    return dataclasses.replace(config, **fields) if fields else config


def checkpoint(fn, *args, module: nn.Module):
    """fn(*args) recomputed in backward (megatron's tensor_parallel.checkpoint: reentrant, RNG states restored).
    args: tensors or None only (saved for backward); everything else must be bound into fn. `module`: what fn
    runs (its parameters and BatchNorm statistics)."""
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        # A reentrant checkpoint's output needs grad only if an input does: trainable weights behind an input
        # that needs none (frozen embedding + LoRA, first layer) would get no gradient. The input has no graph
        # behind it, so a detached copy that requires grad loses nothing; no trainable weight: nothing to recompute.
        i = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        if i is None or not any(p.requires_grad for p in module.parameters()):
            return fn(*args)
        args = (*args[:i], args[i].detach().requires_grad_(), *args[i + 1:])
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
             and m.track_running_stats]
    return tensor_parallel.checkpoint(functools.partial(_once, fn, norms) if norms else fn, False, *args)


def _once(fn, norms, *args):
    """fn with BatchNorm running statistics updated by the first forward only: the recompute (the call that runs
    with grad enabled) normalises with the same batch statistics but must not count the batch twice, so it
    updates throwaway copies (writing the originals back in place would break the version check of the tensors
    batch_norm saved for backward)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    kept = [(m, name, getattr(m, name)) for m in norms
            for name in ("running_mean", "running_var", "num_batches_tracked") if getattr(m, name) is not None]
    for m, name, buf in kept:
        setattr(m, name, buf.clone())
    try:
        return fn(*args)
    finally:
        for m, name, buf in kept:
            setattr(m, name, buf)


def run_layers(layers, hidden: torch.Tensor, config, training: bool, **kwargs) -> torch.Tensor:
    """hidden through megatron layers (each `layer(hidden, **kwargs) -> (hidden, context)`), with megatron's
    full recompute when config.recompute_granularity == "full" (TransformerBlock._checkpointed_forward's rule:
    "uniform" recomputes chunks of recompute_num_layers layers, "block" the first recompute_num_layers)."""
    def run(start: int, stop: int):
        def forward(h):
            for layer in layers[start:stop]:
                h, _ = layer(h, **kwargs)
            return h
        return forward

    count = len(layers)
    if not (config.recompute_granularity == "full" and training and torch.is_grad_enabled()):
        return run(0, count)(hidden)
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        chunks = [(i, min(i + n, count), True) for i in range(0, count, n)]
    else:  # "block"
        chunks = [(i, i + 1, i < n) for i in range(count)]
    for start, stop, recompute in chunks:
        part = run(start, stop)
        hidden = checkpoint(part, hidden, module=nn.ModuleList(layers[start:stop])) if recompute else part(hidden)
    return hidden


class _Recomputed:
    """Mixin: the module's forward is recomputed in backward when training with grad enabled. Tensor arguments
    go through the checkpoint (their gradients flow), the others are bound."""

    def forward(self, *args, **kwargs):
        inner = super().forward
        if not (self.training and torch.is_grad_enabled()):
            return inner(*args, **kwargs)
        names = list(kwargs)
        values = [*args, *kwargs.values()]
        where = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]

        def fn(*tensors):
            full = list(values)
            for i, t in zip(where, tensors):
                full[i] = t
            return inner(*full[: len(args)], **dict(zip(names, full[len(args):])))

        return checkpoint(fn, *(values[i] for i in where), module=self)


@functools.cache
def _recomputed_class(cls: type) -> type:
    return type(f"Recomputed{cls.__name__}", (_Recomputed, cls), {"__module__": cls.__module__})


def recompute_module(module: nn.Module) -> nn.Module:
    """Recompute `module`'s forward in backward, for layers whose loop is someone else's (NeMo, transformers).
    The class is swapped for a subclass in place, so parameter names (checkpoints, HF import/export) and
    isinstance checks stay as they were."""
    if not isinstance(module, _Recomputed):
        module.__class__ = _recomputed_class(type(module))
    return module
