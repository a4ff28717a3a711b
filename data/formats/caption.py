"""A caption record: {"image"|"video"|"audio": path, "caption": text}; the user turn is the kind's prompt
(common.PROMPTS)."""

from tessera.data.formats.common import KINDS, RecordError, caption_chat, items, text

NAME, KEYS, FIELD = "caption", "image|video|audio + caption", "caption"
#: keys of the chat formats: a chat record that also has a caption field is a chat (they are detected first)
_CHATS = ("conversation", "conversations", "messages")


def detect(rec: dict) -> bool:
    return "caption" in rec and any(k in rec for k in KINDS) and not any(k in rec for k in _CHATS)


def convert(rec: dict):
    kind = next(k for k in KINDS if k in rec)
    found = items(rec, kind, NAME)
    if len(found) != 1:
        raise RecordError("malformed_media", kind, "one media path", NAME)
    return caption_chat(kind, text(rec["caption"], "caption", NAME)), [(kind, found[0])]
