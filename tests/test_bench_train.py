"""scripts/bench_train.py's table builder on synthetic metrics (no training), and the calibration plumbing:
per-layout workloads and widened bounds in hetero.planner.calibrate.fit."""

import json

import pytest

from tessera.scripts.bench_train import add_ratios, markdown_table, summarize

HOMO = "audio=dp4@0-3;vision=dp4@0-3;language=dp4@0-3"
NONCOLOC = "vision=dp1@0-0;audio=dp1@1-1;language=tp2,dp1@2-3"


def _metrics(times, boundary=0, losses=None):
    losses = losses or [6.0 - 0.1 * i for i in range(len(times))]
    return [{"step": i + 1, "step_time_s": t, "boundary_bytes": boundary, "loss": loss}
            for i, (t, loss) in enumerate(zip(times, losses))]


def test_summary_uses_median_after_warmup_and_ratio_to_homogeneous():
    rows = add_ratios([
        summarize("homogeneous", "", HOMO, _metrics([9.0, 5.0, 0.4, 0.5, 0.6]), 2, 1024),
        summarize("nc", "vision=dp1@0-0;audio=dp1@1-1;language=tp2@2-3", NONCOLOC,
                  _metrics([9.0, 9.0, 0.2, 0.25, 0.3], boundary=3 * 2 ** 20), 2, 1024),
    ])
    h, nc = rows
    assert h["median_step_s"] == 0.5 and h["timed_steps"] == 3 and h["tokens_per_s"] == pytest.approx(2048)
    assert nc["median_step_s"] == 0.25 and nc["vs_homogeneous"] == pytest.approx(2.0) and h["vs_homogeneous"] == 1
    assert (h["placement"], nc["placement"]) == ("homogeneous", "non-colocated")
    assert nc["boundary_mb_per_step"] == pytest.approx(3.0) and nc["final_loss"] == pytest.approx(5.6)
    table = markdown_table(rows)
    assert table.count("\n") == 3 and "| 2.00x |" in table and "| non-colocated | 0.250 | 4096 |" in table
    json.dumps(rows)  # the --out file


def test_fit_takes_a_workload_per_layout_and_cpu_bounds():
    from tessera.hetero.planner import Constants, Workload, cluster, describe_model, predict
    from tessera.hetero.planner.calibrate import fit

    model = describe_model("nemotron_h_tiny_dense", "radio_vit_tiny", "fastconformer_tiny")
    cl = cluster("cpu_gloo4", 4)
    true = Constants(eff_llm=0.02, eff_vit=0.01, eff_conformer=0.004, bw_eff=0.1, msg_overhead_s=2e-3,
                     layer_overhead_s=1e-3)
    layouts = [HOMO, "vision=dp4@0-3;audio=dp4@0-3;language=tp2,cp2@0-3", "vision=dp4@0-3;audio=dp4@0-3;language=pp2,dp2@0-3",
               "vision=dp2@0-1;audio=dp2@0-1;language=cp2@2-3", NONCOLOC, "vision=dp1@0-0;audio=dp1@1-1;language=pp2@2-3"]
    meas = []
    for lay in layouts:  # 4 rows per microbatch whatever the LLM's DP: the micro batch differs per layout
        dp = 4 if lay == HOMO else 2 if "pp2,dp2" in lay else 1
        w = Workload(seq_length=128, global_batch=8, micro_batch=4 // dp, tiles=5, audio_seconds=2, audio_clip_seconds=2)
        meas.append((lay, predict(lay, model, w, cl, true, recompute=()).step_s, w))
    cpu = {"eff_llm": (1e-4, 1.0), "eff_vit": (1e-4, 1.0), "eff_conformer": (1e-4, 1.0), "msg_overhead_s": (1e-7, 0.1),
           "layer_overhead_s": (1e-7, 0.1)}
    report = fit(meas, model, meas[0][2], cl, bounds=cpu)  # the default bounds stop eff_* at 0.05
    assert report.rel_rmse < 1e-4 and report.spearman == pytest.approx(1.0)
    assert report.constants.msg_overhead_s == pytest.approx(2e-3, rel=1e-2)
