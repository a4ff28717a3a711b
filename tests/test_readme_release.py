"""The README's fine-tune-a-release chain, run as written (tests/test_readme.py COMMANDS: the rows of group
"release"): the tiny release in the hub's layout, a one-step non-colocated fine-tune from it through `nemo ... --yes`
with export, transformers' class loading the export, and the multimodal parity tool on 4 ranks."""

from __future__ import annotations

import pytest

from tests.test_readme import run_rows


@pytest.mark.multiproc
def test_readme_release_chain_runs_as_written(tmp_path):
    failures = run_rows("release", tmp_path)
    assert not failures, "\n\n".join(failures)
