"""The formats datasets come in, each one module of this package, turned into Tessera's own conversation.

A record is one JSON object (a JSONL line, an element of a JSON array, a Hugging Face dataset row). Its format is
the first of REGISTRY whose `detect(record)` (from its keys) says yes; that module's `convert(record)` gives
(turns, media): turns {"role", "content"} whose content holds <image>/<video>/<audio> tags (data/tokens.MEDIA_TAGS),
and [(kind, source)] in tag order per kind, a source being a path string, a Hugging Face media cell {"bytes",
"path"} (read with decode=False) or an audio span {"path", "offset", "duration"} (data/prepare_sources.media_bytes).
Every assistant turn is a target (data/tokens.encode_conversation); system turns are context. A record that cannot
be used raises RecordError naming the field, what was expected and the formats tried; tags that do not match the
media list are one (reason `placeholder_mismatch`), never a sample that reaches the loader misaligned.

A format module has NAME, KEYS (the keys it is detected by, in words), FIELD (named by the checks below),
detect(rec) -> bool and convert(rec) -> (turns, media). Adding one: write the module, add it to REGISTRY. A user's
own format needs no module here: scripts/prepare_data.py --format MODULE:FUNCTION (data/formats/user.py).
"""

from __future__ import annotations

from collections import Counter

from tessera.data.formats import alpaca, caption, cauldron, llava, messages, nemo_asr, nemo_speech_llm, tessera
from tessera.data.formats.common import KINDS, PROMPTS, RecordError, caption_chat  # noqa: F401  (the package's API)
from tessera.data.tokens import KIND_OF_TAG, MEDIA_TAG_RE, MEDIA_TAGS  # the tag grammar encode_conversation reads

#: detection order: the first whose detect() says yes
REGISTRY = {m.NAME: m for m in (
    tessera,
    caption,
    llava,
    messages,
    alpaca,
    cauldron,
    nemo_asr,
    nemo_speech_llm,
)}
FORMATS = tuple(REGISTRY)


def detect(rec) -> str:
    """The format of one record (module docstring); RecordError when it is none of them."""
    if not isinstance(rec, dict):
        raise RecordError("not_an_object", "(record)", f"a JSON object, got {type(rec).__name__}")
    for name, module in REGISTRY.items():
        if module.detect(rec):
            return name
    keys = "; ".join(f"{name}: {m.KEYS}" for name, m in REGISTRY.items())
    raise RecordError("unknown_format", "(record)", f"the keys of one format ({keys}), or your own converter passed "
                      f"as --format MODULE:FUNCTION; it has {sorted(rec)[:8]}")


def to_conversation(rec: dict, fmt: str) -> tuple[list[dict], list[tuple[str, object]]]:
    """(turns, [(kind, source)]) of a record of format `fmt`; RecordError when it cannot be used."""
    module = REGISTRY[fmt]
    turns, media = module.convert(rec)
    return checked(turns, media, fmt, module.FIELD)


def checked(turns, media, fmt: str, field: str):
    """(turns, media) when they make a sample: an assistant turn with text, one tag per media item of each kind."""
    if not any(t["role"] == "assistant" and t["content"].strip() for t in turns):
        raise RecordError("no_assistant_turn", field, "at least one assistant turn with text (the training target)",
                          fmt)
    tags = Counter(KIND_OF_TAG[t] for t in MEDIA_TAG_RE.findall("".join(t["content"] for t in turns)))
    found = Counter(k for k, _ in media)
    for kind in KINDS:
        if tags[kind] != found[kind]:
            raise RecordError("placeholder_mismatch", field,
                              f"one {MEDIA_TAGS[kind]} per {kind} item: {tags[kind]} placeholder(s) for "
                              f"{found[kind]} {kind} item(s)", fmt)
    return turns, media
