"""Data reads at cluster scale (issue 31): every rank reads the JSON of the global stream, and the media bytes of
only the items it decodes, each exactly once per decoding replica; a dataset prepared before the media metadata
loads the same batches; a member replaced after prepare is blanked and counted as metadata_mismatch.

Each rank of a layout is simulated in this process (its loader with its decode plan, no workers); the expected
reads come from the shards themselves (python's tarfile), not from the loader.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_data_reads.py -q
"""

from __future__ import annotations

import functools
import logging
import tarfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from tessera.data.loader import ChatTaskEncoder, build_loader, close_loader
from tessera.data.prepare import make_synthetic, shard_media
from tessera.data.tokens import MODULE_OF_KIND, EncoderTokens, Tokenizer
from tessera.hetero.plan.layout import HeteroLayout
from tessera.hetero.plan.resolved_run import decode_rows

SEQ, ROWS, STEPS = 512, 4, 3
ENC = EncoderTokens(patch=64)
LAYOUTS = ["vision=dp2@0-1;audio=dp2@2-3;language=tp4@4-7", "vision=tp2,dp2@0-3;audio=dp4@0-3;language=tp2,dp2@0-3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("reads")
    make_synthetic(root / "meta", samples=32, seed=3)
    make_synthetic(root / "legacy", samples=32, seed=3, tokenizer=False, media_meta=False)
    return root


def _items(path: Path) -> dict[str, list[tuple[str, str, int]]]:
    """sample key -> [(module, tar entry name, bytes)] of its media, read from the shards with tarfile."""
    return {key: [(MODULE_OF_KIND[kind], name, size) for kind, name, size in items]
            for key, items in shard_media(path).items()}


def _run_rank(path: Path, tokenizer: Path, decode, monkeypatch) -> tuple[list, Counter, set]:
    """STEPS microbatches of one rank's loader; the media members it fetched; the members its stream saw."""
    from megatron.energon.cache.file_store import WebdatasetFileStore

    fetched, seen = Counter(), set()
    getitem, preencode = WebdatasetFileStore.__getitem__, ChatTaskEncoder.preencode_sample

    def counting_getitem(self, name):
        fetched[name] += 1
        return getitem(self, name)

    @functools.wraps(preencode)  # energon looks the method up by its name
    def seeing_preencode(self, sample):
        seen.update(sample.members)
        return preencode(self, sample)

    monkeypatch.setattr(WebdatasetFileStore, "__getitem__", counting_getitem)
    monkeypatch.setattr(ChatTaskEncoder, "preencode_sample", seeing_preencode)
    loader = build_loader(path, ChatTaskEncoder(Tokenizer(tokenizer), SEQ, ENC, decode=decode), ROWS)
    it = iter(loader)
    batches = [next(it) for _ in range(STEPS)]
    close_loader(loader)
    monkeypatch.undo()
    return batches, fetched, seen


@pytest.mark.parametrize("spec", LAYOUTS)
def test_every_item_is_read_once_per_decoding_replica_and_nowhere_else(data, spec, monkeypatch):
    layout, items = HeteroLayout.parse(spec), _items(data / "meta")
    total = Counter()
    for rank in range(layout.world_size):
        plan = decode_rows(layout, rank, ROWS)
        batches, fetched, seen = _run_rank(data / "meta", data / "meta" / "tokenizer.model", plan, monkeypatch)
        assert seen == {"json"}, f"rank {rank}: the global stream read {sorted(seen)}"
        expected = Counter(name for b in batches for row, keys in enumerate(b.keys) for key in keys
                           for module, name, _ in items[key] if row in plan.get(module, ()))
        assert fetched == expected, f"rank {rank} ({spec}) read other media than it decodes"
        media_bytes = sum(size for b in batches for row, keys in enumerate(b.keys) for key in keys
                          for module, _, size in items[key] if row in plan.get(module, ()))
        json_bytes = sum(b.read_bytes for b in batches) - media_bytes  # what the stream read: JSON members only
        assert 0 < json_bytes < 2000 * len(items), (rank, json_bytes)
        total.update(fetched)
    # across the layout: each item of the stream (every rank's, the same) read by exactly its module's replicas of
    # the DP rank that owns its row (TP/CP/PP peers), so once per decoding replica
    replicas = {k: m.tp * m.cp * m.pp for k, m in layout.modules.items()}
    served = Counter((module, name) for b in batches for keys in b.keys for key in keys for module, name, _ in items[key])
    assert served and total == Counter({name: n * replicas[module] for (module, name), n in served.items()})


def test_a_dataset_prepared_without_metadata_loads_the_same_batches(data, caplog):
    tok = data / "meta" / "tokenizer.model"
    from tessera.data import loader

    loader.log.addHandler(caplog.handler)  # on the loader's own logger: the root may have been replaced by a library
    try:
        with caplog.at_level(logging.WARNING, logger="tessera.data"):
            old = list(build_loader(data / "legacy", ChatTaskEncoder(Tokenizer(tok), SEQ, ENC), ROWS, repeat=False))
    finally:
        loader.log.removeHandler(caplog.handler)
    new = list(build_loader(data / "meta", ChatTaskEncoder(Tokenizer(tok), SEQ, ENC), ROWS, repeat=False))
    assert "prepare_data --index" in caplog.text and "has no media metadata" in caplog.text
    assert len(old) == len(new) > 0
    for a, b in zip(old, new):
        assert torch.equal(a.tokens, b.tokens) and a.keys == b.keys
        assert all(x.keys() == y.keys() for x, y in zip(a.media, b.media))
        for x, y in zip(a.media, b.media):
            for module in x:
                for (ka, va), (kb, vb) in zip(x[module], y[module]):
                    va, vb = (va[0], vb[0]) if isinstance(va, tuple) else (va, vb)
                    assert ka == kb and torch.equal(torch.as_tensor(va), torch.as_tensor(vb))
    assert sum(b.read_bytes for b in old) > sum(b.read_bytes for b in new) * 0.9  # both decode every item here


def test_a_member_replaced_after_prepare_is_blanked_as_metadata_mismatch(data, tmp_path):
    """Same length, other bytes (a file swapped in place): caught where it is decoded, blanked and counted; the
    batch keeps its shapes. Strict mode stops with the member named."""
    import shutil

    from megatron.energon.errors import FatalSampleError

    root = tmp_path / "replaced"
    shutil.copytree(data / "meta", root)
    shard = sorted(root.glob("*.tar"))[0]
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))
    with open(shard, "r+b") as f:  # flip the middle of the JPEG's entropy-coded data: its header still parses
        f.seek(member.offset_data + member.size // 2)
        chunk = f.read(64)
        f.seek(member.offset_data + member.size // 2)
        f.write(bytes(b ^ 0x5A for b in chunk))
    tok = Tokenizer(root / "tokenizer.model")
    batches = list(build_loader(root, ChatTaskEncoder(tok, SEQ, ENC), ROWS, repeat=False))
    skipped = Counter()
    for b in batches:
        skipped.update(b.skipped)
    assert skipped == Counter({"metadata_mismatch_blanked": 1}), skipped
    with pytest.raises(FatalSampleError, match=f"reason=metadata_mismatch: member {member.name.split('.', 1)[1]}"):
        list(build_loader(root, ChatTaskEncoder(tok, SEQ, ENC, strict=True), ROWS, repeat=False))


def test_index_adds_the_metadata_to_an_old_dataset(data, tmp_path, monkeypatch):
    """`prepare_data --index --out DIR` on a dataset prepared without metadata: afterwards its stream reads JSON
    only and it serves the batches it served before."""
    import shutil

    from tessera.scripts import prepare_data

    root = tmp_path / "old"
    shutil.copytree(data / "legacy", root)
    tok = data / "meta" / "tokenizer.model"
    before, _, seen = _run_rank(root, tok, None, monkeypatch)
    assert seen != {"json"}
    assert prepare_data.main(["--index", "--out", str(root), "--tokenizer", str(tok)]) == 0
    after, fetched, seen = _run_rank(root, tok, None, monkeypatch)
    assert seen == {"json"} and fetched
    for a, b in zip(before, after):
        assert torch.equal(a.tokens, b.tokens) and a.keys == b.keys and a.positions[0].keys() == b.positions[0].keys()
