"""Entry points: data preparation, conversion, dry runs, benchmarks."""

import tessera.hetero  # noqa: F401  (first: its import quiets third-party notices, hetero/runtime/quiet.py)
