"""Layout planner: a cost model of heterogeneous layouts, a search over them, calibration, a dry run.

    .venv/bin/python -m tessera.hetero.planner --llm nemotron_nano_12b_v2 --vision radio_vit_h --gpus 64 --cluster h100
    .venv/bin/python -m tessera.scripts.dryrun --recipe nemotron_vl_12b --world 1024

model.py (what a model costs, from models/configs.py and models/encoders.py), cluster.py (machines,
workload, free constants), comm.py (alpha-beta communication, boundary rows), cost.py (predict one
layout), search.py (enumerate and rank), calibrate.py (fit the constants to measurements), dryrun.py (every group, boundary plan and schedule of a layout at N ranks, one process).
"""

from tessera.hetero.planner.cluster import PRESETS, Cluster, Constants, Workload, cluster
from tessera.hetero.planner.cost import Prediction, predict
from tessera.hetero.planner.model import ModelDesc, describe_model
from tessera.hetero.planner.search import best_layout, format_table, plan_layouts, search

__all__ = ["PRESETS", "Cluster", "Constants", "ModelDesc", "Prediction", "Workload", "best_layout", "cluster",
           "describe_model", "format_table", "plan_layouts", "predict", "search"]
