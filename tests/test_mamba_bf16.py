"""bf16 Mamba-2: the SSD scan computes in float32 whatever dtype its inputs come in.

Training runs the hybrid LLM in bf16; the scan's exp/cumsum decays and C.B scores lose ~3 significant
digits in bf16 (the relative error of one bf16 product is 2^-8), so models/mamba2.ssd_chunk_scan upcasts.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_mamba_bf16.py -q
"""

import pytest
import torch
import torch.nn.functional as F
from _mcore_cpu import single_rank_world

from tessera.models import configs
from tessera.models.hybrid_llm import HybridLM
from tessera.models.mamba2 import ssd_chunk_scan
from tessera.models.nemotron_h_hf import hybrid_config_from_hf


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("seed,length,chunk", [(0, 64, 16), (1, 61, 16), (2, 40, 8)])
def test_bf16_scan_equals_fp32_scan_of_the_same_values(seed, length, chunk):
    """bf16 inputs give the float32 scan of the same (bf16-representable) values.

    Tolerance 1e-6: with the upcast the two calls run identical float32 ops on identical values (measured
    difference 0.0). Without it (every `.float()` dropped, so the scan runs in bf16) the measured
    relative max error is 4e-3 .. 1.2e-2 on y and 1.2e-2 .. 2.4e-2 on the final state for these inputs,
    more than three orders of magnitude above the bound."""
    torch.manual_seed(seed)
    b, h, p, g, n = 2, 4, 16, 2, 32
    x, dt = torch.randn(b, length, h, p), F.softplus(torch.randn(b, length, h) - 1)
    A, B, C = -torch.exp(2 * torch.rand(h)), torch.randn(b, length, g, n), torch.randn(b, length, g, n)
    state0 = 0.5 * torch.randn(b, h, p, n)
    args = [t.bfloat16() for t in (x, dt, A, B, C)]
    for init in (None, state0.bfloat16()):
        y16, s16 = ssd_chunk_scan(*args, chunk_size=chunk, initial_state=init)
        y32, s32 = ssd_chunk_scan(*[t.float() for t in args], chunk_size=chunk,
                                  initial_state=None if init is None else init.float())
        assert _rel(y16, y32) < 1e-6 and _rel(s16, s32) < 1e-6, (_rel(y16, y32), _rel(s16, s32))
        assert y16.dtype == s16.dtype == torch.float32, "the scan returns float32 (callers add D and norm in fp32)"


def test_bf16_mixer_matches_fp32_mixer_on_the_same_weights():
    """The whole mixer in bf16 (megatron's bf16 params) against the same bf16-rounded weights in fp32.

    Tolerance 5e-2: in_proj/out_proj matmuls and the bf16 output round at 2^-8 each; measured 1.1e-2 for
    this input. A scan that does not upcast raises here (bf16 B/C meet float32 dt/decays in one einsum)."""
    pg = single_rank_world()
    cfg = hybrid_config_from_hf(configs.TINY_DENSE)
    torch.manual_seed(0)
    mixers = [HybridLM(cfg, pg).eval().layers[0].mixer for _ in range(2)]
    with torch.no_grad():
        for prm in mixers[0].parameters():
            prm.add_(0.3 * torch.randn_like(prm))
    bf16, fp32 = mixers[0].to(torch.bfloat16), mixers[1]
    fp32.load_state_dict({k: v.float() if torch.is_tensor(v) else v for k, v in bf16.state_dict().items()})
    x = torch.randn(29, 2, cfg.hidden_size).bfloat16()  # [s, b, h]; 29 = 3 chunks of 8 + a padded one
    with torch.no_grad():
        got, _ = bf16(x)
        want, _ = fp32(x.float())
    assert got.dtype == torch.bfloat16 and bool(torch.isfinite(got).all())
    assert _rel(got, want) < 5e-2, _rel(got, want)
