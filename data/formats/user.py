"""A user's own format, without editing Tessera: scripts/prepare_data.py --format MODULE:FUNCTION.

FUNCTION(record) returns the record in Tessera's own schema, {"conversation": [{"role", "content"}...], "media":
[{"kind", "path"}...]} (data/formats/tessera.py), or None to leave the record out; MODULE is a dotted module name
imported with the current directory first on sys.path (as `python -m` does), or the path of a .py file. The module
is loaded, and the function tried on the source's first record, before any shard is written: a module that does
not import or a function that raises stops the run there, naming it with its traceback's last line. Later records
on which it raises are skipped, counted (`format_error`) and named, as any record that cannot be used.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

from tessera.data.formats import checked, tessera
from tessera.data.formats.common import RecordError


class FormatLoadError(ValueError):
    """--format names no usable function; the message says which part and how to write it."""


def last_line(e: BaseException) -> str:
    """The last line of `e`'s traceback ('  File ..., line N, in f' + 'ValueError: ...'): where and what."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}: " if frames else ""
    return where + "".join(traceback.format_exception_only(type(e), e)).strip()


class UserFormat:
    """Record -> (turns, media) through the user's function; `name` is the --format value."""

    def __init__(self, spec: str):
        self.name = spec
        module_name, sep, func_name = spec.rpartition(":")
        if not sep or not module_name or not func_name:
            raise FormatLoadError(f"--format {spec}: expected MODULE:FUNCTION (my_pkg.my_module:convert, or "
                                  f"path/to/my_format.py:convert)")
        try:
            module = _import(module_name)
        except Exception as e:
            raise FormatLoadError(f"--format {spec}: module {module_name!r} does not import ({last_line(e)})") from e
        self.function = getattr(module, func_name, None)
        if not callable(self.function):
            have = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise FormatLoadError(f"--format {spec}: {module_name} has no function {func_name!r} (it has {have})")

    def raw(self, rec):
        """What the user's function returns for `rec` (its own exceptions pass through)."""
        return self.function(rec)

    def __call__(self, rec):
        try:
            own = self.raw(rec)
        except Exception as e:
            raise RecordError("format_error", "(record)", f"a record {self.name} converts; it raised "
                              f"{last_line(e)}", self.name) from e
        if own is None:
            raise RecordError("left_out_by_format", "(record)", f"a record {self.name} keeps (it returned None)",
                              self.name)
        if not isinstance(own, dict) or "conversation" not in own:
            raise RecordError("format_error", "(returned value)", f"{{\"conversation\": [...], \"media\": [...]}} "
                              f"from {self.name}, got {str(own)[:80]!r}", self.name)
        turns, media = tessera.convert(own, self.name)
        return checked(turns, media, self.name, "conversation")


def _import(name: str):
    if name.endswith(".py"):  # a file: imported under its stem, from wherever it is
        path = Path(name).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(name)
