#!/usr/bin/env bash
# Tessera's test suite on a fresh machine (sets up .venv first). Extra arguments go to pytest.
#   bash scripts/test.sh            # everything, then the fast mutation check: ~28-33 min on a 2-core box (2 pytest
#                                   # workers; + ~6 min to build .venv the first time)
#   bash scripts/test.sh -k plan    # a subset
#   bash scripts/test.sh --quick    # the quick tier (pytest -m quick: tests/conftest.py is_quick, no test that starts a
#                                   # process): ~940 tests in ~2.5 min on 2 cores; no mutation check
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_venv.sh"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two workers (this box's 2 cores); a file's tests stay on one worker, so module fixtures are built once and
# the Slurm tests share one cluster. Multi-rank tests spawn their own processes either way.
# --no-loadscope-reorder: files in tests/conftest.py's order (longest first), not xdist's by number of tests.
# --durations=15: the slowest tests, where the suite's minutes go (issue 45)
tier=()
if [ "${1:-}" = "--quick" ]; then
  shift
  tier=(-m quick)
fi
.venv/bin/python -m pytest -q -n "${TESSERA_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 \
  "${tier[@]}" "$@"
# After a full suite, the mutations whose tests take seconds (scripts/mutations.toml, fast = true): each breaks a
# rule on purpose and its test must fail; one that passes means the rule is no longer tested, and CI fails.
if [ "$#" -eq 0 ] && [ "${#tier[@]}" -eq 0 ]; then
  .venv/bin/python scripts/mutate.py --fast --jobs "${TESSERA_TEST_WORKERS:-2}" --timeout 300
fi
