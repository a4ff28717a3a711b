"""The README's benchmark commands, each run in its short mode (tests/test_readme.py COMMANDS: the rows of group
"bench", their `short` arguments appended): exit status 0 and the table line the README points to."""

from __future__ import annotations

import pytest

from tests.test_readme import run_rows


@pytest.mark.multiproc
def test_readme_benchmarks_run_in_their_short_mode(tmp_path):
    failures = run_rows("bench", tmp_path)
    assert not failures, "\n\n".join(failures)
