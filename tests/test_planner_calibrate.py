"""Calibration: rank quality and error of known tables computed by hand, and a fit that recovers the constants
that generated the step times (exactly without noise, closely with known noise).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_planner_calibrate.py -q
"""

import math

import numpy as np
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
    "vision=tp4,dp4@0-15;language=tp4,pp2,dp2@0-15", "vision=dp4@0-3;language=tp2,pp6@4-15",
]
TRUE = Constants(eff_llm=0.41, eff_vit=0.29, bw_eff=0.63, msg_overhead_s=27e-6)
# Five layouts whose predicted step times under TRUE increase strictly (about 1.98, 2.13, 2.69, 2.91, 4.39 s).
FIVE = [LAYOUTS[2], LAYOUTS[0], LAYOUTS[8], LAYOUTS[1], LAYOUTS[5]]


@pytest.fixture(scope="module")
def cl():
    return cluster("h100", 16)


def _predicted(layouts, cl, k=TRUE):
    return np.array([predict(lay, MODEL, WORK, cl, k, recompute=()).step_s for lay in layouts])


def test_rank_quality_of_a_known_wrong_ranking(cl):
    p = _predicted(FIVE, cl)
    assert list(np.argsort(p)) == [0, 1, 2, 3, 4], p  # the table below relies on this predicted order
    # Measured: the predicted-best layout is really 2nd (1.25 s vs the best 1.0 s), 4th and 5th swapped.
    measured = [1.25, 1.0, 1.5, 3.0, 2.0]
    r = evaluate(list(zip(FIVE, measured)), MODEL, WORK, cl, TRUE)
    # ranks 1..5 vs 2,1,3,5,4: sum d^2 = 4, rho = 1 - 6 * 4 / (5 * (25 - 1)) = 0.8
    assert r.spearman == pytest.approx(0.8, abs=1e-12)
    assert r.top1_gap == pytest.approx(0.25, abs=1e-12)  # 1.25 / 1.0 - 1
    np.testing.assert_allclose(r.predicted, p, rtol=1e-12)
    # fully reversed: rho = -1; the predicted best is measured slowest: 5.0 / 1.0 - 1 = 4
    r = evaluate(list(zip(FIVE, [5.0, 4.0, 3.0, 2.0, 1.0])), MODEL, WORK, cl, TRUE)
    assert r.spearman == pytest.approx(-1.0, abs=1e-12) and r.top1_gap == pytest.approx(4.0, abs=1e-12)
    # same order, any scale: rho = 1, gap 0
    r = evaluate(list(zip(FIVE, [1.0, 1.1, 7.0, 7.5, 9.0])), MODEL, WORK, cl, TRUE)
    assert r.spearman == pytest.approx(1.0, abs=1e-12) and r.top1_gap == 0.0
    assert "spearman=1.000 top1_gap=0.0%" in r.table()


def test_relative_error_of_known_misses(cl):
    # measured_i = predicted_i / (1 + e_i), so (predicted - measured) / measured = e_i exactly
    e = np.array([0.1, -0.2, 0.0, 0.05, 0.3])
    measured = _predicted(FIVE, cl) / (1 + e)
    r = evaluate(list(zip(FIVE, measured)), MODEL, WORK, cl, TRUE)
    assert r.rel_rmse == pytest.approx(math.sqrt((0.01 + 0.04 + 0.0 + 0.0025 + 0.09) / 5), rel=1e-9)  # 0.1688
    assert "+30.0%" in r.table() and "-20.0%" in r.table()


def test_fit_recovers_the_generating_constants(cl):
    measured = list(zip(LAYOUTS, _predicted(LAYOUTS, cl)))
    start = evaluate(measured, MODEL, WORK, cl, Constants())  # the defaults (0.5, 0.4, 0.8, 10 us) are off
    assert start.rel_rmse > 0.2
    report = fit(measured, MODEL, WORK, cl)
    for name in ("eff_llm", "eff_vit", "bw_eff", "msg_overhead_s"):
        assert getattr(report.constants, name) == pytest.approx(getattr(TRUE, name), rel=1e-3), name
    assert report.rel_rmse < 1e-6 and report.spearman == pytest.approx(1.0) and report.top1_gap == 0.0
    assert "spearman=1.000" in report.table()


def test_fit_with_known_noise_lands_near_the_generating_constants(cl):
    # +-1% alternating multiplicative noise. The least-squares optimum explains the measurements at least as
    # well as the generating constants do (their residual is exactly the noise: |e| / (1 + e), rms 0.99%).
    # The compute efficiencies, which set most of every step, stay close (measured: eff_llm +2.2%, eff_vit
    # -7.7%); the link constants are weakly determined by 10 layouts (bw_eff -19%, overhead -55%): not asserted.
    noise = np.array([1, -1] * 5) * 0.01
    measured = list(zip(LAYOUTS, _predicted(LAYOUTS, cl) * (1 + noise)))
    at_true = evaluate(measured, MODEL, WORK, cl, TRUE)
    assert at_true.rel_rmse == pytest.approx(float(np.sqrt(np.mean((noise / (1 + noise)) ** 2))), rel=1e-9)
    report = fit(measured, MODEL, WORK, cl)
    assert report.rel_rmse <= at_true.rel_rmse
    assert report.constants.eff_llm == pytest.approx(TRUE.eff_llm, rel=0.05)
    assert report.constants.eff_vit == pytest.approx(TRUE.eff_vit, rel=0.15)
    assert report.spearman == pytest.approx(1.0) and report.top1_gap == 0.0  # 1% noise does not reorder these


def test_evaluate_reports_rank_quality_of_wrong_constants(cl):
    measured = list(zip(LAYOUTS, _predicted(LAYOUTS, cl)))
    off = evaluate(measured, MODEL, WORK, cl, Constants(eff_vit=0.9, bw_eff=0.2))
    m, p = np.array([t for _, t in measured]), off.predicted
    # independent of scipy: Spearman from rank differences (no ties here), top-1 gap from the argmin
    d = np.argsort(np.argsort(p)) - np.argsort(np.argsort(m))
    n = len(m)
    assert off.spearman == pytest.approx(1 - 6 * float((d ** 2).sum()) / (n * (n * n - 1)), abs=1e-12)
    assert off.spearman < 1.0  # these constants do misrank some layouts
    assert off.top1_gap == pytest.approx(m[np.argmin(p)] / m.min() - 1, abs=1e-12)
    assert off.rel_rmse == pytest.approx(float(np.sqrt(np.mean(((p - m) / m) ** 2))), rel=1e-12)
    assert off.rel_rmse > 0.05
    with pytest.raises(ValueError, match="cannot fit 5 constants"):
        fit(measured[:2], MODEL, WORK, cl)


def test_interleaved_orders_run_every_layout_early_and_late():
    from tessera.scripts.calibrate_planner import interleaved_orders

    orders = interleaved_orders(4, 3)
    assert orders == [[0, 1, 2, 3], [0, 3, 2, 1], [2, 3, 0, 1]]
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    positions = {i: {o.index(i) for o in orders} for i in range(4)}
    assert all(len(p) > 1 for p in positions.values()), positions


def test_repeats_combine_to_medians_spreads_and_the_measurements_own_rank_agreement():
    from tessera.scripts.calibrate_planner import combine_repeats

    runs = [{"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 1.2, "b": 1.9, "c": 3.3}, {"a": 0.8, "b": 2.2, "c": 2.7}]
    median, spread, pairs = combine_repeats(runs)
    assert median == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert spread["a"] == pytest.approx(0.4) and spread["c"] == pytest.approx(0.2)
    assert pairs == [1.0, 1.0, 1.0]          # every repeat ranks a < b < c
    _, _, swapped = combine_repeats([{"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 3.0, "b": 2.0, "c": 1.0}])
    assert swapped == [-1.0]
