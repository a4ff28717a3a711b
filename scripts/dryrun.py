"""At-scale dry run of a recipe's (or any) layout: every group, boundary plan and schedule at N ranks, one process.

    .venv/bin/python -m tessera.scripts.dryrun --recipe nemotron_vl_12b --world 1024
    .venv/bin/python -m tessera.scripts.dryrun --layout "vision=tp2,dp4@0-7;language=tp4,dp2@0-7" \
        --llm nemotron_nano_12b_v2 --vision radio_vit_h --world 64

The checks are hetero/planner/dryrun.py's; this command takes a full-size recipe's default layout, model and
workload from recipes/full_size.py. Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

from tessera.hetero.planner.cluster import Workload
from tessera.hetero.planner.dryrun import dry_run
from tessera.hetero.planner.model import describe_model
from tessera.recipes.full_size import RECIPES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", choices=sorted(RECIPES), help="a full-size recipe's default layout and model")
    ap.add_argument("--layout", help="a layout string (hetero/plan/layout.py grammar)")
    ap.add_argument("--world", type=int, help="scale the layout by data parallelism to this many ranks")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--llm")
    ap.add_argument("--vision")
    ap.add_argument("--audio")
    ap.add_argument("--cluster", default="h100")
    a = ap.parse_args(argv)
    if a.recipe:
        r = RECIPES[a.recipe]
        spec, model, workload = a.layout or r.layout, r.model(), r.workload
    elif a.layout:
        spec, workload = a.layout, Workload()
        model = describe_model(a.llm, a.vision, a.audio) if a.llm else None
    else:
        ap.error("give --recipe or --layout")
    report = dry_run(spec, a.world, a.microbatches, model, workload, a.cluster)
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
