"""The modules of a run, one spec per module key, validated once: which registry entry, frozen or not, its lr.

    specs = module_specs(cfg.model, cfg.optim)   # {"vision": ModuleSpec(...), "audio": ..., "language": ...}

A run's config (recipes/config.py) names each encoder by module key: `model.<key>` (a registry name, or
None for no such encoder), `model.freeze_<key>`, `optim.lr_<key>` (None = `optim.lr`); the LLM is
`model.llm`, `model.freeze_llm`, `optim.lr`. Everything downstream (layout resolution, model building, the
optimizers, the data side's placeholder sizes) iterates these specs instead of naming vision and audio.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.hetero.plan.layout import LANGUAGE
from tessera.models import configs, encoders

ENCODER_KEYS = ("vision", "audio")  # encoder module keys a run config can set (each = a modality)


@dataclass(frozen=True)
class ModuleSpec:
    key: str              # layout module key
    name: str             # registry name (models/encoders.py, or models/configs.py for the LLM)
    freeze: bool          # parameters frozen (an encoder's projector still trains)
    lr: float | None      # learning rate (None when no optimizer config was given)
    tensor_parallel: bool  # whether the module has tensor-parallel layers


def _names(modality: str) -> str:
    return ", ".join(sorted(n for n, c in encoders.REGISTRY.items() if c["modality"] == modality))


def module_specs(model, optim=None) -> dict[str, ModuleSpec]:
    """Per module key (encoders in ENCODER_KEYS order, then the LLM) its spec; a ValueError naming the field
    and listing what exists for an unknown or wrong-modality name."""
    if model.llm not in configs.REGISTRY:
        raise ValueError(f"unknown LLM model.llm={model.llm!r}; registered LLMs (models/configs.py): "
                         f"{', '.join(sorted(configs.REGISTRY))}")
    base_lr = getattr(optim, "lr", None)
    specs = {}
    for key in ENCODER_KEYS:
        name = getattr(model, key, None)
        if name is None:
            continue
        if name not in encoders.REGISTRY:
            raise ValueError(f"unknown encoder model.{key}={name!r}; registered {key} encoders "
                             f"(models/encoders.py): {_names(key)}")
        if encoders.REGISTRY[name]["modality"] != key:
            raise ValueError(f"model.{key}={name!r} is an encoder of modality "
                             f"{encoders.REGISTRY[name]['modality']!r}; {key} encoders: {_names(key)}")
        lr = getattr(optim, f"lr_{key}", None) if optim is not None else None
        specs[key] = ModuleSpec(key, name, bool(getattr(model, f"freeze_{key}", False)),
                                lr if lr is not None else base_lr, encoders.has_tensor_parallel(name))
    specs[LANGUAGE] = ModuleSpec(LANGUAGE, model.llm, bool(getattr(model, "freeze_llm", False)), base_lr, True)
    return specs


def encoder_names(model) -> dict[str, str]:
    """module key -> encoder registry name, for the encoders this model has (validated)."""
    return {k: s.name for k, s in module_specs(model).items() if k != LANGUAGE}
