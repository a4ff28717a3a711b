"""A source prepared by several workers, each writing its own shards (scripts/prepare_data.py --workers N).

Worker i takes the i-th part of the records (data/prepare_sources.py: contiguous rows of an array or a dataset,
every N-th line of a JSONL file), detects each record's format and turns it into Tessera's conversation
(data/formats/), reads its media and writes shard-III-NNNNNN.tar (shard-NNNNNN.tar with one worker): the
media probes (data/media_meta.py) run where the bytes are read, and no bytes cross a process boundary. Workers are
forked after the source is opened, so a JSON array is parsed once and shared. Memory is flat in the number of
records: records stream through, and only a bounded sample of texts is kept for the tokenizer trained on the dataset.
A record that cannot be used is skipped, counted by reason and named (where, field, what was expected).
"""

from __future__ import annotations

import re
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from tessera.data.formats import RecordError, detect, to_conversation
from tessera.data.prepare import remove_stale_shards, write_part
from tessera.data.prepare_sources import media_bytes

#: texts each worker keeps for the tokenizer trained on the dataset (data/tokens.train_sentencepiece): a sample
#: large enough for a few-hundred-piece vocabulary, bounded so that memory does not grow with the dataset
TEXTS_PER_WORKER = 20_000
FIRST_REASONS = 3


@dataclass
class Prepared:
    counts: Counter = field(default_factory=Counter)  # samples, and media items by kind
    skipped: Counter = field(default_factory=Counter)  # by reason
    formats: Counter = field(default_factory=Counter)  # records by detected format
    reasons: list[str] = field(default_factory=list)  # the first skips, in words
    texts: list[str] = field(default_factory=list)
    written: set[str] = field(default_factory=set)

    def merge(self, other: "Prepared") -> None:
        self.counts += other.counts
        self.skipped += other.skipped
        self.formats += other.formats
        self.reasons += other.reasons[:FIRST_REASONS - len(self.reasons)]
        self.texts += other.texts
        self.written |= other.written

    @property
    def format(self) -> str:
        """The detected format(s), most records first: 'llava', or 'messages (12), tessera (2)'."""
        if len(self.formats) <= 1:
            return next(iter(self.formats), "none")
        return ", ".join(f"{f} ({n})" for f, n in self.formats.most_common())


def sample_key(rec, index: int, name: str) -> str:
    """A unique tar key: the source's name and the record's index, then its id when it has one. webdataset splits a
    member name at its first '.', so anything but letters, digits, '_' and '-' becomes '_'."""
    rid = rec.get("id") if isinstance(rec, dict) else None
    key = f"{name}_{index:07d}" + (f"_{rid}" if rid not in (None, "") else "")
    return re.sub(r"[^A-Za-z0-9_-]", "_", key)


def prepare_part(source, part: int, parts: int, out: Path, shard_size: int, tick=lambda: None,
                 user_format=None) -> Prepared:
    """Worker `part` of `parts`: its records of `source` into its own shards in `out`. user_format: a
    converter of every record instead of the detected format's module (data/formats/user.UserFormat for --format,
    data/formats/columns.Columns for --columns and a folder builder's layout): its .name is the format reported."""
    result = Prepared()

    def samples():
        for index, where, rec in source.records(part, parts):
            tick()
            try:
                if isinstance(rec, RecordError):
                    raise rec
                if user_format is not None:
                    result.formats[user_format.name] += 1
                    turns, media = user_format(rec)
                else:
                    fmt = detect(rec)
                    result.formats[fmt] += 1
                    turns, media = to_conversation(rec, fmt)
                items = [media_bytes(kind, src, source.root) for kind, src in media]
            except RecordError as e:
                result.skipped[e.reason] += 1
                if len(result.reasons) < FIRST_REASONS:
                    result.reasons.append(f"{e.reason} at {where}: {e}")
                tqdm.write(f"[prepare] skip {where}: {e.reason}: {e}", file=sys.stderr)  # above the bar
                continue
            if len(result.texts) < TEXTS_PER_WORKER:
                result.texts.extend(t["content"] for t in turns)
            yield sample_key(rec, index, source.name), turns, items

    pattern = "shard-%06d.tar" if parts == 1 else f"shard-{part:03d}-%06d.tar"
    result.counts, result.written = write_part(samples(), out, shard_size, pattern=pattern)
    return result


def _worker(source, part, parts, out, shard_size, done, results, user_format):
    def tick():
        with done.get_lock():
            done.value += 1

    try:
        results.put((part, prepare_part(source, part, parts, out, shard_size, tick, user_format)))
    except BaseException:
        results.put((part, traceback.format_exc()))


def prepare_source(source, out: Path, shard_size: int, workers: int = 1, user_format=None) -> Prepared:
    """Every record of `source` into shards in `out` by `workers` processes, with a progress bar on stderr; the
    shards of an earlier run that this one did not write are removed. user_format: prepare_part's."""
    out.mkdir(parents=True, exist_ok=True)
    result = Prepared()
    # on a terminal only (disable=None): in a log, the skip lines and the summary say it all
    bar = tqdm(total=source.total, unit="rec", desc="[prepare]", file=sys.stderr, mininterval=1.0, dynamic_ncols=True,
               disable=None)
    if workers == 1:
        result.merge(prepare_part(source, 0, 1, out, shard_size, lambda: bar.update(1), user_format))
    else:
        import multiprocessing as mp
        import queue

        ctx = mp.get_context("fork")  # the workers share the opened source (a parsed JSON array, an Arrow table)
        done, results = ctx.Value("q", 0), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(source, i, workers, out, shard_size, done, results, user_format),
                             daemon=True)
                 for i in range(workers)]
        for p in procs:
            p.start()
        got: dict[int, Prepared | str] = {}
        while len(got) < workers:
            try:
                part, res = results.get(timeout=0.5)
                got[part] = res
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in got and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"prepare worker {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                       f"(out of memory?); re-run with fewer --workers")
            bar.update(done.value - bar.n)
        for p in procs:
            p.join()
        failed = {i: r for i, r in got.items() if isinstance(r, str)}
        if failed:
            i, tb = next(iter(failed.items()))
            raise RuntimeError(f"prepare worker {i} failed:\n{tb}")
        for i in range(workers):
            result.merge(got[i])
        bar.update(done.value - bar.n)
    bar.close()
    for p in remove_stale_shards(out, result.written):
        print(f"[prepare] removed {p} (left by an earlier run, not written by this one)", file=sys.stderr)
    return result
