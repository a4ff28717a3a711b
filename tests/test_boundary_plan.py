"""Boundary plans over hundreds of generated layouts, checked against a brute-force oracle (pure, fast).

For every layout: simulating the forward plan delivers to every first-stage destination rank exactly the
elements it holds in its own layout (each row written once, by a rank that holds the element); bytes
equal the minimum; the backward plan gives every last-stage source rank each of its elements' gradient
exactly once; and at the (dp, cp) shard level the backward plan is the forward plan transposed.
"""

import itertools
import math
import time

import numpy as np
import pytest

from tessera.hetero.plan.boundary_plan import BoundaryBatch, BoundaryError, minimum_rows, plan_boundary
from tessera.hetero.plan.layout import HeteroLayout, ModuleLayout


# ------------------------------------------------------------------------------------------- oracle
def oracle_source_rows(src: ModuleLayout, batch: BoundaryBatch) -> dict[int, list[int]]:
    """Last-stage source rank -> element ids in its row order: np.array_split of the tokens its DP rank holds of
    each sample (the sample's, or with `sources` the tokens of the items assigned to it)."""
    n, offsets = batch.num_samples, np.r_[0, np.cumsum(batch.tokens_per_sample)]
    out = {}
    for rank in src.ranks:
        c = src.coord(rank)
        if c.pp != src.pp - 1:
            continue
        per, out[rank] = n // src.dp_size, []
        for i in range(n):
            ids = np.arange(offsets[i], offsets[i + 1])
            held = ids[batch.sources[i] == c.dp] if batch.sources is not None else (
                ids if c.dp * per <= i < (c.dp + 1) * per else ids[:0])
            out[rank] += [int(g) for g in np.array_split(held, src.cp)[c.cp]]
    return out


def oracle_dest_rows(dst: ModuleLayout, batch: BoundaryBatch, fmt: str) -> dict[int, dict[int, int]]:
    """First-stage destination rank -> {row: element id} (zigzag chunks r and 2cp-1-r)."""
    n, seq, offsets = batch.num_samples, batch.seq_length, np.r_[0, np.cumsum(batch.tokens_per_sample)]
    chunk = seq // (2 * dst.cp)
    out = {}
    for rank in dst.ranks:
        c = dst.coord(rank)
        if c.pp != 0:
            continue
        mine = [p for p in range(seq) if p // chunk in (c.cp, 2 * dst.cp - 1 - c.cp)]
        per, rows, row = n // dst.dp_size, {}, 0
        for local, i in enumerate(range(c.dp * per, (c.dp + 1) * per)):
            for j, p in enumerate(batch.positions[i]):
                if p in mine:
                    key = row if fmt == "tokens" else local * len(mine) + mine.index(p)
                    rows[key] = int(offsets[i] + j)
                    row += 1
        out[rank] = rows
    return out


def shard_of(layout: ModuleLayout, rank: int) -> tuple[int, int]:
    c = layout.coord(rank)
    return c.dp, c.cp


# ----------------------------------------------------------------------------------------- generator
def random_layouts(count: int, seed: int = 0):
    """(src, dst) layout pairs: colocated and non-colocated, every parallel size 1-4, worlds up to 32."""
    rng = np.random.default_rng(seed)
    made = 0
    while made < count:
        sizes = [rng.choice([1, 1, 2, 2, 3, 4], size=4) for _ in range(2)]  # tp, cp, pp, dp per side
        src_sz, dst_sz = (int(np.prod(s)) for s in sizes)
        colocated = rng.random() < 0.5
        if colocated and src_sz != dst_sz:
            # make the destination fit the same ranks by re-deriving its dp
            mp = int(np.prod(sizes[1][:3]))
            if src_sz % mp:
                continue
            sizes[1][3] = src_sz // mp
            dst_sz = src_sz
        if max(src_sz, dst_sz) > 32 or (not colocated and src_sz + dst_sz > 32):
            continue
        tp, cp, pp, dp = (int(v) for v in sizes[0])
        src = ModuleLayout(first=0, last=src_sz - 1, tp=tp, cp=cp, pp=pp, dp=dp)
        tp, cp, pp, dp = (int(v) for v in sizes[1])
        first = 0 if colocated else src_sz
        dst = ModuleLayout(first=first, last=first + dst_sz - 1, tp=tp, cp=cp, pp=pp, dp=dp)
        yield src, dst, rng
        made += 1


def random_batch(src, dst, rng, uniform=False, items=False) -> BoundaryBatch:
    """items: each sample's tokens cut into 1-3 contiguous items, each encoded by a random source DP rank (the
    loader's assignment by cost: hetero/plan/encoder_balance.ItemAssignment)."""
    n = math.lcm(src.dp_size, dst.dp_size) * int(rng.integers(1, 3))
    seq = 2 * dst.cp * int(rng.integers(1, 6))
    fixed = int(rng.integers(0, seq + 1))
    counts = [fixed if uniform else int(rng.integers(0, seq + 1)) for _ in range(n)]
    positions = [np.sort(rng.choice(seq, c, replace=False)) for c in counts]
    if not items:
        return BoundaryBatch.from_lists(seq, positions)
    sources = []
    for c in counts:
        cuts = np.sort(rng.choice(np.arange(1, c), min(c - 1, int(rng.integers(0, 3))), replace=False)) if c > 1 else []
        bounds = np.asarray([0, *cuts, c], dtype=np.int64)
        sources.append(np.repeat(rng.integers(0, src.dp_size, len(bounds) - 1), np.diff(bounds)))
    return BoundaryBatch.from_lists(seq, positions, sources)


# -------------------------------------------------------------------------------------------- checks
def simulate(direction, in_tables: dict[int, dict[int, int]], out_rows: dict[int, int]):
    """Run a direction plan on element-id tables; returns rank -> {row: element id} and write counts."""
    out = {r: {} for r in out_rows}
    writes = {r: np.zeros(out_rows[r], int) for r in out_rows}
    for t in direction.transfers:
        for s, d in zip(t.src_index, t.dst_index):
            assert s in in_tables[t.src_rank], "a transfer reads a row its sender does not hold"
            out[t.dst_rank][int(d)] = in_tables[t.src_rank][int(s)]
            writes[t.dst_rank][int(d)] += 1
    return out, writes


def check_plan(src, dst, batch, fmt):
    plan = plan_boundary(src, dst, batch, fmt)
    src_rows = {r: dict(enumerate(ids)) for r, ids in oracle_source_rows(src, batch).items()}
    dst_rows = oracle_dest_rows(dst, batch, fmt)
    assert plan.forward.in_rows == {r: len(v) for r, v in src_rows.items()}

    got, writes = simulate(plan.forward, src_rows, plan.forward.out_rows)
    assert got == dst_rows
    if fmt == "dense":  # where the LLM puts the media: exactly the rows of the batch's positions on that rank
        for r, rows in dst_rows.items():
            assert set(np.flatnonzero(plan.written(r))) == set(rows)
    for r in dst_rows:
        assert np.all(writes[r][list(dst_rows[r])] == 1), "an element delivered twice"
        assert writes[r].sum() == len(dst_rows[r])

    back, bwrites = simulate(plan.backward, dst_rows, plan.backward.out_rows)
    assert back == src_rows, "a source replica lacks (or gets a wrong) gradient row"
    assert all(np.all(w == 1) for w in bwrites.values()), "a gradient row counted twice"

    fwd_min, bwd_min = minimum_rows(src, dst, batch)
    assert plan.forward.rows_moved() == fwd_min and plan.backward.rows_moved() == bwd_min
    # brute-force minimum: rows a rank needs that it does not hold itself in the other layout
    need = sum(len(set(v.values()) - set(src_rows.get(r, {}).values())) for r, v in dst_rows.items())
    need_back = sum(len(set(v.values()) - set(dst_rows.get(r, {}).values())) for r, v in src_rows.items())
    assert (fwd_min, bwd_min) == (need, need_back)

    def shard_edges(direction, a, b, table):
        return {(shard_of(a, t.src_rank), shard_of(b, t.dst_rank), table[t.src_rank][int(s)])
                for t in direction.transfers for s in t.src_index}

    fwd = shard_edges(plan.forward, src, dst, src_rows)
    bwd = shard_edges(plan.backward, dst, src, dst_rows)
    assert bwd == {(b, a, g) for a, b, g in fwd}, "backward is not the shard-level transpose of forward"


def test_two_hundred_generated_layouts_in_milliseconds():
    start, cases = time.perf_counter(), 0
    for src, dst, rng in random_layouts(220):
        batch = random_batch(src, dst, rng)
        check_plan(src, dst, batch, "tokens")
        cases += 1
    assert cases >= 200
    per_case_ms = (time.perf_counter() - start) * 1000 / cases
    print(f"{cases} layouts, {per_case_ms:.1f} ms per layout including the brute-force oracle")


def test_items_encoded_where_the_assignment_put_them_over_generated_layouts():
    """Items of a sample encoded on several source DP ranks (issue 35): every destination still receives exactly
    its elements once, from a rank that holds them, at the minimum bytes, and gradients go back transposed."""
    for src, dst, rng in random_layouts(200, seed=5):
        batch = random_batch(src, dst, rng, items=True)
        check_plan(src, dst, batch, "tokens" if rng.random() < 0.5 else "dense")
    with pytest.raises(BoundaryError, match="outside the encoder's dp=2"):
        plan_boundary(ModuleLayout(0, 1, dp=2), ModuleLayout(2, 3, dp=2),
                      BoundaryBatch.from_lists(4, [[0, 1], [2]], [[0, 2], [1]]))


def test_dense_destination_format():
    for src, dst, rng in itertools.islice(random_layouts(60, seed=1), 60):
        check_plan(src, dst, random_batch(src, dst, rng), "dense")


def test_colocated_rows_that_stay_are_never_sent():
    lay = HeteroLayout.parse("vision=dp4@0-3;language=dp4@0-3")
    batch = BoundaryBatch.from_lists(8, [[0, 3], [1, 2, 5], [7], [4, 6]])
    plan = plan_boundary(lay["vision"], lay["language"], batch)
    assert plan.forward.rows_moved() == 0 and plan.backward.rows_moved() == 0
    assert all(t.local for t in plan.forward.transfers)


def test_destination_cp_gets_only_its_zigzag_chunks():
    # language cp=2 on seq 8: CP rank 0 holds positions 0,1,6,7; rank 1 holds 2..5
    lay = HeteroLayout.parse("vision=dp1@0-0;language=cp2@1-2")
    batch = BoundaryBatch.from_lists(8, [[0, 2, 5, 7]])
    plan = plan_boundary(lay["vision"], lay["language"], batch)
    assert plan.forward.out_rows == {1: 2, 2: 2}
    sent = {t.dst_rank: list(t.src_index) for t in plan.forward.transfers}
    assert sent == {1: [0, 3], 2: [1, 2]}


def test_bad_metadata_is_rejected_with_a_fix():
    lay = HeteroLayout.parse("vision=dp2@0-1;language=cp2@0-1")
    with pytest.raises(BoundaryError, match="dp=2 does not divide the 3 samples"):
        plan_boundary(lay["vision"], lay["language"], BoundaryBatch.from_lists(8, [[1], [2], [3]]))
    with pytest.raises(BoundaryError, match="not divisible by 2\\*cp=4"):
        plan_boundary(lay["vision"], lay["language"], BoundaryBatch.from_lists(6, [[1], [2]]))
    with pytest.raises(BoundaryError, match="sample 1: media positions must lie in \\[0, 8\\)"):
        plan_boundary(lay["vision"], lay["language"], BoundaryBatch.from_lists(8, [[1], [9]]))
    with pytest.raises(BoundaryError, match="strictly increasing"):
        plan_boundary(lay["vision"], lay["language"], BoundaryBatch.from_lists(8, [[3, 1], [2]]))
    with pytest.raises(BoundaryError, match="sample 0: media positions must be strictly increasing"):
        plan_boundary(lay["vision"], lay["language"], BoundaryBatch.from_lists(8, [[1, 1], [2]]))  # a duplicate


def test_media_positions_at_the_edges_of_the_sequence():
    """[0, seq_length): the first and last positions are accepted, one past either end is refused."""
    lay = HeteroLayout.parse("vision=dp2@0-1;language=cp2@0-1")
    plan_boundary(lay["vision"], lay["language"], BoundaryBatch.from_lists(8, [[0, 7], [7]]))
    for bad in ([[1], [8]], [[-1], [2]], [[0, 8], [1]]):
        with pytest.raises(BoundaryError, match="must lie in \\[0, 8\\)"):
            plan_boundary(lay["vision"], lay["language"], BoundaryBatch.from_lists(8, bad))


# ------------------------------------------------------------------------------- TP replicas share sending
def _check_round_robin(plan, src: ModuleLayout, dst: ModuleLayout):
    """_receivers' rule: receiving TP replica t reads every row it does not hold from sending replica
    t % (sender's tp) of the shard that holds it (forward: source replicas; backward: destination ones)."""
    for direction, send, recv in ((plan.forward, src, dst), (plan.backward, dst, src)):
        for t in direction.transfers:
            if t.local:
                continue
            s, r = send.coord(t.src_rank), recv.coord(t.dst_rank)
            assert s.tp == r.tp % send.tp, (t.src_rank, t.dst_rank, s, r)


def _sent_rows(direction) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in direction.transfers:
        if not t.local:
            out[t.src_rank] = out.get(t.src_rank, 0) + len(t.src_index)
    return out


def test_source_tp_replicas_share_the_sending():
    # vision tp2,dp2 on 0-3 -> language tp4 on 4-7: language TP rank t reads from vision TP rank t % 2.
    lay = HeteroLayout.parse("vision=tp2,dp2@0-3;language=tp4@4-7")
    src, dst = lay["vision"], lay["language"]
    batch = BoundaryBatch.from_lists(16, [[0, 3, 5], [2, 7, 8, 9, 15]])  # sample 0 on vision dp0, 1 on dp1
    plan = plan_boundary(src, dst, batch)
    _check_round_robin(plan, src, dst)
    senders = {(t.dst_rank, t.src_rank): len(t.src_index) for t in plan.forward.transfers}
    # vision ranks: 0 = (tp0, dp0), 1 = (tp1, dp0), 2 = (tp0, dp1), 3 = (tp1, dp1)
    assert senders == {(4, 0): 3, (4, 2): 5, (5, 1): 3, (5, 3): 5, (6, 0): 3, (6, 2): 5, (7, 1): 3, (7, 3): 5}
    # every vision rank sends its shard to two of the four language replicas: balanced across TP replicas
    assert _sent_rows(plan.forward) == {0: 6, 1: 6, 2: 10, 3: 10}
    # backward: vision TP rank s gets its gradient rows from language TP rank s % 4 (= s): ranks 4 and 5
    back = {(t.src_rank, t.dst_rank): len(t.src_index) for t in plan.backward.transfers}
    assert back == {(4, 0): 3, (4, 2): 5, (5, 1): 3, (5, 3): 5}


def test_destination_tp_replicas_share_the_gradient_sending():
    # vision tp4 on 0-3 -> language tp2 on 4-5: forward uses vision TP ranks 0 and 1 (t % 4 for t < 2);
    # backward vision TP rank s reads from language TP rank s % 2, so both language ranks send twice.
    lay = HeteroLayout.parse("vision=tp4@0-3;language=tp2@4-5")
    src, dst = lay["vision"], lay["language"]
    plan = plan_boundary(src, dst, BoundaryBatch.from_lists(8, [[1, 2, 6]]))
    _check_round_robin(plan, src, dst)
    assert {(t.src_rank, t.dst_rank) for t in plan.forward.transfers} == {(0, 4), (1, 5)}
    assert {(t.src_rank, t.dst_rank) for t in plan.backward.transfers} == {(4, 0), (5, 1), (4, 2), (5, 3)}
    assert _sent_rows(plan.backward) == {4: 6, 5: 6}


def test_colocated_tp_replicas_keep_their_own_rows_and_share_the_rest():
    # vision tp2,dp2 and language tp4 on the same ranks 0-3: rank r holds vision (tp r%2, dp r//2); it keeps
    # that shard's rows locally and reads the other dp shard from the vision rank of its own TP parity.
    lay = HeteroLayout.parse("vision=tp2,dp2@0-3;language=tp4@0-3")
    src, dst = lay["vision"], lay["language"]
    plan = plan_boundary(src, dst, BoundaryBatch.from_lists(8, [[0, 3], [1, 4, 6]]))
    _check_round_robin(plan, src, dst)
    moved = {(t.src_rank, t.dst_rank): len(t.src_index) for t in plan.forward.transfers if not t.local}
    kept = {t.dst_rank: len(t.src_index) for t in plan.forward.transfers if t.local}
    assert kept == {0: 2, 1: 2, 2: 3, 3: 3}
    assert moved == {(2, 0): 3, (3, 1): 3, (0, 2): 2, (1, 3): 2}


def test_round_robin_sender_over_generated_layouts():
    """Every generated layout follows the rule, and when the receiving TP is a multiple of the sending TP
    each (dp, cp) shard's TP replicas send exactly the same number of rows."""
    balanced = 0
    for src, dst, rng in random_layouts(150, seed=3):
        batch = random_batch(src, dst, rng)
        plan = plan_boundary(src, dst, batch)
        _check_round_robin(plan, src, dst)
        colocated = src.first == dst.first
        for direction, send, recv in ((plan.forward, src, dst), (plan.backward, dst, src)):
            if colocated or recv.tp % send.tp:
                continue
            sent = _sent_rows(direction)
            rows_of: dict[tuple, set] = {}
            replicas: dict[tuple, set] = {}
            for rank, rows in sent.items():
                c = send.coord(rank)
                rows_of.setdefault((c.dp, c.cp, c.pp), set()).add(rows)
                replicas.setdefault((c.dp, c.cp, c.pp), set()).add(c.tp)
            for shard in rows_of:
                # all TP replicas of a sending shard send, and the same number of rows each
                assert replicas[shard] == set(range(send.tp)) and len(rows_of[shard]) == 1, (send, recv, shard, sent)
                balanced += send.tp > 1
    assert balanced > 50
