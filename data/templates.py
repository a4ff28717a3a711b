"""Prompt templates of the released model families: the turn markers, how each media tag is wrapped, and
whether images are tiled (vl) or taken at native resolution (omni).

Plain data, one entry per family. data/tokens.encode_conversation applies a template; which family a run uses
is decided once, from the model's encoders (template_for_encoders, called by data/pipeline.build_train_loader).

A media tag of a conversation (<image>, <video>, <audio>, data/tokens.MEDIA_TAGS) becomes
    start + context x N + end
where N is the number of embeddings its encoder produces (data/tokens.EncoderTokens). Only the `context`
positions take encoder embeddings (they are the span data/packing.py turns into positions); `start` / `end` are
ordinary text tokens the LLM embeds itself. Each piece is a single special token of the tokenizer.

Where the wrapping comes from:
  omni  transformers 5.24, models/nemotron_h_omni/processing_nemotron_h_omni.py (NemotronH_Omni_Reasoning_V3
        Processor): token strings at l.68-74; image, replace_image_token l.156-160: <img> <image>xN </img>;
        audio, replace_audio_token l.206-209: <so_start> <so_embedding>xN <so_end>. The processor's text tag of
        an audio clip is its context token <so_embedding> itself; Tessera's conversations say <audio>.
        tests/test_prompt_parity.py checks input_ids against that processor.
  vl    Nemotron Nano V2 VL (12B): transformers has no processor for it. vLLM's port
        (vllm/transformers_utils/processors/nano_nemotron_vl.py, NanoNemotronVLProcessor.get_image_repl) wraps
        all tiles of an image, thumbnail included, in one <img> <image>xN </img>: the same as omni's image. It has
        no audio. Not checked against NVIDIA's own (remote-code) processor, which is not available offline.
  video omni, the release's replace_video_token (l.162-204): one chunk per tubelet of temporal_patch frames,
        "Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.50 seconds: " <img> <image>xk </img>, chunks
        joined by "\n" (a short last tubelet names its frames only), k = the tubelet's tokens; the release's
        context token for video is its image token. The times are the sampled frames' (the processor's frame
        sampling, data/media.sample_indices, and its millisecond rounding, release_frame_time) at the container's
        frame rate, read from the headers before decoding as the processor reads its video_metadata; a container
        without a frame rate gets the processor's labels without times ("Frame 1 and frame 2: "). Under EVS
        (model.video_pruning > 0) the release keeps each tubelet's <img> ... </img> and decides its kept tokens in
        its forward, after encoding (input_ids[retention_mask]); Tessera sizes a row before encoding, so it
        writes the chunks at nominal counts (models/media_tokens.evs_nominal_tubelet_counts: only the clip's
        total is known) and settles them to the counts its EVS chose at the vision boundary
        (hetero/runtime/tubelet_settle.py): the release's layout, the row's length unchanged.
        tests/test_prompt_parity.py checks both against the processor with transformers' own video processor
        (pruned: with transformers' retention mask).
        vl: a bare run of <video>, Tessera's own (the Nano V2 VL's per-frame wrapping is not checkable offline).
The turns are not part of either processor: processor(text=...) tokenizes the text it is given. A run from a
release renders them with the release's chat template (data/release_prompt.py); otherwise, or with
data.chat_template=project, they are the project's ChatML (data/tokens.encode_conversation, CHAT_TEMPLATE).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True)
class MediaWrap:
    """One media item in the token stream: `start`, then `context` once per embedding, then `end`
    ("" = no wrapper token)."""

    context: str
    start: str = ""
    end: str = ""
    # video: one labelled start/context/end chunk per tubelet (tubelet_chunks), the Omni release's layout
    per_tubelet: bool = False

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(t for t in (self.start, self.context, self.end) if t)


@dataclass(frozen=True)
class PromptTemplate:
    """A family's media wrapping per media kind; a kind it lacks is a kind its released model does not take.
    native_resolution: the family's released image processor resizes each image to one native-resolution
    patch grid (omni: NemotronH_Omni_Reasoning_V3ImageProcessor) instead of 512² tiles + a thumbnail (vl);
    data/pipeline.chat_task_encoder sizes and decodes images accordingly (models/media_tokens.py). Whether a
    video's frames are embedded in tubelets is the model's (models/encoders.video_temporal), not the template's."""

    name: str
    media: Mapping[str, MediaWrap] = field(default_factory=dict)
    native_resolution: bool = False

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for w in self.media.values() for t in w.tokens))


RELEASED_IMAGE = MediaWrap(context="<image>", start="<img>", end="</img>")
RELEASED_AUDIO = MediaWrap(context="<so_embedding>", start="<so_start>", end="<so_end>")
RELEASED_VIDEO = MediaWrap(context="<image>", start="<img>", end="</img>", per_tubelet=True)
TESSERA_VIDEO = MediaWrap(context="<video>")  # vl: not the release's per-frame wrapping (module docstring)

TEMPLATES: dict[str, PromptTemplate] = {
    "vl": PromptTemplate("vl", {"image": RELEASED_IMAGE, "video": TESSERA_VIDEO}),
    "omni": PromptTemplate("omni", {"image": RELEASED_IMAGE, "video": RELEASED_VIDEO, "audio": RELEASED_AUDIO},
                           native_resolution=True),
}
#: What encode_conversation / ChatTaskEncoder use when not told: the family that takes every media kind.
DEFAULT_TEMPLATE = "omni"

#: Every token a template writes as one piece; tokenizers must have each as a single token (data/tokens.Tokenizer).
SPECIAL_TOKENS: tuple[str, ...] = (IM_START, IM_END,
                                   *dict.fromkeys(t for tpl in TEMPLATES.values() for t in tpl.special_tokens))

#: The released processor's text tag of each media kind (processing_nemotron_h_omni: image_token, video_token,
#: audio_token), which it expands as the templates above say; config.json's {kind}_token_id is its id.
PROCESSOR_TAGS = {"image": "<image>", "video": "<video>", "audio": "<so_embedding>"}

#: The turn format data/tokens.encode_conversation trains, as a transformers chat template (Jinja): what an
#: export of a run that did not start from a release ships, so `apply_chat_template` renders the prompts the
#: model learnt. Media parts ({"type": "image"}, ...) become the processor's tags.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '" + IM_START + "' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    + "".join(f"{{%- {'if' if i == 0 else 'elif'} part['type'] == '{kind}' -%}}{tag}"
              for i, (kind, tag) in enumerate(PROCESSOR_TAGS.items()))
    + "{%- else -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '" + IM_END + "\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '" + IM_START + "assistant\\n' }}{%- endif -%}")


def release_frame_time(index: int, fps: float) -> float:
    """The time the release's processor writes for source frame `index` of a clip at `fps`: the index times one
    frame's duration truncated to whole milliseconds (replace_video_token: int(1000 / fps) ms), not index / fps."""
    return index * int(1000.0 / fps) / 1000.0


def tubelet_chunks(frames: int, temporal: int, tokens_per_tubelet: int,
                   times: list[float] | None = None) -> list[tuple[str, int]]:
    """(label, tokens) of each tubelet of a clip of `frames` frames, `temporal` frames per tubelet: the release's
    labels, "Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.50 seconds: " (the first frame "Frame", the
    others "frame", joined by " and "; a short last tubelet names the frames it has), or without `times` (the
    sampled frames' release_frame_time; a clip without a frame rate) "Frame 1 and frame 2: ", as
    replace_video_token writes them (module docstring). data/tokens.encode_conversation writes each as
    label <img> <image> x tokens </img>."""
    if times is not None and len(times) != frames:
        raise ValueError(f"{len(times)} frame times for a clip of {frames} frames")
    labels = []
    for first in range(0, frames, temporal):
        names = [f"{'Frame' if f == first else 'frame'} {f + 1}"
                 + ("" if times is None else f" sampled at {times[f]:.2f} seconds")
                 for f in range(first, min(first + temporal, frames))]
        labels.append(" and ".join(names) + ": ")
    return [(label, tokens_per_tubelet) for label in labels]


def prompt_template(name: str | PromptTemplate) -> PromptTemplate:
    if isinstance(name, PromptTemplate):
        return name
    if name not in TEMPLATES:
        raise ValueError(f"unknown prompt template {name!r}; templates: {', '.join(TEMPLATES)}")
    return TEMPLATES[name]


def template_for_encoders(encoders: Iterable[str]) -> str:
    """The family of a model with these encoder modules ("vision", "audio"): Nemotron 3 Nano Omni is the
    released model with a sound encoder (recipes' omni family); a vision-only model is the Nano V2 VL (vl and
    video families)."""
    return "omni" if "audio" in set(encoders) else "vl"
