"""What the cost model knows about a model: per module, parameters, FLOPs, activation bytes and sizes.

Derived from the same configs that build the models (models/configs.py for the LLM, dicts of Hugging Face
NemotronH field names; models/encoders.py for encoders, their families' dataclasses), so a planner number and a
built model can never describe different architectures. Nothing here imports torch.

Every module processes *items* of `tokens` tokens each: the LLM one packed sequence per sample, a ViT one
512² tile (or video frame), a FastConformer one audio clip. Forward FLOPs per item are
`tokens * (linear_flops + attn_flops * tokens)` — a per-token part (2 FLOPs per multiply-accumulate of
every weight a token touches) plus an attention part that grows with the context.

Formulas (forward, per token; h = hidden, V = vocab; training = 3x forward, 4x with full recompute):
    attention  2*h*(q + 2*kv)*hd + 2*q*hd*h     + 2*q*hd*S   (causal: QK^T and AV over S/2 positions)
    MLP        2 * 2*h*ffn                                    (squared ReLU, no gate)
    MoE        2*h*E + topk * 2*2*h*f_e + shared * 2*2*h*f_s (only the routed top-k experts run)
    Mamba-2    2*h*(2*di + 2*g*n + H) + 2*di*h + 2*(di + 2*g*n)*K          (in_proj, out_proj, conv)
               + g*n*Q + di*Q + 4*di*n   (SSD, chunk Q: C.B^T and (L o CB).X inside chunks, states in/out)
    lm_head    2*h*V  (the embedding lookup does no FLOPs)
    ViT layer  2*(4*h^2 + 2*h*ffn) + 4*h*T  per token, T = patches + prefix tokens of one sequence (a tile,
               a native grid, a tubelet); patch embed 2*3*p^2*h per patch and frame; pixel shuffle is a
               reshape (0 FLOPs) that folds s^2 tokens into one of width s^2*h; projector 2*(s^2*h*f + f*h_llm)
               per output token (hetero/planner/flops.py adds them up per sequence)
    Conformer  2*(2*2*h*4h + 4*h^2 + 2*h^2 + 2*h*2h + h*h + K*h) + 8*h*T  per 80 ms frame (two half FFNs,
               MHSA with relative-position projection and score term over 2T-1 positions, conv module);
               mel filterbank and dw-striding subsampling counted per 10 ms mel frame; projector
               2*(h*f + f*h_llm) per output token.
Activation bytes per token are what autograd keeps for backward in Tessera's modules as built (fitted to and
checked against a meta-device forward, hetero/planner/meta_memory.py; bf16 unless noted), in three parts: the
TP-sharded part (act_bytes, at tp=1), the part every TP rank holds in full (act_replicated: norm inputs and
outputs, residual-width tensors; under sequence parallelism, the MoE LLM at TP > 1, split over TP too) and,
for MoE, the routed rows a rank's experts take (act_unsplit, neither). Per layer and token:
    Mamba-2    4h | 6*conv + 30*di + 12*H          (conv in/out; fp32 y, x*D, gated RMSNorm; fused scan)
    attention  4h | 2*(q + 2kv)*hd + 4*q*hd         (flash: no S^2 term)
    at CP > 1  head-parallel layers (hetero/plan/cp_path.py) run the same kernels on 1/cp of the heads: as at
               CP 1; zigzag layers keep more: the all-gather attention 8*q bytes per local token and global key
               (bf16 scores, masked, fp32 softmax), the torch SSD scan 48*H*chunk bytes per token (intra-chunk
               decays and scores); hetero/planner/cp_cost.py picks per layer kind
    MLP        4h | 4*ffn
    MoE        4h + 4E + 12k | 4*f_s + 6*k*f_e | 2*h*k + 12k  (router fp32 scores, top-k; shared expert;
               per routed row: its h-wide copy, index and prob, and 3 expert-FFN-wide tensors)
    ViT layer  12h (8h without layer scale) | 10h + 4*ffn;  outside: 2*3p^2 per patch, projector 4*(in + hidden)
    Conformer  44h + 8f per frame + (4*heads + 1) per frame and context frame (rel-pos scores materialised);
               outside: dw-striding subsampling 2*C*F*(2/4 + 3/16 + 3/64 ...) per mel frame, projector 4*(h + hidden)
    LLM head   4h | 4*V fp32 logits (logits_bytes) on the last stage
(bytes, separated by |: replicated | TP-sharded | unsplit). With full recompute each layer keeps only its input
(2h, replicated) and the largest layer's activations live once while it is recomputed (act_peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.models import configs, encoders

BF16 = 2


@dataclass(frozen=True)
class ModuleDesc:
    """One module's cost-relevant facts; `items`/`tokens` come from the workload (see cost.items_of)."""

    key: str                      # "language", "vision", "audio"
    kind: str                     # which calibrated efficiency constant (cluster.Constants.eff_<kind>) its kernels
                                  # run at: "llm", or the encoder family's ("vit", "conformer"); nothing else reads it
    params: int                   # every parameter, projector included for encoders
    replicated_params: int        # held in full by every TP rank (norms, routers, encoder embeddings and projectors)
    expert_params: int            # routed-expert parameters (sharded by ep), part of params
    edge_params: int              # embedding + lm_head: live on the first / last PP stage only
    layers: int                   # PP stages cut these
    hidden: int                   # width of TP collectives and PP sends
    out_hidden: int               # width of what crosses the boundary (the LLM's hidden)
    linear_flops: float           # forward FLOPs per token, weights only (lm_head excluded)
    attn_flops: float             # forward FLOPs per token per context token
    head_flops: float             # forward FLOPs per token on the last stage only (lm_head)
    act_bytes: float              # bytes per token kept for backward, all layers: the TP-sharded part at tp=1
    act_replicated: float         # same, the part every TP rank holds (split over TP under sequence parallelism)
    act_unsplit: float            # same, split by neither (MoE: the routed rows of this rank's experts)
    act_bytes_recompute: float    # with full recompute: every layer's input (replicated)
    act_peak: tuple[tuple[str, float, float, float], ...]  # (layer symbol, replicated, sharded, unsplit) per token
    act_edge: float               # per token outside the layers, replicated (LLM: last stage; encoders: embed,
                                  # projector)
    logits_bytes: float           # per token on the last stage (fp32 logits for the loss), tp=1
    tp_collectives: int           # TP all-reduce pairs (fwd+bwd) per token pass over all layers
    attn_layers: int              # CP ring attention layers
    mamba_layers: int             # CP state passing layers
    state_bytes: int              # Mamba state per sample and layer (what CP passes on)
    moe_layers: int
    topk: int
    kv_width: int                 # K+V width per token (CP ring message)
    tp_divides: tuple[int, ...]   # TP must divide each (heads, KV heads, Mamba groups/heads)
    # vision/audio: how workload units map to items
    tokens_per_tile: int = 0      # ViT: tokens inside one tile (patches + prefix)
    out_per_tile: int = 0         # ViT: LLM tokens per tile after pixel shuffle
    temporal_patch: int = 0       # ViT: frames fused per video tubelet (0: none)
    frames_per_second: float = 0  # conformer: encoder frames (after subsampling) per audio second
    pre_flops_per_second: float = 0  # conformer: mel filterbank and subsampling FLOPs per audio second
    prefix_tokens: int = 0        # ViT: class / register tokens of every sequence
    pixel_shuffle: int = 1        # ViT: patches per output token along each side
    embed_flops: float = 0        # ViT: patch embedding FLOPs per patch and frame (a tubelet embeds several)
    out_flops: float = 0          # ViT: projector FLOPs per output token
    act_ctx: float = 0            # bytes per token and context token (materialised attention scores), TP-sharded
    cp_ctx: float = 0             # LLM at CP > 1: bytes per local token and global key, all attention layers, sharded
    cp_act: float = 0             # LLM at CP > 1: bytes per token, all Mamba layers (torch SSD scan), sharded
    cp_heads: tuple[int, ...] = ()  # LLM: (query heads, KV heads, Mamba heads, Mamba groups): the CP path rule's input
    head_dim: int = 0             # LLM: attention head width
    mamba_dims: tuple[int, int] = (0, 0)  # LLM: Mamba head width, state size
    scan_flops: float = 0         # LLM: forward FLOPs per token of all Mamba layers' conv + SSD scan (part of linear)
    cp_split: str = "items"       # encoders at CP > 1: "tokens" (an item's tokens split, each layer gathering K/V:
                                  # a family with context_parallel) or "items" (whole items per rank)
    name: str = ""                # registry name (models/configs.py, models/encoders.py); "" for raw config fields


@dataclass(frozen=True)
class ModelDesc:
    name: str
    modules: tuple[ModuleDesc, ...]

    def __getitem__(self, key: str) -> ModuleDesc:
        for m in self.modules:
            if m.key == key:
                return m
        raise KeyError(f"model {self.name} has no module {key!r}; it has {[m.key for m in self.modules]}")

    @property
    def keys(self) -> list[str]:
        return [m.key for m in self.modules]

    @property
    def encoders(self) -> list[ModuleDesc]:
        return [m for m in self.modules if m.key != "language"]


def llm_blocks(c: dict) -> dict[str, dict[str, float]]:
    """Per layer kind: params (rep_params of them replicated over TP), linear FLOPs/token, attention
    FLOPs/token/ctx, activation bytes/token (act: TP-sharded at tp=1, rep: replicated, unsplit: MoE routed rows)."""
    h, hd, q, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    di, nh = c["mamba_num_heads"] * c["mamba_head_dim"], c["mamba_num_heads"]
    g, n, K, Q = c["n_groups"], c["ssm_state_size"], c["conv_kernel"], c["chunk_size"]
    in_out = 2 * di + 2 * g * n + nh
    conv = di + 2 * g * n
    blocks = {
        "M": dict(params=h * in_out + conv * K + conv + 3 * nh + di + di * h + h, rep_params=h,
                  flops=2 * h * in_out + 2 * di * h + 2 * conv * K + g * n * Q + di * Q + 4 * di * n,
                  attn=0.0, rep=4 * h, act=6 * conv + 30 * di + 12 * nh,
                  cp=48 * nh * Q, scan=2 * conv * K + g * n * Q + di * Q + 4 * di * n),
        "*": dict(params=h * (q + 2 * kv) * hd + q * hd * h + h, rep_params=h,
                  flops=2 * h * (q + 2 * kv) * hd + 2 * q * hd * h, attn=2.0 * q * hd,
                  rep=4 * h, act=2 * (q + 2 * kv) * hd + 4 * q * hd, cp_ctx=8 * q),
        "-": dict(params=2 * h * c["intermediate_size"] + h, rep_params=h, flops=4 * h * c["intermediate_size"],
                  attn=0.0, rep=4 * h, act=4 * c["intermediate_size"]),
    }
    if "n_routed_experts" in c:
        E, k, fe = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
        fs = c.get("moe_shared_expert_intermediate_size", 0) * c.get("n_shared_experts", 0)
        # the router's expert bias is a buffer, not a parameter
        blocks["E"] = dict(params=h * E + E * 2 * h * fe + 2 * h * fs + h, rep_params=h * E + h,
                           experts=E * 2 * h * fe, flops=2 * h * E + k * 4 * h * fe + 4 * h * fs, attn=0.0,
                           rep=4 * h + 4 * E + 12 * k, act=4 * fs + 6 * k * fe, unsplit=2 * h * k + 12 * k)
    return blocks


def _peaks(blocks: dict, kinds: str) -> tuple[tuple[str, float, float, float], ...]:
    return tuple((ch, b["rep"], b["act"], b.get("unsplit", 0.0)) for ch, b in blocks.items() if ch in kinds)


def describe_llm(name: str | dict) -> ModuleDesc:
    """A registered LLM by name, or any NemotronH config fields (a checkpoint's)."""
    c = configs.hf_fields(name) if isinstance(name, str) else name
    h, V, pattern, hd = c["hidden_size"], c["vocab_size"], c["hybrid_override_pattern"], c["head_dim"]
    blocks = llm_blocks(c)
    total = lambda field: sum(blocks[ch].get(field, 0) for ch in pattern)  # noqa: E731
    edge = 2 * V * h  # untied embedding + lm_head
    attn_layers, mamba_layers = pattern.count("*"), pattern.count("M")
    tp_divides = (c["num_attention_heads"], c["num_key_value_heads"], c["n_groups"], c["mamba_num_heads"])
    return ModuleDesc(
        key="language", kind="llm", params=int(total("params") + edge + h),
        replicated_params=int(total("rep_params") + h), expert_params=int(total("experts")),
        edge_params=edge, layers=len(pattern), hidden=h, out_hidden=h,
        linear_flops=total("flops"), attn_flops=total("attn"), head_flops=2.0 * h * V,
        act_bytes=total("act"), act_replicated=total("rep"), act_unsplit=total("unsplit"),
        act_bytes_recompute=BF16 * h * len(pattern), act_peak=_peaks(blocks, pattern),
        cp_ctx=total("cp_ctx"), cp_act=total("cp"),
        act_edge=2 * BF16 * h, logits_bytes=4.0 * V,
        tp_collectives=len(pattern), attn_layers=attn_layers, mamba_layers=mamba_layers,
        state_bytes=4 * c["mamba_num_heads"] * c["mamba_head_dim"] * c["ssm_state_size"],
        moe_layers=pattern.count("E"), topk=c.get("num_experts_per_tok", 0),
        kv_width=2 * c["num_key_value_heads"] * c["head_dim"], tp_divides=tp_divides,
        cp_heads=(c["num_attention_heads"], c["num_key_value_heads"], c["mamba_num_heads"], c["n_groups"]),
        head_dim=hd, mamba_dims=(c["mamba_head_dim"], c["ssm_state_size"]), scan_flops=total("scan"),
        name=name if isinstance(name, str) else "")


def describe_encoder(name: str, llm_hidden: int) -> ModuleDesc:
    """The ModuleDesc of encoder `name` (+ its projector to `llm_hidden`): its family's parameters, FLOPs and
    activation bytes (models/encoder_families: planner_fields)."""
    c = encoders.encoder_config(name)
    return ModuleDesc(**encoders.family_of(c).planner_fields(c, llm_hidden), name=name)


def describe_model(llm: str | dict, vision: str | None = None, audio: str | None = None, name: str = "") -> ModelDesc:
    """The ModelDesc of an LLM (models.configs name, or a checkpoint's config fields) with optional encoders
    (models.encoders names, `hf:` names included)."""
    lang = describe_llm(llm)
    mods = [lang]
    if vision:
        mods.insert(0, describe_encoder(vision, lang.hidden))
    if audio:
        mods.insert(len(mods) - 1, describe_encoder(audio, lang.hidden))
    return ModelDesc(name or "+".join(filter(None, (vision, audio, llm if isinstance(llm, str) else "llm"))),
                     tuple(mods))
