"""The torch modules of the `hf:DIR` encoder families (models/encoder_families/hf_transformers.py): a transformers
vision tower or audio encoder loaded from DIR, fed as its own processor feeds it.

    HFVisionEncoder  uint8 tiles -> HFPixels (the image processor's rescale and normalisation) -> HFVisionTower
                     (the tower's forward; as pipeline stages, embed / run_stage_layers / head)
    HFAudioEncoder   waveforms -> HFAudioFeatures (the model's own feature extractor) -> the encoder's rows over
                     each clip's samples
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.models.encoder_families.base import family_of


def deterministic(config) -> None:
    """Dropout, drop path (stochastic depth), LayerDrop and SpecAugment off (in place, a dual model's sub-configs
    too): training equal in every layout, as Tessera's encoders."""
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and ("dropout" in key or "drop_path" in key or key.endswith("layerdrop")
                                         or key.startswith("mask_time_prob") or key.startswith("mask_feature_prob")):
            setattr(config, key, 0.0)
    if hasattr(config, "apply_spec_augment"):
        config.apply_spec_augment = False
    for sub in ("vision_config", "audio_config", "encoder"):
        if hasattr(getattr(config, sub, None), "to_dict"):
            deterministic(getattr(config, sub))


def load_transformers_model(cfg):
    """The tower of cfg's directory: its weights, or on the meta device (models/meta_device.meta_build) shapes only.
    A type of the family's table loads as its tower class; any other through AutoModel, then the model's own
    accessor of its encoder (cfg.submodule: a dual model's vision_model, an encoder-decoder's get_encoder())."""
    import transformers

    directory, meta = cfg.directory, torch.empty(0).is_meta
    cls = getattr(transformers, cfg.tower_class)
    config = (transformers.AutoConfig if cls is transformers.AutoModel else cls.config_class).from_pretrained(directory)
    deterministic(config)
    if hasattr(config, "vision_use_head"):
        config.vision_use_head = False  # SigLIP's attention-pooling head: no output Tessera uses
    if meta:
        model = cls.from_config(config) if cls is transformers.AutoModel else cls(config)
    else:
        model = cls.from_pretrained(directory, config=config, dtype=torch.float32)
    where = cfg.submodule
    tower = model.get_encoder() if where == "encoder" else getattr(model, where) if where else model
    if getattr(tower, "pooler", None) is not None:
        tower.pooler = None  # a pooled output Tessera never reads: its parameters would get no gradient
    return tower


class HFPixels(nn.Module):
    """uint8 tiles [n, 3, tile, tile] -> the processor's pixel_values of them: rescaled, normalised (fp32)."""

    def __init__(self, cfg):
        super().__init__()
        self.rescale = cfg.rescale
        self.register_buffer("mean", torch.tensor(cfg.mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(cfg.std).view(1, 3, 1, 1), persistent=False)

    def forward(self, tiles):
        tiles = torch.as_tensor(tiles).to(self.mean.device)
        return (tiles.float() * self.rescale - self.mean) / self.std


class HFVisionTower(nn.Module):
    """Normalised tiles [n, 3, tile, tile] -> the tower's patch features as a grid [n, rows, cols, hidden].

    Pipeline stage `stage` of `pp` keeps its share of the encoder's plain list of layers (cfg.layer_list;
    models/vision's split, named by their global index), the embeddings on the first stage and the final norm
    (cfg.final_norm) on the last; the stages run through embed / run_stage_layers / head
    (models/multimodal.MediaModule.forward_stage), which together are the model's own forward: embeddings (CLIP: +
    pre_layrnorm), the layers without a mask (a tile has no padding), the final norm (SigLIP's post_layernorm,
    DINOv2's layernorm; CLIP's post_layernorm is its pooled output's only: none). For a type outside the table
    this composition is checked when its config is made (hf_contract.pipeline_stages)."""

    cp = 1

    def __init__(self, cfg, recompute: str, pp: int = 1, stage: int = 0):
        from tessera.models.audio import stage_layers
        from tessera.models.vision import vit_stage_layers

        super().__init__()
        self.cfg, self.model = cfg, load_transformers_model(cfg)
        self.pp, self.stage, self.first_stage, self.last_stage = pp, stage, stage == 0, stage == pp - 1
        if recompute != "none":  # transformers' layer checkpointing: each layer recomputed in backward
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        body = self.body
        if pp > 1:
            owner, _, name = cfg.layer_list.rpartition(".")  # e.g. encoder.layers (SigLIP), encoder.layer (DINOv2)
            owner = body.get_submodule(owner)
            setattr(owner, name, stage_layers(getattr(owner, name), vit_stage_layers(cfg.layers, pp, stage)))
            if not self.first_stage:
                body.embeddings = body.pre_layrnorm = None
            if not self.last_stage and cfg.final_norm:
                setattr(body, cfg.final_norm, None)

    @property
    def body(self) -> nn.Module:
        """The vision transformer itself (embeddings, encoder.layers, norms) inside the transformers wrapper."""
        return getattr(self.model, "vision_model", self.model)

    def inputs(self, pixels) -> dict:
        """The tower's forward arguments for normalised tiles: pixel_values, and for SigLIP2 the processor's
        patch rows (convert_image_to_patches' (rows, cols, p, p, c) order) and spatial shapes."""
        if not self.cfg.model_type.startswith("siglip2"):
            return {"pixel_values": pixels}
        n, c, h, w = pixels.shape
        p = self.cfg.patch
        patches = pixels.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(n, -1, p * p * c)
        shapes = torch.tensor([[h // p, w // p]] * n, dtype=torch.long, device=pixels.device)
        # no mask: a tile fills its max_num_patches, so the processor's mask is all ones (no padded patch)
        return {"pixel_values": patches, "pixel_attention_mask": None, "spatial_shapes": shapes}

    def forward(self, pixels):
        n, _, h, w = pixels.shape
        if (h, w) != (self.cfg.tile,) * 2 and not self.cfg.model_type.startswith("siglip2"):
            # a fixed-size tower's position table holds the processor's grid only (SigLIP2 resizes its own)
            raise ValueError(f"encoder {self.cfg.name!r} takes {self.cfg.tile}-px tiles, got {w}x{h} images: "
                             f"use it with tiled images (the vl recipes), not native-resolution ones (omni)")
        if self.pp > 1:
            raise RuntimeError(f"encoder {self.cfg.name!r} is pipeline stage {self.stage} of {self.pp}: run it "
                               f"through embed / run_stage_layers / head")
        hidden = self.model(**self.inputs(pixels)).last_hidden_state[:, self.cfg.prefix_tokens:]
        p = self.cfg.patch
        return hidden.reshape(n, h // p, w // p, -1)

    def embed(self, pixels):
        """First stage: normalised tiles -> the embedded tokens [n, prefix + patches, hidden]."""
        inputs, body = self.inputs(pixels), self.body
        if "spatial_shapes" in inputs:
            return body.embeddings(inputs["pixel_values"], inputs["spatial_shapes"])
        hidden = body.embeddings(inputs["pixel_values"])
        return body.pre_layrnorm(hidden) if getattr(body, "pre_layrnorm", None) is not None else hidden

    def run_stage_layers(self, hidden):
        """This stage's layers over [tokens, n, hidden] (megatron's sequence-first order, as models/vision's)."""
        x = hidden.transpose(0, 1)
        for layer in self.body.get_submodule(self.cfg.layer_list):
            x = layer(x, None)
            x = x[0] if isinstance(x, tuple) else x
        return x.transpose(0, 1)

    def head(self, hidden, rows: int, cols: int):
        """Last stage: [tokens, n, hidden] -> the patch grid [n, rows, cols, hidden] (the final norm applied, the
        class / register tokens dropped)."""
        x = hidden.transpose(0, 1)
        if self.cfg.final_norm:
            x = getattr(self.body, self.cfg.final_norm)(x)
        return x[:, self.cfg.prefix_tokens:].reshape(x.shape[0], rows, cols, -1)


class HFVisionEncoder(nn.Module):
    """uint8 tiles [n, 3, tile, tile] -> tokens [n * patches, hidden] (models/vision.VisionEncoder's interface)."""

    def __init__(self, cfg, recompute: str = "none", pp: int = 1, stage: int = 0):
        super().__init__()
        self.cfg, self.pixels, self.vit = cfg, HFPixels(cfg), HFVisionTower(cfg, recompute, pp, stage)

    @property
    def out_dim(self) -> int:
        return self.cfg.hidden

    def normalize(self, tiles):
        """Normalised pixels in the tower's dtype (the run's: bf16 on GPUs)."""
        return self.pixels(tiles).to(next(self.vit.parameters()).dtype)

    def grid_tokens(self, tiles):
        return self.vit(self.normalize(tiles))

    def forward(self, tiles):
        return self.grid_tokens(tiles).flatten(0, 2)


class HFAudioFeatures:
    """The model's own feature extractor on a list of waveforms -> (encoder input [b, ...], valid samples [b])."""

    def __init__(self, cfg):
        from transformers import AutoFeatureExtractor

        self.cfg, self.extractor = cfg, AutoFeatureExtractor.from_pretrained(cfg.directory)

    def __call__(self, waves: list):
        import numpy as np

        device = torch.as_tensor(waves[0]).device
        arrays = [torch.as_tensor(w, dtype=torch.float32).cpu().numpy() for w in waves]
        window = self.cfg.window_samples
        lengths = torch.tensor([min(len(a), window) if window else len(a) for a in arrays], device=device)
        if self.cfg.model_type == "whisper":
            out = self.extractor(arrays, sampling_rate=self.cfg.sample_rate, return_tensors="np")
            return torch.from_numpy(np.asarray(out["input_features"])).to(device), lengths
        # wav2vec2 / HuBERT: normalised per clip, each clip its own pass (padding would change group norm)
        out = [self.extractor(a, sampling_rate=self.cfg.sample_rate, return_tensors="np")["input_values"][0]
               for a in arrays]
        batch = torch.zeros(len(out), int(lengths.max()), device=device)
        for i, a in enumerate(out):
            batch[i, :len(a)] = torch.from_numpy(np.asarray(a))
        return batch, lengths


class HFAudioEncoder(nn.Module):
    """Float waveforms -> per clip [tokens, hidden] (models/audio.FastConformerEncoder's interface, one stage)."""

    pp, stage, first_stage, last_stage = 1, 0, True, True

    def __init__(self, cfg, recompute: str = "none"):
        super().__init__()
        self.cfg, self.tokens = cfg, family_of(cfg).tokens(cfg)
        self.extract = HFAudioFeatures(cfg)
        self.encoder = load_transformers_model(cfg)
        if recompute != "none":
            self.encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @property
    def out_dim(self) -> int:
        return self.cfg.hidden

    def features(self, waves):
        return self.extract(waves)

    def encode_features(self, feats, lengths):
        """Encoder rows [b, rows, hidden] and the rows each clip's samples cover."""
        keep = torch.tensor([self.tokens.audio_tokens(int(n)) for n in lengths], device=feats.device)
        feats = feats.to(next(self.encoder.parameters()).dtype)  # the run's dtype (bf16 on GPUs)
        if self.cfg.model_type == "whisper":
            return self.encoder(feats).last_hidden_state, keep
        rows = [self.encoder(feats[i:i + 1, :int(n)]).last_hidden_state[0] for i, n in enumerate(lengths)]
        out = feats.new_zeros(len(rows), max(len(r) for r in rows), self.out_dim)
        return torch.stack([torch.cat([r, out[0, len(r):]]) for r in rows]) if rows else out, keep

    def encode_received(self, hidden, lengths):
        raise ValueError(f"encoder {self.cfg.name!r} runs on one pipeline stage (pp1)")

    def keep(self, out, out_len, feat_len=None):
        return [o[:int(n)] for o, n in zip(out, out_len)]

    def forward(self, waves):
        hidden, keep = self.encode_features(*self.features(waves))
        return self.keep(hidden, keep)
