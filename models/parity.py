"""Logit parity of our HybridLM against transformers' NemotronH on a local HF checkpoint.

    python -m models.parity --hf-dir DIR                                        # one process
    torchrun --nproc-per-node 2 -m models.parity --hf-dir DIR --tp 2            # TP=2 (gloo on CPU)
    torchrun --nproc-per-node 2 -m models.parity --hf-dir DIR --cp 2            # CP=2, zigzag
    torchrun --nproc-per-node 4 -m models.parity --hf-dir DIR --tp 2 --cp 2     # (or --tp 2 --pp 2)

Every rank loads its TP/PP shard of DIR into HybridLM and takes its zigzag CP slice of a fixed random
batch; the batch runs through the stages, the last stage gathers the logits over TP (vocab) and CP
(sequence) and compares them with NemotronHForCausalLM (float32, torch path) loaded from the same DIR.
max_rel_err = max|ours - ref| / max|ref| over all logits. Rank 0 prints the verdict last:
    parity: PASS max_rel_err=<float>      (exit 0)      parity: FAIL max_rel_err=<float> > tol (exit 1)

This module is single-device like the rest of models/: the batch, the reference and the command line.
Process groups, the distributed forward and the kernel choice live in hetero/parity_launch.py, which
main() imports by name only when the command runs, so models/ keeps no import of torch.distributed or
hetero/ (tests/test_models_cp.py checks that for every file in models/).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

BATCH, SEQ, SEED = 2, 37, 1234  # SEQ not a multiple of typical chunk sizes: exercises the padding
LAUNCHER = "hetero.parity_launch"  # the distributed runner behind main()


def seq_length(cp: int = 1) -> int:
    """SEQ, cut to a multiple of 2*cp so the zigzag layout gives every CP rank two equal chunks."""
    return SEQ - SEQ % (2 * cp) if cp > 1 else SEQ


def fixed_batch(vocab_size: int, length: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, length), generator=torch.Generator().manual_seed(SEED))


def reference_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import NemotronHForCausalLM

    ref = NemotronHForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(input_ids).logits.float()


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="local dir with config.json + *.safetensors")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (zigzag)")
    parser.add_argument("--tol", type=float, default=1e-4, help="max relative error allowed (fp32)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return importlib.import_module(LAUNCHER).run(args)


if __name__ == "__main__":
    sys.exit(main())
