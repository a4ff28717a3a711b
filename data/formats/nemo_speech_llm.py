"""NeMo's speech-LLM (spoken question answering) manifest: JSONL {"audio_filepath", "duration", "offset"?,
"question" and/or "context", "answer", "system_prompt"?} (NeMo's `sqa_as_conversation` data type). The line is read
by NeMo's own parser (data/formats/nemo_asr.parse_line); the turns are those of NeMo's sqa_cut_to_conversation
(nemo.collections.common.data.lhotse.cutset): system_prompt as a system turn, then the context, the question and the
audio as user turns, the answer as the assistant turn. Paths and an offset span as in data/formats/nemo_asr.py."""

from tessera.data.formats.common import RecordError, text
from tessera.data.formats.nemo_asr import AUDIO_KEYS, audio_source, parse_line

NAME, KEYS, FIELD = "nemo_speech_llm", "audio_filepath + duration + question|context + answer", "answer"


def detect(rec: dict) -> bool:
    return (any(k in rec for k in AUDIO_KEYS) and "duration" in rec and "answer" in rec
            and ("question" in rec or "context" in rec))


def convert(rec: dict):
    item = parse_line(rec)
    turns = [{"role": "system", "content": text(rec["system_prompt"], "system_prompt", NAME)}] if rec.get(
        "system_prompt") else []
    for key in ("context", "question"):
        if item.get(key) is not None:
            turns.append({"role": "user", "content": text(item[key], key, NAME)})
    if not isinstance(item["answer"], str):
        raise RecordError("malformed_turn", "answer", f"a string, got {type(item['answer']).__name__}", NAME)
    turns += [{"role": "user", "content": "<audio>"}, {"role": "assistant", "content": item["answer"]}]
    return turns, [("audio", audio_source(item, NAME))]
