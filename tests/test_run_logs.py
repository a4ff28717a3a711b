"""What a run prints (issue 33, item 4 and part of 2): a few examples per skip reason, logged on one rank, the rest
counted; one summary line every trainer.log_every steps; real (non-padding) tokens and peak memory per step.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_run_logs.py -q
"""

from __future__ import annotations

import logging

import pytest
import torch

from tessera.data.loader import SKIP_EXAMPLES, ChatTaskEncoder, build_loader
from tessera.data.prepare import make_synthetic
from tessera.data.tokens import EncoderTokens, Tokenizer
from tessera.hetero.training.metrics import RunMetrics, peak_memory_gib, read_metrics

ENC = EncoderTokens(patch=64)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("logs")
    make_synthetic(root, samples=32, seed=5)
    return root


class _Lines(logging.Handler):
    """The loader's log lines, taken from its own logger object (not via the root logger, which a library
    imported earlier in the same process may have replaced)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _batches(root, **kw) -> tuple[list, list[str]]:
    from tessera.data import loader

    te = ChatTaskEncoder(Tokenizer(root / "tokenizer.model"), 512, ENC, modules={"vision"}, **kw)
    handler, level = _Lines(), loader.log.level
    loader.log.addHandler(handler)
    loader.log.setLevel(logging.WARNING)
    try:
        return list(build_loader(root, te, 2, repeat=False)), handler.lines
    finally:
        loader.log.removeHandler(handler)
        loader.log.setLevel(level)


def test_skips_are_counted_and_only_a_few_examples_logged_on_the_rank_that_logs(data):
    batches, lines = _batches(data)  # no audio encoder: every sample with audio is skipped as no_encoder
    skipped = sum(b.skipped.get("no_encoder", 0) for b in batches)
    assert skipped > SKIP_EXAMPLES + 2, skipped
    assert sum("reason=no_encoder" in m for m in lines) == SKIP_EXAMPLES
    assert sum("further 'no_encoder' skips are counted" in m for m in lines) == 1
    quiet, lines = _batches(data, log_skips=False)  # every other rank: the same skips, counted, not logged
    assert sum(b.skipped.get("no_encoder", 0) for b in quiet) == skipped
    assert not lines


def test_real_tokens_leave_the_row_padding_out(data):
    tok = Tokenizer(data / "tokenizer.model")
    for b in _batches(data)[0]:
        assert b.real_tokens() == int((b.tokens != tok.pad_id).sum()) < b.tokens.numel()


def test_one_summary_line_every_log_every_steps_and_at_the_end(tmp_path, capsys):
    m = RunMetrics(tmp_path, 5, progress=False, tensorboard=False, log_every=2)
    for step in range(1, 6):
        m.log({"step": step, "loss": 1.0 / step, "lr": {"language": 1e-3, "vision": 2e-4}, "grad_norm": 0.5,
               "tokens_per_s": 100.0, "real_tokens_per_s": 60.0, "step_time_s": 0.1, "peak_memory_gib": 1.5,
               "model_tflops_per_gpu": 400.0, "mfu": 0.4044, "skipped_by_reason": {"no_encoder": step},
               "max_over_ranks": {"peak_memory_gib": 2.0, "data_wait_s": 0.02, "boundary_s": 0.03}})
    m.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
    # the fullest / slowest rank's memory, data wait and boundary time: the ones that set the pace
    assert lines[0] == ("step 2/5 loss 0.5000 lr 1.00e-03 grad_norm 0.500 tokens/s 100 (real 60) 400.0 TFLOPS/GPU "
                        "MFU 40.4% step 0.10s (data wait 0.02s, boundary 0.03s) memory 2.00 GiB skipped no_encoder=2")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert 0 < peak_memory_gib(torch.device("cpu")) < 64
