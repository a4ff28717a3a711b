"""Nemotron Nano V2 VL's oracle: the release's model assembled from transformers' parts, and its samples.

transformers has no class for NemotronH_Nano_VL_V2, so the reference is built as the release wires it (vLLM's
vllm/model_executor/models/nano_nemotron_vl.py, NemotronH_Nano_VL_V2: extract_feature, pixel_shuffle, mlp1,
load_weights; Megatron-Bridge's NemotronVLBridge maps the same tensor names):
  tiles [N, 3, tile, tile] --transformers RadioModel (preprocessor external: the processor normalises)-->
  features [N, (tile/p)^2, C] --reshape [N, tile/p, tile/p, C], pixel_shuffle v2 at downsample_ratio-->
  [N, (tile/p)^2 r^2, C / r^2] --mlp1 = RMSNorm(eps 1e-5), Linear (no bias), ReLU^2, Linear (no bias)-->
  embeddings, written in order over the img_context positions of the prompt (the release's merge) -->
  transformers NemotronHForCausalLM (its `language_model.*` tensors).
Every tensor is the checkpoint's own (released names: `vision_model.radio_model.model.*` renamed as transformers'
conversion_mapping.py "radio" entry renames them, `mlp1.{0,1,3}`, `language_model.*`); the RADIO layer scales,
which that release does not store, are the identity vLLM loads them as. Nothing of Tessera's models is used; the
shapes come from the hub config.json through models/released.transformers_config (a wrong shape fails the
strict load).

Samples (nano_vl_samples): an image cut into tiles by the release processor's rule (release_tiles), two images,
and a video whose frames are each one tile, each in the release's chunk "Frame i sampled at t seconds: " <img>
<image>xk </img> (vLLM NanoNemotronVLProcessor.get_video_repl, temporal patch 1); `<img>`/`</img>`/label ids are
stand-in text ids (the tiny release ships no tokenizer); the context id is config.json's img_context_token_id.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

VL_SEED = 2468
RADIO = "vision_model.radio_model."
# transformers' conversion_mapping.py: "nemotron_h" renames backbone. -> model. (a dense LLM: no expert merge);
# "radio": released name -> RadioModel name (attn.qkv is chunked in three)
RADIO_RENAMES = (("radio_model.model.patch_generator.embedder", "embeddings.patch_projection"),
                 ("radio_model.model.patch_generator.pos_embed", "embeddings.position_embedding"),
                 ("radio_model.model.patch_generator.cls_token.token", "embeddings.cls_register_token"),
                 ("radio_model.model.blocks", "encoder.layer"), ("attn.proj", "attention.o_proj"))


def hub_config(hf_dir: str) -> dict:
    """DIR/config.json as the release ships it (NemotronH_Nano_VL_V2), read as the release's code reads it."""
    import json
    from pathlib import Path

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    if "NemotronH_Nano_VL_V2" not in [config.get("model_type"), *(config.get("architectures") or [])]:
        raise ValueError(f"{hf_dir}/config.json is not a Nemotron Nano V2 VL (model_type NemotronH_Nano_VL_V2)")
    return config


def release_tiles(image: np.ndarray, tile: int, max_tiles: int = 12, use_thumbnail: bool = True) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 tiles [T, 3, tile, tile]: the release processor's rule (InternVL's
    dynamic_preprocess, which vLLM's NanoNemotronVLProcessor tiles with through get_internvl_target_ratios and
    calculate_internvl_targets; InternVL2.5 model card, "Inference with Transformers"): the (cols, rows) grid of
    1..max_tiles tiles whose aspect ratio is closest to the image's (a tie goes to the later, larger grid only when
    the image's area exceeds half of it), PIL resize of the whole image to that grid (bicubic, PIL's default),
    row-major crops, and a thumbnail of the whole image resized to one tile when there is more than one tile."""
    from PIL import Image

    height, width = image.shape[:2]
    ratios = sorted({(i, j) for n in range(1, max_tiles + 1) for i in range(1, n + 1) for j in range(1, n + 1)
                     if i * j <= max_tiles}, key=lambda r: r[0] * r[1])
    aspect, best_diff, best = width / height, float("inf"), (1, 1)
    for cols, rows in ratios:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and width * height > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    cols, rows = best
    img = Image.fromarray(image)
    resized = np.asarray(img.resize((cols * tile, rows * tile), Image.Resampling.BICUBIC))
    tiles = [resized[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
    if use_thumbnail and len(tiles) != 1:
        tiles.append(np.asarray(img.resize((tile, tile), Image.Resampling.BICUBIC)))
    return np.stack(tiles).transpose(0, 3, 1, 2).copy()


def pixel_shuffle_v2(x: torch.Tensor, scale: float) -> torch.Tensor:
    """[N, W, H, C] -> [N, W*scale, H*scale, C/scale^2]: the release's pixel_shuffle with ps_version v2 (the grid
    transposed back after the two folds)."""
    n, w, h, c = x.shape
    x = x.view(n, w, int(h * scale), int(c / scale)).permute(0, 2, 1, 3).contiguous()
    x = x.view(n, int(h * scale), int(w * scale), int(c / (scale * scale)))
    return x.permute(0, 2, 1, 3).contiguous()


class ReLUSquared(nn.Module):
    def forward(self, x):
        return torch.relu(x).square()


class NanoVLReference(nn.Module):
    """The release's forward (module docstring) on one document: input_ids [1, S], tiles uint8 [N, 3, t, t] in
    prompt order (image tiles, video frames)."""

    def __init__(self, hf_dir: str):
        super().__init__()
        from transformers import NemotronHForCausalLM, RadioModel

        from tessera.models.released import transformers_config

        hub, native = hub_config(hf_dir), transformers_config(hf_dir)
        self.context_id, self.scale = int(hub["img_context_token_id"]), float(hub["downsample_ratio"])
        if hub.get("ps_version", "v2") != "v2":
            raise ValueError(f"{hf_dir}: ps_version {hub['ps_version']!r}; this oracle implements the release's v2")
        self.patch, self.mean, self.std = int(hub["patch_size"]), hub["norm_mean"], hub["norm_std"]
        self.radio = RadioModel(native.vision_config)
        self.radio.make_preprocessor_external()
        wide = native.vision_config.hidden_size * round(1 / self.scale) ** 2
        self.mlp1 = nn.Sequential(nn.RMSNorm(wide, eps=1e-5), nn.Linear(wide, hub["projector_hidden_size"], bias=False),
                                  ReLUSquared(), nn.Linear(hub["projector_hidden_size"],
                                                           native.text_config.hidden_size, bias=False))
        self.llm = NemotronHForCausalLM(native.text_config)
        self._load(hf_dir)

    def _load(self, hf_dir: str) -> None:
        from safetensors.torch import load_file

        from tessera.models.nemotron_h_hf import safetensors_files

        tensors = {}
        for f in safetensors_files(hf_dir):
            tensors.update(load_file(str(f)))
        radio, mlp1, llm = {}, {}, {}
        for key, t in tensors.items():
            if key.startswith(RADIO):
                name = key[len("vision_model."):]
                for old, new in RADIO_RENAMES:
                    name = name.replace(old, new)
                if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
                    for part, chunk in zip("qkv", t.chunk(3, dim=0)):
                        radio[name.replace("attn.qkv", f"attention.{part}_proj")] = chunk
                else:
                    radio[name] = t
            elif key.startswith("mlp1."):
                mlp1[key[len("mlp1."):]] = t
            elif key.startswith("language_model."):
                llm[key[len("language_model."):].replace("backbone.", "model.", 1)] = t  # the "nemotron_h" rename
            else:
                raise KeyError(f"{hf_dir}: tensor {key} belongs to no part of the Nano V2 VL release")
        # what the release does not store: layer scales (identity, as vLLM loads them), RadioModel's own buffers
        own = self.radio.state_dict()
        for name in own:
            if ".layer_scale" in name:
                radio[name] = torch.ones_like(own[name])
            elif name.startswith(("summary_idxs", "input_conditioner", "embeddings.video_patch_projection")):
                radio[name] = own[name]
        self.radio.load_state_dict(radio, strict=True)
        self.mlp1.load_state_dict(mlp1, strict=True)
        self.llm.load_state_dict(llm, strict=False)  # lm_head may be tied; checked below
        missing = set(self.llm.state_dict()) - set(llm)
        if missing - {"lm_head.weight"} or ("lm_head.weight" in missing and not self.llm.config.tie_word_embeddings):
            raise KeyError(f"{hf_dir}: the language model lacks {sorted(missing)}")

    def tile_embeddings(self, tiles: torch.Tensor) -> torch.Tensor:
        """uint8 [N, 3, t, t] -> [N * tokens per tile, llm hidden]: the processor's ToTensor + Normalize with
        config.json's norm_mean/norm_std, then extract_feature."""
        mean, std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in (self.mean, self.std))
        x = (tiles.to(torch.float32) / 255.0 - mean) / std
        features = self.radio(x).features
        side = x.shape[-1] // self.patch
        shuffled = pixel_shuffle_v2(features.reshape(len(x), side, side, -1), self.scale)
        return self.mlp1(shuffled.reshape(len(x), -1, shuffled.shape[-1])).reshape(-1, self.llm.config.hidden_size)

    def forward(self, input_ids: torch.Tensor, tiles: torch.Tensor | None) -> torch.Tensor:
        embeds = self.llm.get_input_embeddings()(input_ids)
        mask = input_ids == self.context_id
        if tiles is not None and len(tiles):
            media = self.tile_embeddings(tiles)
            if media.shape[0] != int(mask.sum()):
                raise ValueError(f"{int(mask.sum())} img_context positions but {media.shape[0]} tile embeddings")
            embeds = embeds.masked_scatter(mask[..., None], media.to(embeds.dtype))
        return self.llm(inputs_embeds=embeds).logits


def sample_tiles(sample) -> torch.Tensor:
    """uint8 [N, 3, t, t]: every tile of a sample's images and every frame of its videos, in prompt order."""
    return torch.cat([torch.as_tensor(item[0] if kind == "video" else item) for _, kind, item, _, _ in sample.media])


def nano_vl_samples(hf_dir: str, seed: int = VL_SEED) -> list:
    """Four documents (models/hf_reference.OmniSample: the same fields the parity tool packs) from DIR's config, random from `seed`: "image" (a 150x70 image: 2x1 tiles + thumbnail),
    "two_images" (60x190: 1x3 + thumbnail; 50x50: one tile), "video" (3 frames, one tile each, in per-frame
    chunks), "video_then_image" (2 frames, then an 80x40 image: 2x1 + thumbnail); an even number of rows, so the
    layouts' DP sizes divide them. Tokens per tile: (tile/patch)^2 * downsample_ratio^2, the release's num_image_token."""
    from tessera.models.hf_reference import OmniSample

    hub = hub_config(hf_dir)
    tile, context = int(hub["force_image_size"]), int(hub["img_context_token_id"])
    per_tile = int((tile // hub["patch_size"]) ** 2 * hub["downsample_ratio"] ** 2)
    vocab = int(hub["llm_config"]["vocab_size"])
    rng = np.random.default_rng(seed)
    text = np.setdiff1d(np.arange(vocab), [context])
    img_start, img_end = (int(i) for i in text[:2])  # stand-ins for <img> and </img>
    text = text[2:]

    def image(w, h):
        return release_tiles(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), tile)

    def frames(n):  # already one tile each: the release resizes every frame to one tile, no thumbnail
        return rng.integers(0, 256, size=(n, 3, tile, tile), dtype=np.uint8)

    plans = {"image": [5, ("image", image(150, 70)), 7],
             "two_images": [4, ("image", image(60, 190)), 3, ("image", image(50, 50)), 6],
             "video": [6, ("video", frames(3)), 5],
             "video_then_image": [3, ("video", frames(2)), 4, ("image", image(80, 40)), 5]}
    samples = []
    for name, plan in plans.items():
        tokens, media, chunks = [], [], {}
        for part in plan:
            if isinstance(part, int):
                tokens += rng.choice(text, size=part).tolist()
                continue
            kind, item = part
            if kind == "image":
                tokens.append(img_start)
                media.append(("vision", kind, item, len(tokens), per_tile * len(item)))
                tokens += [context] * (per_tile * len(item)) + [img_end]
                continue
            placed = []
            for f in range(len(item)):  # "Frame {f+1} sampled at {t:.2f} seconds: " (stand-in label ids)
                tokens += rng.choice(text, size=5 if f else 4).tolist() + [img_start]
                placed.append((len(tokens), per_tile))
                tokens += [context] * per_tile + [img_end]
            chunks[len(media)] = tuple(placed)
            media.append(("vision", kind, (item, None), placed[0][0], per_tile * len(item)))
        samples.append(OmniSample(name, torch.tensor(tokens), media, chunks))
    return samples


def nano_vl_reference_logits(hf_dir: str, samples: list, model: NanoVLReference | None = None):
    """The oracle's float32 logits [n_i, vocab] of every sample alone."""
    model = (model or NanoVLReference(hf_dir)).float().eval()
    with torch.no_grad():
        return [model(s.tokens[None], sample_tiles(s) if s.media else None)[0].float() for s in samples]
