"""Check a heterogeneous layout before a big job: hetero-parallel forward/backward == single device.

    torchrun --nproc-per-node 4 -m hetero.verify --layout "vision=dp4@0-3;language=tp2,cp2@0-3"
    torchrun --nproc-per-node 4 -m hetero.verify --layout "vision=tp2@0-1;audio=cp2@2-3;language=tp2,pp2@..."

Builds the small encoders -> projector -> boundary -> LLM chain of hetero.verify_chain in the layout (real
megatron-core TP layers, CP attention, PP stages, one boundary communicator per encoder), runs one
forward and backward, runs the same model in this process on one device with the same weights and batch,
and prints the max relative error of the output, the loss and every parameter gradient, plus the boundary
bytes moved against the minimum. Rank 0's last line is

    verify: PASS max_rel_err=<float> bytes=<int> min_bytes=<int>      (or verify: FAIL ... and exit 1)

FAIL when any error exceeds 1e-5 (fp32) or the boundary moved more bytes than the minimum.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from hetero.boundary import BoundaryCommunicator
from hetero.boundary_plan import BoundaryBatch, source_shard
from hetero.cp_attention import zigzag_positions
from hetero.cpu_shims import apply_cpu_shims, default_backend
from hetero.groups import build_module_groups, destroy_module_groups
from hetero.layout import LANGUAGE, HeteroLayout, LayoutError, ModelShapes
from hetero.verify_chain import (ChainDims, ParallelEncoder, ParallelLanguage, encoder_token_meta, make_weights,
                                 reference_forward, sharded_reference_grad)

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


def batch_shape(layout: HeteroLayout) -> tuple[int, int]:
    """(samples per microbatch, sequence length) that exercise every module's DP and the LLM's CP."""
    return 2 * math.lcm(*(m.dp_size for m in layout.modules.values())), 8 * 2 * layout[LANGUAGE].cp


def validated_layout(spec: str, dims: ChainDims, world_size: int) -> HeteroLayout:
    """Parse and validate against the chain's shapes; raises LayoutError before any work."""
    layout = HeteroLayout.parse(spec)
    layout.validate(world_size=world_size)
    n, seq = batch_shape(layout)
    heads = {k: dims.enc_heads for k in layout.encoders} | {LANGUAGE: dims.llm_heads}
    return layout.validate(ModelShapes(heads=heads, kv_heads={LANGUAGE: dims.llm_kv_heads}, seq_length=seq,
                                       samples_per_microbatch=n), world_size=world_size)


def make_batch(layout: HeteroLayout, dims: ChainDims, seed: int, dtype):
    """A deterministic microbatch: variable media tokens per sample and encoder, disjoint positions."""
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
    batches = {k: BoundaryBatch.from_lists(seq, positions[k]) for k in encoders}
    g = torch.Generator().manual_seed(seed + 1)
    inputs = {k: torch.randn(int(batches[k].tokens_per_sample.sum()), dims.d_in, generator=g).to(dtype)
              for k in encoders}
    text = torch.randn(n, seq, dims.llm_hidden, generator=g).to(dtype)
    target = torch.randn(n, seq, dims.llm_hidden, generator=g).to(dtype)
    return batches, inputs, text, target


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _send(t, peer):
    dist.send(t.contiguous(), peer)


def _recv(shape, peer, dtype, device):
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, peer)
    return buf.requires_grad_()


def run_verify(spec: str, seed: int = 1234, dtype=torch.float32, dims: ChainDims = ChainDims()) -> dict:
    """Run the check on every rank of an initialised world; returns rank-local results (global on rank 0)."""
    layout = validated_layout(spec, dims, dist.get_world_size())
    lang = layout[LANGUAGE]
    batches, inputs, text, target = make_batch(layout, dims, seed, dtype)
    n, seq = text.shape[:2]
    rank = dist.get_rank()
    # the run's device: the local GPU with NCCL, the CPU with gloo (the reference always runs on the CPU)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    groups = build_module_groups(layout)
    w = make_weights(layout, dims, seed, dtype)

    # ---- single device reference (this process, full model) ----
    # in float64: the reference's own rounding then does not count against the layout under test
    ref_w = {k: v.double().requires_grad_() for k, v in w.items()}
    ref_y, ref_loss = reference_forward(ref_w, layout, dims, {k: v.double() for k, v in inputs.items()}, batches,
                                        text.double(), target.double())
    ref_loss.backward()
    ref_grads = {k: v.grad for k, v in ref_w.items()}

    # ---- heterogeneous run ----
    modules, comms, outs, errors, stage_io = {}, {}, {}, {}, {}
    for key in sorted(layout.encoders):  # encoder pipelines, then their boundary
        g, m = groups[key], layout[key]
        if g.is_member:
            c = g.coord
            enc = modules[key] = ParallelEncoder(w, key, layout, dims, g.pgs, c.pp, dtype).to(dev)
            rows = source_shard(m, batches[key], c.dp, c.cp)
            counts = [len(source_shard(m, batches[key], c.dp, r)) for r in range(m.cp)]
            pos, seg = (t[torch.as_tensor(rows)].to(dev) for t in encoder_token_meta(batches[key]))
            x = inputs[key][torch.as_tensor(rows)].to(dev) if c.pp == 0 else _recv(
                (len(rows), dims.enc_hidden), m.rank_of(c.tp, c.cp, c.dp, c.pp - 1), dtype, dev)
            h = enc(x, pos, seg, counts)
            stage_io[key] = (x, h)
            if c.pp < m.pp - 1:
                _send(h, m.rank_of(c.tp, c.cp, c.dp, c.pp + 1))
        comms[key] = BoundaryCommunicator(m, lang, dims.llm_hidden, dtype, dev, dst_format="dense")
        if rank in m.ranks or rank in lang.ranks:
            src_out = stage_io[key][1] if g.is_member and g.last_stage else None
            outs[key] = comms[key](src_out, batches[key])

    lg = groups[LANGUAGE]
    loss_local = torch.zeros((), dtype=torch.float64, device=dev)
    if lg.is_member:
        c = lg.coord
        local_pos = zigzag_positions(seq, lang.cp, c.cp)
        samples = np.arange(c.dp * n // lang.dp_size, (c.dp + 1) * n // lang.dp_size)
        pos = torch.as_tensor(np.tile(local_pos, len(samples)), device=dev)
        seg = torch.as_tensor(np.repeat(samples, len(local_pos)), device=dev)
        sl = (torch.as_tensor(samples)[:, None], torch.as_tensor(local_pos)[None, :])
        lm = modules[LANGUAGE] = ParallelLanguage(w, layout, dims, lg.pgs, c.pp, dtype).to(dev)
        target_local = target[sl].to(dev)
        detached = {}
        if c.pp == 0:
            # LLM runs on detached boundary outputs; their grads go back through the boundaries afterwards
            x = text[sl].to(dev)
            for key in sorted(layout.encoders):
                detached[key] = outs[key].detach().requires_grad_()
                mask = torch.zeros(n, seq, dtype=torch.bool)
                for i, p in enumerate(batches[key].positions):
                    mask[i, torch.as_tensor(p)] = True
                x = torch.where(mask[sl][..., None].to(dev), detached[key], x)
            x = x.reshape(-1, dims.llm_hidden)
        else:
            x = _recv((len(samples) * len(local_pos), dims.llm_hidden), lang.rank_of(c.tp, c.cp, c.dp, c.pp - 1),
                      dtype, dev)
        y = lm(x, pos, seg)
        if c.pp < lang.pp - 1:
            _send(y, lang.rank_of(c.tp, c.cp, c.dp, c.pp + 1))
            dist.recv(grad := torch.empty_like(y), lang.rank_of(c.tp, c.cp, c.dp, c.pp + 1))
            torch.autograd.backward(y, grad)
        else:
            loss = ((y.view(len(samples), -1, dims.llm_hidden) - target_local) ** 2).sum() / target.numel()
            loss.backward()
            if c.tp == 0:
                loss_local = loss.detach().double()
            errors["output"] = _rel_err(y.view(len(samples), -1, dims.llm_hidden), ref_y[sl])
        if c.pp > 0:
            _send(x.grad, lang.rank_of(c.tp, c.cp, c.dp, c.pp - 1))

    for key in sorted(layout.encoders):  # boundary backward, then the encoder pipeline backward
        g, m = groups[key], layout[key]
        if key in outs:
            if lg.is_member and lg.coord.pp == 0:
                torch.autograd.backward(outs[key], detached[key].grad)
            else:
                BoundaryCommunicator.backward_from(outs[key])
        if g.is_member:
            c = g.coord
            if c.pp < m.pp - 1:
                h = stage_io[key][1]
                grad = torch.empty_like(h)
                dist.recv(grad, m.rank_of(c.tp, c.cp, c.dp, c.pp + 1))
                torch.autograd.backward(h, grad)
            if c.pp > 0:
                _send(stage_io[key][0].grad, m.rank_of(c.tp, c.cp, c.dp, c.pp - 1))

    # ---- gradient sync over each module's dp x cp, then compare with the reference ----
    for key, mod in modules.items():
        for p in mod.parameters():
            dist.all_reduce(p.grad, group=groups[key].pgs.dp_cp)
        for sub in mod.modules():
            if hasattr(sub, "full_names"):
                for pname in ("weight", "bias"):
                    if getattr(sub, pname, None) is None:
                        continue
                    ref = sharded_reference_grad(sub, pname, ref_grads)
                    errors[f"grad {sub.full_names[0][:-7]}.{pname}"] = _rel_err(getattr(sub, pname).grad, ref)
    dist.all_reduce(loss_local)
    errors["loss"] = _rel_err(loss_local, ref_loss.detach())

    worst_name = max(errors, key=errors.get, default="")
    worst = torch.tensor([errors.get(worst_name, 0.0)], dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if errors.get(worst_name, 0.0) == worst.item() and worst.item() > TOLERANCE[dtype]:
        print(f"  rank{rank} worst: {worst_name} rel_err={worst.item():.3e}", flush=True)
    moved = torch.tensor([sum(c.bytes_sent for c in comms.values())], dtype=torch.int64, device=dev)
    dist.all_reduce(moved)
    min_bytes = sum(comms[k].minimum_bytes(batches[k]) for k in comms)
    destroy_module_groups(groups)
    ok = worst.item() <= TOLERANCE[dtype] and int(moved.item()) <= min_bytes
    return {"ok": ok, "max_rel_err": worst.item(), "bytes": int(moved.item()), "min_bytes": min_bytes,
            "errors": errors, "loss": float(ref_loss), "placement": layout.placement}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", required=True, help='e.g. "vision=dp4@0-3;language=tp2,cp2@0-3"')
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    try:  # before any process group exists: a bad layout costs nothing
        validated_layout(args.layout, ChainDims(), int(os.environ.get("WORLD_SIZE", "1")))
    except LayoutError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"verify: FAIL invalid layout: {e}", file=sys.stderr)
        return 2
    apply_cpu_shims()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(default_backend())
    rank = dist.get_rank()
    torch.set_num_threads(1)
    res = run_verify(args.layout, args.seed)
    if rank == 0:
        print(f"layout: {args.layout} ({res['placement']}, world {dist.get_world_size()}, fp32)")
        for name, err in sorted(res["errors"].items()):
            print(f"  rank0 {name:32s} rel_err={err:.3e}")
        verdict = "PASS" if res["ok"] else "FAIL"
        print(f"verify: {verdict} max_rel_err={res['max_rel_err']:.3e} bytes={res['bytes']} "
              f"min_bytes={res['min_bytes']}", flush=True)
    dist.destroy_process_group()
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
