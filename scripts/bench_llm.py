"""OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_llm.py

Hybrid LLM throughput on this CPU (one process, TP=CP=PP=1, float32), two tables from one run:
  1. HybridLM forward+backward tokens/s for the tiny test model (models.configs TINY_DENSE / TINY_MOE) and
     a ~100M-parameter Nemotron-H shape (BENCH_100M), on the kernels hetero.parallel.kernel_choice picks here.
  2. Our Mamba-2 mixer (models/mamba2.py) vs transformers' NemotronHMamba2Mixer torch path, loaded with
     the same weights, at the Mamba shapes of both configs: forward+backward ms each, the ratio
     (transformers / ours, >1 means ours is faster), and their max relative output difference.
Times are the median of --iters runs after one warm-up. Other options: --batch, --seq, --iters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

# Keep the output to the tables: megatron warns once per missing optional GPU library, transformers
# once about its torch fallback (which is the path being measured here).
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from tessera.hetero.runtime.world import process_world
from tessera.hetero.parallel.kernel_choice import select_kernels
from tessera.hetero.tools.parity import init_groups
from tessera.models import configs
from tessera.models.hybrid_llm import HybridLM
from tessera.models.nemotron_h_hf import hybrid_config_from_hf, mamba_to_megatron

CONFIGS = {"tiny-dense": configs.TINY_DENSE, "tiny-moe": configs.TINY_MOE, "100m": configs.BENCH_100M}


def median_seconds(step, iters: int) -> float:
    step()  # warm-up: allocator, lazy init
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_model(fields: dict, pg, kernels, batch: int, seq: int, iters: int) -> tuple[int, float]:
    """(parameter count, forward+backward tokens/s) of one HybridLM."""
    torch.manual_seed(0)
    model = HybridLM(hybrid_config_from_hf(fields), pg, core_attention=kernels.core_attention,
                     mamba_mixer=kernels.mamba_mixer, moe_experts=kernels.moe_experts).train()
    ids = torch.randint(0, fields["vocab_size"], (batch, seq + 1))

    def step():
        model.zero_grad(set_to_none=True)
        model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()

    return sum(p.numel() for p in model.parameters()), batch * seq / median_seconds(step, iters)


def bench_mixer(fields: dict, pg, batch: int, seq: int, iters: int) -> tuple[float, float, float]:
    """(ours ms, transformers ms, max rel output diff) for forward+backward of one Mamba-2 mixer."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    torch.manual_seed(0)
    ref = NemotronHMamba2Mixer(NemotronHConfig(**fields), layer_idx=0).train()
    config = hybrid_config_from_hf(fields)
    model = HybridLM(config, pg)  # borrow the Mamba layer the spec builds, load the same weights into it
    ours = model.layers[config.hybrid_pattern.index("M")].mixer.train()
    ours.load_state_dict(mamba_to_megatron(ref.state_dict(), config))
    x = torch.randn(batch, seq, fields["hidden_size"])
    x_sbh = x.transpose(0, 1).contiguous()

    def run_ours():
        ours.zero_grad(set_to_none=True)
        ours(x_sbh)[0].square().mean().backward()

    def run_ref():
        ref.zero_grad(set_to_none=True)
        ref(x).square().mean().backward()

    with torch.no_grad():
        diff = ((ours(x_sbh)[0].transpose(0, 1) - ref(x)).abs().max() / ref(x).abs().max()).item()
    return 1e3 * median_seconds(run_ours, iters), 1e3 * median_seconds(run_ref, iters), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].split("\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    # every entry point's bootstrap (threads, CPU shims, a one-rank world); gloo: the model runs on the CPU
    with process_world(backend="gloo"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also where a GPU is (process_world: CPU only)
        run(args)


def run(args) -> None:
    pg = init_groups()
    kernels = select_kernels(pg)
    print(f"{kernels.line} threads={torch.get_num_threads()} batch={args.batch} seq={args.seq} "
          f"iters={args.iters}")

    print(f"\n{'model':<11} {'params':>10} {'fwd+bwd tokens/s':>17}")
    for name, fields in CONFIGS.items():
        params, tps = bench_model(fields, pg, kernels, args.batch, args.seq, args.iters)
        print(f"{name:<11} {params / 1e6:>9.2f}M {tps:>17.0f}")

    print(f"\n{'mamba mixer':<11} {'shape (h x p, n)':>17} {'ours ms':>9} {'hf ms':>9} {'hf/ours':>8} "
          f"{'max rel diff':>13}")
    for name in ("tiny-dense", "100m"):
        fields = CONFIGS[name]
        ours_ms, ref_ms, diff = bench_mixer(fields, pg, args.batch, args.seq, args.iters)
        shape = f"{fields['mamba_num_heads']}x{fields['mamba_head_dim']}, {fields['ssm_state_size']}"
        print(f"{name:<11} {shape:>17} {ours_ms:>9.1f} {ref_ms:>9.1f} {ref_ms / ours_ms:>8.2f} {diff:>13.1e}")


if __name__ == "__main__":
    main()
