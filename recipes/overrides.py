"""`key=value` overrides of a recipe, parsed as nemo-run's CLI parses them (used by the CLI and by
`python -m tessera.recipes.train --recipe NAME key=value ...`).

    cfg = apply_overrides(recipe("nemotron_vl_tiny"), ["trainer.max_steps=5", "model.vision=siglip_tiny"])
"""

import dataclasses
import types
import typing

import nemo_run as run
from nemo_run.cli import cli_parser

from tessera.recipes import checks
from tessera.hetero.runspec.config import DataConfig, LoraConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig


def _teach_parser(*classes) -> None:
    """Let nemo-run parse overrides of these dataclasses' fields.

    nemo-run 0.11.1 parses a value by its field's annotation object. hetero/runspec/config.py has
    `from __future__ import annotations`, so every annotation is a *string* ("int", "str | None"), which the
    parser refuses in strict mode (`trainer.max_steps=20` -> "Unsupported type: int"); and it knows
    typing.Union but not PEP 604's types.UnionType. So: register, for each annotation string, a parser
    that parses with the resolved type, PEP 604 unions rewritten as typing.Union."""
    tp = cli_parser.type_parser

    def parse_as(t):
        if isinstance(t, types.UnionType):
            t = typing.Union[typing.get_args(t)]
        if typing.get_origin(t) is tuple:  # tuples are given as lists: optim.betas=[0.9,0.99]
            item = typing.List[typing.get_args(t)[0]]
            return lambda value, _ann: tuple(tp.parse(value, item))
        return lambda value, _ann: tp.parse(value, t)

    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if isinstance(f.type, str) and f.type not in tp.custom_parsers:
                tp.register_parser(f.type)(parse_as(hints[f.name]))


_teach_parser(ModelConfig, LoraConfig, DataConfig, OptimConfig, TrainerConfig, RunConfig)


def apply_overrides(cfg: run.Config, overrides: list[str]) -> run.Config:
    """`key=value` overrides applied to a recipe's run.Config[RunConfig] with the CLI's checks and parser."""
    checks.check_overrides(RunConfig, overrides)
    return cli_parser.parse_cli_args(cfg, list(overrides)) if overrides else cfg
