"""The first-step loss of a release's samples, Tessera's training step against the oracle's cross entropy.

    res = first_step_loss(hf_dir, layout)   # collective over every rank; {loss, oracle_loss, targets, layout}

The samples and the modules are the parity tool's (hetero/tools/parity_multimodal.py: release_samples,
release_run, packed_batch): one sample a row, DIR's modules built and loaded as a fine-tune of DIR in fp32. The
targets: every next token of a sample that is text (never a media placeholder), as the packer labels a document
(data/packing.py: labels[t] = tokens[t + 1]). Tessera's side is one hetero_step with the trainer's own
LanguageStage (its per-token loss summed and divided by the step's target count, hetero/training/stages.py),
before any update; the oracle's is the mean cross entropy of its logits (transformers' Omni class, or the Nano
V2 VL assembled from transformers' parts: models/nano_vl_reference.py) at the same targets.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.data.packing import IGNORE
from tessera.hetero.plan.layout import LANGUAGE
from tessera.hetero.runtime.groups import destroy_module_groups
from tessera.hetero.runtime.step_executor import hetero_step
from tessera.hetero.tools.parity_multimodal import (hf_reference_outputs, packed_batch, release_run, release_samples,
                                                    seq_length_for)
from tessera.hetero.training.stages import LanguageStage, MediaEncoderStage
from tessera.hetero.training.step_parts import boundary_batches, step_context
from tessera.models.hf_reference import OMNI_SEED, omni_token_ids


def text_targets(tokens: torch.Tensor, placeholders: set[int]) -> torch.Tensor:
    """labels [n] of one document: tokens[t + 1] where that is text, IGNORE at placeholders and the last token."""
    nxt = tokens[1:]
    keep = ~torch.isin(nxt, torch.tensor(sorted(placeholders)))
    return torch.cat([torch.where(keep, nxt, IGNORE), torch.tensor([IGNORE])])


def oracle_loss(ref_logits, samples, placeholders: set[int]) -> tuple[float, int]:
    """(mean cross entropy over every sample's text targets, their count) of the oracle's logits."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for logits, s in zip(ref_logits, samples):
        labels = text_targets(s.tokens, placeholders)
        total += F.cross_entropy(logits.double(), labels, ignore_index=IGNORE, reduction="sum")
        count += int((labels != IGNORE).sum())
    return float(total / count), count


def first_step_loss(hf_dir: str, layout: str = "", seed: int = OMNI_SEED) -> dict:
    """Tessera's first-step loss of DIR's samples in `layout` and the oracle's (module docstring), on every rank."""
    hf_dir = str(Path(hf_dir).expanduser().resolve())
    samples = release_samples(hf_dir, seed)
    placeholders = set(omni_token_ids(hf_dir)[:2])
    seq = seq_length_for(samples)
    run = release_run(hf_dir, layout, len(samples), seq)
    batch = packed_batch(samples, seq)
    for r, s in enumerate(samples):
        batch.labels[r, : len(s.tokens)] = text_targets(s.tokens, placeholders)
    targets = int((batch.labels != IGNORE).sum())
    ctx = step_context(run)
    hetero, device = run.layout, run.device
    enc = {k: MediaEncoderStage(run.modules[k], k, hetero[k], run.groups[k].coord, [batch], device,
                                 run.groups[k].pgs.cp)
           for k in run.modules if k != LANGUAGE}
    lang = (LanguageStage(run.modules[LANGUAGE], hetero[LANGUAGE], run.groups[LANGUAGE].coord, [batch], targets,
                          device, ctx.settle) if LANGUAGE in run.modules else None)
    result = hetero_step(hetero, run.groups, enc, lang, ctx.comms, boundary_batches([batch], hetero, ctx.settle),
                         ctx.like)
    # [Tessera's loss: the shares of the last stage's TP-rank-0 ranks, the oracle's loss]
    out = torch.zeros(2, dtype=torch.float64, device=device)
    if ctx.hosts_loss:
        out[0] = result.loss.double()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    if run.rank == 0:
        out[1] = oracle_loss(hf_reference_outputs(hf_dir, seed), samples, placeholders)[0]
    dist.broadcast(out[1:], src=0)
    if ctx.settle is not None:
        ctx.settle.close()
    destroy_module_groups(run.groups)
    return {"loss": float(out[0]), "oracle_loss": float(out[1]), "targets": targets, "layout": str(hetero)}


__all__ = ["first_step_loss", "oracle_loss", "text_targets"]
