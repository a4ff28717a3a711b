"""Tessera's own schema: {"conversation": [{"role", "content"}...], "media": [{"kind", "path"}...]}, the content
holding <image>/<video>/<audio> tags in the order of `media` per kind."""

from tessera.data.formats.common import KINDS, ROLES, RecordError, local, text

NAME, KEYS, FIELD = "tessera", "conversation (+ media)", "conversation"


def detect(rec: dict) -> bool:
    return "conversation" in rec


def convert(rec: dict, fmt: str = NAME):
    """fmt: the name errors give (a user's --format returns this schema: data/formats/user.py)."""
    turns = rec["conversation"]
    if not isinstance(turns, list):
        raise RecordError("malformed_turn", "conversation", "a list of {role, content} turns", fmt)
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("role") not in ROLES:
            raise RecordError("malformed_turn", f"conversation[{i}].role", f"one of {ROLES}", fmt)
        out.append({"role": t["role"], "content": text(t.get("content"), f"conversation[{i}].content", fmt)})
    media = []
    for i, m in enumerate(rec.get("media") or []):
        if not isinstance(m, dict) or m.get("kind") not in KINDS or not isinstance(m.get("path"), str):
            raise RecordError("malformed_media", f"media[{i}]", f"{{kind: one of {KINDS}, path}}", fmt)
        media.append((m["kind"], local(m["path"], f"media[{i}].path", fmt)))
    return out, media
