"""Vision encoders: a ViT on megatron-core transformer layers, pixel shuffle, and the MLP projector.

One ViT class serves the ViT families (models/encoder_families/vit.py: radio.py, siglip.py); they differ only in
data and in whether the patch embedding has a bias (the family's patch_bias):
    radio   linear patch embedding without bias, `prefix_tokens` cls/register tokens (dropped from the
            output), LayerNorm eps 1e-6, exact GELU, 128x128 learned position table, per-channel layer
            scales on both residual branches (RadioLayer's layer_scale{1,2}), no final norm unless the
            config asks for the Omni model's `vision_final_layernorm` (`final_norm`).
    siglip  conv patch embedding with bias (stored here as the equivalent linear over flattened patches),
            no prefix tokens, tanh-GELU, position table of its training grid (27x27 for so400m/384),
            final LayerNorm (SigLIP's post_layernorm), no layer scale.
The position table is interpolated to each input's patch grid (RADIO: CPE square resize + window, see
VisionTransformer.position_embedding), so any H, W that are multiples of the patch size work (dynamic
resolution); tiles are one fixed size in practice.

Layers are megatron TransformerLayers with the local spec: ColumnParallelLinear QKV/FC1 and
RowParallelLinear proj/FC2 shard over the injected TP group (pg_collection.tp); everything before and
after the layers is replicated across TP ranks. Attention is bidirectional.

    vit = VisionTransformer(encoder_config("radio_vit_tiny"), pg_collection)
    enc = VisionEncoder(vit)                      # uint8 tiles -> pixel-shuffled tokens
    tokens = enc(tiles)                           # [tiles * tokens_per_tile, hidden * shuffle**2]
    proj = Projector(enc.out_dim, 4 * 1280, llm_hidden)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch import nn

from tessera.models.encoder_families.base import family_of
from tessera.models.recompute import megatron_fields, run_layers

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


@dataclass
class TileSeqParams(PackedSeqParams):
    """megatron's packed_seq_params channel for tokens of many tiles flattened into one [T, 1] sequence (the
    vision encoder under context parallelism, models/vision_cp.py; SelfAttention hands it to its core
    attention untouched when qkv_format is not "thd").

    query_slices: per tile, the [start, stop) rows of its queries in this rank's sequence (tiles contiguous,
        in order); key_index: per tile, the rows of its keys/values in the key sequence (on one device this
        rank's own; under CP every rank's sequences gathered rank after rank); counts: every CP rank's
        sequence length (the gathers' row counts)."""

    qkv_format: str = "sbhd"
    query_slices: tuple = ()
    key_index: tuple = ()
    counts: tuple = ()


def tile_attention(query, keys, values, params: TileSeqParams, scale) -> torch.Tensor:
    """Bidirectional attention of each tile's queries over that tile's keys only (patches of different
    tiles never attend to each other). query [T, 1, heads, d]; keys/values [T_keys, 1, heads, d] -> [T, 1,
    heads * d]."""
    outs = []
    for (start, stop), index in zip(params.query_slices, params.key_index):
        q = query[start:stop, 0].transpose(0, 1)[None]  # [1, heads, n, d]
        k, v = (t[index, 0].transpose(0, 1)[None] for t in (keys, values))
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1).flatten(1))
    out = torch.cat(outs) if outs else query.new_zeros(0, query.shape[2] * query.shape[3])
    end = params.query_slices[-1][1] if params.query_slices else 0
    if end != query.shape[0]:
        raise ValueError(f"tile attention: the tiles' query rows end at {end}, the sequence has {query.shape[0]}")
    return out[:, None]


class BidirectionalCoreAttention(MegatronModule):
    """softmax(QK^T/sqrt(d))V over all tokens of an image, on megatron's [s, b, heads, dim] layout.

    megatron's local DotProductAttention forks the CUDA RNG tracker per call and materialises the scores;
    SDPA does neither. Dropout is off in every ViT we load, so no RNG tracker is needed. With TileSeqParams
    the sequence is many tiles flattened (b = 1), each attending within itself; a context-parallel class
    (hetero/parallel/cp_tile_attention.py) plugs in through `vit_layer_spec(core_attention=...)`."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", cp_comm_type=None,
                 softmax_scale=None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.no_mask:
            raise ValueError(f"vision attention is bidirectional (no_mask), got {attn_mask_type}")
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, *, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if isinstance(packed_seq_params, TileSeqParams) and attention_bias is None:
            return tile_attention(query, key, value, packed_seq_params, self.softmax_scale)
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("vision attention takes whole images [s, b, h, d] (or TileSeqParams), no bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def vit_transformer_config(cfg, tp: int = 1, dtype: torch.dtype = torch.float32,
                           recompute: str = "none") -> TransformerConfig:
    """recompute: "none" | "selective" | "full" (models/recompute.py), as megatron's recompute fields."""
    return TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        ffn_hidden_size=cfg.ffn, normalization="LayerNorm", layernorm_epsilon=cfg.eps,
        add_bias_linear=True, add_qkv_bias=True, gated_linear_unit=False, activation_func=ACTIVATIONS[cfg.act],
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, params_dtype=dtype, pipeline_dtype=dtype, **megatron_fields(recompute),
    )


class LayerScaleBiasDropoutAdd(nn.Module):
    """A TransformerLayer's bias-dropout-add with a learned per-channel scale on the branch output:
    residual + dropout((x + bias) * lambda1), transformers' RadioLayer order (o_proj/fc2 output with its bias,
    times layer_scale.lambda1, then the residual add).

    Megatron has no layer scale, but calls its bda spec as `bda(training, fused)(x_with_bias, residual, p)`, so a
    module in that slot carries the parameter: `layers.N.self_attn_bda.lambda1` / `layers.N.mlp_bda.lambda1`.
    Under TP the branch output is already all-reduced by the row-parallel linear (full hidden on every rank),
    so lambda1 is a replicated [hidden] parameter like the LayerNorm weights: every rank holds all of it and
    computes the same gradient."""

    def __init__(self, hidden_size: int, init_value: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.lambda1 = nn.Parameter(torch.full((hidden_size,), float(init_value), dtype=dtype))

    def forward(self, training: bool, fused: bool):
        bda = get_bias_dropout_add(training, fused)

        def scaled_bda(x_with_bias, residual, prob):
            x, bias = x_with_bias
            x = x if bias is None else x + bias  # the bias is inside the scaled branch, as in nn.Linear
            return bda((x * self.lambda1, None), residual, prob)

        return scaled_bda


def vit_layer_spec(cfg, dtype: torch.dtype = torch.float32, core_attention=None) -> ModuleSpec:
    """Pre-norm attention + pre-norm MLP, both from megatron's local backend; with cfg.layer_scale set, both
    residual adds scale their branch per channel (LayerScaleBiasDropoutAdd, initialised to that value).
    core_attention: the core attention class (BidirectionalCoreAttention; a context-parallel one is injected)."""
    backend = LocalSpecProvider()
    column, row = backend.column_parallel_linear(), backend.row_parallel_linear()
    scale = cfg.layer_scale
    bda = get_bias_dropout_add if scale is None else ModuleSpec(
        module=LayerScaleBiasDropoutAdd, params={"hidden_size": cfg.hidden, "init_value": scale, "dtype": dtype})
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(linear_qkv=column, core_attention=core_attention or BidirectionalCoreAttention,
                                                   linear_proj=row),
            ),
            self_attn_bda=bda,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
            mlp_bda=bda,
        ),
    )


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[n, c, H, W] -> [n, (H/p)(W/p), c*p*p], patches row-major, each patch channel-major (c, y, x):
    the flattening of a Conv2d(kernel=stride=p) weight, so conv and linear embedders share one layout."""
    n, c, h, w = pixels.shape
    x = pixels.reshape(n, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(n, (h // patch) * (w // patch), c * patch * patch)


def vit_stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """Global indices of the ViT layers of pipeline stage `stage` of `pp`: megatron's even split, n // pp
    per stage, the remainder on the last stage."""
    per = n_layers // pp
    if per == 0:
        raise ValueError(f"the vision encoder has {n_layers} layers: it cannot split over pp{pp} stages "
                         f"(at most pp{n_layers})")
    start = stage * per
    return range(start, n_layers if stage == pp - 1 else start + per)


class VisionTransformer(MegatronModule):
    """Normalised pixels [n, 3, H, W] -> patch features [n, H/p, W/p, hidden] (prefix tokens dropped).

    Context parallelism (pg_collection.cp of size > 1): models/vision_cp.py runs the same pieces on this rank's
    part of the tokens. Pipeline stages (pg_collection.pp of size > 1): the tower is that function cut at layer
    boundaries.
    Stage 0 holds the embedder, position table, prefix tokens (and video embedder), every stage its layers
    (vit_stage_layers), the last stage the final norm; `embed`, `run_stage_layers` and `head` are the pieces."""

    def __init__(self, cfg, pg_collection, dtype: torch.dtype = torch.float32, recompute: str = "none",
                 core_attention=None):
        config = vit_transformer_config(cfg, pg_collection.tp.size(), dtype, recompute)
        super().__init__(config=config)
        self.cfg = cfg
        d, p = cfg.hidden, cfg.patch
        pp_group = getattr(pg_collection, "pp", None)
        self.pp = pp_group.size() if pp_group is not None else 1
        self.stage = pp_group.rank() if pp_group is not None else 0
        self.first_stage, self.last_stage = self.stage == 0, self.stage == self.pp - 1
        # context parallelism (models/vision_cp.py): this rank computes its part of every row's tokens; the
        # injected core attention gathers keys/values over pg_collection.cp
        cp_group = getattr(pg_collection, "cp", None)
        self.cp = cp_group.size() if cp_group is not None else 1
        self.cp_rank = cp_group.rank() if cp_group is not None else 0
        if self.cp > 1 and self.pp > 1:
            raise ValueError(f"vision encoder cp{self.cp} x pp{self.pp}: context parallelism runs the tower as one "
                             f"pipeline stage; use cp or pp for the vision encoder, not both")
        self.layer_ids = vit_stage_layers(cfg.layers, self.pp, self.stage)
        self.embedder = self.pos_embed = self.prefix = self.video_embedder = self.final_norm = None
        if self.first_stage:
            self.embedder = nn.Linear(3 * p * p, d, bias=family_of(cfg).patch_bias, dtype=dtype)
            self.pos_embed = nn.Parameter(0.02 * torch.randn(1, cfg.pos_grid ** 2, d, dtype=dtype))
            self.prefix = nn.Parameter(0.02 * torch.randn(cfg.prefix_tokens, d, dtype=dtype)) \
                if cfg.prefix_tokens else None
            # Video tubelets: one linear over temporal_patch frames' patches, a Conv3D(kernel=stride) in effect.
            t = cfg.temporal_patch
            self.video_embedder = nn.Linear(t * 3 * p * p, d, bias=False, dtype=dtype) if t else None
        spec = vit_layer_spec(cfg, dtype, core_attention)
        built = [(i, build_module(spec, config=config, layer_number=i + 1, pg_collection=pg_collection))
                 for i in self.layer_ids]
        # one stage: a ModuleList (layers.N); a pipeline stage keys its layers by their *global* index, so its
        # state dict names (layers.N.*) are the single-stage ones and checkpoints stay layout-free
        self.layers = nn.ModuleList(m for _, m in built) if self.pp == 1 else \
            nn.ModuleDict({str(i): m for i, m in built})
        # RadioModel ends at its last block; a final LayerNorm exists for SigLIP (post_layernorm) and, for RADIO,
        # only where NemotronH_Omni_Reasoning_V3 builds `vision_final_layernorm` (LLM with MTP layers).
        if self.last_stage and cfg.final_norm:
            self.final_norm = nn.LayerNorm(d, eps=cfg.eps, dtype=dtype)

    def position_embedding(self, rows: int, cols: int) -> torch.Tensor:
        """The learned table resampled to a rows x cols patch grid: [1, rows*cols, hidden].

        pos_resize "cpe" (RADIO's cropped position embedding, eval rule of transformers' RadioPatchEmbeddings):
        resize to a square of the longer side, then take the top-left rows x cols window, so a 3x5 grid sees
        the same positions as the top 3 rows of a 5x5 one. A plain resize to (rows, cols) would stretch the
        table anisotropically and give non-square grids other positions than RADIO was trained with.
        transformers has no training-mode branch (NVlabs' random crop/scale CPE is not applied), so neither
        do we: train and eval use this deterministic rule.
        "plain" (SigLIP): resize straight to (rows, cols), as transformers' interpolate_pos_encoding."""
        g = self.cfg.pos_grid
        if (rows, cols) == (g, g):
            return self.pos_embed
        cpe = self.cfg.pos_resize == "cpe"
        size = (max(rows, cols),) * 2 if cpe else (rows, cols)
        table = self.pos_embed.reshape(1, g, g, -1).permute(0, 3, 1, 2)
        table = F.interpolate(table.float(), size=size, mode=self.cfg.pos_interp, align_corners=False)
        table = table[:, :, :rows, :cols]  # the CPE window (a no-op for "plain")
        return table.to(self.pos_embed.dtype).permute(0, 2, 3, 1).reshape(1, rows * cols, -1)

    def patch_embedder(self, channels: int) -> nn.Module:
        """The linear that embeds a tile's patches: the image embedder for 3 channels, the video embedder for a
        video tubelet's t*3 (its frames stacked along the channels, models/video.VideoEncoder.tiles)."""
        return self.embedder if channels == 3 else self.video_embedder

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """First stage: pixels [n, c, H, W] -> the layers' input [n, prefix + patches, hidden] (patch embedding,
        position embedding, prefix tokens); c = 3, or t*3 for video tubelets (patch_embedder)."""
        if not self.first_stage:
            raise RuntimeError(f"vision pipeline stage {self.stage} has no embedding (stage 0 has)")
        p = self.cfg.patch
        rows, cols = pixels.shape[-2] // p, pixels.shape[-1] // p
        if pixels.shape[-2] % p or pixels.shape[-1] % p:
            raise ValueError(f"image {tuple(pixels.shape[-2:])} is not a multiple of the patch size {p}")
        x = self.patch_embedder(pixels.shape[1])(patchify(pixels, p))
        x = x + self.position_embedding(rows, cols)
        if self.prefix is not None:
            x = torch.cat([self.prefix.expand(x.shape[0], -1, -1), x], dim=1)
        return x

    def run_stage_layers(self, hidden: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
        """This stage's layers on megatron's [s, b, hidden] (TileSeqParams: many tiles flattened, b = 1)."""
        layers = list(self.layers) if isinstance(self.layers, nn.ModuleList) else list(self.layers.values())
        return run_layers(layers, hidden, self.config, self.training, attention_mask=None,
                          packed_seq_params=packed_seq_params)

    def head(self, hidden: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """Last stage: the layers' output [s, n, hidden] -> patch features [n, rows, cols, hidden]."""
        if not self.last_stage:
            raise RuntimeError(f"vision pipeline stage {self.stage} is not the last ({self.pp} stages)")
        out = hidden.transpose(0, 1)[:, self.cfg.prefix_tokens:]
        if self.final_norm is not None:  # per token, so after dropping the prefix is the same as before it
            out = self.final_norm(out)   # (the Omni model normalises RadioModel's `features`)
        return out.reshape(out.shape[0], rows, cols, -1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """The whole tower (one pipeline stage only): embed -> layers -> head."""
        if self.pp != 1:
            raise RuntimeError("a vision pipeline stage runs through MediaModule.forward_stage, not forward")
        p = self.cfg.patch
        x = self.embed(pixels)
        hidden = self.run_stage_layers(x.transpose(0, 1).contiguous())  # megatron layers take [s, b, h]
        return self.head(hidden, pixels.shape[-2] // p, pixels.shape[-1] // p)


def pixel_shuffle(x: torch.Tensor, factor: int = 2) -> torch.Tensor:
    """[n, h, w, c] -> [n, h/f, w/f, c*f*f]: each f x f block of patches becomes one token.

    Channel order follows InternVL's pixel_shuffle(scale=1/f) (what NemotronH_Nano_VL_V2's mlp1 was trained
    on): token (i, j) is the concatenation of patches (2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1) for f=2,
    i.e. the channel index is (row offset, col offset, c) with the row offset slowest."""
    n, h, w, c = x.shape
    if h % factor or w % factor:
        raise ValueError(f"patch grid {h}x{w} is not divisible by the pixel-shuffle factor {factor}")
    x = x.reshape(n, h // factor, factor, w // factor, factor, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(n, h // factor, w // factor, factor * factor * c)


class SquaredReLU(nn.Module):
    def forward(self, x):
        return torch.relu(x).square()


class Projector(nn.Sequential):
    """RMSNorm -> Linear -> squared ReLU -> Linear, bias-free; indices 0, 1, 3 are HF's mlp1.{0,1,3}."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, eps: float = 1e-5, dtype=torch.float32):
        super().__init__(nn.RMSNorm(in_dim, eps=eps, dtype=dtype), nn.Linear(in_dim, hidden, bias=False, dtype=dtype),
                         SquaredReLU(), nn.Linear(hidden, out_dim, bias=False, dtype=dtype))


class PixelNormalize(nn.Module):
    """A ViT family's preprocessing (models/encoder_families/vit.py): uint8 tiles [n, 3, H, W] (on any device:
    moved to this module's as uint8) -> (pixels / 255 - mean) / std per channel, in `dtype`."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def forward(self, tiles: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        tiles = torch.as_tensor(tiles).to(self.mean.device, non_blocking=True)
        return ((tiles.to(self.mean.dtype) / 255.0 - self.mean) / self.std).to(dtype)


class VisionEncoder(nn.Module):
    """uint8 tiles [n, 3, tile, tile] -> pixel-shuffled tokens [n * tokens_per_tile, out_dim]."""

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        self.vit, self.cfg = vit, vit.cfg
        self.pixels = PixelNormalize(self.cfg.mean, self.cfg.std)

    @property
    def out_dim(self) -> int:
        return self.cfg.hidden * self.cfg.pixel_shuffle ** 2

    def normalize(self, tiles: torch.Tensor) -> torch.Tensor:
        """uint8 tiles (on any device: moved to the encoder's as uint8) -> normalised pixels in the ViT's dtype."""
        return self.pixels(tiles, self.vit.embedder.weight.dtype)

    def grid_tokens(self, tiles: torch.Tensor) -> torch.Tensor:
        """[n, h', w', out_dim]: the shuffled token grid (video pruning needs the per-frame grid)."""
        return pixel_shuffle(self.vit(self.normalize(tiles)), self.cfg.pixel_shuffle)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        return self.grid_tokens(tiles).flatten(0, 2)
