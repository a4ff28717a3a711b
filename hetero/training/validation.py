"""Validation: the loss on held-out data, forward only through the run's layout, the same in every layout.

    data.val_path=synthetic | DIR | BLEND.yaml | "NAME=DIR;NAME=BLEND.yaml" | auto    (data/pipeline.val_sets)
    trainer.val_every=N (0: only after the last step)   trainer.val_steps=K (global batches per set and pass)

A pass reads each set's first K x microbatches global microbatches from its start with the data seed, in the
run's tokenizer and row split: the same batches at every pass and after a resume, so there is no loader state
to save and passes compare. It runs them as one forward-only step (hetero_step(forward_only=True) under
no_grad, every module in eval mode for the pass: BatchNorm uses its running statistics, the MoE router counts no
tokens) and reports the token-weighted mean loss over all of them, `val/<name>/loss` in metrics.jsonl and
TensorBoard. The loss is summed over the ranks that hold it, as the training loss is, so every layout of one
run reports the same number (tests/test_validation.py: two layouts within 1e-6).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.data.loader import close_loader
from tessera.data.pipeline import SYNTHETIC_VAL_SET, synthetic_root
from tessera.hetero.runtime.step_executor import hetero_step
from tessera.hetero.build.run_state import RunState
from tessera.hetero.training.step_parts import StepContext, boundary_batches, rank_stages, run_loader


def resolve_val_sets(spec: str | None, rank: int, train_path: str | None = None,
                     kinds: tuple[str, ...] | None = None) -> dict[str, str]:
    """{name: dataset path} of data.val_path (data/pipeline.val_sets; "auto" follows `train_path`, data.path); the
    held-out synthetic set made by rank 0, of the model's media `kinds` (data/pipeline.synthetic_kinds)."""
    from tessera.data.pipeline import SYNTHETIC_VAL, synthetic_dataset, val_sets

    sets = val_sets(spec, train_path)
    if SYNTHETIC_VAL in sets.values():
        root = synthetic_root() / "val"
        if rank == 0:
            synthetic_dataset(root, **SYNTHETIC_VAL_SET, kinds=kinds)
        dist.barrier()
        path = str(synthetic_dataset(root, **SYNTHETIC_VAL_SET, kinds=kinds)[0])
        sets = {name: path if p == SYNTHETIC_VAL else p for name, p in sets.items()}
    return sets


def describe_val_sets(spec: str | None, train_path: str | None, sets: dict[str, str]) -> str:
    """The line a run starts with: which sets it validates on, and why none when none."""
    from tessera.data.pipeline import AUTO_VAL, split_of

    if sets:
        return "validation sets: " + ", ".join(f"{name} = {path}" + (f" (its {split_of(path)} split)"
                                                                     if split_of(path) != "train" else "")
                                               for name, path in sets.items())
    if (spec or "").strip() == AUTO_VAL:
        return (f"validation: none (data.val_path=auto: data.path={train_path} has no val split; prepare it with "
                f"scripts/prepare_data.py --val-ratio R, or set data.val_path=DIR)")
    return "validation: none (data.val_path unset)"


def _batches(run: RunState, path: str, count: int) -> list:
    """The set's first `count` global microbatches, from its start (a fresh loader with the data seed)."""
    # one process, from the start; the training stream's loader logs skip examples already
    loader = run_loader(run, path, num_workers=0, log_skips=False)
    try:
        it = iter(loader)
        return [next(it) for _ in range(count)]
    finally:
        close_loader(loader)


def validation_loss(run: RunState, path: str, steps: int, ctx: StepContext) -> float:
    """The mean loss per target token over `steps` global batches of the set at `path` (every rank calls it)."""
    batches = _batches(run, path, steps * run.resolved.microbatches)
    enc, lang, _ = rank_stages(run, batches, ctx.settle)
    modes = {m: m.training for module in run.modules.values() for m in module.modules()}
    try:
        for module in run.modules.values():
            module.eval()
        with torch.no_grad():
            result = hetero_step(run.layout, run.groups, enc, lang, ctx.comms,
                                 boundary_batches(batches, run.layout, ctx.settle), ctx.like, forward_only=True)
    finally:
        # each part back in its own mode (frozen towers and LoRA bases stay in eval): set one by one, since train()
        # recurses into children and a part reached from two parents would take the later parent's mode
        for m, training in modes.items():
            m.training = training
    loss = torch.tensor([float(result.loss) if ctx.hosts_loss else 0.0], dtype=torch.float64, device=run.device)
    dist.all_reduce(loss)
    return float(loss)


def validate(run: RunState, sets: dict[str, str], steps: int, ctx: StepContext) -> dict[str, float]:
    """{set name: loss} of every set (data/pipeline.val_sets), in order (RunMetrics.log_val logs val/<name>/loss)."""
    return {name: validation_loss(run, path, steps, ctx) for name, path in sets.items()}
