"""Energon task encoder and loader: webdataset shards → packed global microbatches, resumable.

Pipeline (energon runs every stage inside its worker processes and checkpoints all of them):
  cook          raw tar members, untouched (decoder=None: we decode ourselves to count and name failures)
  preencode     parse the JSON, probe media headers → predicted tiles/frames/samples → placeholder sizes,
                tokenize; too-long or misaligned samples are skipped here, before they take buffer space
  pack          first-fit-decreasing over a buffer of `packing_buffer` samples into rows of seq_length
  postencode    decode the media of the samples in one row and check the decode against the prediction;
                a sample failing here is dropped from its row before positions are computed, so the
                alignment of the row stays exact
  batch         N rows → PackedBatch (the global microbatch)

Why energon: it gives deterministic shuffling, blending (metadataset YAML with weights) and exact
save/restore of every buffer (including the packing buffer) for free. Why rank 0 of world 1 on every rank:
a heterogeneous layout gives each module its own DP size, so energon's per-rank sample split (one DP size)
cannot serve all modules; instead every rank reads the same global stream and data/sharding.py cuts each
module's rows from it, which also makes the per-sample metadata available on every rank.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from megatron.energon import (Cooker, Sample, SkipSample, TaskEncoder, WorkerConfig,
                              get_savable_loader, get_train_dataset, stateless)
from megatron.energon.edataclass import edataclass
from megatron.energon.errors import FatalSampleError

from data.media import (MediaError, choose_grid, decode_audio, decode_image, decode_video, probe_audio,
                        probe_image, probe_video, sample_indices)
from data.packing import EncodedSample, PackedSample, collate, first_fit_decreasing, pack_row
from data.tokens import MEDIA_TAGS, EncoderTokens, PromptError, Tokenizer, encode_conversation

log = logging.getLogger("tessera.data")


@edataclass
class RawSample(Sample):
    members: dict  # tar member suffix (e.g. "json", "img0.jpg") -> bytes


@stateless
def cook_raw(sample: dict) -> RawSample:
    members = {k: v for k, v in sample.items() if not k.startswith("__")}
    return RawSample(__key__=sample["__key__"], __restore_key__=sample["__restore_key__"],
                     __subflavors__=sample.get("__subflavors__"), __sources__=sample.get("__sources__"),
                     members=members)


def _shard_of(sample: Sample) -> str:
    src = sample.__sources__
    return src[0].shard_name if src else "?"


class ChatTaskEncoder(TaskEncoder):
    """Chat/caption samples with images, videos and audio → packed rows (see module docstring)."""

    decoder = None
    cookers = [Cooker(cook_raw)]

    def __init__(self, tokenizer: str | Path | Tokenizer, seq_length: int, encoder: EncoderTokens = EncoderTokens(),
                 strict: bool = False):
        self.tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
        self.seq_length = seq_length
        self.enc = encoder
        self.strict = strict
        # Skips seen by this process since its last batch; each batch carries them to the training loop.
        self._pending: Counter = Counter()

    def _skip(self, sample: Sample, category: str, reason: str):
        msg = f"skipped sample: shard={_shard_of(sample)} key={sample.__key__} reason={category}: {reason}"
        if self.strict:
            raise FatalSampleError(msg + " (strict mode)")
        self._pending[category] += 1
        log.warning(msg)
        raise SkipSample(msg)

    def _units(self, kind: str, data: bytes) -> int:
        """Predicted tiles / frames / 16 kHz samples of one item, from headers only."""
        if kind == "image":
            w, h = probe_image(data)
            return choose_grid(w, h, self.enc.max_tiles, self.enc.thumbnail, self.enc.tile).num_tiles
        if kind == "video":
            return len(sample_indices(probe_video(data), self.enc.video_frames))
        return probe_audio(data, self.enc.audio_rate)

    @stateless
    def preencode_sample(self, sample: RawSample) -> EncodedSample:
        m = sample.members
        try:
            meta = json.loads(m["json"])
            turns, items = meta["conversation"], meta.get("media", [])
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
            self._skip(sample, "corrupt_member", f"json member unreadable ({type(e).__name__}: {e})")
        raw = []
        for it in items:
            if it.get("kind") not in MEDIA_TAGS:
                self._skip(sample, "corrupt_member", f"unknown media kind {it.get('kind')!r}")
            if m.get(it.get("field")) is None:
                self._skip(sample, "missing_modality", f"{it['kind']} member '{it.get('field')}' not in shard")
            raw.append((it["kind"], m[it["field"]]))
        units = []
        for kind, data in raw:
            try:
                units.append(self._units(kind, data))
            except MediaError as e:
                self._skip(sample, f"undecodable_{kind}", str(e))
        try:
            prompt = encode_conversation(self.tok, turns, [k for k, _ in raw],
                                         [self.enc.tokens(k, u) for (k, _), u in zip(raw, units)])
        except PromptError as e:
            self._skip(sample, "missing_modality" if "missing modality" in str(e) else "extra_media", str(e))
        if len(prompt) > self.seq_length:
            self._skip(sample, "too_long", f"{len(prompt)} tokens > seq_length {self.seq_length}")
        return EncodedSample.derive_from(sample, prompt=prompt, raw_media=raw, media=[], units=units,
                                         shard=_shard_of(sample))

    @stateless
    def postencode_sample(self, sample: EncodedSample) -> EncodedSample:
        decoded = []
        for kind, data in sample.raw_media:
            try:
                if kind == "image":
                    arr = decode_image(data, self.enc.tile, self.enc.max_tiles, self.enc.thumbnail)
                    n = arr.shape[0]
                elif kind == "video":
                    arr = decode_video(data, self.enc.video_frames, self.enc.tile)
                    n = arr[0].shape[0]
                else:
                    arr = decode_audio(data, self.enc.audio_rate)
                    n = arr.shape[0]
            except MediaError as e:
                self._skip(sample, f"undecodable_{kind}", str(e))
            decoded.append((kind, n, arr))
        for (kind, n, _), want in zip(decoded, sample.units):
            if n != want:
                self._skip(sample, f"undecodable_{kind}", f"decoded {n} units but the header predicted {want}")
        media = [(module, decoded[item][0], decoded[item][1], decoded[item][2])
                 for module, _, _, item in sample.prompt.spans]
        return EncodedSample.derive_from(sample, prompt=sample.prompt, raw_media=[], media=media,
                                         units=sample.units, shard=sample.shard)

    def select_samples_to_pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        groups = first_fit_decreasing([len(s) for s in samples], self.seq_length)
        return [[samples[i] for i in g] for g in groups]

    @stateless
    def pack_selected_samples(self, samples: list[EncodedSample]) -> PackedSample:
        return pack_row(samples, self.seq_length, self.tok.pad_id)

    def batch(self, rows: list[PackedSample]):
        skipped, self._pending = dict(self._pending), Counter()
        return collate(rows, skipped)


def build_loader(path: str | Path, task_encoder: ChatTaskEncoder, rows_per_microbatch: int, *,
                 num_workers: int = 0, seed: int = 0, packing_buffer: int = 32, shuffle_buffer: int = 64,
                 samples_per_sequence: int | None = 16, repeat: bool = True, state=None):
    """A SavableDataLoader of global PackedBatch microbatches, restored from `state` when given.

    `path` is a prepared dataset (energon prepare) or a metadataset YAML with a weighted blend; repeat=False
    stops after one epoch (evaluation, counting). The stream
    depends only on (path, seed, num_workers, buffers), never on the rank: see the module docstring."""
    wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed_offset=seed)
    ds = get_train_dataset(str(path), worker_config=wc, batch_size=rows_per_microbatch,
                           packing_buffer_size=packing_buffer, shuffle_buffer_size=shuffle_buffer,
                           max_samples_per_sequence=samples_per_sequence, task_encoder=task_encoder,
                           repeat=repeat)
    loader = get_savable_loader(ds, checkpoint_every_min_n_samples=1)
    if state is not None:
        loader.restore_state_rank(state)
    return loader


class SkipStats(Counter):
    """Running count of skipped samples by reason, fed from PackedBatch.skipped."""

    def add(self, batch) -> "SkipStats":
        self.update(batch.skipped)
        return self

    def line(self) -> str:
        return "skipped " + (", ".join(f"{k}={v}" for k, v in sorted(self.items())) or "none")
