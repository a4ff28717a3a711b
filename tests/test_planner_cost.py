"""Cost model: hand-computable FLOPs, parameters and memory; closed-form boundary rows vs plan_boundary;
infeasible layouts come back with the reason."""

import numpy as np
import pytest

from tessera.hetero.plan.boundary_plan import BoundaryBatch, plan_boundary
from tessera.hetero.plan.layout import HeteroLayout
from tessera.hetero.planner import Constants, Workload, cluster, describe_model, predict
from tessera.hetero.planner.comm import boundary_rows
from tessera.hetero.planner.cost import GIB, items_of
from tessera.hetero.planner.model import llm_blocks, describe_llm
from tessera.models import configs


@pytest.mark.parametrize("name", ["nemotron_nano_12b_v2", "nemotron_nano_9b_v2", "nemotron_3_nano_30b_a3b"])
def test_llm_parameters_match_the_published_sizes(name):
    assert describe_llm(name).params == pytest.approx(configs.REGISTRY[name]["published_params"], rel=2e-3)


def test_block_flops_by_hand():
    c = configs.hf_fields("nemotron_h_tiny_dense")  # h 64, ffn 96, 4 heads x 16, 2 KV heads
    b = llm_blocks(c)
    assert b["-"]["flops"] == 2 * 2 * 64 * 96                         # up + down projection
    assert b["*"]["flops"] == 2 * 64 * (4 + 2 * 2) * 16 + 2 * 4 * 16 * 64  # qkv + output projection
    assert b["*"]["attn"] == 2 * 4 * 16                                # 2*2*q*hd per position, causal half
    d = describe_llm("nemotron_h_tiny_dense")
    assert d.linear_flops == sum(b[ch]["flops"] for ch in c["hybrid_override_pattern"])
    assert d.head_flops == 2 * 64 * 128


def test_single_gpu_step_is_compute_plus_optimizer():
    model = describe_model("nemotron_h_bench_100m")
    w = Workload(seq_length=1024, global_batch=4)
    k = Constants()
    p = predict("language=dp1@0-0", model, w, cluster("h100", 1), k, recompute=())
    llm = model["language"]
    flops = 3 * 4 * 1024 * (llm.linear_flops + llm.attn_flops * 1024 + llm.head_flops)
    assert p.breakdown["compute"] == pytest.approx(flops / (989.4e12 * k.eff_llm), rel=1e-12)
    assert all(p.breakdown[n] == 0 for n in ("tp", "cp", "ep", "pp", "dp", "boundary", "bubble"))
    assert p.step_s == pytest.approx(sum(p.breakdown.values()), rel=1e-12)
    assert p.tokens_per_s * p.step_s == pytest.approx(4 * 1024)
    assert p.tflops_per_gpu == pytest.approx(flops / p.step_s / 1e12)


def test_memory_of_a_known_layout():
    model = describe_model("nemotron_nano_12b_v2")
    w = Workload(seq_length=4096, global_batch=8)
    p = predict("language=tp4,dp2@0-7", model, w, cluster("h100", 8), recompute=())
    llm = model["language"]
    rep = llm.replicated_params               # norms: whole on every TP rank
    local = (llm.params - rep) / 4 + rep      # pp=1: every other parameter split by tp
    states = 2 * local + 4 * local + 12 * local / 2   # bf16 weights, fp32 grads, Adam over dp*cp = 2
    tokens = 4096                             # one sequence per microbatch per DP replica, cp=1
    # sharded activations split by tp, residual-width ones (4h per layer) whole; last stage: 4h + fp32 logits / tp
    act = tokens * (llm.act_bytes / 4 + 62 * 4 * 5120) + tokens * (4 * 5120 + 4 * 131072 / 4)
    assert p.memory_gib["0-7"] == pytest.approx((states + act) / GIB, rel=1e-12)
    assert p.feasible and p.microbatches == 4


def test_boundary_rows_equal_plan_boundary():
    specs = ["vision=dp4@0-3;language=tp2,cp2@0-3", "vision=tp2,cp2@0-3;language=tp4@4-7",
             "vision=dp8@0-7;language=tp2,cp2,pp2@0-7", "vision=tp2,dp2,pp2@0-7;language=tp2,cp4,dp2@8-23",
             "vision=dp8@0-7;language=cp4,dp2@0-7", "vision=tp4,dp2@0-7;language=tp2,cp2,dp2@0-7"]
    for spec in specs:
        lay = HeteroLayout.parse(spec)
        src, dst = lay["vision"], lay["language"]
        n, t = 2 * np.lcm(src.dp_size, dst.dp_size), 6 * dst.cp * src.cp
        plan = plan_boundary(src, dst, BoundaryBatch.from_lists(4 * t, [np.arange(t) * 4] * n))  # evenly spread
        rows = boundary_rows(src, dst, n, t)
        per = lambda d, side: {r: sum(len(x.dst_index) for x in getattr(d, side)(r)) for r in d.out_rows}  # noqa
        sends = {r: sum(len(x.src_index) for x in plan.forward.sends(r)) for r in plan.forward.in_rows}
        assert rows.fwd_recv_max == max(per(plan.forward, "recvs").values()), spec
        assert rows.bwd_recv_max == max(per(plan.backward, "recvs").values()), spec
        assert rows.fwd_send_max == max(sends.values()), spec
        assert (rows.fwd_moved, rows.bwd_moved) == (plan.forward.rows_moved(), plan.backward.rows_moved()), spec


def test_media_tokens_per_unit():
    vl = describe_model("nemotron_nano_12b_v2", "radio_vit_h", "fastconformer_parakeet_0_6b")
    assert items_of(vl["vision"], Workload(tiles=3, frames=4))[:3] == (7, 1034, 7 * 256)  # 32x32 patches + 10
    assert items_of(vl["vision"], Workload(frames=5, tubelets=True))[0] == 3                # ceil(5 / 2) tubelets
    clips, per_clip, tokens, _ = items_of(vl["audio"], Workload(audio_seconds=60, audio_clip_seconds=30))
    assert (clips, per_clip, tokens) == (2, 375, 750)                                      # 12.5 frames/s


@pytest.mark.parametrize("spec, workload, reason", [
    ("language=tp8,dp4@0-31", Workload(), "does not divide its 2 attention kv_heads"),
    ("language=dp1@0-0", Workload(), "memory: ranks 0-0 need"),
    ("language=tp2,dp4@0-7", Workload(global_batch=6), "not a multiple of the 4 sequences per microbatch"),
    ("language=cp4,dp8@0-31", Workload(seq_length=4100), "not divisible by 2*cp = 8"),
])
def test_infeasible_layouts_say_why(spec, workload, reason):
    p = predict(spec, describe_model("nemotron_3_nano_30b_a3b"), workload, cluster("h100"))
    assert not p.feasible and reason in p.reason


def test_encoder_dp_must_fan_into_the_llm():
    p = predict("vision=dp8@0-7;language=tp4,dp2@8-15", describe_model("nemotron_nano_12b_v2", "radio_vit_h"),
                Workload(tiles=4), cluster("h100"))
    assert not p.feasible and "cannot take an equal share of 2 samples" in p.reason


@pytest.mark.parametrize("spec,alive", [
    ("vision=tp2,dp8@0-15;language=tp2,dp8@0-15", "one"),      # all at pp 1: inside each microbatch
    ("vision=cp2,dp8@0-15;language=tp2,dp8@0-15", "one"),
    ("vision=tp4,dp4@0-15;language=tp2,pp2,dp4@0-15", "all"),  # LLM pp 2: three phases
    ("vision=pp2,dp8@0-15;language=pp2,dp8@0-15", "all"),
])
def test_colocated_encoder_activations_alive_follow_the_trainers_schedule(spec, alive):
    """hetero/plan/schedule_plan.py runs colocated encoders at pp 1 inside each microbatch (one microbatch of
    activations alive) and otherwise in three phases (every microbatch alive until phase 3)."""
    model, w = describe_model("nemotron_nano_12b_v2", "radio_vit_h"), Workload(seq_length=8192, global_batch=64, tiles=8)
    p = predict(spec, model, w, cluster("h100", 16), recompute=())
    assert p.placement == "colocated" and p.microbatches >= 8, p.reason
    assert p.in_flight["vision"] == (1 if alive == "one" else p.microbatches), p.in_flight


def test_layer_overhead_is_a_fixed_cost_per_layer_call_and_microbatch():
    """Constants.layer_overhead_s: every layer's forward (x1) and backward (x2) on every microbatch costs it, on
    the stage that holds the layer, whatever the layer's size (the tiny CPU models' steps are mostly this)."""
    import dataclasses

    model = describe_model("nemotron_h_bench_100m")
    layers = model["language"].layers
    w = Workload(seq_length=1024, global_batch=4)
    for spec, pp in (("language=dp1@0-0", 1), ("language=pp2@0-1", 2)):
        base = predict(spec, model, w, cluster("h100", pp), Constants(), recompute=())
        more = predict(spec, model, w, cluster("h100", pp), dataclasses.replace(Constants(), layer_overhead_s=1e-3),
                       recompute=())
        per_stage = layers / pp * 3 * 1e-3
        assert more.modules["language"].stages[0].compute - base.modules["language"].stages[0].compute == \
            pytest.approx(per_stage, rel=1e-9)
        assert more.step_s - base.step_s == pytest.approx((base.microbatches + pp - 1) * per_stage, rel=1e-6)


# ---- LLM context parallelism priced on the path the trainer takes (issue 32) ---------------------------------

def _llm_layout(tp, cp):
    from tessera.hetero.plan.layout import ModuleLayout

    return ModuleLayout(0, tp * cp - 1, tp=tp, cp=cp)


def test_cp_path_rule_is_the_kernel_choices():
    """The planner's path per layer kind is the one select_kernels builds, for every shipped LLM and many tp x cp."""
    from types import SimpleNamespace

    from tessera.hetero.parallel.kernel_choice import select_kernels
    from tessera.hetero.planner.cp_cost import kernel_paths

    class _G:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    checked = 0
    for name in configs.REGISTRY:
        lang = describe_llm(name)
        q, kv, heads, groups = lang.cp_heads
        heads_cfg = SimpleNamespace(num_attention_heads=q, num_query_groups=kv, mamba_num_heads=heads,
                                    mamba_num_groups=groups)
        for tp in (1, 2, 4, 8):
            for cp in (2, 3, 4, 8, 16):
                if any(n % tp for n in lang.tp_divides):
                    continue
                line = select_kernels(SimpleNamespace(tp=_G(tp), cp=_G(cp)), gpu=False, config=heads_cfg).line
                paths = kernel_paths(lang, _llm_layout(tp, cp))
                for kind in ("attention", "mamba"):
                    trainer = "head-parallel" if f"{kind}=head-parallel" in line else "zigzag"
                    assert f"{kind} {trainer}" in paths, (name, tp, cp, line, paths)
                checked += 1
    assert checked > 50


def test_head_parallel_cp_keeps_what_cp1_keeps_and_zigzag_costs_more():
    """12B at tp2: cp4 splits every head (head-parallel: activations per local token as at CP 1); 42 query heads
    (a made-up model) do not split over cp4, so its attention takes the zigzag path: gathered scores kept, torch
    attention priced slower, both visible in the step and the memory."""
    from dataclasses import replace

    from tessera.hetero.planner.cost import activation_bytes, module_cost
    from tessera.hetero.planner.cp_cost import kernel_paths

    lang = describe_llm("nemotron_nano_12b_v2")
    odd = replace(lang, cp_heads=(42, 2, *lang.cp_heads[2:]))
    assert kernel_paths(lang, _llm_layout(2, 4)) == "attention head-parallel, mamba head-parallel"
    assert kernel_paths(odd, _llm_layout(2, 4)).startswith(
        "attention zigzag (21 heads per TP rank do not divide by cp=4), mamba head-parallel")
    tokens, ctx = 4096.0, 16384.0
    assert activation_bytes(lang, _llm_layout(2, 4), tokens, ctx, False) == activation_bytes(
        lang, _llm_layout(2, 1), tokens, ctx, False)
    assert activation_bytes(odd, _llm_layout(2, 4), tokens, ctx, False)[0] > activation_bytes(
        lang, _llm_layout(2, 4), tokens, ctx, False)[0] + lang.cp_ctx * ctx * tokens / 2 * 0.99
    w, cl, k = Workload(seq_length=16384, global_batch=8), cluster("h100"), Constants()
    fast, slow = (module_cost(m, _llm_layout(2, 4), 1, w, cl, k, False, 1) for m in (lang, odd))
    assert 0 < fast.stages[0].cp < slow.stages[0].cp
    # the zigzag attention's extra time is at least its core FLOPs at the torch kernels' speed minus the fused
    core = 16384 * lang.attn_flops * 16384 / 8 * 3  # one sequence over tp2 x cp4, fwd+bwd
    extra = core * (1 / (cl.peak_tflops * 1e12 * k.eff_torch_attention) - 1 / (cl.peak_tflops * 1e12 * k.eff_llm))
    assert slow.stages[0].cp - fast.stages[0].cp > 0.9 * extra


def test_plan_table_names_the_llm_cp_path():
    from tessera.hetero.planner.search import format_table

    model = describe_model("nemotron_nano_12b_v2", "radio_vit_h")
    w = Workload(seq_length=16384, global_batch=64, tiles=24)
    pred = predict("vision=tp2,cp4@0-7;language=tp2,cp4@0-7", model, w, cluster("h100"))
    assert pred.feasible, pred.reason
    assert pred.kernels == "attention head-parallel, mamba head-parallel"
    assert " 1 LLM context parallelism: attention head-parallel, mamba head-parallel" in format_table([pred])


def test_plan_table_has_a_legend_and_says_its_last_column_is_a_layout():
    """Issue 62 item 7: bound, idle and mb were not explained, nor that a row trains with layout=."""
    from tessera.hetero.planner.search import format_table

    pred = predict("vision=tp2,cp4@0-7;language=tp2,cp4@0-7", describe_model("nemotron_nano_12b_v2", "radio_vit_h"),
                   Workload(seq_length=16384, global_batch=64, tiles=24), cluster("h100"))
    assert pred.feasible, pred.reason
    table = format_table([pred])
    row = table.splitlines()[2].split()
    step, parts = float(row[5]), sum(float(x) for x in row[6:10])  # step s = compute + comm + bubble + bound
    assert abs(step - parts) < 0.03, row  # each column rounded to 0.01 s
    for words in ("step s = compute + comm", "bound (the encoder-to-LLM boundary's sends)", "idle: the seconds",
                  "mb: sequences per LLM data-parallel replica per microbatch",
                  'Train a row with layout="<its layout column>"'):
        assert words in table, words


def test_an_encoder_is_priced_at_its_busiest_dp_rank():
    """Issue 35 item 4: an encoder's compute is the expected maximum over its DP ranks for the recipe's media mix
    (hetero/planner/straggler.py, itself checked against a simulation in tests/test_encoder_balance.py), with and
    without items dealt by cost; a mix without spread is priced at the mean, as before."""
    from dataclasses import replace

    from tessera.hetero.planner.straggler import busiest_rank_factor
    from tessera.recipes.full_size import RECIPES

    r = RECIPES["nemotron_omni_30b_a3b"]
    model, lay, cl = r.model(), "vision=dp32@0-31;audio=dp32@0-31;language=dp32,ep8@0-31", cluster("h100")
    even = predict(lay, model, replace(r.workload, vision_spread=(0.0, 0.0), audio_spread=(0.0, 0.0)), cl,
                   recompute=())
    per_dp = r.workload.global_batch // even.microbatches // 32
    steps = {}
    for balanced in (True, False):
        p = predict(lay, model, replace(r.workload, balance_encoders=balanced), cl, recompute=())
        steps[balanced] = p.step_s
        for key in ("vision", "audio"):
            items = items_of(model[key], r.workload)[0]
            want = busiest_rank_factor(32, per_dp, per_dp * items, r.workload.spread(key), balanced)
            got = p.modules[key].stages[0].compute / even.modules[key].stages[0].compute
            assert got == pytest.approx(want, rel=1e-9) and want > 1.0, (key, balanced, got, want)
        assert p.modules["language"] == even.modules["language"]
    assert even.step_s < steps[True] < steps[False], steps
