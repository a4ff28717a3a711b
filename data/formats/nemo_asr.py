"""NeMo's ASR manifest: JSONL {"audio_filepath", "duration", "text", "offset"?} (also "audio_filename",
"normalized_text", "text_filepath"), read by NeMo's own line parser (nemo.collections.common.parts.preprocessing
.manifest: the names it accepts and what they mean are NeMo's, not a copy here). A relative path resolves against
the manifest's folder, as NeMo's get_full_path does (or --media-root). With an `offset`, only the span [offset,
offset + duration] of the file is the sample (cut at prepare: data/prepare_sources.media_bytes); without one the
file is taken whole. The user turn is the audio caption prompt (common.PROMPTS), the transcript the answer."""

import json

from tessera.data.formats.common import RecordError, caption_chat, local

NAME, KEYS, FIELD = "nemo_asr", "audio_filepath + duration + text (+ offset)", "text"
AUDIO_KEYS, TEXT_KEYS = ("audio_filepath", "audio_filename"), ("text", "normalized_text", "text_filepath")
#: NeMo's speech-LLM manifests have these on the same lines: not a transcript record
PROMPT_KEYS = ("answer", "question", "context")


def detect(rec: dict) -> bool:
    return (any(k in rec for k in AUDIO_KEYS) and "duration" in rec and any(k in rec for k in TEXT_KEYS)
            and not any(k in rec for k in PROMPT_KEYS))


def parse_line(rec: dict) -> dict:
    """NeMo's reading of the manifest line `rec`: {audio_file, duration, offset, text, ...}. Paths stay relative (the
    manifest named here has no folder): Tessera resolves them against the manifest's folder or --media-root."""
    from nemo.collections.common.parts.preprocessing import manifest  # ~15 s: only when a NeMo manifest is read

    try:
        return getattr(manifest, "__parse_item")(json.dumps(rec), "manifest.json")
    except (ValueError, TypeError, OSError) as e:
        raise RecordError("malformed_manifest_line", "(line)", f"a line NeMo's manifest reader accepts ({e})",
                          NAME) from e


def audio_source(item: dict, fmt: str):
    """The audio of a parsed line: its path, or {path, offset, duration} for a span."""
    path = local(item["audio_file"], "audio_filepath", fmt)
    if item.get("offset") is None:
        return path
    for key in ("offset", "duration"):
        if not isinstance(item[key], (int, float)) or item[key] < 0:
            raise RecordError("malformed_media", key, f"seconds (a number >= 0), got {item[key]!r}", fmt)
    return {"path": path, "offset": float(item["offset"]), "duration": float(item["duration"])}


def convert(rec: dict):
    item = parse_line(rec)
    if not isinstance(item["text"], str):
        raise RecordError("malformed_turn", "text", f"a string, got {type(item['text']).__name__}", NAME)
    return caption_chat("audio", item["text"]), [("audio", audio_source(item, NAME))]
