"""The loader state in a checkpoint is data (JSON), never a pickle: exact resume through the JSON form, and a
checkpoint whose loader state is a pickle (or anything but that JSON) is refused before anything runs."""

from __future__ import annotations

import io
import json
import os
import pickle
import shlex

import numpy as np
import pytest
from _blend import make_blend, take
import torch

from tessera.data.loader import ChatTaskEncoder, build_loader, close_loader

from tessera.data.tokens import EncoderTokens, Tokenizer
from tessera.hetero.checkpoint.loader_state import decode_loader_state, encode_loader_state

ENC = EncoderTokens(patch=64)
SEQ, ROWS = 512, 2


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    return make_blend(tmp_path_factory.mktemp("blend"), 16, 8)


def _loader(root, workers, state=None):
    te = ChatTaskEncoder(Tokenizer(root / "a" / "tokenizer.model"), SEQ, ENC)
    return build_loader(root / "blend.yaml", te, ROWS, num_workers=workers, seed=5, state=state)




def _same(a, b) -> bool:
    if a.keys != b.keys or not (bool((a.tokens == b.tokens).all()) and bool((a.labels == b.labels).all())):
        return False
    for ma, mb in zip(a.media, b.media):
        for m in ma:
            for (ka, xa), (kb, xb) in zip(ma[m], mb[m]):
                if ka != kb or not np.array_equal(xa[0] if ka == "video" else xa, xb[0] if kb == "video" else xb):
                    return False
    return True


# workers=1 covers the worker-process form (SavableDatasetCheckpoint with the torch/numpy/random RNG states),
# workers=0 the in-process one (nested FlexStates); 2 workers is the same form as 1.
@pytest.mark.parametrize("workers", [0, 1])
def test_json_round_trip_resumes_with_identical_batches(blend, workers):
    straight = take(_loader(blend, workers), 5)
    first = _loader(blend, workers)
    head = take(first, 2, close=False)
    text = encode_loader_state(first.save_state_rank())
    close_loader(first)
    # what the checkpoint holds: text inside the common state, which torch.load(weights_only=True) accepts
    buf = io.BytesIO()
    torch.save({"loader": text}, buf)
    buf.seek(0)
    text = torch.load(buf, weights_only=True)["loader"]
    assert isinstance(text, str) and json.loads(text)["format"] == "tessera-loader-state"
    tail = take(_loader(blend, workers, state=decode_loader_state(text)), 3)
    assert len(head + tail) == len(straight)
    for i, (a, b) in enumerate(zip(straight, head + tail)):
        assert _same(a, b), f"batch {i} differs after the JSON round trip"


class _Payload:
    """What a malicious checkpoint would carry: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_pickle_payload_in_a_checkpoint_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    # the checkpoint a pre-JSON Tessera (or an attacker) writes: the loader state as pickle bytes
    buf = io.BytesIO()
    torch.save({"loader": payload, "step": 3}, buf)
    buf.seek(0)
    common = torch.load(buf, weights_only=True)
    with pytest.raises(ValueError, match=r"loader state is a pickle .*refusing to load it.*arbitrary code.*"
                                         r"resume from a checkpoint written by this version of Tessera"):
        decode_loader_state(common["loader"])
    # ... and the same payload smuggled into the JSON form, or as latin-1 text
    for text in (json.dumps({"format": "tessera-loader-state", "version": 1,
                             "state": {"$": "posix.system", "v": [f"touch {marker}"]}}),
                 payload.decode("latin-1")):
        with pytest.raises(ValueError, match="checkpoint loader state"):
            decode_loader_state(text)
    assert not marker.exists()
    pickle.loads(payload)  # the payload is real: unpickled, it does run
    assert marker.exists()


@pytest.mark.parametrize("doc, problem", [
    ({"format": "other", "version": 1, "state": None}, "not a 'tessera-loader-state' document"),
    ({"format": "tessera-loader-state", "version": 2, "state": None}, "format version 2"),
    ({"format": "tessera-loader-state", "version": 1, "state": {"x": 1}}, "without a type tag"),
    ({"format": "tessera-loader-state", "version": 1, "state": {"$": "SliceState", "v": {"index": 0}}},
     r"SliceState needs exactly the fields \['current', 'index'\]"),
    ({"format": "tessera-loader-state", "version": 1,
      "state": {"$": "ndarray", "dtype": "|O", "shape": [1], "v": ""}}, "unsupported dtype '|O'"),
])
def test_malformed_json_states_are_refused_with_the_fix(doc, problem):
    with pytest.raises(ValueError, match=problem + ".*start the run afresh: trainer.resume=false"):
        decode_loader_state(json.dumps(doc))


def test_an_unknown_state_type_fails_at_save_time():
    class Mystery:
        pass

    with pytest.raises(TypeError, match=r"state\[0\] holds a .*Mystery"):
        encode_loader_state([Mystery()])


def _train(run_dir: str, steps: int):
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    trainer = TrainerConfig(max_steps=steps, run_dir=run_dir, save_every=1, progress=False, tensorboard=False)
    return train(ModelConfig(), DataConfig(seq_length=128, rows_per_microbatch=2, microbatches=1), OptimConfig(),
                 trainer, name="test")


@pytest.mark.multiproc
def test_training_resumes_from_json_and_refuses_a_pickled_loader_state(tmp_path):
    """The loop end to end on one gloo rank: its checkpoint holds JSON; a checkpoint whose loader state was
    swapped for a pickle payload stops the resume with the clear error, unrun."""
    from tessera.hetero.tools.spawn import run_on_ranks

    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    run_on_ranks(1, _train, str(run_dir), 1, timeout=300)
    common_pt = run_dir / "checkpoints" / "step_000001" / "common.pt"
    saved = torch.load(common_pt, weights_only=True)
    assert isinstance(saved["common"]["loader"], str)
    decode_loader_state(saved["common"]["loader"])
    # (resuming through the JSON state: tests/test_train_fault.py's relaunch and test_train_hetero's resume)
    tampered = saved
    tampered["common"]["loader"] = pickle.dumps(_Payload(marker))
    torch.save(tampered, common_pt)
    with pytest.raises(AssertionError, match="loader state is a pickle .*refusing to load it"):  # run_on_ranks
        run_on_ranks(1, _train, str(run_dir), 2, timeout=300)
    assert not marker.exists()
