"""LLaVA / ShareGPT, and LLaMA-Factory's sharegpt: {"conversations": [{"from": "human"|"gpt"|"system", "value":
"<image>\\n..."}...], "image"|"video"|"audio" (LLaVA: a path or a list) or "images"|"videos"|"audios" (LLaMA-Factory,
Hugging Face rows: lists, Image/Audio features), "system"? (LLaMA-Factory: the system prompt, a first system turn)}."""

from tessera.data.formats.common import KINDS, RecordError, items, role_turns, text

NAME, KEYS, FIELD = "llava", "conversations (+ image(s)/video(s)/audio(s), system)", "conversations"
#: LLaVA / ShareGPT speaker names (their `from`) -> roles
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def detect(rec: dict) -> bool:
    return "conversations" in rec


def convert(rec: dict):
    turns = role_turns(rec["conversations"], "conversations", "from", "value", ROLES, NAME)
    if rec.get("system"):  # LLaMA-Factory's top-level system prompt (LLaVA records have none)
        if turns and turns[0]["role"] == "system":
            raise RecordError("malformed_turn", "system", "a system prompt or a first system turn, not both", NAME)
        turns = [{"role": "system", "content": text(rec["system"], "system", NAME)}] + turns
    return turns, [(k, s) for k in KINDS for s in items(rec, k, NAME)]
