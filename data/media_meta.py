"""What packing needs of a media item, stored at prepare time so the global stream never reads media bytes.

Every rank reads the whole global stream (data/loader.py): the metadata of every sample, for the boundary plan.
Only the ranks that decode an item need its bytes. So `prepare` probes each item once and writes the facts into the
sample's JSON member, beside the item's field:

    {"kind": "image", "field": "img0.jpg", "bytes": 6291456, "crc32": 2876543210, "probe": {"width": 4000, ...}}
    {"kind": "video", "field": "vid0.mp4", "bytes": ..., "crc32": ..., "probe": {"frames", "width", "height", "fps"}}
    {"kind": "audio", "field": "aud0.flac", "bytes": ..., "crc32": ..., "probe": {"frames", "rate"}}
    an item whose header cannot be read: "error": {"reason": ..., "message": ...} in place of "probe"

The probe facts are the header probes' own results (data/media.probe_*), so the placeholders sized from them are
the ones sized from the bytes. The byte length and CRC-32 tie them to the bytes: a member replaced after prepare is
caught where it is decoded (`check_bytes`, reason `metadata_mismatch`), never as a shape error in the encoder.
"""

from __future__ import annotations

import zlib

from tessera.data.media import MediaError, probe_audio_header, probe_image, probe_video

#: the dataset.yaml line that makes energon's reader take only the JSON member of each sample from the tar
PART_FILTER = "part_filter: [json]"
INDEX_COMMAND = "python -m tessera.scripts.prepare_data --index --out DIR"


def probe_facts(kind: str, data: bytes) -> dict:
    """The header facts of one item (MediaError when its header cannot be read)."""
    if kind == "image":
        width, height = probe_image(data)
        return {"width": width, "height": height}
    if kind == "video":
        head = probe_video(data)
        return {"frames": head.frames, "width": head.width, "height": head.height, "fps": head.fps}
    frames, rate = probe_audio_header(data)
    return {"frames": frames, "rate": rate}


def item_entry(kind: str, field: str, data: bytes) -> dict:
    """The JSON entry of one media item: where it is, what it is, and how to know its bytes again."""
    entry = {"kind": kind, "field": field, "bytes": len(data), "crc32": zlib.crc32(data)}
    try:
        entry["probe"] = probe_facts(kind, data)
    except MediaError as e:  # kept, not dropped: the loader skips the sample with the reason it always gave
        entry["error"] = {"reason": e.reason or f"undecodable_{kind}", "message": str(e)}
    return entry


def has_facts(entry: dict) -> bool:
    return "bytes" in entry and ("probe" in entry or "error" in entry)


def facts_of(entry: dict) -> dict:
    """The stored probe facts; the stored probe failure raised as the MediaError it was."""
    if "error" in entry:
        raise MediaError(entry["error"]["message"], reason=entry["error"]["reason"])
    return entry["probe"]


def check_bytes(entry: dict, data: bytes) -> None:
    """Raise MediaError(reason='metadata_mismatch') unless `data` are the bytes the entry was prepared from."""
    if len(data) != entry["bytes"] or zlib.crc32(data) != entry["crc32"]:
        raise MediaError(f"member {entry['field']} is not what was prepared ({len(data)} bytes, crc32 "
                         f"{zlib.crc32(data)}; prepared: {entry['bytes']} bytes, crc32 {entry['crc32']}): it was "
                         f"replaced after prepare; re-run {INDEX_COMMAND}", reason="metadata_mismatch")
