"""The multi-image SFT collections' layout (the_cauldron, Idefics / SmolVLM-style sets): {"images": [Image...],
"texts": [{"user", "assistant", "source"?}...]}, other keys of a turn ignored. The images carry no tags: every image
of a row belongs before its first user turn (as these collections are meant), one <image> each, then a newline."""

from tessera.data.formats.common import RecordError, items, text

NAME, KEYS, FIELD = "cauldron", "images + texts [{user, assistant}]", "texts"


def detect(rec: dict) -> bool:
    return "texts" in rec and "images" in rec


def convert(rec: dict):
    pairs = rec["texts"]
    if not isinstance(pairs, list):
        raise RecordError("malformed_turn", "texts", "a list of {user, assistant} turns", NAME)
    images = items({"images": rec["images"]}, "image", NAME)
    turns = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, dict):
            raise RecordError("malformed_turn", f"texts[{i}]", "a {user, assistant} turn", NAME)
        user = text(pair.get("user"), f"texts[{i}].user", NAME)
        if i == 0 and images:
            user = "<image>" * len(images) + "\n" + user
        turns += [{"role": "user", "content": user},
                  {"role": "assistant", "content": text(pair.get("assistant"), f"texts[{i}].assistant", NAME)}]
    return turns, [("image", s) for s in images]
