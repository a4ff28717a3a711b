"""The planner applied to one training run's config: `layout=auto` and `nemo tessera plan`.

    layout = best_layout_for_run(run_cfg, world=64, cluster_name="h100")
    print(plan_table_for_run(run_cfg, gpus=64, cluster_name="h100"))

The workload comes from the run's data config (row length, rows per step; media per row from the
recipe family's planner defaults when it has them, else max_tiles + thumbnail tiles / video frames / 30 s
of audio). `auto` keeps only layouts this run can train: encoders without CP/PP (the real encoders run as
one stage) and every module's DP dividing the run's rows per microbatch.
"""

from __future__ import annotations

from tessera.hetero.plan.layout import HeteroLayout, LayoutError, ModelShapes
from tessera.hetero.planner.cluster import Workload, cluster
from tessera.recipes.full_size import RECIPES
from tessera.hetero.planner.model import describe_model
from tessera.hetero.planner.search import format_table, search


def workload_for_run(cfg) -> Workload:
    planned = RECIPES.get(cfg.name)
    media = dict(tiles=planned.workload.tiles, frames=planned.workload.frames,
                 audio_seconds=planned.workload.audio_seconds) if planned else dict(
        tiles=float(cfg.data.max_tiles + 1) if cfg.model.vision else 0.0,
        audio_seconds=30.0 if cfg.model.audio else 0.0)
    return Workload(seq_length=cfg.data.seq_length,
                    global_batch=cfg.data.rows_per_microbatch * cfg.data.microbatches, **media)


def _trainable(spec: str, cfg, world: int) -> bool:
    layout = HeteroLayout.parse(spec)
    if any(layout[k].cp > 1 or layout[k].pp > 1 for k in layout.encoders):
        return False
    try:
        layout.validate(ModelShapes(seq_length=cfg.data.seq_length,
                                    samples_per_microbatch=cfg.data.rows_per_microbatch), world_size=world)
    except LayoutError:
        return False
    return True


def ranked_for_run(cfg, gpus: int, cluster_name: str = "h100"):
    model = describe_model(cfg.model.llm, cfg.model.vision, cfg.model.audio, name=cfg.name)
    return [p for p in search(model, workload_for_run(cfg), cluster(cluster_name), gpus) if p.feasible]


def best_layout_for_run(cfg, world: int, cluster_name: str = "h100") -> str:
    for p in ranked_for_run(cfg, world, cluster_name):
        if _trainable(p.layout, cfg, world):
            return p.layout
    raise LayoutError(f"layout=auto: no layout of {cfg.model.llm} + encoders on {world} ranks is both feasible on "
                      f"{cluster_name} and trainable with rows_per_microbatch={cfg.data.rows_per_microbatch}; "
                      f"give layout=... explicitly or change data.rows_per_microbatch")


def plan_table_for_run(cfg, gpus: int, cluster_name: str = "h100", top: int = 10) -> str:
    preds = ranked_for_run(cfg, gpus, cluster_name)
    head = preds[:top]
    base = next((p for p in preds if p.placement == "homogeneous"), None)
    if base is not None and base not in head:
        head.append(base)
    return format_table(head)


__all__ = ["best_layout_for_run", "plan_table_for_run", "workload_for_run"]
