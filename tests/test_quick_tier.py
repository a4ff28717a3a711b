"""The quick tier (`bash scripts/test.sh --quick`, tests/conftest.py is_quick): a test that starts a process is out
by itself, whatever file it is in; every other test is in unless LEFT_OUT names it."""

from __future__ import annotations

import ast
from pathlib import Path

import conftest

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = '''
import subprocess, sys
import pytest
from tessera.hetero.tools.spawn import run_on_ranks


def _train(tmp):
    return subprocess.run([sys.executable, "-m", "tessera.recipes.train"], cwd=tmp)


def _on_two_ranks():
    return run_on_ranks(2, print)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("run"))


def test_a_rule():
    assert sorted([2, 1]) == [1, 2]


def test_trains_through_a_helper(tmp_path):
    _train(tmp_path)


def test_reads_a_fixture_that_trains(trained):
    assert trained


def test_on_ranks():
    _on_two_ranks()


def test_a_command():
    subprocess.run(["true"])
'''


def test_a_test_that_starts_a_process_directly_or_through_its_file_is_not_quick(tmp_path):
    path = tmp_path / "test_sample.py"
    path.write_text(SAMPLE)
    starting = conftest._starting_functions(path)
    assert "test_a_rule" not in starting
    assert {"test_trains_through_a_helper", "test_reads_a_fixture_that_trains", "test_on_ranks",
            "test_a_command"} <= starting


def test_left_out_names_tests_that_exist():
    for name, tests in conftest.LEFT_OUT.items():
        tree = ast.parse((ROOT / "tests" / name).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        functions = {t.split("[")[0] for t in tests}  # a parametrized id: its function
        assert functions <= defined, (name, functions - defined)


def test_quick_is_the_marker_test_sh_selects():
    text = (ROOT / "scripts" / "test.sh").read_text()
    assert 'tier=(-m quick)' in text and "--quick" in text
