"""Packing: the first-fit-decreasing packer's exact bins, and the loss mask of packed rows.

The loss mask is checked against the token stream itself: in every packed sample the labelled positions
are exactly the positions *before* each assistant content token and its closing <|im_end|> (position k-1
predicts token k), the label is that next token, and nothing is labelled across a sample boundary or in
the padding. The assistant spans are found independently of `EncodedPrompt.target`, by locating
"<|im_start|>assistant\\n" in the tokens and reading up to the next <|im_end|>.
"""

import numpy as np
import pytest

from tessera.data.packing import IGNORE, EncodedSample, first_fit_decreasing, pack_row
from tessera.data.templates import TEMPLATES
from tessera.data.tokens import IM_END, IM_START, EncoderTokens, Tokenizer, encode_conversation, train_sentencepiece

TEXTS = ["Describe the image.", "A red circle on a blue background.", "What happens in this video?",
         "user\n", "assistant\n", "system\n", "The tone is steady and the square moves.", "Yes.", "No, it is green."] * 20

ENC = EncoderTokens(patch=64)  # 16 tokens per tile, as tests/test_data_loader.py

# (turns, media kinds, media units) — units are tiles / frames / 16 kHz samples, sized by ENC as the loader does.
CONVERSATIONS = [
    ([{"role": "user", "content": "<image>\nDescribe the image."},
      {"role": "assistant", "content": "A red circle on a blue background."}], ["image"], [2]),
    ([{"role": "system", "content": "You describe media."},
      {"role": "user", "content": "What happens in this video? <video>"},
      {"role": "assistant", "content": "The square moves."},
      {"role": "user", "content": "<audio> and the tone?"},
      {"role": "assistant", "content": "The tone is steady."}], ["video", "audio"], [2, 16000]),
    ([{"role": "user", "content": "Is it red?"}, {"role": "assistant", "content": "Yes."}], [], []),
    ([{"role": "user", "content": "<image> Is it blue?"},
      {"role": "assistant", "content": "No, it is green."}], ["image"], [1]),
    ([{"role": "user", "content": "Describe the image."},
      {"role": "assistant", "content": "A red circle."},
      {"role": "user", "content": "And then?"},
      {"role": "assistant", "content": "The square moves."}], [], []),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(train_sentencepiece(TEXTS, tmp_path_factory.mktemp("tok") / "sp", vocab_size=200))


def _encoded(tok, i, turns, kinds, units) -> EncodedSample:
    prompt = encode_conversation(tok, turns, kinds, [ENC.tokens(k, u) for k, u in zip(kinds, units)])
    return EncodedSample(__key__=f"s{i}", __restore_key__=(), prompt=prompt,
                         raw_media=[(k, b"") for k in kinds], media=[], units=list(units), shard="shard0")


def _assistant_targets(tok, tokens: np.ndarray) -> list[int]:
    """Positions (in `tokens`) of every assistant content token and its closing <|im_end|>."""
    head = [tok.special[IM_START]] + tok.encode("assistant\n")
    end = tok.special[IM_END]
    out, t = [], tokens.tolist()
    for s in range(len(t) - len(head) + 1):
        if t[s:s + len(head)] == head:
            k = s + len(head)
            while t[k] != end:
                out.append(k)
                k += 1
            out.append(k)  # the closing <|im_end|> is a target too
    return out


def test_labels_are_exactly_each_samples_next_assistant_token(tok):
    samples = [_encoded(tok, i, *c) for i, c in enumerate(CONVERSATIONS)]
    lengths = [len(s) for s in samples]
    seq = 64 * ((max(lengths) + 40) // 64 + 1)
    bins = first_fit_decreasing(lengths, seq)
    assert len(bins) < len(samples), "the fixture should put several samples into one row"
    seen = []
    for b in bins:
        row = pack_row([samples[i] for i in b], seq, tok.pad_id)
        cu = row.cu_seqlens.tolist()
        want = np.full(seq, IGNORE, dtype=np.int64)
        for k, i in enumerate(b):
            s, o = samples[i], cu[k]
            assert cu[k + 1] - o == len(s) and row.keys[k] == s.__key__
            np.testing.assert_array_equal(row.tokens[o:o + len(s)], s.prompt.tokens)
            targets = _assistant_targets(tok, s.prompt.tokens)
            # the assistant answers of this sample, in order, each closed by <|im_end|>
            answers = [t for turn in CONVERSATIONS[i][0] if turn["role"] == "assistant"
                       for t in tok.encode(turn["content"]) + [tok.special[IM_END]]]
            assert s.prompt.tokens[targets].tolist() == answers
            for k_tok in targets:
                assert k_tok >= 1
                want[o + k_tok - 1] = s.prompt.tokens[k_tok]  # position k-1 predicts token k
            seen.append(i)
        labelled = np.flatnonzero(row.labels != IGNORE).tolist()
        assert labelled == np.flatnonzero(want != IGNORE).tolist(), "loss mask is not the assistant tokens"
        np.testing.assert_array_equal(row.labels, want)
        # never across a boundary: each sample's last position (and all padding) predicts nothing
        for end in cu[1:]:
            assert row.labels[end - 1] == IGNORE
        assert (row.labels[cu[len(b)]:] == IGNORE).all() and (row.tokens[cu[len(b)]:] == tok.pad_id).all()
        media = {tok.special[t] for t in TEMPLATES["omni"].special_tokens}  # placeholders and their wrappers
        assert not media & set(row.labels[row.labels != IGNORE].tolist())
    assert sorted(seen) == list(range(len(samples)))


# ---------------------------------------------------------------------------------- first_fit_decreasing
def _check_bins(lengths, capacity, bins):
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths))), "every item exactly once"
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins), "a bin over capacity"
    assert all(b == sorted(b) for b in bins), "items keep stream order inside a bin"


@pytest.mark.parametrize("lengths,capacity,bins", [
    # sorted: 7(5) 6(0) 5(2) 5(3) 4(1) 3(4); the second 5 exactly fills bin 2, the 4 exactly fills bin 1
    # (room 4 after the 6) and the 3 exactly fills bin 0 (room 3 after the 7): three full bins.
    ([6, 4, 5, 5, 3, 7], 10, [[4, 5], [0, 1], [2, 3]]),
    # one item of exactly the capacity gets a bin of its own, and nothing else fits next to it
    ([10, 3, 7, 10], 10, [[0], [3], [1, 2]]),
    # first fit, not best fit: after 12 | 10+9 the 1 goes to the first bin with room (bin 0, room 8), not to
    # the tighter bin 1 (room 1)
    ([12, 10, 9, 1], 20, [[0, 3], [1, 2]]),
    # ties by index: the equal 5s are placed in index order (5 at index 1 opens bin 0)
    ([4, 5, 5, 5, 1], 10, [[1, 2], [0, 3, 4]]),
    ([], 8, []),
])
def test_first_fit_decreasing_exact_bins(lengths, capacity, bins):
    got = first_fit_decreasing(lengths, capacity)
    assert got == bins
    _check_bins(lengths, capacity, got)


def test_first_fit_decreasing_is_first_fit_over_decreasing_lengths():
    """Random lengths: besides the invariants, every item went to the first bin it fitted in at its turn
    (replaying the placements in decreasing-length order), and a new bin only when none had room."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        capacity = int(rng.integers(8, 40))
        lengths = [int(v) for v in rng.integers(1, capacity + 1, size=int(rng.integers(1, 25)))]
        bins = first_fit_decreasing(lengths, capacity)
        _check_bins(lengths, capacity, bins)
        where = {i: k for k, b in enumerate(bins) for i in b}
        # bins are opened in placement order: by their longest item (lowest index among ties)
        firsts = [min(b, key=lambda i: (-lengths[i], i)) for b in bins]
        assert firsts == sorted(firsts, key=lambda i: (-lengths[i], i))
        used = [0] * len(bins)
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            fits = [k for k in range(len(bins)) if used[k] and used[k] + lengths[i] <= capacity]
            assert where[i] == (fits[0] if fits else used.index(0)), (lengths, capacity, bins, i)
            used[where[i]] += lengths[i]


@pytest.mark.parametrize("tubelets,per,kept,nominal", [
    (3, 4, 6, [4, 1, 1]), (3, 4, 7, [4, 2, 1]), (4, 25, 50, [25, 9, 8, 8]), (2, 4, 4, [4, 0]), (1, 9, 9, [9]),
    (3, 4, 12, [4, 4, 4])])
def test_evs_nominal_tubelet_counts_keep_the_first_whole_and_spread_the_rest(tubelets, per, kept, nominal):
    from tessera.models.media_tokens import evs_nominal_tubelet_counts

    assert evs_nominal_tubelet_counts(tubelets, per, kept) == nominal


@pytest.mark.parametrize("tubelets,per,kept", [(3, 4, 3), (3, 4, 13), (0, 4, 4)])
def test_evs_nominal_tubelet_counts_refuse_a_total_that_does_not_fit(tubelets, per, kept):
    from tessera.models.media_tokens import evs_nominal_tubelet_counts

    with pytest.raises(ValueError, match="do not fit"):
        evs_nominal_tubelet_counts(tubelets, per, kept)


def test_settling_a_pruned_clips_chunks_moves_them_and_the_text_between(tok):
    """A pruned clip of 3 tubelets (4 tokens each, 6 kept) in the omni template: written at the nominal counts
    [4, 1, 1]; settled to [4, 2, 0] it is exactly the prompt written with those counts (the release's layout of
    the same choice, an empty last chunk included), positions and labels alike; counts that do not sum to what
    was kept are refused, naming the item."""
    import dataclasses

    import torch

    from tessera.data.packing import collate
    from tessera.data.tokens import media_placeholders

    enc = dataclasses.replace(ENC, video_temporal=2, video_pruning=0.5)
    turns = [{"role": "user", "content": "Watch <video> now."}, {"role": "assistant", "content": "It moves."}]

    def row(chunks):
        prompt = encode_conversation(tok, turns, ["video"], [chunks], "omni")
        s = EncodedSample(__key__="v", __restore_key__=(), prompt=prompt, raw_media=[("video", b"")], media=[],
                          units=[5], shard="shard0")
        return collate([pack_row([s], len(prompt) + 3, tok.pad_id)], {})

    nominal = media_placeholders(dataclasses.replace(enc, patch=128), "omni", "video", 5)  # 4 tokens a tubelet
    assert [n for _, n in nominal] == [4, 1, 1]
    batch, want = row(nominal), row([(label, n) for (label, _), n in zip(nominal, [4, 2, 0])])
    ((r, j, chunks),) = batch.chunked_items("vision")
    assert [n for _, n in chunks] == [4, 1, 1]
    batch.settle_tubelet_chunks("vision", {(r, j): [4, 2, 0]})
    assert torch.equal(batch.tokens, want.tokens) and torch.equal(batch.labels, want.labels)
    np.testing.assert_array_equal(batch.positions[0]["vision"], want.positions[0]["vision"])
    assert batch.media_meta == want.media_meta
    with pytest.raises(ValueError, match=r"row 0 vision item 0: counts \[4, 1, 0\] do not settle 3 chunks of 6"):
        batch.settle_tubelet_chunks("vision", {(0, 0): [4, 1, 0]})


def test_the_llm_reads_tokens_only_after_the_boundary_settled_them():
    """The EVS order (hetero/runtime/tubelet_settle.py): a microbatch handed to the boundary is pending until its
    chunks settle; the LLM's first stage asks first and is refused before, allowed after."""
    from types import SimpleNamespace

    from _mcore_cpu import single_rank_world

    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.runtime.tubelet_settle import TubeletSettle

    single_rank_world()
    settle = TubeletSettle(HeteroLayout.parse("vision=dp1@0-0;language=tp1@0-0"), "vision", "cpu")
    batch = SimpleNamespace(chunked_items=lambda key: [], boundary_batches=lambda keys: {k: f"{k} batch" for k in keys})
    boundary = settle.lazy(batch, 0)
    with pytest.raises(RuntimeError, match="microbatch 0: the LLM reads its tokens before the vision boundary"):
        settle.require_settled(0)
    assert boundary(None) == "vision batch"
    settle.require_settled(0)
    settle.close()


def test_settling_the_second_item_of_a_row_in_three_unequal_chunks():
    """The chunk rules at the edges the one-video test cannot reach: an item after another in its row (its positions
    start after the first item's tokens), three chunks whose last two differ (the region ends at the last chunk's
    end), and chunked_items skipping a plain (kind, units, tokens) item. Worked by hand: context token 99, the text
    between chunks (10, 11 and 20, 21) moves with them."""
    from types import SimpleNamespace

    import torch

    from tessera.data.packing import PackedBatch, settle_chunks

    I, C = 5, 99  # noqa: E741  (an image token, the video's context token)
    tokens = np.array([7, I, I, 8, C, C, 10, 11, C, 20, 21, C, C, C, 30, 31])
    chunks = ((4, 2), (8, 1), (11, 3))
    out, placed = settle_chunks(tokens, chunks, [1, 3, 2])
    assert out.tolist() == [7, I, I, 8, C, 10, 11, C, C, C, 20, 21, C, C, 30, 31]
    assert placed == ((4, 1), (7, 3), (12, 2))
    batch = SimpleNamespace(tokens=torch.from_numpy(tokens[None].copy()),
                            positions=[{"vision": np.array([1, 2, 4, 5, 8, 11, 12, 13])}],
                            media_meta=[{"vision": [("image", 1, 2), ("video", 5, 6, chunks)]}])
    assert PackedBatch.chunked_items(batch, "vision") == [(0, 1, chunks)]
    PackedBatch.settle_tubelet_chunks(batch, "vision", {(0, 1): [1, 3, 2]})
    assert batch.tokens[0].tolist() == out.tolist()
    assert batch.positions[0]["vision"].tolist() == [1, 2, 4, 7, 8, 9, 12, 13]
    assert batch.media_meta[0]["vision"][1] == ("video", 5, 6, ((4, 1), (7, 3), (12, 2)))


def test_check_names_a_module_with_metadata_but_no_positions():
    """The empty case of PackedBatch.check: a row whose metadata plans an item of a module that has no positions
    at all is the named mismatch (4 tokens planned for 0 positions), not a TypeError; and the encoder's counts
    checked against the positions, an item encoded on another rank counted from its metadata."""
    from types import SimpleNamespace

    import torch

    from tessera.data.packing import PackedBatch

    batch = SimpleNamespace(media=[{}], media_meta=[{"vision": [("image", 1, 4)]}], positions=[{}], keys=[["k0"]],
                            labels=torch.full((1, 8), IGNORE))
    with pytest.raises(ValueError, match=r"packed row 0 \(k0\) vision: metadata plans 4 tokens for 0 positions"):
        PackedBatch.check(batch)
    # with the encoder's counts: a decoded item counts as the encoder says, one another rank encodes (None) as planned
    decoded = SimpleNamespace(media=[{"vision": [("image", "pixels"), ("image", None)]}],
                              media_meta=[{"vision": [("image", 1, 2), ("image", 1, 3)]}],
                              positions=[{"vision": np.array([1, 2, 4, 5, 6])}], keys=[["k0"]],
                              labels=torch.full((1, 8), IGNORE))
    PackedBatch.check(decoded, count_tokens=lambda kind, item: 2)
    with pytest.raises(ValueError, match=r"packed row 0 \(k0\) vision: 6 embeddings for 5 positions"):
        PackedBatch.check(decoded, count_tokens=lambda kind, item: 3)
    decoded.media[0]["vision"].pop()  # one decoded item for two planned: refused, even when the counts add up
    with pytest.raises(ValueError, match=r"zip\(\) argument 2 is longer than argument 1"):
        PackedBatch.check(decoded, count_tokens=lambda kind, item: 5)
    # two items on one position (diff 0) overlap; a label on the token before a slot is a loss on it; a slot at
    # position 0 has no token before it (the last label is not "before" it)
    labels = torch.full((1, 8), 7)
    labels[0, 1] = IGNORE
    row = lambda pos: SimpleNamespace(media=[{}], media_meta=[{"vision": [("image", 1, 2)] * (len(pos) // 2)}],  # noqa: E731
                                      positions=[{"vision": np.array(pos)}], keys=[["k0"]], labels=labels)
    with pytest.raises(ValueError, match=r"vision: media positions not strictly increasing"):
        PackedBatch.check(row([1, 2, 2, 3]))
    with pytest.raises(ValueError, match=r"vision: a loss on the token before a media slot"):
        PackedBatch.check(row([3, 4]))
    with pytest.raises(ValueError, match=r"vision: a loss on the token before a media slot"):
        PackedBatch.check(row([1, 2]))  # a slot at position 1: its token before is position 0
    PackedBatch.check(row([0, 2]))
