"""`model.checkpoint=ORG/NAME[@REVISION]`: a release's hub id, found in the local Hugging Face cache.

REVISION is any the hub takes (a branch, a tag, a commit, `refs/pr/N`; `/` allowed); the repo id is checked by
huggingface_hub's own validator. A miss lists the revisions the cache does hold.

    path = local_checkpoint("nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16@main")   # the snapshot directory

Resolved once, before launch (recipes/cli.py), so the ranks only ever see a directory and compute nodes never
reach the network: huggingface_hub's own offline lookup (snapshot_download with local_files_only) reads the
cache `hf download ORG/NAME` fills (HF_HUB_CACHE, else HF_HOME/hub). An existing local path of the same
spelling wins (a relative directory `org/name` is a directory, not a hub id).
"""

from __future__ import annotations

from pathlib import Path


class HubCacheMiss(ValueError):
    """A hub id that the local Hugging Face cache does not hold."""


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of `REPO[@REVISION]`, or None when `spec` is no hub id. The repo id is
    huggingface_hub's to judge (validate_repo_id: `NAME` or `ORG/NAME`); a revision is anything git names and the
    hub takes: a branch, a tag, a commit, `refs/pr/N`, with `/` in it. A repo id has no `@`, so the first one
    separates them."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not spec or spec.startswith((".", "~", "/")):
        return None
    repo, at, revision = spec.partition("@")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    if at and not revision:
        raise HubCacheMiss(f"model.checkpoint={spec}: nothing after `@`; give ORG/NAME@REVISION (a branch, tag, "
                           f"commit or refs/pr/N) or ORG/NAME for main")
    return repo, revision or None


def is_hub_id(spec: str) -> bool:
    try:
        return parse_hub_id(spec) is not None
    except HubCacheMiss:
        return True


def _cached_revisions(cache: Path, repo: str) -> str:
    """What the cache holds of `repo`, in words (huggingface_hub's scan_cache_dir): its refs and commits."""
    from huggingface_hub import scan_cache_dir

    try:
        repos = [r for r in scan_cache_dir(cache).repos if r.repo_id == repo and r.repo_type == "model"]
    except Exception:  # no cache folder at all, or one huggingface_hub cannot read: nothing to list
        return ""
    held = [f"{', '.join(sorted(rev.refs)) + ' = ' if rev.refs else ''}{rev.commit_hash}"
            for r in repos for rev in sorted(r.revisions, key=lambda v: v.commit_hash)]
    return f"; it holds {repo} at {'; '.join(held)}" if held else ""


def local_checkpoint(spec: str, cache_dir: str | Path | None = None) -> str:
    """`spec` itself when it is a local path or no hub id; else the cached snapshot directory of REPO at
    REVISION (default main). cache_dir: the hub cache (default: huggingface_hub's, from HF_HUB_CACHE/HF_HOME)."""
    if not spec or Path(spec).expanduser().exists():
        return spec
    parsed = parse_hub_id(spec)
    if parsed is None:
        return spec
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, revision = parsed
    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    try:
        return snapshot_download(repo, revision=revision, cache_dir=str(cache), local_files_only=True)
    except LocalEntryNotFoundError:
        rev = f" --revision {revision}" if revision else ""
        raise HubCacheMiss(
            f"model.checkpoint={spec}: no local directory of that name, and the Hugging Face cache {cache} holds no "
            f"snapshot of {repo}{'@' + revision if revision else ''}{_cached_revisions(cache, repo)}; run "
            f"`hf download {repo}{rev}` where the hub is reachable, with HF_HOME (or HF_HUB_CACHE) pointing at the "
            f"cache this run reads, or give the downloaded directory") from None


def hub_id_of(path: str | Path) -> str | None:
    """The hub id a snapshot directory of the cache is of (`.../models--ORG--NAME/snapshots/COMMIT` -> ORG/NAME), or
    None for any other directory: what a fine-tune's adapters name as their base (PEFT's base_model_name_or_path),
    since local_checkpoint turned the user's hub id into this path before launch."""
    parts = Path(path).expanduser().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/", 1)
    return None
