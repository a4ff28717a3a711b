"""Tessera checkpoint <-> Hugging Face layout, in one process on CPU.

    .venv/bin/python -m tessera.scripts.convert_hf --checkpoint runs/ft/checkpoints --out /tmp/hf_export
    .venv/bin/python -m tessera.scripts.convert_hf --init nemotron_vl_tiny --out /tmp/hf_init   # a fresh HF checkpoint

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
import sys
from pathlib import Path

from tessera.hetero.export.hf import export_checkpoint, write_hf
from tessera.hetero.runtime.world import process_world


def init_checkpoint(recipe_name: str, out: str | Path, vocab_size: int = 0, seed: int = 0) -> Path:
    """A recipe's model with fresh weights, written in HF layout (vocab grown to vocab_size if larger)."""
    from tessera.hetero.build.model_build import llm_fields
    from tessera.hetero.build.seeded_init import full_hf_state
    from tessera.recipes.registry import recipe

    import fiddle as fdl

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
    with process_world(backend="gloo", alone=True):  # one CPU rank whatever the machine or the job has
        out = export_checkpoint(args.checkpoint, args.out) if args.checkpoint else \
            init_checkpoint(args.init, args.out, args.vocab_size)
    print(f"[convert] wrote {out}/model.safetensors and {out}/language_model/ (transformers NemotronH)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
