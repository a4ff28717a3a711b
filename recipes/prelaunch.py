"""Checks of a run's *inputs* before anything is launched: data, tokenizer, checkpoint to start from.

    from tessera.recipes.prelaunch import check_inputs
    check_inputs(task)            # task.model / task.data / task.trainer as in hetero/runspec/config.py; ValueError

recipes/cli.py calls it at the end of TesseraRunContext.parse_fn, so a missing tokenizer or a checkpoint
directory without weights fails in a second on the submitting machine, with the fix named, instead of on
every rank minutes later (sentencepiece's `NOT_FOUND ".../tokenizer.model"`). What is checked:

  data.path        None = synthetic data. A directory must be a prepared dataset (DIR/.nv-meta, as
                   scripts/prepare_data.py or `energon prepare` write); a file must be an energon metadataset
                   YAML (a blend). Every dataset's sample type must be one data/sample_types.py turns into a
                   conversation (refused naming the supported ones). A directory's train split must hold a shard.
  data.tokenizer   the run's tokenizer (data/run_tokenizer.run_tokenizer: data.tokenizer, else the checkpoint's
                   own, else the dataset's; a blend YAML has none of its own) exists and loads, with Tessera's
                   template and media tokens, and agrees with the checkpoint's config.json (media token ids,
                   vocabulary): a released model is never fine-tuned with another tokenizer's ids; with
                   synthetic data too (the synthetic set's tokenizer, made here).
  data.chat_template  release (a checkpoint's own chat template) renders a conversation and its assistant turns
                   are found (data/release_prompt.py); project: a note when the checkpoint's template differs.
  model.checkpoint an HF-layout directory with *.safetensors, or a Tessera `checkpoints/` directory whose
                   `latest` names a complete step.

On a remote cluster (run.executor.ssh_host) the paths live on the cluster: nothing is checked here.
Full-size recipes on synthetic data or from random weights are printed as a loud warning
(full_size_warnings; recipes/train.py prints it again on rank 0 of the job).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from tessera.recipes.full_size import RECIPES as FULL_SIZE

FULL_SIZE_LLMS = frozenset(r.llm for r in FULL_SIZE.values())


def is_full_size(model) -> bool:
    return model.llm in FULL_SIZE_LLMS


def full_size_warnings(model, data) -> list[str]:
    """Banner lines for a full-size model that would train on synthetic data or from random weights."""
    if not is_full_size(model):
        return []
    what = []
    if data.path is None:
        what.append("on SYNTHETIC data (96 generated samples, data.path unset): set data.path=DIR (a dataset "
                    "from scripts/prepare_data.py) to train on yours")
    if not model.checkpoint:
        what.append("from RANDOM weights (model.checkpoint unset): set model.checkpoint=HF_DIR (*.safetensors) "
                    "or a Tessera checkpoints/ directory to fine-tune released weights")
    if not what:
        return []
    bar = "!" * 100
    return [bar, *(f"!! WARNING: full-size model {model.llm} trains {w}" for w in what), bar]


def _check_tokenizer(path: Path, source: str) -> None:
    if not path.exists():
        raise FileNotFoundError(path)
    from tessera.data.tokens import Tokenizer

    try:
        Tokenizer(path)
    except Exception as e:  # sentencepiece / tokenizers errors: say which file and what to do
        raise ValueError(f"{source}: tokenizer {path} does not load ({type(e).__name__}: {e}); give a "
                         f"SentencePiece .model or a tokenizer.json with Tessera's special tokens "
                         f"(scripts/prepare_data.py trains one)") from None


def check_data(data, checkpoint: str | None = None) -> None:
    """data.path and the run's tokenizer (`checkpoint`: model.checkpoint, whose own tokenizer comes before the
    dataset's)."""
    from tessera.data.pipeline import SYNTHETIC_VAL, val_sets
    from tessera.data.run_tokenizer import run_tokenizer

    for name, val in val_sets(data.val_path, data.path).items():  # the held-out sets: named, existing, prepared
        if val != SYNTHETIC_VAL:
            _check_dataset(f"data.val_path ({name})", val)
    if data.path is None:
        if data.tokenizer:
            _tokenizer_given(data.tokenizer)
        return
    _check_dataset("data.path", data.path)
    if data.tokenizer:
        _tokenizer_given(data.tokenizer)
        return
    choice = run_tokenizer(None, checkpoint, data.path)
    _check_tokenizer(Path(choice.path), choice.source)


def _check_dataset(field: str, value: str) -> None:
    """A prepared dataset directory or an energon blend YAML, named by the field that gave it; data.path's blend
    of several (NAME=DIR[:W];..., data/blend.py) member by member."""
    from tessera.data.blend import is_blend_spec, parse_blend_spec

    if field == "data.path" and is_blend_spec(value):
        for member in parse_blend_spec(value):
            _check_dataset(f"data.path ({member.name})", str(member.path))
        return
    path = Path(value).expanduser()
    other = "drop data.path for synthetic data" if field.startswith("data.path") else "data.val_path=synthetic"
    if not path.exists():
        raise ValueError(f"{field}={value} does not exist; prepare a dataset there with "
                         f"`python scripts/prepare_data.py --manifest data.jsonl --out {value}` (or {other})")
    if path.is_dir():
        if not (path / ".nv-meta").is_dir():
            raise ValueError(f"{field}={value} is not a prepared dataset (no {path / '.nv-meta'}); run "
                             f"`python scripts/prepare_data.py ... --out {value}` or `energon prepare {value}`")
        if field.startswith("data.path"):
            _check_train_split(value, path)
    elif path.suffix not in (".yaml", ".yml"):
        raise ValueError(f"{field}={value} is a file but not an energon metadataset YAML (a blend); give a "
                         f"prepared dataset directory or a .yaml blend")
    from tessera.data.sample_types import UnsupportedSampleType, check_sample_types

    try:  # every dataset's sample type (a blend's too) is one the loader turns into a conversation
        check_sample_types(path)
    except UnsupportedSampleType as e:
        raise ValueError(f"{field}={value}: {e}") from None


def _check_train_split(value: str, path: Path) -> None:
    """Training reads the dataset's train split: an empty one (all shards held out as val) otherwise fails every
    rank with energon's EmptyDatasetError, minutes in."""
    from tessera.data.prepare_split import split_parts

    parts = split_parts(path)
    if parts is not None and not parts.get("train"):
        held = ", ".join(k for k, v in parts.items() if v) or "no split"
        raise ValueError(f"data.path={value} has no shard in its train split ({path / '.nv-meta' / 'split.yaml'}: "
                         f"its shards are in {held}); re-run scripts/prepare_data.py into an empty "
                         f"--out (it keeps a train shard: a lower --shard-size or --val-ratio chooses how many), "
                         f"or `energon prepare {value}` with a train share")


def _tokenizer_given(tokenizer: str) -> None:
    path = Path(tokenizer).expanduser()
    if not path.is_file():
        raise ValueError(f"data.tokenizer={tokenizer} is not a file; give a SentencePiece .model or a "
                         f"tokenizer.json (or drop data.tokenizer to use the checkpoint's or the dataset's own)")
    _check_tokenizer(path, f"data.tokenizer={tokenizer}")


def check_checkpoint(model) -> None:
    """model.checkpoint is one of the kinds hetero/checkpoint/source.py decides, complete, before any rank starts."""
    from tessera.hetero.checkpoint.source import HF_LAYOUT, LATEST, RUN, checkpoint_source

    source = checkpoint_source(model.checkpoint)
    if source is None:
        return
    path = source.path
    if not path.is_dir():
        raise ValueError(f"model.checkpoint={model.checkpoint} is not a directory; give an HF-layout directory "
                         f"(*.safetensors; `python -m tessera.scripts.convert_hf` writes one) or a Tessera "
                         f"run's checkpoints/ directory")
    if source.kind in HF_LAYOUT and any(path.glob("*.safetensors")):
        from tessera.models import released
        from tessera.models.nemotron_h_hf import safetensors_files

        safetensors_files(path)  # every shard the index names is present
        if source.is_release:  # its config.json defines the model: parse it now
            config = source.release_config()
            released.llm_fields_of(config)
            for modality in released.modalities_of(config):
                released.encoder_config_of(released.encoder_name(path, modality))
        return
    if source.kind == RUN:
        return
    latest = path / LATEST
    if latest.is_file():  # a checkpoints/ directory whose last complete step is gone
        step = path / latest.read_text().strip()
        raise ValueError(f"model.checkpoint={model.checkpoint}: `latest` names {step.name}, which is missing; "
                         f"point model.checkpoint at a checkpoints/ directory whose last save completed")
    hint = (f"; did you mean model.checkpoint={path / 'checkpoints'}?" if (path / "checkpoints" / "latest").is_file()
            else "")
    raise ValueError(f"model.checkpoint={model.checkpoint} holds neither *.safetensors (an HF-layout checkpoint) "
                     f"nor a `latest` file (a Tessera checkpoints/ directory){hint or '; give one of those'}")


def check_tokenizer_agreement(data, model) -> None:
    """The run's tokenizer against model.checkpoint's config.json (data/run_tokenizer.check_agreement), then the
    prompt format (check_prompt_format). Synthetic data with no tokenizer given or in the checkpoint trains with
    the synthetic set's: made here as the ranks would make it (data/pipeline.synthetic_dataset, cached where they
    read it) and checked, when the checkpoint has a config.json whose ids it must have."""
    from tessera.data.run_tokenizer import check_agreement, checkpoint_config, own_tokenizer, run_tokenizer
    from tessera.data.tokens import Tokenizer

    if not model.checkpoint:
        return
    path = data.path
    if path is None and not data.tokenizer and own_tokenizer(model.checkpoint) is None:
        if not checkpoint_config(model.checkpoint):
            return  # a Tessera checkpoints/ directory: the ranks hold the tokenizer to the model they build
        from tessera.data.pipeline import synthetic_dataset, synthetic_kinds, synthetic_root
        from tessera.hetero.runspec.modules import encoder_names

        path = str(synthetic_dataset(synthetic_root(), kinds=synthetic_kinds(encoder_names(model)))[0])
    choice = run_tokenizer(data.tokenizer, model.checkpoint, path)
    if path != data.path and choice.source.startswith("data.path="):
        choice = replace(choice, source="the synthetic data set's: data.path unset")
    tok = Tokenizer(choice.path)
    check_agreement(tok, model.checkpoint, source=choice.source)
    check_prompt_format(data, model, tok)


def check_prompt_format(data, model, tok) -> None:
    """data.chat_template=release with a checkpoint that ships a chat template: the template renders a conversation
    with media and its assistant turns are found (data/release_prompt.py), and `tok` tokenizes it as the release's
    processor does (a tokenizer.json). data.chat_template=project: a note when the checkpoint's template renders
    turns otherwise (data/run_tokenizer.chat_template_note)."""
    from tessera.data.release_prompt import ChatTemplateError, assistant_spans, release_messages
    from tessera.data.run_tokenizer import chat_template_note, run_chat_template

    template = run_chat_template(data.chat_template, model.checkpoint)
    if template is None:
        note = chat_template_note(model.checkpoint)
        if note:
            print(note, file=sys.stderr, flush=True)
        return
    probe = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image> What is it?"},
             {"role": "assistant", "content": "A circle."}, {"role": "user", "content": "And <audio>?"},
             {"role": "assistant", "content": "A tone."}]
    try:
        assistant_spans(template, release_messages(probe, template))
    except ChatTemplateError as e:
        raise ValueError(f"model.checkpoint={model.checkpoint}: {e}") from None
    tok.encode_with_offsets("")  # a SentencePiece model: refused naming the fix


def _remote(executor) -> bool:
    tunnel = getattr(executor, "tunnel", None)
    return tunnel is not None and type(tunnel).__name__ == "SSHTunnel"


def check_inputs(task, executor=None, dryrun: bool = False) -> None:
    """Raise ValueError naming the input that is missing or wrong and the fix. `executor`: the run's
    executor (an SSH-tunnelled Slurm executor's paths are on the cluster and are not checked); `dryrun`:
    report a problem as a note instead (a dry run shows the resolved config, inputs may come later)."""
    for line in full_size_warnings(task.model, task.data):
        print(line, file=sys.stderr, flush=True)
    if _remote(executor):
        print("note: inputs (data.path, data.tokenizer, model.checkpoint) are on the cluster; not checked here",
              file=sys.stderr, flush=True)
        return
    try:
        check_data(task.data, task.model.checkpoint)
        check_checkpoint(task.model)
        check_tokenizer_agreement(task.data, task.model)
    except ValueError as e:
        if not dryrun:
            raise
        print(f"note (a real launch stops here): {e}", file=sys.stderr, flush=True)


# ---- saves before a Slurm time limit ----------------------------------------------------------------------

# What one rank writes per second to a cluster's parallel file system while saving (its share of a node's few
# GB/s): used to estimate how long the save on the signal takes, from the planner's weights + optimizer bytes.
SAVE_BYTES_PER_S_PER_RANK = 1.0e9


def save_schedule_problems(trainer, time_limit_s: int, signal_spec: str | None, step_s: float,
                           save_s: float) -> tuple[list[str], list[str]]:
    """(errors, warnings) about a Slurm job keeping its work: a save on the signal must fit in the grace
    torchrun gets (a step + the save), and without a usable signal a periodic save must come before the limit.
    step_s / save_s: the planner's step time and the estimated save time of the run's layout."""
    from tessera.recipes.slurm_signal import STOP_SIGNALS, shutdown_grace_s, slurm_signal

    errors, warnings = [], []
    sig, lead = slurm_signal(signal_spec)
    periodic = [trainer.save_every * step_s if trainer.save_every else None,
                trainer.save_interval_minutes * 60 + step_s if trainer.save_interval_minutes else None]
    first = min((t for t in periodic if t is not None), default=None)
    hours = lambda t: f"{t / 3600:.1f} h"  # noqa: E731
    when = (f"the first periodic save comes after {hours(first)} (trainer.save_every={trainer.save_every}, "
            f"trainer.save_interval_minutes={trainer.save_interval_minutes}, {step_s:.1f} s per step as the planner "
            f"prices this layout)" if first is not None else "no periodic save is set (trainer.save_every=0, "
            "trainer.save_interval_minutes=0)")
    suggest = max(1, int((time_limit_s / 4) / 60))
    if sig is None or sig not in STOP_SIGNALS:
        if first is None or first + save_s > time_limit_s:
            why = ("run.executor.signal is unset or goes to the batch shell only (B:)" if sig is None else
                   f"run.executor.signal={signal_spec} sends SIG{sig}, which the ranks do not save on (TERM, USR1)")
            errors.append(f"no checkpoint would be written before the job's time limit ({hours(time_limit_s)}): {why}, "
                          f"and {when}. Set run.executor.signal=TERM@300 (the ranks save on it), or "
                          f"trainer.save_interval_minutes={suggest}")
        return errors, warnings
    grace = shutdown_grace_s(signal_spec)
    if step_s + save_s > grace:
        need = int(step_s + save_s) + 1 + 30
        errors.append(f"run.executor.signal={signal_spec} leaves the ranks {grace} s between the signal and the "
                      f"launcher's kill, but finishing a step ({step_s:.0f} s) and saving it (~{save_s:.0f} s) takes "
                      f"longer: set run.executor.signal={sig}@{max(need, lead + 60)}")
    if first is None or first + save_s > time_limit_s - lead:
        warnings.append(f"every allocation keeps only the checkpoint saved on SIG{sig} before its limit "
                        f"({hours(time_limit_s)}): {when}; a crash before then loses the allocation's work. Set "
                        f"trainer.save_interval_minutes={suggest} to also save on time")
    return errors, warnings


def check_save_schedule(task, executor, dryrun: bool = False) -> None:
    """For a Slurm job on GPUs: the planner's step time for the run's layout against the time limit and the
    signal's grace (save_schedule_problems). Errors raise ValueError (notes in a dry run); warnings print."""
    import nemo_run as run

    if not isinstance(executor, run.SlurmExecutor) or not executor.gpus_per_node or not task.layout:
        return  # CPU jobs: the planner prices GPUs, its step time says nothing about them
    from tessera.hetero.planner.run_layout import price_run
    from tessera.hetero.runspec.config import RunConfig
    from tessera.recipes.slurm_signal import slurm_time_s

    pred = price_run(RunConfig(task.name, task.layout, task.model, task.data, task.optim, task.trainer), task.layout)
    if not pred.feasible:
        return  # the layout checks say why; no step time to compare
    save_s = max(pred.state_gib.values(), default=0.0) * 2**30 / SAVE_BYTES_PER_S_PER_RANK
    errors, warnings = save_schedule_problems(task.trainer, slurm_time_s(executor.time), executor.signal,
                                              pred.step_s, save_s)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr, flush=True)
    if errors and not dryrun:
        raise ValueError(errors[0])
    for e in errors:
        print(f"note (a real launch stops here): {e}", file=sys.stderr, flush=True)
