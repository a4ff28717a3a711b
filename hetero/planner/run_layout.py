"""A run's layout, resolved once: config + world size -> a validated, trainable HeteroLayout.

    layout = resolve_run_layout(run_cfg, world=4)               # the CLI before launch, the trainer on its ranks
    print(plan_table_for_run(run_cfg, gpus=64, cluster_name="h100"))   # `nemo tessera plan`

`resolve_run_layout` is the only place a run's `layout` string becomes a HeteroLayout. It handles
  ""      every module data-parallel on all `world` ranks (the homogeneous baseline);
  "auto"  the planner's best layout on `world` ranks among those the trainer can run;
  a spec  parsed; when `world` is a whole multiple of its ranks, grown by data parallelism to `world`;
then checks the module keys against the model; when the layout's DP sizes do not divide
data.rows_per_microbatch, sets data.rows_per_microbatch / data.microbatches to a split of the same rows per step
that they do divide (hetero/plan/layout.rows_for_layout: a recipe sized for 16 GPUs runs on 64 with 4x the rows
per microbatch and 1/4 the microbatches); validates sizes against the model's heads, the row length and the
rows per microbatch, and applies the one trainability rule (hetero/plan/trainable.py). Every error is a
LayoutError naming the module, the field and the fix, raised before any process group exists.

The workload the planner prices comes from the run's `data` config: row length, rows per step, and media per
row (`data.tiles_per_row` ..., set by the full-size recipes; else max_tiles + thumbnail tiles, video frames,
30 s of audio), never from the run's name.
"""

from __future__ import annotations

import dataclasses

from tessera.hetero.plan.layout import (LANGUAGE, HeteroLayout, LayoutError, ModelShapes, ModuleLayout, rows_for_layout,
                                        scale_layout)
from tessera.hetero.plan.trainable import check_trainable, untrainable_reasons
from tessera.hetero.planner.cluster import Workload, cluster
from tessera.hetero.planner.model import describe_model
from tessera.hetero.planner.search import format_table, price_layout, search
from tessera.hetero.training.run_modules import checkpoint_llm_fields, encoder_names, module_specs
from tessera.models import configs, encoders


def module_keys(model) -> list[str]:
    """The layout's module keys this model needs: its encoders, then the LLM."""
    return list(module_specs(model))


def encoder_has_tp(model) -> dict[str, bool]:
    return {k: s.tensor_parallel for k, s in module_specs(model).items() if k != LANGUAGE}


def video_pruned(model) -> bool:
    """Whether the run prunes video tokens (EVS; hetero/plan/trainable.untrainable_reasons)."""
    return (getattr(model, "video_pruning", 0.0) or 0.0) > 0


def model_shapes(cfg, llm_fields: dict | None = None) -> ModelShapes:
    """Heads per module (from the registries, or the checkpoint's LLM fields), row length, rows per microbatch."""
    llm = llm_fields or checkpoint_llm_fields(getattr(cfg.model, "checkpoint", None)) or configs.REGISTRY[cfg.model.llm]
    cfgs = {k: encoders.encoder_config(n) for k, n in encoder_names(cfg.model).items()}
    heads = {k: c["heads"] for k, c in cfgs.items() if "heads" in c}
    heads[LANGUAGE] = llm["num_attention_heads"]
    return ModelShapes(heads=heads, kv_heads={LANGUAGE: llm["num_key_value_heads"]},
                       seq_length=cfg.data.seq_length, samples_per_microbatch=cfg.data.rows_per_microbatch,
                       moe="E" in llm.get("hybrid_override_pattern", ""))


def resolve_run_layout(cfg, world: int, llm_fields: dict | None = None, cluster_name: str | None = None) -> HeteroLayout:
    """The run's validated, trainable layout on `world` ranks (see the module docstring)."""
    keys = module_keys(cfg.model)
    spec = (cfg.layout or "").strip()
    if not spec:
        spec = ";".join(f"{k}=dp{world}@0-{world - 1}" for k in keys)
    elif spec == "auto":
        spec = best_layout_for_run(cfg, world, cluster_name or "h100", llm_fields)
    layout = HeteroLayout.parse(spec)
    if layout.world_size != world and world % layout.world_size == 0:
        layout = scale_layout(layout, world)
    layout = fit_modules(layout, keys)
    # every module's DP takes whole rows of each microbatch: the step's rows are kept, their split may change
    cfg.data.rows_per_microbatch, cfg.data.microbatches = rows_for_layout(layout, cfg.data.rows_per_microbatch,
                                                                          cfg.data.microbatches)
    layout.validate(model_shapes(cfg, llm_fields), world_size=world)
    return check_trainable(layout, encoder_has_tp(cfg.model), video_pruned(cfg.model))


def fit_modules(layout: HeteroLayout, keys: list[str]) -> HeteroLayout:
    """The layout with exactly the model's module keys. An encoder the recipe's layout does not name (one added
    with `model.audio=...`) goes data-parallel on the ranks of the layout's first encoder (else the LLM's); a
    module the model does not have is dropped when another module shares its ranks (else its ranks would idle:
    an error naming the fix)."""
    modules = dict(layout.modules)
    for key in list(modules):
        if key not in keys:
            m = modules.pop(key)
            if not any(o.ranks == m.ranks for o in modules.values()):
                raise LayoutError(f"layout {layout}: the model has no {key!r} module, and ranks {m.first}-{m.last} "
                                  f"hold nothing else; give a layout for modules {keys} (or set model.{key})")
    if LANGUAGE not in modules:
        raise LayoutError(f"layout {layout} has no '{LANGUAGE}' module: add '{LANGUAGE}=FIELDS@FIRST-LAST'")
    for key in keys:
        if key not in modules:
            host = next((modules[k] for k in modules if k != LANGUAGE), modules[LANGUAGE])
            modules[key] = ModuleLayout(first=host.first, last=host.last)
    return HeteroLayout({k: modules[k] for k in keys})


def workload_for_run(cfg) -> Workload:
    """What one optimizer step of this run processes, as the cost model prices it."""
    d, m = cfg.data, cfg.model
    media = dict(tiles=float(d.max_tiles + 1) if m.vision else 0.0, audio_seconds=30.0 if m.audio else 0.0,
                 frames=float(d.video_frames) if m.vision and m.video_pruning else 0.0)
    for f, field in (("tiles", "tiles_per_row"), ("frames", "frames_per_row"), ("audio_seconds", "audio_seconds_per_row")):
        value = getattr(d, field, None)
        if value is not None:
            media[f] = float(value)
    return Workload(seq_length=d.seq_length, global_batch=d.rows_per_microbatch * d.microbatches, **media)


def ranked_for_run(cfg, gpus: int, cluster_name: str = "h100"):
    """Feasible layouts for this run on `gpus` GPUs, best predicted throughput first."""
    return [p for p in search(model_for_run(cfg), workload_for_run(cfg), cluster(cluster_name), gpus) if p.feasible]


def price_run(cfg, spec: str, cluster_name: str = "h100"):
    """The cost model's Prediction for this run in layout `spec` (step time, memory, state per rank range)."""
    return price_layout(HeteroLayout.parse(spec), model_for_run(cfg), workload_for_run(cfg), cluster(cluster_name))


def model_for_run(cfg):
    """The cost model's description of this run's model: a released checkpoint's own encoders and LLM when
    fine-tuning one, else the recipe's registry names."""
    names = encoder_names(cfg.model)
    llm = checkpoint_llm_fields(getattr(cfg.model, "checkpoint", None)) or cfg.model.llm
    return describe_model(llm, names.get("vision"), names.get("audio"), name=cfg.name)


def _problems(spec: str, cfg, world: int, llm_fields: dict | None) -> list[str]:
    """Why this run cannot train `spec` on `world` ranks (empty when it can)."""
    layout = HeteroLayout.parse(spec)
    try:
        rows, _ = rows_for_layout(layout, cfg.data.rows_per_microbatch, cfg.data.microbatches)
        shapes = dataclasses.replace(model_shapes(cfg, llm_fields), samples_per_microbatch=rows)
        layout.validate(shapes, world_size=world)
    except LayoutError as e:
        return [str(e)]
    return untrainable_reasons(layout, encoder_has_tp(cfg.model), video_pruned(cfg.model))


def best_layout_for_run(cfg, world: int, cluster_name: str = "h100", llm_fields: dict | None = None) -> str:
    """layout=auto: the planner's best layout on `world` ranks that this run can train."""
    for p in ranked_for_run(cfg, world, cluster_name):
        if not p.baseline and not _problems(p.layout, cfg, world, llm_fields):
            return p.layout
    raise LayoutError(f"layout=auto: no layout of {cfg.model.llm} + encoders on {world} ranks is both feasible on "
                      f"{cluster_name} and trainable with {cfg.data.rows_per_microbatch * cfg.data.microbatches} rows "
                      f"per step; give layout=... explicitly or change data.rows_per_microbatch / data.microbatches")


def plan_table_for_run(cfg, gpus: int, cluster_name: str = "h100", top: int = 10) -> str:
    """The top layouts with the best homogeneous one (Megatron's baseline); layouts the trainer cannot run are
    marked and never first."""
    preds = ranked_for_run(cfg, gpus, cluster_name)
    problems = {p.layout: _problems(p.layout, cfg, gpus, None) for p in preds}
    ok = [p for p in preds if not problems[p.layout]]
    head = [p for p in ok if not p.baseline][:top]
    base = next((p for p in ok if p.placement == "homogeneous"), None)
    if base is not None and base not in head:
        head.append(base)
    table = format_table(head)
    skipped = [p for p in preds[:top] if problems[p.layout] and not p.baseline]
    if skipped:
        table += "\nranked higher by the cost model but not trainable by this run:\n" + "\n".join(
            f"  {p.layout}: {'; '.join(problems[p.layout])}" for p in skipped)
    return table


__all__ = ["best_layout_for_run", "model_shapes", "module_keys", "plan_table_for_run", "resolve_run_layout",
           "workload_for_run"]
