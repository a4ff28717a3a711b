"""LoRA adapters of the one-rank model as PEFT's files: OUT/adapters/ of hetero/export/hf.py.

    tensors = peft_adapters(modules)        # base_model.model.<released module>.lora_A.weight [r, in], .lora_B [out, r]
    write_adapters(out, tensors, lora, adapter_model(model_cfg, hf_fields))

PEFT (`PeftModel.from_pretrained(model, OUT/adapters)`) matches adapter_config.json's target_modules and the
tensors' keys against the module names of the model it is given, so the files name the modules of the model
transformers builds from the export (what PEFT's own save_pretrained would write for it):
  omni  NemotronH_Omni_Reasoning_V3 (OUT/config.json: a release's, or one written for a registry model).
        transformers renames the release's tensors as it loads them (transformers/conversion_mapping.py:
        "nemotron_h", "radio", "NemotronH_Omni_Reasoning_V3"), so its modules do not carry the released names:
        language_model.model.layers.N.mixer.*, multi_modal_projector.linear_1/2, embed_audio.linear_1/2,
        vision_model.encoder.layer.N.{attention.{q,k,v,o}_proj, mlp.fc1/fc2}; RADIO's fused attn.qkv becomes
        q/k/v_proj sharing its A, each with its rows of B (transformers' Chunk(dim=0) of the weight)
  llm   NemotronHForCausalLM, for a model without media (OUT/language_model/): model.layers.N.mixer.*
  None  no transformers class holds the whole model (a FastConformer or SigLIP tower): the released names
        (language_model.backbone.*, mlp1.*, vision_model.radio_model.model.blocks.N.attn.qkv, ...)
transformers fuses a layer's routed experts into one parameter per projection ([experts, out, in]); PEFT adapts
such a parameter through target_parameters (its ParamWrapper): A [experts * r, in] expert-major, B
[out, r * experts] whose column k * experts + e is expert e's column k (ParamWrapper.get_delta_weight). The
wrappers of one module's parameters nest in the module's parameter order, so with both adapted up_proj's
adapter sits under `base_layer` and down_proj's outside it.
These names are transformers 5.24's (pyproject.toml pins that minor release); tests/test_trained_is_exported.py
loads the files with PEFT and compares the logits with the trained model's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from tessera.hetero.checkpoint.source import checkpoint_source

PREFIX = "base_model.model."
# released module name -> transformers' (applied in order; module docstring)
_RENAMES = {"omni": ((r"^language_model\.backbone\.", "language_model.model."),
                     (r"^mlp1\.1$", "multi_modal_projector.linear_1"),
                     (r"^mlp1\.3$", "multi_modal_projector.linear_2"),
                     (r"^sound_projection\.linear([12])$", r"embed_audio.linear_\1"),
                     (r"^vision_model\.radio_model\.model\.blocks\.", "vision_model.encoder.layer."),
                     (r"\.attn\.proj$", ".attention.o_proj"), (r"\.attn\.qkv$", ".attention.qkv")),
            "llm": ((r"^language_model\.backbone\.", "model."),)}
_EXPERT = re.compile(r"^(.+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)$")
_EXPERT_PARAMS = ("up_proj", "down_proj")  # NemotronHExperts' parameter order: PEFT nests its wrappers in it


def _hf_module(key: str, name: str) -> list[str]:
    """Released module name(s) of an adapted layer of the one-rank model (TP1, PP1); several for fused qkv."""
    from tessera.models.multimodal_hf import PROJECTOR_ROOT
    from tessera.models.nemotron_h_hf import HF

    if key != "language":
        return [PROJECTOR_ROOT[key] + name[len("projector."):]]
    i, rest = name.split(".", 2)[1:]
    mixer = f"language_model.{HF.format(int(i))}mixer."
    rest = rest.replace("self_attention.", "").replace("mlp.", "")
    fused = {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"],
             "shared_experts.linear_fc1": ["shared_experts.up_proj"],
             "shared_experts.linear_fc2": ["shared_experts.down_proj"],
             "linear_fc1": ["up_proj"], "linear_fc2": ["down_proj"]}
    rest = rest.replace("mixer.", "")
    if rest.startswith("experts.local_experts."):  # a routed expert (one rank: local id = global id)
        _, _, j, linear = rest.split(".")
        return [f"{mixer}experts.{j}.{fused[linear][0]}"]
    return [mixer + n for n in fused.get(rest, [rest])]


def peft_adapters(modules) -> dict:
    """PEFT-style tensors of every adapter of the one-rank model under the released module names
    (base_model.model.<module>.lora_A/B.weight); write_adapters names them for the model that loads them."""
    from tessera.hetero.build.lora import adapted_layers
    from tessera.models.nemotron_h_hf import qkv_unfuse

    out = {}
    for key, module in modules.items():
        for name, layer in adapted_layers(module):
            a, b = layer.adapter.lora_A.detach().float(), layer.adapter.lora_B.detach().float()
            if key == "vision" and name.startswith("encoder.vit."):  # a ViT layer (target `vision`)
                from tessera.models.multimodal_hf import vision_adapter_targets

                hf, bs = zip(*vision_adapter_targets(name[len("encoder.vit."):], b, module.cfg))
            else:
                hf = _hf_module(key, name)
                bs = qkv_unfuse(b, module.config) if len(hf) == 3 else (b,)
            for n, part in zip(hf, bs):
                out[f"{PREFIX}{n}.lora_A.weight"] = a.clone()
                out[f"{PREFIX}{n}.lora_B.weight"] = part.contiguous().clone()
    return out


def adapter_model(model_cfg, hf_fields: dict) -> str | None:
    """Which transformers model the adapter files name modules of: "omni", "llm" or None (module docstring)."""
    from tessera.hetero.build.model_build import hf_shapes
    from tessera.hetero.runspec.modules import encoder_names, release_config
    from tessera.models import released

    if not encoder_names(model_cfg):
        return "llm"
    source = checkpoint_source(getattr(model_cfg, "checkpoint", None))
    if source is not None and source.is_release:  # the export carries the release's config.json
        return "omni" if source.release_config().get("model_type") == released.OMNI else None
    return "omni" if release_config(model_cfg, hf_fields, hf_shapes(model_cfg, hf_fields))[0] is not None else None


def adapter_base(model_cfg) -> str | None:
    """What the adapters apply to: the release the run started from, by its hub id when it came from the hub cache
    (the user's model.checkpoint=ORG/NAME), else its directory; None for a model built from registry names (its
    base weights are the seed's: the export's merged model is the way to serve it)."""
    from tessera.models.hub_cache import hub_id_of

    source = checkpoint_source(getattr(model_cfg, "checkpoint", None))
    if source is None or not source.is_release:
        return None
    return hub_id_of(source.path) or str(source.path.resolve())


def _put(out: dict, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
    # own storage for every tensor: safetensors refuses tensors that share memory (q/k/v share one A)
    out[f"{PREFIX}{module}.lora_A.weight"] = a.contiguous().clone()
    out[f"{PREFIX}{module}.lora_B.weight"] = b.contiguous().clone()


def transformers_adapters(tensors: dict, model: str) -> tuple[dict, list[str], list[str]]:
    """(tensors, target_modules, target_parameters) of released-name adapters (peft_adapters) for transformers'
    `model`, "omni" or "llm" (module docstring)."""
    out, experts = {}, {}
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        name = key[len(PREFIX):-len(".lora_A.weight")]
        a, b = tensors[key], tensors[f"{PREFIX}{name}.lora_B.weight"]
        for pattern, repl in _RENAMES[model]:
            name = re.sub(pattern, repl, name)
        expert = _EXPERT.match(name)
        if expert:
            experts.setdefault((expert[1], expert[3]), {})[int(expert[2])] = (a, b)
        elif name.endswith(".attention.qkv"):  # the released RADIO's fused qkv: [q; k; v] rows
            for x, part in zip("qkv", b.chunk(3)):
                _put(out, f"{name[:-len('qkv')]}{x}_proj", a, part)
        else:
            _put(out, name, a, b)
    modules = sorted(k[len(PREFIX):-len(".lora_A.weight")] for k in out if k.endswith(".lora_A.weight"))
    params = []
    for root in sorted({r for r, _ in experts}):
        adapted = [p for p in _EXPERT_PARAMS if (root, p) in experts]
        for depth, proj in enumerate(adapted):
            per = experts[root, proj]
            if sorted(per) != list(range(len(per))):
                raise ValueError(f"{root}.{proj}: adapters of experts {sorted(per)}; PEFT adapts the fused "
                                 f"parameter of every expert 0..n-1")
            a = torch.cat([per[e][0] for e in range(len(per))])  # [experts * r, in], expert-major
            b = torch.stack([per[e][1] for e in range(len(per))], dim=-1).flatten(1)  # [out, r * experts]
            _put(out, root + ".base_layer" * (len(adapted) - 1 - depth), a, b)
            params.append(f"{root}.{proj}")
    return out, modules, params


def write_adapters(out: Path, tensors: dict, lora, model: str | None = None, base: str | None = None) -> Path:
    """OUT/adapters/: adapter_model.safetensors + adapter_config.json (rank, alpha, targets), the modules named
    for transformers' `model` (adapter_model; None: the released names); `base`: the model they adapt, the
    release's hub id or path (adapter_base), which AutoPeftModel loads first."""
    from safetensors.torch import save_file

    params = []
    if model is not None:
        tensors, modules, params = transformers_adapters(tensors, model)
    else:
        modules = sorted(k[len(PREFIX):-len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight"))
    path = out / "adapters"
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    # PEFT's own fields only: it warns of any other as written by a newer PEFT (telling the user to upgrade)
    config = {"peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
              "bias": "none", "target_modules": modules}
    if params:
        config["target_parameters"] = params
    if base:
        config["base_model_name_or_path"] = base
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
