"""Per-module parallel layouts and their placement on ranks.

A heterogeneous layout gives every module of one model ("vision", "audio", "language", ...) its own
TP/CP/PP/DP(/EP) sizes and an inclusive rank range. Placement follows from the ranges alone: modules on
identical ranges are *colocated*, modules on disjoint ranges are *non-colocated*; partial overlaps, gaps
and ranges outside the world are errors.

String form (one CLI override), modules separated by ';':

    KEY=FIELDS@FIRST-LAST      FIELDS: comma list of tpN, cpN, ppN, dpN, epN in any order
    vision=dp4@0-3;audio=dp4@0-3;language=tp2,cp2@0-3

Every size defaults to 1 except dp, which is derived from the range size when omitted.

Rank order inside a module follows megatron's convention, tp fastest, then cp, dp and pp:
    rank = first + tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Nothing here touches torch.distributed: `validate()` runs before any process group exists.
"""

from __future__ import annotations

import math
import re
import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from tessera.hetero.plan.zigzag import zigzag_multiple

LANGUAGE = "language"
VISION, AUDIO = "vision", "audio"
ENCODER_KEYS = (VISION, AUDIO)          # the encoder module keys a run can have (each a modality), in order
MODULE_KEYS = (*ENCODER_KEYS, LANGUAGE)  # every module key, in the order runs list them
GRID_DIMS = ("tp", "cp", "dp", "pp")  # fastest first, as HyperCommGrid's shape
_FIELD_RE = re.compile(r"^(tp|cp|pp|dp|ep)(\d+)$")
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class LayoutError(ValueError):
    """An invalid layout. The message names the module, the field and a fix."""


@dataclass(frozen=True)
class RankCoord:
    """Where one global rank sits inside one module's grid."""

    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ModuleLayout:
    """One module's parallel sizes and its inclusive global rank range [first, last]."""

    first: int
    last: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int | None = None  # None: derived from the range size
    ep: int = 1

    def __post_init__(self):
        # resolve a derivable dp now, so equal layouts compare equal however they were written
        mp = self.tp * self.cp * self.pp
        if self.dp is None and isinstance(mp, int) and mp > 0 and self.size > 0 and self.size % mp == 0:
            object.__setattr__(self, "dp", self.size // mp)

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    @property
    def ranks(self) -> range:
        return range(self.first, self.last + 1)

    @property
    def dp_size(self) -> int:
        if self.dp is not None:
            return self.dp
        return self.size // (self.tp * self.cp * self.pp)

    @property
    def shape(self) -> list[int]:
        return [self.tp, self.cp, self.dp_size, self.pp]

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return self.first + tp + self.tp * (cp + self.cp * (dp + self.dp_size * pp))

    def coord(self, rank: int) -> RankCoord | None:
        """This module's grid coordinate of a global rank, or None if the rank is not in the module."""
        if rank not in self.ranks:
            return None
        r = rank - self.first
        tp, r = r % self.tp, r // self.tp
        cp, r = r % self.cp, r // self.cp
        dp, pp = r % self.dp_size, r // self.dp_size
        return RankCoord(tp=tp, cp=cp, dp=dp, pp=pp)

    def to_spec(self) -> str:
        fields = [f"{n}{getattr(self, n)}" for n in ("tp", "cp", "pp") if getattr(self, n) != 1]
        fields.append(f"dp{self.dp_size}")
        if self.ep != 1:
            fields.append(f"ep{self.ep}")
        return ",".join(fields) + f"@{self.first}-{self.last}"

    def validate(self, key: str) -> None:
        for name in ("tp", "cp", "pp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise LayoutError(f"module '{key}': {name}={v!r} must be a positive integer; e.g. {name}1")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise LayoutError(f"module '{key}': dp={self.dp!r} must be a positive integer, or omitted to derive it")
        if self.first < 0 or self.last < self.first:
            raise LayoutError(
                f"module '{key}': rank range {self.first}-{self.last} is empty or negative; write @FIRST-LAST "
                f"with 0 <= FIRST <= LAST")
        mp = self.tp * self.cp * self.pp
        if self.dp is None:
            if self.size % mp:
                raise LayoutError(
                    f"module '{key}': tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {mp} does not divide its "
                    f"{self.size} ranks ({self.first}-{self.last}); change tp/cp/pp or the rank range")
        elif mp * self.dp != self.size:
            raise LayoutError(
                f"module '{key}': tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*{self.dp} = {mp * self.dp} but its "
                f"range {self.first}-{self.last} has {self.size} ranks; set dp{self.size // mp if self.size % mp == 0 else '?'}"
                f" or omit dp to derive it, or change the range")
        if (self.cp * self.dp_size) % self.ep:
            raise LayoutError(
                f"module '{key}': ep={self.ep} must divide cp*dp = {self.cp * self.dp_size} (experts are spread "
                f"over the data-parallel ranks); choose ep among the divisors of {self.cp * self.dp_size}")


def _parse_module(item: str) -> tuple[str, ModuleLayout]:
    hint = "write KEY=FIELDS@FIRST-LAST, e.g. language=tp2,cp2@0-3"
    if "=" not in item or "@" not in item:
        raise LayoutError(f"layout entry '{item}': {hint}")
    key, rest = item.split("=", 1)
    key = key.strip()
    if not _KEY_RE.match(key):
        raise LayoutError(f"layout entry '{item}': module key '{key}' must be an identifier; {hint}")
    fields_s, range_s = rest.rsplit("@", 1)
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", range_s)
    if not m:
        raise LayoutError(f"module '{key}': rank range '@{range_s}' must be @FIRST-LAST, e.g. @0-3")
    sizes: dict[str, int] = {}
    for f in filter(None, (s.strip() for s in fields_s.split(","))):
        fm = _FIELD_RE.match(f)
        if not fm:
            raise LayoutError(f"module '{key}': field '{f}' is not one of tpN, cpN, ppN, dpN, epN (N >= 1)")
        name, value = fm.group(1), int(fm.group(2))
        if name in sizes:
            raise LayoutError(f"module '{key}': field '{name}' given twice; keep one")
        sizes[name] = value
    return key, ModuleLayout(first=int(m.group(1)), last=int(m.group(2)), **sizes)


def llm_sequence_parallel(moe: bool, tp: int) -> bool:
    """Whether the LLM runs sequence parallel: MoE with TP > 1 (megatron's MoE layer trains with TP only under
    sequence parallelism); dense LLMs keep the plain TP path. The one rule: the model config and validation
    both read it."""
    return moe and tp > 1


@dataclass(frozen=True)
class ModelShapes:
    """What validation needs to know about the model and the batch (all optional).

    heads: attention heads per module (TP must divide them); kv_heads likewise.
    seq_length: the LLM's (packed) sequence length; must divide by 2*cp for zigzag CP (and each CP rank's
    share by tp under sequence parallelism).
    samples_per_microbatch: the global number of samples in one microbatch, split over every module's DP.
    moe: the LLM has MoE layers (then TP > 1 means sequence parallelism: llm_sequence_parallel).
    """

    heads: Mapping[str, int] = field(default_factory=dict)
    kv_heads: Mapping[str, int] = field(default_factory=dict)
    seq_length: int | None = None
    samples_per_microbatch: int | None = None
    moe: bool = False


@dataclass(frozen=True)
class HeteroLayout:
    modules: Mapping[str, ModuleLayout]

    @classmethod
    def parse(cls, spec: str) -> "HeteroLayout":
        items = [s.strip() for s in spec.split(";") if s.strip()]
        if not items:
            raise LayoutError("empty layout; write e.g. 'vision=dp4@0-3;language=tp2,cp2@0-3'")
        modules: dict[str, ModuleLayout] = {}
        for item in items:
            key, layout = _parse_module(item)
            if key in modules:
                raise LayoutError(f"module '{key}' appears twice in the layout; give each module once")
            modules[key] = layout
        return cls(modules)

    def __str__(self) -> str:
        return ";".join(f"{k}={m.to_spec()}" for k, m in self.modules.items())

    def __getitem__(self, key: str) -> ModuleLayout:
        return self.modules[key]

    @property
    def world_size(self) -> int:
        return max(m.last for m in self.modules.values()) + 1

    @property
    def encoders(self) -> list[str]:
        return [k for k in self.modules if k != LANGUAGE]

    def colocated(self, a: str, b: str) -> bool:
        return self.modules[a].ranks == self.modules[b].ranks

    @property
    def placement(self) -> str:
        """'colocated' when every module shares one range, 'non-colocated' when all are disjoint, else 'mixed'."""
        ranges = {(m.first, m.last) for m in self.modules.values()}
        if len(ranges) == 1:
            return "colocated"
        return "non-colocated" if len(ranges) == len(self.modules) else "mixed"

    def modules_of_rank(self, rank: int) -> list[str]:
        return [k for k, m in self.modules.items() if rank in m.ranks]

    def validate(self, shapes: ModelShapes | None = None, world_size: int | None = None) -> "HeteroLayout":
        """Raise LayoutError naming the module, the field and a fix; return self when valid."""
        for key, m in self.modules.items():
            m.validate(key)
        if LANGUAGE not in self.modules:
            raise LayoutError(f"no '{LANGUAGE}' module: every other module is an encoder feeding it; add "
                              f"'{LANGUAGE}=...@FIRST-LAST'")
        self._validate_placement(world_size)
        if shapes is not None:
            self._validate_shapes(shapes)
        return self

    def _validate_placement(self, world_size: int | None) -> None:
        items = list(self.modules.items())
        for i, (ka, a) in enumerate(items):
            for kb, b in items[i + 1:]:
                same = a.ranks == b.ranks
                disjoint = a.last < b.first or b.last < a.first
                if not (same or disjoint):
                    raise LayoutError(
                        f"modules '{ka}' (@{a.first}-{a.last}) and '{kb}' (@{b.first}-{b.last}) partly overlap: "
                        f"ranges must be identical (colocated) or disjoint (non-colocated)")
        world = world_size if world_size is not None else self.world_size
        # identical or disjoint ranges tile the world when, sorted, each starts where the last ended (checked
        # without listing the ranks: the layout search validates thousands of layouts of 16,384+ ranks)
        ranges = sorted({(m.first, m.last) for m in self.modules.values()})
        ends = [-1] + [last for _, last in ranges]
        if [first for first, _ in ranges] != [e + 1 for e in ends[:-1]] or ends[-1] != world - 1:
            covered = sorted({r for m in self.modules.values() for r in m.ranks})
            missing = sorted(set(range(world)) - set(covered))
            outside = sorted(set(covered) - set(range(world)))
            gaps = [r for r in missing if r < self.world_size]  # inside the layout: no world size fills them
            what = f"ranks {missing} belong to no module" if missing else f"ranks {outside} exceed the world"
            fix = "" if gaps or self.world_size == world else f" (or launch with world size {self.world_size})"
            raise LayoutError(f"rank ranges must tile the world of {world} ranks exactly: {what}; adjust the "
                              f"@FIRST-LAST ranges{' to cover them' if gaps else ''}{fix}")

    def _validate_shapes(self, shapes: ModelShapes) -> None:
        for key, m in self.modules.items():
            for label, table in (("heads", shapes.heads), ("kv_heads", shapes.kv_heads)):
                n = table.get(key)
                if n is not None and n % m.tp:
                    fits = [d for d in range(1, n + 1) if n % d == 0]
                    raise LayoutError(f"module '{key}': tp={m.tp} does not divide its {n} attention {label}; "
                                      f"use tp in {fits}")
        lang = self.modules[LANGUAGE]
        chunks = zigzag_multiple(lang.cp)
        if shapes.seq_length is not None and shapes.seq_length % chunks:
            raise LayoutError(
                f"module '{LANGUAGE}': seq_length={shapes.seq_length} is not divisible by 2*cp = {chunks} "
                f"(zigzag context parallelism cuts the sequence into 2*cp chunks); pad the sequence to a "
                f"multiple of {chunks} or lower cp")
        if (shapes.seq_length is not None and llm_sequence_parallel(shapes.moe, lang.tp)
                and (shapes.seq_length // lang.cp) % lang.tp):
            raise LayoutError(
                f"module '{LANGUAGE}': each CP rank's {shapes.seq_length // lang.cp} of seq_length="
                f"{shapes.seq_length} positions do not divide by tp={lang.tp} (an MoE LLM with TP runs sequence "
                f"parallel: every TP rank holds 1/tp of them); use a seq_length that is a multiple of "
                f"{math.lcm(chunks, lang.cp * lang.tp)}")
        n = shapes.samples_per_microbatch
        if n is not None:
            for key, m in self.modules.items():
                if n % m.dp_size:
                    others = ", ".join(f"{k} dp={o.dp_size}" for k, o in self.modules.items() if k != key)
                    need = rows_multiple(self)
                    raise LayoutError(
                        f"module '{key}': dp={m.dp_size} cannot take an equal share of {n} samples per microbatch, "
                        f"so its data cannot fan in/out to {others}; use a multiple of {need} samples per "
                        f"microbatch or change dp")


def scale_layout(layout: HeteroLayout | str, world: int) -> HeteroLayout:
    """The layout on `world` ranks: every module's range and DP grow by world / layout.world_size, or shrink by
    layout.world_size / world (an elastic restart on fewer ranks) when every module's DP and range boundaries
    divide by that factor; TP, CP, PP and EP never change. LayoutError naming the module otherwise."""
    layout = HeteroLayout.parse(layout) if isinstance(layout, str) else layout
    size = layout.world_size
    if world % size == 0:
        f = world // size
        return HeteroLayout({k: dataclasses.replace(m, first=m.first * f, last=(m.last + 1) * f - 1,
                                                    dp=m.dp_size * f) for k, m in layout.modules.items()})
    if world < 1 or size % world:
        raise LayoutError(f"world {world} is not a multiple of the layout's {size} ranks (nor a divisor); "
                          f"scaling changes data parallelism by a whole factor")
    f = size // world
    for k, m in layout.modules.items():
        if m.dp_size % f or m.first % f or (m.last + 1) % f:
            raise LayoutError(f"layout {layout} cannot shrink by data parallelism to {world} ranks: module '{k}' "
                              f"(dp={m.dp_size} on ranks {m.first}-{m.last}) does not divide by {f}")
    return HeteroLayout({k: dataclasses.replace(m, first=m.first // f, last=(m.last + 1) // f - 1,
                                                dp=m.dp_size // f) for k, m in layout.modules.items()})


def rows_multiple(layout: HeteroLayout) -> int:
    """Rows per microbatch must be a multiple of this for every module's DP to take an equal share: the lcm of
    the DP sizes. The one rule: validation, rows_for_layout, the recipes, the planner and verify read it."""
    return math.lcm(*(m.dp_size for m in layout.modules.values()))


def rows_for_layout(layout: HeteroLayout, rows: int, microbatches: int) -> tuple[int, int]:
    """(rows per microbatch, microbatches) for `layout` with the same rows per step (rows x microbatches): the
    given ones when every module's DP divides `rows`; else the smallest multiple of lcm(DP sizes) >= rows that
    divides the step's rows (fewer microbatches, as megatron derives them from the global batch and DP), or
    the largest smaller one. LayoutError naming the fix when no multiple divides the step's rows."""
    need = rows_multiple(layout)
    if rows % need == 0:
        return rows, microbatches
    step = rows * microbatches
    fits = [r for r in range(need, step + 1, need) if step % r == 0]
    if not fits:
        dps = ", ".join(f"{k} dp={m.dp_size}" for k, m in layout.modules.items())
        raise LayoutError(f"layout {layout}: no whole number of rows per microbatch gives every module an equal "
                          f"share ({dps}: a multiple of {need}) and divides the step's {step} rows "
                          f"(data.rows_per_microbatch={rows} x data.microbatches={microbatches}); use a step of a "
                          f"multiple of {need} rows or change dp")
    chosen = min((r for r in fits if r >= rows), default=max(fits))
    return chosen, step // chosen
