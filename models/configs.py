"""Nemotron-H LLM sizes as plain data, in Hugging Face NemotronH config.json field names.

Each entry is exactly what a released checkpoint's config.json says (the fields that change the
architecture), so the same dict builds our HybridLM (models.nemotron_h_hf.hybrid_config_from_hf) and a
transformers NemotronHForCausalLM (tests build tiny random checkpoints from TINY_*). `published_params`
is the size the model card / tech report gives; tests build each model on the meta device and check it.
Layer patterns: M = Mamba-2, * = attention, - = MLP, E = MoE.
"""

from __future__ import annotations

_NEMOTRON_H = dict(  # shared by every released Nemotron-H LLM below
    vocab_size=131072, head_dim=128, mamba_num_heads=128, mamba_head_dim=80, n_groups=8,
    ssm_state_size=128, conv_kernel=4, chunk_size=128, layer_norm_epsilon=1e-5, num_key_value_heads=8,
    mlp_hidden_act="relu2", use_bias=False, mlp_bias=False, attention_bias=False,
    tie_word_embeddings=False, time_step_min=0.001,
)

NEMOTRON_NANO_12B_V2 = dict(  # LLM of Nemotron Nano V2 VL 12B: 28 Mamba-2 + 28 MLP + 6 attention
    _NEMOTRON_H,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-",
    hidden_size=5120, intermediate_size=20480, num_attention_heads=40,
    published_params=12.31e9,
)

NEMOTRON_NANO_9B_V2 = dict(  # Minitron-pruned 12B: 27 Mamba-2 + 25 MLP + 4 attention
    _NEMOTRON_H,
    hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    hidden_size=4480, intermediate_size=15680, num_attention_heads=40,
    published_params=8.89e9,
)

NEMOTRON_3_NANO_30B_A3B = dict(  # LLM of Nemotron 3 Nano Omni: 23 Mamba-2 + 23 MoE + 6 attention
    _NEMOTRON_H,
    hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    hidden_size=2688, intermediate_size=1856, num_attention_heads=32, num_key_value_heads=2,
    mamba_num_heads=64, mamba_head_dim=64,
    n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712, n_shared_experts=1, routed_scaling_factor=2.5,
    n_group=1, topk_group=1, norm_topk_prob=True,
    published_params=31.6e9,
)

_TINY = dict(  # small enough for 2-rank CPU tests in seconds; every dim divides by TP=2
    vocab_size=128, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
    conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5, mlp_hidden_act="relu2", time_step_min=0.001,
)

TINY_DENSE = dict(_TINY, hybrid_override_pattern="M-M*-M-")

TINY_MOE = dict(
    _TINY, hybrid_override_pattern="M*ME",
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48, n_shared_experts=1, routed_scaling_factor=2.5,
)

BENCH_100M = dict(  # ~100M-parameter Nemotron-H shape for CPU throughput runs (scripts/bench_llm.py)
    vocab_size=16384, hidden_size=768, head_dim=64, num_attention_heads=12, num_key_value_heads=4,
    intermediate_size=3072, mamba_num_heads=24, mamba_head_dim=64, n_groups=2, ssm_state_size=64,
    conv_kernel=4, chunk_size=128, layer_norm_epsilon=1e-5, mlp_hidden_act="relu2", time_step_min=0.001,
    hybrid_override_pattern="M-M-M-M*-M-M-M*-M-",
)

def _slice(release: dict, pattern: str) -> dict:
    """A real-width slice of a released LLM: its widths, heads, experts and vocabulary, only `pattern`'s layers (one
    GPU trains it with the release's encoders: scripts/gpu_step.py measures TFLOPS/GPU and MFU on it)."""
    return {k: v for k, v in release.items() if k != "published_params"} | {"hybrid_override_pattern": pattern}


# ~2.5B parameters (1.34B of them embedding and output layer): 3 Mamba-2 + 3 MLP + 1 attention, the 12B's mix
NEMOTRON_NANO_12B_V2_SLICE = _slice(NEMOTRON_NANO_12B_V2, "M-M*-M-")
# ~2.1B parameters: 2 Mamba-2, 1 attention, 1 MoE layer of all 128 experts (1.3B); with ViT-H, Parakeet and
# mixed-precision Adam ~60 GB before activations, so one 80 GB GPU holds it
NEMOTRON_3_NANO_30B_A3B_SLICE = _slice(NEMOTRON_3_NANO_30B_A3B, "M*EM")

REGISTRY = {
    "nemotron_h_tiny_dense": TINY_DENSE,
    "nemotron_h_tiny_moe": TINY_MOE,
    "nemotron_h_bench_100m": BENCH_100M,
    "nemotron_nano_12b_v2": NEMOTRON_NANO_12B_V2,
    "nemotron_nano_9b_v2": NEMOTRON_NANO_9B_V2,
    "nemotron_3_nano_30b_a3b": NEMOTRON_3_NANO_30B_A3B,
    "nemotron_nano_12b_v2_slice": NEMOTRON_NANO_12B_V2_SLICE,
    "nemotron_3_nano_30b_a3b_slice": NEMOTRON_3_NANO_30B_A3B_SLICE,
}


def hf_fields(name: str) -> dict:
    """The config.json fields of a registered size (without our bookkeeping keys)."""
    return {k: v for k, v in REGISTRY[name].items() if k != "published_params"}
