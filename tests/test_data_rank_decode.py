"""Per-rank decoding: each rank decodes exactly the media of the rows its encoder modules consume (none on
an LLM-only rank), while every rank gets the same global batches with the full per-sample metadata."""

from collections import Counter

import numpy as np
import pytest

import tessera.data.loader as loader_mod
from tessera.data.loader import ChatTaskEncoder, build_loader, close_loader
from tessera.data.sharding import decode_plan
from tessera.data.tokens import MODULE_OF_KIND, EncoderTokens, Tokenizer
from tessera.hetero.plan.layout import HeteroLayout, ModelShapes
from tessera.data.prepare import make_synthetic

ENC = EncoderTokens(patch=64)
SEQ, ROWS, BATCHES = 512, 4, 3
LAYOUTS = [
    "vision=dp2@0-1;language=tp2@2-3",  # non-colocated; no audio module: audio is decoded nowhere
    "vision=dp2@0-1;audio=dp1@2-2;language=tp2,dp2@3-6",  # non-colocated, three ranges
    "vision=dp4@0-3;audio=dp4@0-3;language=tp2@0-3",  # colocated
    "vision=tp2,dp2@0-3;audio=dp2@4-5;language=dp2,pp2@6-9",  # encoder TP peers decode the same rows
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("rankdec")
    make_synthetic(root, samples=40, seed=5, shard_size=10, prefix="r")
    return root


def _run(root, plan, monkeypatch):
    """BATCHES global batches for one decode plan, with every real decode call recorded as (key, kind)."""
    calls, decodes = [], Counter()
    orig = ChatTaskEncoder._decode_item

    def spy(self, kind, data, units, key, shard):
        calls.append((key, kind))
        return orig(self, kind, data, units, key, shard)

    for name in ("decode_image", "decode_video", "decode_audio"):
        real = getattr(loader_mod, name)
        monkeypatch.setattr(loader_mod, name, lambda *a, _r=real, _n=name, **k: (decodes.update([_n]), _r(*a, **k))[1])
    monkeypatch.setattr(ChatTaskEncoder, "_decode_item", spy)
    te = ChatTaskEncoder(Tokenizer(root / "tokenizer.model"), SEQ, ENC, decode=plan)
    ld = build_loader(root, te, ROWS, seed=1)
    batches = []
    for b in ld:
        batches.append(b)
        if len(batches) == BATCHES:
            break
    close_loader(ld)
    monkeypatch.undo()
    assert sum(decodes.values()) == len(calls)  # one real decode per recorded item, nothing else decoded
    return batches, calls


def _count(kind, item):
    return ENC.tokens(kind, (item[0] if kind == "video" else item).shape[0])


@pytest.mark.parametrize("spec", LAYOUTS)
def test_each_rank_decodes_exactly_its_share(dataset, spec, monkeypatch):
    layout = HeteroLayout.parse(spec)
    layout.validate(ModelShapes(samples_per_microbatch=ROWS))
    ref, ref_calls = _run(dataset, None, monkeypatch)
    # Global item list (batch, row, key, kind): the reference decodes row by row, each row's items in
    # media_meta order (both follow the row's span order), so its calls line up with the metadata.
    items, i = [], 0
    for bi, b in enumerate(ref):
        for row, meta in enumerate(b.media_meta):
            for m, lst in meta.items():
                for kind, *_ in lst:
                    assert ref_calls[i][1] == kind and ref_calls[i][0] in b.keys[row]
                    items.append((bi, row, *ref_calls[i]))
                    i += 1
    assert i == len(ref_calls) and {MODULE_OF_KIND[k] for *_, k in items} == {"vision", "audio"}

    runs: dict = {}  # plan -> result; ranks with equal plans (TP/CP/PP peers, LLM ranks) share one run
    per_module_dp: dict = {}
    for rank in range(layout.world_size):
        plan = decode_plan(layout, rank, ROWS)
        key = tuple(sorted((m, r.start, r.stop) for m, r in plan.items()))
        if key not in runs:
            runs[key] = _run(dataset, plan, monkeypatch)
        batches, calls = runs[key]
        want = [(k, kind) for bi, row, k, kind in items
                if MODULE_OF_KIND[kind] in plan and row in plan[MODULE_OF_KIND[kind]]]
        assert Counter(calls) == Counter(want), f"rank {rank} decoded other media than its share"
        if not plan:
            assert calls == [] and all(m == {} for b in batches for m in b.media)
        for b, r in zip(batches, ref):  # same batch order and full metadata on every rank
            assert b.keys == r.keys and bool((b.tokens == r.tokens).all())
            assert b.media_meta == r.media_meta
            assert all(pa.keys() == pb.keys() and all(np.array_equal(pa[m], pb[m]) for m in pa)
                       for pa, pb in zip(b.positions, r.positions))
            b.check(_count)
            for row, media in enumerate(b.media):
                assert set(media) == {m for m in b.media_meta[row] if m in plan and row in plan[m]}
        for m in plan:
            coord = layout[m].coord(rank)
            if (coord.tp, coord.cp, coord.pp) == (0, 0, 0):
                per_module_dp.setdefault(m, []).extend(c for c in calls if MODULE_OF_KIND[c[1]] == m)
    for m in layout.encoders:  # the module's DP ranks together decode the global batch, no duplicates
        every = Counter((k, kind) for *_, k, kind in items if MODULE_OF_KIND[kind] == m)
        assert Counter(per_module_dp[m]) == every, m
