"""Full-size recipe families' modules, workloads and default layouts, as plain data (recipes/registry.py).

Each default layout was picked with the planner (`python -m tessera.hetero.planner ...` at the recipe's GPU count,
best layout of the recipe's placement with power-of-two sizes) and passes HeteroLayout.validate; the dry
run (`python -m tessera.scripts.dryrun --recipe NAME --world 1024`) scales it by data parallelism.

    nemotron_vl_12b        RADIO ViT-H + Nemotron Nano 12B V2, images: 24 tiles (6144 tokens) per 16K row
    nemotron_video_12b     same modules, video: 32 frames (8192 tokens) per 16K row; the LLM pipelines (pp2)
    nemotron_omni_30b_a3b  RADIO ViT-H + Parakeet FastConformer 0.6B + Nemotron 3 Nano 30B-A3B (MoE, ep2):
                           vision colocated with the LLM, audio on its own 4 GPUs (mixed placement)
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.hetero.planner.cluster import Workload
from tessera.hetero.planner.model import ModelDesc, describe_model


@dataclass(frozen=True)
class RecipeDefaults:
    llm: str                    # models.configs.REGISTRY name
    vision: str | None          # models.encoders.REGISTRY names
    audio: str | None
    gpus: int
    workload: Workload
    layout: str                 # hetero/plan/layout.py grammar, on `gpus` ranks

    def model(self) -> ModelDesc:
        return describe_model(self.llm, self.vision, self.audio)


RECIPES = {
    "nemotron_vl_12b": RecipeDefaults(
        llm="nemotron_nano_12b_v2", vision="radio_vit_h", audio=None, gpus=16,
        workload=Workload(seq_length=16384, global_batch=128, tiles=24),
        layout="vision=tp2,dp8@0-15;language=tp4,cp2,dp2@0-15"),
    "nemotron_video_12b": RecipeDefaults(
        llm="nemotron_nano_12b_v2", vision="radio_vit_h", audio=None, gpus=16,
        workload=Workload(seq_length=16384, global_batch=128, frames=32),
        layout="vision=tp4,dp4@0-15;language=tp4,cp2,pp2,dp1@0-15"),
    "nemotron_omni_30b_a3b": RecipeDefaults(
        llm="nemotron_3_nano_30b_a3b", vision="radio_vit_h", audio="fastconformer_parakeet_0_6b", gpus=32,
        workload=Workload(seq_length=16384, global_batch=112, tiles=16, audio_seconds=120),
        layout="audio=dp4@0-3;vision=tp2,dp14@4-31;language=tp2,dp14,ep2@4-31"),
}
