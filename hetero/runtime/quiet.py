"""Third-party notices that tell a Tessera user nothing they can act on, silenced where they are emitted.

Installed once per process, before those libraries are imported, by tessera/hetero/__init__.py (which every entry
point's package imports first: tessera/recipes/__init__.py, tessera/scripts/__init__.py). Each entry names its
emitter and why it says nothing to the user; anything else a library warns about still shows.
- nv_one_logger (NeMo's telemetry, imported with NeMo's ASR collection): "OneLogger: Setting error_handling_strategy
  ... with OneLogger disabled" and "No exporters were provided": telemetry Tessera never enables. Its loggers'
  level, not a warnings filter.
- megatron-core on a machine without a GPU: "Transformer Engine and Apex are not installed. Falling back to ..."
  and "Apex is not installed. Falling back to Torch Norm" (one per module at import, 6 per process): on CPU the torch
  path is the design (the `gpu` extra brings Transformer Engine); on a GPU machine they stay, a missing TE is
  worth knowing there. A filter on those messages from megatron's modules only.
"""

from __future__ import annotations

import logging
import warnings

_DONE = []


def quiet_third_party_notices() -> None:
    if _DONE:
        return
    _DONE.append(True)
    logging.getLogger("nv_one_logger").setLevel(logging.ERROR)
    import torch

    if not torch.cuda.is_available():
        warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed",
                                category=UserWarning, module=r"megatron\.")
