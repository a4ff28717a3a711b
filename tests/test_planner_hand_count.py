"""The cost model's MoE x CP x EP memory and time against a count by hand, and the one optimizer-bytes formula.

Every expected number below is written out from hetero/planner/model.py's docstring formulas for the tiny MoE
LLM (models/configs.py TINY_MOE, pattern M*ME), not computed by the planner's code: a change of any rule
(expert data parallelism = cp * dp / ep, sequence parallel splits, 4 all-to-alls per MoE layer) shows up as
a wrong byte or second count here, in milliseconds.
"""

import pytest

from tessera.hetero.plan.layout import HeteroLayout
from tessera.hetero.planner import Constants, Workload, cluster, describe_model, predict
from tessera.hetero.planner.memory_report import optimizer_bytes, shard_memory
from tessera.hetero.planner.meta_memory import Shard

# TINY_MOE: h 64, vocab 128, 4 query / 2 KV heads of 16, Mamba 8 heads x 16 (d_inner 128), 2 groups, state 16,
# conv 4; 4 routed experts of 32 (top 2), one shared expert of 48
H, V, TOPK = 64, 128, 2
MAMBA = 64 * (2 * 128 + 2 * 2 * 16 + 8) + 192 * 4 + 192 + 3 * 8 + 128 + 128 * 64 + 64  # in_proj conv A D dt norm out
ATTENTION = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 64                                    # qkv, o, norm
MOE_DENSE = 64 * 4 + 2 * 64 * 48 + 64                                                   # router, shared expert, norm
EXPERTS = 4 * 2 * 64 * 32                                                               # up + down of each
EDGE = 2 * V * H                                                                        # embedding + lm_head
PARAMS = 2 * MAMBA + ATTENTION + MOE_DENSE + EXPERTS + EDGE + H                         # + final norm
REPLICATED = 5 * H + 64 * 4                                                             # 5 norms + router
# activation bytes per token (model.py): replicated | TP-sharded | unsplit, summed over M * M E
ACT_REP = 3 * 4 * H + (4 * H + 4 * 4 + 12 * TOPK)
ACT_SHARDED = 2 * (6 * 192 + 30 * 128 + 12 * 8) + (2 * (4 + 2 * 2) * 16 + 4 * 4 * 16) + (4 * 48 + 6 * TOPK * 32)
ACT_UNSPLIT = 2 * H * TOPK + 12 * TOPK
HEAD = 2 * 2 * H + 4 * V                                                                # last stage: 4h | fp32 logits
SEQ = 64
BW, NVLINK, IB = 0.8, 450e9, 50e9        # Constants.bw_eff, H100 preset links (bytes/s each way)
NVLINK_LAT, IB_LAT, MSG = 3e-6, 8e-6, 10e-6


def test_the_tiny_moe_described_as_counted_by_hand():
    llm = describe_model("nemotron_h_tiny_moe")["language"]
    assert (MAMBA, ATTENTION, PARAMS) == (30360, 12352, 112368)  # the hand count itself, added up once
    assert (llm.params, llm.replicated_params, llm.expert_params, llm.edge_params) == (PARAMS, REPLICATED,
                                                                                        EXPERTS, EDGE)
    assert (llm.act_replicated, llm.act_bytes, llm.act_unsplit) == (ACT_REP, ACT_SHARDED, ACT_UNSPLIT)


# per rank: dense = non-expert, non-edge parameters (TP-split but for the replicated ones); edge / tp on the one
# stage; experts / (tp * ep); Adam's 12 B over dp*cp ranks (dense) and cp*dp/ep ranks (experts); activations of
# S/cp tokens per sequence, the replicated part split by tp under sequence parallelism (MoE at tp > 1)
CASES = {
    # tp1: expert DP = cp*dp/ep = 2*6/4 = 3, neither dp (6) nor cp (2) nor dp*cp (12)
    "language=cp2,dp6,ep4@0-11": dict(
        dense=PARAMS - EDGE - EXPERTS, edge=EDGE, experts=EXPERTS // 4, dp_cp=12, expert_dp=3,
        act=SEQ // 2 * (ACT_REP + ACT_SHARDED + ACT_UNSPLIT + HEAD)),
    # tp2 (sequence parallel): expert DP = 2*2/2 = 2
    "language=tp2,cp2,dp2,ep2@0-7": dict(
        dense=(PARAMS - EDGE - EXPERTS - REPLICATED) // 2 + REPLICATED, edge=EDGE // 2, experts=EXPERTS // 4,
        dp_cp=4, expert_dp=2, act=SEQ // 2 * ((ACT_REP + ACT_SHARDED + HEAD) // 2 + ACT_UNSPLIT)),
}


def _predict(spec):
    lay = HeteroLayout.parse(spec)
    gpus = lay.world_size
    samples = lay["language"].dp_size  # micro_batch 1: one sequence per DP replica and microbatch
    w = Workload(seq_length=SEQ, global_batch=2 * samples)
    return predict(lay, describe_model("nemotron_h_tiny_moe"), w, cluster("h100", gpus), Constants(), recompute=())


@pytest.mark.parametrize("spec", sorted(CASES))
def test_moe_memory_with_cp_and_ep_by_hand(spec):
    c = CASES[spec]
    p = _predict(spec)
    assert p.feasible and p.microbatches == 2, p.reason
    mem = p.modules["language"].mem_first
    local = c["dense"] + c["edge"] + c["experts"]
    assert mem.weights == 2 * local and mem.grads == 4 * local
    assert mem.optim == pytest.approx(12 * ((c["dense"] + c["edge"]) / c["dp_cp"] + c["experts"] / c["expert_dp"]),
                                      rel=1e-12)
    assert mem.act == pytest.approx(c["act"], rel=1e-12)
    assert p.memory_gib[spec.split("@")[1]] * 2 ** 30 == pytest.approx(mem.total, rel=1e-12)


def _wire(nbytes, hops, gbps, lat):
    """One collective's seconds: bytes on the wire at the achieved bandwidth plus a latency per hop."""
    return nbytes / (gbps * BW) + hops * (lat + MSG)


def test_moe_time_with_cp_and_ep_by_hand():
    """tp1, cp2, dp6, ep4 on one and a half H100 nodes: per microbatch each rank holds 32 tokens (64 / cp)."""
    spec = "language=cp2,dp6,ep4@0-11"
    p = _predict(spec)
    cost = p.modules["language"]
    stage = cost.stages[0]
    tokens = SEQ // 2
    # EP: 4 all-to-alls (dispatch + combine, forward + backward) per MoE layer of every routed row (top 2,
    # h wide, bf16) over the 4 EP ranks (NVLink: 4 ranks 1 apart): (p-1)/p of the bytes, p-1 hops
    ep = 1 * 4 * _wire(tokens * TOPK * H * 2 * 3 / 4, 3, NVLINK, NVLINK_LAT)
    assert stage.ep == pytest.approx(ep, rel=1e-12)
    assert p.breakdown["ep"] == pytest.approx(2 * ep, rel=1e-12)  # two microbatches
    # CP head-parallel (4 heads / 2 KV heads, 8 Mamba heads / 2 groups split over cp2): forward + backward
    # all-to-alls of q, k, v, out (widths 64, 32, 32, 64) per attention layer and z, x, B, C, dt, y
    # (128, 128, 32, 32, 8, 128) per Mamba layer, half of each on the wire, one hop
    attention = 2 * sum(_wire(tokens * w * 2 / 2, 1, NVLINK, NVLINK_LAT) for w in (64, 32, 32, 64))
    mamba = 2 * 2 * sum(_wire(tokens * w * 2 / 2, 1, NVLINK, NVLINK_LAT) for w in (128, 128, 32, 32, 8, 128))
    assert stage.cp == pytest.approx(attention + mamba, rel=1e-12)
    assert stage.tp == 0 and stage.pp == 0
    # DP: reduce-scatter + all-gather of the dense + edge bf16 weights over the 12 dp*cp ranks (InfiniBand:
    # 12 ranks span two nodes, 2*ceil(log2 12) / 2 = 4 hops) and of the experts over their 3 expert-DP ranks
    dense = PARAMS - EXPERTS
    dp = 2 * _wire(dense * 2 * 11 / 12, 4, IB, IB_LAT) + 2 * _wire(EXPERTS // 4 * 2 * 2 / 3, 2, IB, IB_LAT)
    assert cost.dp_s == pytest.approx(dp, rel=1e-12)
    # Adam reads and writes 30 B per local parameter at 3.35 TB/s
    assert cost.optim_s == pytest.approx(30 * (dense / 12 + EXPERTS // 4 / 3) / 3.35e12, rel=1e-12)


@pytest.mark.parametrize("spec", ["language=cp2,dp6,ep4@0-11", "language=tp2,cp2,dp2,ep2@0-7",
                                  "language=tp2,pp2,dp2,ep2@0-7", "language=tp2,dp2@0-3"])
def test_memory_report_and_cost_model_share_one_optimizer_formula(spec):
    """The dry run's report (from a shard's trainable counts) and the cost model (from the model description)
    give the same Adam bytes for the same parameters, at ZeRO-1, replicated and fp32."""
    p = _predict(spec)
    lay = HeteroLayout.parse(spec)["language"]
    llm = describe_model("nemotron_h_tiny_moe")["language"]
    experts = llm.expert_params // (lay.tp * lay.ep * lay.pp)
    for stage, mem in ((0, p.modules["language"].mem_first), (lay.pp - 1, p.modules["language"].mem_last)):
        local = int(mem.weights) // 2
        s = Shard("language", stage, 0, params=local, param_bytes=2 * local, experts=experts, trainable=local,
                  trainable_experts=experts, act=mem.act)
        assert shard_memory(s, lay, p, zero1=True)[0].optim == pytest.approx(mem.optim, rel=1e-12), stage
        assert optimizer_bytes(s, lay, zero1=False) == 12 * local
        assert optimizer_bytes(s, lay, zero1=True, mixed=False) == pytest.approx(mem.optim * 8 / 12, rel=1e-12)
