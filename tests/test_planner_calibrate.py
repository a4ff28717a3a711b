"""Calibration recovers the constants that generated synthetic step times, and reports rank quality."""

import pytest

from tessera.hetero.planner import Constants, Workload, cluster, describe_model, predict
from tessera.hetero.planner.calibrate import evaluate, fit

MODEL = describe_model("nemotron_nano_12b_v2", "radio_vit_h")
# short rows and many microbatches: TP/PP messages are small enough that per-message latency shows
WORK = Workload(seq_length=2048, global_batch=64, micro_batch=8, tiles=4)
LAYOUTS = [
    "vision=tp4,dp4@0-15;language=tp4,dp4@0-15", "vision=tp8,dp2@0-15;language=tp8,dp2@0-15",
    "vision=dp16@0-15;language=tp4,dp4@0-15", "vision=cp2,dp8@0-15;language=tp2,pp4,dp2@0-15",
    "vision=tp2,dp2@0-3;language=tp4,pp3@4-15", "vision=dp8@0-7;language=tp8@8-15",
    "vision=tp2,pp2,dp2@0-7;language=tp2,pp2,dp2@8-15", "vision=tp2,dp8@0-15;language=tp2,pp8@0-15",
    "vision=tp4,dp4@0-15;language=tp4,pp2,dp2@0-15", "vision=dp4@0-3;language=tp2,cp2,pp3@4-15",
]
TRUE = Constants(eff_llm=0.41, eff_vit=0.29, bw_eff=0.63, msg_overhead_s=27e-6)


def test_fit_recovers_the_generating_constants():
    cl = cluster("h100", 16)
    measured = [(lay, predict(lay, MODEL, WORK, cl, TRUE, recompute=()).step_s) for lay in LAYOUTS]
    assert all(t < float("inf") for _, t in measured)
    report = fit(measured, MODEL, WORK, cl)            # starts from the defaults (0.5, 0.4, 0.8, 10 us)
    for name in ("eff_llm", "eff_vit", "bw_eff", "msg_overhead_s"):
        assert getattr(report.constants, name) == pytest.approx(getattr(TRUE, name), rel=1e-3), name
    assert report.rel_rmse < 1e-6 and report.spearman == pytest.approx(1.0) and report.top1_gap == 0.0
    assert "spearman=1.000" in report.table()


def test_evaluate_reports_rank_quality_of_wrong_constants():
    cl = cluster("h100", 16)
    measured = [(lay, predict(lay, MODEL, WORK, cl, TRUE, recompute=()).step_s) for lay in LAYOUTS]
    off = evaluate(measured, MODEL, WORK, cl, Constants(eff_vit=0.9, bw_eff=0.2))
    assert off.rel_rmse > 0.05 and off.top1_gap >= 0.0 and -1.0 <= off.spearman <= 1.0
    with pytest.raises(ValueError, match="cannot fit 4 constants"):
        fit(measured[:2], MODEL, WORK, cl)
