"""What the cost model knows about a model: per module, parameters, FLOPs, activation bytes and sizes.

Derived from the same plain dicts that build the models (models/configs.py for the LLM in Hugging Face
NemotronH field names, models/encoders.py for encoders), so a planner number and a built model can never
describe different architectures. Nothing here imports torch.

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
    ViT layer  2*(4*h^2 + 2*h*ffn) + 4*h*T  per token, T = patches + prefix tokens of one tile
               patch embed 2*3*p^2*h per patch; pixel shuffle is a reshape (0 FLOPs) that folds s^2
               tokens into one of width s^2*h; projector 2*(s^2*h*f + f*h_llm) per output token
    Conformer  2*(2*2*h*4h + 4*h^2 + h^2 + 2*h*2h + h*h + K*h) + 6*h*T  per 80 ms frame (two half FFNs,
               MHSA with relative-position projection and score term, conv module); dw-striding
               subsampling counted per 10 ms mel frame; projector 2*(h*f + f*h_llm) per output token.
Activation bytes per token and layer count the bf16 tensors autograd keeps (flash attention: no S^2
term); with full recompute only each layer's input (2*h bytes) is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.models import configs, encoders

BF16 = 2


@dataclass(frozen=True)
class ModuleDesc:
    """One module's cost-relevant facts; `items`/`tokens` come from the workload (see cost.items_of)."""

    key: str                      # "language", "vision", "audio"
    kind: str                     # "llm", "vit", "conformer": which efficiency constant applies
    params: int                   # every parameter, projector included for encoders
    expert_params: int            # routed-expert parameters (sharded by ep), part of params
    edge_params: int              # embedding + lm_head: live on the first / last PP stage only
    layers: int                   # PP stages cut these
    hidden: int                   # width of TP collectives and PP sends
    out_hidden: int               # width of what crosses the boundary (the LLM's hidden)
    linear_flops: float           # forward FLOPs per token, weights only (lm_head excluded)
    attn_flops: float             # forward FLOPs per token per context token
    head_flops: float             # forward FLOPs per token on the last stage only (lm_head)
    act_bytes: float              # bytes per token kept for backward, all layers, tp=1
    act_bytes_recompute: float    # same with full recompute (layer inputs only)
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
    pre_flops_per_second: float = 0  # conformer: subsampling FLOPs per audio second


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


def _llm_blocks(c: dict) -> dict[str, dict[str, float]]:
    """Per layer kind: params, linear FLOPs/token, attention FLOPs/token/ctx, activation bytes/token."""
    h, hd, q, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    di, nh = c["mamba_num_heads"] * c["mamba_head_dim"], c["mamba_num_heads"]
    g, n, K, Q = c["n_groups"], c["ssm_state_size"], c["conv_kernel"], c["chunk_size"]
    in_out = 2 * di + 2 * g * n + nh
    conv = di + 2 * g * n
    blocks = {
        "M": dict(params=h * in_out + conv * K + conv + 3 * nh + di + di * h + h,
                  flops=2 * h * in_out + 2 * di * h + 2 * conv * K + g * n * Q + di * Q + 4 * di * n,
                  attn=0.0,
                  # norm in, in_proj in, in_proj out, conv in/out, y, gated-norm (y, z), out_proj in
                  act=BF16 * (2 * h + in_out + 2 * conv + di + 2 * di + di)),
        "*": dict(params=h * (q + 2 * kv) * hd + q * hd * h + h,
                  flops=2 * h * (q + 2 * kv) * hd + 2 * q * hd * h, attn=2.0 * q * hd,
                  act=BF16 * (2 * h + (q + 2 * kv) * hd + 2 * q * hd)),
        "-": dict(params=2 * h * c["intermediate_size"] + h, flops=4 * h * c["intermediate_size"], attn=0.0,
                  act=BF16 * (2 * h + 2 * c["intermediate_size"])),
    }
    if "n_routed_experts" in c:
        E, k, fe = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
        fs = c.get("moe_shared_expert_intermediate_size", 0) * c.get("n_shared_experts", 0)
        blocks["E"] = dict(params=h * E + E + E * 2 * h * fe + 2 * h * fs + h, experts=E * 2 * h * fe,
                           flops=2 * h * E + k * 4 * h * fe + 4 * h * fs, attn=0.0,
                           act=BF16 * (2 * h + h + k * (h + 2 * fe) + h + 2 * fs))
    return blocks


def describe_llm(name: str | dict) -> ModuleDesc:
    """A registered LLM by name, or any NemotronH config fields (a checkpoint's)."""
    c = configs.hf_fields(name) if isinstance(name, str) else name
    h, V, pattern = c["hidden_size"], c["vocab_size"], c["hybrid_override_pattern"]
    blocks = _llm_blocks(c)
    total = lambda field: sum(blocks[ch].get(field, 0) for ch in pattern)  # noqa: E731
    edge = 2 * V * h  # untied embedding + lm_head
    attn_layers, mamba_layers = pattern.count("*"), pattern.count("M")
    tp_divides = (c["num_attention_heads"], c["num_key_value_heads"], c["n_groups"], c["mamba_num_heads"])
    return ModuleDesc(
        key="language", kind="llm", params=int(total("params") + edge + h), expert_params=int(total("experts")),
        edge_params=edge, layers=len(pattern), hidden=h, out_hidden=h,
        linear_flops=total("flops"), attn_flops=total("attn"), head_flops=2.0 * h * V,
        act_bytes=total("act"), act_bytes_recompute=BF16 * h * len(pattern), logits_bytes=4.0 * V,
        tp_collectives=len(pattern), attn_layers=attn_layers, mamba_layers=mamba_layers,
        state_bytes=4 * c["mamba_num_heads"] * c["mamba_head_dim"] * c["ssm_state_size"],
        moe_layers=pattern.count("E"), topk=c.get("num_experts_per_tok", 0),
        kv_width=2 * c["num_key_value_heads"] * c["head_dim"], tp_divides=tp_divides)


def describe_vit(name: str, llm_hidden: int) -> ModuleDesc:
    c = encoders.encoder_config(name)
    h, L, ffn, p, s = c["hidden"], c["layers"], c["ffn"], c["patch"], c["pixel_shuffle"]
    patches = (c["tile"] // p) ** 2
    T = patches + c["prefix_tokens"]
    out = patches // (s * s)
    proj_in, proj_hidden = s * s * h, 4 * s * s * h  # models.multimodal: projector hidden = 4x its input
    proj_params = proj_in + proj_in * proj_hidden + proj_hidden * llm_hidden
    layer_params = 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h  # qkv/proj/fc1/fc2 with biases, 2 norms
    embed_params = 3 * p * p * h + h + c["pos_grid"] ** 2 * h + c["prefix_tokens"] * h
    # everything per *internal* token: patch embed and projector are rescaled from per-patch / per-output
    per_token = (L * 2 * (4 * h * h + 2 * h * ffn) + 2 * 3 * p * p * h * patches / T
                 + 2 * (proj_in * proj_hidden + proj_hidden * llm_hidden) * out / T)
    act_layer = BF16 * (6 * h + 2 * h + 2 * ffn)  # attention: norm/qkv in, q/k/v, out; MLP: norm/fc1 in, fc1/fc2 out
    return ModuleDesc(
        key="vision", kind="vit", params=int(L * layer_params + embed_params + proj_params), expert_params=0,
        edge_params=0, layers=L, hidden=h, out_hidden=llm_hidden, linear_flops=per_token,
        attn_flops=4.0 * h * L, head_flops=0.0,
        act_bytes=L * act_layer + BF16 * (proj_in + proj_hidden) * out / T,
        act_bytes_recompute=BF16 * h * L, logits_bytes=0.0, tp_collectives=2 * L, attn_layers=0,
        mamba_layers=0, state_bytes=0, moe_layers=0, topk=0, kv_width=2 * h, tp_divides=(c["heads"],),
        tokens_per_tile=T, out_per_tile=out, temporal_patch=c["temporal_patch"])


def describe_conformer(name: str, llm_hidden: int) -> ModuleDesc:
    c = encoders.encoder_config(name)
    h, L, K, sub, C = c["hidden"], c["layers"], c["conv_kernel"], c["subsampling"], c["subsampling_channels"]
    f = h * c["ff_expansion"]
    mel_fps = 1.0 / c["window_stride"]
    fps = mel_fps / sub
    # dw-striding: conv(1->C, 3x3, s2) then log2(sub)-1 x [depthwise 3x3 s2 + pointwise C->C], then linear
    stages = sub.bit_length() - 1
    pre, area = 0.0, c["n_mels"] * mel_fps  # (freq x time) positions per second before each stage
    for i in range(stages):
        area /= 4
        pre += 2 * area * C * 9 if i == 0 else 2 * area * C * (9 + C)
    pre += 2 * fps * (C * c["n_mels"] // sub) * h
    layer_params = 2 * (2 * h * f + f + h) + 4 * h * h + h * h + 2 * h * h + K * h + h * h + 10 * h
    proj_hidden = 4 * h  # models.multimodal: sound projector hidden = 4x the encoder width
    proj_params = h + h * proj_hidden + proj_hidden * llm_hidden
    sub_params = 9 * C + (stages - 1) * (9 * C + C * C) + C * c["n_mels"] // sub * h
    per_frame = (L * 2 * (2 * h * f + 4 * h * h + h * h + 2 * h * h + K * h + h * h)
                 + 2 * (h * proj_hidden + proj_hidden * llm_hidden))
    act_layer = BF16 * (2 * (2 * h + 2 * f) + 6 * h + 8 * h + 2 * h)  # 2 half FFNs, MHSA, conv module, norm
    return ModuleDesc(
        key="audio", kind="conformer", params=int(L * layer_params + proj_params + sub_params), expert_params=0,
        edge_params=0, layers=L, hidden=h, out_hidden=llm_hidden, linear_flops=per_frame, attn_flops=6.0 * h * L,
        head_flops=0.0, act_bytes=L * act_layer + BF16 * (h + proj_hidden), act_bytes_recompute=BF16 * h * L,
        logits_bytes=0.0, tp_collectives=4 * L, attn_layers=0, mamba_layers=0, state_bytes=0, moe_layers=0,
        topk=0, kv_width=2 * h, tp_divides=(c["heads"],), frames_per_second=fps, pre_flops_per_second=pre)


def describe_model(llm: str | dict, vision: str | None = None, audio: str | None = None, name: str = "") -> ModelDesc:
    """The ModelDesc of an LLM (models.configs name, or a checkpoint's config fields) with optional encoders
    (models.encoders names, `hf:` names included)."""
    lang = describe_llm(llm)
    mods = [lang]
    if vision:
        mods.insert(0, describe_vit(vision, lang.hidden))
    if audio:
        mods.insert(len(mods) - 1, describe_conformer(audio, lang.hidden))
    return ModelDesc(name or "+".join(filter(None, (vision, audio, llm if isinstance(llm, str) else "llm"))),
                     tuple(mods))
