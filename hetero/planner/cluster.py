"""The machine, the batch and the few free constants of the cost model, as frozen plain data.

Cluster presets (per GPU; sources):
    h100  NVIDIA H100 SXM5 80 GB in a DGX H100: 989.4 dense BF16 TFLOPS and 3.35 TB/s HBM3 (H100 datasheet,
          https://www.nvidia.com/en-us/data-center/h100/), 80 GB = 79.6 GiB as nvidia-smi reports (81559 MiB);
          NVLink 4 900 GB/s bidirectional = 450 GB/s each way; 8x ConnectX-7 400 Gb/s per node = one 50 GB/s
          NIC per GPU (DGX H100 user guide, https://docs.nvidia.com/dgx/dgxh100-user-guide/).
    h200  NVIDIA H200 SXM 141 GB: same compute, NVLink and NICs (DGX H200), 141 GB = 131 GiB HBM3e at 4.8 TB/s
          (H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/).
    cpu_gloo4  4 gloo ranks (one process, one thread each) on one CPU box, a "GPU" being one rank: peak = one
          core's fp32 matmul rate, "HBM" = a rank's share of RAM and its copy bandwidth, links = gloo over
          loopback TCP. Numbers measured on the 2-core dev box by scripts/calibrate_planner.py (which re-measures
          them on every run and uses its own figures); 4 ranks on 2 cores share them, which this does not model.
Link latencies (3 us NVLink, 8 us InfiniBand incl. one switch hop) are typical NCCL small-message figures,
not datasheet numbers; the fitted per-message overhead (Constants.msg_overhead_s) absorbs the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from tessera.hetero.planner.flops import peak_tflops


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    nodes: int
    peak_tflops: float        # dense BF16 per GPU
    hbm_gib: float
    hbm_tbps: float           # HBM bandwidth, for the optimizer step
    intra_gbps: float         # GB/s per GPU per direction inside a node (NVLink)
    inter_gbps: float         # GB/s per GPU per direction across nodes (its NIC)
    intra_latency_s: float
    inter_latency_s: float

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


# cpu_gloo4, as measured by scripts/calibrate_planner.py (one core's fp32 GEMM, copy bandwidth, gloo loopback)
PEAK_CPU_TFLOPS, MEM_CPU_TBPS, GLOO_GBPS, GLOO_LATENCY_S = 0.0925, 0.0385, 2.45, 61e-6

PRESETS = {
    "h100": Cluster("h100", gpus_per_node=8, nodes=128, peak_tflops=peak_tflops("H100 SXM", "bfloat16"),
                    hbm_gib=79.6, hbm_tbps=3.35, intra_gbps=450.0, inter_gbps=50.0,
                    intra_latency_s=3e-6, inter_latency_s=8e-6),
    "h200": Cluster("h200", gpus_per_node=8, nodes=128, peak_tflops=peak_tflops("H200", "bfloat16"),
                    hbm_gib=131.3, hbm_tbps=4.8, intra_gbps=450.0, inter_gbps=50.0,
                    intra_latency_s=3e-6, inter_latency_s=8e-6),
    "cpu_gloo4": Cluster("cpu_gloo4", gpus_per_node=4, nodes=1, peak_tflops=PEAK_CPU_TFLOPS, hbm_gib=5.0,
                         hbm_tbps=MEM_CPU_TBPS, intra_gbps=GLOO_GBPS, inter_gbps=GLOO_GBPS,
                         intra_latency_s=GLOO_LATENCY_S, inter_latency_s=GLOO_LATENCY_S),
}


def cluster(name: str, gpus: int | None = None) -> Cluster:
    """A preset, with enough nodes for `gpus` GPUs when given."""
    if name not in PRESETS:
        raise KeyError(f"unknown cluster {name!r}; presets: {', '.join(PRESETS)}")
    c = PRESETS[name]
    return c if gpus is None else replace(c, nodes=max(1, -(-gpus // c.gpus_per_node)))


@dataclass(frozen=True)
class Workload:
    """One optimizer step's data. Media counts are per packed LLM sequence (one row of seq_length)."""

    seq_length: int = 8192
    global_batch: int = 256            # sequences per step
    micro_batch: int = 1               # sequences per LLM data-parallel replica per microbatch
    # a run's configured rows per (global) microbatch: the search then prices the split the trainer runs
    # (hetero/plan/layout.rows_for_layout); None (a study's hypothetical step): the smallest one every DP divides
    rows_per_microbatch: int | None = None
    tiles: float = 0.0                 # image tiles per sequence (each 256 LLM tokens for RADIO at 512 px)
    frames: float = 0.0                # video frames per sequence (one tile each)
    tubelets: bool = False             # fuse temporal_patch frames into one ViT pass
    audio_seconds: float = 0.0         # audio per sequence
    audio_clip_seconds: float = 30.0   # length of one clip (attention spans a clip)
    # how unevenly the media mix's cost falls: (row, item) coefficient of variation of encoder FLOPs, measured for a
    # mix by scripts/bench_balance.py (straggler.MIXED_SPREAD); (0, 0) prices every row alike (the mean)
    vision_spread: tuple[float, float] = (0.0, 0.0)
    audio_spread: tuple[float, float] = (0.0, 0.0)
    balance_encoders: bool = True      # items dealt to encoder DP ranks by cost (data.balance_encoders)

    def spread(self, key: str) -> tuple[float, float]:
        """The (row, item) spread of an encoder module's cost ("vision", "audio": the media mix's, any family)."""
        return {"vision": self.vision_spread, "audio": self.audio_spread}.get(key, (0.0, 0.0))


@dataclass(frozen=True)
class Constants:
    """The free constants calibration fits (calibrate.fit); defaults are typical Megatron-on-H100 figures.

    eff_*: achieved fraction of peak BF16 FLOPs for that module kind's kernels (wide LLM GEMMs run closer to
    peak than a 1280-wide ViT or a 1024-wide Conformer); bw_eff: achieved fraction of link bandwidth
    (NCCL bus bandwidth / line rate); msg_overhead_s: software cost per message on top of link latency;
    layer_overhead_s: software cost of one layer's forward on one microbatch (Python, autograd, kernel
    launches; backward counts twice), whatever its size: negligible next to a real GPU layer's compute
    (default 0), the whole step for the tiny CPU models (scripts/calibrate_planner.py fits ~4 ms).
    """

    eff_llm: float = 0.50
    eff_vit: float = 0.40
    eff_conformer: float = 0.35
    # the zigzag CP path's torch-op sequence kernels on a GPU, fraction of peak (hetero/planner/cp_cost.py):
    # unfused masked attention and the torch SSD scan, bf16, 12B heads, 16K-32K tokens, measured on an H200 by
    # scripts/bench_cp_kernels.py at 20.5 and 4.7 TFLOP/s of the planner's FLOPs (flash: ~500, mamba_ssm: ~30)
    eff_torch_attention: float = 0.02
    eff_torch_scan: float = 0.005
    bw_eff: float = 0.80
    msg_overhead_s: float = 10e-6
    layer_overhead_s: float = 0.0

    def eff(self, kind: str) -> float:
        return getattr(self, f"eff_{kind}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
