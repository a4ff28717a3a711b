"""Context parallelism of the hybrid LLM's sequence layers: the zigzag path vs the head-parallel path, measured
side by side on real gloo ranks (fp32, torch kernels; on a GPU box scripts/bench_cp_kernels.py times the
kernels each path runs there, fused ones included).

    OMP_NUM_THREADS=1 .venv/bin/python -m tessera.scripts.bench_cp                      # S 2K-8K x CP 2, 4
    OMP_NUM_THREADS=1 .venv/bin/python -m tessera.scripts.bench_cp --seqs 2048 --cps 2 --repeat 2

One layer of each kind, forward + backward, per CP rank (the slowest rank's median time, the largest peak of
resident memory growth): Nemotron Nano 12B v2's heads as one TP rank of TP 4 holds them (Mamba: 32 heads x
80, 2 groups, state 128, chunk 128; attention: 10 query heads, 2 KV heads, head width 128), a narrow hidden
width (256) so that the per-token projections, the same on both paths, stay small next to what CP changes:
the conv and scan, the attention core and their communication. Both paths get the same weights and tokens;
their outputs are compared (max relative difference) so the table cannot time a wrong path.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from tessera.hetero.plan.cp_path import attention_path, mamba_path
from tessera.hetero.tools.spawn import run_on_ranks

SHAPES = dict(hidden_size=256, mamba_num_heads=32, mamba_head_dim=80, n_groups=2, ssm_state_size=128,
              chunk_size=128, num_attention_heads=10, num_key_value_heads=2, head_dim=128)
PATHS = {"zigzag": ("cp_mamba.ZigzagCPMamba2Mixer", "cp_attention_module.ZigzagCPCoreAttention"),
         "head-parallel": ("cp_heads.HeadParallelMamba2Mixer", "cp_heads.HeadParallelCoreAttention")}


def _class(dotted: str) -> type:
    import importlib

    module, name = dotted.split(".")
    return getattr(importlib.import_module(f"tessera.hetero.parallel.{module}"), name)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _layer_config(cp: int):
    from tessera.models import configs
    from tessera.models.nemotron_h_hf import hybrid_config_from_hf

    fields = dict(configs.TINY_DENSE, **SHAPES, intermediate_size=512, hybrid_override_pattern="M*")
    return hybrid_config_from_hf(fields, cp=cp)


def _bench_rank(seq: int, repeat: int, path: str, kind: str) -> tuple:
    """On every rank of a CP group: the `kind` layer ("mamba" mixer or core "attention") of `path`, fwd+bwd;
    (median seconds, growth of the process's peak resident memory in MiB, the output). One process per layer and
    path, so each peak is its own."""
    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType

    from tessera.hetero.plan.zigzag import zigzag_shard
    from tessera.hetero.tools.parity import init_groups
    from tessera.models.hybrid_llm import build_hybrid_layer_specs

    torch.set_num_threads(1)
    cp = dist.get_world_size()
    pg = init_groups(cp=cp)
    rank = pg.cp.rank()
    config = _layer_config(cp)
    torch.manual_seed(0)
    x = zigzag_shard(torch.randn(seq, 1, config.hidden_size), cp, rank, 0)
    q, k, v = (zigzag_shard(torch.randn(seq, 1, n, 128), cp, rank, 0) for n in (10, 2, 2))
    mixer_name, attention_name = PATHS[path]
    torch.manual_seed(1)
    if kind == "mamba":
        mixer = _class(mixer_name)(config, build_hybrid_layer_specs(config)["M"].submodules, pg_collection=pg)
        with torch.no_grad():  # slow decays (the init's fade within a few tokens): state crosses every CP chunk
            mixer.A_log.copy_(torch.linspace(-6, -2, mixer.A_log.numel()))
        run = lambda: mixer(x.clone().requires_grad_())[0]  # noqa: E731
    else:
        attention = _class(attention_name)(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                           pg_collection=pg)
        run = lambda: attention(*(t.clone().requires_grad_() for t in (q, k, v)))  # noqa: E731
    times, before = [], _peak_mib()
    for _ in range(repeat + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        y = run()
        y.sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), _peak_mib() - before, y.detach().numpy()  # by value


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="2048,4096,8192")
    ap.add_argument("--cps", default="2,4")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    print("| S | cp | layer | zigzag ms | head-parallel ms | speed-up | zigzag peak MiB | head-parallel peak MiB | "
          "max rel diff |\n|---|---|---|---|---|---|---|---|---|")
    for cp in map(int, args.cps.split(",")):
        for seq in map(int, args.seqs.split(",")):
            for kind in ("mamba", "attention"):
                heads = ((SHAPES["mamba_num_heads"], SHAPES["n_groups"]) if kind == "mamba"
                         else (SHAPES["num_attention_heads"], SHAPES["num_key_value_heads"]))
                rule = (mamba_path if kind == "mamba" else attention_path)(*heads, 1, cp)
                if not rule.head_parallel:  # the trainer keeps this layer on the zigzag path: nothing to compare
                    print(f"| {seq} | {cp} | {kind} | - | - | - | - | - | zigzag only: {rule.reason} |", flush=True)
                    continue
                zz, hp = (run_on_ranks(cp, _bench_rank, seq, args.repeat, path, kind, timeout=3600)
                          for path in PATHS)
                t_zz, t_hp = (max(r[0] for r in ranks) for ranks in (zz, hp))
                m_zz, m_hp = (max(r[1] for r in ranks) for ranks in (zz, hp))
                diff = max(float(abs(a[2] - b[2]).max() / abs(b[2]).max()) for a, b in zip(zz, hp))
                print(f"| {seq} | {cp} | {kind} | {1e3 * t_zz:.0f} | {1e3 * t_hp:.0f} | {t_zz / t_hp:.2f}x | "
                      f"{m_zz:.0f} | {m_hp:.0f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
