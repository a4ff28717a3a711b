"""The planner prices an encoder by its family's own numbers (issue 59 item 2): FLOPs, parameters, activation bytes
and tokens from EncoderFamily.planner_fields, the media it takes from its modality; `kind` only names the
calibrated efficiency constant its kernels run at. A family that calls its kernels something else, at the same
efficiency, gets the same plan; one that is slower gets a slower one, and nothing else changes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera.hetero.planner import Constants, cluster, predict
from tessera.hetero.planner.flops import media_item_flops
from tessera.models.media_tokens import EncoderTokens
from tessera.recipes.full_size import RECIPES

LAYOUT = "vision=dp8@0-7;audio=dp8@0-7;language=dp8,ep8@0-7"


def _renamed(model, kinds: dict):
    return replace(model, modules=tuple(replace(m, kind=kinds.get(m.key, m.kind)) for m in model.modules))


def test_an_encoder_of_any_kind_is_priced_by_its_numbers():
    r = RECIPES["nemotron_omni_30b_a3b"]
    model, cl, k = r.model(), cluster("h100"), Constants()
    base = predict(LAYOUT, model, r.workload, cl, k, recompute=())
    # the vision encoder called "conformer" and the audio one "vit", each at its own efficiency: the same plan
    swapped = _renamed(model, {"vision": "conformer", "audio": "vit"})
    same = replace(k, eff_conformer=k.eff_vit, eff_vit=k.eff_conformer)
    assert predict(LAYOUT, swapped, r.workload, cl, same, recompute=()).modules == base.modules
    # (the constants as they are: only the encoders' compute changes, by the ratio of their efficiencies)
    other = predict(LAYOUT, swapped, r.workload, cl, k, recompute=())
    ratio = other.modules["vision"].stages[0].compute / base.modules["vision"].stages[0].compute
    assert ratio == pytest.approx(k.eff_vit / k.eff_conformer, rel=0.05) and ratio != 1.0
    assert other.modules["language"] == base.modules["language"]


def test_media_item_flops_follow_the_modality_not_the_kind():
    model = RECIPES["nemotron_omni_30b_a3b"].model()
    tok = EncoderTokens()  # (the defaults: 512-px tiles of 16-px patches, 16 kHz audio)
    for key, kind, units in (("vision", "image", 2), ("audio", "audio", 48_000)):
        want = media_item_flops(model[key], tok, kind, units)
        assert want > 0 and media_item_flops(replace(model[key], kind="llm"), tok, kind, units) == want
