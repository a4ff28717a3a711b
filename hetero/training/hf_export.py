"""A Tessera checkpoint saved in any layout -> the Hugging Face layout, in one process on CPU.

    .venv/bin/python -m tessera.hetero.training.hf_export CHECKPOINT OUT

The model is rebuilt with every module on one rank and dist_checkpointing reshards into it. Writes
  OUT/model.safetensors      the whole model in the NemotronH_Nano_VL_V2 / Omni key layout
                             (language_model.*, vision_model.*, mlp1.*, sound_encoder.*, sound_projection.*)
  OUT/tessera.json           the run's model config (which encoders, which LLM), or, for a model fine-tuned
                             from a released checkpoint, OUT/config.json: the release's own (transformers
                             loads OUT like the release)
  OUT/language_model/        config.json + model.safetensors: transformers' NemotronHForCausalLM loads it
The training loop runs this module in its own process after the last step (`trainer.export_hf`);
scripts/convert_hf.py is the user's command around it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace


def _fields(model_cfg) -> dict:
    return dataclasses.asdict(model_cfg) if dataclasses.is_dataclass(model_cfg) else dict(vars(model_cfg))


def one_rank_world() -> None:
    import torch.distributed as dist

    from tessera.hetero.runtime.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(prefix="tessera_convert_", delete=False).name
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def _single_rank_model(model_cfg, hf_fields: dict):
    """Every module of the model on rank 0 (dp1), as the training code builds it."""
    from tessera.hetero.runtime.groups import build_module_groups
    from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout
    from tessera.hetero.training.model_build import build_rank_modules, module_configs
    from tessera.hetero.training.run_modules import encoder_names

    keys = sorted(encoder_names(model_cfg)) + [LANGUAGE]
    layout = HeteroLayout.parse(";".join(f"{k}=dp1@0-0" for k in keys))
    groups = build_module_groups(layout)
    configs = module_configs(layout, hf_fields)
    return build_rank_modules(model_cfg, layout, groups, configs), groups, configs


def write_hf(out: Path, full: dict, model_cfg, hf_fields: dict) -> Path:
    """OUT/model.safetensors (+ tessera.json, + language_model/ loadable by transformers)."""
    from safetensors.torch import save_file

    from tessera.models import released

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in full.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    source = getattr(model_cfg, "checkpoint", None)
    if source and released.is_released_checkpoint(source):
        # the same architecture as the released checkpoint it was fine-tuned from: its config.json describes
        # these tensors (transformers loads OUT as it loads the release; so does model.checkpoint=OUT)
        (out / "config.json").write_text((Path(source).expanduser() / "config.json").read_text())
        (out / "tessera.json").unlink(missing_ok=True)
    else:
        (out / "tessera.json").write_text(json.dumps({"model": _fields(model_cfg), "llm_hf_config": hf_fields},
                                                     indent=2))
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

    from tessera.hetero.training.checkpoint import latest_checkpoint, load_checkpoint
    from tessera.models.multimodal import MultimodalModel
    from tessera.models.multimodal_hf import export_hf

    one_rank_world()
    path = Path(checkpoint)
    path = latest_checkpoint(path) or path
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    # the run's model config as saved (plain fields; model_build reads them by name)
    model_cfg = SimpleNamespace(**json.loads(common["config"])["model"])
    hf_fields = json.loads(common["llm_hf_config"])
    modules, groups, configs = _single_rank_model(model_cfg, hf_fields)
    load_checkpoint(path, modules, None, groups, configs)
    media = {k: m for k, m in modules.items() if k != "language"}
    return write_hf(Path(out), export_hf(MultimodalModel(modules["language"], media)), model_cfg, hf_fields)


if __name__ == "__main__":
    export_checkpoint(sys.argv[1], sys.argv[2])
    sys.exit(0)
