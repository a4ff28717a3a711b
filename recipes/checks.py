"""Checks that run before anything is launched: registry names, override keys, the layout against the model.

    from tessera.recipes.checks import check_run
    layout = check_run(cfg.model, cfg.data, cfg.layout, world_size=4)   # HeteroLayout, or a ValueError

Every error names what was wrong and lists what exists, so a typo on the CLI fails in a second on the
submitting machine instead of minutes later on every rank of a cluster job. Plain data only (no torch,
no process groups): the registries are dicts and HeteroLayout.validate is a pure function.
"""

from __future__ import annotations

import dataclasses
import re
import typing

from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout, LayoutError, ModelShapes
from tessera.models import configs, encoders

MODALITIES = ("vision", "audio")  # the encoder module keys of a ModelConfig and of a layout


def encoder_names(modality: str | None = None) -> list[str]:
    return sorted(n for n, c in encoders.REGISTRY.items() if modality is None or c["modality"] == modality)


def llm_names() -> list[str]:
    return sorted(configs.REGISTRY)


def check_names(model) -> None:
    """model.llm / model.vision / model.audio must be registered names of the right modality."""
    if model.llm not in configs.REGISTRY:
        raise ValueError(f"unknown LLM model.llm={model.llm!r}; registered LLMs (models/configs.py): "
                         f"{', '.join(llm_names())}")
    for modality in MODALITIES:
        name = getattr(model, modality)
        if name is None:
            continue
        if name not in encoders.REGISTRY:
            raise ValueError(f"unknown encoder model.{modality}={name!r}; registered {modality} encoders "
                             f"(models/encoders.py): {', '.join(encoder_names(modality))}")
        if encoders.REGISTRY[name]["modality"] != modality:
            raise ValueError(f"model.{modality}={name!r} is an encoder of modality "
                             f"{encoders.REGISTRY[name]['modality']!r}; {modality} encoders: "
                             f"{', '.join(encoder_names(modality))}")


def module_keys(model) -> list[str]:
    """The layout's module keys this model needs: its encoders, then the LLM."""
    return [m for m in MODALITIES if getattr(model, m) is not None] + [LANGUAGE]


def resolve_layout(layout: str, model, world_size: int) -> HeteroLayout:
    """The layout string as a HeteroLayout; "" means every module data-parallel on all `world_size` ranks."""
    if not layout:
        layout = ";".join(f"{k}=dp{world_size}@0-{world_size - 1}" for k in module_keys(model))
    return HeteroLayout.parse(layout)


def shapes(model, data) -> ModelShapes:
    """What layout validation needs from the registered module sizes and the batch."""
    heads, kv = {}, {}
    llm = configs.REGISTRY[model.llm]
    heads[LANGUAGE], kv[LANGUAGE] = llm["num_attention_heads"], llm["num_key_value_heads"]
    for m in MODALITIES:
        name = getattr(model, m)
        if name is not None and "heads" in encoders.REGISTRY[name]:
            heads[m] = encoders.REGISTRY[name]["heads"]
    return ModelShapes(heads=heads, kv_heads=kv, seq_length=data.seq_length,
                       samples_per_microbatch=data.rows_per_microbatch)


def check_run(model, data, layout: str, world_size: int | None = None) -> HeteroLayout:
    """Names, module keys, and the layout validated against the model and batch (optionally the world)."""
    check_names(model)
    if not layout and world_size is None:
        raise ValueError('layout "" needs the launched world size to expand to every-module DP')
    hl = resolve_layout(layout, model, world_size or 0)
    want, have = set(module_keys(model)), set(hl.modules)
    if want != have:
        missing, extra = sorted(want - have), sorted(have - want)
        raise LayoutError(
            f"layout {layout!r} does not match the model's modules {module_keys(model)}"
            + (f": no entry for {missing}" if missing else "") + (f": {extra} not in the model" if extra else "")
            + "; give every module (model.vision / model.audio set to None drop theirs) one KEY=FIELDS@FIRST-LAST")
    return hl.validate(shapes(model, data), world_size=world_size)


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
            where, fields = ".".join(parts[: i + 1]), _fields_of(fields[part])
