"""Full-size recipe families' modules, workloads and default layouts, as plain data (recipes/registry.py).

Each default layout is the planner's best (`python -m tessera.hetero.planner ...` at the recipe's GPU count)
whose memory fits an 80 GB GPU with what the recipes turn on (ZeRO-1, full activation recompute; the planner's
memory model agrees with a meta-device build of the real modules, `python -m tessera.scripts.dryrun --recipe
NAME --world N`, within a few percent) and that the trainer can run; the dry run scales it by data parallelism.

    nemotron_vl_12b        RADIO ViT-H + Nemotron Nano 12B V2, images: 24 tiles (6144 tokens) per 16K row
    nemotron_video_12b     same modules, video: 32 frames (8192 tokens) per 16K row
    nemotron_omni_30b_a3b  RADIO ViT-H + Parakeet FastConformer 0.6B + Nemotron 3 Nano 30B-A3B (MoE, ep8)
(The earlier tp4,cp2 / ep2 defaults predicted 80-97 GiB per rank once the memory model counted what the zigzag
CP attention and the MoE shards really keep; with head-parallel CP (issue 32) the LLM at CP > 1 keeps what it
keeps at CP 1, and VL's tp4,cp2 is the planner's best again.)
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.hetero.planner.cluster import Workload
from tessera.hetero.planner.model import ModelDesc, describe_model
from tessera.hetero.planner.straggler import MIXED_SPREAD  # the bench's document/video/audio mix (bench_balance.py)


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
        workload=Workload(seq_length=16384, global_batch=128, tiles=24, vision_spread=MIXED_SPREAD["vision"]),
        layout="vision=tp4,cp2,dp2@0-15;language=tp4,cp2,dp2@0-15"),   # 66.7 GiB predicted, LLM CP head-parallel
    "nemotron_video_12b": RecipeDefaults(
        llm="nemotron_nano_12b_v2", vision="radio_vit_h", audio=None, gpus=16,
        workload=Workload(seq_length=16384, global_batch=128, frames=32, vision_spread=MIXED_SPREAD["vision"]),
        layout="vision=tp2,dp8@0-15;language=tp2,dp8@0-15"),           # 70.6 GiB predicted
    "nemotron_omni_30b_a3b": RecipeDefaults(
        llm="nemotron_3_nano_30b_a3b", vision="radio_vit_h", audio="fastconformer_parakeet_0_6b", gpus=32,
        workload=Workload(seq_length=16384, global_batch=128, tiles=16, audio_seconds=120,  # 4 rows per DP rank
                          vision_spread=MIXED_SPREAD["vision"], audio_spread=MIXED_SPREAD["audio"]),
        # audio cp2: its busiest rank (dp16, 8 rows each) is priced 1.5% faster than at dp32 under balancing
        layout="vision=dp32@0-31;audio=cp2,dp16@0-31;language=dp32,ep8@0-31"),  # 70.6 GiB predicted
}
