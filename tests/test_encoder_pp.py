"""Encoders split over pipeline stages in training (models/multimodal.MediaModule.forward_stage): the
tiny VL model (RADIO-tiny, 2 ViT layers, + Nemotron-H tiny) trains with vision=pp2 on ranks of its own and
colocated with the LLM (an earlier vision stage on an LLM first-stage rank joins the boundary after handing its
activation on: hetero/plan/schedule_plan.py), and with a FastConformer (2 layers) at audio=pp2 likewise; loss and
grad norm equal the homogeneous run's at every step (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.training.metrics import read_metrics
from tests._run_curves import (AUDIO_NORM_DRIFT, check_first_step, curves as _curves, rel as _rel,
                               seed_run_dir as _seed_run_dir)

pytestmark = pytest.mark.multiproc

REFERENCE = "vision=dp4@0-3;language=dp4@0-3"
PIPELINE = "vision=pp2@0-1;language=tp2@2-3"
COLOCATED = "vision=pp2,dp2@0-3;language=dp4@0-3"
STEPS = 6
# run name -> (layout, model fields); each pipelined run is compared with the reference run of its model
RUNS = {"reference": (REFERENCE, {}),
        "non_colocated_pp2": (PIPELINE, {}),
        "colocated_pp2": (COLOCATED, {}),
        # both pipelined on the same ranks: what layout=auto picks for the tiny VL recipe on 4 ranks
        "vision_and_llm_pp2": ("vision=pp2,dp2@0-3;language=pp2,dp2@0-3", {}),
        # SigLIP: no prefix tokens, a final norm (on the last stage)
        "siglip_reference": (REFERENCE, {"vision": "siglip_tiny"}),
        "siglip_pp2": (PIPELINE, {"vision": "siglip_tiny"}),
        # a frozen tower: no encoder gradient, yet the received activation stays in the graph
        "frozen_reference": (REFERENCE, {"freeze_vision": True}),
        "frozen_pp2": (PIPELINE, {"freeze_vision": True}),
        # the conformer split over stages (models/audio.py), on ranks of its own and colocated
        "omni_reference": ("vision=dp4@0-3;audio=dp4@0-3;language=dp4@0-3", {"audio": "fastconformer_tiny"}),
        "audio_pp2": ("vision=dp2@0-1;audio=pp2@2-3;language=tp2@0-1", {"audio": "fastconformer_tiny"}),
        "audio_pp2_colocated": ("vision=dp4@0-3;audio=pp2,dp2@0-3;language=dp4@0-3", {"audio": "fastconformer_tiny"})}
PIPELINED = {"non_colocated_pp2": "reference", "colocated_pp2": "reference", "vision_and_llm_pp2": "reference",
             "siglip_pp2": "siglip_reference", "frozen_pp2": "frozen_reference", "audio_pp2": "omni_reference",
             "audio_pp2_colocated": "omni_reference"}


RESUMED = 8  # the step-6 checkpoints resumed to step 8: pp2 -> homogeneous, homogeneous -> pp2, and the reference
RESUMES = {"pp_into_reference": ("non_colocated_pp2", REFERENCE), "reference_into_pp": ("reference", PIPELINE),
           "reference_again": ("reference", REFERENCE)}


def _train(run_dir: str, layout: str, fields: dict, steps: int = STEPS):
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    model = ModelConfig(**{"vision": "radio_vit_tiny", "llm": "nemotron_h_tiny_dense", **fields})
    # 160: every step of the 8 holds an audio clip (the audio runs check their boundary moves data every step)
    data = DataConfig(seq_length=160, rows_per_microbatch=4, microbatches=2)
    trainer = TrainerConfig(max_steps=steps, run_dir=run_dir, save_every=0, progress=False, tensorboard=False)
    optim = OptimConfig(lr=2e-3, warmup_steps=2, min_lr_ratio=1.0)
    return train(model, data, optim, trainer, layout=layout, name="test")


def _all_runs(root: str) -> dict[str, str]:
    """Every run in one launch; run name -> the layout it trained in. Then each of RESUMES: a fresh run directory
    whose latest checkpoint is a finished run's step-6 one, trained on to step 8 in another layout."""
    import torch.distributed as dist

    out = {name: _train(str(Path(root) / name), layout, fields)["layout"] for name, (layout, fields) in RUNS.items()}
    for name, (src, layout) in RESUMES.items():
        ckpt, run_dir = Path(root) / src / "checkpoints" / f"step_{STEPS:06d}", Path(root) / "resume" / name
        if dist.get_rank() == 0:
            _seed_run_dir(ckpt, run_dir)
        dist.barrier()
        out[name] = _train(str(run_dir), layout, {}, RESUMED)["layout"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoder_pp")
    layouts = run_on_ranks(4, _all_runs, str(root), timeout=900)
    return root, layouts


@pytest.mark.parametrize("name", sorted(PIPELINED))
def test_vision_pp_matches_the_homogeneous_run_at_every_step(runs, name):
    """Loss and global grad norm within 1e-5 relative of the same model's homogeneous run at every step (a
    stage that ran the wrong layers, dropped the prefix tokens early or lost an item would show at step 1,
    checked to 1e-6); with audio the grad norm within AUDIO_NORM_DRIFT after step 1 (tests/_run_curves.py)."""
    from tessera.hetero.plan.layout import HeteroLayout

    root, layouts = runs
    assert max(m.pp for k, m in HeteroLayout.parse(layouts[0][name]).modules.items() if k != "language") == 2
    loss_ref, norm_ref = _curves(root / PIPELINED[name])
    loss, norm = _curves(root / name)
    assert len(loss) == len(loss_ref) == STEPS
    assert loss[-1] < loss[0], f"the model does not learn: {loss[0]:.3f} -> {loss[-1]:.3f}"
    print(f"{name}: max rel loss diff {_rel(loss, loss_ref):.2e}, grad norm {_rel(norm, norm_ref):.2e}")
    assert _rel(loss, loss_ref) <= 1e-5, f"{name}: loss curves differ by {_rel(loss, loss_ref):.2e}"
    check_first_step(name, loss, loss_ref, norm, norm_ref)
    drift = AUDIO_NORM_DRIFT if "audio" in RUNS[name][1] else 1e-5  # (tests/_run_curves.py: why)
    assert _rel(norm, norm_ref) <= drift, f"{name}: grad norms differ by {_rel(norm, norm_ref):.2e}"
    assert all(r["boundary_bytes"] > 0 for r in read_metrics(root / name)), "the boundary moved no data"
    # the final checkpoint was written (every stage's weights under the layout-free names)
    assert (root / name / "checkpoints" / f"step_{STEPS:06d}").is_dir()


def test_checkpoints_move_between_pp2_and_the_homogeneous_layout(runs):
    """A pp2 run's checkpoint (each stage saved its own layers under their global names) resumes in the
    homogeneous layout, and the homogeneous run's resumes in pp2: steps 7-8 equal the reference's own resume."""
    root, _ = runs
    again, _ = _curves(root / "resume" / "reference_again")
    assert [r["step"] for r in read_metrics(root / "resume" / "reference_again")] == [7, 8]
    for name in ("pp_into_reference", "reference_into_pp"):
        loss, _ = _curves(root / "resume" / name)
        print(f"resume {name}: max rel loss diff {_rel(loss, again):.2e}")
        assert len(loss) == 2 and _rel(loss, again) <= 1e-5, f"{name}: {loss} vs {again}"


def test_what_vision_pp_refuses():
    """Encoder PP is trainable colocated and on its own ranks, for vision and audio (what CP refuses:
    tests/test_encoder_cp.py)."""
    import re

    from tessera.hetero.plan.layout import HeteroLayout, LayoutError
    from tessera.hetero.plan.trainable import check_trainable, untrainable_reasons

    has_tp = {"vision": True, "audio": False}
    assert untrainable_reasons(HeteroLayout.parse(PIPELINE), has_tp) == []
    assert untrainable_reasons(HeteroLayout.parse("vision=pp2,dp2@0-3;language=tp2,dp2@4-7"), has_tp) == []
    assert untrainable_reasons(HeteroLayout.parse(COLOCATED), has_tp) == []
    assert untrainable_reasons(HeteroLayout.parse("vision=dp2@0-1;audio=pp2@0-1;language=tp2@2-3"), has_tp) == []
    with pytest.raises(LayoutError, match=re.escape("the audio encoder has no tensor parallelism")):
        check_trainable(HeteroLayout.parse("vision=dp4@0-3;audio=tp2,dp2@0-3;language=dp4@0-3"), has_tp)
