"""Check a heterogeneous layout before a big job: hetero-parallel forward/backward == single device.

    torchrun --nproc-per-node 4 -m tessera.hetero.tools.verify --layout "vision=dp4@0-3;language=tp2,cp2@0-3"
    torchrun --nproc-per-node 4 -m tessera.hetero.tools.verify --layout "vision=tp2@0-1;audio=cp2@2-3;language=tp2,pp2@..."

Builds the small encoders -> projector -> boundary -> LLM chain of hetero.tools.verify_chain_model in the layout (real
megatron-core TP layers, CP attention, PP stages, one boundary communicator per encoder), runs one
forward and backward, runs the same model in this process on one device with the same weights and batch,
and prints the max relative error of the output, the loss and every parameter gradient, plus the boundary
bytes moved against the minimum. Rank 0's last line is

    verify: PASS max_rel_err=<float> bytes=<int> min_bytes=<int>      (or verify: FAIL ... and exit 1)

FAIL when any error exceeds 1e-5 (fp32) or the boundary moved more bytes than the minimum.

    --llm moe       every LLM layer's MLP becomes a mixture of experts (hetero.tools.verify_chain_moe): megatron's
                    MoELayer (sigmoid top-2 router over 4 experts with a fixed expert bias, allgather dispatcher,
                    one shared expert) with the layout's expert parallelism (language=...,epN: N must divide the
                    4 experts and the LLM's cp*dp); with tp > 1 the LLM runs sequence parallel. Every routed
                    expert's gradient is compared on the EP ranks that own it; expert gradients are summed over
                    the expert-DP group, the router's (and other sequence-parallel weights') over TP first. E.g.

        torchrun --nproc-per-node 4 -m tessera.hetero.tools.verify --llm moe --layout "vision=tp2,dp2@0-3;language=tp2,dp2,ep2@0-3"

    --documents K   packs K documents of random lengths into every LLM row: LLM attention stays inside a
                    document (the zigzag CP attention gets real document ids), and besides the one-device
                    comparison every document's outputs and per-token losses must equal the one-device LLM
                    run on that document alone ("doc-alone" errors).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from tessera.hetero.runtime.boundary import BoundaryCommunicator
from tessera.hetero.plan.boundary_plan import BoundaryBatch, source_shard
from tessera.hetero.plan.encoder_balance import balanced_assignment
from tessera.hetero.plan.zigzag import zigzag_multiple, zigzag_positions
from tessera.hetero.runtime.world import process_world
from tessera.hetero.runtime.groups import build_module_groups, destroy_module_groups
from tessera.hetero.runtime.step_executor import hetero_step
from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout, LayoutError, ModelShapes, rows_multiple
from tessera.hetero.plan.resolved_run import dp_rows
from tessera.hetero.tools.verify_chain_model import (ChainDims, ParallelEncoder, ParallelLanguage, encoder_token_meta, make_weights,
                                 reference_documents_alone, reference_forward, sharded_reference_grad,
                                 token_segments)
from tessera.hetero.tools.verify_chain_moe import LLMS
from tessera.hetero.optim.optimizers import reduce_gradients

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


def batch_shape(layout: HeteroLayout) -> tuple[int, int]:
    """(samples per microbatch, sequence length) that exercise every module's DP and the LLM's CP."""
    return 2 * rows_multiple(layout), 8 * zigzag_multiple(layout[LANGUAGE].cp)


def validated_layout(spec: str, dims: ChainDims, world_size: int, llm: str = "dense") -> HeteroLayout:
    """Parse and validate against the chain's shapes; raises LayoutError before any work."""
    if llm not in LLMS:
        raise ValueError(f"llm={llm!r}: use one of {LLMS}")
    layout = HeteroLayout.parse(spec)
    layout.validate(world_size=world_size)
    ep = layout[LANGUAGE].ep
    if llm == "dense" and ep > 1:
        raise LayoutError(f"module '{LANGUAGE}': ep={ep} but the dense chain has no experts to spread; run with "
                          f"--llm moe (llm=\"moe\") or drop ep{ep}")
    if llm == "moe" and dims.moe_experts % ep:
        fits = [d for d in range(1, dims.moe_experts + 1) if dims.moe_experts % d == 0]
        raise LayoutError(f"module '{LANGUAGE}': ep={ep} does not divide the MoE chain's {dims.moe_experts} "
                          f"experts (each EP rank holds an equal share); use ep in {fits}")
    n, seq = batch_shape(layout)
    heads = {k: dims.enc_heads for k in layout.encoders} | {LANGUAGE: dims.llm_heads}
    return layout.validate(ModelShapes(heads=heads, kv_heads={LANGUAGE: dims.llm_kv_heads}, seq_length=seq,
                                       samples_per_microbatch=n, moe=llm == "moe"), world_size=world_size)


def _items(counts: list[int], dp: int, rng, balance: bool) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """With `balance`, each sample's media tokens cut into 1-3 items (sizes, in token order) and every token's
    encoding DP rank: the items dealt largest first by their cost (attention: size squared), as the trainer's
    loader deals media items (hetero/plan/encoder_balance.py). Without, one item per sample, encoded by the
    sample's DP rank (sources None)."""
    if not balance:
        return np.asarray(counts, dtype=np.int64), None
    sizes, per_sample = [], []
    for c in counts:
        cuts = sorted(rng.choice(np.arange(1, c), min(c - 1, int(rng.integers(0, 3))), replace=False)) if c > 1 else []
        bounds = np.asarray([0, *cuts, c], dtype=np.int64)
        per_sample.append(np.diff(bounds))
        sizes += per_sample[-1].tolist()
    owner = balanced_assignment([float(z) ** 2 + z for z in sizes], dp)
    at, sources = 0, []
    for part in per_sample:
        sources.append(np.repeat(np.asarray(owner[at:at + len(part)], dtype=np.int64), part))
        at += len(part)
    return np.asarray(sizes, dtype=np.int64), sources


def make_batch(layout: HeteroLayout, dims: ChainDims, seed: int, dtype, documents: int = 0, balance: bool = False):
    """A deterministic microbatch: variable media tokens per sample and encoder, disjoint positions (with
    `balance`, each sample's tokens of an encoder in 1-3 items encoded where the assignment by cost puts them);
    with `documents` K > 0 also docs [N, S]: each row cut at K-1 random points into K documents (else None).
    Returns (boundary batches, inputs, text, target, docs, item sizes per encoder)."""
    n, seq = batch_shape(layout)
    rng = np.random.default_rng(seed)
    encoders = sorted(layout.encoders)
    per_encoder = seq // (len(encoders) + 1)
    positions = {k: [] for k in encoders}
    for _ in range(n):
        free = rng.permutation(seq)
        for k in encoders:
            count = int(rng.integers(1, per_encoder + 1))
            positions[k].append(np.sort(free[:count]))
            free = free[count:]
    item_rng, batches, items = np.random.default_rng(seed + 3), {}, {}
    for k in encoders:
        items[k], sources = _items([len(p) for p in positions[k]], layout[k].dp_size, item_rng, balance)
        batches[k] = BoundaryBatch.from_lists(seq, positions[k], sources)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = {k: torch.randn(int(batches[k].tokens_per_sample.sum()), dims.d_in, generator=g).to(dtype)
              for k in encoders}
    text = torch.randn(n, seq, dims.llm_hidden, generator=g).to(dtype)
    target = torch.randn(n, seq, dims.llm_hidden, generator=g).to(dtype)
    docs = None
    if documents > 0:
        if documents > seq:
            raise ValueError(f"--documents {documents} > sequence length {seq}")
        starts = np.zeros((n, seq), dtype=np.int64)
        for r in range(n):
            starts[r, rng.choice(np.arange(1, seq), documents - 1, replace=False)] = 1
        docs = torch.as_tensor(starts.cumsum(1))
    return batches, inputs, text, target, docs, items


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


class _EncoderStage:
    """Glue: one rank's encoder stage reading its own rows of each microbatch (hetero.runtime.step_executor)."""

    def __init__(self, module, layout_m, coord, micro, key, dims, dev):
        self.module, self.m, self.c, self.micro, self.key, self.dims, self.dev = \
            module, layout_m, coord, micro, key, dims, dev

    def _rows(self, mb, cp=None):
        return source_shard(self.m, self.micro[mb][0][self.key], self.c.dp, self.c.cp if cp is None else cp)

    def input_shape(self, mb):
        return (len(self._rows(mb)), self.dims.enc_hidden)

    def forward(self, x, mb):
        batches, inputs = self.micro[mb][0], self.micro[mb][1]
        rows = torch.as_tensor(self._rows(mb))
        counts = [len(self._rows(mb, r)) for r in range(self.m.cp)]
        pos, seg = (t[rows].to(self.dev) for t in encoder_token_meta(batches[self.key], self.micro[mb][5][self.key]))
        if x is None:
            x = inputs[self.key][rows].to(self.dev)
        return self.module(x, pos, seg, counts)


class _LanguageStage:
    """Glue: one rank's LLM stage; the first stage fuses text with every encoder's boundary output."""

    def __init__(self, module, layout, coord, micro, dims, dev, total_elems):
        self.module, self.c, self.micro, self.dims, self.dev = module, coord, micro, dims, dev
        lang = layout[LANGUAGE]
        n, seq = micro[0][2].shape[:2]
        self.local_pos = zigzag_positions(seq, lang.cp, coord.cp)
        self.samples = np.asarray(dp_rows(n, lang.dp_size, coord.dp))
        self.sl = (torch.as_tensor(self.samples)[:, None], torch.as_tensor(self.local_pos)[None, :])
        self.pos = torch.as_tensor(np.tile(self.local_pos, len(self.samples)), device=dev)
        self.seg = torch.as_tensor(np.repeat(self.samples, len(self.local_pos)), device=dev)
        self.total = total_elems

    def input_shape(self, mb):
        return (len(self.samples) * len(self.local_pos), self.dims.llm_hidden)

    def forward(self, x, media, mb):
        batches, _, text, _, docs, _ = self.micro[mb]
        if x is None:
            x = text[self.sl].to(self.dev)
            for key in sorted(media):
                mask = torch.zeros(text.shape[:2], dtype=torch.bool)
                for i, p in enumerate(batches[key].positions):
                    mask[i, torch.as_tensor(p)] = True
                mask = mask[self.sl].to(self.dev)
                if not torch.equal(mask, media[key].mask):  # the plan's placement, checked against the positions
                    raise AssertionError(f"{key}: the boundary wrote other rows than the batch's media positions")
                x = torch.where(mask[..., None], media[key].values, x)
            x = x.reshape(-1, self.dims.llm_hidden)
        seg = self.seg if docs is None else token_segments(*text.shape[:2], docs)[self.sl].reshape(-1).to(self.dev)
        return self.module(x, self.pos, seg)

    def loss(self, y, mb):
        target = self.micro[mb][3][self.sl].to(self.dev)
        return ((y.view(len(self.samples), -1, self.dims.llm_hidden) - target) ** 2).sum() / self.total


def run_verify(spec: str, seed: int = 1234, dtype=torch.float32, dims: ChainDims = ChainDims(),
               microbatches: int = 1, documents: int = 0, llm: str = "dense", balance: bool = False) -> dict:
    """Run the check on every rank of an initialised world; results are global (identical on all ranks).

    With several microbatches the step accumulates gradients over them through hetero.runtime.step_executor, and the
    reference is the single-device model over the same microbatches. llm="moe": the LLM's MLPs are mixtures of
    experts (hetero.tools.verify_chain_moe) spread over the layout's EP. balance: every encoder's items encoded
    where the assignment by cost puts them, not with their samples (issue 35)."""
    layout = validated_layout(spec, dims, dist.get_world_size(), llm)
    if llm == "moe" and dtype != torch.float32:  # hetero.tools.verify_chain_moe: megatron's router sigmoid is fp32
        raise ValueError(f"llm='moe' checks float32 only (megatron's MoE router rounds its scores to fp32), not {dtype}")
    lang, rank = layout[LANGUAGE], dist.get_rank()
    micro = [make_batch(layout, dims, seed + 7 * mb, dtype, documents, balance) for mb in range(microbatches)]
    total = microbatches * micro[0][2].numel()  # the loss is normalised by the step's global element count
    # the run's device: the local GPU with NCCL, the CPU with gloo (the reference always runs on the CPU)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    groups = build_module_groups(layout)
    w = make_weights(layout, dims, seed, dtype, llm)

    # ---- single-device reference, in float64 so its own rounding does not count against the layout ----
    ref_w = {k: v.double().requires_grad_(not k.endswith("expert_bias")) for k, v in w.items()}
    ref_loss, ref_ys = torch.zeros((), dtype=torch.float64), []
    alone_ys = []
    for batches, inputs, text, target, docs, items in micro:
        y, loss = reference_forward(ref_w, layout, dims, {k: v.double() for k, v in inputs.items()}, batches,
                                    text.double(), target.double(), docs, items)
        ref_loss, ref_ys = ref_loss + loss * text.numel() / total, ref_ys + [y.detach()]
        if docs is not None:  # every document through the LLM alone: what the packed row must reproduce
            with torch.no_grad():
                alone_ys.append(reference_documents_alone(ref_w, layout, dims,
                                                          {k: v.double() for k, v in inputs.items()}, batches,
                                                          text.double(), docs, items))
    ref_loss.backward()
    ref_grads = {k: v.grad for k, v in ref_w.items()}

    # ---- heterogeneous run ----
    modules, encoders, language = {}, {}, None
    for key in sorted(layout.encoders):
        g = groups[key]
        if g.is_member:
            modules[key] = ParallelEncoder(w, key, layout, dims, g.pgs, g.coord.pp, dtype).to(dev)
            encoders[key] = _EncoderStage(modules[key], layout[key], g.coord, micro, key, dims, dev)
    lg = groups[LANGUAGE]
    if lg.is_member:
        modules[LANGUAGE] = ParallelLanguage(w, layout, dims, lg.pgs, lg.coord.pp, dtype, llm).to(dev)
        language = _LanguageStage(modules[LANGUAGE], layout, lg.coord, micro, dims, dev, total)
    comms = {k: BoundaryCommunicator(layout[k], lang, dims.llm_hidden, dtype, dev, dst_format="dense")
             for k in sorted(layout.encoders)}
    like = torch.empty(0, dtype=dtype, device=dev)
    result = hetero_step(layout, groups, encoders, language, comms, [m[0] for m in micro], like)
    # the trainer's rule (hetero/optim/optimizers.py): experts over expert-DP, sequence-parallel weights over TP first,
    # everything else over DP x CP
    reduce_gradients(modules, groups)

    # ---- compare ----
    errors = {}
    if lg.is_member and lg.last_stage:
        for mb, y in enumerate(result.outputs):
            y = y.view(len(language.samples), -1, dims.llm_hidden)
            errors[f"output mb{mb}"] = _rel_err(y, ref_ys[mb][language.sl])
            if alone_ys:
                target = micro[mb][3][language.sl].double()
                alone = alone_ys[mb][language.sl]
                errors[f"doc-alone output mb{mb}"] = _rel_err(y, alone)
                errors[f"doc-alone token loss mb{mb}"] = _rel_err(((y.double().cpu() - target) ** 2).sum(-1),
                                                                  ((alone - target) ** 2).sum(-1))
    for key, mod in modules.items():
        for sub in mod.modules():
            if hasattr(sub, "full_names"):
                for pname in ("weight", "bias"):
                    if getattr(sub, pname, None) is None:
                        continue
                    ref = sharded_reference_grad(sub, pname, ref_grads)
                    errors[f"grad {sub.full_names[0][:-7]}.{pname}"] = _rel_err(getattr(sub, pname).grad, ref)
    loss = result.loss if (lg.is_member and lg.coord.tp == 0) else torch.zeros_like(result.loss)
    dist.all_reduce(loss)
    errors["loss"] = _rel_err(loss, ref_loss.detach())

    worst_name = max(errors, key=errors.get, default="")
    worst = torch.tensor([errors.get(worst_name, 0.0)], dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if errors.get(worst_name, 0.0) == worst.item() and worst.item() > TOLERANCE[dtype]:
        print(f"  rank{rank} worst: {worst_name} rel_err={worst.item():.3e}", flush=True)
    moved = torch.tensor([sum(c.bytes_sent for c in comms.values())], dtype=torch.int64, device=dev)
    dist.all_reduce(moved)
    min_bytes = sum(comms[k].minimum_bytes(m[0][k]) for k in comms for m in micro)
    destroy_module_groups(groups)
    ok = worst.item() <= TOLERANCE[dtype] and int(moved.item()) <= min_bytes
    return {"ok": ok, "max_rel_err": worst.item(), "bytes": int(moved.item()), "min_bytes": min_bytes,
            "errors": errors, "loss": float(ref_loss), "placement": layout.placement, "llm": llm}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", required=True, help='e.g. "vision=dp4@0-3;language=tp2,cp2@0-3"')
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--microbatches", type=int, default=1, help="microbatches per step (gradient accumulation)")
    ap.add_argument("--llm", choices=LLMS, default="dense",
                    help="the LLM's MLPs: dense, or moe (mixture of experts over the layout's EP; TP runs SP)")
    ap.add_argument("--documents", type=int, default=0,
                    help="pack K documents of random lengths into every LLM row (0: one sequence per row)")
    ap.add_argument("--balance", action="store_true",
                    help="encode each media item on the encoder DP rank the assignment by cost picks (issue 35)")
    args = ap.parse_args(argv)
    try:  # before any process group exists: a bad layout costs nothing
        validated_layout(args.layout, ChainDims(), int(os.environ.get("WORLD_SIZE", "1")), args.llm)
    except LayoutError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"verify: FAIL invalid layout: {e}", file=sys.stderr)
        return 2
    with process_world():
        res = run_verify(args.layout, args.seed, microbatches=args.microbatches, documents=args.documents,
                         llm=args.llm, balance=args.balance)
        if dist.get_rank() == 0:
            print(f"layout: {args.layout} ({res['placement']}, world {dist.get_world_size()}, fp32, llm {args.llm})")
            for name, err in sorted(res["errors"].items()):
                print(f"  rank0 {name:32s} rel_err={err:.3e}")
            verdict = "PASS" if res["ok"] else "FAIL"
            print(f"verify: {verdict} max_rel_err={res['max_rel_err']:.3e} bytes={res['bytes']} "
                  f"min_bytes={res['min_bytes']}", flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
