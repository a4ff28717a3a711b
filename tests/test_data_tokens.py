"""Placeholder sizes equal what the encoders produce; loss only on assistant turns; misalignment is refused."""

import io
import math

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from tessera.data.media import (choose_grid, decode_audio, decode_image, decode_video, probe_audio, probe_image,
                        probe_video, sample_indices)
from tessera.data.templates import TEMPLATES
from tessera.data.tokens import (IM_END, EncoderTokens, PromptError, Tokenizer, encode_conversation,
                         train_sentencepiece)
from tessera.data.prepare import synth_video

TEXTS = ["Describe the image.", "A red circle on a blue background.", "What happens in this video?",
         "user\n", "assistant\n", "system\n", "The tone is steady and the square moves."] * 20


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(train_sentencepiece(TEXTS, tmp_path_factory.mktemp("tok") / "sp", vocab_size=200))


def _png(w, h):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_tokens_per_tile_is_pixel_shuffled_patch_grid():
    assert EncoderTokens().tokens_per_tile == (512 // 16) ** 2 // 4 == 256
    assert EncoderTokens(patch=14, tile=448).tokens_per_tile == 256
    with pytest.raises(ValueError):
        EncoderTokens(patch=30)


@pytest.mark.parametrize("size,grid", [((640, 480), (3, 2)), ((300, 900), (1, 3)), ((1024, 256), (4, 1)),
                                       ((200, 200), (1, 1)), ((100, 2000), (1, 6))])
def test_image_tiles_follow_aspect_ratio(size, grid):
    g = choose_grid(*size, max_tiles=6)
    assert (g.cols, g.rows) == grid
    assert g.num_tiles == grid[0] * grid[1] + (grid != (1, 1))  # thumbnail only for multi-tile grids
    # Small tiles: a 200x200 image now fills a 2x2 grid (ties go to the larger grid when pixels allow).
    small = choose_grid(*size, max_tiles=6, tile=64)
    tiles = decode_image(_png(*size), tile=64, max_tiles=6)
    assert tiles.shape == (small.num_tiles, 3, 64, 64) and tiles.dtype == np.uint8
    assert probe_image(_png(*size)) == size


def test_video_frames_uniform_with_timestamps():
    import random

    data, _, _ = synth_video(random.Random(3))
    total = probe_video(data).frames
    frames, stamps = decode_video(data, frames=4, tile=32)
    assert frames.shape == (min(4, total), 3, 32, 32)
    want = np.asarray(sample_indices(total, 4)) / 8.0  # synthetic videos are 8 fps, pts in 1/8 s
    np.testing.assert_allclose(stamps, want)
    assert EncoderTokens(tile=32, patch=4).video_tokens(frames.shape[0]) == frames.shape[0] * 16


@pytest.mark.parametrize("rate,channels,seconds", [(16000, 1, 1.0), (22050, 2, 1.3), (44100, 1, 0.5), (8000, 2, 2.0)])
def test_audio_resampled_to_16k_mono_with_predicted_length(rate, channels, seconds):
    wave = np.random.default_rng(0).standard_normal((int(rate * seconds), channels)).astype(np.float32) * 0.1
    buf = io.BytesIO()
    sf.write(buf, wave, rate, format="FLAC")
    out = decode_audio(buf.getvalue())
    assert out.ndim == 1 and len(out) == probe_audio(buf.getvalue()) == math.ceil(len(wave) * 16000 / rate)


def test_audio_tokens_match_nemo_preprocessor_and_fastconformer():
    torch = pytest.importorskip("torch")
    from nemo.collections.asr.modules import AudioToMelSpectrogramPreprocessor, ConformerEncoder

    pre = AudioToMelSpectrogramPreprocessor(sample_rate=16000, features=80)
    enc = ConformerEncoder(feat_in=80, n_layers=1, d_model=16, n_heads=2, subsampling="dw_striding",
                           subsampling_factor=8, subsampling_conv_channels=8, ff_expansion_factor=1)
    cfg = EncoderTokens()
    lengths = torch.tensor([16000, 8000 + 37, 27_200, 1601])
    with torch.no_grad():
        feats, feat_len = pre(input_signal=torch.zeros(4, int(lengths.max())), length=lengths)
        _, out_len = enc(audio_signal=feats, length=feat_len)
    assert out_len.tolist() == [cfg.audio_tokens(int(n)) for n in lengths]


def test_conversation_expands_tags_and_masks_assistant_only(tok):
    turns = [{"role": "user", "content": "<image>\nDescribe the image. <audio>"},
             {"role": "assistant", "content": "A red circle."},
             {"role": "user", "content": "<video>"},
             {"role": "assistant", "content": "The square moves."}]
    p = encode_conversation(tok, turns, ["audio", "image", "video"], [25, 7 * 256, 8 * 256])
    # Spans in text order, each pointing at its item in storage order.
    assert [(m, n, i) for m, _, n, i in p.spans] == [("vision", 1792, 1), ("audio", 25, 0), ("vision", 2048, 2)]
    for module, start, n, _ in p.spans:
        assert not p.target[start:start + n].any()
    ids = {k: tok.special[w.context] for k, w in TEMPLATES["omni"].media.items()}  # the default template's
    # omni writes video at the image token, as the release does (in per-tubelet chunks: media_placeholders)
    assert (p.tokens == ids["image"]).sum() == 1792 + 2048 and (p.tokens == ids["audio"]).sum() == 25
    # The target tokens are exactly both assistant answers, each closed by <|im_end|>.
    target = p.tokens[p.target].tolist()
    answer = tok.encode("A red circle.") + [tok.special[IM_END]] + tok.encode("The square moves.") + [tok.special[IM_END]]
    assert target == answer


def test_misaligned_media_is_refused(tok):
    turns = [{"role": "user", "content": "<image> and <image>"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(PromptError, match="missing modality"):
        encode_conversation(tok, turns, ["image"], [256])
    with pytest.raises(PromptError, match="more media than placeholders"):
        encode_conversation(tok, turns, ["image", "image", "audio"], [256, 256, 10])


def _hf_tokenizer_json(path, with_specials=True):
    """A byte-level BPE tokenizer.json trained locally with the `tokenizers` library (what a HF checkpoint ships)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    from tessera.data.tokens import SPECIAL_TOKENS

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<pad>", *SPECIAL_TOKENS] if with_specials else ["<pad>"]
    hf.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(path))
    return hf


def test_hf_tokenizer_json_encodes_the_template(tmp_path):
    import pickle

    hf = _hf_tokenizer_json(tmp_path / "tokenizer.json")
    tok = Tokenizer(tmp_path / "tokenizer.json")
    assert tok.pad_id == hf.token_to_id("<pad>") and tok.special[IM_END] == hf.token_to_id(IM_END)
    turns = [{"role": "user", "content": "Describe the image.\n<image> and <audio>"},
             {"role": "assistant", "content": "A red circle on a blue background."}]
    p = encode_conversation(tok, turns, ["image", "audio"], [32, 5])
    assert [(m, n) for m, _, n, _ in p.spans] == [("vision", 32), ("audio", 5)]
    for module, start, n, _ in p.spans:
        wrap = TEMPLATES["omni"].media["image" if module == "vision" else "audio"]
        assert set(p.tokens[start:start + n].tolist()) == {tok.special[wrap.context]}
        # the span is the embedding run alone, between the template's wrapper tokens
        assert p.tokens[start - 1] == tok.special[wrap.start] and p.tokens[start + n] == tok.special[wrap.end]
    # Loss covers exactly the assistant text and its closing <|im_end|>; the text round-trips through HF.
    learned = p.tokens[p.target].tolist()
    assert learned[-1] == tok.special[IM_END]
    assert hf.decode(learned[:-1]) == "A red circle on a blue background."
    clone = pickle.loads(pickle.dumps(tok))  # energon ships the task encoder to worker processes
    assert clone.encode("A red circle.") == tok.encode("A red circle.") == hf.encode("A red circle.").ids
    _hf_tokenizer_json(tmp_path / "plain.json", with_specials=False)
    with pytest.raises(ValueError, match="lacks the special tokens"):
        Tokenizer(tmp_path / "plain.json")
