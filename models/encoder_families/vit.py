"""What the ViT families (RADIO, SigLIP, and any ViT a user adds) share: models/vision.VisionTransformer on megatron
layers (TP, token CP and PP), the data side's tile/patch/pixel-shuffle count, the planner's cost, and the
checkpoint conversion of megatron's layer layout to a transformers-style one. A ViT family says what differs: its
checkpoint names (layer_root, layer_names, embed_keys, fused_qkv), whether its patch embedding has a bias, and any
tensors outside the layers it checks or writes (extra_import / extra_export).

QKV: HF stores [q; k; v] (all heads each); megatron's linear_qkv stores per head [q_h; k_h; v_h], so a TP rank's
contiguous row block holds whole heads. Column-parallel rows and row-parallel columns split evenly; biases of
row-parallel linears, norms and layer scales are replicated. import_tensors(..., tp_rank, tp) gives one rank's
shard, export_tensors([shard per tp rank]) merges them back, bit-exactly.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from tessera.models.encoder_families.base import BF16, EncoderFamily


# megatron layer suffix -> split kind (col / row / None); a family maps each suffix to its own name (layer_names)
LAYER_SPLITS = {"input_layernorm": None, "self_attention.linear_proj": "row", "pre_mlp_layernorm": None,
                "mlp.linear_fc1": "col", "mlp.linear_fc2": "row"}
# our layer scales (the bda modules of models/vision.py) -> the checkpoint's suffix is the family's (layer_scales)
LAYER_SCALES = ("self_attn_bda.lambda1", "mlp_bda.lambda1")


@dataclass
class ViTConfig:
    """The fields every ViT family has (models/vision.py reads them)."""

    patch: int            # patch side in pixels
    hidden: int
    layers: int
    heads: int
    ffn: int
    eps: float            # LayerNorm epsilon
    act: str              # models/vision.ACTIVATIONS key
    prefix_tokens: int    # cls/register tokens before the patches, dropped from the output
    pos_grid: int         # side of the learned position table's patch grid
    pos_interp: str       # F.interpolate mode resampling it to an input's grid
    pos_resize: str       # "cpe" (RADIO: square of the longer side, top-left window) or "plain"
    tile: int             # tile side in pixels (the data side's tiling)
    pixel_shuffle: int    # tokens merged per side after the tower
    temporal_patch: int   # frames a video tubelet fuses (0: no tubelet embedder)
    mean: tuple           # per-channel pixel statistics of the preprocessing
    std: tuple
    projector_hidden: int | None  # the projector's hidden width; None = 4x its input
    final_norm: bool      # a LayerNorm after the last layer
    layer_scale: float | None  # per-channel scales on both residual branches (initial value); None: none


def head_major(t, heads: int):
    """[q; k; v] -> per head [q_h; k_h; v_h] (weight [3D, D] or bias [3D])."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def qkv_major(t, heads: int):
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


class TensorReader:
    """Checkpoint tensors read by name; remembers what was read so that a tensor nobody reads can be named."""

    def __init__(self, hf, cfg: ViTConfig, missing_hint=lambda key: ""):
        self.hf, self.read, self.owner = hf, set(), f"encoder {cfg.name or cfg.family!r}"
        self.missing_hint = missing_hint

    def __call__(self, key: str):
        if key not in self.hf:
            raise KeyError(f"{key} is missing from the checkpoint ({self.owner} has that tensor"
                           f"{self.missing_hint(key)})")
        self.read.add(key)
        return self.hf[key]


class ViTFamily(EncoderFamily):
    """A vision family on models/vision.VisionTransformer; subclasses set the checkpoint layout below."""

    modality = "vision"
    tensor_parallel = context_parallel = pipeline_parallel = True
    patch_bias = False       # the patch embedding has a bias (SigLIP's Conv2d)
    fused_qkv = True         # the checkpoint stores one qkv linear per layer (else q_proj, k_proj, v_proj)
    qkv_name = "attn.qkv"    # its name (fused), or the prefix of {q,k,v}_proj: e.g. "self_attn."
    layer_names: dict[str, str]   # LAYER_SPLITS suffix -> the checkpoint's layer suffix
    layer_scales = ("layer_scale1.lambda1", "layer_scale2.lambda1")  # checkpoint suffixes of LAYER_SCALES
    tower_roots: tuple[str, ...]  # prefixes of every checkpoint tensor this tower owns (unread ones are refused)

    @abc.abstractmethod
    def layer_root(self, i: int) -> str:
        """The checkpoint prefix of layer i."""

    @abc.abstractmethod
    def embed_keys(self, cfg: ViTConfig) -> dict[str, str]:
        """Our names -> checkpoint names of the tower's tensors outside its layers, those this config has."""

    def import_embed(self, cfg: ViTConfig, out: dict) -> None:
        """Reshape the embed tensors read as stored into ours, in place (a Conv2d patch embedding, ...)."""

    def export_embed(self, cfg: ViTConfig, out: dict) -> None:
        """The inverse of import_embed on the checkpoint tensors, in place."""

    def extra_import(self, cfg: ViTConfig, take: TensorReader) -> None:
        """Read and check the tower's non-parameter tensors (buffers the config fixes)."""

    def extra_export(self, cfg: ViTConfig) -> dict:
        """The tower's non-parameter tensors as the config fixes them."""
        return {}

    def missing_hint(self, key: str) -> str:
        """What to change when checkpoint tensor `key` is missing (appended to the KeyError)."""
        return ""

    # -- model -----------------------------------------------------------------------------------------------
    def build(self, cfg, pg_collection, *, recompute="none", core_attention=None):
        from tessera.models.vision import VisionEncoder, VisionTransformer

        return VisionEncoder(VisionTransformer(cfg, pg_collection, recompute=recompute, core_attention=core_attention))

    def preprocessor(self, cfg):
        from tessera.models.vision import PixelNormalize

        return PixelNormalize(cfg.mean, cfg.std)

    def tokens(self, cfg):
        from tessera.models.media_tokens import EncoderTokens

        return EncoderTokens(tile=cfg.tile, patch=cfg.patch, pixel_shuffle=cfg.pixel_shuffle)

    def video_temporal_patch(self, cfg):
        return cfg.temporal_patch or 0

    def planner_fields(self, cfg, llm_hidden):
        c = cfg
        h, L, ffn, p, s = c.hidden, c.layers, c.ffn, c.patch, c.pixel_shuffle
        tokens = self.tokens(c)  # the data side's token arithmetic (models/media_tokens.EncoderTokens)
        patches, out = tokens.patches_per_tile, tokens.tokens_per_tile
        T = patches + c.prefix_tokens
        proj_in, proj_hidden = s * s * h, c.projector_hidden or 4 * s * s * h  # models.multimodal's default
        proj_params = proj_in + proj_in * proj_hidden + proj_hidden * llm_hidden
        scale = c.layer_scale is not None
        temporal = self.video_temporal_patch(c)
        # TP splits qkv/proj/fc1/fc2 weights and the column-parallel (qkv, fc1) biases; the rest is replicated
        sharded = 4 * h * h + 2 * h * ffn + 3 * h + ffn
        layer_params = sharded + h + h + 4 * h + 2 * h * scale  # + proj/fc2 biases, 2 LayerNorms, layer scales
        embed_params = (3 * p * p * h + h * self.patch_bias + c.pos_grid ** 2 * h + c.prefix_tokens * h
                        + temporal * 3 * p * p * h + 2 * h * c.final_norm)
        params = L * layer_params + embed_params + proj_params
        # per internal token the layers; the patch embed per patch and frame, the projector per output token
        # (flops.vit_sequence_flops puts them together for any grid)
        per_token = L * 2 * (4 * h * h + 2 * h * ffn)
        rep, act = (12 if scale else 8) * h, 10 * h + 4 * ffn  # LN in/out (and layer-scale inputs) | qkv, out x2, fc
        return dict(
            key="vision", kind="vit", params=int(params), replicated_params=int(params - L * sharded),
            expert_params=0, edge_params=0, layers=L, hidden=h, out_hidden=llm_hidden, linear_flops=per_token,
            embed_flops=2.0 * 3 * p * p * h, out_flops=2.0 * (proj_in * proj_hidden + proj_hidden * llm_hidden),
            prefix_tokens=c.prefix_tokens, pixel_shuffle=s,
            attn_flops=4.0 * h * L, head_flops=0.0, act_bytes=L * act, act_replicated=L * rep, act_unsplit=0.0,
            act_bytes_recompute=BF16 * h * L, act_peak=(("L", rep, act, 0.0),),
            act_edge=BF16 * (3 * p * p * patches + 2 * (proj_in + proj_hidden) * out) / T,
            logits_bytes=0.0, tp_collectives=2 * L, attn_layers=0,
            mamba_layers=0, state_bytes=0, moe_layers=0, topk=0, kv_width=2 * h, tp_divides=(c.heads,),
            tokens_per_tile=T, out_per_tile=out, temporal_patch=temporal,
            cp_split="tokens" if self.context_parallel else "items")

    # -- checkpoints -----------------------------------------------------------------------------------------
    def checkpoint_module(self, encoder):
        return encoder.vit

    def _qkv_names(self, root: str, kind: str) -> list[str]:
        if self.fused_qkv:
            return [f"{root}{self.qkv_name}.{kind}"]
        return [f"{root}{self.qkv_name}{x}_proj.{kind}" for x in "qkv"]

    def import_tensors(self, cfg, hf, module_keys=None, tp_rank=0, tp=1):
        """Every tensor the config's tower has must be there and every tower tensor in `hf` must be read (else
        KeyError naming it); module_keys is not needed (the config fixes the tower's tensors)."""
        import torch

        heads = cfg.heads
        take, out = TensorReader(hf, cfg, self.missing_hint), {}
        for ours, theirs in self.embed_keys(cfg).items():
            out[ours] = take(theirs)
        self.import_embed(cfg, out)
        self.extra_import(cfg, take)
        for i in range(cfg.layers):
            root, mine = self.layer_root(i), f"layers.{i}."
            for kind in ("weight", "bias"):
                qkv = torch.cat([take(k) for k in self._qkv_names(root, kind)])
                out[f"{mine}self_attention.linear_qkv.{kind}"] = head_major(qkv, heads).chunk(tp)[tp_rank]
                for ours, split in LAYER_SPLITS.items():
                    t = take(f"{root}{self.layer_names[ours]}.{kind}")
                    if split == "col" or (split == "row" and kind == "weight"):
                        t = t.chunk(tp, dim=0 if split == "col" else 1)[tp_rank]
                    out[f"{mine}{ours}.{kind}"] = t
            if cfg.layer_scale is not None:  # [hidden], replicated on every TP rank
                for ours, theirs in zip(LAYER_SCALES, self.layer_scales):
                    out[mine + ours] = take(root + theirs)
        left = sorted(k for k in hf if k.startswith(self.tower_roots) and k not in take.read)
        if left:
            raise KeyError(f"checkpoint tensors {left[:8]}{' ...' if len(left) > 8 else ''} have no place in "
                           f"{take.owner} (final_norm={cfg.final_norm}, layer_scale={cfg.layer_scale})")
        return {k: v.clone() for k, v in out.items()}

    def export_tensors(self, cfg, shards):
        import torch

        heads, first = cfg.heads, shards[0]
        out = {theirs: first[ours] for ours, theirs in self.embed_keys(cfg).items()}
        self.export_embed(cfg, out)
        out.update(self.extra_export(cfg))
        for i in range(cfg.layers):
            root, mine = self.layer_root(i), f"layers.{i}."
            for kind in ("weight", "bias"):
                qkv = qkv_major(torch.cat([s[f"{mine}self_attention.linear_qkv.{kind}"] for s in shards]), heads)
                names = self._qkv_names(root, kind)
                out.update(zip(names, qkv.chunk(len(names))))
                for ours, split in LAYER_SPLITS.items():
                    parts = [s[f"{mine}{ours}.{kind}"] for s in shards]
                    if split == "col" or (split == "row" and kind == "weight"):
                        t = torch.cat(parts, dim=0 if split == "col" else 1)
                    else:
                        t = parts[0]
                    out[f"{root}{self.layer_names[ours]}.{kind}"] = t
            if cfg.layer_scale is not None:  # replicated: every rank holds the same tensor
                for ours, theirs in zip(LAYER_SCALES, self.layer_scales):
                    out[root + theirs] = first[mine + ours]
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    def lora_targets(self, cfg, name, b):
        """A fused qkv's rows reordered from megatron's per-head [q_h; k_h; v_h] to the checkpoint's [q; k; v] as
        the weight is, so that W_hf + (alpha/r) B_hf A is the merged export."""
        _, i, suffix = name.split(".", 2)
        root = self.layer_root(int(i))
        if suffix == "self_attention.linear_qkv":
            names = [n.rpartition(".")[0] for n in self._qkv_names(root, "weight")]
            return list(zip(names, qkv_major(b, cfg.heads).chunk(len(names))))
        return [(root + self.layer_names[suffix], b)]
