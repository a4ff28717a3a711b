"""Tessera checkpoint <-> Hugging Face layout, in one process on CPU.

    .venv/bin/python -m scripts.convert_hf --checkpoint runs/ft/checkpoints --out /tmp/hf_export
    .venv/bin/python -m scripts.convert_hf --init nemotron_vl_tiny --out /tmp/hf_init   # a fresh HF checkpoint

--checkpoint: a run's checkpoints/ (its `latest`) or one step_N/ directory, saved in ANY layout: the model is
rebuilt here with every module on one rank and dist_checkpointing reshards into it. Writes
  OUT/model.safetensors      the whole model in the NemotronH_Nano_VL_V2 / Omni key layout
                             (language_model.*, vision_model.*, mlp1.*, sound_encoder.*, sound_projection.*)
  OUT/tessera.json           the run's model config (which encoders, which LLM)
  OUT/language_model/        config.json + model.safetensors: transformers' NemotronHForCausalLM loads it
--init: the same files for a recipe's model with fresh weights (what fine-tuning tests start from).
Fine-tuning reads such a directory directly: `model.checkpoint=OUT` converts on the fly.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def _one_rank_world() -> None:
    import torch.distributed as dist

    from hetero.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(prefix="tessera_convert_", delete=False).name
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def _single_rank_model(model_cfg, hf_fields: dict):
    """Every module of the model on rank 0 (dp1), as the training code builds it."""
    from hetero.groups import build_module_groups
    from hetero.layout import LANGUAGE, HeteroLayout
    from hetero.training.model_build import build_rank_modules, encoder_names, module_configs

    keys = sorted(encoder_names(model_cfg)) + [LANGUAGE]
    layout = HeteroLayout.parse(";".join(f"{k}=dp1@0-0" for k in keys))
    groups = build_module_groups(layout)
    configs = module_configs(layout, hf_fields)
    return build_rank_modules(model_cfg, layout, groups, configs), groups, configs


def write_hf(out: Path, full: dict, model_cfg, hf_fields: dict) -> Path:
    """OUT/model.safetensors (+ tessera.json, + language_model/ loadable by transformers)."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in full.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tessera.json").write_text(json.dumps({"model": asdict(model_cfg), "llm_hf_config": hf_fields}, indent=2))
    lm = out / "language_model"
    lm.mkdir(exist_ok=True)
    save_file({k[len("language_model."):]: v.contiguous() for k, v in full.items() if k.startswith("language_model.")},
              str(lm / "model.safetensors"), metadata={"format": "pt"})
    from transformers import NemotronHConfig

    NemotronHConfig(**hf_fields).save_pretrained(str(lm))
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """A Tessera checkpoint (any layout) -> HF layout files in `out`."""
    from megatron.core import dist_checkpointing

    from hetero.training.checkpoint import latest_checkpoint, load_checkpoint
    from models.multimodal import MultimodalModel
    from models.multimodal_hf import export_hf
    from recipes.config import ModelConfig

    _one_rank_world()
    path = Path(checkpoint)
    path = latest_checkpoint(path) or path
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    model_cfg = ModelConfig(**json.loads(common["config"])["model"])
    hf_fields = json.loads(common["llm_hf_config"])
    modules, groups, configs = _single_rank_model(model_cfg, hf_fields)
    load_checkpoint(path, modules, None, groups, configs)
    media = {k: m for k, m in modules.items() if k != "language"}
    return write_hf(Path(out), export_hf(MultimodalModel(modules["language"], media)), model_cfg, hf_fields)


def init_checkpoint(recipe_name: str, out: str | Path, vocab_size: int = 0, seed: int = 0) -> Path:
    """A recipe's model with fresh weights, written in HF layout (vocab grown to vocab_size if larger)."""
    from hetero.training.model_build import full_hf_state, llm_fields
    from recipes.registry import recipe

    import fiddle as fdl

    _one_rank_world()
    model_cfg = fdl.build(recipe(recipe_name).model)
    hf_fields = llm_fields(model_cfg, vocab_size)
    return write_hf(Path(out), full_hf_state(model_cfg, hf_fields, seed), model_cfg, hf_fields)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Tessera checkpoint -> Hugging Face layout")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a run's checkpoints/ directory or one step_N/ directory")
    src.add_argument("--init", metavar="RECIPE", help="fresh weights of a recipe's model")
    ap.add_argument("--vocab-size", type=int, default=0, help="--init: grow the LLM vocabulary to this size")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out) if args.checkpoint else \
        init_checkpoint(args.init, args.out, args.vocab_size)
    print(f"[convert] wrote {out}/model.safetensors and {out}/language_model/ (transformers NemotronH)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
