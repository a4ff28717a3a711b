"""Model FLOPs, one function per module kind: what the planner prices and what the trainer reports.

    sequence_flops(mod, tokens)            forward FLOPs of one sequence through a module (model.py's formulas)
    vit_sequence_flops(mod, patches)       one ViT sequence with its patch embedding and projector
    llm_row_flops(mod, seq_length)         one packed LLM row, lm_head included
    media_item_flops(mod, tok, kind, units) one media item (an image's tiles or native grid, a clip's tubelets,
                                           an audio clip) as the encoder runs it
    peak_tflops(device_name, dtype)        the device's dense peak, for MFU (None where unknown: CPU)
    StepFlops(model_cfg, hf_fields, ..)    a run's step: FLOPs per module of its batches, TFLOPS/GPU, MFU

A training step is 3x the forward (model FLOPs: the extra forward of activation recompute is not counted, as
MFU is defined by PaLM and reported by Megatron). The LLM's attention is counted causal (half the S x S
scores: what a causal flash kernel computes), an encoder's bidirectional; a packed row is priced over its
whole length, as the kernels run it. tests/test_flops.py checks every function against torch's
FlopCounterMode on the tiny models (within 5%), the outside count of what the ops execute.
No torch, so the planner prices a thousand layouts in milliseconds with the same arithmetic.
"""

from __future__ import annotations

import math

from tessera.hetero.planner.model import ModuleDesc

# Dense peak TFLOPS per GPU by the name torch.cuda.get_device_name() reports (first match wins, so the PCIe
# and NVL variants come before the SXM part). bf16: tensor cores, dense; float32: the non-tensor FP32 rate
# (torch's default matmul precision "highest" keeps fp32 matmuls off TF32). NVIDIA datasheets.
DEVICE_PEAK_TFLOPS = (
    ("H100 PCIe", {"bfloat16": 756.0, "float32": 51.2}),
    ("H100 NVL", {"bfloat16": 835.5, "float32": 60.0}),
    ("H100", {"bfloat16": 989.4, "float32": 66.9}),
    ("H200", {"bfloat16": 989.4, "float32": 66.9}),
    ("GH200", {"bfloat16": 989.4, "float32": 66.9}),
    ("B200", {"bfloat16": 2250.0, "float32": 80.0}),
    ("A100", {"bfloat16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.1, "float32": 91.6}),
)


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """Dense peak TFLOPS of a device for `dtype` ("bfloat16" | "float32"); None for a device not in the table."""
    for name, peaks in DEVICE_PEAK_TFLOPS:
        if name in device_name:
            return peaks.get(dtype)
    return None


def sequence_flops(mod: ModuleDesc, tokens: float, extra: float = 0.0) -> float:
    """Forward FLOPs of one sequence of `tokens` tokens: every weight per token, attention over the sequence, and
    `extra` (an audio clip's subsampling). The LLM's lm_head is llm_row_flops' part."""
    return tokens * (mod.linear_flops + mod.attn_flops * tokens) + extra


def llm_row_flops(mod: ModuleDesc, seq_length: int) -> float:
    """Forward FLOPs of one packed LLM row of seq_length tokens, its lm_head included."""
    return sequence_flops(mod, seq_length) + seq_length * mod.head_flops


def vit_sequence_flops(mod: ModuleDesc, patches: int, frames: int = 1) -> float:
    """Forward FLOPs of one ViT sequence of `patches` patches (a tile, a native grid, a tubelet of `frames`
    frames embedded together): the layers over patches + prefix tokens, the patch embedding per patch and
    frame, the projector per output token after pixel shuffle."""
    return (sequence_flops(mod, patches + mod.prefix_tokens) + patches * frames * mod.embed_flops
            + patches / mod.pixel_shuffle ** 2 * mod.out_flops)


def media_item_flops(mod: ModuleDesc, tok, kind: str, units: int | tuple) -> float:
    """Forward FLOPs of one media item as the encoder runs it. `tok`: the run's EncoderTokens (models/media_tokens.py:
    patches per tile, frames per tubelet, the audio front end); `units` as the data side records them
    (PackedBatch.media_meta): image tiles, each one sequence of a tile's patches, or a native (rows, cols) patch
    grid, one sequence of all its patches (its cost grows with their square); video frames, or (frames, rows,
    cols), in tubelets of tok.video_temporal frames, one sequence each; audio 16 kHz samples, one clip one
    sequence."""
    if mod.key == "vision":  # tiles / patch grids / tubelets, each one sequence of the family's tokens
        grid = units if kind == "image" else (units[1:] if isinstance(units, tuple) else None)
        patches = grid[0] * grid[1] if isinstance(grid, tuple) else tok.patches_per_tile
        if kind == "image":
            return vit_sequence_flops(mod, patches) * (1 if isinstance(units, tuple) else units)
        frames = units[0] if isinstance(units, tuple) else units
        return vit_sequence_flops(mod, patches, tok.video_temporal) * math.ceil(frames / tok.video_temporal)
    if mod.key == "audio":  # one clip one sequence of the family's rows
        return sequence_flops(mod, tok.audio_encoder_rows(units), mod.pre_flops_per_second * units / tok.audio_rate)
    raise ValueError(f"{mod.key} encodes no media items")


class StepFlops:
    """A run's model FLOPs per step, from the batches it trained on (recipes/train.py builds it and hands it to the
    trainer, which logs `record`'s fields: training code never imports the cost model).

    Every LLM row of the step's global microbatches and every media item its encoders run (the metadata every rank
    holds for every row, so all ranks agree without communicating), times 3 (forward and backward; recompute's
    extra forward is not model FLOPs). TFLOPS per GPU divide by the world, not by a module's ranks: a
    non-colocated layout's idle encoder ranks lower it, as they should."""

    def __init__(self, model_cfg, hf_fields: dict, device_name: str = "cpu", dtype: str = "float32",
                 encoders: dict[str, str] | None = None):
        """encoders: module key -> encoder registry name (runspec/modules.encoder_names: a released checkpoint's own
        encoders when fine-tuning one); None: the config's vision/audio names."""
        from tessera.data.pipeline import encoder_tokens
        from tessera.hetero.planner.model import describe_model

        if encoders is None:
            encoders = {k: getattr(model_cfg, k) for k in ("vision", "audio") if getattr(model_cfg, k)}
        self.desc = describe_model(hf_fields, encoders.get("vision"), encoders.get("audio"))
        self.tok = encoder_tokens(encoders) if encoders else None
        self.peak = peak_tflops(device_name, dtype)

    def item_flops(self, module: str, kind: str, units) -> float:
        """Forward FLOPs of one media item of encoder `module`: the cost the run balances encoder DP ranks by
        (hetero/plan/encoder_balance.ItemAssignment)."""
        mod = next((m for m in self.desc.modules if m.key == module), None)
        if mod is None:
            raise KeyError(f"StepFlops prices {[m.key for m in self.desc.modules]}, not encoder '{module}': build it "
                           f"with the run's encoders (runspec/modules.encoder_names)")
        return media_item_flops(mod, self.tok, kind, units)

    def step_flops(self, batches: list) -> dict[str, float]:
        """Training FLOPs (3 x forward) per module of a step over these global microbatches (PackedBatch)."""
        out = {}
        for mod in self.desc.modules:
            if mod.kind == "llm":
                fwd = sum(len(b.keys) * llm_row_flops(mod, b.seq_length) for b in batches)
            else:
                fwd = sum(media_item_flops(mod, self.tok, m[0], m[1]) for b in batches for row in b.media_meta
                          for m in row.get(mod.key, []))
            out[mod.key] = 3.0 * fwd
        return out

    def encoder_imbalance(self, batches: list) -> dict[str, float]:
        """Per encoder: the sum over the step's microbatches of its busiest DP rank's FLOPs over the sum of the mean
        rank's (1.0: even), as the items were assigned (PackedBatch.item_owners). Each microbatch's embeddings
        cross the boundary when its slowest encoder rank is done, so this is the encoder's time over the ideal."""
        out = {}
        for key in sorted({k for b in batches for k in b.owners}):
            dp, busiest, mean = batches[0].owners[key][0], 0.0, 0.0
            for b in batches:
                loads = [0.0] * dp
                for meta, owners in zip(b.media_meta, b.item_owners(key, dp)):
                    for m, o in zip(meta.get(key, []), owners):
                        loads[o] += self.item_flops(key, m[0], m[1])
                busiest, mean = busiest + max(loads), mean + sum(loads) / dp
            out[key] = busiest / mean if mean > 0 else 1.0
        return out

    def record(self, batches: list, step_time_s: float, world: int) -> dict:
        """A metrics record's throughput fields: model FLOPs per module, TFLOPS per GPU, MFU (None without a peak),
        each encoder's load imbalance over its DP ranks."""
        flops = self.step_flops(batches)
        tflops = sum(flops.values()) / step_time_s / world / 1e12
        return {"model_flops": flops, "model_tflops_per_gpu": tflops, "mfu": tflops / self.peak if self.peak else None,
                "encoder_imbalance": self.encoder_imbalance(batches)}
