"""Activation recompute settings as data: `model.recompute` parsed into one mode per module.

Pure (no torch): hetero/runspec/config.py validates `model.recompute` with it when the config is made, recipes/checks.py
again before launch (the CLI holds a run.Config, which builds no dataclass), and model building reads the
per-module modes from it. What each mode recomputes per layer type is in models/recompute.py.

    parse_recompute("full")                          # {"language": "full", "vision": "full", "audio": "full"}
    parse_recompute("language=full,vision=selective")  # unnamed modules: "none"
    parse_recompute("selective,language=full")       # a bare mode is the default for the modules not named
"""

from __future__ import annotations

from tessera.hetero.plan.layout import ENCODER_KEYS, LANGUAGE

RECOMPUTE_MODULES = (LANGUAGE, *ENCODER_KEYS)  # layout module keys, in the order `parse_recompute` lists them
RECOMPUTE_MODES = ("none", "selective", "full")
FIELD = "model.recompute"


def _error(value, why: str) -> ValueError:
    return ValueError(f"{FIELD}={value!r}: {why}; give one mode for every module ({'|'.join(RECOMPUTE_MODES)}) "
                      f"or per module, e.g. 'language=full,vision=selective' (modules: "
                      f"{', '.join(RECOMPUTE_MODULES)})")


def parse_recompute(value) -> dict[str, str]:
    """{module: mode} for every module of RECOMPUTE_MODULES; a ValueError naming the field, the bad part and the
    allowed values for anything else."""
    if not isinstance(value, str) or not value.strip():
        raise _error(value, "expected a non-empty string")
    default, named = None, {}
    for item in (part.strip() for part in value.split(",")):
        module, sep, mode = (s.strip() for s in item.partition("="))
        if not sep:  # a bare mode: the default
            module, mode = None, item
        if mode not in RECOMPUTE_MODES:
            raise _error(value, f"unknown mode {mode!r}{f' for module {module!r}' if module else ''}; modes: "
                                f"{', '.join(RECOMPUTE_MODES)}")
        if module is None:
            if default is not None:
                raise _error(value, "more than one default mode")
            default = mode
        elif module not in RECOMPUTE_MODULES:
            raise _error(value, f"unknown module {module!r}; modules: {', '.join(RECOMPUTE_MODULES)}")
        elif module in named:
            raise _error(value, f"module {module!r} given twice")
        else:
            named[module] = mode
    return {m: named.get(m, default or "none") for m in RECOMPUTE_MODULES}
