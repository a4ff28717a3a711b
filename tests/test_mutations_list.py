"""scripts/mutations.toml stays runnable: every entry names a file that exists and a `find` that occurs exactly once
in it (scripts/mutate.py skips an entry whose text moved, and only the fast ones run in CI, so a slow mutation whose
code was refactored would otherwise stop guarding its rule without a sound)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutation_finds_its_text_exactly_once():
    entries = tomllib.loads((ROOT / "scripts" / "mutations.toml").read_text())["mutation"]
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), "mutation names repeat"
    stale = []
    for e in entries:
        path = ROOT / e["file"]
        count = path.read_text().count(e["find"]) if path.is_file() else -1
        if count != 1:
            stale.append(f"{e['name']}: {e['file']} " + ("is gone" if count < 0 else f"holds its find {count} times"))
        missing = [t for t in e["tests"] if not (ROOT / t.split("::")[0]).is_file()]
        if missing:
            stale.append(f"{e['name']}: no test file {missing}")
    assert not stale, "update these entries of scripts/mutations.toml to the code as it is now:\n" + "\n".join(stale)
