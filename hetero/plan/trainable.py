"""What the trainer can run: the one trainability rule, shared by the trainer, `layout=auto` and the planner.

A layout can be valid (hetero/plan/layout.py: ranges tile the world, sizes divide heads and samples) and
still not be trainable by hetero/training:
- every encoder takes context parallelism (hetero/plan/encoder_cp.py): the vision tower computes each CP rank's
  part of every row's tokens (models/vision_cp.py: attention gathers each tile's keys/values); the audio encoder,
  whose convolution and subsampling windows cross any cut of a clip, encodes whole clips per CP rank and gathers
  the outputs (hetero/training/stages.py);
- both encoders split over pipeline stages (models/multimodal.MediaModule.forward_stage: layers cut at layer
  boundaries; models/audio.py runs NeMo's / transformers' conformer forward on a later stage's received
  hidden states), but not together with CP;
- only encoders with tensor-parallel layers take tp > 1.

Pure: the caller says which encoders have tensor-parallel layers (from the encoder registry), so this
module needs no model code.
"""

from __future__ import annotations

from typing import Mapping

from tessera.hetero.plan.layout import ENCODER_KEYS, VISION, HeteroLayout, LayoutError

# encoder module keys whose training splits the encoder over pipeline stages (pp > 1), never with cp > 1: all
PIPELINED_ENCODERS = frozenset(ENCODER_KEYS)


def untrainable_reasons(layout: HeteroLayout, encoder_has_tp: Mapping[str, bool],
                        video_pruned: bool = False) -> list[str]:
    """Why the trainer cannot run `layout` (empty when it can); each reason names the module and the fix.

    encoder_has_tp: per encoder module key, whether its encoder has tensor-parallel layers.
    video_pruned: the run prunes video tokens (EVS ranks a whole clip's tokens: no vision CP;
    models/multimodal.build_media_module refuses it too). Frames and tubelets split like images."""
    reasons = []
    vision = layout.modules.get(VISION)
    if vision is not None and video_pruned and vision.cp > 1:
        reasons.append(f"vision={vision.to_spec()}: video pruning (EVS) takes a whole clip on one rank; use cp1 for "
                       f"vision, or model.video_pruning=0")
    for key in layout.encoders:
        m = layout[key]
        if m.pp > 1 and key not in PIPELINED_ENCODERS:
            reasons.append(f"{key}={m.to_spec()}: the {key} encoder runs as one pipeline stage (its forward is "
                           f"one piece); use tp/dp for {key}")
        if m.cp > 1 and m.pp > 1:
            reasons.append(f"{key}={m.to_spec()}: the {key} encoder splits over cp or pp, not both; use cp{m.cp} "
                           f"or pp{m.pp} for {key}")
        if m.tp > 1 and not encoder_has_tp.get(key, False):
            reasons.append(f"{key}=tp{m.tp}: the {key} encoder has no tensor parallelism; use tp1 for {key} "
                           f"(more dp instead)")
    return reasons


class UntrainableLayout(LayoutError):
    """A valid layout the trainer cannot run; `reasons` lists why, each naming the module and the fix."""

    def __init__(self, layout: HeteroLayout, reasons: list[str]):
        super().__init__("layout " + str(layout) + " cannot train: " + "; ".join(reasons))
        self.reasons = reasons


def check_trainable(layout: HeteroLayout, encoder_has_tp: Mapping[str, bool],
                    video_pruned: bool = False) -> HeteroLayout:
    """`layout`, or an UntrainableLayout (a LayoutError) listing every reason the trainer cannot run it."""
    reasons = untrainable_reasons(layout, encoder_has_tp, video_pruned)
    if reasons:
        raise UntrainableLayout(layout, reasons)
    return layout
