"""Input parity of the prompt (issue 15, item 4): Tessera's data pipeline gives the omni family exactly the
input_ids of the released processor, transformers' NemotronH_Omni_Reasoning_V3Processor.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_prompt_parity.py -q

Both sides get the same conversation and media and the same tokenizer, a byte-level BPE trained here with the
template's special tokens (data/templates.SPECIAL_TOKENS) and saved as tokenizer.json:
  - Tessera: the loader's task encoder for the omni encoders (data/pipeline.chat_task_encoder: RADIO ViT-H and
    the released Parakeet sound encoder, so the omni template), on the raw sample bytes (JSON + WAV + PNG),
    as the loader's preencode stage sees them; then packed into a row (data/packing.pack_row);
  - transformers: the processor's own __call__ on the conversation written as text (ChatML turns, the media
    tags as the processor's tags: its `image_token`, its `audio_token`), with the raw waveforms.
Asserted: input_ids equal token for token (the wrapping <img> ... </img> and <so_start> ... <so_end>, the
placeholder counts, the text between them), and the packed row's encoder positions of each module are exactly
where the processor's input_ids hold that module's placeholder id (the ids the model scatters embeddings to).

What the processor is given without its image and video processors (their modules import torchvision, which is
absent here): images go through a stand-in image processor that returns only `image_grid_hw`, the input of the
processor's replace_image_token, computed by transformers' own grid rule (get_patch_grid_size with the image
processor's defaults and per-call budget, tests/_omni_image_processor.py) from the decoded image's size. So the
image placeholder counts are compared too: Tessera's omni family takes each image at native resolution
(data/pipeline.chat_task_encoder) and must announce the count of the release's grid. For audio the processor
computes the count from the waveform. The vl family (tiles + thumbnail, no transformers processor) is compared
for its wrapping only: its stand-in is handed the grid whose count equals the tiles' (32 x 32·tiles patches).
Video goes through transformers' own video processor (NemotronH_Omni_Reasoning_V3VideoProcessor: no torchvision
needed) with the clip's frames at their stored size, sampled as transformers' loader samples them, and their
video_metadata (frame rate, source indices): the processor writes one "Frame i sampled at t seconds and frame j
sampled at u seconds: " <img> <image>xk </img> chunk per 2-frame tubelet, k from its aspect-preserving frame grid
(32x32 patches for a square frame; Tessera's omni family decodes frames to the same grid,
models/media_tokens.video_frame_grid). The processor takes one video per call. Video is compared unpruned, the release's default (its EVS layout is decided in its forward).
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import soundfile as sf
import torch
from _omni_image_processor import release_grid, release_image_module, release_video_grid
from PIL import Image
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from tessera.data.loader import RawSample
from tessera.data.packing import pack_row
from tessera.data.prepare import encode_mp4
from tessera.data.pipeline import chat_task_encoder
from tessera.data.templates import SPECIAL_TOKENS, TEMPLATES
from tessera.data.tokens import Tokenizer

# The omni family with the released sound encoder (its processor's audio count; NeMo's FastConformer keeps its
# own valid length, tests/test_audio_token_count.py).
ENCODERS = {"vision": "radio_vit_h", "audio": "parakeet_hf_0_6b"}
SEQ = 16384
TEXTS = ["Describe the image.", "A red circle on a blue background.", "Listen to this clip: what is it?",
         "A steady tone, then silence.", "You are a helpful assistant.", "Compare the two sounds and the picture.",
         "user\n", "assistant\n", "system\n",
         # merges across a label's leading space (" Frame"), so a label tokenized apart from the text before it
         # would differ from the processor's one string
         "Watch this: Frame 1 and frame 2: ", " Frame 3 and frame 4", "then Frame 5"] * 20

# 16 kHz samples per clip: n = samples // 160 mel frames
CLIP_SAMPLES = {
    "1.28s": 20480,      # n = 128, a multiple of 8: 17 tokens (the centre-padded STFT frame counts)
    "1.28s+79": 20559,   # n = 128, samples not a multiple of the hop
    "0.5s": 8000,        # n = 50
    "0.1s": 1600,        # n = 10: the shortest clip the front end takes without padding
    "3s": 48000,         # n = 300
}
# (width, height). vl tiles (max_tiles 12): 1; 5x2 + thumbnail; 1x12 + thumbnail. Release grids (omni), rows x cols
# patches: 32x32 (19x19 scaled up to the 1024-patch min), 32x76 (1200/16 = 75, odd: round() gives 76), 108x10
# (44x4 scaled up to 107x10, then rows rounded up to the pixel shuffle)
IMAGE_SIZES = {"square": (300, 300), "wide": (1200, 500), "strip": (50, 700)}


def _tokenizer_json(path, specials):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", *specials],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return _tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json", SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def processor(tokenizer_json):
    """The released processor around the same tokenizer, the Parakeet feature extractor (default: the release's
    128 mel bins) and the grid-only image stand-in; the processor's defaults are the release's (subsampling 8,
    hop 160, 16 kHz)."""
    from transformers import (BatchFeature, NemotronH_Omni_Reasoning_V3Processor, ParakeetFeatureExtractor,
                              PreTrainedTokenizerFast)
    # from its module: the top-level name is a placeholder asking for torchvision, which this processor never uses
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import \
        NemotronH_Omni_Reasoning_V3VideoProcessor

    class GridImageProcessor:
        """Stands in for NemotronH_Omni_Reasoning_V3ImageProcessor: returns the image_grid_hw that processor
        would, from transformers' own grid rule and defaults for a PIL image (release_grid), or a given
        [h, w] grid as is (the vl family's tiles); its pixels are not needed for input_ids."""

        downsample_ratio = release_image_module().NemotronH_Omni_Reasoning_V3ImageProcessor.downsample_ratio
        model_input_names = ["pixel_values", "image_grid_hw"]

        def __call__(self, images, **kwargs):
            assert not kwargs.get("images_kwargs"), "the release's defaults only"
            grids = [release_grid(im.height, im.width, n_images=len(images)) if isinstance(im, Image.Image)
                     else im for im in images]
            return BatchFeature({"image_grid_hw": torch.tensor(grids)})

    class WithoutTorchvision(NemotronH_Omni_Reasoning_V3Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name in ("image_processor", "video_processor"):
                return None  # the stand-in; the video processor, whose class check asks for torchvision
            return super().check_argument_for_proper_class(argument_name, argument)

        def __repr__(self):  # the base class serialises its sub-processors, which the stand-in is not
            return "NemotronH_Omni_Reasoning_V3Processor(grid-only images)"

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    # the release's normalisation constants live in its checkpoint's preprocessor config; they change pixels only
    video = NemotronH_Omni_Reasoning_V3VideoProcessor(norm_mean=[0.5] * 3, norm_std=[0.25] * 3)
    return WithoutTorchvision(image_processor=GridImageProcessor(), video_processor=video, tokenizer=tok,
                              feature_extractor=ParakeetFeatureExtractor())


@pytest.fixture(scope="module")
def task_encoder(tokenizer_json):
    te = chat_task_encoder(Tokenizer(tokenizer_json), ENCODERS, SEQ, max_tiles=12, video_frames=8)
    assert te.template == "omni", "the omni encoders must select the omni template"
    return te


def _wave(samples: int, seed: int) -> np.ndarray:
    t = np.arange(samples) / 16000
    rng = np.random.default_rng(seed)
    return (0.2 * np.sin(2 * math.pi * 440 * t) + 0.05 * rng.standard_normal(samples)).astype(np.float32)


WAVES = {name: _wave(n, i) for i, (name, n) in enumerate(CLIP_SAMPLES.items())}


def _frames(frames: int, size: tuple[int, int]) -> np.ndarray:
    """uint8 [frames, h, w, 3]: a square crossing a dark background."""
    (w, h), out = size, np.full((frames, size[1], size[0], 3), 20, dtype=np.uint8)
    for t in range(frames):
        x = (w - 16) * t // max(frames - 1, 1)
        out[t, h // 2 - 8:h // 2 + 8, x:x + 16] = (220, 40, 40)
    return out


# frames, (width, height): 5 frames end in a one-frame tubelet ("Frame 5: "); the omni family's frame grid keeps
# the clip's aspect ratio as the release's does (160x90: 24 x 42 patches, 252 tokens a tubelet, not a tile's 256)
VIDEOS = {"5f": (5, (64, 64)), "4f": (4, (160, 90)), "12f": (12, (64, 64))}
FPS = 8  # the clips' frame rate (encode_mp4): the labels' times are index x 125 ms


def _wav_bytes(wave: np.ndarray) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, wave, 16000, format="WAV", subtype="FLOAT")  # float: the decoded waveform is the array itself
    return buf.getvalue()


def _png_bytes(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 10)).save(buf, format="PNG")
    return buf.getvalue()


CONVERSATIONS = {
    "audio": ([{"role": "user", "content": "Listen to this clip: <audio>\nWhat is it?"},
               {"role": "assistant", "content": "A steady tone, then silence."}], ["audio:1.28s"]),
    "image": ([{"role": "user", "content": "<image>\nDescribe the image."},
               {"role": "assistant", "content": "A red circle on a blue background."}], ["image:wide"]),
    "mixed": ([{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "<audio> and <audio>, then <image>: compare the two sounds and the picture."},
               {"role": "assistant", "content": "The first is longer."},
               {"role": "user", "content": "And these? <audio><image> <audio> <audio><image>"},
               {"role": "assistant", "content": "A steady tone."}],
              ["audio:1.28s+79", "audio:0.5s", "image:square", "audio:3s", "image:wide", "audio:0.1s", "audio:1.28s",
               "image:strip"]),
    # text right before the tag: the first label is tokenized with it, as the processor tokenizes one string
    "video": ([{"role": "user", "content": "Watch this: <video>\nWhat moves?"},
               {"role": "assistant", "content": "A red square, left to right."}], ["video:5f"]),
    "video_audio_image": ([{"role": "user", "content": "<audio> then <video><image> Compare them."},
                           {"role": "assistant", "content": "A steady tone."}],
                          ["audio:0.5s", "video:4f", "image:wide"]),
    # more frames than video_frames (8): the processor's sampling picks frames 0, 1, 3, 4, 6, 7, 9, 10
    "video_sampled": ([{"role": "user", "content": "<video> What happens?"},
                       {"role": "assistant", "content": "It moves."}], ["video:12f"]),
}


def _sample(conversation: str):
    """(turns, [(kind, name)], the raw sample the loader's cooker yields)."""
    turns, items = CONVERSATIONS[conversation]
    media, members = [], {}
    for i, item in enumerate(items):
        kind, name = item.split(":")
        field = f"m{i}.{ {'audio': 'wav', 'image': 'png', 'video': 'mp4'}[kind]}"
        members[field] = (_wav_bytes(WAVES[name]) if kind == "audio" else _png_bytes(IMAGE_SIZES[name])
                          if kind == "image" else encode_mp4(_frames(*VIDEOS[name]), fps=FPS))
        media.append({"kind": kind, "field": field})
    members["json"] = json.dumps({"conversation": turns, "media": media}).encode()
    raw = RawSample(__key__=conversation, __restore_key__=(), __subflavors__=None, __sources__=None, members=members)
    return turns, [tuple(item.split(":")) for item in items], raw


def _processor_ids(processor, turns, items, task_encoder):
    """transformers' input_ids for the conversation: ChatML text, the processor's own media tags."""
    tags = {"<image>": processor.image_token, "<audio>": processor.audio_token}
    text = ""
    for turn in turns:
        content = turn["content"]
        for tessera_tag, processor_tag in tags.items():
            content = content.replace(tessera_tag, processor_tag)
        text += f"<|im_start|>{turn['role']}\n{content}<|im_end|>\n"
    enc, images = task_encoder.enc, []
    for kind, name in items:
        if kind != "image":
            continue
        if enc.native_resolution:  # the decoded image: the stand-in takes its grid from transformers' rule
            images.append(Image.open(io.BytesIO(_png_bytes(IMAGE_SIZES[name]))).convert("RGB"))
        else:  # vl: the image's tiles side by side as one patch grid, the same token count
            tiles, _ = task_encoder._units("image", _png_bytes(IMAGE_SIZES[name]))  # what the loader predicts
            images.append([enc.tile // enc.patch, tiles * enc.tile // enc.patch])
    audio = [WAVES[name] for kind, name in items if kind == "audio"]
    videos = [torch.from_numpy(_frames(*VIDEOS[name])).permute(0, 3, 1, 2) for kind, name in items if kind == "video"]
    video_kwargs = {}
    if videos:  # the clip's frames sampled as transformers' video loader samples them (load_video with its default
        # sampling), with the metadata it returns (frame rate, source indices): each tubelet's label carries its
        # frames' times (given no metadata the processor writes none; given metadata without the indices it
        # would time the sampled frames as if they were consecutive)
        (video,) = videos  # (the processor takes one video per call)
        meta = VideoMetadata(total_num_frames=len(video), fps=FPS)
        meta.frames_indices = default_sample_indices_fn(meta, num_frames=min(len(video), enc.video_frames))
        videos = [video[torch.as_tensor(meta.frames_indices)]]
        video_kwargs = dict(video_metadata=meta, do_sample_frames=False)
    out = processor(text=text, images=images or None, audio=audio or None, videos=videos or None,
                    sampling_rate=16000, **video_kwargs)
    return np.asarray(out["input_ids"][0])


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_input_ids_equal_the_released_processor(conversation, processor, task_encoder):
    turns, items, raw = _sample(conversation)
    encoded = task_encoder.preencode_sample(raw)
    want = _processor_ids(processor, turns, items, task_encoder)
    got = encoded.prompt.tokens
    if len(got) != len(want) or (got != want).any():
        common = min(len(got), len(want))
        at = int(np.argmax(got[:common] != want[:common])) if (got[:common] != want[:common]).any() else common
        show = lambda ids: processor.tokenizer.convert_ids_to_tokens(ids[max(0, at - 3):at + 4].tolist())  # noqa: E731
        pytest.fail(f"input_ids differ from token {at} (lengths {len(got)}, {len(want)}): tessera {show(got)}, "
                    f"release {show(want)}")
    # Where the processor puts each module's placeholder id is where the packed row takes its embeddings.
    row = pack_row([encoded], len(got) + 7, task_encoder.tok.pad_id)
    placeholder = {"vision": processor.image_token_id, "audio": processor.audio_token_id}
    for module, token_id in placeholder.items():
        np.testing.assert_array_equal(row.positions.get(module, []), np.flatnonzero(want == token_id))
    # and the counts per item are the processor's (audio from the waveform, images from transformers' grid)
    counts = [n for _, _, n in row.media_meta.get("audio", [])]
    assert counts == [processor._estimate_audio_num_embeddings(len(WAVES[name])) for k, name in items if k == "audio"]
    grids = [release_grid(h, w, n_images=sum(k == "image" for k, _ in items))
             for k, name in items if k == "image" for w, h in [IMAGE_SIZES[name]]]
    vision = row.media_meta.get("vision", [])
    assert [(units, n) for kind, units, n, *_ in vision if kind == "image"] == [(g, g[0] * g[1] // 4) for g in grids]
    # a video: all its frames, one tubelet chunk of the processor's per-frame token count per 2 frames
    videos = [name for kind, name in items if kind == "video"]
    for (kind, units, n, *_), name in zip([m for m in vision if m[0] == "video"], videos, strict=True):
        frames, (w, h) = VIDEOS[name]
        vp = processor.video_processor
        tile = vp(videos=[torch.zeros(1, 3, h, w)])["pixel_values_videos"].shape[-2:]  # the processor's frame size
        per_frame = (tile[0] // vp.patch_size) * (tile[1] // vp.patch_size) // round(1 / vp.downsample_ratio) ** 2
        grid = release_video_grid(h, w)
        assert per_frame == grid[0] * grid[1] // 4
        used = min(frames, task_encoder.enc.video_frames)
        assert (units, n) == ((used, *grid), math.ceil(used / 2) * per_frame)


def test_frames_are_sampled_and_timed_as_the_released_processor_does():
    """The frames a clip trains on are the ones transformers' loader samples (default_sample_indices_fn), and the
    times in the labels are replace_video_token's (source index x whole milliseconds per frame)."""
    from tessera.data.media import sample_indices
    from tessera.data.templates import release_frame_time

    for total in range(1, 70):
        for wanted in range(1, total + 1):
            want = default_sample_indices_fn(VideoMetadata(total_num_frames=total, fps=FPS), num_frames=wanted)
            assert sample_indices(total, wanted) == want.tolist(), (total, wanted)
    assert sample_indices(5, 8) == [0, 1, 2, 3, 4]  # a short clip: every frame (transformers refuses to ask more)
    # 30 fps: 33 ms a frame, so frame 300 is labelled 9.90 s, not 10.00 s
    assert [f"{release_frame_time(i, 30.0):.2f}" for i in (0, 1, 300)] == ["0.00", "0.03", "9.90"]


@pytest.mark.parametrize("seed", [0, 1])
def test_an_evs_pruned_clip_settles_to_the_released_models_pruned_ids(seed, processor, tokenizer_json):
    """EVS (video pruning 0.5): the data side writes the clip's tubelet chunks at nominal counts; settled to the
    counts Tessera's EVS chooses on some projected embeddings, the row is what transformers' forward keeps of the
    processor's ids with its own retention mask on the same embeddings (input_ids[retention_mask], the
    NemotronH_Omni_Reasoning_V3 forward's statement), and the vision positions are its image-token positions."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import compute_retention_mask

    from tessera.data.packing import collate
    from tessera.models.video import evs_prune, evs_tubelet_counts

    te = chat_task_encoder(Tokenizer(tokenizer_json), ENCODERS, SEQ, max_tiles=12, video_frames=8, video_pruning=0.5)
    turns, items, raw = _sample("video")
    full = _processor_ids(processor, turns, items, te)  # every tubelet's tokens: the processor's ids
    frames, (w, h) = VIDEOS["5f"]
    rows, cols = (g // 2 for g in release_video_grid(h, w))
    tubelets = math.ceil(frames / 2)
    embeds = torch.randn(tubelets * rows * cols, 8, generator=torch.Generator().manual_seed(seed))
    keep = compute_retention_mask(embeds, tubelets, 0.5)
    retention = np.ones(len(full), dtype=bool)
    retention[full == processor.image_token_id] = keep.numpy()
    want = full[retention]

    batch = collate([pack_row([te.preencode_sample(raw)], len(want) + 5, te.tok.pad_id)], {})
    ((r, j, nominal),) = batch.chunked_items("vision")
    _, chosen = evs_prune(embeds.reshape(tubelets, rows, cols, -1), 0.5)
    counts = evs_tubelet_counts(chosen, tubelets, rows * cols)
    assert counts != [n for _, n in nominal], "EVS chose the nominal counts: the test would not bite"
    labels = batch.labels.clone()
    batch.settle_tubelet_chunks("vision", {(r, j): counts})
    np.testing.assert_array_equal(batch.tokens[0, :len(want)].numpy(), want)
    np.testing.assert_array_equal(batch.positions[0]["vision"], np.flatnonzero(want == processor.image_token_id))
    assert [n for _, n in batch.media_meta[0]["vision"][0][3]] == counts
    assert torch.equal(batch.labels, labels)  # the chunks are never targets: the loss's labels do not move


def test_a_one_point_28_second_clip_has_seventeen_tokens(processor, task_encoder):
    """The clip whose mel frame count is a multiple of 8 announces 17, the release's count."""
    _, _, raw = _sample("audio")
    encoded = task_encoder.preencode_sample(raw)
    assert (encoded.prompt.tokens == task_encoder.tok.special["<so_embedding>"]).sum() == 17


@pytest.mark.parametrize("token", sorted({t for tpl in TEMPLATES.values() for t in tpl.special_tokens}))
def test_a_tokenizer_without_a_wrapping_token_is_refused(tmp_path, token):
    path = _tokenizer_json(tmp_path / "tokenizer.json", [t for t in SPECIAL_TOKENS if t != token])
    with pytest.raises(ValueError, match=f"lacks the special tokens \\['{token}'\\]"):
        Tokenizer(path)


def test_vision_only_models_use_the_vl_template(processor, tokenizer_json):
    """vl: vLLM's Nano V2 VL port wraps an image (all its tiles) as the Omni processor does (data/templates.py),
    and that model takes no audio."""
    from tessera.data.tokens import PromptError, encode_conversation

    te = chat_task_encoder(Tokenizer(tokenizer_json), {"vision": "radio_vit_h"}, SEQ, max_tiles=12)
    assert te.template == "vl"
    turns, items, raw = _sample("image")
    np.testing.assert_array_equal(te.preencode_sample(raw).prompt.tokens, _processor_ids(processor, turns, items, te))
    with pytest.raises(PromptError, match="vl prompt template has no audio"):
        encode_conversation(te.tok, CONVERSATIONS["audio"][0], ["audio"], [17], "vl")
