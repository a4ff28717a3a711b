r"""Per-CP-rank kernel work at Nemotron-H 12B layer shapes: Tessera's zigzag CP vs head-parallel CP.

    OMP_NUM_THREADS=1 .venv/bin/python -m tessera.scripts.bench_cp_kernels --device cpu --seqs 512 --cps 2 \
        --tp 16 --repeat 1                                                      # CPU smoke test: torch rows only
    # GPU box, repo root as the `tessera` package, mamba_ssm's Triton code from .gpu_carry/site:
    mkdir -p /tmp/ns && ln -s "$PWD" /tmp/ns/tessera && export PYTHONPATH=/tmp/ns:$PWD/.gpu_carry/site
    OUT=/tmp/out python3 -m tessera.scripts.bench_cp_kernels        # S 16k,32k,64k x cp 2,4,8, --tp 1, numerics first

Shapes: Mamba 128 heads x head_dim 80, 8 groups, state 128, chunk 128, conv kernel 4; attention 40 query heads,
8 KV heads, head_dim 128; bf16 inputs (dt float32, as the mixer passes it), batch 1, divided by --tp.
One CP rank's kernels, forward + backward, for one layer:
  zigzag  what Tessera's zigzag CP runs today: the rank holds 2 chunks of S/(2cp) tokens with all local heads.
          Mamba: torch SSD scan `ssd_chunk_scan` once per chunk (no cross-rank state fix-up, no gathers);
          conv1d: once per chunk over [k-1 halo | chunk]; attention: `masked_attention` of the S/cp local
          queries over all S gathered keys, causal by the zigzag positions of rank 0 (chunks 0 and 2cp-1).
  head    head-parallel CP (all-to-all before/after, not timed): the full sequence S for heads/cp heads
          (groups/cp groups or 1; KV heads/cp or 1). Mamba: torch scan and mamba_ssm's fused Triton
          `mamba_chunk_scan_combined` (when importable); attention: SDPA is_causal + enable_gqa (flash on GPU).
Columns: median fwd+bwd ms over --repeat (after warm-up; CUDA events on GPU), peak allocated GiB (GPU only),
TFLOP/s from model FLOPs x3 (attention 4*S*S/2*h*d over the sequence, Mamba scan 6*tokens*h*p*n, conv
2*k*tokens*channels), each the rank's 1/cp share. A numerics section runs first (fp32, packed documents).
--max-seconds: rows after that wall time are skipped (the table so far is already printed/written).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F

try:  # cp_gather_attention imports numpy without needing it for masked_attention; a bare GPU box may lack it
    import numpy  # noqa: F401
except ImportError:
    sys.modules["numpy"] = types.ModuleType("numpy")

from tessera.hetero.parallel.cp_gather_attention import masked_attention
from tessera.hetero.parallel.kernel_choice import ieee_fp32_dots, import_kernel_module
from tessera.models.mamba2 import causal_depthwise_conv1d, document_starts, ssd_chunk_scan

MAMBA = dict(heads=128, dim=80, groups=8, state=128, chunk=128, conv=4)
ATTN = dict(heads=40, kv=8, dim=128)
BF16 = torch.bfloat16


def fused_scan(autotune_configs: int = 0):
    """mamba_ssm's fused Triton scan, or (None, why not). autotune_configs > 0: each of its kernels autotunes over
    only its first that many configs (the full sweep takes minutes per shape family on a fresh machine)."""
    try:
        if autotune_configs:
            import triton

            full = triton.autotune
            triton.autotune = lambda configs, *a, **k: full(configs[:autotune_configs], *a, **k)
        # a MAMBA_SKIP_CUDA_BUILD build imports too (kernel_choice.import_kernel_module)
        return import_kernel_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined, ""
    except Exception as e:  # noqa: BLE001 - ImportError, no triton, no GPU driver...
        return None, f"{type(e).__name__}: {e}"


def split(n: int, k: int, strict: bool) -> int | None:
    """n heads over k ranks: n/k; with strict=False, 1 when n < k and k % n == 0 (each rank inside one group)."""
    if n % k == 0:
        return n // k
    return 1 if not strict and k % n == 0 else None


def error_text(e: Exception) -> str:
    return f"error: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:100]}".replace("|", "/")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def mamba_inputs(length, h, p, g, n, dtype, device, grad_dtype=torch.float32):
    """Leaves x, dt (positive, float32), A (negative), B, C with requires_grad, plus an output gradient."""
    x = torch.randn(1, length, h, p, device=device, dtype=dtype)
    dt = torch.empty(1, length, h, device=device).uniform_(-6.9, -2.3).exp()  # dt in [1e-3, 0.1] as Nemotron-H
    A = -torch.empty(h, device=device).uniform_(1, 16)
    B, C = (torch.randn(1, length, g, n, device=device, dtype=dtype) for _ in range(2))
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C)]
    return leaves, torch.randn(1, length, h, p, device=device, dtype=grad_dtype)


def check_numerics(device, fused) -> list[tuple[str, float | None, str]]:
    """(name, relative max error, note) for the fused scan vs the torch scan and SDPA vs masked_attention."""
    torch.manual_seed(0)
    out = []
    length, h, p, g, n, q = 1024, 8, 64, 2, 64, 64
    doc_ids = torch.tensor([0] * 300 + [1] * 500 + [2] * 224, device=device)[None]  # 3 packed documents
    if fused is None or device.type != "cuda":
        out.append(("mamba_chunk_scan_combined vs ssd_chunk_scan", None, "skipped: no fused scan here"))
    else:
        (x, dt, A, B, C), go = mamba_inputs(length, h, p, g, n, torch.float32, device)
        ins = [x, dt, B, C]
        # both sides in IEEE fp32 (ieee_fp32_dots says why); these fp32 kernels compile now, the bf16 benchmark
        # kernels later, with the defaults restored
        with ieee_fp32_dots():
            ref = ssd_chunk_scan(x, dt, A, B, C, q, resets=document_starts(doc_ids))[0]
            ref_g = torch.autograd.grad(ref, ins, go)
            try:
                y = fused(x, dt, A, B, C, q, seq_idx=doc_ids.to(torch.int32))
                y_g = torch.autograd.grad(y, ins, go)
                out.append(("mamba fused vs torch scan: y (3 docs)", rel_err(y, ref), ""))
                out += [(f"mamba fused vs torch scan: d{k}", rel_err(a, b), "")
                        for k, a, b in zip(("x", "dt", "B", "C"), y_g, ref_g)]
            except Exception as e:  # noqa: BLE001 - report a kernel that fails to compile or run, go on
                out.append(("mamba fused vs torch scan", None, error_text(e)))
    hq, hkv, d = 8, 2, 64
    qkv = [torch.randn(1, hh, length, d, device=device, requires_grad=True) for hh in (hq, hkv, hkv)]
    go = torch.randn(1, hq, length, d, device=device)
    y = F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True)
    y_g = torch.autograd.grad(y, qkv, go)
    cpu = [t.detach().cpu()[0].transpose(0, 1).contiguous().requires_grad_() for t in qkv]  # [T, heads, d]
    pos, seg = torch.arange(length), torch.zeros(length, dtype=torch.long)
    ref = masked_attention(*cpu, pos, pos, seg, seg, causal=True)
    ref_g = torch.autograd.grad(ref, cpu, go.cpu()[0].transpose(0, 1))
    out.append((f"sdpa ({device.type}) vs masked_attention (cpu): out", rel_err(y[0].transpose(0, 1), ref), ""))
    out += [(f"sdpa ({device.type}) vs masked_attention (cpu): d{k}", rel_err(a[0].transpose(0, 1), b), "")
            for k, a, b in zip("qkv", y_g, ref_g)]
    return out


def zigzag_mamba(s, cp, h, g, device):
    m, c = MAMBA, s // (2 * cp)
    parts = [mamba_inputs(c, h, m["dim"], g, m["state"], BF16, device) for _ in range(2)]

    def step():
        ys = [ssd_chunk_scan(x, dt, A, B, C, m["chunk"])[0] for (x, dt, A, B, C), _ in parts]
        torch.autograd.grad(ys, [t for leaves, _ in parts for t in leaves], [go for _, go in parts])
    return step


def head_mamba(s, h, g, device, fused=None):
    m = MAMBA
    (x, dt, A, B, C), go = mamba_inputs(s, h, m["dim"], g, m["state"], BF16, device, BF16 if fused else torch.float32)

    def step():
        y = fused(x, dt, A, B, C, m["chunk"]) if fused else ssd_chunk_scan(x, dt, A, B, C, m["chunk"])[0]
        torch.autograd.grad(y, [x, dt, A, B, C], go)
    return step


def conv_step(lengths, channels, device):
    """Depthwise causal conv over pieces of `lengths` tokens, each behind a k-1 token halo (as the CP mixer)."""
    k = MAMBA["conv"]
    w = torch.randn(channels, k, device=device, dtype=BF16, requires_grad=True)
    bias = torch.zeros(channels, device=device, dtype=BF16, requires_grad=True)
    xs = [torch.randn(1, n + k - 1, channels, device=device, dtype=BF16, requires_grad=True) for n in lengths]
    gos = [torch.randn(1, n, channels, device=device, dtype=BF16) for n in lengths]

    def step():
        ys = [causal_depthwise_conv1d(x, w, bias)[:, k - 1:] for x in xs]
        torch.autograd.grad(ys, xs + [w, bias], gos)
    return step


def zigzag_attention(s, cp, h, kv, device):
    d, c = ATTN["dim"], s // (2 * cp)
    q = torch.randn(2 * c, h, d, device=device, dtype=BF16, requires_grad=True)
    k, v = (torch.randn(s, kv, d, device=device, dtype=BF16, requires_grad=True) for _ in range(2))
    go = torch.randn(2 * c, h, d, device=device, dtype=BF16)
    q_pos = torch.cat([torch.arange(c), torch.arange((2 * cp - 1) * c, 2 * cp * c)]).to(device)  # rank 0
    k_pos = torch.arange(s, device=device)
    q_seg, k_seg = torch.zeros_like(q_pos), torch.zeros_like(k_pos)

    def step():
        torch.autograd.grad(masked_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, causal=True), [q, k, v], go)
    return step


def head_attention(s, h, kv, device):
    d = ATTN["dim"]
    q = torch.randn(1, h, s, d, device=device, dtype=BF16, requires_grad=True)
    k, v = (torch.randn(1, kv, s, d, device=device, dtype=BF16, requires_grad=True) for _ in range(2))
    go = torch.randn(1, h, s, d, device=device, dtype=BF16)

    def step():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != kv)
        torch.autograd.grad(y, [q, k, v], go)
    return step


def measure(make, device, repeat):
    """(median ms, peak GiB or None, warm-up s) of make()'s step; raises OutOfMemoryError."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step = make()
    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
        step()  # second warm-up: autotuning and allocator growth are done after the first
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return statistics.median(times), peak, first


def cell_rows(s, cp, tp, fused, device):
    """[(layout, kernel, heads label, tokens, model FLOPs, make() or the reason to skip)] of one (S, cp) cell."""
    m, d = MAMBA, ATTN["dim"]
    mh, mg = split(m["heads"], tp, True), split(m["groups"], tp, False)
    ah, akv = split(ATTN["heads"], tp, True), split(ATTN["kv"], tp, False)
    conv_ch = lambda h, g: h * m["dim"] + 2 * g * m["state"]  # noqa: E731 - x | B | C channels
    zok, aok = None not in (mh, mg), None not in (ah, akv)
    hm = (split(mh, cp, True), split(mg, cp, False)) if zok else (None, None)
    ha = (split(ah, cp, True), split(akv, cp, False)) if aok else (None, None)
    hok, haok = None not in hm, None not in ha
    zm, za = (f"{mh}h/{mg}g" if zok else "-"), (f"{ah}q/{akv}kv" if aok else "-")
    hml, hal = (f"{hm[0]}h/{hm[1]}g" if hok else "-"), (f"{ha[0]}q/{ha[1]}kv" if haok else "-")
    scan_fl = 3 * 6 * (s // cp) * (mh or 0) * m["dim"] * m["state"]
    conv_fl = 3 * 2 * m["conv"] * (s // cp) * (conv_ch(mh, mg) if zok else 0)
    attn_fl = 3 * 4 * s * s / 2 * (ah or 0) * d / cp
    fused_make = (lambda: head_mamba(s, *hm, device, fused)) if fused else "no fused scan"
    return [
        ("zigzag", "mamba ssd_chunk_scan x2", zm, s // cp, scan_fl,
         (lambda: zigzag_mamba(s, cp, mh, mg, device)) if zok else "heads % tp"),
        ("zigzag", "conv1d x2 (halo)", f"{conv_ch(mh, mg) if zok else '-'}ch", s // cp, conv_fl,
         (lambda: conv_step([s // (2 * cp)] * 2, conv_ch(mh, mg), device)) if zok else "heads % tp"),
        ("zigzag", "attn masked_attention", za, s // cp, attn_fl,
         (lambda: zigzag_attention(s, cp, ah, akv, device)) if aok else "heads % tp"),
        ("head", "mamba ssd_chunk_scan", hml, s, scan_fl,
         (lambda: head_mamba(s, *hm, device)) if hok else "heads % (tp*cp)"),
        ("head", "mamba chunk_scan_combined", hml, s, scan_fl,
         fused_make if hok else "heads % (tp*cp)"),
        ("head", "conv1d", f"{conv_ch(*hm) if hok else '-'}ch", s, conv_fl,
         (lambda: conv_step([s], conv_ch(*hm), device)) if hok else "heads % (tp*cp)"),
        ("head", "attn sdpa causal", hal, s, attn_fl,
         (lambda: head_attention(s, *ha, device)) if haok else "heads % (tp*cp)"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seqs", default="16384,32768,65536")
    ap.add_argument("--cps", default="2,4,8")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-seconds", type=float, default=210.0)
    ap.add_argument("--skip-numerics", action="store_true")
    ap.add_argument("--autotune-configs", type=int, default=0, help="autotune mamba_ssm's kernels over this many "
                    "configs each (0: all)")
    args = ap.parse_args()
    device, t_start = torch.device(args.device), time.perf_counter()
    fused, why = fused_scan(args.autotune_configs) if device.type == "cuda" else (None, "CPU run")
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)
        if os.environ.get("OUT"):
            os.makedirs(os.environ["OUT"], exist_ok=True)
            with open(os.path.join(os.environ["OUT"], "bench_cp_kernels.md"), "w") as f:
                f.write("\n".join(lines) + "\n")

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    emit(f"# CP kernels per rank: {name}, torch {torch.__version__}, tp {args.tp}, repeat {args.repeat}")
    emit(f"fused Triton scan (mamba_ssm): {'available' if fused else 'unavailable, rows skipped (' + why + ')'}")
    if not args.skip_numerics:
        emit("\n## Numerics (fp32, S=1024, tolerance 1e-3; Triton fp32 dots in IEEE, TRITON_F32_DEFAULT=ieee)\n")
        emit("| check | rel. max error | result |\n|---|---|---|")
        t0 = time.perf_counter()
        for check, err, note in check_numerics(device, fused):
            verdict = note if err is None else ("PASS" if err <= 1e-3 else "FAIL")
            emit(f"| {check} | {'-' if err is None else f'{err:.2e}'} | {verdict} |")
        emit(f"\n(numerics took {time.perf_counter() - t0:.1f} s)")

    emit("\n## Fwd+bwd per CP rank (bf16, batch 1)\n")
    emit("| S | cp | layout | kernel | heads | tokens | ms | peak GiB | TFLOP/s |\n" + "|---" * 9 + "|")
    for s, cp in [(int(s), int(cp)) for s in args.seqs.split(",") for cp in args.cps.split(",")]:
        for layout, kernel, heads, tokens, flops, make in cell_rows(s, cp, args.tp, fused, device):
            head = f"| {s} | {cp} | {layout} | {kernel} | {heads} | {tokens} |"
            if isinstance(make, str) or time.perf_counter() - t_start > args.max_seconds:
                emit(f"{head} skip: {make if isinstance(make, str) else 'time budget'} | - | - |")
                continue
            failed = ""
            try:
                result = measure(make, device, args.repeat)
            except torch.cuda.OutOfMemoryError:
                failed = "OOM"
            except Exception as e:  # noqa: BLE001 - one broken kernel must not end the table
                failed = error_text(e)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if failed:
                emit(f"{head} {failed} | - | - |")
                continue
            ms, peak, first = result
            print(f"  ({kernel}: warm-up {first:.1f} s, elapsed {time.perf_counter() - t_start:.0f} s)",
                  file=sys.stderr, flush=True)
            mem = "-" if peak is None else f"{peak:.2f}"
            emit(f"{head} {ms:.2f} | {mem} | {flops / (ms * 1e-3) / 1e12:.3g} |")
    emit(f"\n(total {time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
