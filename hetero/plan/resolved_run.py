"""A run, resolved once: the config's layout string, the world and the model's shapes -> one frozen ResolvedRun.

    run = resolve_run("vision=dp4@0-3;language=tp2,dp2@0-3", world=4, model=RunModel(...), seq_length=256,
                      rows_per_microbatch=4, microbatches=2)
    run.layout; run.rows_per_microbatch, run.microbatches; run.dp_rows("vision", dp_rank=1); run.decode_rows(rank)

Every fact that follows from a run's config and its world is derived here, once, and read by the CLI's checks,
the trainer (its state, decode plan, stages, boundary plan), the dry run and the parity tool:
  layout    ""      every module data-parallel on all `world` ranks (the homogeneous baseline);
            "auto"  the first layout `propose()` yields that this run can train (the planner ranks, this decides);
            a spec  parsed; when `world` is a whole multiple of its ranks, grown by data parallelism to `world`;
                    on an elastic restart (elastic=True) at another world: scaled by DP (down too) when that
                    divides and fits memory, else the planner's best layout this run can train;
  modules   exactly the model's keys (fit_modules: an encoder the layout does not name goes data-parallel on
            the ranks of the layout's first encoder);
  rows      the step's rows (rows_per_microbatch x microbatches) re-split so every module's DP takes whole rows
            (rows_for_layout); the config is never written back;
  checks    heads vs TP, seq_length vs 2*cp (zigzag), rows vs DP, and the one trainability rule (trainable.py).
Every error is a LayoutError naming the module, the field and the fix, raised before any process group exists.

Pure: the caller describes the model (RunModel: built from its registries by hetero/runspec/modules.run_model).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from tessera.hetero.plan.layout import (LANGUAGE, MODULE_KEYS, HeteroLayout, LayoutError, ModelShapes, ModuleLayout,
                                        llm_sequence_parallel, rows_for_layout, scale_layout)
from tessera.hetero.plan.cp_path import CPPath, attention_path, mamba_path
from tessera.hetero.plan.trainable import check_trainable

IGNORE = -100  # the label that losses skip (torch's cross_entropy ignore_index default)


def dp_rows(n: int, dp_size: int, dp_rank: int) -> range:
    """Rows of a microbatch of `n` rows that DP rank `dp_rank` of `dp_size` owns: [d*n/D, (d+1)*n/D). The one
    rule of row ownership: the decode plan, the shards, the boundary plan and the stages all read it."""
    if n % dp_size:
        raise ValueError(f"{n} rows per microbatch cannot be split evenly over dp={dp_size}; use a multiple of "
                         f"{dp_size} rows")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside dp={dp_size}")
    per = n // dp_size
    return range(dp_rank * per, (dp_rank + 1) * per)


def dp_owner(row: int, n: int, dp_size: int) -> int:
    """The DP rank (of `dp_size`) that owns global row `row` of a microbatch of `n` rows (inverse of dp_rows)."""
    return row // (n // dp_size)


def decode_rows(layout: HeteroLayout, rank: int, rows_per_microbatch: int) -> dict[str, range]:
    """Encoder module -> the global rows whose media `rank` must decode (its DP rows of that module). Empty for
    an LLM-only rank. TP/CP/PP peers of one encoder DP rank get the same rows (each decodes them: a peer needs
    the pixels it shards, and peers usually sit on other hosts)."""
    return {key: dp_rows(rows_per_microbatch, layout[key].dp_size, layout[key].coord(rank).dp)
            for key in layout.modules_of_rank(rank) if key in layout.encoders}


@dataclass(frozen=True)
class RunModel:
    """What resolution needs to know about a run's model (pure data; hetero/runspec/modules.run_model builds it).

    keys: module keys, encoders first, then LANGUAGE; heads / kv_heads: attention heads per module (TP must
    divide them); encoder_tp: per encoder, whether it has tensor-parallel layers; video_pruned: EVS prunes
    video tokens (no vision CP); moe: the LLM has MoE layers (TP > 1 runs sequence parallel)."""

    keys: tuple[str, ...]
    heads: Mapping[str, int] = field(default_factory=dict)
    kv_heads: Mapping[str, int] = field(default_factory=dict)
    encoder_tp: Mapping[str, bool] = field(default_factory=dict)
    video_pruned: bool = False
    moe: bool = False
    mamba_heads: int = 0  # the LLM's Mamba heads and B/C groups: with heads / kv_heads, its CP path (cp_path.py)
    mamba_groups: int = 0

    def shapes(self, seq_length: int | None = None, rows_per_microbatch: int | None = None) -> ModelShapes:
        """What HeteroLayout.validate checks against: heads, and the row length and rows when given."""
        return ModelShapes(heads=self.heads, kv_heads=self.kv_heads, seq_length=seq_length,
                           samples_per_microbatch=rows_per_microbatch, moe=self.moe)


@dataclass(frozen=True)
class ResolvedRun:
    """One run on one world: its layout and batch split, and the rules that follow from them."""

    layout: HeteroLayout
    world: int
    model: RunModel
    seq_length: int
    rows_per_microbatch: int
    microbatches: int
    # launched ranks beyond `world` that wait unused: an elastic restart on a world that no layout of the run
    # tiles trains on the largest smaller one that works (its lowest ranks), the rest are spares
    spares: int = 0

    @property
    def keys(self) -> list[str]:
        return list(self.layout.modules)

    @property
    def encoders(self) -> list[str]:
        return self.layout.encoders

    @property
    def rows_per_step(self) -> int:
        return self.rows_per_microbatch * self.microbatches

    @property
    def sequence_parallel(self) -> bool:
        """Whether the LLM runs sequence parallel (MoE with TP > 1)."""
        return llm_sequence_parallel(self.model.moe, self.layout[LANGUAGE].tp)

    def dp_rows(self, key: str, dp_rank: int) -> range:
        """The global rows of each microbatch that DP rank `dp_rank` of module `key` owns."""
        return dp_rows(self.rows_per_microbatch, self.layout[key].dp_size, dp_rank)

    def decode_rows(self, rank: int) -> dict[str, range]:
        """Encoder module -> the global rows of each microbatch whose media `rank` decodes (decode_rows)."""
        return decode_rows(self.layout, rank, self.rows_per_microbatch)

    def decode_items(self, rank: int) -> dict[str, int]:
        """Encoder module -> `rank`'s DP rank of it: the items it decodes and encodes are those the run's item
        assignment (hetero/plan/encoder_balance.ItemAssignment) gives that DP rank. Empty for an LLM-only rank."""
        return {key: self.layout[key].coord(rank).dp for key in self.layout.modules_of_rank(rank)
                if key in self.layout.encoders}

    def encoder_dp_sizes(self) -> dict[str, int]:
        return {key: self.layout[key].dp_size for key in self.layout.encoders}

    def shapes(self) -> ModelShapes:
        return self.model.shapes(self.seq_length, self.rows_per_microbatch)

    def llm_cp_paths(self) -> tuple[CPPath, CPPath]:
        """(attention, Mamba) context-parallel path of the LLM's layers (cp_path.py; the kernel choice builds them)."""
        lang, m = self.layout[LANGUAGE], self.model
        return (attention_path(m.heads[LANGUAGE], m.kv_heads[LANGUAGE], lang.tp, lang.cp),
                mamba_path(m.mamba_heads, m.mamba_groups, lang.tp, lang.cp))

    def cp_line(self) -> str:
        """What the launch prints for an LLM at CP > 1 ("" otherwise): each layer kind's path, and why zigzag."""
        lang = self.layout[LANGUAGE]
        if lang.cp == 1:
            return ""
        parts = [f"{name} {p.path}" + (f" (torch kernels: {p.reason})" if p.reason else "")
                 for name, p in zip(("attention", "mamba"), self.llm_cp_paths())]
        return f"context parallelism: language cp={lang.cp}: " + ", ".join(parts)


def fit_modules(layout: HeteroLayout, keys: Iterable[str]) -> HeteroLayout:
    """The layout with exactly the model's module keys. An encoder the layout does not name (one added with
    `model.audio=...`) goes data-parallel on the ranks of the layout's first encoder (else the LLM's); a module
    the model does not have is dropped when another module shares its ranks (else its ranks would idle: an
    error naming the fix). A key that names no module at all (a typo: `visoin=...`) is an error, never dropped."""
    keys = list(keys)
    modules = dict(layout.modules)
    unknown = [k for k in modules if k not in MODULE_KEYS]
    if unknown:  # the message lists this model's keys: those are the ones the layout may name
        k = unknown[0]
        hint = difflib.get_close_matches(k, keys, n=1) or difflib.get_close_matches(k, MODULE_KEYS, n=1)
        raise LayoutError(f"layout module {k!r} is not a module of this model"
                          + (f" (did you mean {hint[0]!r}?)" if hint else "")
                          + f"; its modules are: {', '.join(sorted(keys))} (layout {layout})")
    for key in list(modules):
        if key not in keys:
            m = modules.pop(key)
            if not any(o.ranks == m.ranks for o in modules.values()):
                raise LayoutError(f"layout {layout}: the model has no {key!r} module, and ranks {m.first}-{m.last} "
                                  f"hold nothing else; give a layout for modules {keys} (or set model.{key})")
    if LANGUAGE not in modules:
        raise LayoutError(f"layout {layout} has no '{LANGUAGE}' module: add '{LANGUAGE}=FIELDS@FIRST-LAST'")
    for key in keys:
        if key not in modules:
            host = next((modules[k] for k in modules if k != LANGUAGE), modules[LANGUAGE])
            modules[key] = ModuleLayout(first=host.first, last=host.last)
    return HeteroLayout({k: modules[k] for k in keys})


def resolve_run(spec: str, world: int, model: RunModel, seq_length: int, rows_per_microbatch: int,
                microbatches: int, propose: Callable[[], Iterable[str]] | None = None, elastic: bool = False,
                fits: Callable[[str], str] | None = None) -> ResolvedRun:
    """The run's validated, trainable layout and batch split on `world` ranks (see the module docstring).
    `propose`: for spec "auto", layouts on `world` ranks in the planner's order (best first).
    `elastic`: the world may differ from an explicit layout's (an elastic restart on the ranks that are left, or
    more): the layout scaled by DP when that divides and `fits` (layout -> why it does not fit memory, "" when it
    does) passes, else the planner's best layout this run can train (`propose`); the step's rows are kept."""
    spec = (spec or "").strip()
    if elastic and spec not in ("", "auto") and HeteroLayout.parse(spec).world_size != world:
        scaled, why = scaled_for_restart(spec, world, fits)
        for candidate in ([scaled] if scaled else []) + list(propose() if propose else []):
            try:
                return resolve_run(candidate, world, model, seq_length, rows_per_microbatch, microbatches)
            except LayoutError as e:
                why = why or str(e)
        raise LayoutError(f"elastic restart on {world} ranks: {why}; and the planner proposes no layout this run can "
                          f"train on {world} ranks with {rows_per_microbatch * microbatches} rows per step")
    if spec == "auto":
        if propose is None:
            raise LayoutError("layout=auto needs the planner's proposals; resolve the run through "
                              "tessera.recipes.checks.resolve (or give layout=... explicitly)")
        for candidate in propose():
            try:
                return resolve_run(candidate, world, model, seq_length, rows_per_microbatch, microbatches)
            except LayoutError:
                continue
        raise LayoutError(f"layout=auto: no layout of this model on {world} ranks is both feasible and trainable "
                          f"with {rows_per_microbatch * microbatches} rows per step; give layout=... explicitly or "
                          f"change data.rows_per_microbatch / data.microbatches")
    if not spec:
        spec = ";".join(f"{k}=dp{world}@0-{world - 1}" for k in model.keys)
    layout = HeteroLayout.parse(spec)
    if layout.world_size != world and world % layout.world_size == 0:
        layout = scale_layout(layout, world)
    layout = fit_modules(layout, model.keys)
    # every module's DP takes whole rows of each microbatch: the step's rows are kept, their split may change
    rows, micro = rows_for_layout(layout, rows_per_microbatch, microbatches)
    run = ResolvedRun(layout, world, model, seq_length, rows, micro)
    layout.validate(run.shapes(), world_size=world)
    check_trainable(layout, model.encoder_tp, model.video_pruned)
    return run


def scaled_for_restart(spec: str, world: int, fits: Callable[[str], str] | None) -> tuple[str, str]:
    """(the layout scaled by DP to `world` ranks, "") or ("", why not: no whole DP factor, or memory)."""
    try:
        scaled = str(scale_layout(spec, world))
    except LayoutError as e:
        return "", str(e)
    too_big = fits(scaled) if fits is not None else ""
    return ("", f"{scaled} does not fit memory ({too_big})") if too_big else (scaled, "")
