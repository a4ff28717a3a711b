"""GPU check: the CUDA kernels against the CPU path, a bf16 training step, per-layer TFLOPS. One GPU, one command:

    pip install -e '.[gpu]'   # once: Transformer Engine, mamba-ssm, causal-conv1d in megatron-core 0.16.1's ranges
    python -m tessera.scripts.gpu_check                # exit 0 when every check passes, 1 on a failed one
    python -m tessera.scripts.gpu_check --dry          # the plan and the table's rows, no GPU needed

Checks, each printed as one row of a table (name, result, error or time, verdict):
  te_attention       megatron's TEDotProductAttention (bf16, causal, GQA, [s, b, h, d]) vs SDPACoreAttention
                     (the CPU path) in fp32 on the CPU, same q/k/v
  te_attention_thd   the same with packed documents: TE in THD format (cu_seqlens, padding_causal) vs a
                     block-diagonal causal fp32 reference on the CPU
  causal_conv1d      MambaSSMMixer.conv (causal_conv1d_fn) vs Mamba2Mixer.conv on the CPU, same weights (fp32)
  mamba_ssm_scan     MambaSSMMixer.scan (mamba_chunk_scan_combined) vs the torch SSD scan on the CPU (fp32)
  mamba_ssm_scan_docs  the same with packed documents (doc ids as seq_idx): what each head-parallel CP rank runs
                     on the whole rows of its heads (hetero/parallel/cp_heads.py; the CP all-to-alls themselves
                     need 2+ GPUs and are checked exactly on CPU ranks by tests/test_models_cp.py)
  mamba_mixer        a whole Mamba-2 mixer forward: GPU kernels vs the CPU mixer, same weights (fp32)
  kernel_choice      select_kernels on this machine in bf16 picks transformer_engine and mamba_ssm
  train_step_bf16    `python -m tessera.recipes.train --recipe nemotron_vl_tiny model.dtype=bfloat16` on one rank,
                     1 step: exits 0 with a finite loss (the real entry point: device binding, NCCL, moves)
Then forward+backward TFLOPS of one layer of each kind (M Mamba-2, * attention, - MLP, E MoE) at the real
nemotron_nano_12b_v2 and nemotron_3_nano_30b_a3b shapes (bf16, --seq tokens x --batch rows, the kernels
select_kernels picks), model FLOPs counted as in `layer_flops` below.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

CHECKS = ["te_attention", "te_attention_thd", "causal_conv1d", "mamba_ssm_scan", "mamba_ssm_scan_docs", "mamba_mixer",
          "kernel_choice", "train_step_bf16"]
MODELS = ["nemotron_nano_12b_v2", "nemotron_3_nano_30b_a3b"]
TOL = {"bf16": 2e-2, "fp32": 1e-3}  # max |gpu - cpu| / max |cpu|


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def llm_config(name: str, pattern: str, dtype=torch.bfloat16):
    """The registered LLM's HybridConfig with a different layer pattern (and a small vocabulary)."""
    from tessera.models.configs import hf_fields
    from tessera.models.nemotron_h_hf import hybrid_config_from_hf

    fields = dict(hf_fields(name), hybrid_override_pattern=pattern, vocab_size=1024)
    return hybrid_config_from_hf(fields, dtype=dtype)


def layer_flops(name: str, symbol: str, seq: int, batch: int) -> float:
    """Forward model FLOPs of one `symbol` layer of model `name` over batch rows of seq tokens: the planner's
    count (hetero/planner/model.llm_blocks per token, causal attention at half the square; what the trainer
    logs as TFLOPS/GPU and MFU, checked against FlopCounterMode by tests/test_flops.py)."""
    from tessera.hetero.planner.model import llm_blocks
    from tessera.models.configs import hf_fields

    block = llm_blocks(hf_fields(name))[symbol]
    return batch * seq * (block["flops"] + block["attn"] * seq)


def symbols(name: str) -> list[str]:
    from tessera.models.configs import hf_fields

    pattern = hf_fields(name)["hybrid_override_pattern"]
    return [s for s in "M*-E" if s in pattern]


# ---- checks -------------------------------------------------------------------------------------------

def _attention_inputs(seq, batch, heads, groups, dim, dev):
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(seq, batch, heads, dim, generator=g)
    k, v = (torch.randn(seq, batch, groups, dim, generator=g) for _ in range(2))
    return [x.to(dev, torch.bfloat16) for x in (q, k, v)]


def _attention_config(heads=16, groups=4, dim=128):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=dim, attention_dropout=0.0,
                             params_dtype=torch.bfloat16, bf16=True)


def check_te_attention(pgs, dev) -> str:
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from tessera.models.sdpa_attention import SDPACoreAttention

    cfg = _attention_config()
    q, k, v = _attention_inputs(1024, 2, 16, 4, 128, dev)
    te = TEDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                               pg_collection=pgs)
    out = te(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    ref = SDPACoreAttention(cfg, 1, AttnMaskType.causal)(*(x.float().cpu() for x in (q, k, v)))
    return _verdict(rel_err(out, ref), TOL["bf16"])


def check_te_attention_thd(pgs, dev) -> str:
    import torch.nn.functional as F
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    cfg = _attention_config()
    lengths = [300, 17, 512, 195]  # documents packed into one row of 1024 tokens
    seq = sum(lengths)
    q, k, v = (x[:, 0] for x in _attention_inputs(seq, 1, 16, 4, 128, dev))  # THD: [tokens, heads, dim]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    te = TEDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.padding_causal,
                               attention_type="self", pg_collection=pgs)
    out = te(q, k, v, None, attn_mask_type=AttnMaskType.padding_causal, packed_seq_params=params)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    qf, kf, vf = (x.float().cpu().transpose(0, 1) for x in (q, k, v))  # [heads, t, d]
    ref = F.scaled_dot_product_attention(qf, kf.repeat_interleave(4, 0), vf.repeat_interleave(4, 0), attn_mask=mask)
    return _verdict(rel_err(out.reshape(seq, 16, 128), ref.transpose(0, 1)), TOL["bf16"])


def _mixers(pgs, dev):
    """(CPU Mamba2Mixer, GPU mixer) with the same weights at a 12B-like width, fp32; the GPU mixer has mamba_ssm's
    scan and causal_conv1d's conv, or torch's conv where causal_conv1d is not installed (as select_kernels picks)."""
    from megatron.core.models.backends import LocalSpecProvider

    from tessera.hetero.parallel.kernel_choice import MambaSSMMixer, MambaSSMScanMixer, installed
    from tessera.models.mamba2 import Mamba2Mixer, Mamba2Submodules

    cfg = llm_config("nemotron_nano_12b_v2", "M", torch.float32)
    backend = LocalSpecProvider()
    sub = Mamba2Submodules(in_proj=backend.column_parallel_linear(), out_proj=backend.row_parallel_linear())
    torch.manual_seed(0)
    cpu = Mamba2Mixer(cfg, sub, pg_collection=pgs)
    gpu = (MambaSSMMixer if installed("causal_conv1d") else MambaSSMScanMixer)(cfg, sub, pg_collection=pgs)
    gpu.load_state_dict(cpu.state_dict())
    return cfg, cpu, gpu.to(dev)


def check_causal_conv1d(pgs, dev) -> str:
    from tessera.hetero.parallel.kernel_choice import MambaSSMMixer

    _, cpu, gpu = _mixers(pgs, dev)
    if not isinstance(gpu, MambaSSMMixer):  # torch's conv on both sides would compare nothing
        raise ImportError("causal_conv1d is not installed (the trainer runs torch's conv)")
    xbc = torch.randn(2, 512, cpu.conv_dim)
    return _verdict(rel_err(gpu.conv(xbc.to(dev)), cpu.conv(xbc)), TOL["fp32"])


def _scan_check(pgs, dev, docs: torch.Tensor | None) -> str:
    _, cpu, gpu = _mixers(pgs, dev)
    b, s, h, p, g, n = 2, 512, cpu.heads, cpu.head_dim, cpu.groups, cpu.state
    x, B, C = torch.randn(b, s, h, p), torch.randn(b, s, g, n), torch.randn(b, s, g, n)
    dt = torch.nn.functional.softplus(torch.randn(b, s, h) - 3)
    A = -torch.exp(cpu.A_log.detach().float())
    from tessera.hetero.parallel.kernel_choice import ieee_fp32_dots

    on_gpu = {} if docs is None else {"doc_ids": docs.to(dev)}
    with ieee_fp32_dots():  # Triton's fp32 dots are TF32 by default (1.45e-3 off torch's); both sides IEEE
        out = gpu.scan(*(t.to(dev) for t in (x, dt, A, B, C)), **on_gpu)
        return _verdict(rel_err(out, cpu.scan(x, dt, A, B, C, doc_ids=docs)), TOL["fp32"])


def check_mamba_ssm_scan(pgs, dev) -> str:
    return _scan_check(pgs, dev, None)


def check_mamba_ssm_scan_docs(pgs, dev) -> str:
    """Packed documents (doc ids -> seq_idx), as every head-parallel CP rank scans whole rows of its heads."""
    rows = [torch.bucketize(torch.arange(512), torch.tensor(c), right=True) for c in ([37, 300], [200])]
    return _scan_check(pgs, dev, torch.stack(rows))


def check_mamba_mixer(pgs, dev) -> str:
    from tessera.hetero.parallel.kernel_choice import ieee_fp32_dots

    cfg, cpu, gpu = _mixers(pgs, dev)
    hidden = torch.randn(512, 2, cfg.hidden_size)
    with torch.no_grad(), ieee_fp32_dots():  # both sides IEEE fp32, as _scan_check
        return _verdict(rel_err(gpu(hidden.to(dev))[0], cpu(hidden)[0]), TOL["fp32"])


def check_kernel_choice(pgs, dev) -> str:
    from tessera.hetero.parallel.kernel_choice import select_kernels

    line = select_kernels(pgs, dtype=torch.bfloat16).line
    ok = "attention=transformer_engine" in line and "mamba=mamba_ssm" in line
    return f"{line} | {'PASS' if ok else 'FAIL'}"


def check_train_step_bf16(pgs, dev) -> str:
    run_dir = tempfile.mkdtemp(prefix="tessera_gpu_check_")
    cmd = [sys.executable, "-m", "tessera.recipes.train", "--recipe", "nemotron_vl_tiny",
           "layout=vision=dp1@0-0;language=dp1@0-0", "model.dtype=bfloat16", "trainer.max_steps=1",
           f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    done = [ln for ln in res.stdout.splitlines() if ln.startswith("done:")]
    if res.returncode or not done:
        return f"exit {res.returncode}: {(res.stderr or res.stdout)[-400:]!r} | FAIL"
    loss = float(done[-1].split("last_loss=")[1].split()[0])
    return f"{done[-1]} | {'PASS' if math.isfinite(loss) else 'FAIL'}"


def _verdict(err: float, tol: float) -> str:
    return f"max_rel_err={err:.2e} (tol {tol:.0e}) | {'PASS' if err <= tol else 'FAIL'}"


# ---- per-layer TFLOPS ---------------------------------------------------------------------------------

def layer_tflops(pgs, dev, name: str, symbol: str, seq: int, batch: int, iters: int,
                 dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """(ms per forward+backward, TFLOPS) of one `symbol` layer of model `name` in `dtype` on `dev` (the kernels
    select_kernels picks there; scripts/gpu_step.py's CPU smoke runs it at tiny shapes)."""
    from tessera.hetero.parallel.kernel_choice import select_kernels
    from tessera.models.hybrid_llm import HybridLM

    cfg = llm_config(name, symbol, dtype)
    kernels = select_kernels(pgs, dtype=dtype, config=cfg)
    layer = HybridLM(cfg, pgs, core_attention=kernels.core_attention, mamba_mixer=kernels.mamba_mixer,
                     moe_experts=kernels.moe_experts).layers[0]
    layer = layer.to(dev, dtype)
    x = torch.randn(seq, batch, cfg.hidden_size, device=dev, dtype=dtype, requires_grad=True)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def once():
        out = layer(x, attention_mask=None)[0]
        out.backward(torch.ones_like(out))

    for _ in range(2):
        once()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    sync()
    dt = (time.perf_counter() - t0) / iters
    return 1e3 * dt, 3 * layer_flops(name, symbol, seq, batch) / dt / 1e12


# ---- driver -------------------------------------------------------------------------------------------

def text_table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)


def dry(args) -> int:
    print("gpu_check plan (--dry: nothing runs)\n")
    print(text_table([("check", "compares")] + [(c, __doc__.split(c, 1)[1].split("\n")[0].strip()) for c in CHECKS]))
    print(f"\nper-layer forward+backward TFLOPS, bf16, seq={args.seq} batch={args.batch}:")
    rows = [("model", "layer", "GFLOP fwd", "ms", "TFLOPS")]
    for name in MODELS:
        for sym in symbols(name):
            rows.append((name, sym, f"{layer_flops(name, sym, args.seq, args.batch) / 1e9:.1f}", "-", "-"))
    print(text_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry", action="store_true", help="print the plan and the table's rows; no GPU needed")
    parser.add_argument("--seq", type=int, default=8192, help="tokens per row for the TFLOPS table")
    parser.add_argument("--batch", type=int, default=1, help="rows for the TFLOPS table")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks (names above)")
    args = parser.parse_args(argv)
    if args.dry:
        return dry(args)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False); "
              "run it on a GPU with the gpu extra installed, or pass --dry", file=sys.stderr)
        return 2
    from tessera.hetero.runtime.device import current_device
    from tessera.hetero.runtime.world import process_world

    with process_world():  # every entry point's bootstrap: CPU shims, cuda:0 bound, a one-rank world
        return run(args, current_device())


def run(args, dev) -> int:
    from tessera.hetero.tools.parity import init_groups

    pgs = init_groups()
    print(f"gpu_check on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}\n", flush=True)
    rows, failed = [("check", "result", "verdict")], 0
    for name in args.only or CHECKS:
        try:
            result, _, verdict = globals()[f"check_{name}"](pgs, dev).rpartition(" | ")
        except Exception as e:  # a missing extra or a kernel error is a failed row, not a crash
            result, verdict = f"{type(e).__name__}: {str(e)[:300]}", "FAIL"
        failed += verdict != "PASS"
        rows.append((name, result, verdict))
        print(f"{name}: {verdict} {result}", flush=True)
    print("\n" + text_table(rows) + "\n", flush=True)
    from tessera.hetero.planner.flops import peak_tflops

    peak = peak_tflops(torch.cuda.get_device_name(dev), "bfloat16")  # the trainer's MFU denominator
    trows = [("model", "layer", "GFLOP fwd", "ms fwd+bwd", "TFLOPS", f"MFU (peak {peak})")]
    for model in MODELS:
        for sym in symbols(model):
            try:
                ms, tf = layer_tflops(pgs, dev, model, sym, args.seq, args.batch, args.iters)
                trows.append((model, sym, f"{layer_flops(model, sym, args.seq, args.batch) / 1e9:.1f}",
                              f"{ms:.2f}", f"{tf:.1f}", f"{100 * tf / peak:.1f}%" if peak else "-"))
            except Exception as e:
                trows.append((model, sym, "-", "-", f"{type(e).__name__}: {str(e)[:120]}", "-"))
            torch.cuda.empty_cache()
    print(f"per-layer forward+backward TFLOPS, bf16, seq={args.seq} batch={args.batch}:")
    print(text_table(trows), flush=True)
    print(f"\ngpu_check: {'PASS' if not failed else f'FAIL ({failed} check(s))'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
