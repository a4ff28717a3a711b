"""What a step runs with on this rank, shared by training steps (loop.py), validation (validation.py) and the
parity tools: the boundary communicators, the rank's stages over a step's microbatches, the EVS tubelet settle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.data.pipeline import settles_tubelet_chunks
from tessera.hetero.plan.encoder_balance import ItemAssignment
from tessera.hetero.plan.layout import LANGUAGE, VISION
from tessera.hetero.runtime.boundary import BoundaryCommunicator
from tessera.hetero.runtime.tubelet_settle import TubeletSettle
from tessera.hetero.build.run_state import RunState
from tessera.hetero.training.stages import LanguageStage, MediaEncoderStage, global_token_count


def run_loader(run: RunState, path: str, state=None, num_workers: int | None = None,
               log_skips: bool | None = None):
    """This rank's loader of `path` as the run reads it: the run's tokenizer, encoders, row split, item
    assignment and decode plan, and media settings (data/pipeline.build_train_loader); the training stream and every validation set."""
    from tessera.data.pipeline import build_train_loader, split_of

    d = run.cfg.data
    return build_train_loader(path, run.tok_path, run.encoders, d.seq_length,
                              run.resolved.rows_per_microbatch, decode=run.resolved.decode_items(run.rank),
                              assignment=item_assignment(run),
                              num_workers=d.num_workers if num_workers is None else num_workers, seed=d.seed,
                              max_tiles=d.max_tiles, video_frames=d.video_frames, caption_prompt=d.caption_prompt,
                              video_pruning=run.cfg.model.video_pruning, state=state, chat_template=run.chat_template,
                              log_skips=run.rank == 0 if log_skips is None else log_skips,
                              # on GPUs, upscaling small media is left to the GPU (models/tiling.py)
                              defer_upscale=run.device.type != "cpu", split=split_of(path))


def item_assignment(run: RunState) -> ItemAssignment:
    """Which DP rank of each encoder encodes each item of a microbatch: by the item's FLOPs (the planner's count,
    run.step_flops) when data.balance_encoders, else with its row. Every rank's loader holds the same."""
    by_cost = run.cfg.data.balance_encoders and run.step_flops is not None
    return ItemAssignment(run.resolved.encoder_dp_sizes(), run.step_flops.item_flops if by_cost else None)


def rank_stages(run: RunState, batches: list, settle: TubeletSettle | None = None
                ) -> tuple[dict[str, MediaEncoderStage], LanguageStage | None, int]:
    """(encoder stages, LLM stage or None, global target tokens) of this rank over a step's global microbatches;
    the LLM's loss is divided by the target tokens of all of them."""
    layout, groups, modules = run.layout, run.groups, run.modules
    total = global_token_count(batches)
    enc = {k: MediaEncoderStage(modules[k], k, layout[k], groups[k].coord, batches, run.device, groups[k].pgs.cp)
           for k in modules if k != LANGUAGE}
    lang = (LanguageStage(modules[LANGUAGE], layout[LANGUAGE], groups[LANGUAGE].coord, batches, total, run.device,
                          settle) if LANGUAGE in modules else None)
    return enc, lang, total


@dataclass(frozen=True)
class StepContext:
    """What every step of a run shares on this rank (training steps, validation passes, the parity tools)."""

    comms: dict[str, BoundaryCommunicator]  # encoder key -> its boundary communicator into the LLM's layout
    like: torch.Tensor  # an empty tensor of the run's dtype on the rank's device: what received activations become
    hosts_loss: bool  # this rank holds the step's loss (the LLM's last stage, TP rank 0)
    settle: TubeletSettle | None  # the EVS tubelet settle at the vision boundary, when the run writes tubelet chunks


def step_context(run: RunState) -> StepContext:
    """The run's StepContext. Collective: every rank builds it alike (the settle creates a process group)."""
    comms = {k: BoundaryCommunicator(run.layout[k], run.layout[LANGUAGE], run.configs[LANGUAGE].hidden_size,
                                     run.dtype, run.device, dst_format="dense") for k in sorted(run.layout.encoders)}
    like = torch.empty(0, dtype=run.dtype, device=run.device)
    hosts_loss = (LANGUAGE in run.modules and run.groups[LANGUAGE].last_stage
                  and run.groups[LANGUAGE].coord.tp == 0)
    return StepContext(comms, like, bool(hosts_loss), _tubelet_settle(run))


def _tubelet_settle(run: RunState) -> TubeletSettle | None:
    """The exchange that settles EVS-pruned clips' tubelet chunks at the vision boundary, when the run writes
    them (data/pipeline.settles_tubelet_chunks); built on every rank alike (it creates a process group)."""
    if not settles_tubelet_chunks(run.encoders, run.cfg.model.video_pruning):
        return None
    return TubeletSettle(run.layout, VISION, run.device)


def boundary_batches(batches: list, layout, settle: TubeletSettle | None) -> list[dict]:
    """Each microbatch's boundary batch per encoder, for hetero_step; the vision one settled inside its boundary
    op when the run prunes clips written in tubelet chunks."""
    settled = settle.key if settle is not None else None  # built inside its boundary op instead
    out = [b.boundary_batches([k for k in sorted(layout.encoders) if k != settled]) for b in batches]
    if settle is not None:
        for mb, (b, per_key) in enumerate(zip(batches, out)):
            per_key[settle.key] = settle.lazy(b, mb)
    return out
