"""The planner's side of a run: what it costs and which layouts it proposes, from the run's config.

    print(plan_table_for_run(run_cfg, gpus=64, cluster_name="h100"))   # `nemo tessera plan`
    proposals = layout_proposals(run_cfg, world=64)                     # layout=auto, in the planner's order

The planner only proposes: a run is resolved (its layout, batch split, every check) by one function,
hetero/plan/resolved_run.resolve_run (through hetero/runspec/modules.resolve_config), which takes the first
proposal this run can train. The workload the planner prices comes from the run's `data` config: row length,
rows per step, and media per row (`data.tiles_per_row` ..., set by the full-size recipes; else max_tiles +
thumbnail tiles, video frames, 30 s of audio), never from the run's name.
"""

from __future__ import annotations

from tessera.hetero.plan.layout import HeteroLayout, LayoutError
from tessera.hetero.plan.trainable import UntrainableLayout
from tessera.hetero.planner.cluster import Workload, cluster
from tessera.hetero.planner.model import describe_model
from tessera.hetero.planner.search import format_table, price_layout, search
from tessera.hetero.planner.straggler import MIXED_SPREAD
from tessera.hetero.checkpoint.source import checkpoint_llm_fields
from tessera.hetero.runspec.modules import encoder_names, resolve_config


def workload_for_run(cfg) -> Workload:
    """What one optimizer step of this run processes, as the cost model prices it."""
    d, m = cfg.data, cfg.model
    media = dict(tiles=float(d.max_tiles + 1) if m.vision else 0.0, audio_seconds=30.0 if m.audio else 0.0,
                 frames=float(d.video_frames) if m.vision and m.video_pruning else 0.0)
    for f, field in (("tiles", "tiles_per_row"), ("frames", "frames_per_row"), ("audio_seconds", "audio_seconds_per_row")):
        value = getattr(d, field, None)
        if value is not None:
            media[f] = float(value)
    # the media mix's spread is not known before the data is read: priced as the bench's mixed set (straggler.py)
    return Workload(seq_length=d.seq_length, global_batch=d.rows_per_microbatch * d.microbatches,
                    rows_per_microbatch=d.rows_per_microbatch, vision_spread=MIXED_SPREAD["vision"],
                    audio_spread=MIXED_SPREAD["audio"], balance_encoders=getattr(d, "balance_encoders", True),
                    **media)


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


def layout_proposals(cfg, world: int, cluster_name: str = "h100"):
    """layout=auto: a callable yielding the planner's feasible, non-baseline layouts on `world` ranks, best
    predicted throughput first (searched only when called: an explicit layout never pays for the search)."""
    return lambda: (p.layout for p in ranked_for_run(cfg, world, cluster_name) if not p.baseline)


def _problems(spec: str, cfg, world: int) -> list[str]:
    """Why this run cannot train `spec` on `world` ranks (empty when it can)."""
    try:
        resolve_config(cfg, world, layout=spec)
    except UntrainableLayout as e:
        return e.reasons
    except LayoutError as e:
        return [str(e)]
    return []


def best_layout_for_run(cfg, world: int, cluster_name: str = "h100", llm_fields: dict | None = None) -> str:
    """layout=auto: the planner's best layout on `world` ranks that this run can train."""
    return str(resolve_config(cfg, world, llm_fields, layout_proposals(cfg, world, cluster_name), "auto").layout)


def plan_table_for_run(cfg, gpus: int, cluster_name: str = "h100", top: int = 10) -> str:
    """The top layouts with the best homogeneous one (Megatron's baseline); layouts the trainer cannot run are
    marked and never first."""
    preds = ranked_for_run(cfg, gpus, cluster_name)
    problems = {p.layout: _problems(p.layout, cfg, gpus) for p in preds}
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


__all__ = ["best_layout_for_run", "layout_proposals", "plan_table_for_run", "price_run", "workload_for_run"]
