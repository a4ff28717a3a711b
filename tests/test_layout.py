"""Layouts: the string grammar, placement, and validate()'s errors (module, field and fix named)."""

import pytest

from tessera.hetero.plan.layout import HeteroLayout, LayoutError, ModelShapes, ModuleLayout


def test_parse_readme_example_and_round_trip():
    lay = HeteroLayout.parse("vision=dp4@0-3;audio=dp4@0-3;language=tp2,cp2@0-3").validate()
    assert lay["vision"] == ModuleLayout(first=0, last=3, dp=4)
    assert lay["language"].shape == [2, 2, 1, 1]  # tp, cp, dp derived = 4/(2*2), pp
    assert lay.placement == "colocated" and lay.world_size == 4
    assert HeteroLayout.parse(str(lay)) == lay


def test_fields_in_any_order_defaults_and_derived_dp():
    lay = HeteroLayout.parse(" vision = pp2 , tp2 @ 0-7 ; language=ep2,cp2,tp2@8-15").validate()
    v, l = lay["vision"], lay["language"]
    assert (v.tp, v.cp, v.pp, v.dp_size, v.ep) == (2, 1, 2, 2, 1)
    assert (l.tp, l.cp, l.pp, l.dp_size, l.ep) == (2, 2, 1, 2, 2)
    assert lay.placement == "non-colocated"


def test_dp_is_derived_at_the_edges_so_equal_layouts_compare_equal():
    """tp*cp*pp of exactly 1 and a range of exactly one rank still derive dp, so a layout written with or
    without its dp is the same layout."""
    assert ModuleLayout(first=0, last=3) == ModuleLayout(first=0, last=3, dp=4)
    assert ModuleLayout(first=5, last=5) == ModuleLayout(first=5, last=5, dp=1)
    assert HeteroLayout.parse("language=@0-3") == HeteroLayout.parse("language=dp4@0-3")


def test_rank_order_is_tp_fastest_then_cp_dp_pp():
    m = ModuleLayout(first=8, last=23, tp=2, cp=2, pp=2)  # dp derived: 2
    assert [m.rank_of(tp=1), m.rank_of(cp=1), m.rank_of(dp=1), m.rank_of(pp=1)] == [9, 10, 12, 16]
    for r in m.ranks:
        c = m.coord(r)
        assert m.rank_of(c.tp, c.cp, c.dp, c.pp) == r
    assert m.coord(7) is None and m.coord(24) is None


@pytest.mark.parametrize("spec, words", [
    ("vision=dp4@0-3", ["no 'language' module"]),
    ("language=tp3@0-3", ["'language'", "tp*cp*pp", "does not divide"]),
    ("language=tp2,dp4@0-3", ["'language'", "tp*cp*pp*dp", "set dp2"]),
    ("language=tp2,tp2@0-3", ["'language'", "given twice"]),
    ("language=sp2@0-3", ["'language'", "'sp2'", "tpN"]),
    ("language=tp2@3-0", ["'language'", "empty"]),
    ("language=tp2@0-x", ["'language'", "@FIRST-LAST"]),
    ("language tp2", ["KEY=FIELDS@FIRST-LAST"]),
    ("vision=dp2@0-1;language=dp2@1-2", ["partly overlap", "'vision'", "'language'"]),
    ("vision=dp2@0-1;language=dp2@3-4", ["tile the world", "[2]"]),
    ("vision=dp2@0-1;vision=dp2@2-3;language=dp1@0-0", ["appears twice"]),
    ("language=dp3,ep2@0-2", ["'language'", "ep=2", "divide cp*dp"]),
    # the edges of the grammar and of each check: a zero size, a second '=' or '@', nothing at all, and two
    # ranges that share exactly one rank (the later range listed first)
    ("language=tp0@0-3", ["'language'", "tp=0 must be a positive integer"]),
    ("language=dp0@0-3", ["'language'", "dp=0 must be a positive integer, or omitted"]),
    ("language=dp2", ["layout entry 'language=dp2'", "KEY=FIELDS@FIRST-LAST"]),
    ("language=tp1=2@0-1", ["'language'", "field 'tp1=2' is not one of"]),
    ("language=dp2@@0-1", ["'language'", "field 'dp2@' is not one of"]),
    (" ; ", ["empty layout; write e.g."]),
    ("language=dp2@2-3;vision=dp3@0-2", ["partly overlap", "'language' (@2-3)", "'vision' (@0-2)"]),
    ("language=@3-2", ["'language'", "rank range 3-2 is empty or negative"]),
])
def test_invalid_layouts_name_module_field_and_fix(spec, words):
    with pytest.raises(LayoutError) as e:
        HeteroLayout.parse(spec).validate()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_world_size_mismatch():
    with pytest.raises(LayoutError, match="tile the world of 8 ranks"):
        HeteroLayout.parse("vision=dp4@0-3;language=tp2,cp2@0-3").validate(world_size=8)
    with pytest.raises(LayoutError, match=r"tile the world of 2 ranks exactly: ranks \[2, 3\] exceed the world"):
        HeteroLayout.parse("language=dp4@0-3").validate(world_size=2)


@pytest.mark.parametrize("shapes, words", [
    (ModelShapes(heads={"language": 6}), ["'language'", "tp=4", "6 attention heads", "[1, 2, 3, 6]"]),
    (ModelShapes(kv_heads={"language": 2}), ["'language'", "tp=4", "kv_heads"]),
    (ModelShapes(seq_length=100), ["'language'", "seq_length=100", "2*cp = 8", "pad"]),
    (ModelShapes(samples_per_microbatch=6), ["'vision'", "dp=4", "6 samples", "fan in/out to language dp=1, audio dp=2", "multiple of 4"]),
    # an MoE LLM with TP runs sequence parallel: each CP rank's 18 positions must split over tp=4
    (ModelShapes(seq_length=72, moe=True), ["'language'", "seq_length=72", "tp=4", "sequence", "multiple of 16"]),
])
def test_shape_validation(shapes, words):
    lay = HeteroLayout.parse("vision=dp4@0-3;language=tp4,cp4@4-19;audio=dp2,cp2@20-23")
    with pytest.raises(LayoutError) as e:
        lay.validate(shapes)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_valid_shapes_pass():
    lay = HeteroLayout.parse("vision=dp4@0-3;language=tp2,cp2@0-3")
    assert lay.validate(ModelShapes(heads={"language": 8, "vision": 4}, seq_length=64, samples_per_microbatch=8))


def test_sequence_parallel_length_rule_binds_only_moe_with_tp():
    lay = HeteroLayout.parse("vision=dp4@0-3;language=tp4,cp4@4-19;audio=dp2,cp2@20-23")
    lay.validate(ModelShapes(seq_length=72))             # dense: zigzag needs 2*cp | 72 only
    lay.validate(ModelShapes(seq_length=80, moe=True))   # 80 / cp4 = 20 positions, 5 per TP rank
    HeteroLayout.parse("language=cp4@0-3").validate(ModelShapes(seq_length=72, moe=True))  # tp1: no SP
    from tessera.hetero.plan.layout import llm_sequence_parallel  # the rule itself, from its edge: tp 2

    assert llm_sequence_parallel(True, 2) and not llm_sequence_parallel(True, 1) and not llm_sequence_parallel(False, 2)


def _dps(*sizes: int) -> HeteroLayout:
    """A layout whose modules have these DP sizes (rows_for_layout reads nothing else)."""
    keys, first, parts = ["vision", "audio", "language"][-len(sizes):], 0, []
    for key, dp in zip(keys, sizes):
        parts.append(f"{key}=dp{dp}@{first}-{first + dp - 1}")
        first += dp
    return HeteroLayout.parse(";".join(parts))


@pytest.mark.parametrize("spec,rows,micro,want", [
    ("vision=tp2,dp8@0-15;language=tp2,dp8@0-15", 8, 16, (8, 16)),        # fits: unchanged
    ("vision=tp2,dp32@0-63;language=tp2,dp32@0-63", 8, 16, (32, 4)),      # a 16-GPU recipe on 64 GPUs
    ("vision=dp2@0-1;language=dp6@2-7", 4, 6, (6, 4)),                     # lcm(2, 6) = 6 divides 24
    ("vision=dp3@0-2;language=dp4@3-6", 8, 6, (12, 4)),                    # lcm 12: the smallest >= 8 dividing 48
    ("language=dp1@0-0", 1, 1, (1, 1)),                                    # the smallest run
    ("vision=dp2@0-1;language=dp3@2-4", 6, 1, (6, 1)),                     # neither DP divides the other; lcm does
    ("vision=dp2@0-1;language=dp3@2-4", 12, 5, (12, 5)),                   # a multiple of the lcm: unchanged
    ("vision=dp4@0-3;language=dp4@4-7", 2, 8, (4, 4)),                     # the next multiple divides 16
    ("vision=dp4@0-3;language=dp4@4-7", 6, 4, (8, 3)),                     # 8 divides 24
    ("vision=dp4@0-3;language=dp4@4-7", 5, 4, (20, 1)),                    # 8, 12, 16 do not divide 20: the step
    ("vision=tp2,dp512@0-1023;language=tp2,dp512@0-1023", 8, 64, (512, 1)),  # 16-GPU recipe on 1024: one microbatch
])
def test_rows_per_microbatch_follow_the_layout_and_keep_the_step(spec, rows, micro, want):
    from tessera.hetero.plan.layout import rows_for_layout

    layout = HeteroLayout.parse(spec)
    got = rows_for_layout(layout, rows, micro)
    assert got[0] * got[1] == rows * micro
    assert all(got[0] % m.dp_size == 0 for m in layout.modules.values())
    assert got == want and all(type(n) is int for n in got)  # whole rows and microbatches, not 2.0


@pytest.mark.parametrize("spec,rows,micro,need", [
    ("vision=dp4@0-3;language=dp4@4-7", 2, 3, 4),                          # no multiple of 4 divides 6 rows
    ("language=dp2@0-1", 1, 1, 2),                                         # one row for two DP ranks
    ("vision=dp2@0-1;language=dp3@2-4", 4, 1, 6),                          # lcm 6 > the step's 4 rows
    ("vision=tp2,dp1024@0-2047;language=tp2,dp1024@0-2047", 8, 64, 1024),  # 512 rows for 1024 DP ranks
])
def test_rows_for_layout_refuses_a_step_no_split_fits_and_names_the_fix(spec, rows, micro, need):
    from tessera.hetero.plan.layout import rows_for_layout

    layout = HeteroLayout.parse(spec)
    with pytest.raises(LayoutError) as e:
        rows_for_layout(layout, rows, micro)
    dps = ", ".join(f"{k} dp={m.dp_size}" for k, m in layout.modules.items())
    for words in (str(layout), dps, f"a multiple of {need}", f"the step's {rows * micro} rows",
                  f"data.rows_per_microbatch={rows} x data.microbatches={micro}",
                  f"use a step of a multiple of {need} rows or change dp"):
        assert words in str(e.value), (words, str(e.value))


def test_rows_for_layout_against_a_brute_force_search():
    """Every small case: unchanged when every DP divides the rows; else the fewest rows >= the configured ones
    that every DP divides and that divide the step (found by trying every row count); else an error."""
    from tessera.hetero.plan.layout import rows_for_layout

    for sizes in [(1,), (2,), (3,), (2, 3), (4, 4), (2, 6), (4, 6), (2, 3, 4), (8, 1)]:
        layout = _dps(*sizes)
        for rows in range(1, 13):
            for micro in range(1, 9):
                step = rows * micro
                ok = [r for r in range(1, step + 1) if step % r == 0 and all(r % d == 0 for d in sizes)]
                if all(rows % d == 0 for d in sizes):
                    want = (rows, micro)
                elif ok:
                    r = min(r for r in ok if r >= rows)
                    want = (r, step // r)
                else:
                    with pytest.raises(LayoutError):
                        rows_for_layout(layout, rows, micro)
                    continue
                assert rows_for_layout(layout, rows, micro) == want, (sizes, rows, micro)


def test_a_gap_in_the_ranges_is_not_fixed_by_a_world_size():
    """Issue 62 item 7: ranges leaving rank 2 unused said "(or launch with world size 5)" to a world of 5."""
    with pytest.raises(LayoutError) as e:
        HeteroLayout.parse("vision=dp2@0-1;language=dp2@3-4").validate(world_size=5)
    assert str(e.value) == ("rank ranges must tile the world of 5 ranks exactly: ranks [2] belong to no module; "
                            "adjust the @FIRST-LAST ranges to cover them")
    with pytest.raises(LayoutError, match=r"ranks \[4, 5\] belong to no module; adjust the @FIRST-LAST ranges "
                                          r"\(or launch with world size 4\)"):
        HeteroLayout.parse("vision=dp2@0-1;language=dp2@2-3").validate(world_size=6)
