"""Checks that run before anything is launched: registry names, override keys, the layout against the model.

    from tessera.recipes.checks import check_run
    run = check_run(cfg, world_size=4)   # a ResolvedRun (run.layout, run.rows_per_microbatch, ...), or a
                                         # ValueError naming the field and the fix

Every error names what was wrong and lists what exists, so a typo on the CLI fails in a second on the
submitting machine instead of minutes later on every rank of a cluster job. The layout is resolved by the
one function (hetero/plan/resolved_run.resolve_run, the planner proposing layouts for layout=auto), so what passes
here is exactly what trains: recipes/train.py resolves the run with `resolve` below and hands it to the trainer.
Plain data only (no torch, no process groups).
"""

from __future__ import annotations

import dataclasses
import re
import typing

from tessera.hetero.plan.layout import ENCODER_KEYS
from tessera.hetero.plan.recompute import parse_recompute
from tessera.hetero.plan.resolved_run import ResolvedRun
from tessera.hetero.plan.retention import KeepPolicy
from tessera.hetero.planner.run_layout import layout_proposals, price_run
from tessera.hetero.runspec.modules import module_specs, resolve_config
from tessera.models import configs, encoders
from tessera.hetero.runspec.config import check_elastic

MODALITIES = ENCODER_KEYS  # the encoder module keys of a ModelConfig and of a layout


def encoder_names(modality: str | None = None) -> list[str]:
    return encoders.names(modality)


def llm_names() -> list[str]:
    return sorted(configs.REGISTRY)


def check_names(model) -> None:
    """model.llm / model.vision / model.audio must be registered names of the right modality; model.recompute
    must parse (the CLI's model is a run.Config: ModelConfig.__post_init__ has not run yet)."""
    module_specs(model)
    parse_recompute(getattr(model, "recompute", "none"))


def resolve(cfg, world_size: int, llm_fields: dict | None = None, elastic: bool = False,
            planner: bool = True) -> ResolvedRun:
    """The run resolved on `world_size` ranks; for layout=auto the planner proposes (h100 costs). elastic: a
    restart of an elastic job, whose world may differ from the layout's (resolve_run's `elastic`); planner=False:
    without the planner's proposals (an explicit layout only scaled by DP; layout=auto fails)."""
    fits = (lambda spec: _memory_problem(cfg, spec)) if elastic else None
    propose = layout_proposals(cfg, world_size) if planner else None
    return resolve_config(cfg, world_size, llm_fields, propose, elastic=elastic, fits=fits)


def _memory_problem(cfg, spec: str) -> str:
    """Why the planner's memory model says `spec` does not fit (h100, 80 GB), or "". Only memory: the workload
    it prices (media per row) is an estimate, its other verdicts are the trainer's to make."""
    pred = price_run(cfg, spec)
    return pred.reason if not pred.feasible and pred.reason.startswith("memory") else ""


def check_run(cfg, world_size: int) -> ResolvedRun:
    """Names, module keys, and the run resolved and validated for `world_size` ranks (trainability included)."""
    check_names(cfg.model)
    if getattr(cfg.optim, "use_distributed_optimizer", False) and cfg.model.dtype != "bfloat16":
        raise ValueError(f"optim.use_distributed_optimizer=True shards the fp32 master weights of a bf16 run, and "
                         f"model.dtype={cfg.model.dtype!r} has none: set model.dtype=bfloat16 or drop the option")
    KeepPolicy(getattr(cfg.trainer, "keep_last", None), getattr(cfg.trainer, "keep_every", 0))
    check_elastic(getattr(cfg.trainer, "elastic_min_nodes", 0), getattr(cfg.trainer, "elastic_max_restarts", 0))
    return resolve(cfg, world_size)


# ---- override keys --------------------------------------------------------------------------------------

_KEY_RE = re.compile(r"^([A-Za-z_][\w.]*)\s*(?:[-+*/|&]?=)")


def _fields_of(tp) -> dict[str, typing.Any] | None:
    """A dataclass's {field: type}, or None for anything else (a leaf)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return {f.name: hints[f.name] for f in dataclasses.fields(tp)}
    return None


def check_overrides(fn, args: list[str]) -> None:
    """Every `a.b=v` override must name a parameter of `fn` and then fields of its dataclass types."""
    top = typing.get_type_hints(fn)
    top.pop("return", None)
    for arg in args:
        m = _KEY_RE.match(arg)
        if not m or arg.startswith("-"):
            continue
        parts, fields, where = m.group(1).split("."), top, fn.__name__
        for i, part in enumerate(parts):
            if fields is None:
                raise ValueError(f"unknown key {m.group(1)!r}: {'.'.join(parts[:i])} is a plain value with no "
                                 f"fields")
            if part not in fields:
                raise ValueError(f"unknown key {m.group(1)!r}: {where} has no {part!r}; its keys: "
                                 f"{', '.join(fields)}")
            where, leaf, fields = ".".join(parts[: i + 1]), fields[part], _fields_of(fields[part])
        if fields is None and arg[m.end() - 2] not in "-+*/|&":  # a plain key=value of a scalar field
            _check_scalar(m.group(1), arg[m.end():].strip(), leaf)


_SCALARS = {int: "an integer", float: "a number", bool: "true or false"}


def _check_scalar(key: str, value: str, tp) -> None:
    """An int / float / bool field's value must parse as one, with nemo-run's parser (the one that applies it): a
    bad one is named here, before nemo-run wraps its own error in itself twice."""
    kinds = [t for t in typing.get_args(tp) or (tp,) if t is not type(None)]
    if len(kinds) != 1 or kinds[0] not in _SCALARS:
        return
    from nemo_run.cli.cli_parser import type_parser

    try:
        type_parser.parse(value, tp)
    except Exception:
        none = " (or None)" if type(None) in typing.get_args(tp) else ""
        raise ValueError(f"{key}={value}: give {_SCALARS[kinds[0]]}{none}, e.g. {key}="
                         f"{ {int: '3', float: '0.5', bool: 'true'}[kinds[0]]}") from None
