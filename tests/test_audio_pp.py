"""The audio encoder split over pipeline stages (models/audio.py, MediaModule.forward_stage): for NeMo's FastConformer
and transformers' ParakeetEncoder, stages run in sequence (in one process; a stage reads only its pipeline group's
size and rank) give the one-stage encoder's embeddings and gradients, each stage holds exactly its layers under the
one-stage names, and the activation handed on has the shape every stage computes from the clip lengths alone.
Training with audio=pp2 (colocated and on ranks of its own): tests/test_encoder_pp.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tessera.models.multimodal import build_media_module

CLIPS = [8000, 20480, 3000, 12345]  # 16 kHz samples: 0.5 s, 1.28 s (mel frames a multiple of 8), short, odd


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _stage_pgs(pgs, pp: int, stage: int):
    return SimpleNamespace(tp=pgs.tp, cp=pgs.cp, dp=pgs.dp, pp=_Group(pp, stage))


def _items():
    g = np.random.default_rng(0)
    return [("audio", (0.1 * g.standard_normal(n)).astype(np.float32)) for n in CLIPS]


@pytest.mark.parametrize("name,pp,layers", [("fastconformer_tiny", 2, 2), ("parakeet_hf_tiny", 2, 2),
                                            ("fastconformer_tiny", 3, 4), ("parakeet_hf_tiny", 3, 5)])
def test_audio_stages_equal_the_one_stage_encoder(name, pp, layers):
    from tests._mcore_cpu import single_rank_world

    pgs = single_rank_world()
    torch.manual_seed(0)
    whole = build_media_module(name, 24, pgs, layers=layers)
    full = whole.state_dict()
    items = _items()
    want = [whole([it]) for it in items]
    sum(w.square().sum() for w in want).backward()
    want_grads = {k: p.grad for k, p in whole.named_parameters() if p.grad is not None}

    stages = [build_media_module(name, 24, _stage_pgs(pgs, pp, s), layers=layers) for s in range(pp)]
    names = set()
    for s, stage in enumerate(stages):
        own = stage.state_dict()
        assert set(own) <= set(full), sorted(set(own) - set(full))  # the one-stage names, nothing else
        names |= set(own)
        stage.load_state_dict({k: full[k] for k in own})
    assert names == set(full), sorted(set(full) - names)  # every tensor on exactly the stages that need it
    layers = [sorted({int(m.group(1)) for k in st.state_dict() if (m := re.match(r"encoder\.encoder\.layers\.(\d+)\.", k))})
              for st in stages]
    assert sum(layers, []) == list(range(whole.cfg.layers)) and all(layers)

    x = None
    for stage in stages:
        shape = stage.stage_shape(items)
        x = stage.forward_stage(items, x)
        if stage is not stages[-1]:
            assert tuple(x.shape) == shape  # what the next stage expects, from the clip lengths alone
            x.retain_grad()
    got = torch.cat(want).detach()
    assert x.shape == got.shape
    err = float((x - got).norm() / got.norm())
    assert err < 1e-5, err
    x.square().sum().backward()
    for s, stage in enumerate(stages):
        for k, p in stage.named_parameters():
            if k in want_grads:
                e = float((p.grad - want_grads[k]).norm() / want_grads[k].norm().clamp_min(1e-30))
                assert e < 1e-4, (s, k, e)
    print(f"{name} pp{pp}: embeddings rel err {err:.1e}, layers per stage {layers}")


def test_a_later_stage_checks_what_it_receives():
    from tests._mcore_cpu import single_rank_world

    stage = build_media_module("fastconformer_tiny", 24, _stage_pgs(single_rank_world(), 2, 1))
    items = _items()
    rows, hidden = stage.stage_shape(items)
    with pytest.raises(ValueError, match=r"audio stage 1 got hidden states \(5, 32\)"):
        stage.forward_stage(items, torch.zeros(5, hidden))
    with pytest.raises(ValueError, match="stage 0 reads the waveforms"):
        stage.forward_stage(items, None)
