"""LoRA settings as data: the valid target names and the one validation every entry point shares.

Pure (no torch): hetero/runspec/config.py validates `model.lora` with it when the config is made, and
hetero/build/lora.py again when a saved config (a plain dict) comes back for export.
"""

from __future__ import annotations

# Megatron-Bridge's target names (the LLM's layers), plus Tessera's Mamba and media-projector layers and the
# vision tower (`vision`: every ViT layer's linear_qkv, linear_proj, linear_fc1, linear_fc2); what each wraps is
# in hetero/build/lora.py. The audio tower is not adapted.
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj", "projector",
                "vision")
#: model.lora.targets when not given: the LLM's layers and the projectors (the encoder towers are opt-in: `vision`)
DEFAULT_LORA_TARGETS = tuple(t for t in LORA_TARGETS if t != "vision")
LORA_EXPORTS = ("merged", "adapters", "both")


def lora_targets(targets) -> tuple[str, ...]:
    """A tuple of target names; a CLI string `linear_qkv,linear_proj` is split at commas."""
    if isinstance(targets, str):
        return tuple(t.strip() for t in targets.split(",") if t.strip())
    return tuple(targets)


def validate_lora(rank, alpha, targets, dropout, export) -> None:
    """A ValueError naming the model.lora field for anything a LoRA run cannot use."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"model.lora.rank={rank!r}: a non-negative integer (0 = LoRA off)")
    if rank and not alpha > 0:
        raise ValueError(f"model.lora.alpha={alpha!r}: must be > 0 (scale = alpha / rank)")
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"model.lora.targets: unknown {unknown}; valid targets: {', '.join(LORA_TARGETS)}")
    if rank and not targets:
        raise ValueError(f"model.lora.targets is empty; valid targets: {', '.join(LORA_TARGETS)}")
    if dropout != 0.0:
        raise ValueError(f"model.lora.dropout={dropout!r}: only 0.0 is implemented (a dropout that agrees "
                         "across tensor-parallel ranks needs megatron's RNG tracker)")
    if export not in LORA_EXPORTS:
        raise ValueError(f"model.lora.export={export!r}: one of {', '.join(LORA_EXPORTS)}")
