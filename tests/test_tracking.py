"""Experiment tracking (hetero/training/tracking.py): an offline W&B run holds the run's config, every step's
metrics, the validation losses and loss.png, read back from the run file W&B wrote; a resumed run logs into
the same W&B run.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_tracking.py -q

The reader below walks W&B's transaction log (run-<id>.wandb: a 7-byte ":W&B" header, then leveldb-log
blocks of 32 KiB whose records carry a 7-byte header: checksum, length, type FULL/FIRST/MIDDLE/LAST) and
parses each record with W&B's own protobuf (wandb.proto.wandb_internal_pb2.Record).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tessera.hetero.training.metrics import RunMetrics
from tessera.hetero.training.tracking import WandbTracker, wandb_run_id

BLOCK, HEADER = 32 * 1024, 7


def _records(path: Path) -> list:
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, pos, parts = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            break
        parts += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # FULL or LAST: one whole record
            rec = Record()
            rec.ParseFromString(parts)
            out.append(rec)
            parts = b""
    return out


def _history(records) -> dict[int, dict]:
    steps = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            steps.setdefault(r.history.step.num, {}).update(items)
    return steps


def _record(step: int) -> dict:
    return {"step": step, "loss": 5.0 / step, "lr": {"language": 1e-3}, "grad_norm": 1.0, "tokens_per_s": 10.0,
            "step_time_s": 0.1, "model_flops": {"language": 3e9}, "mfu": None}


def test_offline_wandb_run_holds_config_metrics_val_and_plot(tmp_path):
    config = {"name": "t", "model": {"llm": "nemotron_h_tiny_dense"}, "trainer": {"max_steps": 3}}
    tracker = WandbTracker("tessera-test", tmp_path, "t", config, mode="offline")
    m = RunMetrics(tmp_path, 3, progress=False, tensorboard=False, tracker=tracker)
    for step in (1, 2, 3):
        m.log(_record(step))
    m.log_val(3, {"synthetic": 2.5})
    m.close()

    (run_file,) = tmp_path.glob(f"wandb/offline-run-*/run-{wandb_run_id(tmp_path)}.wandb")
    records = _records(run_file)
    steps = _history(records)
    assert [steps[s]["loss"] for s in (1, 2, 3)] == [5.0, 2.5, 5.0 / 3]
    assert steps[1]["lr/language"] == 1e-3 and steps[2]["model_flops/language"] == 3e9
    assert steps[3]["val/synthetic/loss"] == 2.5
    files = [f.path for r in records if r.WhichOneof("record_type") == "files" for f in r.files.files]
    png = [f for f in files if f.startswith("media/images/loss_png")]
    assert any(k.startswith("loss_png/") for k in steps[3]) and png, f"loss.png was not logged: {files}"
    assert (run_file.parent / "files" / png[0]).read_bytes() == (tmp_path / "loss.png").read_bytes()
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]  # the run record holds the config
    assert (run.run_id, run.project, run.display_name) == (wandb_run_id(tmp_path), "tessera-test", "t")
    conf = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert conf["model"] == {"llm": "nemotron_h_tiny_dense"} and conf["trainer"] == {"max_steps": 3}


def test_a_resumed_run_keeps_its_wandb_id(tmp_path):
    assert wandb_run_id(tmp_path) == wandb_run_id(str(tmp_path) + "/") != wandb_run_id(tmp_path / "other")
