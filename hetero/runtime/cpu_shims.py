"""The few patches megatron-core 0.16.1 needs to run on CPU with gloo. Applied only when no GPU exists.

Each shim names the upstream line it works around (megatron-core==0.16.1, pinned in pyproject.toml).
tests/test_cpu_shims.py fails when a shim stops being needed (upstream fixed it: delete the shim) or stops
working (upstream moved the code: update it). Nothing here changes behaviour on a machine with CUDA.

1. torch.cuda.current_device() -> "cpu". ~175 call sites build tensors on
   `torch.cuda.current_device()` (e.g. megatron/core/utils.py:631 GlobalMemoryBuffer,
   tensor_parallel/layers.py weight allocation); on CPU torch raises "Torch not compiled with CUDA".
2. The RNG tracker (tensor_parallel/random.py:235-238 CudaRNGStatesTracker.add, :422
   model_parallel_cuda_manual_seed, :55/:66 _get_cuda_rng_state, :102 _set_cuda_rng_state) reads and
   writes CUDA generator states. On CPU the device generator *is* the CPU generator, so these map onto it:
   tracker states are real CPU generator states and `fork()` really switches them (dropout differs per TP
   rank as on GPU, instead of being silently identical).
3. Without Transformer Engine, transformer/moe/moe_utils.py:22-39 leaves TE helper names undefined, yet
   router_gating_linear tests `te_general_gemm is not None` (moe_utils.py:1192, 1225) -> NameError.
   Defining the missing names as None takes the torch path. Needed on any machine without TE.
4. torch.cuda.synchronize() -> no-op. dist_checkpointing's torch_dist saver calls it before writing
   (dist_checkpointing/strategies/filesystem_async.py:230 preload_tensors); with no CUDA there is no
   device work to wait for.
5. torch.compile off. megatron's fusions are `jit_fuser = torch.compile` (megatron/core/jit.py:21, applied at import
   to activations.py, transformer/moe/router.py, moe/experts.py, fusions/fused_bias_*.py, ...): on CPU each
   process traces them with dynamo and builds C++ with inductor at its first call and at every new shape, ~2.7 s
   of a 4-rank tiny run's ~7 s per rank. megatron's own `disable_jit_fuser()` reaches only functions decorated after
   it, so every torch.compile region runs eagerly: `torch.compiler.set_stance("force_eager")`, torch's switch for
   this. The fused functions run the same fp32 ops (a 4-step MoE run's losses and grad norms are bitwise equal).
   Not `torch._dynamo.config.disable`: with it, each compiled function's first call still enters dynamo's frame
   callback, which builds torch's trace rules first (~0.45 s per process) only to skip the frame.
6. megatron's jit_fuser off from its import. Under shim 5 the decoration itself still costs: `jit_fuser =
   torch.compile` imports dynamo and inductor when megatron's fusions are decorated, 2.4 of the 4.3 CPU-s that
   `import megatron.core` takes in a fresh process (measured), paid by every rank, CLI and script on CPU.
   tessera/hetero/__init__.py installs a one-shot import hook that calls megatron's own `disable_jit_fuser()`
   (megatron/core/jit.py:27) right after megatron/core/jit.py runs, before any fusion binds the name, when torch
   sees no GPU. The fusions are then plain functions, the same ops shim 5 runs. A process that imports megatron.core
   before any tessera.hetero module keeps shim 5's path (same numbers, the import's cost paid).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

# torch is imported in the functions: tessera/hetero/__init__.py imports this module for shim 6, and the pure
# layout and plan modules under tessera.hetero need no torch
_applied = False
_TE_MOE_NAMES = (
    "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
    "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm",
)


def _define_missing_te_names() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE:
        for name in _TE_MOE_NAMES:
            if not hasattr(moe_utils, name):
                setattr(moe_utils, name, None)  # shim 3


def _cpu_get_rng_state(device="cuda", *args, **kwargs):
    import torch

    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, *args, **kwargs):
    import torch

    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed):
    import torch

    torch.default_generator.manual_seed(int(seed))


def _cpu_current_device():
    return "cpu"


def _cpu_synchronize(device=None):
    return None


def apply_cpu_shims() -> bool:
    """Patch megatron-core for CPU if there is no GPU (shim 3: whenever TE is missing). Idempotent.
    Returns True if the CPU shims are active."""
    import torch

    global _applied
    _define_missing_te_names()
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = _cpu_current_device  # shim 1
    torch.cuda.get_rng_state = _cpu_get_rng_state  # shim 2
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed
    torch.cuda.synchronize = _cpu_synchronize  # shim 4
    from megatron.core import jit

    if jit.jit_fuser is not jit.noop_decorator:  # shim 6 came too late for this process (megatron imported first)
        torch.compiler.set_stance("force_eager")  # shim 5 (torch.compiler imports dynamo: 0.3-1.2 CPU-s)
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    _applied = True
    return True


class _MegatronJitOffOnCpu(importlib.abc.MetaPathFinder):
    """Shim 6: megatron.core.jit is loaded as usual, then (no GPU) megatron's disable_jit_fuser() runs at once."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core.jit":
            return None
        sys.meta_path.remove(self)  # one-shot, and so find_spec below does not come back here
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:  # no megatron-core here: the import fails as it would anyway
            return None
        exec_module = spec.loader.exec_module

        def exec_then_disable(module):
            exec_module(module)
            import torch  # imported by megatron/core/jit.py just now

            if not torch.cuda.is_available():
                module.disable_jit_fuser()

        spec.loader.exec_module = exec_then_disable
        return spec


def turn_megatron_jit_off_at_its_import() -> None:
    """Shim 6, installed by tessera/hetero/__init__.py; a no-op once megatron.core.jit is imported."""
    if "megatron.core.jit" not in sys.modules and not any(isinstance(f, _MegatronJitOffOnCpu) for f in sys.meta_path):
        sys.meta_path.insert(0, _MegatronJitOffOnCpu())


def default_backend() -> str:
    """The process-group backend of this run: NCCL with a GPU, gloo without. Used only to initialise the
    default group; every subgroup inherits it (never hard-coded elsewhere)."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"
