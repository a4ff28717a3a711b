"""Tiny random NemotronH checkpoints, built offline with transformers (no hub, no remote code).

Every parameter and the router's expert bias are perturbed away from their structured init (ones,
zeros, arange), so a wrong mapping of any tensor (A_log, D, dt_bias, norms, e_score_correction_bias)
changes the logits and fails parity.
"""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_checkpoint(fields: dict, out_dir: str | Path, seed: int = 0) -> Path:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms, A_log, D, dt_bias, conv bias: centred on their init, varied
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def unit_gain_(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """A tiny release's weights at unit gain instead of std 0.02 (matrices ~ N(0, 1/fan_in)), and its constant
    vectors (norm weights, biases) varied, so its logits move visibly with any wrong tensor; in place."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5 if p.shape[0] > 1 else 0.5)
            elif p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(0.2 * torch.randn_like(p))
    return model
