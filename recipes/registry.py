"""Named recipes: small functions returning a `run.Config[RunConfig]`; variants call a base and mutate it.

    nemo tessera finetune --factory nemotron_vl_tiny run.executor=local --yes          # 4 CPU ranks, ~20 steps
    nemo tessera pretrain --factory "nemotron_vl_12b(gpus=16)" run.executor=slurm run.executor.account=ACC ...

    from tessera.recipes.registry import recipe
    cfg = recipe("nemotron_omni_tiny_pretrain")        # run.Config[RunConfig]; fiddle.build(cfg) -> RunConfig

Naming: `<family>_<size>_<stage>` with stage `pretrain` (projector alignment: encoders and LLM frozen, only
the projectors train, higher lr) or `finetune` (everything trains). The bare `<family>_<size>` is the finetune
stage in Python (`recipe("nemotron_vl_tiny")`); on the CLI it is the stage of the entry point you run, as in
NeMo (`nemo tessera pretrain --factory nemotron_vl_tiny` is the pretrain stage).

Families: vl (image tiles), video (frames + EVS-style token pruning), omni (image/video + audio). Sizes:
`tiny` (registry tiny LLM/encoders, 4 CPU ranks, synthetic data, a few minutes on a CPU box) and the full
models (`12b`: RADIO ViT-H + Nemotron Nano 12B v2; `30b_a3b`: RADIO ViT-H + Parakeet FastConformer +
Nemotron 3 Nano 30B-A3B), whose heterogeneous layout comes from the GPU count `gpus` (default: the count
recipes/full_size.py planned it for; multiples of it grow its DP; 8-64 otherwise from a fallback table).
"""

from __future__ import annotations

from typing import Callable

import nemo_run as run

from tessera.hetero.plan.layout import HeteroLayout, rows_multiple, scale_layout
from tessera.hetero.runspec.modules import ENCODER_KEYS
from tessera.recipes.full_size import RECIPES as PLANNED  # the planner's layout per full-size recipe
from tessera.hetero.runspec.config import DataConfig, LoraConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig

GPU_COUNTS = (8, 16, 32, 64)
GLOBAL_BATCH = 128  # sequences per optimizer step when the planner gives none

# Full-size layouts where the planner's choice (recipes/full_size.py, picked with its cost model at one
# GPU count) cannot be scaled to by whole DP factors, e.g. 8 GPUs under a 16-GPU default. At 8 GPUs the 12B
# families take the planner's best layout that trains and fits there (hetero/planner/run_layout.best_layout_for_run;
# tests/test_recipes.py checks it): VL the ViT split like a tp2,cp2 LLM, video the ViT at tp2 beside a tp4 LLM
# (EVS keeps vision at cp1). No layout of the 30B-A3B omni model fits 8 or 16 GPUs of 80 GB (its optimizer
# states); its entries there are the shape the planner would take (LLM tp2, 128 experts over ep, the
# FastConformer without TP), for larger GPUs or a frozen LLM.
_FALLBACK_LAYOUTS: dict[str, dict[int, str]] = {
    "nemotron_vl_12b": {8: "vision=tp2,cp2,dp2@0-7;language=tp2,cp2,dp2@0-7"},
    "nemotron_video_12b": {8: "vision=tp2,dp4@0-7;language=tp4,dp2@0-7"},
    "nemotron_omni_30b_a3b": {g: f"vision=tp2,dp{g // 2}@0-{g - 1};audio=dp{g}@0-{g - 1};"
                                 f"language=tp2,dp{g // 2},ep{min(g // 2, 16)}@0-{g - 1}" for g in (8, 16)},
}


def full_layout(recipe_name: str, gpus: int) -> str:
    """The default layout of a full-size recipe on `gpus` GPUs: the planner's, grown by DP when `gpus` is a
    multiple of its GPU count (hetero.plan.layout.scale_layout), else the fallback table's."""
    planned = PLANNED.get(recipe_name)
    if planned is not None and gpus % planned.gpus == 0:
        return str(scale_layout(planned.layout, gpus))
    table = _FALLBACK_LAYOUTS[recipe_name]
    if gpus not in table:
        known = sorted({*table, *([planned.gpus] if planned else [])})
        raise ValueError(f"no default layout for {recipe_name} on gpus={gpus}; use gpus in {known}"
                         + (f" or a multiple of {planned.gpus}" if planned else "")
                         + f", or pass layout=\"...\" (e.g. {table[min(table)]!r})")
    return table[gpus]


def default_gpus(recipe_name: str) -> int:
    return PLANNED[recipe_name].gpus if recipe_name in PLANNED else GPU_COUNTS[0]


# Tiny recipes run on 4 CPU ranks; each family shows a different placement.
TINY_WORLD = 4
_TINY_LAYOUTS = {
    "vl": "vision=dp4@0-3;language=tp2,dp2@0-3",                        # colocated, LLM TP
    "video": "vision=dp2@0-1;language=tp2@2-3",                         # non-colocated encoder / LLM
    "omni": "vision=dp4@0-3;audio=dp4@0-3;language=tp2,cp2@0-3",        # two encoders, LLM TP + CP
}


def rows_for(layout: str) -> int:
    """The smallest global rows per microbatch that every module's DP divides."""
    return rows_multiple(HeteroLayout.parse(layout))


def _run(name: str, model: run.Config, layout: str, data: run.Config, optim: run.Config,
         trainer: run.Config) -> run.Config[RunConfig]:
    return run.Config(RunConfig, name=name, layout=layout, model=model, data=data, optim=optim, trainer=trainer)


# ---- stages: mutate a base recipe in place and return it -------------------------------------------------

def finetune_stage(cfg: run.Config[RunConfig]) -> run.Config[RunConfig]:
    """Everything trains (the base recipes already are this stage); the name gets its suffix."""
    cfg.name = f"{cfg.name}_finetune"
    return cfg


def pretrain_stage(cfg: run.Config[RunConfig]) -> run.Config[RunConfig]:
    """Projector alignment (VLM stage 1): encoders and LLM frozen, only projectors learn, at 10x the lr."""
    cfg.name = f"{cfg.name}_pretrain"
    m = cfg.model
    for key in ENCODER_KEYS:
        setattr(m, f"freeze_{key}", getattr(m, key) is not None)
    m.freeze_llm = True
    cfg.optim.lr = cfg.optim.lr * 10
    return cfg


# ---- tiny bases: registry tiny modules, synthetic data (path=None), 4 CPU ranks -------------------------

def _tiny(family: str, vision: str | None, audio: str | None) -> run.Config[RunConfig]:
    return _run(
        f"nemotron_{family}_tiny",
        model=run.Config(ModelConfig, llm="nemotron_h_tiny_dense", vision=vision, audio=audio, dtype="float32",
                         lora=run.Config(LoraConfig)),  # a run.Config so `model.lora.rank=8` overrides it
        layout=_TINY_LAYOUTS[family],
        data=run.Config(DataConfig, path=None, seq_length=256, rows_per_microbatch=4, microbatches=2,
                        # validate on what the data holds out: a held-out synthetic set for the synthetic data,
                        # data.path's own val split (none without one: data/pipeline.val_sets)
                        max_tiles=2, video_frames=4, val_path="auto"),
        optim=run.Config(OptimConfig, lr=1e-3, warmup_steps=2, clip_grad=1.0),
        trainer=run.Config(TrainerConfig, max_steps=20, log_every=5, save_every=0, val_every=10),
    )


def nemotron_vl_tiny() -> run.Config[RunConfig]:
    """Tiny VL (RADIO tiny ViT + tiny dense Nemotron-H), colocated vision dp4 / LLM tp2,dp2 on 4 CPU ranks."""
    return _tiny("vl", vision="radio_vit_tiny", audio=None)


def nemotron_video_tiny() -> run.Config[RunConfig]:
    """Tiny video: frames through the ViT (one tile each), half the video tokens pruned (EVS); encoder on
    ranks 0-1, LLM on 2-3."""
    cfg = _tiny("video", vision="radio_vit_tiny", audio=None)
    cfg.model.video_pruning = 0.5
    cfg.data.video_frames = 4
    cfg.data.max_tiles = 1   # video rows: frames are the media, no image tiling budget needed
    return cfg


def nemotron_omni_tiny() -> run.Config[RunConfig]:
    """Tiny omni: RADIO tiny + FastConformer tiny + tiny LLM; both encoders dp4, LLM tp2,cp2 on 4 CPU ranks.
    Images at native resolution (the omni family's, data/pipeline.chat_task_encoder) in 16..48 patches of the
    tiny RADIO's 16 px (its 64-px tile's 16 patches .. max_tiles 2 + 1 tiles' worth): 4-12 tokens an image,
    what the tiles gave, so a synthetic sample stays well inside seq_length 256. The release's 1024..13312
    patches would give up to 3328 tokens an image."""
    cfg = _tiny("omni", vision="radio_vit_tiny", audio="fastconformer_tiny")
    # the planner prices the synthetic set's longest clip (data/prepare.synth_audio: 0.5-3 s), not its 30 s
    # default, whose 387 media tokens exceed seq_length 256 and leave layout=auto (and an elastic restart that
    # re-plans) no layout at all
    cfg.data.audio_seconds_per_row = 3.0
    return cfg


# ---- full sizes: released module sizes, bf16, layout from the GPU count ---------------------------------

def _full(name: str, gpus: int, llm: str, audio: str | None) -> run.Config[RunConfig]:
    layout = full_layout(name, gpus)
    planned = PLANNED.get(name)
    seq_length = planned.workload.seq_length if planned else 16384
    global_batch = planned.workload.global_batch if planned else GLOBAL_BATCH
    rows = rows_for(layout)
    return _run(
        name,
        # checkpoint=None starts from random weights; finetuning sets model.checkpoint=HF_DIR
        # full recompute and ZeRO-1: what the default layouts' memory (recipes/full_size.py) assumes
        model=run.Config(ModelConfig, llm=llm, vision="radio_vit_h", audio=audio, dtype="bfloat16",
                         recompute="full", lora=run.Config(LoraConfig)),
        layout=layout,
        # the global batch stays the planner's as GPUs grow: more DP means fewer microbatches per step
        data=run.Config(DataConfig, path=None, seq_length=seq_length, rows_per_microbatch=rows,
                        microbatches=max(1, global_batch // rows), num_workers=2, max_tiles=12, video_frames=8,
                        # what the planner prices (layout=auto, nemo tessera plan): the family's media per row
                        tiles_per_row=planned.workload.tiles if planned else None,
                        frames_per_row=planned.workload.frames if planned else None,
                        audio_seconds_per_row=planned.workload.audio_seconds if planned else None),
        optim=run.Config(OptimConfig, lr=1e-4, weight_decay=0.05, warmup_steps=200, clip_grad=1.0,
                         use_distributed_optimizer=True),
        # saves every 1,000 steps and every hour (a 4-hour Slurm allocation at ~30 s a step keeps 3-4 checkpoints,
        # plus the one on its limit's SIGTERM), asynchronously; the newest 3 and every 5,000th step stay on disk
        trainer=run.Config(TrainerConfig, max_steps=20000, log_every=10, save_every=1000, save_interval_minutes=60,
                           keep_last=3, keep_every=5000, async_save=True, timeout_s=1800, overlap_grad_reduce=True),
    )


def nemotron_vl_12b(gpus: int = default_gpus("nemotron_vl_12b")) -> run.Config[RunConfig]:
    """Nemotron Nano V2 VL 12B: RADIO ViT-H + Nemotron Nano 12B v2 on 16K rows; gpus 8, 16, 32, 64, ..."""
    return _full("nemotron_vl_12b", gpus, llm="nemotron_nano_12b_v2", audio=None)


def nemotron_video_12b(gpus: int = default_gpus("nemotron_video_12b")) -> run.Config[RunConfig]:
    """The 12B VL on video: 32 frames per clip, half the video tokens pruned (EVS-style)."""
    cfg = _full("nemotron_video_12b", gpus, llm="nemotron_nano_12b_v2", audio=None)
    planned = PLANNED.get("nemotron_video_12b")
    cfg.model.video_pruning = 0.5
    cfg.data.video_frames = int(planned.workload.frames) if planned and planned.workload.frames else 32
    cfg.data.max_tiles = 1   # video rows: frames are the media
    return cfg


def nemotron_omni_30b_a3b(gpus: int = default_gpus("nemotron_omni_30b_a3b")) -> run.Config[RunConfig]:
    """Nemotron 3 Nano Omni: RADIO ViT-H + Parakeet FastConformer 0.6B + Nemotron 3 Nano 30B-A3B (MoE).
    Images at native resolution: max_tiles 12 of 512 px / 16-px patches gives 1024..13312 patches an image, the
    released image processor's min_num_patches / max_num_patches (tests/test_native_resolution.py)."""
    return _full("nemotron_omni_30b_a3b", gpus, llm="nemotron_3_nano_30b_a3b", audio="fastconformer_parakeet_0_6b")


BASES: dict[str, Callable[..., run.Config[RunConfig]]] = {
    f.__name__: f for f in (nemotron_vl_tiny, nemotron_video_tiny, nemotron_omni_tiny,
                            nemotron_vl_12b, nemotron_video_12b, nemotron_omni_30b_a3b)
}
STAGES: dict[str, Callable[[run.Config[RunConfig]], run.Config[RunConfig]]] = {
    "pretrain": pretrain_stage, "finetune": finetune_stage,
}


def recipe_names() -> list[str]:
    """Every name `recipe()` accepts: each base (= its finetune stage) and `<base>_<stage>`."""
    return sorted([*BASES, *(f"{b}_{s}" for b in BASES for s in STAGES)])


def recipe(name: str, **kwargs) -> run.Config[RunConfig]:
    """The recipe `name` (see recipe_names()); kwargs go to the base (e.g. gpus=16 for full sizes)."""
    base, stage = name, "finetune"
    for s in STAGES:
        if name.endswith(f"_{s}") and name[: -len(s) - 1] in BASES:
            base, stage = name[: -len(s) - 1], s
    if base not in BASES:
        raise ValueError(f"unknown recipe {name!r}; recipes: {', '.join(recipe_names())}")
    return STAGES[stage](BASES[base](**kwargs))


def build_recipe_kwargs(name: str, overrides: list[str] = ()) -> dict:
    """train()'s keyword arguments for recipe `name` with dotted `key=value` overrides, built (no nemo-run
    launch): what `python -m tessera.recipes.train --recipe NAME trainer.max_steps=5` runs. A leading `gpus=N`
    goes to a full-size base; the rest are checked and parsed as on the CLI."""
    import fiddle as fdl

    from tessera.recipes.overrides import apply_overrides  # lazily: nemo-run's parser loads only when used

    kwargs = {}
    rest = []
    for o in overrides:
        if o.startswith("gpus="):
            kwargs["gpus"] = int(o.split("=", 1)[1])
        else:
            rest.append(o)
    built = fdl.build(apply_overrides(recipe(name, **kwargs), rest))
    return dict(model=built.model, data=built.data, optim=built.optim, trainer=built.trainer,
                layout=built.layout, name=built.name)
