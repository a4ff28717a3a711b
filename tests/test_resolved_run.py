"""The one resolution of a run (hetero/plan/resolved_run.py): pure, over many layouts, in milliseconds.

What every consumer (CLI checks, trainer, decode plan, boundary plan, planner, parity tool) reads from a
ResolvedRun must hold for any layout: the step's rows kept and split into whole rows for every DP, each
module's DP rows tiling each microbatch exactly once, each encoder rank decoding exactly its DP rows, the
config never written, and layout=auto taking the first proposal that can train.
"""

from __future__ import annotations

import itertools
import re
from types import SimpleNamespace

import pytest

from tessera.hetero.plan.layout import LANGUAGE, LayoutError
from tessera.hetero.plan.resolved_run import RunModel, dp_owner, dp_rows, resolve_run
from tessera.hetero.plan.trainable import UntrainableLayout

MODEL = RunModel(keys=("vision", "audio", LANGUAGE), heads={"vision": 4, "audio": 4, LANGUAGE: 8},
                 kv_heads={LANGUAGE: 4}, encoder_tp={"vision": True, "audio": False})


def _layouts(world: int):
    """Every colocated / split placement of vision+audio (dp only) and an LLM with tp/cp/dp on `world` ranks."""
    for tp, cp in itertools.product((1, 2), (1, 2)):
        for enc_ranks in range(0, world):
            llm_ranks = world - enc_ranks
            if llm_ranks % (tp * cp):
                continue
            llm_first = enc_ranks
            if enc_ranks == 0:  # colocated
                enc = f"vision=dp{world}@0-{world - 1};audio=dp{world}@0-{world - 1}"
            else:
                enc = f"vision=dp{enc_ranks}@0-{enc_ranks - 1};audio=dp{enc_ranks}@0-{enc_ranks - 1}"
            yield f"{enc};language=tp{tp},cp{cp}@{llm_first}-{world - 1}"


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_every_layout_keeps_the_step_and_gives_every_dp_whole_rows_decoded_once(world):
    checked = 0
    for spec in _layouts(world):
        for rows, micro in ((4, 2), (12, 1), (6, 4)):
            try:
                run = resolve_run(spec, world, MODEL, seq_length=64, rows_per_microbatch=rows, microbatches=micro)
            except LayoutError as e:
                # refused only when no whole split of the step exists for these DP sizes
                assert "no whole number of rows" in str(e), (spec, rows, micro, e)
                continue
            checked += 1
            assert run.rows_per_step == rows * micro
            assert run.keys == list(MODEL.keys) and run.encoders == ["vision", "audio"]
            for key, m in run.layout.modules.items():
                owned = [r for d in range(m.dp_size) for r in run.dp_rows(key, d)]
                assert owned == list(range(run.rows_per_microbatch)), (spec, key)
                assert all(dp_owner(r, run.rows_per_microbatch, m.dp_size) == d
                           for d in range(m.dp_size) for r in run.dp_rows(key, d))
            for key in run.encoders:
                m = run.layout[key]
                decoded = [r for rank in range(world) for r in run.decode_rows(rank).get(key, [])]
                # each row decoded by exactly the tp*cp*pp peers of its DP rank
                assert sorted(decoded) == sorted(list(range(run.rows_per_microbatch)) * (m.tp * m.cp * m.pp))
                # ... and by the rank whose encoder stage hands it to the boundary (the plan's source owner)
                for rank in m.ranks:
                    owner = m.coord(rank).dp
                    assert all(dp_owner(r, run.rows_per_microbatch, m.dp_size) == owner
                               for r in run.decode_rows(rank)[key]), (spec, key, rank)
            assert all(not run.decode_rows(r) for r in range(world) if run.layout.modules_of_rank(r) == [LANGUAGE])
    assert checked > 0


def test_the_step_is_re_split_and_the_inputs_are_never_written():
    data = SimpleNamespace(rows_per_microbatch=4, microbatches=8)
    run = resolve_run("vision=dp8@0-7;language=dp8@0-7", 8, MODEL, 64, data.rows_per_microbatch, data.microbatches)
    assert (run.rows_per_microbatch, run.microbatches) == (8, 4)
    assert (data.rows_per_microbatch, data.microbatches) == (4, 8)
    # a module the layout does not name joins the first encoder's ranks; the key order is the model's
    assert str(run.layout) == "vision=dp8@0-7;audio=dp8@0-7;language=dp8@0-7"
    # "" is every module data-parallel on the world; a spec for fewer ranks grows by DP
    assert str(resolve_run("", 2, MODEL, 64, 4, 1).layout) == "vision=dp2@0-1;audio=dp2@0-1;language=dp2@0-1"
    grown = resolve_run("vision=dp1@0-0;language=dp1@1-1", 4, MODEL, 64, 4, 1).layout
    assert str(grown) == "vision=dp2@0-1;audio=dp2@0-1;language=dp2@2-3"


def test_auto_takes_the_first_proposal_that_trains_and_says_when_none_does():
    seen = []

    def propose():
        for spec in ("vision=dp2@0-1;audio=tp2@0-1;language=dp2@2-3",   # audio has no TP: cannot train
                     "vision=dp2@0-1;audio=dp2@0-1;language=tp2@2-3",   # trains
                     "vision=dp4@0-3;audio=dp4@0-3;language=dp4@0-3"):
            seen.append(spec)
            yield spec

    run = resolve_run("auto", 4, MODEL, 64, 4, 1, propose)
    assert str(run.layout) == "vision=dp2@0-1;audio=dp2@0-1;language=tp2,dp1@2-3"
    assert len(seen) == 2  # lazily: nothing after the first that trains
    with pytest.raises(LayoutError, match=re.escape("layout=auto: no layout")):
        resolve_run("auto", 4, MODEL, 64, 4, 1, lambda: iter(["vision=dp4@0-3;audio=tp2,dp2@0-3;language=dp4@0-3"]))
    with pytest.raises(LayoutError, match="needs the planner's proposals"):
        resolve_run("auto", 4, MODEL, 64, 4, 1)


def test_what_cannot_train_is_refused_with_every_reason():
    pruned = RunModel(**{**MODEL.__dict__, "video_pruned": True})
    with pytest.raises(UntrainableLayout) as e:
        resolve_run("vision=cp2@0-1;audio=tp2@0-1;language=dp2@2-3", 4, pruned, 64, 4, 1)
    assert len(e.value.reasons) == 2 and "model.video_pruning=0" in str(e.value) and "tp1 for audio" in str(e.value)
    with pytest.raises(LayoutError, match=r"seq_length=62 is not divisible by 2\*cp = 4"):
        resolve_run("vision=dp4@0-3;language=cp2,dp2@0-3", 4, MODEL, 62, 4, 1)


def test_dp_rows_is_the_only_ownership_rule():
    assert list(dp_rows(8, 4, 3)) == [6, 7]
    with pytest.raises(ValueError, match="cannot be split evenly over dp=3"):
        dp_rows(8, 3, 0)
    with pytest.raises(ValueError, match="dp_rank 2 outside dp=2"):
        dp_rows(4, 2, 2)  # one past the last DP rank


def test_one_encoder_path_decision_for_every_key_and_split():
    from tessera.hetero.plan.encoder_cp import encoder_path

    got = {(key, cp, pp): encoder_path(key, cp, pp) for key in ("vision", "audio") for cp in (1, 2) for pp in (1, 2)
           if not (cp > 1 and pp > 1)}
    assert got == {("vision", 1, 1): "items", ("vision", 2, 1): "token_cp", ("vision", 1, 2): "pipeline",
                   ("audio", 1, 1): "items", ("audio", 2, 1): "item_cp", ("audio", 1, 2): "pipeline"}
    with pytest.raises(ValueError, match="cp or pp, not both"):
        encoder_path("vision", 2, 2)


def test_a_misspelt_module_is_refused_not_silently_replaced():
    # before: 'visoin' shared its ranks with the LLM, so it was dropped and vision went dp4 on ranks 0-3
    # the message names the key and lists this model's module keys (not every key a model could have)
    no_audio = RunModel(keys=("vision", LANGUAGE), heads=MODEL.heads, kv_heads=MODEL.kv_heads,
                        encoder_tp=MODEL.encoder_tp)
    with pytest.raises(LayoutError, match=r"layout module 'visoin' is not a module of this model \(did you mean "
                                          r"'vision'\?\); its modules are: language, vision \("):
        resolve_run("visoin=dp4@0-3;language=dp4@0-3", 4, no_audio, 64, 4, 1)
    with pytest.raises(LayoutError, match=r"'visoin' .*its modules are: audio, language, vision \("):
        resolve_run("visoin=tp2,dp2@0-3;language=tp2,dp2@0-3", 4, MODEL, 64, 4, 1)
    # a real module key the model lacks is still dropped when its ranks hold another module
    run = resolve_run("vision=dp4@0-3;audio=dp4@0-3;language=dp4@0-3", 4, no_audio, 64, 4, 1)
    assert run.keys == ["vision", LANGUAGE]


def test_the_llm_cp_path_is_said_before_launch():
    """Issue 32: the resolved run names each LLM layer kind's CP path (the rule the kernel choice builds), and why a
    kind stays on the zigzag torch kernels; nothing at CP 1."""
    model = RunModel(**{**MODEL.__dict__, "mamba_heads": 8, "mamba_groups": 2})
    run = lambda spec: resolve_run(spec, 8, model, 256, 8, 1)  # noqa: E731
    assert run("vision=dp8@0-7;audio=dp8@0-7;language=tp2,dp4@0-7").cp_line() == ""
    assert run("vision=dp8@0-7;audio=dp8@0-7;language=tp2,cp2,dp2@0-7").cp_line() == (
        "context parallelism: language cp=2: attention head-parallel, mamba head-parallel")
    # 8 heads / 4 KV heads over tp1 x cp8: the heads split; 8 Mamba heads, 2 groups: split with each group on 4 ranks
    assert run("vision=dp8@0-7;audio=dp8@0-7;language=cp8@0-7").cp_line().endswith(
        "attention head-parallel, mamba head-parallel")
    odd = RunModel(**{**model.__dict__, "heads": {**MODEL.heads, LANGUAGE: 12}, "kv_heads": {LANGUAGE: 4}})
    assert resolve_run("vision=dp8@0-7;audio=dp8@0-7;language=tp2,cp2,dp2@0-7", 8, odd, 256, 8, 1).cp_line() == (
        "context parallelism: language cp=2: attention head-parallel, mamba head-parallel")
    assert resolve_run("vision=dp8@0-7;audio=dp8@0-7;language=cp8@0-7", 8, odd, 256, 8, 1).cp_line() == (
        "context parallelism: language cp=8: attention zigzag (torch kernels: 12 heads per TP rank do not divide by "
        "cp=8), mamba head-parallel")


def test_the_module_keys_at_the_edges_of_fitting_a_layout_to_the_model():
    """A typo closest to a module this model lacks still gets its hint; a key like no module gets none; a module
    the model lacks, alone on its ranks, and a layout without the LLM are named (before any validation)."""
    no_audio = RunModel(keys=("vision", LANGUAGE), heads=MODEL.heads, kv_heads=MODEL.kv_heads,
                        encoder_tp=MODEL.encoder_tp)
    with pytest.raises(LayoutError, match=r"layout module 'audoi' is not a module of this model \(did you mean "
                                          r"'audio'\?\); its modules are: language, vision \("):
        resolve_run("audoi=dp4@0-3;language=dp4@0-3", 4, no_audio, 64, 4, 1)
    with pytest.raises(LayoutError, match=r"layout module 'xyz' is not a module of this model; its modules are"):
        resolve_run("xyz=dp4@0-3;language=dp4@0-3", 4, MODEL, 64, 4, 1)
    with pytest.raises(LayoutError, match=r"the model has no 'audio' module, and ranks 2-3 hold nothing else"):
        resolve_run("vision=dp2@0-1;language=dp2@0-1;audio=dp2@2-3", 4, no_audio, 64, 4, 1)
    with pytest.raises(LayoutError, match=r"has no 'language' module: add 'language=FIELDS@FIRST-LAST'"):
        resolve_run("vision=dp4@0-3", 4, MODEL, 64, 4, 1)


def test_an_elastic_restart_scales_by_dp_else_takes_the_planners_and_names_the_first_reason():
    """resolve_run's elastic branch, pure and fast (recipes/elastic.resolve_restart drives it with the planner and
    the memory model): a fixed run refuses another world; an elastic one shrinks by DP; "" is not a restart; no
    whole DP factor (3 ranks) takes the planner's first layout that trains, not the homogeneous one; a scaled
    layout that does not fit memory, with no proposal that trains, is named by that first reason."""
    spec = "vision=dp4@0-3;audio=dp4@0-3;language=tp2,dp2@0-3"
    with pytest.raises(LayoutError, match="tile the world of 2 ranks"):
        resolve_run(spec, 2, MODEL, 64, 4, 1)
    scaled = "vision=dp2@0-1;audio=dp2@0-1;language=tp2,dp1@0-1"
    assert str(resolve_run(spec, 2, MODEL, 64, 4, 1, elastic=True).layout) == scaled
    assert str(resolve_run("", 2, MODEL, 64, 4, 1, elastic=True).layout) == "vision=dp2@0-1;audio=dp2@0-1;language=dp2@0-1"
    planned = "vision=dp1@0-0;audio=dp1@0-0;language=tp2,dp1@1-2"
    run = resolve_run(spec, 3, MODEL, 64, 4, 3, elastic=True, propose=lambda: iter([planned]))
    assert (str(run.layout), run.rows_per_microbatch, run.microbatches) == (planned, 4, 3)
    with pytest.raises(LayoutError, match=r"elastic restart on 3 ranks: world 3 is not a multiple of the layout's 4 "
                                          r"ranks .*; and the planner proposes no layout this run can train on 3 "
                                          r"ranks with 12 rows per step"):
        resolve_run(spec, 3, MODEL, 64, 4, 3, elastic=True)
    with pytest.raises(LayoutError, match=re.escape(f"elastic restart on 2 ranks: {scaled} does not fit memory "
                                                    "(ranks 0-1 need 90 GiB); and the planner proposes no layout")):
        resolve_run(spec, 2, MODEL, 64, 4, 1, elastic=True, fits=lambda s: "ranks 0-1 need 90 GiB",
                    propose=lambda: iter(["vision=dp2@0-1;audio=tp2@0-1;language=dp2@0-1"]))  # audio: no TP
