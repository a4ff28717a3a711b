"""LLaMA-Factory's alpaca: {"instruction", "input"?, "output", "system"?, "history"?: [[query, response]...],
"images"?, "videos"?, "audios"?: lists of paths}, <image>/<video>/<audio> tags in the texts, one per item (LLaMA-Factory
data/README.md). The user turn is instruction + "\\n" + input when input is not empty (its converter's rule); the
history's pairs come first, each a user and an assistant turn."""

from tessera.data.formats.common import KINDS, RecordError, items, text

NAME, KEYS, FIELD = "alpaca", "instruction + output (+ input, system, history, images/videos/audios)", "output"


def detect(rec: dict) -> bool:
    return "instruction" in rec and "output" in rec


def convert(rec: dict):
    turns = [{"role": "system", "content": text(rec["system"], "system", NAME)}] if rec.get("system") else []
    history = rec.get("history") or []
    if not isinstance(history, list):
        raise RecordError("malformed_turn", "history", "a list of [query, response] pairs", NAME)
    for i, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise RecordError("malformed_turn", f"history[{i}]", "a [query, response] pair", NAME)
        turns += [{"role": "user", "content": text(pair[0], f"history[{i}][0]", NAME)},
                  {"role": "assistant", "content": text(pair[1], f"history[{i}][1]", NAME)}]
    query = text(rec["instruction"], "instruction", NAME)
    if rec.get("input"):
        query += "\n" + text(rec["input"], "input", NAME)
    turns += [{"role": "user", "content": query}, {"role": "assistant", "content": text(rec["output"], "output", NAME)}]
    return turns, [(k, s) for k in KINDS for s in items({k + "s": rec.get(k + "s")}, k, NAME)]
