"""Mutation check: apply each named small bug to a scratch copy of the tree, one at a time, run the fast tests
that should catch it, and print which caught it.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/mutate.py                 # every mutation in scripts/mutations.toml
    OMP_NUM_THREADS=1 .venv/bin/python scripts/mutate.py --only ffd_strict_fit --keep
    OMP_NUM_THREADS=1 .venv/bin/python scripts/mutate.py --fast --jobs 2 # the `fast = true` ones: CI, ~3 min

The list is plain data (scripts/mutations.toml: name, file, find, replace, tests, why); grow it whenever a bug
escapes the suite. Each `find` must occur exactly once in its file. The scratch copy holds the working tree's
tracked and untracked-not-ignored files (and a link to .venv); a `tessera` package of links in front of it on PYTHONPATH makes
`import tessera.*` load the scratch copy, not this checkout (checked in every run). First the selected
tests run unmutated (they must pass, or a "caught" would mean nothing); then, per mutation, its tests run with
`pytest -x`: exit 1 = caught, 0 = escaped. Each pytest runs in a fork of a server that imported torch,
megatron-core, transformers and NeMo once (never tessera, so the fork imports the mutated copy): ~1-3 s a
mutation instead of ~7 s, most of it imports. The whole list takes minutes per mutation; its table goes in notes.
`--fast` takes the entries marked `fast = true` (their tests take seconds, import included): scripts/test.sh runs
them after a full suite, so a rule whose test stops catching its bug fails CI. `--jobs N` runs N mutations at once,
each in its own scratch copy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hetero", "models", "data", "recipes", "scripts")


def load(path: Path) -> list[dict]:
    entries = tomllib.loads(path.read_text())["mutation"]
    for e in entries:
        missing = {"name", "file", "find", "replace", "tests"} - set(e)
        if missing:
            raise SystemExit(f"{path}: mutation {e.get('name', '?')!r} lacks {sorted(missing)}")
    return entries


def scratch_copy(dst: Path) -> dict[str, str]:
    """Copy the working tree into dst; returns the environment that imports tessera from dst."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    (dst / ".venv").symlink_to(ROOT / ".venv", target_is_directory=True)  # tests run .venv/bin/nemo, torchrun
    ns = dst / ".mutate_ns" / "tessera"
    ns.mkdir(parents=True)
    (ns / "__init__.py").write_text("")
    for pkg in PACKAGES:
        (ns / pkg).symlink_to(dst / pkg, target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(dst / ".mutate_ns"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONDONTWRITEBYTECODE="1")
    return env  # every forked run checks that it imports tessera from dst (_pytest_in_fork)


# Imported once by a forkserver that every pytest run forks from (~0.1 s a run instead of ~5 s of imports): heavy
# libraries only, never tessera, so each fork imports the scratch copy's (mutated) tessera afresh.
PRELOAD = ["torch", "torch.distributed", "numpy", "megatron.core", "transformers", "pytest",
           "nemo.collections.asr.modules"]
_SERVER = None


def _server():
    global _SERVER
    if _SERVER is None:
        import multiprocessing as mp

        _SERVER = mp.get_context("forkserver")
        _SERVER.set_forkserver_preload(PRELOAD)  # the server starts at the first run
    return _SERVER


def _pytest_in_fork(dst: str, env: dict, tests: list[str], log: str) -> None:
    """The forked child: the scratch copy's environment and import path, then pytest, output to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(dst)
    os.environ.clear()
    os.environ.update(env)
    # no bytecode: a mutation and its undo can share a second and a size, and a stale .pyc would run the other one
    sys.dont_write_bytecode = True
    sys.path[:0] = [p for p in env["PYTHONPATH"].split(os.pathsep) if p] + [dst]  # as `python -m pytest` in dst
    import pytest as _pytest

    import tessera.data

    if not tessera.data.__path__[0].startswith(dst):
        print(f"scratch copy not imported (tessera.data from {tessera.data.__path__[0]!r}); refusing to mutate",
              flush=True)
        os._exit(3)
    rc = _pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(rc))


def pytest(dst: Path, env: dict, tests: list[str], timeout: int) -> tuple[int, float, str]:
    """pytest -x over `tests` in the scratch copy dst, in a fork of the preloaded server: (exit code, s, output)."""
    t0 = time.perf_counter()
    log = dst / ".mutate_pytest.log"
    proc = _server().Process(target=_pytest_in_fork, args=(str(dst), env, tests, str(log)))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        from tessera.hetero.tools.spawn import kill_tree  # the checkout's: only psutil, run here in the parent

        kill_tree(proc.pid)
        rc = -1
    else:
        rc = proc.exitcode
    out = log.read_text() if log.exists() else ""
    return rc, time.perf_counter() - t0, out if rc != -1 else out + "\ntimeout"


def mutate_one(dst: Path, env: dict, e: dict, timeout: int) -> tuple[str, str, str, float]:
    """(name, verdict, first failing test, seconds) of one mutation applied to the scratch copy dst."""
    path = dst / e["file"]
    original = path.read_text()
    if original.count(e["find"]) != 1:
        return e["name"], "find text not found once", "-", 0.0
    path.write_text(original.replace(e["find"], e["replace"]))
    try:
        rc, dt, out = pytest(dst, env, e["tests"], timeout)
    finally:
        path.write_text(original)
    failed = [line.split(" ")[1] for line in out.splitlines() if line.startswith("FAILED ")]
    verdict = {0: "ESCAPED", 1: "caught"}.get(rc, f"exit {rc}")
    if rc == 0 and " passed" not in (out.strip().splitlines() or [""])[-1]:
        verdict = "not run (all skipped)"
    print(f"{e['name']}: {verdict} {failed[:1]} ({dt:.0f} s)", flush=True)
    return e["name"], verdict, failed[0] if failed else "-", dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", type=Path, default=ROOT / "scripts" / "mutations.toml")
    ap.add_argument("--only", nargs="*", help="mutation names")
    ap.add_argument("--fast", action="store_true", help="only the entries marked fast = true")
    ap.add_argument("--jobs", type=int, default=1, help="mutations at once, one scratch copy each")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies")
    a = ap.parse_args(argv)
    entries = [e for e in load(a.list) if (not a.only or e["name"] in a.only) and (not a.fast or e.get("fast"))]
    t0 = time.perf_counter()
    dsts = [Path(tempfile.mkdtemp(prefix="tessera_mutate_")) for _ in range(max(1, min(a.jobs, len(entries))))]
    try:
        envs = [scratch_copy(dst) for dst in dsts]
        tests = sorted({t for e in entries for t in e["tests"]})
        # unmutated first, split over the copies: each forked run must pass where the mutations will run
        t1 = time.perf_counter()
        with ThreadPoolExecutor(len(dsts)) as pool:
            base = list(pool.map(lambda i: pytest(dsts[i], envs[i], tests[i::len(dsts)], a.timeout), range(len(dsts))))
        dt = time.perf_counter() - t1
        for rc, _, out in base:
            if rc != 0:
                print(out[-4000:])
                raise SystemExit(f"the selected tests fail unmutated (exit {rc}); fix that first")
        print(f"baseline: {len(tests)} test selections pass unmutated ({dt:.0f} s)", flush=True)
        # each worker takes the next mutation for its own copy: a copy holds one mutation at a time
        with ThreadPoolExecutor(len(dsts)) as pool:
            free = Queue()
            for i in range(len(dsts)):
                free.put(i)

            def job(e):
                i = free.get()
                try:
                    return mutate_one(dsts[i], envs[i], e, a.timeout)
                finally:
                    free.put(i)

            rows = list(pool.map(job, entries))
    finally:
        if not a.keep:
            for dst in dsts:
                shutil.rmtree(dst, ignore_errors=True)
    print(f"\n{len(rows)} mutations in {time.perf_counter() - t0:.0f} s")
    print("\n| mutation | verdict | caught by | s |\n|---|---|---|---:|")
    for name, verdict, by, dt in rows:
        print(f"| {name} | {verdict} | {by} | {dt:.0f} |")
    return 0 if all(v == "caught" for _, v, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
