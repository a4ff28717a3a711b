"""Rank layouts for a model on a GPU count by predicted throughput.

    .venv/bin/python -m tessera.hetero.planner --llm nemotron_nano_12b_v2 --vision radio_vit_h --gpus 64 --cluster h100

Prints the top layouts (tokens/s, TFLOPS/GPU, gain over the best homogeneous layout, step breakdown,
memory, micro batch, recompute) and, last, the best layout as a string for `layout=...`.
For a recipe (its modules and workload): `nemo tessera plan --factory NAME gpus=128`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tessera.hetero.planner.cluster import Workload, cluster
from tessera.hetero.planner.model import describe_model
from tessera.hetero.planner.search import format_table, plan_layouts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm")
    ap.add_argument("--vision")
    ap.add_argument("--audio")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--cluster", default="h100")
    ap.add_argument("--top", type=int, default=10)
    for f in dataclasses.fields(Workload):  # every workload field can be overridden, e.g. --seq-length 131072
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            ap.add_argument(flag, action="store_const", const=True, default=None)
        else:
            ap.add_argument(flag, type=type(f.default), default=None)
    a = ap.parse_args(argv)
    if a.llm:
        model, w = describe_model(a.llm, a.vision, a.audio), Workload(tiles=16 if a.vision else 0,
                                                                      audio_seconds=60 if a.audio else 0)
    else:
        ap.error("give --llm (and --vision/--audio); for a recipe: nemo tessera plan --factory NAME")
    w = dataclasses.replace(w, **{f.name: getattr(a, f.name) for f in dataclasses.fields(Workload)
                                  if getattr(a, f.name) is not None})
    preds = plan_layouts(model, w, cluster(a.cluster, a.gpus), a.gpus, top=a.top)
    print(f"{model.name} on {a.gpus} x {a.cluster}: {w}")
    print(format_table(preds))
    if not preds:
        print("no feasible layout")
        return 1
    print(f"best: {preds[0].layout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
