"""Mamba-2 mixer in pure PyTorch: the CPU kernel and the numerical reference for the hybrid LLM.

megatron-core's MambaMixer needs mamba_ssm/causal_conv1d (CUDA/Triton), so on CPU this module does the
same job with plain torch ops: in_proj -> depthwise causal conv1d + SiLU -> chunked SSD scan (+ D skip)
-> gated RMSNorm -> out_proj. The maths follows the Mamba-2 paper's "minimal SSD" formulation, the same
one transformers' NemotronH torch path evaluates, so logits match it to float32 round-off.

Tensor parallelism follows megatron's MambaMixer: heads and B/C groups are split across TP ranks. The
in_proj output of one rank is laid out as [z_r | x_r | B_r | C_r | dt_r], so a ColumnParallelLinear whose
full weight stores the ranks' blocks one after another gives every rank exactly its slice (the HF loader
builds that order, see models/nemotron_h_hf.py). The gated norm groups never straddle ranks because
n_groups is divisible by TP. Activations are [s, b, h] like every megatron layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = a[..., j+1] + ... + a[..., i] for i >= j, -inf above the diagonal.

    Summing masked copies (instead of subtracting two cumsums) keeps it exact where cumsums would
    cancel catastrophically; exp() of the result is the decay from position j to position i.
    """
    t = a.size(-1)
    rows = a.unsqueeze(-1).expand(*a.shape, t)  # rows[..., k, j] = a[..., k]
    strictly_lower = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    summed = rows.masked_fill(~strictly_lower, 0.0).cumsum(dim=-2)
    lower = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(0)
    return summed.masked_fill(~lower, float("-inf"))


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked selective-state-space scan (SSD), batch-first, float32 inside.

    x: [b, l, h, p]; dt: [b, l, h] (already softplus'ed and clamped); A: [h] (negative);
    B, C: [b, l, g, n] with h divisible by g. initial_state: [b, h, p, n] or None.
    Returns y [b, l, h, p] (without the D skip) and the final state [b, h, p, n]; the state is what a
    later chunk of the same sequence (context parallelism, decoding) would continue from.
    resets: bool [b, l], True where a packed document starts: the log-decay there is -inf, so the state
    carried into that token is multiplied by 0 (the document starts from a zero state, as if alone).
    None (or no True) is the unpacked scan, bit for bit.
    """
    b, length, h, p = x.shape
    g = B.shape[2]
    pad = (-length) % chunk_size
    x, dt = x.float(), dt.float()
    B = B.float().repeat_interleave(h // g, dim=2)
    C = C.float().repeat_interleave(h // g, dim=2)
    xdt = x * dt.unsqueeze(-1)
    adt = dt * A.float()  # [b, l, h], log-decay per step
    if resets is not None and not bool(resets.any()):
        resets = None
    if resets is not None:
        adt = adt.masked_fill(resets[..., None], float("-inf"))

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))  # zero-pad the sequence dim (dim 1)
        return t.reshape(b, -1, chunk_size, *t.shape[2:])

    xdt, adt, B, C = chunks(xdt), chunks(adt), chunks(B), chunks(C)  # [b, c, q, ...]
    adt = adt.permute(0, 3, 1, 2)  # [b, h, c, q]
    a_cum = adt.cumsum(dim=-1)

    # 1. inside each chunk: attention-like scores C.B masked by the decay between positions.
    decay = torch.exp(segment_sum(adt))  # [b, h, c, q(target), q(source)]
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * decay
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)

    # 2. the state each chunk leaves behind, from its own inputs only.
    if resets is None:
        to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, h, c, q]
    else:  # sum of the later steps' log-decays without a difference (-inf - -inf would be NaN)
        later = F.pad(adt[..., 1:], (0, 1))
        to_end = torch.exp(later.flip(-1).cumsum(-1).flip(-1))
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, xdt)

    # 3. carry states across chunks: state entering chunk c = decayed sum over earlier chunks.
    if initial_state is None:
        initial_state = torch.zeros_like(chunk_states[:, 0])
    chunk_states = torch.cat([initial_state.float().unsqueeze(1), chunk_states], dim=1)
    chunk_decay = torch.exp(segment_sum(F.pad(a_cum[..., -1], (1, 0))))  # [b, h, c+1, c+1]
    carried = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, chunk_states)
    entering, final_state = carried[:, :-1], carried[:, -1]

    # 4. contribution of the entering state to every position of the chunk.
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, entering, torch.exp(a_cum))

    y = (y_diag + y_off).reshape(b, -1, h, p)[:, :length]
    return y, final_state


def document_starts(doc_ids: torch.Tensor | None, previous: torch.Tensor | None = None) -> torch.Tensor | None:
    """bool [b, l]: True where a new packed document starts (its id differs from the token before).
    previous: [b] id of the token before position 0 (context parallelism), else position 0 never starts
    one. None when doc_ids is None or nothing starts (one document per row: the unpacked path)."""
    if doc_ids is None:
        return None
    before = doc_ids[:, :1] if previous is None else previous[:, None].to(doc_ids.dtype)
    starts = doc_ids != torch.cat([before, doc_ids[:, :-1]], dim=1)
    return starts if bool(starts.any()) else None


def causal_depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """x: [b, l, d]; weight: [d, k]. Output at t sees inputs t-k+1 .. t only (left zero padding).
    doc_ids: [b, l] packed-document id per token; a tap reading a token of another document is zeroed,
    so no document sees the previous one's tail. None or one document per row: the plain conv."""
    k = weight.shape[-1]
    if doc_ids is not None and document_starts(doc_ids) is not None:
        windows = F.pad(x.transpose(1, 2), (k - 1, 0)).unfold(-1, k, 1)  # [b, d, l, k]: inputs t-k+1 .. t
        docs = F.pad(doc_ids, (k - 1, 0), value=-1).unfold(-1, k, 1)  # [b, l, k]
        same = (docs == doc_ids[..., None]).to(x.dtype)
        out = torch.einsum("bdlk,blk,dk->bld", windows, same, weight)
        return out + bias if bias is not None else out
    out = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), weight.unsqueeze(1), bias, groups=x.shape[-1])
    return out.transpose(1, 2)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float):
    """RMSNorm of y * silu(z) over groups of `group_size` channels (norm after gate, as Nemotron-H)."""
    dtype = y.dtype
    y = y.float() * F.silu(z.float())
    grouped = y.reshape(*y.shape[:-1], -1, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.reshape(y.shape).to(dtype)


@dataclass
class MixerShard:
    """The heads a mixer's sequence kernels run on and their parameters: a rank's whole TP shard, or under
    head-parallel context parallelism (hetero/parallel/cp_heads.py) a CP rank's slice of it."""

    heads: int
    groups: int
    conv_weight: torch.Tensor  # [d + 2 * groups * state, kernel]: the x, B, C channels of these heads
    conv_bias: torch.Tensor
    dt_bias: torch.Tensor  # [heads]
    A_log: torch.Tensor
    D: torch.Tensor


@dataclass
class Mamba2Submodules:
    """Which linear classes to use; megatron's Column/RowParallelLinear in the hybrid spec."""

    in_proj: type
    out_proj: type


class Mamba2Mixer(nn.Module):
    """Mamba-2 mixer, [s, b, hidden] -> ([s, b, hidden], bias=None) like a megatron mixer.

    Config fields read (a megatron TransformerConfig extended by models/hybrid_llm.py): hidden_size,
    mamba_num_heads, mamba_head_dim, mamba_num_groups, mamba_state_dim, mamba_conv_kernel,
    mamba_chunk_size, mamba_dt_min_clamp, layernorm_epsilon, init_method, output_layer_init_method, and
    megatron's recompute_granularity / recompute_modules: selective recompute of "core_attn" also recomputes the
    SSD scan, the Mamba counterpart of core attention (models/recompute.py).
    """

    # Whether `scan` keeps large intermediates for backward (the torch SSD: [b, h, chunks, q, q] decays and
    # scores); a fused kernel that saves about its inputs sets False: recomputing it would only cost time.
    scan_keeps_intermediates = True

    def __init__(self, config, submodules: Mamba2Submodules, layer_number: int = 1, tp_group=None,
                 pg_collection=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        if pg_collection is not None:  # injected groups win; subclasses (CP, GPU kernels) read more of them
            tp_group = pg_collection.tp
        self.pg_collection = pg_collection
        tp = tp_group.size() if tp_group is not None else 1
        heads, groups = config.mamba_num_heads, config.mamba_num_groups
        if heads % tp or groups % tp or heads % groups:
            raise ValueError(
                f"mamba heads ({heads}) and groups ({groups}) must divide by tp ({tp}), heads by groups"
            )
        self.heads, self.groups = heads // tp, groups // tp  # this rank's share
        self.head_dim, self.state = config.mamba_head_dim, config.mamba_state_dim
        self.d_inner = self.heads * self.head_dim
        self.conv_dim = self.d_inner + 2 * self.groups * self.state
        full_inner = heads * config.mamba_head_dim
        self.norm_group = full_inner // groups  # channels per gated-norm group (= per B/C group)

        in_features = 2 * full_inner + 2 * groups * config.mamba_state_dim + heads
        self.in_proj = submodules.in_proj(
            config.hidden_size, in_features, config=config, init_method=config.init_method,
            bias=False, gather_output=False, skip_bias_add=True, is_expert=False, tp_group=tp_group,
        )
        self.out_proj = submodules.out_proj(
            full_inner, config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_group=tp_group,
        )
        # Per-rank parameters; megatron marks them tensor_model_parallel so checkpointing shards them.
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, config.mamba_conv_kernel))
        self.conv1d_bias = nn.Parameter(torch.zeros(self.conv_dim))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.norm_weight = nn.Parameter(torch.ones(self.d_inner))
        nn.init.kaiming_uniform_(self.conv1d_weight, a=5**0.5)
        for p in (self.conv1d_weight, self.conv1d_bias, self.A_log, self.D, self.dt_bias, self.norm_weight):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        self.recompute_scan = (self.scan_keeps_intermediates
                               and getattr(config, "recompute_granularity", None) == "selective"
                               and "core_attn" in (getattr(config, "recompute_modules", None) or ()))

    def shard(self) -> MixerShard:
        """This rank's heads and their parameters: the whole TP shard (head-parallel CP takes a slice)."""
        return MixerShard(self.heads, self.groups, self.conv1d_weight, self.conv1d_bias, self.dt_bias,
                          self.A_log, self.D)

    def forward(self, hidden_states: torch.Tensor, initial_state: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None):
        """doc_ids: [b, s] packed-document id of every (local) token, or None for one sequence per row."""
        zxbcdt, _ = self.in_proj(hidden_states)
        y, z = self.mix(zxbcdt.transpose(0, 1), self.shard(), initial_state, doc_ids)  # [b, s, .] for the scan
        y = gated_rms_norm(y, z, self.norm_weight, self.norm_group, self.config.layernorm_epsilon)
        out, bias = self.out_proj(y.to(hidden_states.dtype).transpose(0, 1))
        return out, bias

    def mix(self, zxbcdt: torch.Tensor, shard: MixerShard, initial_state=None, doc_ids=None):
        """The sequence mixing of `shard`'s heads: zxbcdt [b, s, z | x | B | C | dt] (its heads' channels)
        -> (y [b, s, d] float32 before the gated norm, the gate z [b, s, d])."""
        b, s, _ = zxbcdt.shape
        d_inner = shard.heads * self.head_dim
        conv_dim = d_inner + 2 * shard.groups * self.state
        z, xbc, dt = zxbcdt.split([d_inner, conv_dim, shard.heads], dim=-1)
        xbc = F.silu(self.conv(xbc, doc_ids, shard.conv_weight, shard.conv_bias))
        x, B, C = xbc.split([d_inner, shard.groups * self.state, shard.groups * self.state], dim=-1)
        dt = F.softplus(dt.float() + shard.dt_bias.float()).clamp(min=self.config.mamba_dt_min_clamp)
        x = x.reshape(b, s, shard.heads, self.head_dim)
        doc_kwargs = {"doc_ids": doc_ids} if doc_ids is not None else {}
        scan_args = (x, dt, -torch.exp(shard.A_log.float()), B.reshape(b, s, shard.groups, self.state),
                     C.reshape(b, s, shard.groups, self.state), initial_state)
        if self.recompute_scan and self.training and torch.is_grad_enabled():
            from tessera.models.recompute import checkpoint  # megatron's checkpoint; this module stays torch-only

            y = checkpoint(lambda *a: self.scan(*a, **doc_kwargs), *scan_args, module=self)
        else:
            y = self.scan(*scan_args, **doc_kwargs)
        y = y + x.float() * shard.D.float()[:, None]
        return y.reshape(b, s, d_inner), z

    # The two sequence-mixing steps; everything else in forward is per token. Context parallelism and GPU
    # kernels (hetero/) replace exactly these two by subclassing.
    # Both take doc_ids [b, s] (packed-document ids): no tap and no state crosses a document start.
    def conv(self, xbc: torch.Tensor, doc_ids: torch.Tensor | None = None, weight=None, bias=None) -> torch.Tensor:
        """Causal depthwise conv over the [b, s, conv_dim] local sequence (before SiLU); weight/bias: a head
        shard's conv parameters (default: this rank's)."""
        weight, bias = (self.conv1d_weight, self.conv1d_bias) if weight is None else (weight, bias)
        return causal_depthwise_conv1d(xbc, weight, bias, doc_ids)

    def scan(self, x, dt, A, B, C, initial_state=None, doc_ids=None) -> torch.Tensor:
        """SSD scan y [b, s, h, p] (float32, without the D skip); shapes as ssd_chunk_scan."""
        y, _ = ssd_chunk_scan(x, dt, A, B, C, self.config.mamba_chunk_size, initial_state,
                              resets=document_starts(doc_ids))
        return y
