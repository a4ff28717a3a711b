"""The mixture-of-experts MLP of `hetero.tools.verify --llm moe`: its weights, its one-device reference, and
its parallel side, megatron-core's own MoELayer.

With `--llm moe` every LLM layer's MLP is Nemotron-H's MoE (megatron: moe_router_score_function="sigmoid",
top-k renormalised, aux-loss-free expert bias):

    scores = sigmoid(x @ router.weight.T)                       [tokens, E], no router bias
    chosen = top-k of (scores + router.expert_bias)             the fixed per-expert bias shifts the choice only
    probs  = scores[chosen] / sum(scores[chosen])               the chosen experts' weights (renormalised)
    out    = sum over chosen e of probs_e * fc2_e(relu(fc1_e(x))**2) + shared.fc2(relu(shared.fc1(x))**2)

with E routed experts and one shared expert, no biases (megatron's shared expert has none). The expert bias
is drawn with the weights and never trained here (megatron updates it from token counts between steps).

The parallel side is megatron's MoELayer from models.hybrid_llm.moe_spec with the routed experts the trainer
runs (hetero.parallel.kernel_choice.moe_experts_kernel: grouped GEMMs where torch has them), the
allgather token dispatcher, the module's process groups injected (ep, expt_tp = tp, tp_ep, expt_dp). Routed
expert j on EP rank r is global expert r * E/ep + j, its fc1 rows / fc2 columns sliced over expert-TP. With
TP > 1 the LLM runs sequence parallel (tessera.hetero.plan.layout.llm_sequence_parallel): see ParallelLanguage.

fp32 only: megatron's router takes the sigmoid in fp32 whatever the input dtype (megatron-core 0.16.1,
moe_utils.topk_routing_with_score_function: `torch.sigmoid(logits.float()).type_as(logits)`), so a float64 run
agrees with the float64 reference to ~1e-7, not to verify's float64 tolerance; verify refuses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from tessera.hetero.parallel.kernel_choice import moe_experts_kernel
from tessera.models.hybrid_llm import moe_spec

LLMS = ("dense", "moe")
EXPERT_BIAS_SCALE = 0.1  # large enough that the bias changes some tokens' choice (sigmoid scores lie in (0, 1))
EXPERT_OUT_SCALE = 0.1


def is_moe(w: dict, prefix: str) -> bool:
    """Whether the layer `prefix` of the full weights has an MoE MLP (else the dense fc1/fc2)."""
    return prefix + ".router.weight" in w


def moe_weights(w: dict, g: torch.Generator, prefix: str, dims, dtype) -> None:
    """Add layer `prefix`'s MoE weights to the full weights w, drawn from generator g (identical on every rank).
    The experts' fc2 are drawn small (EXPERT_OUT_SCALE): squared ReLU grows the residual stream of this norm-free
    chain quadratically per layer, and an fp32 comparison against fp64 needs moderate activations. The expert
    bias is kept fp32 (megatron keeps it fp32)."""
    hidden = dims.llm_hidden

    def lin(name, out_f, in_f, scale=1.0):
        w[name + ".weight"] = (torch.randn(out_f, in_f, generator=g) * scale * in_f ** -0.5).to(dtype)

    lin(prefix + ".router", dims.moe_experts, hidden)
    w[prefix + ".router.expert_bias"] = torch.randn(dims.moe_experts, generator=g) * EXPERT_BIAS_SCALE
    for e in range(dims.moe_experts):
        lin(f"{prefix}.experts.{e}.fc1", dims.moe_ffn, hidden)
        lin(f"{prefix}.experts.{e}.fc2", hidden, dims.moe_ffn, EXPERT_OUT_SCALE)
    lin(prefix + ".shared.fc1", dims.moe_shared_ffn, hidden)
    lin(prefix + ".shared.fc2", hidden, dims.moe_shared_ffn, EXPERT_OUT_SCALE)


# ---------------------------------------------------------------------------------------- reference
def reference_moe(w: dict, prefix: str, x: torch.Tensor, topk: int) -> torch.Tensor:
    """The MoE MLP on flat tokens x [T, H], plain tensors, the routing computed here."""
    scores = torch.sigmoid(F.linear(x, w[prefix + ".router.weight"]))
    chosen = torch.topk(scores + w[prefix + ".router.expert_bias"].to(scores.dtype), topk, dim=1).indices
    top = scores.gather(1, chosen)
    probs = top / (top.sum(-1, keepdim=True) + 1e-20)
    out = torch.zeros_like(x)
    for e in range(w[prefix + ".router.weight"].shape[0]):
        tok, slot = (chosen == e).nonzero(as_tuple=True)
        h = squared_relu(F.linear(x[tok], w[f"{prefix}.experts.{e}.fc1.weight"]))
        out = out.index_add(0, tok, F.linear(h, w[f"{prefix}.experts.{e}.fc2.weight"]) * probs[tok, slot, None])
    shared = F.linear(squared_relu(F.linear(x, w[prefix + ".shared.fc1.weight"])), w[prefix + ".shared.fc2.weight"])
    return out + shared


# ----------------------------------------------------------------------------------------- parallel
def moe_config(dims, module_layout, dtype, sequence_parallel: bool) -> TransformerConfig:
    """megatron config of the MoE layers: the fields models/hybrid_llm.hybrid_config sets for Nemotron-H's MoE
    (sigmoid router with expert bias, fp32 router, no aux loss, allgather dispatcher, no grouped gemm), the
    module's TP/EP sizes (megatron tags expert parameters allreduce=False from expert_model_parallel_size)."""
    return TransformerConfig(
        num_layers=1, hidden_size=dims.llm_hidden, num_attention_heads=dims.llm_heads, ffn_hidden_size=dims.moe_ffn,
        tensor_model_parallel_size=module_layout.tp, expert_model_parallel_size=module_layout.ep,
        expert_tensor_parallel_size=module_layout.tp, sequence_parallel=sequence_parallel, params_dtype=dtype,
        use_cpu_initialization=True, perform_initialization=False, add_bias_linear=False, gated_linear_unit=False,
        activation_func=squared_relu, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=dims.moe_experts, moe_router_topk=dims.moe_topk, moe_ffn_hidden_size=dims.moe_ffn,
        moe_shared_expert_intermediate_size=dims.moe_shared_ffn, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, moe_shared_expert_overlap=False,
    )


def _load(module, w, name: str, rank: int, size: int, dim: int) -> None:
    """Copy shard `rank` of `size` (along `dim`) of the full bias-free weight `name` into a megatron linear,
    and record where it came from (verify compares its gradient with hetero.tools.verify_chain_model's
    sharded_reference_grad)."""
    with torch.no_grad():
        module.weight.copy_(w[name + ".weight"].chunk(size, dim=dim)[rank])
    module.full_names = (name + ".weight", name + ".bias")
    module.shard = (rank, size, dim)


class ParallelMoE(torch.nn.Module):
    """One rank's part of layer `prefix`'s MoE: megatron's MoELayer on flat tokens [T(/tp under SP), H]."""

    def __init__(self, w, prefix: str, config: TransformerConfig, pgs, layer_number: int = 1):
        super().__init__()
        spec = moe_spec(config.num_moe_experts, moe_experts_kernel()[0])  # the experts the trainer runs
        self.layer = build_module(spec, config=config, layer_number=layer_number, pg_collection=pgs)
        router = self.layer.router
        _load(router, w, prefix + ".router", 0, 1, 0)
        with torch.no_grad():
            router.expert_bias.copy_(w[prefix + ".router.expert_bias"])
        local = config.num_moe_experts // pgs.ep.size()
        etp, etp_rank = pgs.expt_tp.size(), pgs.expt_tp.rank()
        for j, expert in enumerate(self.layer.experts.local_experts):
            name = f"{prefix}.experts.{pgs.ep.rank() * local + j}"  # the global expert id
            _load(expert.linear_fc1, w, name + ".fc1", etp_rank, etp, 0)
            _load(expert.linear_fc2, w, name + ".fc2", etp_rank, etp, 1)
        tp, tp_rank = pgs.tp.size(), pgs.tp.rank()
        _load(self.layer.shared_experts.linear_fc1, w, prefix + ".shared.fc1", tp_rank, tp, 0)
        _load(self.layer.shared_experts.linear_fc2, w, prefix + ".shared.fc2", tp_rank, tp, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, bias = self.layer(x.unsqueeze(1))  # megatron's [s, b, h]
        assert bias is None
        return y.squeeze(1)
