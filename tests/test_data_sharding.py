"""Layout-aware sharding: for every module, the union over its DP ranks is the global microbatch with no
duplicates; TP/CP/PP peers of a DP rank hold the same rows; BoundaryBatch mirrors the packed positions."""

import numpy as np
import pytest

from tessera.data.packing import EncodedSample, collate, pack_row
from tessera.data.sharding import dp_rows, shard_for_rank
from tessera.data.tokens import EncodedPrompt
from tessera.hetero.plan.layout import HeteroLayout, ModelShapes

LAYOUTS = [
    "vision=dp4@0-3;audio=dp4@0-3;language=tp2,cp2@0-3",  # colocated, LLM dp1
    "vision=dp4@0-3;audio=dp4@0-3;language=tp2@0-3",  # colocated, LLM dp2
    "vision=dp2@0-1;audio=dp1@2-2;language=tp2,dp2@3-6",  # non-colocated, three ranges
    "vision=tp2,dp2@0-3;audio=dp2@4-5;language=dp4,pp2@6-13",  # non-colocated with pp
    "vision=dp8@0-7;audio=dp8@0-7;language=tp4,dp2@0-7",
]


def _sample(key: str, spans: list[tuple[str, int, int]], length: int) -> EncodedSample:
    target = np.zeros(length, dtype=bool)
    target[-3:] = True
    prompt = EncodedPrompt(np.arange(length, dtype=np.int32) % 50 + 10, target,
                           [(m, s, n, i) for i, (m, s, n) in enumerate(spans)])
    media = [(m, "image" if m == "vision" else "audio", n, np.zeros(n)) for m, _, n in spans]
    return EncodedSample(__key__=key, __restore_key__=(), prompt=prompt, raw_media=[], media=media,
                         units=[n for _, _, n in spans], shard="s")


def _global_batch(rows: int, seq: int = 64):
    rng = np.random.default_rng(0)
    packed = []
    for r in range(rows):
        samples, used = [], 0
        for j in range(3):
            n = int(rng.integers(12, 20))  # the 3 target tokens come after every media span (the contract)
            a = int(rng.integers(1, 4))
            samples.append(_sample(f"r{r}s{j}", [("vision", 2, a + 1), ("audio", a + 4, 2)] if j != 1 else [], n))
            used += n
        packed.append(pack_row(samples, seq, pad_id=0))
    return collate(packed, {})


@pytest.mark.parametrize("spec", LAYOUTS)
def test_union_over_dp_ranks_is_the_global_batch(spec):
    layout = HeteroLayout.parse(spec)
    n = 8
    layout.validate(ModelShapes(samples_per_microbatch=n))
    batch = _global_batch(n)
    all_keys = [k for row in batch.keys for k in row]
    for module in layout.modules:
        by_dp: dict[int, list[str]] = {}
        for rank in range(layout.world_size):
            shard = shard_for_rank(batch, layout, rank).get(module)
            if shard is None:
                assert layout[module].coord(rank) is None
                continue
            # Peers (same DP coordinate, other tp/cp/pp) must hold identical rows.
            assert by_dp.setdefault(shard.dp_rank, shard.keys) == shard.keys
            if module != "language":
                # Encoder ranks hold exactly the media and positions of their rows.
                for i, row in enumerate(shard.rows):
                    np.testing.assert_array_equal(shard.batch.positions[i].get(module, []),
                                                  batch.positions[row].get(module, []))
                    assert len(shard.media()[i]) == len(batch.media[row].get(module, []))
        union = [k for d in sorted(by_dp) for k in by_dp[d]]
        assert len(by_dp) == layout[module].dp_size
        assert union == all_keys and len(set(union)) == len(union), module


def test_boundary_batches_mirror_positions():
    batch = _global_batch(4)
    bb = batch.boundary_batches()
    assert set(bb) == {"vision", "audio"}
    for module, b in bb.items():
        assert b.seq_length == 64 and len(b.positions) == 4
        for r, pos in enumerate(b.positions):
            assert pos.dtype == np.int64
            # Samples 0 and 2 of each row carry one item per module at a known in-sample offset; sample 1
            # has none. Rebuild the expected packed positions from cu_seqlens and the item sizes.
            cu = batch.cu_seqlens[r].tolist()
            sizes = [len(item) for _, item in batch.media[r][module]]
            vision = [len(item) for _, item in batch.media[r]["vision"]]
            offsets = [2, 2] if module == "vision" else [vision[0] + 3, vision[1] + 3]
            want = np.concatenate([np.arange(cu[j] + o, cu[j] + o + n) for j, o, n in zip((0, 2), offsets, sizes)])
            np.testing.assert_array_equal(pos, want)


def test_uneven_split_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot be split evenly over dp=3"):
        dp_rows(8, 3, 0)
    assert list(dp_rows(8, 4, 3)) == [6, 7]


def test_every_collated_batch_is_checked_and_a_broken_one_names_its_row():
    """Issue 34: collate runs PackedBatch.check on every batch. Two media items whose tokens overlap (a wrong
    offset between items of one row) or a loss on the token before a media slot are refused, naming the row,
    its samples and the module; assert statements would vanish under python -O."""
    batch = _global_batch(2)  # collate checked it: a good batch passes
    vision = batch.positions[1]["vision"]
    assert len(vision) >= 2
    dup = vision.copy()
    dup[1] = dup[0]
    batch.positions[1]["vision"] = dup
    with pytest.raises(ValueError, match=r"packed row 1 \(r1s0, r1s1, r1s2\) vision: media positions not strictly"):
        batch.check()
    batch.positions[1]["vision"] = vision
    batch.labels[1, int(vision[0]) - 1] = 7
    with pytest.raises(ValueError, match="packed row 1 .* vision: a loss on the token before a media slot"):
        batch.check()
