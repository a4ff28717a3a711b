"""Logit parity of our HybridLM against transformers' NemotronH on a local HF checkpoint.

    python -m models.parity --hf-dir DIR                                  # one process
    torchrun --nproc-per-node 2 -m models.parity --hf-dir DIR --tp 2      # TP=2 (gloo on CPU)
    torchrun --nproc-per-node 4 -m models.parity --hf-dir DIR --tp 2 --pp 2

Every rank loads its TP/PP shard of DIR into HybridLM; a fixed random batch runs through the stages
(activations sent stage to stage over the pp group), the last stage gathers the vocab-parallel logits
over TP and compares them with NemotronHForCausalLM (float32, torch path) loaded from the same DIR.
max_rel_err = max|ours - ref| / max|ref| over all logits. Rank 0 prints the verdict last:
    parity: PASS max_rel_err=<float>      (exit 0)      parity: FAIL max_rel_err=<float> > tol (exit 1)

This file is the command-line launcher, so unlike the rest of models/ it sets up torch.distributed
itself; `compare()` only uses the groups it is given.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from models.hybrid_llm import HybridLM
from models.nemotron_h_hf import hybrid_config_from_hf, load_hf_state_dict, load_into

BATCH, SEQ, SEED = 2, 37, 1234  # SEQ not a multiple of typical chunk sizes: exercises the padding


def fixed_batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))


def reference_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import NemotronHForCausalLM

    ref = NemotronHForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(input_ids).logits.float()


def pipeline_forward(model: HybridLM, input_ids: torch.Tensor, pp_group) -> torch.Tensor | None:
    """Forward through all stages; returns full-vocab logits on the last stage, None elsewhere."""
    pp_rank, pp_size = pp_group.rank(), pp_group.size()
    shape = (input_ids.shape[1], input_ids.shape[0], model.config.hidden_size)  # [s, b, h]
    ranks = dist.get_process_group_ranks(pp_group)
    with torch.no_grad():
        if pp_rank > 0:
            received = torch.empty(shape, dtype=model.config.params_dtype)
            dist.recv(received, src=ranks[pp_rank - 1], group=pp_group)
            model.set_input_tensor(received)
        out = model(input_ids if pp_rank == 0 else None)
        if pp_rank < pp_size - 1:
            dist.send(out.contiguous(), dst=ranks[pp_rank + 1], group=pp_group)
            return None
        return gather_from_tensor_model_parallel_region(out, group=model.pg_collection.tp)


def compare(hf_dir: str, pg_collection: ProcessGroupCollection) -> float:
    """max_rel_err of our logits vs transformers', known on every rank (sent from the last stage)."""
    tp, pp = pg_collection.tp.size(), pg_collection.pp.size()
    config = hybrid_config_from_hf(hf_dir, tp=tp, pp=pp)
    model = HybridLM(config, pg_collection).eval()
    load_into(model, load_hf_state_dict(hf_dir), pg_collection.tp.rank(), pg_collection.pp.rank())
    input_ids = fixed_batch(config.vocab_size)
    logits = pipeline_forward(model, input_ids, pg_collection.pp)
    err = torch.zeros(1, dtype=torch.float64)
    if logits is not None and pg_collection.tp.rank() == 0:
        ref = reference_logits(hf_dir, input_ids)
        err[0] = ((logits - ref).abs().max() / ref.abs().max()).item()
    dist.all_reduce(err, op=dist.ReduceOp.MAX)  # only one rank holds a non-zero value
    return err.item()


def _init_from_env(tp: int, pp: int) -> ProcessGroupCollection:
    """gloo world from torchrun's environment (or a one-rank world) + megatron's groups."""
    from hetero.cpu_shims import apply_cpu_shims, default_backend  # CLI entry only: the model code itself stays single-device

    apply_cpu_shims()
    if "RANK" in os.environ:
        dist.init_process_group(default_backend())
    else:
        store = tempfile.NamedTemporaryFile(prefix="tessera_parity_", delete=False).name
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if dist.get_world_size() != tp * pp:
        raise SystemExit(f"world size {dist.get_world_size()} != tp*pp = {tp * pp}: launch tp*pp ranks")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return ProcessGroupCollection.use_mpu_process_groups()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="local dir with config.json + *.safetensors")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--tol", type=float, default=1e-4, help="max relative error allowed (fp32)")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    pg_collection = _init_from_env(args.tp, args.pp)
    err = compare(args.hf_dir, pg_collection)
    ok = err <= args.tol
    if dist.get_rank() == 0:
        verdict = f"parity: PASS max_rel_err={err:.3e}" if ok else f"parity: FAIL max_rel_err={err:.3e} > {args.tol}"
        print(f"tp={args.tp} pp={args.pp} batch={BATCH}x{SEQ}", flush=True)
        print(verdict, flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
