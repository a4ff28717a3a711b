"""The small encoders -> projector -> boundary -> LLM chain that `hetero.tools.verify` runs two ways.

`reference_forward` is the single-device model: plain tensors, full weights. `ParallelEncoder` and
`ParallelLanguage` build one rank's part of the same model in its module's layout from megatron-core
tensor-parallel layers (weights sliced from the same full tensors) and the CP attention kernel, so any
difference between the two is a bug in the layouts, the boundary or the kernels.

Every encoder block: bidirectional attention within each sample (CP: keys gathered over the CP group)
and an MLP; the projector maps to the LLM width. Every LLM layer: causal attention within each sample
(zigzag CP) and an MLP, or with llm="moe" a mixture of experts (hetero.tools.verify_chain_moe: megatron's
MoELayer with EP; TP then runs sequence parallel). Loss: squared error to a fixed target, summed, over
(samples*seq*hidden).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, gather_from_sequence_parallel_region,
                                          scatter_to_sequence_parallel_region)

from tessera.hetero.plan.boundary_plan import BoundaryBatch
from tessera.hetero.parallel.cp_gather_attention import context_parallel_attention, masked_attention
from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout, llm_sequence_parallel
from tessera.hetero.tools.verify_chain_moe import LLMS, ParallelMoE, is_moe, moe_config, moe_weights, reference_moe


@dataclass(frozen=True)
class ChainDims:
    d_in: int = 12          # encoder input features per media token
    enc_hidden: int = 24
    enc_heads: int = 4
    llm_hidden: int = 32
    llm_heads: int = 8
    llm_kv_heads: int = 4
    ffn_mult: int = 2
    moe_experts: int = 4    # llm="moe": routed experts per LLM layer (EP must divide it)
    moe_topk: int = 2
    moe_ffn: int = 32       # each routed expert's FFN width
    moe_shared_ffn: int = 64


def depth(pp: int) -> int:
    return max(2, pp)


def stage_layers(n_layers: int, pp: int, stage: int) -> list[int]:
    return [int(i) for i in np.array_split(np.arange(n_layers), pp)[stage]]


def make_weights(layout: HeteroLayout, dims: ChainDims, seed: int, dtype=torch.float32,
                 llm: str = "dense") -> dict[str, torch.Tensor]:
    """Full (unsharded) weights of the whole chain, identical on every rank. llm="moe": every LLM layer's MLP
    is a mixture of experts (router, fixed expert bias, routed and shared experts) instead of fc1/fc2."""
    if llm not in LLMS:
        raise ValueError(f"llm={llm!r}: use one of {LLMS}")
    g = torch.Generator().manual_seed(seed)
    w = {}

    def lin(name, out_f, in_f, bias=True):
        w[name + ".weight"] = (torch.randn(out_f, in_f, generator=g) * in_f ** -0.5).to(dtype)
        if bias:
            w[name + ".bias"] = (torch.randn(out_f, generator=g) * 0.02).to(dtype)

    def block(prefix, d, heads, kv_heads, mlp=True):
        hd = d // heads
        # no q/k/v bias (as in the Nemotron LLMs); a key bias would also get an identically-zero gradient
        # (softmax ignores a per-query constant), which no relative error can compare
        lin(prefix + ".q", heads * hd, d, bias=False)
        lin(prefix + ".k", kv_heads * hd, d, bias=False)
        lin(prefix + ".v", kv_heads * hd, d, bias=False)
        lin(prefix + ".o", d, heads * hd)
        if mlp:
            lin(prefix + ".fc1", d * dims.ffn_mult, d)
            lin(prefix + ".fc2", d, d * dims.ffn_mult)

    for key in sorted(layout.encoders):
        lin(f"{key}.embed", dims.enc_hidden, dims.d_in)
        for i in range(depth(layout[key].pp)):
            block(f"{key}.blocks.{i}", dims.enc_hidden, dims.enc_heads, dims.enc_heads)
        lin(f"{key}.proj1", dims.llm_hidden * dims.ffn_mult, dims.enc_hidden)
        lin(f"{key}.proj2", dims.llm_hidden, dims.llm_hidden * dims.ffn_mult)
    for i in range(depth(layout[LANGUAGE].pp)):
        block(f"{LANGUAGE}.layers.{i}", dims.llm_hidden, dims.llm_heads, dims.llm_kv_heads, mlp=llm == "dense")
        if llm == "moe":
            moe_weights(w, g, f"{LANGUAGE}.layers.{i}", dims, dtype)
    return w


# ---------------------------------------------------------------------------------------- reference
def _ref_lin(w, name, x):
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def _ref_block(w, prefix, x, pos, seg, heads, kv_heads, causal, topk=0):
    hd = x.shape[-1] // heads
    q = _ref_lin(w, prefix + ".q", x).view(-1, heads, hd)
    k = _ref_lin(w, prefix + ".k", x).view(-1, kv_heads, hd)
    v = _ref_lin(w, prefix + ".v", x).view(-1, kv_heads, hd)
    a = masked_attention(q, k, v, pos, pos, seg, seg, causal).reshape(x.shape[0], -1)
    x = x + _ref_lin(w, prefix + ".o", a)
    if is_moe(w, prefix):
        return x + reference_moe(w, prefix, x, topk)
    return x + _ref_lin(w, prefix + ".fc2", F.gelu(_ref_lin(w, prefix + ".fc1", x)))


def encoder_token_meta(batch: BoundaryBatch, item_sizes: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per media token of an encoder: (index within its item, item id) — attention positions/segments. An item is
    a run of a sample's tokens (`item_sizes`, in token order; None: one item per sample), encoded on its own as
    the trainer's media items are, so an item can be encoded on any DP rank."""
    counts = batch.tokens_per_sample if item_sizes is None else np.asarray(item_sizes, dtype=np.int64)
    seg = np.repeat(np.arange(len(counts)), counts)
    pos = np.arange(len(seg)) - np.repeat(np.cumsum(counts) - counts, counts)
    return torch.as_tensor(pos), torch.as_tensor(seg)


def reference_fused(w, layout: HeteroLayout, dims: ChainDims, inputs: dict, batches: dict[str, BoundaryBatch],
                    text: torch.Tensor, items: dict | None = None) -> torch.Tensor:
    """Single-device LLM input [N, S, H]: text embeddings with every encoder's output at its positions.
    items: encoder -> its item sizes (encoder_token_meta); None: one item per sample."""
    n, seq, hidden = text.shape
    fused = text.clone()
    for key in sorted(layout.encoders):
        pos, seg = encoder_token_meta(batches[key], (items or {}).get(key))
        h = _ref_lin(w, f"{key}.embed", inputs[key])
        for i in range(depth(layout[key].pp)):
            h = _ref_block(w, f"{key}.blocks.{i}", h, pos, seg, dims.enc_heads, dims.enc_heads, causal=False)
        e = _ref_lin(w, f"{key}.proj2", F.gelu(_ref_lin(w, f"{key}.proj1", h)))
        sample = np.repeat(np.arange(n), batches[key].tokens_per_sample)
        rows = torch.as_tensor(sample * seq + np.concatenate(batches[key].positions))
        fused = fused.reshape(n * seq, hidden).index_copy(0, rows, e).view(n, seq, hidden)
    return fused


def token_segments(n: int, seq: int, docs: torch.Tensor | None = None) -> torch.Tensor:
    """[N, S] attention segment of every LLM token: its sample, or with packed documents (docs [N, S], the
    document index within the row) its (sample, document) pair — tokens attend within their segment."""
    sample = torch.arange(n)[:, None].expand(n, seq)
    return sample if docs is None else sample * seq + docs


def reference_llm(w, layout: HeteroLayout, dims: ChainDims, x: torch.Tensor, pos, seg) -> torch.Tensor:
    """The LLM layers on flat tokens x [T, H] with their positions and segments."""
    for i in range(depth(layout[LANGUAGE].pp)):
        x = _ref_block(w, f"{LANGUAGE}.layers.{i}", x, pos, seg, dims.llm_heads, dims.llm_kv_heads, causal=True,
                       topk=dims.moe_topk)
    return x


def reference_forward(w, layout: HeteroLayout, dims: ChainDims, inputs: dict, batches: dict[str, BoundaryBatch],
                      text: torch.Tensor, target: torch.Tensor, docs: torch.Tensor | None = None,
                      items: dict | None = None):
    """Single-device forward: returns (LLM output [N, S, H], loss). docs: packed documents per row; items: each
    encoder's item sizes (reference_fused)."""
    n, seq, hidden = text.shape
    fused = reference_fused(w, layout, dims, inputs, batches, text, items)
    pos = torch.arange(seq).repeat(n)
    x = reference_llm(w, layout, dims, fused.reshape(n * seq, hidden), pos, token_segments(n, seq, docs).reshape(-1))
    y = x.view(n, seq, hidden)
    return y, ((y - target) ** 2).sum() / y.numel()


def reference_documents_alone(w, layout: HeteroLayout, dims: ChainDims, inputs: dict,
                              batches: dict[str, BoundaryBatch], text: torch.Tensor, docs: torch.Tensor,
                              items: dict | None = None):
    """LLM output [N, S, H] with every packed document run through the LLM alone (positions from 0)."""
    fused = reference_fused(w, layout, dims, inputs, batches, text, items)
    out = torch.empty_like(fused)
    for r in range(fused.shape[0]):
        for d in docs[r].unique().tolist():
            idx = (docs[r] == d).nonzero().squeeze(1)
            pos = torch.arange(len(idx))
            out[r, idx] = reference_llm(w, layout, dims, fused[r, idx], pos, torch.zeros_like(pos))
    return out


# ----------------------------------------------------------------------------------------- parallel
class ParallelBlock(torch.nn.Module):
    """One attention + MLP block in a module's TP/CP layout, weights sliced from the full tensors."""

    def __init__(self, w, prefix, d, heads, kv_heads, config, pgs, causal: bool, moe=None):
        super().__init__()
        self.tp, self.cp_group, self.causal = pgs.tp.size(), pgs.cp, causal
        self.hd, self.heads, self.kv_heads = d // heads, heads // self.tp, kv_heads // self.tp
        self.prefix, t = prefix, pgs.tp.rank()

        def col(name, out_f, in_f, bias=True):
            m = ColumnParallelLinear(in_f, out_f, config=config, init_method=lambda x: x, bias=bias,
                                     gather_output=False, tp_group=pgs.tp)
            _load(m, w, prefix + name, t, self.tp, dim=0)
            return m

        def row(name, out_f, in_f):
            m = RowParallelLinear(in_f, out_f, config=config, init_method=lambda x: x, bias=True,
                                  input_is_parallel=True, skip_bias_add=False, tp_group=pgs.tp)
            _load(m, w, prefix + name, t, self.tp, dim=1)
            return m

        self.q = col(".q", heads * self.hd, d, bias=False)
        self.k = col(".k", kv_heads * self.hd, d, bias=False)
        self.v = col(".v", kv_heads * self.hd, d, bias=False)
        self.o = row(".o", d, heads * self.hd)
        if moe is None:
            self.fc1 = col(".fc1", w[prefix + ".fc1.weight"].shape[0], d)
            self.fc2 = row(".fc2", d, w[prefix + ".fc2.weight"].shape[1])
        else:  # the MoE MLP (ParallelMoE) in its place
            self.moe = moe

    def forward(self, x, pos, seg, counts=None):
        n = pos.shape[0]  # this rank's tokens; under sequence parallelism x holds 1/tp of them (q/k/v gather)
        q = self.q(x)[0].view(n, self.heads, self.hd)
        k = self.k(x)[0].view(n, self.kv_heads, self.hd)
        v = self.v(x)[0].view(n, self.kv_heads, self.hd)
        a = context_parallel_attention(q, k, v, pos, seg, self.causal, self.cp_group, counts)
        x = x + self.o(a.reshape(n, -1))[0]  # under sequence parallelism: reduce-scattered to x's slice
        if hasattr(self, "moe"):
            return x + self.moe(x)
        return x + self.fc2(F.gelu(self.fc1(x)[0]))[0]


def _load(module, w, name, tp_rank, tp, dim):
    """Copy this TP rank's slice of full weight `name` into a megatron parallel linear."""
    weight, bias = w[name + ".weight"], w.get(name + ".bias")
    with torch.no_grad():
        module.weight.copy_(weight.chunk(tp, dim=dim)[tp_rank])
        if bias is not None:
            module.bias.copy_(bias.chunk(tp, dim=0)[tp_rank] if dim == 0 else bias)
    module.full_names = (name + ".weight", name + ".bias")
    module.shard = (tp_rank, tp, dim)


def mp_config(tp: int, dtype, sequence_parallel: bool = False) -> ModelParallelConfig:
    return ModelParallelConfig(tensor_model_parallel_size=tp, params_dtype=dtype, use_cpu_initialization=True,
                               perform_initialization=False, sequence_parallel=sequence_parallel)


class ParallelEncoder(torch.nn.Module):
    """One rank's pipeline stage of an encoder (+ the projector on its last stage)."""

    def __init__(self, w, key, layout: HeteroLayout, dims: ChainDims, pgs, stage: int, dtype=torch.float32):
        super().__init__()
        m = layout[key]
        cfg, t, tp = mp_config(m.tp, dtype), pgs.tp.rank(), m.tp
        self.first, self.last = stage == 0, stage == m.pp - 1
        if self.first:
            self.embed = ColumnParallelLinear(dims.d_in, dims.enc_hidden, config=cfg, init_method=lambda x: x,
                                              bias=True, gather_output=True, tp_group=pgs.tp)
            _load(self.embed, w, f"{key}.embed", t, tp, dim=0)
        self.blocks = torch.nn.ModuleList(
            ParallelBlock(w, f"{key}.blocks.{i}", dims.enc_hidden, dims.enc_heads, dims.enc_heads, cfg, pgs, False)
            for i in stage_layers(depth(m.pp), m.pp, stage))
        if self.last:
            self.proj1 = ColumnParallelLinear(dims.enc_hidden, dims.llm_hidden * dims.ffn_mult, config=cfg,
                                              init_method=lambda x: x, bias=True, gather_output=False,
                                              tp_group=pgs.tp)
            self.proj2 = RowParallelLinear(dims.llm_hidden * dims.ffn_mult, dims.llm_hidden, config=cfg,
                                           init_method=lambda x: x, bias=True, input_is_parallel=True,
                                           skip_bias_add=False, tp_group=pgs.tp)
            _load(self.proj1, w, f"{key}.proj1", t, tp, dim=0)
            _load(self.proj2, w, f"{key}.proj2", t, tp, dim=1)

    def forward(self, x, pos, seg, counts):
        h = self.embed(x)[0] if self.first else x
        for b in self.blocks:
            h = b(h, pos, seg, counts)
        if self.last:
            h = self.proj2(F.gelu(self.proj1(h)[0]))[0]
        return h


class ParallelLanguage(torch.nn.Module):
    """One rank's pipeline stage of the LLM; input and output are [local samples * seq/cp, hidden].

    llm="moe": every layer's MLP is megatron's MoELayer (ParallelMoE). With TP > 1 it then runs sequence
    parallel (llm_sequence_parallel), as models/hybrid_llm.HybridLM: the stage scatters its input over TP along
    the tokens, the layers carry 1/tp of them (q/k/v and the MoE dispatcher gather, the attention output
    reduce-scatters) and the stage gathers its output again. Stage boundaries (PP, the loss) stay whole tokens,
    replicated over TP as in the dense chain, so the gather's backward only takes this rank's slice of the
    (replicated) gradient."""

    def __init__(self, w, layout: HeteroLayout, dims: ChainDims, pgs, stage: int, dtype=torch.float32,
                 llm: str = "dense"):
        super().__init__()
        if llm not in LLMS:
            raise ValueError(f"llm={llm!r}: use one of {LLMS}")
        m = layout[LANGUAGE]
        self.sp, self.tp_group = llm_sequence_parallel(llm == "moe", m.tp), pgs.tp
        cfg = mp_config(m.tp, dtype, self.sp)
        mcfg = moe_config(dims, m, dtype, self.sp) if llm == "moe" else None
        self.layers = torch.nn.ModuleList(
            ParallelBlock(w, f"{LANGUAGE}.layers.{i}", dims.llm_hidden, dims.llm_heads, dims.llm_kv_heads, cfg,
                          pgs, True, moe=ParallelMoE(w, f"{LANGUAGE}.layers.{i}", mcfg, pgs, i + 1) if mcfg else None)
            for i in stage_layers(depth(m.pp), m.pp, stage))

    def forward(self, x, pos, seg):
        if self.sp:
            x = scatter_to_sequence_parallel_region(x, group=self.tp_group)
        for layer in self.layers:
            x = layer(x, pos, seg)
        if self.sp:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
        return x


def sharded_reference_grad(module, param_name: str, ref_grads: dict) -> torch.Tensor:
    """The reference gradient of a parallel linear's parameter, sliced as this rank holds it."""
    weight_name, bias_name = module.full_names
    tp_rank, tp, dim = module.shard
    if param_name == "weight":
        return ref_grads[weight_name].chunk(tp, dim=dim)[tp_rank]
    return ref_grads[bias_name].chunk(tp, dim=0)[tp_rank] if dim == 0 else ref_grads[bias_name]
