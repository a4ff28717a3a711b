"""`hetero.tools.verify --llm moe`: the chain's LLM with megatron-core MoE layers (sigmoid top-2 router over 4
experts with a fixed expert bias, one shared expert) in EP / TP+SP / CP / PP layouts == the one-device model.

One 4-rank launch runs every layout back to back (each launch costs seconds of imports on a 2-core box).
"""

import pytest
import torch

from tessera.hetero.tools.spawn import run_on_ranks

# (layout, microbatches, documents)
MOE_LAYOUTS = [
    ("vision=dp4@0-3;language=dp4,ep2@0-3", 1, 0),                # EP2 colocated (expert-DP 2 inside DP4)
    ("vision=tp2,dp2@0-3;language=tp2,dp2,ep2@0-3", 1, 0),        # EP2 x TP2, sequence parallel, colocated
    ("vision=dp2@0-1;language=dp2,ep2@2-3", 1, 0),                # EP2 non-colocated
    ("vision=dp4@0-3;language=pp2,dp2,ep2@0-3", 1, 0),            # EP2 with the LLM's PP2
    ("vision=dp4@0-3;language=cp2,dp2,ep4@0-3", 1, 0),            # EP4 over CP2 x DP2: one expert per rank
    ("vision=dp4@0-3;language=tp2,cp2,ep2@0-3", 1, 0),            # TP2 (SP) x CP2, EP2 over the CP ranks
    ("vision=tp2,dp2@0-3;language=tp2,pp2@0-3", 2, 0),            # SP across PP stages, 2 microbatches
    ("vision=dp2@0-1;language=dp2,ep2@2-3", 1, 3),                # packed documents: MoE per token, doc-alone
]
EXPERTS = 4


def _verify_moe(cases):
    from tessera.hetero.tools.verify import run_verify

    out = []
    for spec, microbatches, documents in cases:
        res = run_verify(spec, microbatches=microbatches, documents=documents, llm="moe")
        out.append({k: v for k, v in res.items() if k != "errors"} | {"compared": sorted(res["errors"])})
    return out


@pytest.mark.multiproc
def test_verify_moe_layouts_match_single_device():
    ranks = run_on_ranks(4, _verify_moe, MOE_LAYOUTS)
    for i, (spec, microbatches, documents) in enumerate(MOE_LAYOUTS):
        res = ranks[0][i]
        assert res["llm"] == "moe", (spec, res)
        assert res["max_rel_err"] <= 1e-5, (spec, res)
        assert res["bytes"] == res["min_bytes"], (spec, res)  # the boundary moved no more than the minimum
        assert res["ok"], (spec, res)
        # every layer's router, shared expert and each of the 4 routed experts was compared on some rank (each
        # expert on the EP ranks that own it)
        compared = {name for r in ranks for name in r[i]["compared"]}
        layers = {name.split(".")[2] for name in compared if name.startswith("grad language.layers.")}
        assert layers == {"0", "1"}, (spec, sorted(compared))
        for layer in layers:
            prefix = f"grad language.layers.{layer}"
            assert f"{prefix}.router.weight" in compared, (spec, sorted(compared))
            for part in [f"experts.{e}" for e in range(EXPERTS)] + ["shared"]:
                for fc in ("fc1", "fc2"):
                    assert f"{prefix}.{part}.{fc}.weight" in compared, (spec, part, sorted(compared))
        if documents:
            assert any(name.startswith("doc-alone") for r in ranks for name in r[i]["compared"]), spec


def test_verify_moe_refuses_ep_not_dividing_experts(monkeypatch, capsys):
    from tessera.hetero.plan.layout import LayoutError
    from tessera.hetero.tools.verify import main, validated_layout
    from tessera.hetero.tools.verify_chain_model import ChainDims

    spec = "vision=dp3@0-2;language=dp3,ep3@0-2"  # ep3 divides cp*dp = 3 (the layout is valid) but not 4 experts
    with pytest.raises(LayoutError, match=r"ep=3 does not divide the MoE chain's 4 experts.*use ep in \[1, 2, 4\]"):
        validated_layout(spec, ChainDims(), 3, llm="moe")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["--llm", "moe", "--layout", spec]) == 2  # before any process group exists
    assert "verify: FAIL invalid layout" in capsys.readouterr().err
    # ep on the dense chain has nothing to spread: refused, pointing at --llm moe
    with pytest.raises(LayoutError, match="--llm moe"):
        validated_layout("vision=dp2@0-1;language=dp2,ep2@0-1", ChainDims(), 2)


def test_moe_expert_bias_changes_the_routing():
    """The fixed expert bias shifts the top-k choice of some tokens in this chain (so the bias path is tested):
    the one-device model with the bias zeroed gives another output."""
    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.tools.verify import make_batch
    from tessera.hetero.tools.verify_chain_model import ChainDims, make_weights, reference_forward

    dims, layout = ChainDims(), HeteroLayout.parse("vision=dp4@0-3;language=dp4,ep2@0-3")
    batches, inputs, text, target, *_ = make_batch(layout, dims, 1234, torch.float64)
    w = {k: v.double() for k, v in make_weights(layout, dims, 1234, torch.float64, llm="moe").items()}
    y, _ = reference_forward(w, layout, dims, inputs, batches, text, target)
    unbiased = {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in w.items()}
    y0, _ = reference_forward(unbiased, layout, dims, inputs, batches, text, target)
    assert (y - y0).abs().max() > 1e-3 * y.abs().max()
