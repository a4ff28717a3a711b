"""Fine-tune a provided checkpoint and export it back: HF-layout checkpoint in (made locally, as released
checkpoints are laid out), frozen vision encoder, loss goes down, the export loads in transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.training.metrics import read_metrics

pytestmark = pytest.mark.multiproc
ROOT = Path(__file__).resolve().parents[1]
LAYOUT = "vision=dp2@0-1;language=tp2@2-3"  # non-colocated, LLM TP2: the export must merge TP shards


def _finetune(hf_dir: str, run_dir: str, export: str):
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    model = ModelConfig(llm="nemotron_h_tiny_dense", vision="radio_vit_tiny", freeze_vision=True, checkpoint=hf_dir)
    trainer = TrainerConfig(max_steps=8, run_dir=run_dir, progress=False, tensorboard=False, export_hf=export)
    return train(model, DataConfig(seq_length=128, rows_per_microbatch=4, microbatches=2), OptimConfig(lr=3e-3),
                 trainer, layout=LAYOUT, name="ft")


def test_finetune_hf_checkpoint_with_frozen_encoder_and_export(tmp_path):
    init = tmp_path / "hf_init"
    res = subprocess.run([sys.executable, "-m", "tessera.scripts.convert_hf", "--init", "nemotron_vl_tiny", "--vocab-size",
                          "400", "--out", str(init)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "hf_out"
    run_on_ranks(4, _finetune, str(init), str(tmp_path / "run"), str(out), timeout=600)

    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    before, after = load_file(str(init / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    tower = [k for k in before if k.startswith("vision_model.")]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower), "the frozen encoder changed"
    for prefix in ("mlp1.", "language_model."):  # projector and LLM trained
        assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(prefix)), prefix

    from transformers import NemotronHForCausalLM

    hf, info = NemotronHForCausalLM.from_pretrained(str(out / "language_model"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    exported = {k[len("language_model."):]: v for k, v in after.items() if k.startswith("language_model.")}
    assert torch.equal(hf.lm_head.weight, exported["lm_head.weight"])
    hf.eval()
    with torch.no_grad():
        logits = hf(torch.arange(16)[None] % 400).logits
    assert logits.shape == (1, 16, hf.config.vocab_size) and torch.isfinite(logits).all()
