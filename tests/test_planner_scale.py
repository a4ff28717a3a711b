"""The planner's pricing at scale (issue 36 item 6: layout=auto re-planned in seconds at 16,384 ranks): the boundary
rows without visiting every rank equal a count over every rank, the least recompute found without pricing options
that cannot fit equals trying all three, the search skips only layouts that cannot fit (and its feasible rows are
the same with the skip and without), and validation does not list the ranks."""

import importlib
import itertools
import math
import time

import numpy as np
import pytest

from tessera.hetero.plan.layout import HeteroLayout, ModuleLayout, scale_layout
from tessera.hetero.plan.zigzag import zigzag_chunks
from tessera.hetero.planner import Constants, Workload, cluster, describe_model
from tessera.hetero.planner.comm import BoundaryRows, boundary_rows
from tessera.hetero.planner.cost import _price, predict, remote_encoders_fit
from tessera.hetero.planner.search import _micro_batch, price_layout, search
from tessera.recipes.full_size import RECIPES


def _overlap(a0, a1, b0, b1):
    return np.clip(np.minimum(a1, b1) - np.maximum(a0, b0), 0, None)


def rows_by_every_rank(src: ModuleLayout, dst: ModuleLayout, samples: int, tokens: float) -> BoundaryRows:
    """boundary_rows as it was: every DP pair's sample overlap and every colocated rank's local copy."""
    ds, ss = np.arange(dst.dp_size), np.arange(src.dp_size)
    samp = _overlap(ds[:, None] / dst.dp_size, (ds[:, None] + 1) / dst.dp_size, ss[None, :] / src.dp_size,
                    (ss[None, :] + 1) / src.dp_size)
    rc, sc = np.arange(dst.cp), np.arange(src.cp)
    lo, hi, two = sc[None, :] / src.cp, (sc[None, :] + 1) / src.cp, 2 * dst.cp
    first, second = zigzag_chunks(dst.cp, rc[:, None])
    tok = _overlap(first / two, (first + 1) / two, lo, hi) + _overlap(second / two, (second + 1) / two, lo, hi)
    total = samples * tokens
    need, held = total / (dst.dp_size * dst.cp), total / (src.dp_size * src.cp)
    peers = int(max((samp > 0).sum(0).max() * (tok > 0).sum(0).max(), (samp > 0).sum(1).max() * (tok > 0).sum(1).max()))
    busiest, back = math.ceil(dst.tp / src.tp), math.ceil(src.tp / dst.tp)
    n_dst, n_src = dst.dp_size * dst.cp * dst.tp, src.dp_size * src.cp * src.tp
    if src.last < dst.first or dst.last < src.first:
        return BoundaryRows(need, held * busiest, held, need * back, need * n_dst, held * n_src, peers)
    coords = lambda m, r: ((r - m.first) % m.tp, (r - m.first) // m.tp % m.cp,  # noqa: E731
                           (r - m.first) // (m.tp * m.cp) % m.dp_size, (r - m.first) // (m.tp * m.cp * m.dp_size))
    ranks = np.arange(dst.first, dst.last + 1)
    (d_tp, d_cp, d_dp, d_pp), (_, s_cp, s_dp, s_pp) = coords(dst, ranks), coords(src, ranks)
    both = (d_pp == 0) & (s_pp == src.pp - 1)
    local = np.where(both, samp[d_dp, s_dp] * tok[d_cp, s_cp], 0.0) * total
    sent = np.zeros((src.tp, src.dp_size, src.cp))
    sent += (np.bincount(np.arange(dst.tp) % src.tp, minlength=src.tp) * held)[:, None, None]
    np.subtract.at(sent, (d_tp[both] % src.tp, s_dp[both], s_cp[both]), local[both])
    return BoundaryRows(float(max(need - local[d_pp == 0].min(), 0.0)), float(sent.max()),
                        float(held - local[s_pp == src.pp - 1].min()), need * back, need * n_dst - float(local.sum()),
                        held * n_src - float(local.sum()), peers)


def _pairs():
    """Colocated pairs of every pp mix (windows that cover a stage and ones that do not), and disjoint ones."""
    for (stp, scp, spp), (dtp, dcp, dpp), mult in itertools.product(
            itertools.product((1, 2, 4), (1, 2), (1, 2, 3)), itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4)),
            (1, 3, 16)):
        size = math.lcm(stp * scp * spp, dtp * dcp * dpp) * mult
        yield ModuleLayout(0, size - 1, tp=stp, cp=scp, pp=spp), ModuleLayout(0, size - 1, tp=dtp, cp=dcp, pp=dpp)
    yield ModuleLayout(0, 5, tp=2), ModuleLayout(6, 21, tp=2, cp=2, pp=2)
    yield ModuleLayout(0, 11, cp=2, pp=2), ModuleLayout(12, 19, tp=4)


def test_boundary_rows_without_every_rank_equal_the_count_over_every_rank():
    for src, dst in _pairs():
        samples = 2 * math.lcm(src.dp_size, dst.dp_size)
        got, want = boundary_rows(src, dst, samples, 37.5), rows_by_every_rank(src, dst, samples, 37.5)
        assert np.allclose(list(vars(got).values()), list(vars(want).values()), rtol=1e-12, atol=1e-9), (src, dst)


def test_boundary_rows_cost_does_not_grow_with_the_world():
    src, dst = ModuleLayout(0, 131071, tp=4, cp=2), ModuleLayout(0, 131071, tp=4, cp=2, pp=2)
    t = time.perf_counter()
    for _ in range(20):
        boundary_rows(src, dst, 16384, 1000.0)
        boundary_rows(ModuleLayout(0, 131071, tp=2), ModuleLayout(0, 131071, tp=4, cp=2), 65536, 1000.0)
    assert time.perf_counter() - t < 0.5  # a full count over 131,072 ranks took seconds each


@pytest.mark.parametrize("spec", ["vision=dp8@0-7;language=tp2,cp2,pp2@0-7", "vision=tp2,dp4@0-7;language=tp4,dp2@0-7",
                                  "vision=dp4@0-3;audio=dp4@4-7;language=tp2,pp2,dp4@8-23",
                                  "vision=dp16@0-15;audio=dp16@0-15;language=dp16,ep8@0-15"])
def test_least_recompute_equals_trying_every_option(spec):
    model = (describe_model("nemotron_3_nano_30b_a3b", "radio_vit_h", "fastconformer_parakeet_0_6b") if "audio" in spec
             else describe_model("nemotron_nano_12b_v2", "radio_vit_h"))
    lay = HeteroLayout.parse(spec)
    for w in (Workload(seq_length=16384, global_batch=64, tiles=16, audio_seconds=120), Workload(global_batch=16),
              Workload(seq_length=4096, global_batch=16, tiles=48)):  # the last fails its checks (media > sequence)
        for gpus in (lay.world_size, 4 * lay.world_size):
            big = scale_layout(lay, gpus)
            got = price_layout(big, model, w, cluster("h100", gpus))
            for opt in ((), tuple(model.keys[:-1]), tuple(model.keys)):  # what predict did before
                want = _price(big, model, _micro_batch(big, w), cluster("h100", gpus), Constants(), opt, False, True)
                if want.feasible or not want.reason.startswith("memory"):
                    break
            assert (got.recompute, got.feasible, got.reason, got.memory_gib) == \
                (want.recompute, want.feasible, want.reason, want.memory_gib), (spec, gpus, w)
            # a layout that fits is timed as before; one that cannot fit is not timed at all
            assert got.tokens_per_s == (want.tokens_per_s if want.feasible else 0.0), (spec, gpus, w)
            assert got.feasible or got.step_s == math.inf


def test_validation_does_not_list_the_ranks():
    big = scale_layout(RECIPES["nemotron_omni_30b_a3b"].layout, 1 << 20)
    t = time.perf_counter()
    for _ in range(100):
        big.validate(world_size=1 << 20)
    assert time.perf_counter() - t < 0.1
    with pytest.raises(Exception, match="ranks \\[8\\] belong to no module"):
        HeteroLayout.parse("vision=dp4@0-3;language=tp2,dp2@4-7").validate(world_size=9)


OMNI = describe_model("nemotron_3_nano_30b_a3b", "radio_vit_h", "fastconformer_parakeet_0_6b")
OMNI_WORK = Workload(seq_length=16384, global_batch=128, tiles=16, audio_seconds=120)


def test_a_layout_the_fit_check_rejects_cannot_fit():
    """remote_encoders_fit is exact on the side that matters: every layout it rejects, predict prices as not fitting
    memory (and untimed); over blocks of 1-32 ranks, with both encoders remote or one colocated."""
    rejected = accepted = 0
    llms = ("tp2,dp32", "tp2,pp2,dp16")
    for v, a, vtp, vcp, llm in itertools.product((1, 2, 8, 32), (0, 1, 4, 32), (1, 2), (1, 2), llms):
        if (v % (vtp * vcp)) or (a and a % vtp):
            continue
        spec = f"vision=tp{vtp},cp{vcp},dp{v // (vtp * vcp)}@0-{v - 1};"
        spec += f"audio=dp{a}@{v}-{v + a - 1};" if a else ""
        lang = HeteroLayout.parse(f"{spec}language={llm}@{v + a}-{v + a + 63}")["language"]
        spec += f"language={llm}@{v + a}-{v + a + lang.size - 1}"
        if not a:
            spec = spec.replace("language=", f"audio=dp{lang.size}@{v}-{v + lang.size - 1};language=")
        lay = HeteroLayout.parse(spec)
        w = _micro_batch(lay, OMNI_WORK)
        cl = cluster("h100", lay.world_size)
        if remote_encoders_fit(lay, OMNI, w, cl):
            accepted += 1
            continue
        rejected += 1
        p = predict(lay, OMNI, w, cl)
        assert not p.feasible and p.reason.startswith("memory") and p.step_s == math.inf, (spec, p.reason)
    assert rejected > 10 and accepted > 10, (rejected, accepted)


@pytest.mark.parametrize("model, work, gpus", [(OMNI, OMNI_WORK, 64),
                                               (describe_model("nemotron_nano_12b_v2", "radio_vit_h"),
                                                Workload(seq_length=16384, global_batch=128, tiles=24), 128)])
def test_the_search_skips_only_what_cannot_fit(model, work, gpus, monkeypatch):
    """The search's feasible rows, gains and times are the same with the fit check's skip and without it."""
    fast = search(model, work, cluster("h100", gpus), gpus)
    search_module = importlib.import_module("tessera.hetero.planner.search")  # the package re-exports search()
    monkeypatch.setattr(search_module, "remote_encoders_fit", lambda *a: True)
    every = search(model, work, cluster("h100", gpus), gpus)
    row = lambda p: (p.layout, p.baseline, p.tokens_per_s, p.recompute, p.memory_gib, p.gain)  # noqa: E731
    assert [row(p) for p in fast if p.feasible] == [row(p) for p in every if p.feasible]
    assert len(fast) < len(every)  # it skipped something
