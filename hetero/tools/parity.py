"""Logit parity of our HybridLM against transformers' NemotronH on a local HF checkpoint.

    python -m tessera.hetero.tools.parity --hf-dir DIR                                        # one process
    torchrun --nproc-per-node 2 -m tessera.hetero.tools.parity --hf-dir DIR --tp 2            # TP=2 (gloo on CPU)
    torchrun --nproc-per-node 2 -m tessera.hetero.tools.parity --hf-dir DIR --cp 2            # CP=2, zigzag
    torchrun --nproc-per-node 4 -m tessera.hetero.tools.parity --hf-dir DIR --tp 2 --cp 2     # (or --tp 2 --pp 2)

Every rank loads its TP/PP shard of DIR into HybridLM and takes its zigzag CP slice of a fixed random
batch; the batch runs through the stages, the last stage gathers the logits over TP (vocab) and CP
(sequence) and compares them with NemotronHForCausalLM (float32, torch path) loaded from the same DIR.
max_rel_err = max|ours - ref| / max|ref| over all logits. Rank 0 prints the verdict last:
    parity: PASS max_rel_err=<float>      (exit 0)      parity: FAIL max_rel_err=<float> > tol (exit 1)

models/hf_reference.py holds the single-device parts (batch, transformers' logits); this module the process
groups, the TP/PP/CP forward of HybridLM and the comparison. `compare(hf_dir, pg_collection)` only uses the
groups it is given, so tests call it from their own gloo worlds.

A released multimodal checkpoint (config.json of transformers' NemotronH_Omni_Reasoning_V3, or of the hub's
NemotronH_Nano_Omni_Reasoning_V3 / NemotronH_Nano_VL_V2 as downloaded, e.g. what scripts/tiny_release.py writes)
is compared in a heterogeneous layout instead (hetero/tools/parity_multimodal.py: image, video, audio and mixed
samples through the trainer's own modules, boundary and step, against transformers' Omni model, or for Nano V2 VL
the oracle models/nano_vl_reference.py assembles from transformers' RadioModel and NemotronHForCausalLM):
    python -m tessera.hetero.tools.parity --hf-dir OMNI_DIR                                   # one rank
    torchrun --nproc-per-node 4 -m tessera.hetero.tools.parity --hf-dir OMNI_DIR \
        --layout "vision=dp2@0-1;audio=dp2@0-1;language=tp2@2-3"
The same verdict line ends it, after a line on how video is compared.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from tessera.hetero.parallel.cp_gather_attention import gather_rows
from tessera.hetero.parallel.vocab_parallel_ce import vocab_parallel_cross_entropy_for
from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout
from tessera.hetero.plan.zigzag import zigzag_shard, zigzag_unshard
from tessera.hetero.runtime.device import current_device
from tessera.hetero.runtime.groups import build_module_groups
from tessera.hetero.runtime.world import process_world
from tessera.hetero.parallel.kernel_choice import select_kernels
from tessera.models.hybrid_llm import HybridLM
from tessera.models.nemotron_h_hf import LazyCheckpoint, hybrid_config_from_hf, load_into
from tessera.models.hf_reference import BATCH, fixed_batch, max_rel_err, reference_logits, seq_length


def _size(group) -> int:
    return group.size() if group is not None else 1


def build_model(hf_dir: str, pg_collection: ProcessGroupCollection, kernels=None) -> HybridLM:
    """This rank's HybridLM with its TP/PP shard of the checkpoint and the kernels chosen for it
    (`kernels`: a hetero.parallel.kernel_choice.Kernels, chosen here when None)."""
    tp, pp, cp = _size(pg_collection.tp), _size(pg_collection.pp), _size(pg_collection.cp)
    config = hybrid_config_from_hf(hf_dir, tp=tp, pp=pp, cp=cp)
    kernels = kernels or select_kernels(pg_collection, dtype=config.params_dtype, config=config)
    model = HybridLM(config, pg_collection, core_attention=kernels.core_attention, mamba_mixer=kernels.mamba_mixer,
                     moe_experts=kernels.moe_experts,
                     cross_entropy=vocab_parallel_cross_entropy_for(pg_collection.tp))
    load_into(model, LazyCheckpoint(hf_dir), pg_collection.tp.rank(), pg_collection.pp.rank(), pg_collection.ep.rank())
    return model.to(current_device())


def gather_sequence(x: torch.Tensor, cp_group) -> torch.Tensor:
    """[b, s_local, ...] zigzag slices of every CP rank -> [b, S, ...] in natural order (differentiable)."""
    if _size(cp_group) == 1:
        return x
    gathered = gather_rows(x.transpose(0, 1).contiguous(), cp_group)
    return zigzag_unshard(gathered, cp_group.size()).transpose(0, 1)


def pipeline_forward(model: HybridLM, input_ids: torch.Tensor, pp_group) -> torch.Tensor | None:
    """Forward of this rank's (CP-local) ids through all stages; full-vocab logits [b, s, vocab] (padding
    stripped) on the last stage."""
    pp_rank, pp_size = pp_group.rank(), pp_group.size()
    shape = (input_ids.shape[1], input_ids.shape[0], model.config.hidden_size)  # [s, b, h]
    ranks = dist.get_process_group_ranks(pp_group)
    device = next(model.parameters()).device
    with torch.no_grad():
        if pp_rank > 0:
            received = torch.empty(shape, dtype=model.config.params_dtype, device=device)
            dist.recv(received, src=ranks[pp_rank - 1], group=pp_group)
            model.set_input_tensor(received)
        out = model(input_ids.to(device) if pp_rank == 0 else None)
        if pp_rank < pp_size - 1:
            dist.send(out.contiguous(), dst=ranks[pp_rank + 1], group=pp_group)
            return None
        return model.full_vocab_logits(out)  # gathered over TP, vocabulary padding stripped


def compare(hf_dir: str, pg_collection: ProcessGroupCollection, kernels=None) -> float:
    """max_rel_err of our logits vs transformers', known on every rank of the world.

    Raises unless the ranks compared exactly one full [batch, seq, vocab] tensor of logits, so 0.0 never
    stands for "nothing compared" (no rank computed logits, or a shape that only broadcasts)."""
    model = build_model(hf_dir, pg_collection, kernels).eval()
    cp_group = pg_collection.cp
    cp = _size(cp_group)
    sp_tp = pg_collection.tp.size() if model.config.sequence_parallel else 1
    input_ids = fixed_batch(model.config.vocab_size, seq_length(cp, sp_tp))
    local_ids = zigzag_shard(input_ids, cp, cp_group.rank(), dim=1) if cp > 1 else input_ids
    logits = pipeline_forward(model, local_ids, pg_collection.pp)
    # [max_rel_err, logits compared]; NCCL reduces device tensors only
    err = torch.zeros(2, dtype=torch.float64, device=current_device())
    if logits is not None:
        with torch.no_grad():
            logits = gather_sequence(logits, cp_group)
        if pg_collection.tp.rank() == 0 and (cp == 1 or cp_group.rank() == 0):
            ref = reference_logits(hf_dir, input_ids)
            if logits.shape == ref.shape:
                err[0] = max_rel_err(logits.cpu(), ref)  # transformers runs on CPU
                err[1] = ref.numel()
            else:
                err[1] = -1.0
    dist.all_reduce(err, op=dist.ReduceOp.SUM)  # only one rank holds non-zero values
    expected = input_ids.numel() * model.config.vocab_size
    if err[1].item() != expected:
        raise RuntimeError(f"parity: {int(err[1].item())} logits compared over all ranks, expected {expected} "
                           f"(-1: our logits' shape differs from transformers')")
    return err[0].item()


def init_groups(tp: int = 1, pp: int = 1, cp: int = 1) -> ProcessGroupCollection:
    """The LLM's groups, built as the trainer builds them (`language=tp..,cp..,pp..` on every rank)."""
    if dist.get_world_size() != tp * pp * cp:
        raise SystemExit(f"world size {dist.get_world_size()} != tp*cp*pp = {tp * cp * pp}: launch that many ranks")
    return build_module_groups(HeteroLayout.parse(f"{LANGUAGE}=tp{tp},cp{cp},pp{pp}@0-{tp * cp * pp - 1}"))[LANGUAGE].pgs


def _is_multimodal(hf_dir: str) -> bool:
    """DIR's config.json is a multimodal release in any layout it comes in (transformers' NemotronH_Omni_Reasoning_V3,
    the hub's Omni or Nano V2 VL: models/released.read_config reads each as the first)."""
    from tessera.models import released

    if not os.path.isfile(os.path.join(os.path.expanduser(hf_dir), "config.json")):
        return False
    return released.read_config(hf_dir).get("model_type") == released.OMNI  # whatever layout the file is in


def run(args) -> int:
    """The command after argument parsing, in the world hetero/runtime/world.process_world joins (torchrun's, or
    one rank for a plain `python -m`)."""
    multimodal = _is_multimodal(args.hf_dir)
    if not multimodal and args.layout is not None:
        raise SystemExit(f"--layout is for multimodal (NemotronH_Omni_Reasoning_V3) checkpoints; {args.hf_dir} holds "
                         f"an LLM alone: use --tp/--pp/--cp")
    if multimodal and (args.tp, args.pp, args.cp) != (1, 1, 1):
        raise SystemExit("a multimodal checkpoint takes --layout (e.g. "
                         "'vision=dp2@0-1;audio=dp2@0-1;language=tp2@2-3'), not --tp/--pp/--cp")
    with process_world():
        return run_multimodal(args) if multimodal else run_llm(args)


def run_llm(args) -> int:
    """An LLM alone (NemotronH) at --tp/--pp/--cp against transformers' NemotronHForCausalLM."""
    pg_collection = init_groups(args.tp, args.pp, args.cp)
    # The fp32 model's kernels; at CP > 1 each layer kind's CP path follows the checkpoint's heads.
    config = hybrid_config_from_hf(args.hf_dir, tp=args.tp, pp=args.pp, cp=args.cp)
    kernels = select_kernels(pg_collection, dtype=torch.float32, config=config)
    err = compare(args.hf_dir, pg_collection, kernels)
    ok = err <= args.tol
    if dist.get_rank() == 0:
        print(kernels.line, flush=True)
        print(f"tp={args.tp} cp={args.cp} pp={args.pp} batch={BATCH}x{seq_length(args.cp)}", flush=True)
        verdict = "PASS" if ok else "FAIL"
        print(f"parity: {verdict} max_rel_err={err:.3e}" + ("" if ok else f" > {args.tol}"), flush=True)
    return 0 if ok else 1


def run_multimodal(args) -> int:
    """A released Omni checkpoint in a heterogeneous layout (hetero/tools/parity_multimodal.py)."""
    from tessera.hetero.tools.parity_multimodal import compare_multimodal

    res = compare_multimodal(args.hf_dir, args.layout or "")
    ok = res["max_rel_err"] <= args.tol  # NaN fails
    if dist.get_rank() == 0:
        print(f"layout {res['layout']} on {dist.get_world_size()} rank(s); samples {', '.join(res['samples'])}; "
              f"{res['compared']} logits compared", flush=True)
        if not res["token_ids_from_config"]:
            print("config.json sets no image/audio token id: the last vocabulary ids stand in, on both sides",
                  flush=True)
        print(res["video_note"], flush=True)
        verdict = "PASS" if ok else "FAIL"
        print(f"parity: {verdict} max_rel_err={res['max_rel_err']:.3e}" + ("" if ok else f" > {args.tol}"), flush=True)
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="local dir with config.json + *.safetensors")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (zigzag)")
    parser.add_argument("--tol", type=float, default=1e-4, help="max relative error allowed (fp32)")
    parser.add_argument("--layout", default=None,
                        help="multimodal checkpoints: the heterogeneous layout, e.g. "
                             "'vision=dp2@0-1;audio=dp2@0-1;language=tp2@2-3' (default: every module on every rank)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
