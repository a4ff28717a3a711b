"""Is a *.safetensors file whole? Read from its header alone, before launch (no tensor is read).

    problem = safetensors_problem(Path("model-00001-of-00013.safetensors"))   # None, or what is wrong, in words

The format (safetensors' own): 8 bytes, the header's length N as a little-endian u64; N bytes of JSON, each
tensor's {"dtype", "shape", "data_offsets": [begin, end]} into the data that follows. A whole file is exactly
8 + N + the largest `end`. An interrupted download or copy leaves a shorter file, which safetensors reports
only when a rank opens it, as "Error while deserializing header: incomplete metadata, file not fully covered"
with no file name; here it is named with both sizes and the fix.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def expected_size(path: Path) -> tuple[int | None, str]:
    """(the file size its header describes, "") or (None, why the header cannot be read)."""
    size = path.stat().st_size
    if size < 8:
        return None, f"{size} bytes, shorter than a safetensors header's 8-byte length"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size:
            return None, f"its header is {n:,} bytes but the file ends at {size:,}"
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return None, f"its header is not JSON ({e})"
    try:
        ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None, "its header has a tensor without data_offsets"
    return 8 + n + max(ends, default=0), ""


def _redownload(path: Path) -> str:
    """The command that fetches `path` again: `hf download ORG/NAME FILE --force-download` when it sits in a hub
    cache snapshot (models--ORG--NAME/snapshots/COMMIT/FILE, huggingface_hub's layout; the cache otherwise keeps
    the broken blob), else plain words."""
    parts = path.absolute().parts
    for i, part in enumerate(parts[:-3]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            repo, commit, rel = part[len("models--"):].replace("--", "/"), parts[i + 2], "/".join(parts[i + 3:])
            return f"re-download it: `hf download {repo} {rel} --revision {commit} --force-download`"
    return "re-download it (or copy it again from its source)"


def safetensors_problem(path: Path) -> str | None:
    """None for a whole file; else one line naming the file, its expected and actual size, and the fix."""
    path = Path(path)
    expected, why = expected_size(path)
    size = path.stat().st_size
    if expected is None:
        return f"{path}: not a whole safetensors file ({why}): {_redownload(path)}"
    if expected != size:
        cut = "truncated, an interrupted download or copy" if size < expected else "longer than its header says"
        return (f"{path}: {size:,} bytes, but its header describes {expected:,} ({cut}): {_redownload(path)}")
    return None
