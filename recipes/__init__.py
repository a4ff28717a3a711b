"""Named recipes and the training entry point (nemo-run factories, the `nemo tessera` CLI)."""

import os

# the libraries' progress bars (energon's "Filling reading buffer", twice per loader and per validation) say
# nothing in a rank's log; tqdm reads this once, when torch imports it (tessera.hetero, next line): set first.
# The run's own bar (hetero/training/metrics.py) passes disable=False; nemo-run's jobs get it from
# recipes/executors.QUIET as well.
os.environ.setdefault("TQDM_DISABLE", "1")

import tessera.hetero  # noqa: E402,F401  (first: its import quiets third-party notices, hetero/runtime/quiet.py)
