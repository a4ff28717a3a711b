"""The megatron-core CPU shims: each must still be needed (else delete it) and must still work.

"Needed" is checked in a fresh interpreter without the shims; "works" in this one with them applied.
"""

import subprocess
import sys

import pytest
import torch

from tessera.hetero.runtime.cpu_shims import apply_cpu_shims

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims apply only without a GPU")

WITHOUT_SHIMS = r"""
import torch, sys
failures = []
try:
    torch.cuda.current_device(); failures.append("current_device works without the shim")
except Exception:
    pass
from megatron.core.tensor_parallel import random as r
try:
    r.CudaRNGStatesTracker().add("x", 1); failures.append("rng tracker works without the shim")
except Exception:
    pass
from megatron.core.transformer.moe import moe_utils
if moe_utils.HAVE_TE or hasattr(moe_utils, "te_general_gemm"):
    failures.append("moe_utils defines te_general_gemm without TE: shim 3 is obsolete")
try:
    torch.cuda.synchronize(); failures.append("torch.cuda.synchronize works without the shim: shim 4 is obsolete")
except Exception:
    pass
from megatron.core import jit
if jit.jit_fuser is not torch.compile:
    failures.append("megatron's jit_fuser is no longer torch.compile: shim 5 is obsolete")
print(failures); sys.exit(1 if failures else 0)
"""


def test_each_shim_is_still_needed():
    proc = subprocess.run([sys.executable, "-c", WITHOUT_SHIMS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


MEGATRON_AFTER_TESSERA_HETERO = r"""
import sys
import tessera.hetero
import torch
from megatron.core import jit
from megatron.core.activations import squared_relu
from megatron.core.transformer.moe import router
x = torch.randn(8)
problems = [p for p, bad in [
    ("jit_fuser is still torch.compile", jit.jit_fuser is not jit.noop_decorator),
    ("megatron's fusions are still compiled", hasattr(squared_relu, "__wrapped__")),
    ("dynamo or inductor was imported", "torch._dynamo" in sys.modules or "torch._inductor.compile_fx" in sys.modules),
    ("squared_relu differs", not torch.equal(squared_relu(x), torch.relu(x) ** 2))] if bad]
print(problems); sys.exit(1 if problems else 0)
"""


def test_megatron_imported_after_tessera_hetero_has_its_fusions_uncompiled():
    """Shim 6: a process that imports tessera.hetero first (every rank, CLI and tool) gets megatron's fusions as
    plain functions, without importing dynamo and inductor (2.4 CPU-s a process)."""
    proc = subprocess.run([sys.executable, "-c", MEGATRON_AFTER_TESSERA_HETERO], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


MEGATRON_BEFORE_TESSERA_HETERO = r"""
import sys
import torch
import megatron.core  # first: shim 6 comes too late, so shim 5 must keep megatron's fusions out of dynamo
from tessera.hetero.runtime.cpu_shims import apply_cpu_shims
from megatron.core.activations import squared_relu  # decorated with jit_fuser = torch.compile at import
from torch._dynamo.convert_frame import input_codes
apply_cpu_shims()
x = torch.randn(8)
problems = [p for p, bad in [
    ("squared_relu differs", not torch.equal(squared_relu(x), torch.relu(x) ** 2)),
    # dynamo's frame callback records every frame it is handed, even one it then skips (after building its trace
    # rules, ~0.45 s a process): under shim 5 it is never handed one
    ("megatron's fusions entered dynamo", squared_relu.__wrapped__.__code__ in input_codes)] if bad]
print(problems); sys.exit(1 if problems else 0)
"""


def test_megatron_imported_before_tessera_hetero_runs_its_fusions_eagerly():
    """Shim 5, for a process that imported megatron.core before tessera.hetero (shim 6 then cannot act)."""
    proc = subprocess.run([sys.executable, "-c", MEGATRON_BEFORE_TESSERA_HETERO], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shims_make_megatron_work_on_cpu():
    assert apply_cpu_shims() is True and apply_cpu_shims() is True  # idempotent
    assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.synchronize() is None  # shim 4: dist_checkpointing's saver calls it
    from megatron.core.tensor_parallel import random as r
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None
    tracker = r.CudaRNGStatesTracker()
    tracker.add("a", 11)
    tracker.add("b", 12)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        a1 = torch.rand(4)
    with tracker.fork("b"):
        b1 = torch.rand(4)
    with tracker.fork("a"):
        a2 = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
    torch.manual_seed(11)
    assert torch.equal(a1, torch.rand(4)), "tracker state 'a' is the CPU generator seeded with 11"
    assert not torch.equal(a1, b1) and not torch.equal(a1, a2), "states advance and differ per name"
