"""A step's model FLOPs, TFLOPS per GPU and MFU, from the batches it trained on (what RunMetrics logs).

    flops = StepFlops(cfg.model, hf_fields, device, dtype)   # once per run
    flops.record(batches, step_time_s, world)  # {"model_tflops_per_gpu": .., "mfu": .. (None on CPU)}

The FLOPs are the planner's (hetero/planner/flops.py: one function per module kind, checked against torch's
FlopCounterMode): every LLM row of the step's global microbatches, every media item its encoders run (the
metadata every rank holds for every row, so all ranks agree without communicating), times 3 (forward and
backward; recompute's extra forward is not model FLOPs). Divided by the world, not by a module's ranks: a
non-colocated layout's idle encoder ranks lower TFLOPS/GPU, as they should.
"""

from __future__ import annotations

import torch

from tessera.data.pipeline import encoder_tokens
from tessera.hetero.planner.flops import llm_row_flops, media_item_flops, peak_tflops
from tessera.hetero.planner.model import describe_model
from tessera.hetero.plan.layout import LANGUAGE


def device_peak_tflops(device: torch.device, dtype: str) -> float | None:
    """The device's dense peak for `dtype` (hetero/planner/flops.DEVICE_PEAK_TFLOPS); None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device), dtype)


class StepFlops:
    """The run's model description, fixed once; `step_flops` prices any batches of it."""

    def __init__(self, model_cfg, hf_fields: dict, device: torch.device, dtype: str):
        encoders = {k: getattr(model_cfg, k) for k in ("vision", "audio") if getattr(model_cfg, k)}
        self.desc = describe_model(hf_fields, encoders.get("vision"), encoders.get("audio"))
        self.tok = encoder_tokens(encoders) if encoders else None
        self.peak = device_peak_tflops(device, dtype)

    def step_flops(self, batches: list) -> dict[str, float]:
        """Training FLOPs (3 x forward) per module of a step over these global microbatches."""
        out = {}
        for mod in self.desc.modules:
            if mod.key == LANGUAGE:
                fwd = sum(len(b.keys) * llm_row_flops(mod, b.seq_length) for b in batches)
            else:
                fwd = sum(media_item_flops(mod, self.tok, m[0], m[1]) for b in batches for row in b.media_meta
                          for m in row.get(mod.key, []))
            out[mod.key] = 3.0 * fwd
        return out

    def record(self, batches: list, step_time_s: float, world: int) -> dict:
        """The metrics record's throughput fields: model TFLOPS per GPU and MFU (None where the peak is unknown)."""
        flops = self.step_flops(batches)
        tflops = sum(flops.values()) / step_time_s / world / 1e12
        return {"model_tflops_per_gpu": tflops, "mfu": tflops / self.peak if self.peak else None,
                "model_flops": flops}
