"""What every format module shares: the error a record that cannot be used raises, and the small readers of turns
and media lists. Pure: no file is read here."""

from __future__ import annotations

from tessera.data.tokens import MEDIA_TAGS

KINDS = tuple(MEDIA_TAGS)
ROLES = ("system", "user", "assistant")
#: the user turn of a caption-only record (a caption record, a media folder's .txt, a transcript)
PROMPTS = {"image": "<image>\nDescribe the image.", "video": "<video>\nWhat happens in this video?",
           "audio": "<audio>\nTranscribe or describe the audio."}


class RecordError(ValueError):
    """A record that cannot become a sample: `reason` is its counted category, the message names the field and what
    was expected."""

    def __init__(self, reason: str, field: str, expected: str, fmt: str | None = None):
        if fmt:
            tried = f" (read as {fmt})"
        else:  # the registry imports this module: its names are read when an error is made
            from tessera.data.formats import FORMATS

            tried = f" (formats tried: {', '.join(FORMATS)})"
        super().__init__(f"field {field!r}: expected {expected}{tried}")
        self.reason = reason


def caption_chat(kind: str, caption: str) -> list[dict]:
    return [{"role": "user", "content": PROMPTS[kind]}, {"role": "assistant", "content": caption}]


def text(value, field: str, fmt: str) -> str:
    if not isinstance(value, str):
        raise RecordError("malformed_turn", field, f"a string, got {type(value).__name__}", fmt)
    return value


def items(rec: dict, kind: str, fmt: str) -> list:
    """The media sources of `kind` at the top level of a record: KIND or KINDs, one source or a list."""
    out = []
    for key in (kind, kind + "s"):
        value = rec.get(key)
        if value is None:
            continue
        for v in (value if isinstance(value, list) else [value]):
            if not (isinstance(v, str) or isinstance(v, dict) and ("bytes" in v or "path" in v)):
                raise RecordError("malformed_media", key, f"a path or a list of paths, got {str(v)[:60]!r}", fmt)
            out.append(local(v, key, fmt))
    return out


def local(source, field: str, fmt: str):
    """`source` (a path, or a Hugging Face cell {bytes, path}) unless it is a URL, which is not fetched."""
    path = source if isinstance(source, str) else source.get("path")
    if isinstance(path, str) and path.startswith(("http://", "https://")) and not (
            isinstance(source, dict) and source.get("bytes")):
        raise RecordError("url_media", field, f"a local path or bytes, got the URL {path} (URLs are not fetched: "
                          "download the media and write their paths)", fmt)
    return source[len("file://"):] if isinstance(source, str) and source.startswith("file://") else source


def role_turns(turns, field: str, speaker: str, said: str, roles: dict, fmt: str) -> list[dict]:
    """[{role, content}] of a list of turns {speaker: name, said: text} whose names `roles` maps to roles."""
    if not isinstance(turns, list):
        raise RecordError("malformed_turn", field, f"a list of {{{speaker}, {said}}} turns", fmt)
    out = []
    for i, t in enumerate(turns):
        role = roles.get(t.get(speaker)) if isinstance(t, dict) else None
        if role is None:
            raise RecordError("malformed_turn", f"{field}[{i}].{speaker}", f"one of {sorted(roles)}", fmt)
        out.append({"role": role, "content": text(t.get(said), f"{field}[{i}].{said}", fmt)})
    return out
