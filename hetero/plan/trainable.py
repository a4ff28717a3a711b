"""What the trainer can run: the one trainability rule, shared by the trainer, `layout=auto` and the planner.

A layout can be valid (hetero/plan/layout.py: ranges tile the world, sizes divide heads and samples) and
still not be trainable by hetero/training: the real encoders run as one pipeline stage without context
parallelism, and only encoders with tensor-parallel layers take tp > 1. The reference chain of
`hetero.tools.verify` goes further (encoder CP/PP), but training does not yet.

Pure: the caller says which encoders have tensor-parallel layers (from the encoder registry), so this
module needs no model code.
"""

from __future__ import annotations

from typing import Mapping

from tessera.hetero.plan.layout import HeteroLayout, LayoutError


def untrainable_reasons(layout: HeteroLayout, encoder_has_tp: Mapping[str, bool]) -> list[str]:
    """Why the trainer cannot run `layout` (empty when it can); each reason names the module and the fix.

    encoder_has_tp: per encoder module key, whether its encoder has tensor-parallel layers."""
    reasons = []
    for key in layout.encoders:
        m = layout[key]
        if m.cp > 1 or m.pp > 1:
            reasons.append(f"{key}={m.to_spec()}: training runs the encoders as one pipeline stage without context "
                           f"parallelism (cp1, pp1); use tp/dp for {key}")
        if m.tp > 1 and not encoder_has_tp.get(key, False):
            reasons.append(f"{key}=tp{m.tp}: the {key} encoder has no tensor parallelism; use tp1 for {key} "
                           f"(more dp instead)")
    return reasons


def check_trainable(layout: HeteroLayout, encoder_has_tp: Mapping[str, bool]) -> HeteroLayout:
    """`layout`, or a LayoutError listing every reason the trainer cannot run it."""
    reasons = untrainable_reasons(layout, encoder_has_tp)
    if reasons:
        raise LayoutError("layout " + str(layout) + " cannot train: " + "; ".join(reasons))
    return layout
