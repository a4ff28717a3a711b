"""`model.checkpoint=ORG/NAME[@REVISION]`: a release's hub id, found in the local Hugging Face cache.

    path = local_checkpoint("nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16@main")   # the snapshot directory

Resolved once, before launch (recipes/cli.py), so the ranks only ever see a directory and compute nodes never
reach the network: huggingface_hub's own offline lookup (snapshot_download with local_files_only) reads the
cache `hf download ORG/NAME` fills (HF_HUB_CACHE, else HF_HOME/hub). An existing local path of the same
spelling wins (a relative directory `org/name` is a directory, not a hub id).
"""

from __future__ import annotations

import re
from pathlib import Path

# huggingface_hub's repo id grammar (an org and a name of letters, digits, - _ .), then an optional @revision
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


class HubCacheMiss(ValueError):
    """A hub id that the local Hugging Face cache does not hold."""


def is_hub_id(spec: str) -> bool:
    return bool(HUB_ID.match(spec)) and not spec.startswith((".", "~"))


def local_checkpoint(spec: str, cache_dir: str | Path | None = None) -> str:
    """`spec` itself when it is a local path or no hub id; else the cached snapshot directory of ORG/NAME at
    REVISION (default main). cache_dir: the hub cache (default: huggingface_hub's, from HF_HUB_CACHE/HF_HOME)."""
    if not spec or Path(spec).expanduser().exists() or not is_hub_id(spec):
        return spec
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    m = HUB_ID.match(spec)
    repo, revision = m["repo"], m["revision"]
    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    try:
        return snapshot_download(repo, revision=revision, cache_dir=str(cache), local_files_only=True)
    except LocalEntryNotFoundError:
        rev = f" --revision {revision}" if revision else ""
        raise HubCacheMiss(
            f"model.checkpoint={spec}: no local directory of that name, and the Hugging Face cache {cache} holds no "
            f"snapshot of {repo}{'@' + revision if revision else ''}; run `hf download {repo}{rev}` where the "
            f"hub is reachable, with HF_HOME (or HF_HUB_CACHE) pointing at the cache this run reads, or give the "
            f"downloaded directory") from None
