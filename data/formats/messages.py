"""OpenAI / TRL / ms-swift messages: {"messages": [{"role": "system"|"user"|"assistant", "content": str | [parts]}...]},
a part {"type": "text", "text"} or {"type": "image"|"video"|"audio", KIND|"path": a local path}. A media part without
a path (TRL's VLM rows), and each <image>/<video>/<audio> tag of a string content (ms-swift), takes the next item of
the row's "images"/"videos"/"audios" list."""

from collections import Counter

from tessera.data.formats.common import KINDS, ROLES, RecordError, items, local, text
from tessera.data.tokens import MEDIA_TAGS

NAME, KEYS, FIELD = "messages", "messages (+ images/videos/audios)", "messages"


def detect(rec: dict) -> bool:
    return "messages" in rec


def convert(rec: dict):
    turns = rec["messages"]
    if not isinstance(turns, list):
        raise RecordError("malformed_turn", "messages", "a list of {role, content} messages", NAME)
    pools = {k: items(rec, k, NAME) for k in KINDS}  # what parts without a path take, in order
    taken = Counter()
    out, media = [], []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("role") not in ROLES:
            raise RecordError("malformed_turn", f"messages[{i}].role", f"one of {ROLES}", NAME)
        content = t.get("content")
        if isinstance(content, str):  # tags in the text refer to the row's lists
            for k in KINDS:
                for _ in range(content.count(MEDIA_TAGS[k])):
                    media.append((k, pools[k][taken[k]] if taken[k] < len(pools[k]) else None))
                    taken[k] += 1
            out.append({"role": t["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RecordError("malformed_turn", f"messages[{i}].content", "a string or a list of parts", NAME)
        said = ""
        for j, part in enumerate(content):
            field = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                said += text(part.get("text"), field + ".text", NAME)
                continue
            if kind not in KINDS:
                raise RecordError("malformed_part", field + ".type", f"one of text, {', '.join(KINDS)} (got "
                                  f"{kind!r})", NAME)
            source = part.get(kind) or part.get("path")
            if source is None:
                source = pools[kind][taken[kind]] if taken[kind] < len(pools[kind]) else None
                taken[kind] += 1
            media.append((kind, source if source is None else local(source, field, NAME)))
            said += MEDIA_TAGS[kind]
        out.append({"role": t["role"], "content": said})
    for k in KINDS:  # a part with no item left, or items no part took
        if taken[k] != len(pools[k]) and (taken[k] or pools[k]):
            raise RecordError("placeholder_mismatch", k + "s", f"one {k} part or {MEDIA_TAGS[k]} per item of "
                              f"{k + 's'!r}: {taken[k]} for {len(pools[k])} item(s)", NAME)
    return out, media
