"""The README's `nemo tessera ...` commands are the ones that work: each one, as written, resolves with
--dryrun (config parsed, names and layout validated, executor sized) without an error. The commands that
really train are run elsewhere: scripts/main.sh (the main job), tests/test_slurm.py, tests/test_finetune.py."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEMO = ROOT / ".venv" / "bin" / "nemo"


def readme_nemo_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+#.*$", "", l).strip() for l in lines if l.strip().startswith(".venv/bin/nemo tessera")]


def test_readme_shows_the_cli_for_every_user_task():
    cmds = readme_nemo_commands()
    assert any(" finetune " in c and "run.executor=slurm" in c for c in cmds)          # run on Slurm
    assert any("model.checkpoint=" in c for c in cmds)                                # fine-tune a checkpoint
    assert any("model.vision=" in c for c in cmds) and any("model.audio=" in c for c in cmds)  # swap
    assert any(" plan " in c for c in cmds) and any("layout=" in c for c in cmds)     # choose a layout


@pytest.mark.skipif(not NEMO.exists(), reason="nemo CLI not installed in .venv")
@pytest.mark.parametrize("cmd", [c for c in readme_nemo_commands() if "--help" not in c])
def test_readme_command_resolves(cmd):
    args = shlex.split(cmd)
    args = [a for a in args if a not in ("--yes", "--dryrun")] + ["--dryrun"]
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    res = subprocess.run([str(ROOT / args[0])] + args[1:], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Error" not in out.replace("error_handling", ""), out[-3000:]
    assert "Dry run" in out or "dryrun" in out.lower(), out[-2000:]
