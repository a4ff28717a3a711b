"""Routed experts as grouped GEMMs (models/moe_experts.GroupedGemmExperts, torch's _grouped_mm) against megatron's
per-expert loop (SequentialMLP, the oracle) on one rank: outputs and every gradient equal (<= 1e-5 fp32), at widths
_grouped_mm refuses unpadded, with an expert that gets no token, through a whole MoE HybridLM, in bf16 within the
loop's own bf16 spread; the cases the grouped path does not cover run the loop. EP, expert-TP, SP, CP and PP with
the grouped experts: tests/test_verify_moe.py and tests/test_moe_train.py (the trainer picks them by kernel_choice).
"""

from __future__ import annotations

import pytest
import torch
from _mcore_cpu import single_rank_world
from megatron.core.transformer.moe.experts import SequentialMLP

from tessera.hetero.parallel.kernel_choice import moe_experts_kernel
from tessera.models import configs
from tessera.models.hybrid_llm import HybridLM, hybrid_config, moe_spec
from tessera.models.moe_experts import GroupedGemmExperts, grouped_linear
from tessera.models.nemotron_h_hf import hybrid_config_from_hf


@pytest.fixture(scope="module")
def pg():
    return single_rank_world()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _experts(pg, cls, experts: int, hidden: int, ffn: int, dtype=torch.float32):
    config = hybrid_config(hybrid_pattern="E", hidden_size=hidden, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
                           num_attention_heads=2, num_moe_experts=experts, moe_router_topk=2, vocab_size=64,
                           params_dtype=dtype)
    spec = moe_spec(experts, cls).submodules.experts
    torch.manual_seed(0)
    return cls(experts, config, spec.submodules, pg_collection=pg).to(dtype)


def _run(module, x, counts, probs, grad):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    out, bias = module(x, counts, probs)
    assert bias is None
    module.zero_grad(set_to_none=True)
    out.backward(grad)
    return out, [x.grad, probs.grad] + [p.grad for p in module.parameters()]


def _inputs(counts, hidden, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = int(sum(counts))
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    probs = torch.rand(tokens, generator=g)  # the router's fp32 weights
    return x, torch.tensor(counts), probs, torch.randn(tokens, hidden, generator=g).to(dtype)


@pytest.mark.parametrize("hidden,ffn", [(64, 32), (6, 10)])  # (6, 10): rows of 24/40 bytes, zero-padded to 16s
def test_grouped_experts_equal_the_loop_fp32(pg, hidden, ffn):
    counts = [5, 0, 9, 3]  # expert 1 gets no token: its grads are zero in both
    loop = _experts(pg, SequentialMLP, 4, hidden, ffn)
    grouped = _experts(pg, GroupedGemmExperts, 4, hidden, ffn)
    grouped.load_state_dict(loop.state_dict())
    assert grouped.grouped_gemm_unsupported(torch.zeros(1, hidden)) is None
    x, c, probs, go = _inputs(counts, hidden)
    ref, ref_grads = _run(loop, x, c, probs, go)
    out, grads = _run(grouped, x, c, probs, go)
    assert _rel(out, ref) <= 1e-5
    names = ["x", "probs"] + [n for n, _ in loop.named_parameters()]
    for name, a, b in zip(names, grads, ref_grads):
        assert a is not None and a.shape == b.shape, name
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp(min=1), name
    assert grads[names.index("local_experts.1.linear_fc1.weight")].abs().max() == 0


def test_expert_weights_are_read_in_place_and_stay_packed_through_casts(pg):
    """The grouped GEMM reads the experts' weights as one tensor without copying them (GroupedGemmExperts._pack),
    also after the dtype casts the trainer does; a weight re-homed by hand falls back to a stacked copy, same numbers."""
    grouped = _experts(pg, GroupedGemmExperts, 4, 64, 32)
    for dtype in (torch.bfloat16, torch.float32):
        grouped.to(dtype)
        for name in ("linear_fc1", "linear_fc2"):
            weights = [getattr(e, name).weight for e in grouped.local_experts]
            stacked = grouped.stacked_weights(name)
            assert stacked.dtype == dtype and stacked.data_ptr() == weights[0].data_ptr()  # a view, not a copy
            assert all(torch.equal(stacked[j], w) for j, w in enumerate(weights))
    loop = _experts(pg, SequentialMLP, 4, 64, 32)
    loop.load_state_dict(grouped.state_dict())
    moved = grouped.local_experts[1].linear_fc2.weight
    moved.data = moved.data.clone()
    assert grouped.stacked_weights("linear_fc2").data_ptr() != grouped.local_experts[0].linear_fc2.weight.data_ptr()
    x, c, probs, go = _inputs([3, 0, 6, 5], 64)
    (out, grads), (ref, ref_grads) = _run(grouped, x, c, probs, go), _run(loop, x, c, probs, go)
    assert _rel(out, ref) <= 1e-5
    assert all((a - b).abs().max() <= 1e-5 * b.abs().max().clamp(min=1) for a, b in zip(grads, ref_grads))


def test_unaligned_width_is_what_grouped_mm_refuses_unpadded():
    """The padding is needed: _grouped_mm itself refuses a 6-wide fp32 row (24 bytes); grouped_linear pads it."""
    x, w, offs = torch.randn(5, 6), torch.randn(2, 4, 6), torch.tensor([2, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    ref = torch.cat([x[:2] @ w[0].T, x[2:] @ w[1].T])
    assert torch.allclose(grouped_linear(x, w, offs), ref, rtol=0, atol=1e-6)


def test_grouped_experts_bf16_within_the_loops_bf16_spread(pg):
    counts = [40, 7, 0, 25]
    exact = _experts(pg, SequentialMLP, 4, 64, 32)
    loop = _experts(pg, SequentialMLP, 4, 64, 32, torch.bfloat16)
    grouped = _experts(pg, GroupedGemmExperts, 4, 64, 32, torch.bfloat16)
    loop.load_state_dict(exact.state_dict())
    grouped.load_state_dict(exact.state_dict())
    x, c, probs, go = _inputs(counts, 64)
    ref, ref_grads = _run(exact, x, c, probs, go)
    half = [x.bfloat16(), c, probs, go.bfloat16()]
    loop_out, loop_grads = _run(loop, *half)
    out, grads = _run(grouped, *half)
    spread = _rel(loop_out.float(), ref)
    assert 0 < spread < 2e-2 and _rel(out.float(), ref) <= 1.5 * spread
    for a, b, r in zip(grads[2:], loop_grads[2:], ref_grads[2:]):
        if r.abs().max() > 0:
            assert _rel(a.float(), r) <= 1.5 * _rel(b.float(), r) + 1e-3


def test_cases_the_grouped_gemm_does_not_cover_run_the_loop(pg, monkeypatch):
    grouped = _experts(pg, GroupedGemmExperts, 4, 64, 32)
    assert "takes" in grouped.grouped_gemm_unsupported(torch.zeros(1, 64, dtype=torch.float64))
    hook = grouped.local_experts[2].linear_fc1.register_forward_hook(lambda m, i, o: (o[0] * 2, o[1]))
    assert "forward hooks" in grouped.grouped_gemm_unsupported(torch.zeros(1, 64))
    loop = _experts(pg, SequentialMLP, 4, 64, 32)
    loop.load_state_dict(grouped.state_dict())
    loop.local_experts[2].linear_fc1.register_forward_hook(lambda m, i, o: (o[0] * 2, o[1]))
    x, c, probs, go = _inputs([3, 4, 5, 6], 64)
    assert torch.equal(_run(grouped, x, c, probs, go)[0], _run(loop, x, c, probs, go)[0])  # the hook ran
    hook.remove()
    called = []
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: called.append(1) or torch.ops.aten._grouped_mm(*a, **k))
    _run(grouped, x, c, probs, go)
    assert called, "with the hook gone the grouped GEMM runs"


def test_moe_hybrid_lm_with_grouped_experts_equals_the_loop(pg):
    """A whole MoE HybridLM (Mamba, attention, MoE with router, shared expert, dispatcher): loss and every
    parameter's gradient with the experts kernel_choice picks equal to megatron's loop."""
    assert moe_experts_kernel()[0] is GroupedGemmExperts  # torch 2.13 has _grouped_mm: the trainer runs it
    config = hybrid_config_from_hf(configs.TINY_MOE)
    torch.manual_seed(0)
    loop = HybridLM(config, pg)
    grouped = HybridLM(config, pg, moe_experts=GroupedGemmExperts)
    grouped.load_state_dict(loop.state_dict())
    assert type(grouped.layers[3].mlp.experts) is GroupedGemmExperts
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, 24), generator=g)
    losses = []
    for model in (loop, grouped):
        loss = model(ids, labels).mean()
        loss.backward()
        losses.append(loss.detach())
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0])
    for (name, a), b in zip(grouped.named_parameters(), loop.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-5 * b.grad.abs().max().clamp(min=1e-12), name


def test_moe_spec_refuses_experts_without_the_loops_parameters():
    with pytest.raises(TypeError, match="subclass of it"):
        moe_spec(4, torch.nn.Linear)
