"""Exact Hugging Face import/export for Nemotron-H (transformers' NemotronHForCausalLM key layout).

A local directory with config.json + *.safetensors is read as is (no hub, no remote code):
    backbone.embeddings.weight, backbone.norm_f.weight, lm_head.weight,
    backbone.layers.N.norm.weight and backbone.layers.N.mixer.* with, per layer kind,
      M: in_proj, conv1d.{weight,bias}, A_log, D, dt_bias, norm, out_proj
      *: {q,k,v,o}_proj          -: {up,down}_proj
      E: gate.weight, gate.e_score_correction_bias, experts.J.{up,down}_proj, shared_experts.{up,down}_proj

Import gives one (tp_rank, pp_rank, ep_rank) its shard of our HybridLM state dict; export merges the
shards of all ranks back. Both are pure tensor reshuffles (no communication), so a round trip is exact.
Layouts that differ from HF:
  - attention: megatron's fused linear_qkv interleaves per KV group [q heads of group g | k_g | v_g];
  - Mamba in_proj: rank-major blocks [z_r | x_r | B_r | C_r | dt_r] (see models/mamba2.py); conv1d
    channels [x_r | B_r | C_r];
  - MoE: experts are split over EP ranks, each expert's FFN over the expert-TP ranks;
  - vocabulary: embedding and lm_head get zero rows up to config.padded_vocab_size before TP sharding
    (models/hybrid_llm.py), and export strips them, so the HF side always has exactly vocab_size rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tessera.hetero.plan.layout import llm_sequence_parallel
from tessera.models.hybrid_llm import ATTENTION, MAMBA, MLP_SYMBOL, MOE, HybridConfig, hybrid_config, stage_layers

HF = "backbone.layers.{}."


def hybrid_config_from_hf(source: str | Path | dict, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                          dtype: torch.dtype = torch.float32, aux_loss_coeff: float = 0.0) -> HybridConfig:
    """Our config from a checkpoint dir's config.json or a dict of its fields (models/configs.py).
    transformers' own NemotronHConfig parses it, so legacy field names mean the same here as there.
    aux_loss_coeff > 0 adds megatron's sequence-level load-balancing loss (Megatron-Bridge's Nemotron-H
    providers: seq_aux_loss, 1e-4) to the aux-loss-free expert bias; 0 leaves the expert bias alone."""
    from transformers import NemotronHConfig

    if isinstance(source, dict):
        c = NemotronHConfig(**source)
    else:
        c = NemotronHConfig.from_pretrained(str(source))
    if c.moe_latent_size is not None:
        raise ValueError("MoE latent projections are not supported by HybridLM")
    # MTP layers (num_nextn_predict_layers) are not built: the main model's logits do not depend on them, and a
    # release's mtp.* tensors are carried unchanged into the export (models/released.CARRIED)
    if c.mlp_hidden_act != "relu2" or c.use_bias or c.mlp_bias or c.attention_bias or c.tie_word_embeddings:
        raise ValueError("HybridLM implements Nemotron-H as released: relu2, no biases, untied embeddings")
    moe = "E" in c.hybrid_override_pattern
    if moe and not c.norm_topk_prob and c.num_experts_per_tok > 1:
        raise ValueError("megatron's sigmoid router always renormalises top-k (norm_topk_prob=True)")
    fields = dict(
        hybrid_pattern=c.hybrid_override_pattern, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads,
        kv_channels=c.head_dim, ffn_hidden_size=c.intermediate_size, layernorm_epsilon=c.layer_norm_epsilon,
        mamba_num_heads=c.mamba_num_heads, mamba_head_dim=c.mamba_head_dim, mamba_num_groups=c.n_groups,
        mamba_state_dim=c.ssm_state_size, mamba_conv_kernel=c.conv_kernel, mamba_chunk_size=c.chunk_size,
        mamba_dt_min_clamp=c.time_step_min, init_method_std=c.initializer_range,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        context_parallel_size=cp, params_dtype=dtype, pipeline_dtype=dtype,
        sequence_parallel=llm_sequence_parallel(moe, tp),
    )
    layers = len(c.hybrid_override_pattern)
    if pp > 1 and layers % pp:
        # megatron splits num_layers // pp per stage; the remainder goes to the last stage.
        fields["num_layers_in_last_pipeline_stage"] = layers - (pp - 1) * (layers // pp)
    if moe:
        fields.update(
            num_moe_experts=c.n_routed_experts, moe_router_topk=c.num_experts_per_tok,
            moe_ffn_hidden_size=c.moe_intermediate_size,
            moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size * c.n_shared_experts,
            moe_router_topk_scaling_factor=float(c.routed_scaling_factor),
        )
        if aux_loss_coeff:
            fields.update(moe_aux_loss_coeff=float(aux_loss_coeff), moe_router_load_balancing_type="seq_aux_loss")
        if c.n_group > 1:
            fields.update(moe_router_num_groups=c.n_group, moe_router_group_topk=c.topk_group)
    return hybrid_config(**fields)


def safetensors_files(hf_dir: str | Path) -> list[Path]:
    """The checkpoint's *.safetensors files; with a model.safetensors.index.json, every shard it names must
    be there (a partial download otherwise loads as a model with missing weights), and each file must be as long
    as its header says (models/safetensors_header.py)."""
    d = Path(hf_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        import json

        named = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        absent = [n for n in named if not (d / n).is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names {len(named)} shard(s) but {len(absent)} "
                                    f"{'is' if len(absent) == 1 else 'are'} missing: {', '.join(absent[:8])}; "
                                    f"download the whole checkpoint")
    from tessera.models.safetensors_header import safetensors_problem

    broken = [p for p in map(safetensors_problem, files) if p]  # headers only: a cut-off file, named before launch
    if broken:
        raise ValueError(f"{len(broken)} of the {len(files)} *.safetensors file(s) in {hf_dir} "
                         f"{'is' if len(broken) == 1 else 'are'} not whole:\n" + "\n".join(f"  {b}" for b in broken))
    return files


def load_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of all *.safetensors shards in the directory."""
    state = {}
    for f in safetensors_files(hf_dir):
        state.update(load_file(str(f)))
    return state


class LazyCheckpoint(Mapping):
    """The tensors of a checkpoint directory's *.safetensors shards, each read from disk only when indexed
    (safetensors memory-maps the files). A rank importing its shard of a large checkpoint reads only the
    tensors its layout needs (its PP stage's layers, its EP rank's experts, the encoders it hosts) and holds
    its shards plus the one tensor being cut, never the whole model. `read` names the tensors read so far;
    `shape(k)` comes from the file header, without reading the tensor."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self._where, self.read = {}, set()
        for f in safetensors_files(hf_dir):
            handle = safe_open(str(f), framework="pt")
            self._where.update(dict.fromkeys(handle.keys(), handle))

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self._where[key].get_tensor(key)
        self.read.add(key)
        return tensor

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key].get_slice(key).get_shape())


class PrefixView(Mapping):
    """`base` restricted to the keys under `prefix`, with the prefix stripped; values read on access."""

    def __init__(self, base: Mapping, prefix: str):
        self.base, self.prefix = base, prefix
        self._keys = [k[len(prefix):] for k in base if k.startswith(prefix)]

    def __getitem__(self, key: str):
        return self.base[self.prefix + key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return self.prefix + key in self.base


# ---- layout helpers: every pair is (split for one rank, merge of all ranks) -----------------------

def mamba_parts(config: HybridConfig) -> list[int]:
    inner = config.mamba_num_heads * config.mamba_head_dim
    bc = config.mamba_num_groups * config.mamba_state_dim
    return [inner, inner, bc, bc, config.mamba_num_heads]  # z, x, B, C, dt


def _split_parts(t: torch.Tensor, parts: list[int], rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s 1/size of every part along dim 0, concatenated."""
    return torch.cat([p.chunk(size)[rank] for p in t.split(parts)])


def _merge_parts(shards: list[torch.Tensor], parts: list[int]) -> torch.Tensor:
    size = len(shards)
    per_rank = [s.split([p // size for p in parts]) for s in shards]
    return torch.cat([torch.cat([r[i] for r in per_rank]) for i in range(len(parts))])


def _qkv_fuse(q, k, v, config: HybridConfig) -> torch.Tensor:
    g, d = config.num_query_groups, config.kv_channels
    h = config.hidden_size
    per = config.num_attention_heads // g
    return torch.cat([q.view(g, per * d, h), k.view(g, d, h), v.view(g, d, h)], dim=1).reshape(-1, h)


def qkv_unfuse(w, config: HybridConfig):
    g, d = config.num_query_groups, config.kv_channels
    per = config.num_attention_heads // g
    q, k, v = w.view(g, (per + 2) * d, -1).split([per * d, d, d], dim=1)
    return q.reshape(-1, w.shape[-1]), k.reshape(-1, w.shape[-1]), v.reshape(-1, w.shape[-1])


def _rows(t, rank, size):
    # a copy, not a view: the full tensor (read from a checkpoint) is freed once its shard is cut
    return t.chunk(size, dim=0)[rank].clone() if size > 1 else t


def _cols(t, rank, size):
    return t.chunk(size, dim=1)[rank].clone() if size > 1 else t


def _pad_vocab(t: torch.Tensor, config: HybridConfig, name: str) -> torch.Tensor:
    """[vocab, h] -> [padded_vocab, h] with zero rows (what the TP shards are cut from)."""
    if t.shape[0] != config.vocab_size:
        raise ValueError(f"{name} has {t.shape[0]} rows but the config's vocab_size is {config.vocab_size}")
    extra = config.padded_vocab_size - config.vocab_size
    return torch.cat([t, t.new_zeros(extra, t.shape[1])]) if extra else t


def _strip_vocab(t: torch.Tensor, config: HybridConfig) -> torch.Tensor:
    """Merged [padded_vocab, h] -> [vocab, h]; a copy, so the file holds no padding storage."""
    return t[: config.vocab_size].clone() if t.shape[0] != config.vocab_size else t


# ---- import ---------------------------------------------------------------------------------------

def mamba_to_megatron(mixer: dict[str, torch.Tensor], config: HybridConfig, tp_rank: int = 0):
    """One NemotronHMamba2Mixer state dict (its own keys) -> this TP rank's Mamba2Mixer state dict."""
    tp, parts = config.tensor_model_parallel_size, mamba_parts(config)
    conv_parts = parts[1:4]  # conv1d runs over [x | B | C]
    out = {
        "in_proj.weight": _split_parts(mixer["in_proj.weight"], parts, tp_rank, tp),
        "conv1d_weight": _split_parts(mixer["conv1d.weight"][:, 0], conv_parts, tp_rank, tp),
        "conv1d_bias": _split_parts(mixer["conv1d.bias"], conv_parts, tp_rank, tp),
        "norm_weight": _rows(mixer["norm.weight"], tp_rank, tp),
        "out_proj.weight": _cols(mixer["out_proj.weight"], tp_rank, tp),
    }
    for name in ("A_log", "D", "dt_bias"):
        out[name] = _rows(mixer[name], tp_rank, tp)
    return out


def hf_to_megatron(hf: dict[str, torch.Tensor], config: HybridConfig, tp_rank: int = 0, pp_rank: int = 0,
                   ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """This rank's HybridLM state dict from a full HF state dict."""
    tp, ep = config.tensor_model_parallel_size, config.expert_model_parallel_size
    pp = config.pipeline_model_parallel_size
    etp = config.expert_tensor_parallel_size or tp
    etp_rank = tp_rank % etp
    out = {}
    if pp_rank == 0:
        emb = "backbone.embeddings.weight"
        out["embedding.weight"] = _rows(_pad_vocab(hf[emb], config, emb), tp_rank, tp)
    if pp_rank == pp - 1:
        out["final_norm.weight"] = hf["backbone.norm_f.weight"]
        out["output_layer.weight"] = _rows(_pad_vocab(hf["lm_head.weight"], config, "lm_head.weight"), tp_rank, tp)
    offset, symbols = stage_layers(config, pp_rank)
    for i, symbol in enumerate(symbols):
        src, dst = HF.format(offset + i), f"layers.{i}."
        m = src + "mixer."
        if symbol == MAMBA:
            out[dst + "norm.weight"] = hf[src + "norm.weight"]
            mixer = {k[len(m):]: hf[k] for k in hf if k.startswith(m)}  # keys first: reads only these
            out.update({dst + "mixer." + k: v for k, v in mamba_to_megatron(mixer, config, tp_rank).items()})
        elif symbol == ATTENTION:
            out[dst + "input_layernorm.weight"] = hf[src + "norm.weight"]
            qkv = _qkv_fuse(hf[m + "q_proj.weight"], hf[m + "k_proj.weight"], hf[m + "v_proj.weight"], config)
            out[dst + "self_attention.linear_qkv.weight"] = _rows(qkv, tp_rank, tp)
            out[dst + "self_attention.linear_proj.weight"] = _cols(hf[m + "o_proj.weight"], tp_rank, tp)
        elif symbol == MLP_SYMBOL:
            out[dst + "pre_mlp_layernorm.weight"] = hf[src + "norm.weight"]
            out[dst + "mlp.linear_fc1.weight"] = _rows(hf[m + "up_proj.weight"], tp_rank, tp)
            out[dst + "mlp.linear_fc2.weight"] = _cols(hf[m + "down_proj.weight"], tp_rank, tp)
        elif symbol == MOE:
            out[dst + "pre_mlp_layernorm.weight"] = hf[src + "norm.weight"]
            out[dst + "mlp.router.weight"] = hf[m + "gate.weight"]
            out[dst + "mlp.router.expert_bias"] = hf[m + "gate.e_score_correction_bias"].float()
            # the layer's dense tensors first, then its routed experts: a seeded source (SeededState) builds
            # each routed expert as a unit of its own, so the dense unit is built once per layer
            s, o = m + "shared_experts.", dst + "mlp.shared_experts."
            out[o + "linear_fc1.weight"] = _rows(hf[s + "up_proj.weight"], tp_rank, tp)
            out[o + "linear_fc2.weight"] = _cols(hf[s + "down_proj.weight"], tp_rank, tp)
            local = config.num_moe_experts // ep
            for j in range(local):
                e, o = f"{m}experts.{ep_rank * local + j}.", f"{dst}mlp.experts.local_experts.{j}."
                out[o + "linear_fc1.weight"] = _rows(hf[e + "up_proj.weight"], etp_rank, etp)
                out[o + "linear_fc2.weight"] = _cols(hf[e + "down_proj.weight"], etp_rank, etp)
    return out


def load_into(model, hf: dict[str, torch.Tensor], tp_rank: int, pp_rank: int, ep_rank: int = 0):
    """Copy this rank's shard into `model`; every parameter and buffer must be covered, nothing extra."""
    shard = hf_to_megatron(hf, model.config, tp_rank, pp_rank, ep_rank)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = sorted(set(own) - set(shard)), sorted(set(shard) - set(own))
    if missing or unexpected:
        raise KeyError(f"HF import mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, v in shard.items():
        if own[k].shape != v.shape:
            raise ValueError(f"{k}: ours {tuple(own[k].shape)} vs HF shard {tuple(v.shape)}")
    model.load_state_dict(shard, strict=False)


# ---- export ---------------------------------------------------------------------------------------

def layer_to_hf(symbol: str, shard, src: str, dst: str, config: HybridConfig) -> dict[str, torch.Tensor]:
    """One hybrid layer's HF tensors (keys under `dst`) from its megatron tensors (keys under `src`) in every
    rank's stage state dict: shard(tp_rank, ep_rank) -> that rank's dict."""
    tp, ep = config.tensor_model_parallel_size, config.expert_model_parallel_size
    etp = config.expert_tensor_parallel_size or tp
    first, m, hf = shard(0, 0), dst + "mixer.", {}

    def tps(key):
        return [shard(r, 0)[key] for r in range(tp)]

    if symbol == MAMBA:
        mx, parts = src + "mixer.", mamba_parts(config)
        hf[dst + "norm.weight"] = first[src + "norm.weight"]
        hf[m + "in_proj.weight"] = _merge_parts(tps(mx + "in_proj.weight"), parts)
        hf[m + "conv1d.weight"] = _merge_parts(tps(mx + "conv1d_weight"), parts[1:4])[:, None]
        hf[m + "conv1d.bias"] = _merge_parts(tps(mx + "conv1d_bias"), parts[1:4])
        for name in ("A_log", "D", "dt_bias"):
            hf[m + name] = torch.cat(tps(mx + name))
        hf[m + "norm.weight"] = torch.cat(tps(mx + "norm_weight"))
        hf[m + "out_proj.weight"] = torch.cat(tps(mx + "out_proj.weight"), dim=1)
    elif symbol == ATTENTION:
        hf[dst + "norm.weight"] = first[src + "input_layernorm.weight"]
        q, k, v = qkv_unfuse(torch.cat(tps(src + "self_attention.linear_qkv.weight")), config)
        hf[m + "q_proj.weight"], hf[m + "k_proj.weight"], hf[m + "v_proj.weight"] = q, k, v
        hf[m + "o_proj.weight"] = torch.cat(tps(src + "self_attention.linear_proj.weight"), dim=1)
    elif symbol == MLP_SYMBOL:
        hf[dst + "norm.weight"] = first[src + "pre_mlp_layernorm.weight"]
        hf[m + "up_proj.weight"] = torch.cat(tps(src + "mlp.linear_fc1.weight"))
        hf[m + "down_proj.weight"] = torch.cat(tps(src + "mlp.linear_fc2.weight"), dim=1)
    elif symbol == MOE:
        hf[dst + "norm.weight"] = first[src + "pre_mlp_layernorm.weight"]
        hf[m + "gate.weight"] = first[src + "mlp.router.weight"]
        hf[m + "gate.e_score_correction_bias"] = first[src + "mlp.router.expert_bias"]
        local = config.num_moe_experts // ep
        for ep_rank in range(ep):
            for j in range(local):
                o = f"{src}mlp.experts.local_experts.{j}."
                # expert-TP rank r lives on every tp rank with tp_rank % etp == r; take the first.
                up = torch.cat([shard(r, ep_rank)[o + "linear_fc1.weight"] for r in range(etp)])
                down = torch.cat([shard(r, ep_rank)[o + "linear_fc2.weight"] for r in range(etp)], 1)
                hf.update(expert_to_hf(f"{m}experts.{ep_rank * local + j}.", up, down))
        s = src + "mlp.shared_experts."
        hf[m + "shared_experts.up_proj.weight"] = torch.cat(tps(s + "linear_fc1.weight"))
        hf[m + "shared_experts.down_proj.weight"] = torch.cat(tps(s + "linear_fc2.weight"), 1)
    return hf


def expert_to_hf(prefix: str, fc1: torch.Tensor, fc2: torch.Tensor) -> dict[str, torch.Tensor]:
    """A routed expert's HF tensors (`prefix` = ...mixer.experts.<global id>.) from its full fc1/fc2."""
    return {prefix + "up_proj.weight": fc1, prefix + "down_proj.weight": fc2}


def embedding_to_hf(tp_shards: list[torch.Tensor], config: HybridConfig) -> dict[str, torch.Tensor]:
    """The embedding's HF tensor from its TP shards (vocabulary padding stripped)."""
    return {"backbone.embeddings.weight": _strip_vocab(torch.cat(tp_shards), config)}


def head_to_hf(final_norm: torch.Tensor, output_tp_shards: list[torch.Tensor],
               config: HybridConfig) -> dict[str, torch.Tensor]:
    """The final norm's and output layer's HF tensors (vocabulary padding stripped)."""
    return {"backbone.norm_f.weight": final_norm,
            "lm_head.weight": _strip_vocab(torch.cat(output_tp_shards), config)}


def megatron_to_hf(shards: dict[tuple[int, int, int], dict[str, torch.Tensor]],
                   config: HybridConfig) -> dict[str, torch.Tensor]:
    """Full HF state dict from every rank's state dict, keyed by (tp_rank, pp_rank, ep_rank)."""
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size

    def tps(pp_rank, key):
        return [shards[(r, pp_rank, 0)][key] for r in range(tp)]

    hf = embedding_to_hf(tps(0, "embedding.weight"), config)
    hf.update(head_to_hf(shards[(0, pp - 1, 0)]["final_norm.weight"], tps(pp - 1, "output_layer.weight"), config))
    for pp_rank in range(pp):
        offset, symbols = stage_layers(config, pp_rank)
        for i, symbol in enumerate(symbols):
            hf.update(layer_to_hf(symbol, lambda tp_rank, ep_rank: shards[(tp_rank, pp_rank, ep_rank)],
                                  f"layers.{i}.", HF.format(offset + i), config))
    return {k: v.contiguous() for k, v in hf.items()}


def save_hf(hf: dict[str, torch.Tensor], hf_config_dir: str | Path, out_dir: str | Path):
    """Write model.safetensors plus the source config.json, the layout transformers' loader reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(hf_config_dir) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config, indent=2))
