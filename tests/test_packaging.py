"""The built wheel installs everything under one `tessera` namespace: beside another project's top-level
`models` and `data` packages it imports, and `nemo tessera finetune --help` works from it.

The wheel goes into a fresh virtual environment (no pip, its own site-packages); the heavy dependencies come
from this checkout's .venv through a directory of links to its site-packages entries, minus everything of the
editable install (tessera's dist-info, the __editable__ finder and every .pth file), and nothing runs with
the repo root on sys.path, so the imports can only be satisfied by the wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tessera.recipes import registry

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("hetero", "data", "models", "recipes", "scripts")
TOP_LEVEL_NAMES = set(PACKAGE_DIRS)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the source (so the build leaves nothing in the checkout)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for f in ROOT.iterdir():  # pyproject.toml, README.md and whatever else it may name
        if f.is_file():
            shutil.copy2(f, src / f.name)
    for d in PACKAGE_DIRS:
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("tessera-*.whl")
    return whl


@pytest.fixture(scope="module")
def env(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """(python of a fresh venv with only the wheel installed, a directory holding rival `models`/`data`)."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root / "env")
    python = root / "env" / "bin" / "python"
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                          "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # the dependencies: links to this .venv's site-packages, without the editable install of this checkout
    deps = root / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        n = entry.name
        if n.startswith(("tessera", "__editable__")) or n.endswith(".pth") or n == "__pycache__":
            continue
        (deps / n).symlink_to(entry)
    # another project's top-level packages, named like the folders this repo maps into tessera.*
    rivals = root / "rivals"
    for name in ("models", "data"):
        (rivals / name).mkdir(parents=True)
        (rivals / name / "__init__.py").write_text(f"WHOSE = 'rival {name}'\n")
    (site / "zz_deps.pth").write_text(f"{rivals}\n{deps}\n")
    return python, rivals


def _run(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([str(python), *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=180)


def test_wheel_has_only_the_tessera_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"tessera"}, tops
    assert not tops & TOP_LEVEL_NAMES
    for pkg in ("tessera/models/hybrid_llm.py", "tessera/hetero/training/loop.py", "tessera/recipes/cli.py",
                "tessera/data/loader.py", "tessera/scripts/convert_hf.py"):
        assert pkg in names, pkg
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/entry_points.txt")))
    assert b"[nemo_run.cli]\ntessera = tessera.recipes.cli" in entry_points


def test_wheel_imports_beside_other_models_and_data_packages(env, tmp_path):
    python, rivals = env
    code = (
        "import sys, tessera.models.hybrid_llm as h, tessera.data.loader as l, tessera.hetero.training.loop, models, data\n"
        "assert not any(p in ('', '.', {root!r}) for p in sys.path), sys.path\n"
        "print(h.__file__); print(l.__file__); print(models.__file__, models.WHOSE); print(data.__file__, data.WHOSE)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {tops!r} and m not in ('models', 'data')))\n"
        "print(sorted(f for m in list(sys.modules.values()) if (f := getattr(m, '__file__', None))\n"
        "             and f.startswith({root!r}) and not f.startswith({venv!r})))\n"
    ).format(root=str(ROOT), venv=str(ROOT / ".venv"), tops=tuple(TOP_LEVEL_NAMES))
    # -P: the script's directory (the empty string) stays off sys.path as well
    p = _run(python, tmp_path, "-P", "-c", code)
    assert p.returncode == 0, p.stderr[-3000:]
    hybrid, loader, models_line, data_line, leaked, from_checkout = p.stdout.splitlines()[-6:]
    site = str(python.parent.parent)
    assert hybrid.startswith(site) and hybrid.endswith("tessera/models/hybrid_llm.py"), hybrid
    assert loader.startswith(site) and loader.endswith("tessera/data/loader.py"), loader
    assert models_line == f"{rivals / 'models' / '__init__.py'} rival models"
    assert data_line == f"{rivals / 'data' / '__init__.py'} rival data"
    assert leaked == "[]", f"the package imported top-level names: {leaked}"
    assert from_checkout == "[]", f"modules loaded from the checkout, not the wheel: {from_checkout}"


def test_nemo_tessera_finetune_help_from_the_wheel(env, tmp_path):
    python, _ = env
    # what the `nemo` console script runs; nemo-run reads sys.argv when nemo_run.__main__ builds the app
    code = ("import sys; sys.argv = ['nemo', 'tessera', 'finetune', '--help']; from nemo_run.__main__ import app; "
            "sys.exit(app())")
    p = _run(python, tmp_path, "-P", "-c", code)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    for name in [*registry.BASES, "local", "slurm"]:
        assert name in p.stdout, name
