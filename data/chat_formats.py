"""The chat formats datasets come in, turned into Tessera's own conversation (pure: no file is read here).

A record is one JSON object (a JSONL line, an element of a JSON array, a Hugging Face dataset row). Its format is
detected from its keys:

  tessera   {"conversation": [{"role", "content"}...], "media": [{"kind", "path"}...]}: Tessera's own schema
  caption   {"image"|"video"|"audio": path, "caption": text}
  llava     LLaVA / ShareGPT: {"conversations": [{"from": "human"|"gpt"|"system", "value": "<image>\\n..."}...],
            "image"|"video"|"audio": a path or a list of them} (HF rows: "images" too, and Image/Audio features)
  messages  OpenAI / TRL: {"messages": [{"role": "system"|"user"|"assistant", "content": str | [parts]}...]}, a
            part {"type": "text", "text"} or {"type": "image"|"video"|"audio", KIND|"path": a local path}; a media
            part without a path (TRL's VLM rows) takes the next item of the row's "images"/"videos"/"audios" list

Every format becomes (conversation, media): turns {"role", "content"} whose content holds <image>/<video>/<audio>
tags (data/tokens.MEDIA_TAGS), and [(kind, source)] in tag order per kind, a source being a path string or a Hugging
Face media cell {"bytes", "path"} (read with decode=False). Every assistant turn is a target (data/tokens
.encode_conversation); system turns are context. A record that cannot be used raises RecordError naming the field,
what was expected and the formats tried; tags that do not match the media list are one (reason
`placeholder_mismatch`), never a sample that reaches the loader misaligned.
"""

from __future__ import annotations

from collections import Counter

from tessera.data.tokens import _KIND_OF_TAG, _TAG_RE, MEDIA_TAGS  # the tag grammar encode_conversation reads

FORMATS = ("tessera", "caption", "llava", "messages")
KINDS = tuple(MEDIA_TAGS)
#: LLaVA / ShareGPT speaker names (their `from`) -> roles
LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")
_KEYS = {"tessera": "conversation", "llava": "conversations", "messages": "messages"}
#: the user turn of a caption-only record (a caption record, a media folder's .txt)
PROMPTS = {"image": "<image>\nDescribe the image.", "video": "<video>\nWhat happens in this video?",
           "audio": "<audio>\nTranscribe or describe the audio."}


class RecordError(ValueError):
    """A record that cannot become a sample: `reason` is its counted category, the message names the field and what
    was expected."""

    def __init__(self, reason: str, field: str, expected: str, fmt: str | None = None):
        tried = f" (read as {fmt})" if fmt else f" (formats tried: {', '.join(FORMATS)})"
        super().__init__(f"field {field!r}: expected {expected}{tried}")
        self.reason = reason


def detect(rec) -> str:
    """The format of one record (module docstring); RecordError when it is none of them."""
    if not isinstance(rec, dict):
        raise RecordError("not_an_object", "(record)", f"a JSON object, got {type(rec).__name__}")
    for fmt, key in _KEYS.items():
        if key in rec:
            return fmt
    if "caption" in rec and any(k in rec for k in KINDS):
        return "caption"
    raise RecordError("unknown_format", "(record)", f"one of the keys conversation, conversations, messages, or "
                      f"image|video|audio + caption; it has {sorted(rec)[:8]}")


def to_conversation(rec: dict, fmt: str) -> tuple[list[dict], list[tuple[str, object]]]:
    """(turns, [(kind, source)]) of a record of format `fmt`; RecordError when it cannot be used."""
    turns, media = _CONVERTERS[fmt](rec)
    if not any(t["role"] == "assistant" and t["content"].strip() for t in turns):
        raise RecordError("no_assistant_turn", _KEYS.get(fmt, "caption"), "at least one assistant turn with text "
                          "(the training target)", fmt)
    tags = Counter(_KIND_OF_TAG[t] for t in _TAG_RE.findall("".join(t["content"] for t in turns)))
    items = Counter(k for k, _ in media)
    for kind in KINDS:
        if tags[kind] != items[kind]:
            raise RecordError("placeholder_mismatch", _KEYS.get(fmt, kind),
                              f"one {MEDIA_TAGS[kind]} per {kind} item: {tags[kind]} placeholder(s) for "
                              f"{items[kind]} {kind} item(s)", fmt)
    return turns, media


def caption_chat(kind: str, caption: str) -> list[dict]:
    return [{"role": "user", "content": PROMPTS[kind]}, {"role": "assistant", "content": caption}]


def _text(value, field: str, fmt: str) -> str:
    if not isinstance(value, str):
        raise RecordError("malformed_turn", field, f"a string, got {type(value).__name__}", fmt)
    return value


def _items(rec: dict, kind: str, fmt: str) -> list:
    """The media sources of `kind` at the top level of a record: KIND or KINDs, one source or a list."""
    out = []
    for key in (kind, kind + "s"):
        value = rec.get(key)
        if value is None:
            continue
        for v in (value if isinstance(value, list) else [value]):
            if not (isinstance(v, str) or isinstance(v, dict) and ("bytes" in v or "path" in v)):
                raise RecordError("malformed_media", key, f"a path or a list of paths, got {str(v)[:60]!r}", fmt)
            out.append(_local(v, key, fmt))
    return out


def _local(source, field: str, fmt: str):
    path = source if isinstance(source, str) else source.get("path")
    if isinstance(path, str) and path.startswith(("http://", "https://")) and not (
            isinstance(source, dict) and source.get("bytes")):
        raise RecordError("url_media", field, f"a local path or bytes, got the URL {path} (URLs are not fetched: "
                          "download the media and write their paths)", fmt)
    return source[len("file://"):] if isinstance(source, str) and source.startswith("file://") else source


def _tessera(rec):
    turns = rec["conversation"]
    if not isinstance(turns, list):
        raise RecordError("malformed_turn", "conversation", "a list of {role, content} turns", "tessera")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("role") not in ROLES:
            raise RecordError("malformed_turn", f"conversation[{i}].role", f"one of {ROLES}", "tessera")
        out.append({"role": t["role"], "content": _text(t.get("content"), f"conversation[{i}].content", "tessera")})
    media = []
    for i, m in enumerate(rec.get("media") or []):
        if not isinstance(m, dict) or m.get("kind") not in KINDS or not isinstance(m.get("path"), str):
            raise RecordError("malformed_media", f"media[{i}]", f"{{kind: one of {KINDS}, path}}", "tessera")
        media.append((m["kind"], _local(m["path"], f"media[{i}].path", "tessera")))
    return out, media


def _caption(rec):
    kind = next(k for k in KINDS if k in rec)
    items = _items(rec, kind, "caption")
    if len(items) != 1:
        raise RecordError("malformed_media", kind, "one media path", "caption")
    return caption_chat(kind, _text(rec["caption"], "caption", "caption")), [(kind, items[0])]


def _llava(rec):
    turns = rec["conversations"]
    if not isinstance(turns, list):
        raise RecordError("malformed_turn", "conversations", "a list of {from, value} turns", "llava")
    out = []
    for i, t in enumerate(turns):
        role = LLAVA_ROLES.get(t.get("from")) if isinstance(t, dict) else None
        if role is None:
            raise RecordError("malformed_turn", f"conversations[{i}].from", f"one of {sorted(LLAVA_ROLES)}", "llava")
        out.append({"role": role, "content": _text(t.get("value"), f"conversations[{i}].value", "llava")})
    return out, [(k, s) for k in KINDS for s in _items(rec, k, "llava")]


def _messages(rec):
    turns = rec["messages"]
    if not isinstance(turns, list):
        raise RecordError("malformed_turn", "messages", "a list of {role, content} messages", "messages")
    pools = {k: _items(rec, k, "messages") for k in KINDS}  # what parts without a path take, in order
    taken = Counter()
    out, media = [], []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("role") not in ROLES:
            raise RecordError("malformed_turn", f"messages[{i}].role", f"one of {ROLES}", "messages")
        content = t.get("content")
        if isinstance(content, str):  # tags in the text refer to the row's lists
            for k in KINDS:
                for _ in range(content.count(MEDIA_TAGS[k])):
                    media.append((k, pools[k][taken[k]] if taken[k] < len(pools[k]) else None))
                    taken[k] += 1
            out.append({"role": t["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RecordError("malformed_turn", f"messages[{i}].content", "a string or a list of parts", "messages")
        text = ""
        for j, part in enumerate(content):
            field = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text += _text(part.get("text"), field + ".text", "messages")
                continue
            if kind not in KINDS:
                raise RecordError("malformed_part", field + ".type", f"one of text, {', '.join(KINDS)} (got "
                                  f"{kind!r})", "messages")
            source = part.get(kind) or part.get("path")
            if source is None:
                source = pools[kind][taken[kind]] if taken[kind] < len(pools[kind]) else None
                taken[kind] += 1
            media.append((kind, source if source is None else _local(source, field, "messages")))
            text += MEDIA_TAGS[kind]
        out.append({"role": t["role"], "content": text})
    for k in KINDS:  # a part with no item left, or items no part took
        if taken[k] != len(pools[k]) and (taken[k] or pools[k]):
            raise RecordError("placeholder_mismatch", k + "s", f"one {k} part or {MEDIA_TAGS[k]} per item of "
                              f"{k + 's'!r}: {taken[k]} for {len(pools[k])} item(s)", "messages")
    return out, media


_CONVERTERS = {"tessera": _tessera, "caption": _caption, "llava": _llava, "messages": _messages}
