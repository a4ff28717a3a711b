"""Fit the cost model's free constants to measured step times, and say how well it then ranks layouts.

    from tessera.hetero.planner.calibrate import fit
    report = fit([("vision=dp8@0-7;language=tp4,dp2@0-7", 1.93), ...], model, workload, cluster)
    print(report.table())

The free constants (cluster.Constants): achieved-FLOPs efficiency per module kind present in the model,
link bandwidth efficiency and per-message overhead. Step time is close to linear in their inverses but
not exactly (max() of pipeline stages, overlap windows), so the fit is a bounded nonlinear least squares
(scipy) on log-constants over relative residuals (pred - measured) / measured: a 10% miss counts the same
on a 1 s and a 10 s step. Quality of the ranking, what the planner is used for, is reported separately:
Spearman rank correlation of predicted and measured step times, and the top-1 gap (how much slower the
layout predicted best really is than the measured best). Measurements come from scripts/bench_train.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import spearmanr

from tessera.hetero.planner.cluster import Cluster, Constants, Workload
from tessera.hetero.planner.cost import predict
from tessera.hetero.planner.model import ModelDesc

BOUNDS = {"eff_llm": (0.05, 1.0), "eff_vit": (0.05, 1.0), "eff_conformer": (0.05, 1.0), "bw_eff": (0.05, 1.0),
          "eff_torch_attention": (1e-3, 1.0), "eff_torch_scan": (1e-3, 1.0),
          "msg_overhead_s": (1e-7, 1e-3), "layer_overhead_s": (1e-8, 1e-2)}


@dataclass
class CalibrationReport:
    constants: Constants
    layouts: list[str]
    measured: np.ndarray
    predicted: np.ndarray
    spearman: float      # rank correlation of predicted vs measured step times
    top1_gap: float      # measured step of the predicted-best layout / best measured step - 1
    rel_rmse: float      # root mean square of (pred - measured) / measured

    def table(self) -> str:
        rows = [f"{'measured s':>10} {'predicted s':>11} {'error':>7}  layout"]
        for lay, m, p in zip(self.layouts, self.measured, self.predicted):
            rows.append(f"{m:>10.4f} {p:>11.4f} {100 * (p - m) / m:>+6.1f}%  {lay}")
        fitted = ", ".join(f"{n}={getattr(self.constants, n):.4g}" for n in Constants.names())
        rows.append(f"fitted: {fitted}")
        rows.append(f"spearman={self.spearman:.3f} top1_gap={100 * self.top1_gap:.1f}% "
                    f"rel_rmse={100 * self.rel_rmse:.1f}%")
        return "\n".join(rows)


def free_constants(model: ModelDesc) -> list[str]:
    """The constants measurements of this model can inform: its module kinds' efficiencies, the links and the
    per-layer software overhead."""
    kinds = sorted({m.kind for m in model.modules})
    return [f"eff_{k}" for k in kinds] + ["bw_eff", "msg_overhead_s", "layer_overhead_s"]


def _workloads(measurements: list[tuple], w: Workload) -> list[Workload]:
    """A measurement is (layout, seconds) or (layout, seconds, Workload): its own workload when the micro batch
    per LLM DP replica differs between layouts (a fixed global batch per microbatch, as training uses)."""
    return [m[2] if len(m) > 2 and m[2] is not None else w for m in measurements]


def _steps(layouts: list[str], model: ModelDesc, w: Workload | list[Workload], cl: Cluster,
           k: Constants) -> np.ndarray:
    out = []
    ws = w if isinstance(w, list) else [w] * len(layouts)
    for lay, wl in zip(layouts, ws):
        p = predict(lay, model, wl, cl, k, recompute=())  # measured runs do what their layout says: no auto
        if not math.isfinite(p.step_s):
            raise ValueError(f"cannot price measured layout {lay}: {p.reason}")
        out.append(p.step_s)
    return np.array(out)


def evaluate(measurements: list[tuple[str, float]], model: ModelDesc, w: Workload, cl: Cluster,
             k: Constants) -> CalibrationReport:
    """Predicted vs measured with the given constants (no fitting)."""
    layouts = [m[0] for m in measurements]
    measured = np.array([m[1] for m in measurements], dtype=float)
    predicted = _steps(layouts, model, _workloads(measurements, w), cl, k)
    rho = float(spearmanr(predicted, measured).statistic) if len(measured) > 2 else float("nan")
    gap = float(measured[int(np.argmin(predicted))] / measured.min() - 1)
    rmse = float(np.sqrt(np.mean(((predicted - measured) / measured) ** 2)))
    return CalibrationReport(k, layouts, measured, predicted, rho, gap, rmse)


def fit(measurements: list[tuple[str, float]], model: ModelDesc, w: Workload, cl: Cluster,
        start: Constants = Constants(), free: list[str] | None = None,
        bounds: dict[str, tuple[float, float]] | None = None) -> CalibrationReport:
    """Least-squares constants for (layout string, measured seconds per step[, Workload]) of one model.
    bounds: per-constant (low, high) overriding BOUNDS (e.g. a CPU box far below GPU efficiencies)."""
    bounds = {**BOUNDS, **(bounds or {})}
    free = free or free_constants(model)
    if len(measurements) < len(free):
        raise ValueError(f"{len(measurements)} measurements cannot fit {len(free)} constants {free}; "
                         f"measure at least as many layouts")
    layouts = [m[0] for m in measurements]
    measured = np.array([m[1] for m in measurements], dtype=float)
    ws = _workloads(measurements, w)
    lo = np.log([bounds[n][0] for n in free])
    hi = np.log([bounds[n][1] for n in free])

    def constants(x: np.ndarray) -> Constants:
        return dataclasses.replace(start, **{n: float(math.exp(v)) for n, v in zip(free, x)})

    def residuals(x: np.ndarray) -> np.ndarray:
        return (_steps(layouts, model, ws, cl, constants(x)) - measured) / measured

    # a constant whose default is off (0: layer_overhead_s) starts mid-range, where its gradient is not ~0
    x0 = np.clip(np.log([getattr(start, n) if getattr(start, n) > bounds[n][0] else math.sqrt(bounds[n][0] * bounds[n][1])
                         for n in free]), lo + 1e-9, hi - 1e-9)
    sol = least_squares(residuals, x0, bounds=(lo, hi), x_scale=1.0, diff_step=1e-6, xtol=1e-12, ftol=1e-12,
                        gtol=1e-12)
    return evaluate(measurements, model, w, cl, constants(sol.x))
