"""At-scale dry run of a recipe's (or any) layout: every group, boundary plan and schedule at N ranks, and per-rank
memory per module counted on the real modules built on the meta device, next to the cost model's.

    .venv/bin/python -m tessera.scripts.dryrun --recipe nemotron_vl_12b --world 1024
    .venv/bin/python -m tessera.scripts.dryrun --recipe nemotron_omni_30b_a3b --stage pretrain   # frozen modules
    .venv/bin/python -m tessera.scripts.dryrun --recipe nemotron_omni_30b_a3b --checkpoint /tmp/omni_30b  # a release
    .venv/bin/python -m tessera.scripts.dryrun --layout "vision=tp2,dp4@0-7;language=tp4,dp2@0-7" \
        --llm nemotron_nano_12b_v2 --vision radio_vit_h --world 64

The checks are hetero/planner/dryrun.py's; this command takes a full-size recipe's default layout, model and
workload from recipes/full_size.py and its freeze flags from recipes/registry.py; --checkpoint DIR builds what DIR's
config.json describes instead, as the recipe's `model.checkpoint=DIR` does (a release as downloaded, or one
scripts/full_release.py writes offline without weights). Exit status 0 when every check
passes, 1 otherwise (a rank over the GPU's usable memory included).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tessera.hetero.plan.layout import LANGUAGE
from tessera.hetero.planner.cluster import Workload
from tessera.hetero.planner.dryrun import dry_run
from tessera.hetero.planner.model import describe_model
from tessera.recipes.full_size import RECIPES


def recipe_frozen(name: str, stage: str) -> tuple[str, ...]:
    """The module keys recipe `name` at `stage` freezes (recipes/registry.py)."""
    from tessera.recipes.registry import recipe  # lazily: nemo-run loads in seconds

    m = recipe(f"{name}_{stage}").model
    return tuple(k for k, flag in (("vision", "freeze_vision"), ("audio", "freeze_audio"), (LANGUAGE, "freeze_llm"))
                 if getattr(m, flag, False))


def recipe_recompute(name: str, stage: str) -> str:
    """The recipe's model.recompute (the full recipes': "full"), which the dry run prices."""
    from tessera.recipes.registry import recipe

    return recipe(f"{name}_{stage}").model.recompute


def checkpoint_model(r, checkpoint: str, frozen: tuple[str, ...]):
    """(cost model's ModelDesc, meta-device model config) of recipe defaults `r` with model.checkpoint=checkpoint:
    the checkpoint's LLM and encoders, as a run from it builds them (hetero/planner/run_layout.model_for_run)."""
    from tessera.hetero.planner.meta_memory import model_config
    from tessera.hetero.checkpoint.source import checkpoint_llm_fields
    from tessera.hetero.runspec.modules import encoder_names

    run_model = model_config({LANGUAGE: r.llm, "vision": r.vision, "audio": r.audio}, set(frozen),
                             checkpoint=str(Path(checkpoint).expanduser().resolve()))
    names = encoder_names(run_model)
    return describe_model(checkpoint_llm_fields(run_model.checkpoint), names.get("vision"), names.get("audio"),
                          name=Path(checkpoint).name), run_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", choices=sorted(RECIPES), help="a full-size recipe's default layout and model")
    ap.add_argument("--stage", default="finetune", choices=("finetune", "pretrain"),
                    help="the recipe's stage: its freeze flags (pretrain: encoders and LLM frozen)")
    ap.add_argument("--layout", help="a layout string (hetero/plan/layout.py grammar)")
    ap.add_argument("--world", type=int, help="scale the layout by data parallelism to this many ranks")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--llm")
    ap.add_argument("--vision")
    ap.add_argument("--audio")
    ap.add_argument("--freeze", default="", help="module keys frozen, e.g. vision,audio (overrides --stage)")
    ap.add_argument("--optimizer", choices=("zero1", "replicated"), default="zero1",
                    help="optimizer states sharded over DP x CP (ZeRO-1, the cost model's assumption) or not")
    ap.add_argument("--checkpoint", help="with --recipe: the model this released checkpoint's config.json "
                    "describes (the recipe's model.checkpoint=DIR)")
    ap.add_argument("--recompute", help="model.recompute to price (full, selective, none, or per module: "
                    "language=full,vision=none); default: the recipe's, else the planner's least that fits")
    ap.add_argument("--no-meta", action="store_true", help="skip the meta-device memory count")
    ap.add_argument("--cluster", default="h100")
    a = ap.parse_args(argv)
    frozen = tuple(k for k in a.freeze.split(",") if k)
    run_model, recompute = None, a.recompute
    if a.checkpoint and not a.recipe:
        ap.error("--checkpoint needs --recipe (the recipe whose model.checkpoint it is)")
    if a.recipe:
        r = RECIPES[a.recipe]
        spec, model, workload = a.layout or r.layout, r.model(), r.workload
        frozen = frozen or recipe_frozen(a.recipe, a.stage)
        recompute = recompute or recipe_recompute(a.recipe, a.stage)
        if a.checkpoint:
            model, run_model = checkpoint_model(r, a.checkpoint, frozen)
    elif a.layout:
        spec, workload = a.layout, Workload()
        model = describe_model(a.llm, a.vision, a.audio) if a.llm else None
    else:
        ap.error("give --recipe or --layout")
    report = dry_run(spec, a.world, a.microbatches, model, workload, a.cluster, meta=not a.no_meta,
                     frozen=frozen, zero1=a.optimizer == "zero1", run_model=run_model, recompute=recompute)
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
