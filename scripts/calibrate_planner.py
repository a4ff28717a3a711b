"""Calibrate the layout planner's cost model on this CPU box: measured vs predicted step times of 10 layouts.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/calibrate_planner.py --out calibrate_planner.json   # ~10 min here
    OMP_NUM_THREADS=1 .venv/bin/python scripts/calibrate_planner.py --steps 8 --repeats 1   # quicker, noisier

One spawn of 4 gloo ranks (scripts/bench_train.py's runner) first microbenchmarks the machine, then trains
the tiny image+audio model in each of LAYOUTS (TP/CP/PP/DP and placement varied; encoders cp1/pp1, every
DP dividing the 4 rows of a microbatch, as training requires):
  machine  one core's fp32 GEMM rate (each rank alone, and all 4 at once), memory copy bandwidth, gloo
           loopback point-to-point latency and bandwidth (ping-pong rank 0 <-> 1), 4-rank all-reduce latency.
           They fill the cpu_gloo4 cluster preset (hetero/planner/cluster.py) for this run.
  workload seq_length 128, 8 rows per step in 2 microbatches of 4 (so the LLM micro batch is 4 / its DP, a
           workload per layout), media per row counted from the same synthetic data the runs train on.
Every layout runs --repeats times (5, of 24 steps: 3 x 16 ranked the layouts against themselves at Spearman 0.79,
5 x 24 at 0.97), in interleaved orders (rotated and alternately reversed per repeat, so the
box's drift hits all layouts alike); the fit takes each layout's median, and the measurement's own quality is
printed next to the fit's: the repeat-to-repeat Spearman of the layouts' step times and each layout's spread.
Then hetero.planner.calibrate.fit fits the free constants (eff_llm, eff_vit, eff_conformer, bw_eff,
msg_overhead_s, layer_overhead_s; bounds widened for a CPU) to the median step times, and the script prints predicted vs
measured per layout (default constants and fitted), the Spearman rank correlation, the top-1 gap (measured
time of the layout the planner ranks first / best measured - 1) and whether the targets (Spearman >= 0.8,
top-1 gap <= 10%) are met on layouts the fit did not see: each layout predicted by a fit on the other 9
(leave-one-out); the in-sample fit (10 layouts, 6 constants) is printed next to it. Caveat: 2 shared cores run
4 ranks and the model is too small for FLOPs to matter: a step is mostly software time per layer call and per
message (layer_overhead_s, msg_overhead_s; measured here ~4 ms and ~1.5 ms), so the fitted efficiencies are not
FLOP efficiencies, and compare the fit's Spearman with the measurement's own. docs/planner_calibration.md holds
a run's tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path


from tessera.scripts.bench_train import MODEL, WORLD, add_ratios, markdown_table, run

LAYOUTS = [
    ("homogeneous", ""),
    ("coloc_tp2_dp2", "vision=tp2,dp2@0-3;audio=dp4@0-3;language=tp2,dp2@0-3"),
    ("coloc_tp2_pp2", "vision=tp2,dp2@0-3;audio=dp4@0-3;language=tp2,pp2@0-3"),
    ("coloc_cp2_dp2", "vision=dp4@0-3;audio=dp4@0-3;language=cp2,dp2@0-3"),
    ("coloc_pp2_dp2", "vision=dp4@0-3;audio=dp4@0-3;language=pp2,dp2@0-3"),
    ("coloc_tp2_cp2", "vision=dp4@0-3;audio=dp4@0-3;language=tp2,cp2@0-3"),
    ("noncoloc_cp2", "vision=dp2@0-1;audio=dp2@0-1;language=cp2@2-3"),
    ("noncoloc_tp2", "vision=dp1@0-0;audio=dp1@1-1;language=tp2@2-3"),
    ("noncoloc_dp2", "vision=dp2@0-1;audio=dp2@0-1;language=dp2@2-3"),
    ("noncoloc_pp2", "vision=dp1@0-0;audio=dp1@1-1;language=pp2@2-3"),
]
LLM = "nemotron_h_tiny_dense"
SEQ, ROWS, MICROBATCHES = 128, 4, 2
CPU_BOUNDS = {"eff_llm": (1e-4, 1.0), "eff_vit": (1e-4, 1.0), "eff_conformer": (1e-4, 1.0), "bw_eff": (1e-3, 1.0),
              "msg_overhead_s": (1e-7, 0.1), "layer_overhead_s": (1e-7, 0.1)}


def check_trainable(spec: str) -> None:
    """The layout as training resolves it (the one resolution, trainability rule included), or a LayoutError."""
    from tessera.recipes.checks import resolve
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, RunConfig

    cfg = RunConfig(layout=spec, model=ModelConfig(llm=LLM, **MODEL),
                    data=DataConfig(seq_length=SEQ, rows_per_microbatch=ROWS, microbatches=MICROBATCHES))
    resolve(cfg, WORLD)


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def microbench() -> dict:
    """Every rank (inside the spawn): GEMM rate alone and all at once, copy bandwidth, gloo p2p and all-reduce."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    gemm = lambda: [a @ b for _ in range(10)]  # noqa: E731
    out = {"rank": rank}
    for r in range(world):  # one rank at a time: a core to itself (as far as the shared box allows)
        dist.barrier()
        if rank == r:
            gemm()
            out["gemm_solo_flops"] = 10 * 2 * n ** 3 / _median_time(gemm, 15)
    dist.barrier()
    gemm()
    out["gemm_all_flops"] = 10 * 2 * n ** 3 / _median_time(gemm, 15)
    dist.barrier()
    if rank == 0:
        x, y = torch.randn(4 << 20), torch.empty(4 << 20)
        out["copy_bytes_per_s"] = 2 * x.numel() * 4 / _median_time(lambda: y.copy_(x), 20)
    for size, key in ((1, "p2p_small_s"), (1 << 20, "p2p_4mb_s")):  # one-way time from ping-pong 0 <-> 1
        buf = torch.zeros(size)
        dist.barrier()
        if rank in (0, 1):
            peer = 1 - rank

            def pingpong():
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            pingpong()
            out[key] = _median_time(pingpong, 30 if size == 1 else 10) / 2
    dist.barrier()
    one = torch.zeros(1)
    dist.all_reduce(one)
    out["allreduce_small_s"] = _median_time(lambda: dist.all_reduce(one), 30)
    return out


def machine(per_rank: list[dict]) -> dict:
    r0 = per_rank[0]
    lat = r0["p2p_small_s"]
    return {"gemm_solo_gflops": statistics.median(r["gemm_solo_flops"] for r in per_rank) / 1e9,
            "gemm_all_gflops": statistics.median(r["gemm_all_flops"] for r in per_rank) / 1e9,
            "copy_gbps": r0["copy_bytes_per_s"] / 1e9, "p2p_latency_s": lat,
            "p2p_gbps": (4 << 20) / max(r0["p2p_4mb_s"] - lat, 1e-9) / 1e9,
            "allreduce4_small_s": r0["allreduce_small_s"]}


def cpu_cluster(m: dict):
    from tessera.hetero.planner.cluster import PRESETS

    return dataclasses.replace(PRESETS["cpu_gloo4"], peak_tflops=m["gemm_solo_gflops"] / 1e3,
                               hbm_tbps=m["copy_gbps"] / 1e3, intra_gbps=m["p2p_gbps"], inter_gbps=m["p2p_gbps"],
                               intra_latency_s=m["p2p_latency_s"], inter_latency_s=m["p2p_latency_s"])


def media_per_row(batches: int = 20) -> dict[str, float]:
    """Vision and audio LLM tokens per row in the synthetic data the runs train on (one process, no decode)."""
    from tessera.data.pipeline import build_train_loader, synthetic_dataset, synthetic_root

    path, tok = synthetic_dataset(synthetic_root())
    loader = build_train_loader(path, tok, MODEL, SEQ, ROWS, decode={}, seed=1234)
    it, tot, rows = iter(loader), {k: 0 for k in MODEL}, 0
    for _ in range(batches):
        b = next(it)
        for k, bb in b.boundary_batches(sorted(MODEL)).items():
            tot[k] += sum(len(p) for p in bb.positions)
        rows += b.tokens.shape[0]
    return {k: v / rows for k, v in tot.items()}


def workload_for(layout: str, media: dict[str, float], model):
    """The planner's Workload of one measured run: 4 rows per microbatch whatever the LLM's DP."""
    from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout
    from tessera.hetero.planner import Workload

    dp = HeteroLayout.parse(layout)[LANGUAGE].dp_size
    fps = model["audio"].frames_per_second
    seconds = media["audio"] / fps
    return Workload(seq_length=SEQ, global_batch=ROWS * MICROBATCHES, micro_batch=ROWS // dp,
                    tiles=media["vision"] / model["vision"].out_per_tile, audio_seconds=seconds,
                    audio_clip_seconds=max(seconds, 1e-3))


def interleaved_orders(n: int, repeats: int) -> list[list[int]]:
    """The order of the n layouts in each repeat: rotated by one per repeat and reversed every other repeat, so
    every layout runs early and late and next to different neighbours (the shared box's drift hits all alike)."""
    out = []
    for k in range(repeats):
        order = [(i + k) % n for i in range(n)]
        out.append(order[::-1] if k % 2 else order)
    return out


def combine_repeats(step_s: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float], list[float]]:
    """Per layout the median step time over repeats and its spread ((max - min) / median); and the Spearman rank
    correlation of every pair of repeats (how well the measurement ranks the layouts against itself)."""
    from itertools import combinations

    from scipy.stats import spearmanr

    names = list(step_s[0])
    median = {n: statistics.median(r[n] for r in step_s) for n in names}
    spread = {n: (max(r[n] for r in step_s) - min(r[n] for r in step_s)) / median[n] for n in names}
    pairs = [float(spearmanr([a[n] for n in names], [b[n] for n in names]).statistic)
             for a, b in combinations(step_s, 2)]
    return median, spread, pairs


def calib_table(rows: list[dict], default, fitted, loo: list[float]) -> str:
    rank = lambda xs: {i: r + 1 for r, i in enumerate(sorted(range(len(xs)), key=lambda i: xs[i]))}  # noqa: E731
    mr, pr = rank(list(fitted.measured)), rank(list(fitted.predicted))
    lines = ["| layout | placement | measured s | default-constants s | fitted s | error | rank meas/pred | LOO s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(rows):
        m, p = fitted.measured[i], fitted.predicted[i]
        lines.append(f"| `{r['resolved']}` | {r['placement']} | {m:.3f} | {default.predicted[i]:.4f} | {p:.3f} | "
                     f"{100 * (p - m) / m:+.0f}% | {mr[i]}/{pr[i]} | {loo[i]:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="steps per layout (the first --warmup are not timed)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats of every layout (medians fitted)")
    ap.add_argument("--out", default="calibrate_planner.json")
    args = ap.parse_args(argv)
    from scipy.stats import spearmanr

    from tessera.hetero.planner import Constants, describe_model
    from tessera.hetero.planner.calibrate import evaluate, fit

    for _, spec in LAYOUTS[1:]:
        check_trainable(spec)
    t0 = time.perf_counter()
    model = describe_model(LLM, MODEL["vision"], MODEL["audio"])
    media = media_per_row()
    repeats, micro = [], None
    for k, order in enumerate(interleaved_orders(len(LAYOUTS), args.repeats)):
        got, pre = run([LAYOUTS[i] for i in order], args.steps, args.warmup, seq=SEQ, rows=ROWS,
                       microbatches=MICROBATCHES, pre=microbench if k == 0 else None)
        micro = micro or pre
        repeats.append({r["name"]: r for r in got})
        print(f"repeat {k + 1}/{args.repeats} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    wall = time.perf_counter() - t0
    median, spread, pairs = combine_repeats([{n: r[n]["median_step_s"] for n, _ in LAYOUTS} for r in repeats])
    rows = []
    for name, _ in LAYOUTS:
        row = dict(repeats[0][name], median_step_s=median[name], spread=spread[name],
                   repeat_step_s=[r[name]["median_step_s"] for r in repeats])
        row["tokens_per_s"] = ROWS * MICROBATCHES * SEQ / median[name]
        rows.append(row)
    rows = add_ratios(rows)
    m = machine(micro)
    cl = cpu_cluster(m)
    meas = [(r["resolved"], r["median_step_s"], workload_for(r["resolved"], media, model)) for r in rows]
    default = evaluate(meas, model, meas[0][2], cl, Constants())
    fitted = fit(meas, model, meas[0][2], cl, bounds=CPU_BOUNDS)
    loo = []  # leave-one-out: fit on the other 9, predict the held-out layout
    for i in range(len(meas)):
        k = fit(meas[:i] + meas[i + 1:], model, meas[0][2], cl, bounds=CPU_BOUNDS).constants
        loo.append(float(evaluate([meas[i]], model, meas[0][2], cl, k).predicted[0]))
    loo_rho = float(spearmanr(loo, fitted.measured).statistic)
    loo_gap = float(fitted.measured[loo.index(min(loo))] / fitted.measured.min() - 1)

    print("## Measured throughput\n")
    print(markdown_table(rows))
    print("\n## Machine (cpu_gloo4 preset for this run)\n")
    print("| GEMM fp32 1 rank alone | GEMM per rank, 4 at once | copy | gloo p2p latency | gloo p2p bandwidth | "
          "all-reduce 4 ranks, 4 B |\n|---:|---:|---:|---:|---:|---:|")
    print(f"| {m['gemm_solo_gflops']:.1f} GFLOP/s | {m['gemm_all_gflops']:.1f} GFLOP/s | {m['copy_gbps']:.2f} GB/s | "
          f"{m['p2p_latency_s'] * 1e6:.0f} us | {m['p2p_gbps']:.2f} GB/s | {m['allreduce4_small_s'] * 1e6:.0f} us |")
    print(f"\nmedia per row: vision {media['vision']:.1f} tokens, audio {media['audio']:.1f} tokens")
    print("\n## Predicted vs measured step time\n")
    print(calib_table(rows, default, fitted, loo))
    consts = ", ".join(f"{n}={getattr(fitted.constants, n):.3g}" for n in Constants.names())
    print(f"\nfitted constants: {consts}")
    print(f"default constants: spearman={default.spearman:.3f} top1_gap={100 * default.top1_gap:.1f}%")
    print(f"fitted (in-sample): spearman={fitted.spearman:.3f} top1_gap={100 * fitted.top1_gap:.1f}% "
          f"rel_rmse={100 * fitted.rel_rmse:.1f}%")
    print(f"leave-one-out (each layout predicted by a fit that did not see it): spearman={loo_rho:.3f} "
          f"top1_gap={100 * loo_gap:.1f}%")
    print(f"the measurement against itself ({args.repeats} interleaved repeats): repeat-to-repeat spearman "
          f"{statistics.mean(pairs):.3f} (min {min(pairs):.3f}); per-layout spread (max-min)/median: median "
          f"{100 * statistics.median(spread.values()):.1f}%, max {100 * max(spread.values()):.1f}%"
          if pairs else "one repeat: no run-to-run spread (use --repeats 3)")
    ok_rho, ok_gap = loo_rho >= 0.8, loo_gap <= 0.10  # judged on layouts the fit did not see
    print(f"targets (leave-one-out): spearman >= 0.8 {'MET' if ok_rho else 'MISSED'}; top-1 gap <= 10% "
          f"{'MET' if ok_gap else 'MISSED'}")
    if not (ok_rho and ok_gap):
        print("why: 4 ranks share 2 cores (a rank waiting in gloo or in Python still takes a core), which the cost "
              "model does not price, and measured spreads between layouts close to the run-to-run noise (the "
              "repeat-to-repeat spearman above) leave no ranking to fit: use more --repeats and --steps.")
    print(f"\nwall {wall:.0f} s ({args.repeats} spawns: microbenchmarks + {len(rows)} layouts x {args.steps} steps each)")
    Path(args.out).write_text(json.dumps({
        "machine": m, "cluster": dataclasses.asdict(cl), "media_per_row": media, "rows": rows,
        "calibration": [{"layout": r["resolved"], "placement": r["placement"], "measured_s": float(fitted.measured[i]),
                         "predicted_default_s": float(default.predicted[i]),
                         "predicted_fitted_s": float(fitted.predicted[i]), "predicted_loo_s": loo[i]}
                        for i, r in enumerate(rows)],
        "fitted_constants": dataclasses.asdict(fitted.constants),
        "spearman": fitted.spearman, "top1_gap": fitted.top1_gap, "rel_rmse": fitted.rel_rmse,
        "default_spearman": default.spearman, "default_top1_gap": default.top1_gap,
        "loo_spearman": loo_rho, "loo_top1_gap": loo_gap, "targets_met": bool(ok_rho and ok_gap), "wall_s": wall,
        "repeat_spearman": pairs, "spread": spread,
    }, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
