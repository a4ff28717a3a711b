"""The modules of a run, one spec per module key, validated once: which registry entry, frozen or not, its lr.

    specs = module_specs(cfg.model, cfg.optim)   # {"vision": ModuleSpec(...), "audio": ..., "language": ...}

A run's config (hetero/runspec/config.py) names each encoder by module key: `model.<key>` (a registry name, or
None for no such encoder), `model.freeze_<key>`, `optim.lr_<key>` (None = `optim.lr`); the LLM is
`model.llm`, `model.freeze_llm`, `optim.lr`. Fine-tuning a released checkpoint (`model.checkpoint=DIR` with
DIR/config.json) takes the encoders DIR describes instead (released_encoders). Everything downstream (layout resolution, model building, the
optimizers, the data side's placeholder sizes) iterates these specs instead of naming vision and audio.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.hetero.plan.layout import AUDIO, ENCODER_KEYS, LANGUAGE, VISION
from tessera.hetero.plan.resolved_run import ResolvedRun, RunModel, resolve_run
from tessera.hetero.checkpoint.source import checkpoint_llm_fields, checkpoint_source
from tessera.models import configs, encoders, released


@dataclass(frozen=True)
class ModuleSpec:
    key: str              # layout module key
    name: str             # registry name (models/encoders.py, or models/configs.py for the LLM)
    freeze: bool          # parameters frozen (an encoder's projector still trains)
    lr: float | None      # learning rate (None when no optimizer config was given)
    tensor_parallel: bool  # whether the module has tensor-parallel layers


def _names(modality: str) -> str:
    return ", ".join(encoders.names(modality))


def module_specs(model, optim=None) -> dict[str, ModuleSpec]:
    """Per module key (encoders in ENCODER_KEYS order, then the LLM) its spec; a ValueError naming the field
    and listing what exists for an unknown or wrong-modality name."""
    if model.llm not in configs.REGISTRY:
        raise ValueError(f"unknown LLM model.llm={model.llm!r}; registered LLMs (models/configs.py): "
                         f"{', '.join(sorted(configs.REGISTRY))}")
    base_lr = getattr(optim, "lr", None)
    released = released_encoders(model)
    specs = {}
    for key in ENCODER_KEYS:
        name = released.get(key) if released is not None else getattr(model, key, None)
        if name is None:
            continue
        if not encoders.is_known(name):
            raise ValueError(f"unknown encoder model.{key}={name!r}; registered {key} encoders "
                             f"(models/encoders.py): {_names(key)}")
        modality = encoders.encoder_config(name).modality
        if modality != key:
            raise ValueError(f"model.{key}={name!r} is an encoder of modality {modality!r}; {key} encoders: "
                             f"{_names(key)}")
        lr = getattr(optim, f"lr_{key}", None) if optim is not None else None
        specs[key] = ModuleSpec(key, name, bool(getattr(model, f"freeze_{key}", False)),
                                lr if lr is not None else base_lr, encoders.has_tensor_parallel(name))
    specs[LANGUAGE] = ModuleSpec(LANGUAGE, model.llm, bool(getattr(model, "freeze_llm", False)), base_lr, True)
    return specs


def released_encoders(model) -> dict[str, str] | None:
    """For `model.checkpoint` = a released-architecture HF directory (config.json, no tessera.json): module key
    -> `hf:<dir>#<key>` for each encoder its config.json describes; those replace model.vision / model.audio
    (the checkpoint defines the model). None for from-scratch runs and Tessera's own checkpoints/exports."""
    source = checkpoint_source(getattr(model, "checkpoint", None))
    if source is None or not source.is_release:
        return None
    return {m: released.encoder_name(source.given, m) for m in released.modalities_of(source.release_config())}


def run_model(model, llm_fields: dict | None = None) -> RunModel:
    """What layout resolution needs to know about `model` (a ModelConfig): its module keys, heads per module
    (from the registries, or the checkpoint's LLM fields), which encoders have TP, EVS, MoE."""
    specs = module_specs(model)
    llm = llm_fields or checkpoint_llm_fields(getattr(model, "checkpoint", None)) or configs.REGISTRY[model.llm]
    cfgs = {k: encoders.encoder_config(s.name) for k, s in specs.items() if k != LANGUAGE}
    heads = {k: c.heads for k, c in cfgs.items() if hasattr(c, "heads")}
    heads[LANGUAGE] = llm["num_attention_heads"]
    return RunModel(keys=tuple(specs), heads=heads, kv_heads={LANGUAGE: llm["num_key_value_heads"]},
                    encoder_tp={k: s.tensor_parallel for k, s in specs.items() if k != LANGUAGE},
                    video_pruned=(getattr(model, "video_pruning", 0.0) or 0.0) > 0,
                    moe="E" in llm.get("hybrid_override_pattern", ""),
                    mamba_heads=llm["mamba_num_heads"], mamba_groups=llm["n_groups"])


def resolve_config(cfg, world: int, llm_fields: dict | None = None, propose=None,
                   layout: str | None = None, elastic: bool = False, fits=None) -> ResolvedRun:
    """`cfg` (a RunConfig) resolved on `world` ranks: hetero/plan/resolved_run.resolve_run on its layout (or
    `layout`), model and data. `propose`: the planner's layouts for layout=auto and elastic restarts, `fits` its
    memory check (tessera.recipes.checks.resolve passes them)."""
    spec = cfg.layout if layout is None else layout
    return resolve_run(spec, world, run_model(cfg.model, llm_fields), cfg.data.seq_length,
                       cfg.data.rows_per_microbatch, cfg.data.microbatches, propose, elastic, fits)


def encoder_names(model) -> dict[str, str]:
    """module key -> encoder registry name, for the encoders this model has (validated)."""
    return {k: s.name for k, s in module_specs(model).items() if k != LANGUAGE}


def release_config(model_cfg, hf_fields: dict, shapes: dict) -> tuple[dict | None, str]:
    """(NemotronH_Omni_Reasoning_V3_Config kwargs, "") of a model built from registry names whose exported tensors
    have `shapes`, or (None, why that architecture does not compute it alike): models/release_config.py."""
    from tessera.models.release_config import omni_config

    names = encoder_names(model_cfg)
    cfgs = {k: encoders.encoder_config(names[k]) if k in names else None for k in ENCODER_KEYS}
    return omni_config(cfgs[VISION], cfgs[AUDIO], hf_fields, shapes, getattr(model_cfg, "video_pruning", 0.0) or 0.0)
