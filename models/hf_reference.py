"""The single-device side of logit parity with transformers' NemotronH: a fixed batch and the reference.

transformers' NemotronHForCausalLM (float32, torch path) loaded from a local HF directory gives the reference
logits of `fixed_batch`; `max_rel_err = max|ours - ref| / max|ref|`. The command that runs Tessera's HybridLM
in a TP/PP/CP layout against it is hetero/tools/parity.py (`torchrun ... -m tessera.hetero.tools.parity`):
process groups live there, so models/ keeps no import of torch.distributed or hetero/.
"""

from __future__ import annotations

import math

import torch

BATCH, SEQ, SEED = 2, 37, 1234  # SEQ not a multiple of typical chunk sizes: exercises the padding


def seq_length(cp: int = 1, sp_tp: int = 1) -> int:
    """SEQ, cut to a multiple of 2*cp so the zigzag layout gives every CP rank two equal chunks, and under
    sequence parallelism over sp_tp ranks to one where each CP rank's positions split over them."""
    step = math.lcm(2 * cp if cp > 1 else 1, cp * sp_tp)
    return SEQ - SEQ % step


def fixed_batch(vocab_size: int, length: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, length), generator=torch.Generator().manual_seed(SEED))


def reference_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import NemotronHForCausalLM

    ref = NemotronHForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(input_ids).logits.float()


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()
