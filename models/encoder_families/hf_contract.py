"""What `hf:DIR` asks of a transformers model it has no table entry for, and what it measures of it on the meta device.

The contract (each check names DIR, the model type and what failed):
    - config.json's model_type is one transformers' AutoConfig builds, and the model is not a causal language model
    - DIR holds the model's own processor (preprocessor_config.json): an image processor (vision) or a feature
      extractor (audio) that loads here (a missing package, such as torchvision, is named)
    - the encoder is the model itself, a dual model's vision tower (`vision_model`), or an encoder-decoder's
      encoder (`get_encoder()`): the model's own accessors
    - its forward on the processor's output (pixel_values of one tile; input_values of a clip) returns
      last_hidden_state [1, tokens, hidden]
What a forward on the meta device shows (no weights read, nothing computed) is measured rather than listed: the
hidden size, the class/register tokens before the patches (tokens - patches), the rows per clip (checked against
the conv stack of its config at several lengths, so the data side can count them without a model), and for the
planner the parameters, FLOPs (torch's FlopCounterMode) and activation bytes (the tensors autograd saves).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

BF16 = 2  # bytes per activation element the planner prices (hetero/planner/model.py's unit)


class HFEncoderError(ValueError):
    """`hf:DIR` names no transformers encoder Tessera takes."""


def refuse(directory, model_type, reason: str):
    return HFEncoderError(f"hf:{directory} (model_type {model_type!r}) is not an encoder hf:DIR takes: {reason}")


def auto_config(directory: Path, model_type: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory)
    except (ValueError, KeyError) as e:
        raise refuse(directory, model_type, f"transformers' AutoConfig does not build it ({e})") from None


def processor(directory: Path, model_type: str):
    """(modality, the model's own image processor or feature extractor) from DIR/preprocessor_config.json."""
    path = directory / "preprocessor_config.json"
    if not path.is_file():
        raise refuse(directory, model_type, f"{path.name} not found: DIR must hold the model's own image processor "
                                            f"or feature extractor (save_pretrained of it) to feed it as trained")
    spec = json.loads(path.read_text())
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    modality = "vision" if "image_processor_type" in spec or "image_mean" in spec else \
        "audio" if "feature_extractor_type" in spec or "sampling_rate" in spec else None
    if modality is None:
        raise refuse(directory, model_type, f"{path.name} describes neither an image processor nor a feature "
                                            f"extractor")
    what = "image processor" if modality == "vision" else "feature extractor"
    try:  # loaded and run once: a package it needs may be imported only when it runs (an OCR step's)
        loaded = (AutoImageProcessor if modality == "vision" else AutoFeatureExtractor).from_pretrained(directory)
        if modality == "vision":
            loaded(images=[np.zeros((64, 64, 3), np.uint8)], return_tensors="np")
        else:
            loaded(np.zeros(loaded.sampling_rate // 10, np.float32), sampling_rate=loaded.sampling_rate,
                   return_tensors="np")
    except ImportError as e:
        found = re.search(r"pip install ([\w.-]+)", str(e)) or re.search(r"No module named '([^'.]+)", str(e))
        package = found.group(1) if found else getattr(e, "name", None) or "a package"
        kind = spec.get("image_processor_type" if modality == "vision" else "feature_extractor_type")
        raise refuse(directory, model_type, f"its {what} ({kind}) needs {package}, which is not installed "
                                            f"(pip install {package})") from None
    return modality, loaded


def submodule(directory: Path, model_type: str, config) -> str:
    """Where the encoder is in what AutoModel builds: "" (the model), "vision_model" (a dual model's tower) or
    "encoder" (an encoder-decoder's, by get_encoder()). A causal language model is refused."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                          MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    if getattr(config, "vision_config", None) is not None:
        return "vision_model"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder"
    # (a text encoder also has a causal-LM head class, BertLMHeadModel: a masked-LM one tells it apart)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise refuse(directory, model_type, "a causal language model (AutoModelForCausalLM builds it), not an "
                                            "encoder: checked for a vision tower (vision_config), an "
                                            "encoder-decoder's encoder and an encoder-only model")
    return ""


def layer_count(tower) -> int:
    """The length of the tower's list of transformer layers: the nn.ModuleList named layer, layers or blocks, an
    encoder's own first (not a conv stack's, nor the convolutional position embedding's), 1 where it has none."""
    from torch import nn

    lists = [(parent.rpartition(".")[2] in ("", "encoder"), len(m)) for name, m in tower.named_modules()
             for parent, _, attr in [name.rpartition(".")]
             if isinstance(m, nn.ModuleList) and attr in ("layer", "layers", "blocks")]
    return max(lists, default=(True, 1))[1] or 1


def meta_forward(cfg, samples: int = 0):
    """(last_hidden_state's shape, tower) of the tower of `cfg` on the meta device, fed one tile or one clip of
    `samples` samples as its processor would give it. A forward that fails, or returns no [1, tokens, hidden]
    last_hidden_state, is refused naming it."""
    import torch

    from tessera.models.hf_towers import load_transformers_model
    from tessera.models.meta_device import meta_build

    directory, model_type = cfg.directory, cfg.model_type
    with meta_build():
        tower = load_transformers_model(cfg)
    vision = hasattr(cfg, "tile")  # (also asked while hf_transformers derives the config, before it is typed)
    fed = (f"pixel_values [1, 3, {cfg.tile}, {cfg.tile}]" if vision
           else f"input_values [1, {samples}]")
    try:
        with torch.no_grad():
            x = torch.empty(1, 3, cfg.tile, cfg.tile, device="meta") if vision \
                else torch.empty(1, samples, device="meta")
            out = tower(x)
    except Exception as e:  # (any model's own error: what it says is the reason)
        raise refuse(directory, model_type, f"its forward on the processor's {fed} fails: "
                                            f"{type(e).__name__}: {e}") from None
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None or hidden.dim() != 3 or hidden.shape[0] != 1:
        got = "no last_hidden_state" if hidden is None else f"last_hidden_state of shape {list(hidden.shape)}"
        raise refuse(directory, model_type, f"its forward on {fed} gives {got}, not the per-item hidden states "
                                            f"[1, tokens, hidden] of an encoder")
    return tuple(hidden.shape), tower


def pipeline_stages(cfg, tower) -> tuple[str, str] | None:
    """(the list of layers, the final norm or "") when the vision tower's forward is embeddings -> those layers ->
    that norm, so pipeline stages can run it by layers (models/hf_towers.HFVisionTower); None where not (e.g. BEiT:
    its layers take the relative position bias). The list is found on the meta tower; the composition is checked
    on a two-layer copy of its config at random weights on the CPU (the structure does not depend on the depth)."""
    import torch
    import transformers
    from torch import nn

    from tessera.models.hf_towers import deterministic

    lists = [n for n, m in tower.named_modules() if isinstance(m, nn.ModuleList)
             and n.rpartition(".")[2] in ("layer", "layers", "blocks") and n.rpartition(".")[0] in ("", "encoder")]
    if len(lists) != 1 or not hasattr(tower, "embeddings"):
        return None
    config = transformers.AutoConfig.from_pretrained(cfg.directory)
    (getattr(config, "vision_config", None) or config).num_hidden_layers = 2
    deterministic(config)
    try:  # (the process's random state is left as it was: a rank's init must not depend on this check)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.AutoModel.from_config(config).eval()
            pixels = torch.randn(1, 3, cfg.tile, cfg.tile)
        small = getattr(model, cfg.submodule) if cfg.submodule else model
        with torch.no_grad():
            want = small(pixels).last_hidden_state
            x = small.embeddings(pixels)
            x = small.pre_layrnorm(x) if getattr(small, "pre_layrnorm", None) is not None else x
            for layer in small.get_submodule(lists[0]):
                x = layer(x, None)
                x = x[0] if isinstance(x, tuple) else x
    except Exception:  # (a layer that needs more than the hidden states: no stage split of it)
        return None
    for norm in ("layernorm", "post_layernorm", "norm", ""):
        module = getattr(small, norm, None) if norm else nn.Identity()
        with torch.no_grad():
            if isinstance(module, nn.Module) and module(x).shape == want.shape \
                    and torch.allclose(module(x), want, atol=1e-5, rtol=0):
                return lists[0], norm
    return None


def conv_rows(convs, samples: int) -> int:
    for kernel, stride, padding in convs:
        samples = (samples + 2 * padding - kernel) // stride + 1
    return samples


def audio_convs(directory: Path, model_type: str, config, cfg) -> tuple:
    """(kernel, stride, padding) per stage of the config's conv stack (conv_kernel / conv_stride), checked on the
    meta device: the rows of clips of several lengths must be what the stack gives (a model that pools or
    upsamples differently is refused: the data side could not count its tokens)."""
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    if not kernels or not strides:
        raise refuse(directory, model_type, "its output length for a clip cannot be determined: the config has no "
                                            "conv_kernel / conv_stride")
    convs = tuple((int(k), int(s), 0) for k, s in zip(kernels, strides))
    rate = cfg.sample_rate
    for samples in (rate, rate + 1, rate * 3 // 2 + 7):
        (_, rows, _), _ = meta_forward(cfg, samples)
        if rows != conv_rows(convs, samples):
            raise refuse(directory, model_type, f"its output length for a clip cannot be determined: "
                                                f"{samples} samples give {rows} rows, its conv stack "
                                                f"{conv_rows(convs, samples)}")
    return convs


def measured_cost(cfg, samples: int = 0) -> tuple[int, float, float]:
    """(parameters, forward FLOPs, activation bytes) of the tower of `cfg` on one item (a tile; a clip of
    `samples` samples; Whisper's whole window) on the meta device: FLOPs by torch's FlopCounterMode, activations
    as the bf16 bytes of every non-parameter tensor autograd saves for backward."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from tessera.models.hf_towers import HFVisionTower, load_transformers_model
    from tessera.models.meta_device import meta_build

    with meta_build():
        tower = HFVisionTower(cfg, "none") if cfg.modality == "vision" else load_transformers_model(cfg)
    params = {id(p) for p in tower.parameters()}
    saved = [0]

    def pack(t):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            saved[0] += t.numel() * BF16
        return t

    counter = FlopCounterMode(display=False)
    with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if cfg.modality == "vision":
            pixels = torch.empty(1, 3, cfg.tile, cfg.tile, device="meta")
            inputs = tower.inputs(pixels)
            if "spatial_shapes" in inputs:  # (read as Python ints to size the position embeddings)
                inputs["spatial_shapes"] = torch.tensor([[cfg.tile // cfg.patch] * 2])
            tower.model(**inputs)
        elif cfg.model_type == "whisper":
            tower(torch.empty(1, tower.config.num_mel_bins, 2 * tower.config.max_source_positions, device="meta"))
        else:
            tower(torch.empty(1, samples, device="meta"))
    return sum(p.numel() for p in tower.parameters()), float(counter.get_total_flops()), float(saved[0])


# -- planner: the family's numbers from measured_cost ------------------------------------------------------------

_MEASURED: dict[str, tuple] = {}  # encoder name -> _measured's numbers: measured once per process


def _measured(cfg, tok) -> tuple[int, float, float, float, float]:
    """(tower parameters, FLOPs per row or tile token, FLOPs per row and context row, activation bytes per row or
    tile token, activation bytes per row and context row); tok: the family's EncoderTokens."""
    if cfg.name in _MEASURED:
        return _MEASURED[cfg.name]
    _MEASURED[cfg.name] = numbers = _measure(cfg, tok)
    return numbers


def _measure(cfg, tok) -> tuple[int, float, float, float, float]:
    if cfg.modality == "vision":
        params, flops, act = measured_cost(cfg)
        tokens = (cfg.tile // cfg.patch) ** 2 + cfg.prefix_tokens
        return params, flops / tokens, 0.0, act / tokens, 0.0
    if cfg.window_samples:  # one pass over the whole window, whatever the clip's length
        params, flops, act = measured_cost(cfg)
        rows = tok.audio_encoder_rows(0)
        return params, flops / rows, 0.0, act / rows, 0.0
    # rows x (linear + attn x rows), solved from clips of one and two seconds (the convs ride on linear)
    rate = cfg.sample_rate
    (params, f1, a1), (_, f2, a2) = measured_cost(cfg, rate), measured_cost(cfg, 2 * rate)
    r1, r2 = tok.audio_encoder_rows(rate), tok.audio_encoder_rows(2 * rate)
    attn, act_ctx = (f2 / r2 - f1 / r1) / (r2 - r1), (a2 / r2 - a1 / r1) / (r2 - r1)
    return params, f1 / r1 - attn * r1, attn, a1 / r1 - act_ctx * r1, act_ctx


def planner_fields(cfg, llm_hidden: int, tok) -> dict:
    """hetero/planner/model.ModuleDesc's fields of the tower of `cfg` + its projector, from the measured numbers
    (tok: the family's EncoderTokens, which count a tile's tokens and a clip's rows)."""
    h, L = cfg.hidden, cfg.layers
    params, linear, attn, act, act_ctx = _measured(cfg, tok)
    proj_hidden = cfg.projector_hidden or 4 * h  # models.multimodal's default
    proj_params = h + h * proj_hidden + proj_hidden * llm_hidden
    proj_flops = 2.0 * (h * proj_hidden + proj_hidden * llm_hidden)
    # the measured bytes are all kept per token (no TP: nothing sharded); a layer's share is 1/L of them
    common = dict(params=int(params + proj_params), replicated_params=int(params + proj_params), expert_params=0,
                  edge_params=0, layers=L, hidden=h, out_hidden=llm_hidden, head_flops=0.0, act_bytes=0.0,
                  act_replicated=act, act_unsplit=0.0, act_bytes_recompute=BF16 * h * L,
                  act_peak=(("L", act / L, 0.0, 0.0),), logits_bytes=0.0, tp_collectives=0, attn_layers=0,
                  mamba_layers=0, state_bytes=0, moe_layers=0, topk=0, kv_width=2 * h, tp_divides=(1,))
    if cfg.modality == "vision":
        patches = (cfg.tile // cfg.patch) ** 2
        return dict(common, key="vision", kind="vit", linear_flops=linear, attn_flops=attn, embed_flops=0.0,
                    out_flops=proj_flops, prefix_tokens=cfg.prefix_tokens, pixel_shuffle=1,
                    act_edge=BF16 * (3 * patches * cfg.patch ** 2 + 2 * (h + proj_hidden) * patches)
                    / (patches + cfg.prefix_tokens),
                    tokens_per_tile=patches + cfg.prefix_tokens, out_per_tile=patches, temporal_patch=0)
    seconds = (cfg.window_samples or cfg.sample_rate) / cfg.sample_rate
    return dict(common, key="audio", kind="conformer", linear_flops=linear + proj_flops, attn_flops=attn,
                act_edge=4 * (h + proj_hidden), act_ctx=act_ctx,
                frames_per_second=tok.audio_encoder_rows(cfg.window_samples or cfg.sample_rate) / seconds,
                pre_flops_per_second=0.0)
