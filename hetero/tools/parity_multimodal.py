"""Logit parity of Tessera's multimodal model in a heterogeneous layout with transformers' released Omni model.

    python -m tessera.scripts.tiny_release --out /tmp/omni                                    # a tiny release
    python -m tessera.hetero.tools.parity --hf-dir /tmp/omni                                  # one rank
    torchrun --nproc-per-node 4 -m tessera.hetero.tools.parity --hf-dir /tmp/omni \\
        --layout "vision=dp2@0-1;audio=dp2@0-1;language=tp2@2-3"                              # non-colocated
    torchrun --nproc-per-node 2 -m tessera.hetero.tools.parity --hf-dir /tmp/omni \\
        --layout "vision=tp2@0-1;audio=dp2@0-1;language=tp2@0-1"                              # colocated
    (also language=pp2@2-3, language=cp2@2-3, ...: any layout the trainer can run; torchrun sets the world)
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_parity_multimodal.py -q -s      # the tests

hetero/tools/parity.py dispatches here when DIR's config.json is a NemotronH_Omni_Reasoning_V3 (model_type
nemotron_h_omni); a NemotronH (LLM only) checkpoint keeps its --tp/--pp/--cp path. No --layout: every module
data-parallel on every rank (one rank under plain `python -m`); the layout is resolved as a training run resolves
it, so a layout of fewer ranks than the world is grown by DP, and every module's DP must divide the 4 rows.

The inputs (models/hf_reference.omni_samples): an image sample (two tiles), an audio sample, a mixed one (text,
image, text, audio, text) and a mixed one audio first, random from a fixed seed; placeholder ids are the
config's image/audio token ids (or, when the config sets none, the last vocabulary ids, on both sides);
placeholder counts are the encoders' own token arithmetic. One sample per row, no packing.

Tessera's side is the trainer's, not a re-implementation: the layout resolved as a run resolves it
(hetero/runspec/modules.resolve_config), the module groups, this rank's modules built and loaded from
DIR as a fine-tuning run builds them (hetero/build/model_build: build_rank_modules, check_checkpoint_tensors,
load_full_state on a LazyCheckpoint), the boundary communicators of hetero/training/loop, the stages of
hetero/training/stages.py and one hetero_step (hetero/runtime/step_executor.py) on a fixed PackedBatch. The only
change is at the LLM's last stage: the stage returns its logits instead of the per-token loss (`_LogitsOnly`,
the loss it hands the step is 0 so the backward the schedule runs is a no-op on values). Each last-stage TP
rank 0 sends (its DP rows, its zigzag CP positions, the TP-gathered logits without vocabulary padding) to rank
0, which places them, checks that every position of every row came exactly once, and compares with
transformers' NemotronH_Omni_Reasoning_V3 on each sample alone (fp32, eval mode but the conformer's BatchNorm,
which normalises each clip with its own statistics as Tessera's training step does; models/hf_reference.py):
    max_rel_err = max|ours - ref| / max|ref| over every real-vocabulary logit of every sample.
Rank 0 prints `parity: PASS max_rel_err=...` (<= --tol, default 1e-4) or `parity: FAIL ...` (exit 1).

Video: when the trainer's model build encodes DIR's video as the release does (tubelets of the ViT's temporal
patch, the omni family: models/encoders.video_temporal), the audio sample also holds a 5-frame clip after its audio
("audio_video") in the release's per-tubelet <img> ... </img> chunks, pruned by EVS at the config's
video_pruning_rate: Tessera's chunks are written at nominal counts and settled at the vision boundary to the
counts its EVS chose (hetero/runtime/tubelet_settle.py, as in training); transformers gets every tubelet's tokens
and prunes them in its forward (models/hf_reference.omni_inputs). The clip ends still, so its last tubelet keeps
nothing and the counts differ from the nominal ones: both sides' logits cover the same sequence only if the
chunks were settled as the release lays them out.
Test-only hook: `compare_multimodal(..., perturb={hf_key: factor})` scales checkpoint tensors as they are read,
so a test can watch parity fail.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tessera.data.packing import IGNORE, PackedBatch
from tessera.hetero.plan.layout import LANGUAGE
from tessera.hetero.runtime.device import current_device
from tessera.hetero.runtime.groups import build_module_groups, destroy_module_groups
from tessera.hetero.runtime.step_executor import hetero_step
from tessera.hetero.build.run_state import RunState
from tessera.hetero.training.step_parts import boundary_batches, step_context
from tessera.hetero.build.model_build import (build_rank_modules, check_checkpoint_tensors, load_full_state,
                                                 module_configs)
from tessera.hetero.runspec.config import DataConfig, ModelConfig, RunConfig
from tessera.hetero.checkpoint.source import checkpoint_llm_fields
from tessera.hetero.runspec.modules import module_specs, resolve_config
from tessera.hetero.training.stages import LanguageStage, MediaEncoderStage
from tessera.models.hf_reference import (OMNI_SEED, OmniSample, omni_reference_logits, omni_samples,
                                         omni_token_ids, video_pruning_rate)
from tessera.models.nemotron_h_hf import LazyCheckpoint
from tessera.models.encoders import video_temporal

VIDEO_NOTE = ("video: compared when the model encodes it as the release does (tubelets of the ViT's temporal "
              "patch, EVS at the config's video_pruning_rate: models/encoders.video_temporal; the omni family)")
VL_VIDEO_NOTE = ("video: compared, frame by frame as the Nano V2 VL release encodes it (one tile a frame, each in "
                 "its own <img> ... </img> chunk)")
# row length rounded up to it: zigzag CP needs a multiple of 2*cp, sequence parallelism (MoE LLMs with TP) one of
# cp*tp; 32 covers the layouts of a few ranks (a larger one is refused by the layout's validation, naming it)
SEQ_MULTIPLE = 32


def model_config(hf_dir: str) -> ModelConfig:
    """The ModelConfig of fine-tuning DIR in fp32: the encoders and the LLM's shape come from DIR's config.json
    (hetero/runspec/modules.released_encoders), not from these registry names."""
    return ModelConfig(vision=None, audio=None, video_pruning=video_pruning_rate(hf_dir), checkpoint=str(hf_dir),
                       dtype="float32")


def seq_length_for(samples: list[OmniSample], multiple: int = SEQ_MULTIPLE) -> int:
    longest = max(len(s.tokens) for s in samples)
    return -(-longest // multiple) * multiple


def packed_batch(samples: list[OmniSample], seq_length: int) -> PackedBatch:
    """One sample per row, padded to seq_length (the padding a document of its own, as the packer makes it);
    every media item decoded on every rank (each rank's stages take only their DP rows)."""
    n = len(samples)
    tokens = torch.zeros(n, seq_length, dtype=torch.long)
    position_ids = torch.zeros(n, seq_length, dtype=torch.long)
    cu, media, positions, meta = [], [], [], []
    for r, s in enumerate(samples):
        k = len(s.tokens)
        tokens[r, :k] = s.tokens
        position_ids[r, :k] = torch.arange(k)
        cu.append(torch.tensor([0, k, seq_length] if k < seq_length else [0, k], dtype=torch.int32))
        row_media, row_pos, row_meta = {}, {}, {}
        for i, (module, kind, item, start, length) in enumerate(s.media):
            row_media.setdefault(module, []).append((kind, item))
            chunks = s.chunks.get(i, ((start, length),))  # a video in tubelet chunks: as the packer records it
            row_pos.setdefault(module, []).extend(np.arange(a, a + n, dtype=np.int64) for a, n in chunks)
            entry = (kind, len(item[0] if kind == "video" else item), length)
            row_meta.setdefault(module, []).append(entry if len(chunks) == 1 else (*entry, chunks))
        media.append(row_media)
        positions.append({m: np.concatenate(p) for m, p in row_pos.items()})
        meta.append(row_meta)
    return PackedBatch(__key__=[s.name for s in samples], __restore_key__=(), __subflavors__=None, __sources__=None,
                       tokens=tokens, labels=torch.full_like(tokens, IGNORE), position_ids=position_ids,
                       cu_seqlens=cu, keys=[[s.name] for s in samples], media=media, positions=positions,
                       media_meta=meta, seq_length=seq_length, skipped={})


class _LogitsOnly(torch.nn.Module):
    """The LLM as LanguageStage drives it, but its last stage returns the vocab-parallel logits: labels are
    dropped, everything else (embedding, media scatter, document ids, pipeline input) is the stage's own."""

    def __init__(self, llm):
        super().__init__()
        self.inner = llm

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, *args, labels=None, **kwargs):
        return self.inner(*args, **kwargs)


class _LogitsStage(LanguageStage):
    def loss(self, logits: torch.Tensor, mb: int) -> torch.Tensor:
        """0, connected to the logits: the schedule's backward then carries zero gradients through every
        module and boundary (its communication still happens, as the schedule requires)."""
        return torch.where(torch.isfinite(logits), logits, 0.0).float().sum() * 0.0


class _Scaled(Mapping):
    """A checkpoint with some tensors scaled as they are read (the test-only `perturb` hook)."""

    def __init__(self, base, factors: dict[str, float]):
        self.base, self.factors = base, factors
        missing = sorted(set(factors) - set(base))
        if missing:
            raise KeyError(f"perturb: no such checkpoint tensors {missing}")

    def __getitem__(self, key):
        t = self.base[key]
        return t * self.factors[key] if key in self.factors else t

    def __iter__(self):
        return iter(self.base)

    def __len__(self):
        return len(self.base)

    def __contains__(self, key):
        return key in self.base

    def shape(self, key):
        return self.base.shape(key)


def _is_nano_vl(hf_dir: str) -> bool:
    from tessera.models.released import HUB_VL, file_layout

    return file_layout(hf_dir) == HUB_VL


def release_samples(hf_dir: str, seed: int) -> list[OmniSample]:
    """The samples of DIR's release: a Nano V2 VL's (tiles cut by its processor's rule, two images, a video of
    per-frame chunks: models/nano_vl_reference.nano_vl_samples), else the Omni's (omni_samples)."""
    if _is_nano_vl(hf_dir):
        from tessera.models.nano_vl_reference import nano_vl_samples

        return nano_vl_samples(hf_dir, seed)
    return omni_samples(hf_dir, seed, _video_temporal(hf_dir))


@functools.lru_cache(maxsize=4)
def hf_reference_outputs(hf_dir: str, seed: int) -> tuple[torch.Tensor, ...]:
    """The oracle's logits of the samples (cached: a test compares several layouts in one process): transformers'
    Omni class, or for a Nano V2 VL (no transformers class) the release assembled from transformers' RadioModel
    and NemotronHForCausalLM (models/nano_vl_reference.py)."""
    samples = release_samples(hf_dir, seed)
    if _is_nano_vl(hf_dir):
        from tessera.models.nano_vl_reference import nano_vl_reference_logits

        return tuple(nano_vl_reference_logits(hf_dir, samples))
    return tuple(omni_reference_logits(hf_dir, samples))


def _video_temporal(hf_dir: str) -> int:
    """Frames per tubelet as the trainer's model build encodes DIR's video (0: frame by frame, not the release's
    function: no video sample)."""
    from tessera.hetero.runspec.modules import encoder_names

    t = video_temporal(encoder_names(model_config(hf_dir)))
    return t if t > 1 else 0


def _eval_but_batchnorm(module: torch.nn.Module) -> None:
    module.eval()
    for m in module.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.train()  # a clip normalised with its own statistics, as in a training step (module docstring)


def release_run(hf_dir: str, layout: str, rows: int, seq: int, perturb: dict[str, float] | None = None) -> RunState:
    """This rank's modules of the release at hf_dir in `layout` over one microbatch of `rows` rows of `seq` tokens,
    built and loaded as a fine-tuning run from DIR builds and loads them (hetero/build/run_state.build_run), in
    fp32, in eval mode but for BatchNorm (each clip's own statistics, as in a training step); `perturb` scales
    loaded weights by name (a break the comparison must see)."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), current_device()
    model_cfg, hf_fields = model_config(hf_dir), checkpoint_llm_fields(hf_dir)
    cfg = RunConfig(layout=layout, model=model_cfg, data=DataConfig(seq_length=seq, rows_per_microbatch=rows,
                                                                    microbatches=1))
    resolved = resolve_config(cfg, world, hf_fields)
    if (resolved.rows_per_microbatch, resolved.microbatches) != (rows, 1):
        raise ValueError(f"layout {resolved.layout}: its DP sizes do not divide the {rows} sample rows")
    groups = build_module_groups(resolved.layout)
    configs = module_configs(resolved.layout, hf_fields)
    modules = build_rank_modules(model_cfg, resolved.layout, groups, configs)
    full = LazyCheckpoint(hf_dir)
    check_checkpoint_tensors(hf_dir, full, model_cfg, hf_fields)
    load_full_state(modules, _Scaled(full, perturb) if perturb else full, groups)
    for m in modules.values():
        m.to(device=device, dtype=torch.float32)
        _eval_but_batchnorm(m)
    # forward only: no data set, tokenizer or optimizer (the samples are built from DIR's config)
    return RunState(cfg, resolved, Path("."), rank, world, device, torch.float32, "", "", hf_fields,
                    module_specs(model_cfg), groups, configs, modules, opt=None, lr_schedule=None)


def compare_multimodal(hf_dir: str, layout: str = "", perturb: dict[str, float] | None = None,
                       seed: int = OMNI_SEED) -> dict:
    """Run the samples through Tessera in `layout` on this world and compare with transformers; collective
    over every rank. Returns, on every rank, {max_rel_err, compared, layout, samples, token_ids_from_config,
    video_note}
(compared: logits compared, every real-vocabulary logit of every sample); raises unless
    exactly every real logit of every sample was compared (so 0.0 never stands for "nothing compared")."""
    hf_dir = str(Path(hf_dir).expanduser().resolve())
    samples = release_samples(hf_dir, seed)
    seq = seq_length_for(samples)
    run = release_run(hf_dir, layout, len(samples), seq, perturb)
    hetero, device, rank, world, hf_fields = run.layout, run.device, run.rank, run.world, run.hf_fields
    batch = packed_batch(samples, seq)
    ctx = step_context(run)
    settle = ctx.settle  # EVS: the video's tubelet chunks settle at the boundary, as in training
    enc = {k: MediaEncoderStage(run.modules[k], k, hetero[k], run.groups[k].coord, [batch], device,
                                 run.groups[k].pgs.cp)
           for k in run.modules if k != LANGUAGE}
    lang = (_LogitsStage(_LogitsOnly(run.modules[LANGUAGE]), hetero[LANGUAGE], run.groups[LANGUAGE].coord, [batch],
                         1, device, settle) if LANGUAGE in run.modules else None)
    result = hetero_step(hetero, run.groups, enc, lang, ctx.comms, boundary_batches([batch], hetero, settle), ctx.like)

    payload = None
    lg = run.groups[LANGUAGE]
    if lg.is_member and lg.last_stage:
        (logits,) = result.outputs
        with torch.no_grad():
            logits = run.modules[LANGUAGE].full_vocab_logits(logits)  # gathered over TP, padding stripped
        if lg.coord.tp == 0:
            payload = (lang.rows.tolist(), lang.pos.tolist(), logits.float().cpu().numpy())
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)

    expected = sum(len(s.tokens) for s in samples) * hf_fields["vocab_size"]
    out = torch.zeros(2, dtype=torch.float64, device=device)  # [max_rel_err, logits compared]
    if rank == 0:
        out[0], out[1] = _score(gathered, samples, seq, hf_reference_outputs(hf_dir, seed))
    dist.broadcast(out, src=0)
    if settle is not None:
        settle.close()
    destroy_module_groups(run.groups)
    if int(out[1].item()) != expected:
        raise RuntimeError(f"parity: {int(out[1].item())} logits compared, expected {expected} (every real-vocabulary "
                           f"logit of {len(samples)} samples)")
    return {"max_rel_err": float(out[0].item()), "compared": expected, "layout": str(hetero),
            "samples": [s.name for s in samples], "token_ids_from_config": omni_token_ids(hf_dir)[2],
            "video_note": VL_VIDEO_NOTE if _is_nano_vl(hf_dir) else VIDEO_NOTE}


def _score(gathered: list, samples: list[OmniSample], seq: int, ref: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    """(max_rel_err, logits compared) from every rank's (rows, positions, logits); -1 compared when a position
    of a row arrived twice or never, or the logits' shape is not transformers'."""
    vocab = ref[0].shape[-1]
    ours = torch.full((len(samples), seq, vocab), float("nan"))
    seen = torch.zeros(len(samples), seq, dtype=torch.long)
    for part in gathered:
        if part is None:
            continue
        rows, pos, logits = part
        logits = torch.from_numpy(logits)
        if logits.shape != (len(rows), len(pos), vocab):
            return 0.0, -1.0
        for i, r in enumerate(rows):
            ours[r, pos] = logits[i]
            seen[r, pos] += 1
    if not bool((seen == 1).all()):
        return 0.0, -1.0
    diff = torch.stack([(ours[r, : len(s.tokens)] - ref[r]).abs().max() for r, s in enumerate(samples)]).max()
    scale = torch.stack([x.abs().max() for x in ref]).max()
    return float(diff / scale), float(sum(x.numel() for x in ref))  # a NaN of ours stays NaN: no PASS


__all__ = ["VIDEO_NOTE", "compare_multimodal", "packed_batch", "seq_length_for"]
