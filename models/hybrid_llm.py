"""Nemotron-H style hybrid decoder (Mamba-2 / attention / MLP / MoE) built from megatron-core pieces.

The layer pattern is a string, one symbol per layer, as Nemotron-H's `hybrid_override_pattern`:
    M = Mamba-2 mixer   * = GQA self-attention   - = squared-ReLU MLP   E = MoE (sigmoid top-k)
Every layer is pre-norm + mixer + residual. Attention, MLP and MoE layers are megatron TransformerLayers
with the local (non-Transformer-Engine) spec and only one half filled in (the other half IdentityOp),
as megatron's own hybrid stack does; the Mamba-2 layer wraps models/mamba2.py. No positional
embedding anywhere (Nemotron-H attention has no RoPE; the Mamba layers carry position).

Parallelism: process groups come in through a megatron ProcessGroupCollection (tp, pp, ep, expt_tp,
tp_ep, ...). TP shards attention heads, MLP/expert FFNs, Mamba heads/groups and the vocabulary. PP
builds only this stage's layers, split the way megatron splits any decoder (get_num_layers_to_build /
get_transformer_layer_offset: even split, or num_layers_in_first/last_pipeline_stage). Non-first stages
take their input through set_input_tensor(), as megatron's pipeline schedules expect.
Context parallelism (CP): every CP rank holds its zigzag slice of the sequence (input ids and labels
sharded by the caller); only the sequence-mixing kernels see other ranks' tokens, so CP is entirely in
the injected `core_attention` / `mamba_mixer` classes (hetero/parallel/cp_attention_module.py, hetero/parallel/cp_mamba.py,
picked by hetero/parallel/kernel_choice.py). Everything else here is per token and CP-unaware.

Usage (groups injected; one rank: hetero.build.model_build.single_rank_pgs()):
    cfg = models.configs.tiny_hybrid()
    model = HybridLM(cfg, pgs, cross_entropy=vocab_parallel_cross_entropy_for(pgs.tp))  # the default at TP=1
    logits = model(input_ids)            # [b, s, padded_vocab / tp] (vocab-parallel)
    full = model.full_vocab_logits(logits)  # [b, s, vocab]: gathered over TP, padding stripped
    loss = model(input_ids, labels)      # [b, s] per-token loss

Vocabulary padding: the embedding and output layer have config.padded_vocab_size rows (Megatron's rule, see
vocab_size_with_padding()), so any vocabulary runs at any TP. Rows >= config.vocab_size are padding: zero on
import, stripped on export (models/nemotron_h_hf.py), their logits -inf before anything sees them (so the
softmax gives them probability 0, the loss ignores them and their output rows get zero gradient), and a
label pointing into them raises (inputs are the same token ids, so their embedding rows stay unused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.activations import squared_relu
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from tessera.hetero.plan.resolved_run import IGNORE
from tessera.models.sdpa_attention import DocumentSeqParams, SDPACoreAttention
from tessera.models.mamba2 import Mamba2Mixer, Mamba2Submodules
from tessera.models.vocab_ce import vocab_cross_entropy
from tessera.models.recompute import run_layers, with_recompute

MAMBA, ATTENTION, MLP_SYMBOL, MOE = "M", "*", "-", "E"
SYMBOLS = (MAMBA, ATTENTION, MLP_SYMBOL, MOE)


def vocab_size_with_padding(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """`vocab_size` rounded up to a multiple of divisible_by * tp: Megatron's rule (megatron.training's
    _vocab_size_with_padding, --make-vocab-size-divisible-by 128). It lives here because megatron-core 0.16.1
    has no copy of it (megatron.training is not part of the package). Every TP shard then holds a multiple
    of `divisible_by` rows, the GEMM-friendly size, and every vocabulary divides by TP."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass
class HybridConfig(TransformerConfig):
    """megatron's TransformerConfig plus what a hybrid Nemotron-H model needs beyond it.

    megatron already has mamba_num_heads / mamba_head_dim / mamba_num_groups / mamba_state_dim.
    num_layers is derived from the pattern.
    """

    hybrid_pattern: str = ""
    """One symbol per layer: M (Mamba-2), * (attention), - (MLP), E (MoE)."""
    vocab_size: int = 0
    """The true vocabulary (tokenizer / checkpoint); the layers hold padded_vocab_size rows."""
    make_vocab_size_divisible_by: int = 128
    mamba_conv_kernel: int = 4
    mamba_chunk_size: int = 128
    mamba_dt_min_clamp: float = 0.0
    """Lower clamp of softplus(dt); Nemotron-H clamps at time_step_min (transformers does the same)."""
    untie_embeddings_and_output_weights: bool = True

    def __post_init__(self):
        bad = sorted(set(self.hybrid_pattern) - set(SYMBOLS))
        if not self.hybrid_pattern or bad:
            raise ValueError(f"hybrid_pattern {self.hybrid_pattern!r}: use only {SYMBOLS}, got {bad}")
        self.num_layers = len(self.hybrid_pattern)
        super().__post_init__()

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and output layer (a property: always consistent with vocab_size and TP)."""
        return vocab_size_with_padding(self.vocab_size, self.tensor_model_parallel_size,
                                       self.make_vocab_size_divisible_by)


def hybrid_config(**fields) -> HybridConfig:
    """A HybridConfig with the settings every Nemotron-H model shares (no biases, RMSNorm,
    squared-ReLU, sigmoid router with expert bias, no dropout, CPU-friendly fusions off)."""
    base = dict(
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=False,
        activation_func=squared_relu, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_dtype="fp32", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_shared_expert_overlap=False,
    )
    base.update(fields)
    if not base.get("num_moe_experts"):
        for key in [k for k in base if k.startswith("moe_")]:
            base.pop(key)
    return HybridConfig(**base)


def stage_layers(config: HybridConfig, pp_rank: int) -> tuple[int, str]:
    """(offset, symbols) of the layers pipeline stage `pp_rank` builds, by megatron's split rule."""
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    return offset, config.hybrid_pattern[offset : offset + count]


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, built as megatron's WrappedTorchNorm builds it (same parameter, same math), but also
    under sequence parallelism, which WrappedTorchNorm refuses (torch_norm.py asserts it off; TENorm is
    GPU-only): each TP rank normalises its own sequence slice, so the weight's gradient is partial per rank
    and is tagged `sequence_parallel` for the trainer to sum over TP (megatron's finalize_model_grads rule)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        if config.normalization != "RMSNorm":
            raise ValueError(f"HybridLM uses RMSNorm, config.normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


class MambaLayer(MegatronModule):
    """Pre-norm + Mamba-2 mixer + residual; call signature and (output, context) like TransformerLayer."""

    def __init__(self, config, submodules: Mamba2Submodules, layer_number=1, pg_collection=None,
                 mixer=Mamba2Mixer):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.norm = RMSNorm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.mixer = mixer(config, submodules, layer_number, pg_collection=pg_collection)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **_):
        doc_ids = getattr(packed_seq_params, "doc_ids", None)
        kwargs = {"doc_ids": doc_ids} if doc_ids is not None else {}
        out, _ = self.mixer(self.norm(hidden_states), **kwargs)
        return hidden_states + out, None


def build_hybrid_layer_specs(config: HybridConfig, core_attention=SDPACoreAttention,
                             mamba_mixer=Mamba2Mixer, moe_experts=SequentialMLP) -> dict[str, ModuleSpec]:
    """One layer spec per pattern symbol, all from megatron's local backend. `core_attention` and
    `mamba_mixer` are the pluggable sequence kernels (context-parallel or GPU ones come from hetero/);
    a mixer class takes (config, submodules, layer_number, pg_collection=...) like Mamba2Mixer.
    `moe_experts` computes the routed experts: megatron's SequentialMLP or a subclass with its parameters
    (models/moe_experts.GroupedGemmExperts)."""
    backend = LocalSpecProvider()
    norm = RMSNorm
    column, row = backend.column_parallel_linear(), backend.row_parallel_linear()
    specs = {
        MAMBA: ModuleSpec(module=MambaLayer, params={"mixer": mamba_mixer},
                          submodules=Mamba2Submodules(in_proj=column, out_proj=row)),
        ATTENTION: ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=norm,
                self_attention=ModuleSpec(
                    module=SelfAttention,
                    params={"attn_mask_type": AttnMaskType.causal},
                    submodules=SelfAttentionSubmodules(
                        linear_qkv=column, core_attention=core_attention, linear_proj=row
                    ),
                ),
                self_attn_bda=get_bias_dropout_add,
            ),
        ),
        MLP_SYMBOL: ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=norm,
                mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
                mlp_bda=get_bias_dropout_add,
            ),
        ),
    }
    if config.num_moe_experts:
        moe = moe_spec(config.num_moe_experts, moe_experts)
        specs[MOE] = ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(pre_mlp_layernorm=norm, mlp=moe, mlp_bda=get_bias_dropout_add),
        )
    return specs


def moe_spec(num_experts: int, experts=SequentialMLP) -> ModuleSpec:
    """megatron's local MoELayer spec (router, token dispatcher, shared expert) with `experts` computing the
    routed experts: SequentialMLP (megatron's loop) or a subclass taking the same submodules and parameters."""
    if not issubclass(experts, SequentialMLP):
        raise TypeError(f"moe_experts={experts.__name__}: use megatron's SequentialMLP or a subclass of it "
                        "(its parameter names are what the HF import, checkpoints and LoRA read)")
    spec = get_moe_module_spec_for_backend(backend=LocalSpecProvider(), num_experts=num_experts)
    spec.submodules.experts.module = experts
    return spec


def vocab_embedding(config: HybridConfig, tp_group) -> tensor_parallel.VocabParallelEmbedding:
    """The first stage's vocab-parallel embedding (also built alone by the seeded initialisation)."""
    return tensor_parallel.VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size,
                                                  init_method=config.init_method, config=config, tp_group=tp_group)


def final_norm_and_output_layer(config: HybridConfig, tp_group):
    """The last stage's final RMSNorm and vocab-parallel output layer (also built alone by the seeded init)."""
    norm = RMSNorm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
    output = tensor_parallel.ColumnParallelLinear(
        config.hidden_size, config.padded_vocab_size, config=config, init_method=config.init_method,
        bias=False, gather_output=False, skip_bias_add=False, tp_group=tp_group,
    )
    return norm, output


class HybridLM(MegatronModule):
    """Embedding -> this stage's hybrid layers -> final RMSNorm -> vocab-parallel output layer.

    recompute: "none" | "selective" | "full" activation recompute (models/recompute.py), set as megatron's
    TransformerConfig fields on a copy of `config`; "none" keeps the config's own recompute fields."""

    def __init__(self, config: HybridConfig, pg_collection, core_attention=SDPACoreAttention,
                 mamba_mixer=Mamba2Mixer, cross_entropy=None, recompute: str = "none", moe_experts=SequentialMLP):
        config = with_recompute(config, recompute)
        super().__init__(config=config)
        # (logits [.., V/tp], target) -> per-token loss. It must reduce over *this* module's TP group
        # (hetero/parallel/vocab_parallel_ce.py); with the whole vocabulary on one rank nothing is reduced
        if cross_entropy is None and pg_collection.tp.size() > 1:
            raise ValueError(f"HybridLM at TP={pg_collection.tp.size()} needs cross_entropy= bound to its TP group: "
                             "pass hetero.parallel.vocab_parallel_ce.vocab_parallel_cross_entropy_for(pgs.tp)")
        self.cross_entropy = cross_entropy or vocab_cross_entropy
        self.pg_collection = pg_collection
        pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
        if pp_size != config.pipeline_model_parallel_size:
            raise ValueError(f"config.pipeline_model_parallel_size={config.pipeline_model_parallel_size} "
                             f"but the pp group has {pp_size} ranks")
        self.pre_process, self.post_process = pp_rank == 0, pp_rank == pp_size - 1
        self.layer_offset, self.layer_symbols = stage_layers(config, pp_rank)
        tp_group = pg_collection.tp
        if tp_group.size() != config.tensor_model_parallel_size:  # the padding (and shard sizes) assume it
            raise ValueError(f"config.tensor_model_parallel_size={config.tensor_model_parallel_size} "
                             f"but the tp group has {tp_group.size()} ranks")
        # rows of this rank's vocab shard that are real tokens; the rest (if any) is padding
        shard = config.padded_vocab_size // tp_group.size()
        self.real_vocab_rows = min(max(config.vocab_size - tp_group.rank() * shard, 0), shard)

        if self.pre_process:
            self.embedding = vocab_embedding(config, tp_group)
        specs = build_hybrid_layer_specs(config, core_attention, mamba_mixer, moe_experts)
        # layer_number is 1-based and stage-local, as megatron's TransformerBlock passes it
        # (TransformerLayer adds the stage offset itself).
        self.layers = torch.nn.ModuleList(
            build_module(specs[symbol], config=config, layer_number=i + 1, pg_collection=pg_collection)
            for i, symbol in enumerate(self.layer_symbols)
        )
        if self.post_process:
            self.final_norm, self.output_layer = final_norm_and_output_layer(config, tp_group)
        with torch.no_grad():  # padding rows start (and, with zero gradient, stay) zero, as after an HF import
            for layer in (getattr(self, "embedding", None), getattr(self, "output_layer", None)):
                if layer is not None:
                    layer.weight[self.real_vocab_rows:].zero_()
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        """Pipeline schedules hand the previous stage's activations in here (a list of one tensor)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                decoder_input: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None):
        """First stage: input_ids [b, s], or decoder_input [s, b, h] (embeddings already mixed with media by
        the multimodal model). Other stages: activations from set_input_tensor.
        Last stage returns vocab-parallel logits [b, s, padded_vocab/tp], padding columns -inf (full_vocab_logits
        gathers and strips them), or per-token loss [b, s] with labels (0 where the label is -100; a label
        outside [0, vocab_size) raises); other stages return activations [s, b, h] for the next stage.
        doc_ids: [b, s] packed-document id of every token (this rank's zigzag slice under CP; every stage
        gets it), e.g. models.sdpa_attention.document_ids(cu_seqlens); attention and Mamba then never mix
        documents. None: one sequence per row (bit-identical to passing a single document)."""
        if labels is not None:
            self._check_labels(labels)
        if not self.pre_process:
            hidden = self.input_tensor
        elif decoder_input is not None:
            hidden = decoder_input
        else:
            hidden = self.embedding(input_ids).transpose(0, 1).contiguous()  # [s, b, h]
        if self.pre_process and self.config.sequence_parallel:
            # each TP rank carries its 1/tp of the sequence between layers (layers gather it where they need
            # the whole: linear_qkv/fc1/in_proj, the MoE dispatcher, the output layer); backward gathers
            hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden, group=self.pg_collection.tp)
        packed = DocumentSeqParams(doc_ids=doc_ids.to(hidden.device)) if doc_ids is not None else None
        hidden = run_layers(self.layers, hidden, self.config, self.training, attention_mask=None,
                            packed_seq_params=packed)
        if not self.post_process:
            return hidden
        logits, _ = self.output_layer(self.final_norm(hidden))
        logits = self._mask_vocab_padding(logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        labels = labels.transpose(0, 1)
        valid = labels != IGNORE
        loss = self.cross_entropy(logits.float(), labels.clamp(min=0).contiguous())
        return (loss * valid).transpose(0, 1).contiguous()

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf on this rank's padding columns. Out of place: megatron's cross entropy subtracts the max in
        place, and masked_fill's backward gives the masked columns (so the padding rows of the output layer)
        exactly zero gradient. -inf is safe there: the max over the TP group is a real logit, exp(-inf) = 0,
        and a target never lies in the padding (_check_labels). Ranks without padding pay nothing."""
        if self.real_vocab_rows == logits.shape[-1]:
            return logits
        padding = torch.arange(logits.shape[-1], device=logits.device) >= self.real_vocab_rows
        return logits.masked_fill(padding, float("-inf"))

    def _check_labels(self, labels: torch.Tensor) -> None:
        """A label in the padding would be scored against a masked logit (an infinite loss) and one past the
        padding silently as 0 by megatron's cross entropy: refuse both with the offending id. On an accelerator
        the check is asynchronous (no host sync per microbatch; a bad label still stops the run, as a device
        assert): the launcher has already checked that the tokenizer fits the vocabulary."""
        bad = ((labels < 0) & (labels != IGNORE)) | (labels >= self.config.vocab_size)
        if labels.device.type != "cpu":
            torch._assert_async(~bad.any(), "a label id is outside the vocabulary (tokenizer/model mismatch)")
            return
        if bool(bad.any()):
            raise ValueError(f"label id {labels[bad][0].item()} is outside the vocabulary [0, "
                             f"{self.config.vocab_size}) (ignored positions use {IGNORE}); "
                             "the data's tokenizer does not match the model")

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[b, s, padded_vocab/tp] vocab-parallel logits of forward() -> [b, s, vocab]: gathered over this
        model's TP group (differentiable) and the padding columns stripped: what parity, generation or
        evaluation hand to users."""
        if self.pg_collection.tp.size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits, group=self.pg_collection.tp)
        if logits.shape[-1] != self.config.padded_vocab_size:
            raise ValueError(f"expected {self.config.padded_vocab_size} gathered vocab columns, got {logits.shape[-1]}")
        return logits[..., : self.config.vocab_size]
