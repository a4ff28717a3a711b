"""Which context-parallel path an LLM layer takes, written once (pure; no torch). The trainer's kernel choice
(hetero/parallel/kernel_choice.py) and the planner's pricing (hetero/planner/cost.py) both read it.

    head-parallel  all-to-all from this rank's zigzag tokens of every local head to the whole sequence of
                   1/cp of the heads, the CP = 1 kernel there (fused on a GPU: mamba_ssm / causal_conv1d,
                   Transformer Engine or flash attention with THD documents), all-to-all back
                   (hetero/parallel/cp_heads.py). Needs the heads to split over cp.
    zigzag         every rank keeps its zigzag tokens: attention all-gathers K/V and runs unfused masked
                   attention, Mamba passes chunk states (hetero/parallel/cp_attention_module.py, cp_mamba.py).
                   Torch ops on any device: the fallback when the heads do not split.

A layer's heads split over cp when the heads per TP rank divide by cp and the heads they share (attention:
KV heads; Mamba: B/C groups) per TP rank either divide by cp or divide cp; in the second case each shared
head is replicated over cp / shared ranks, as megatron's MambaContextParallel does for Mamba groups.
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD_PARALLEL, ZIGZAG, NO_CP = "head-parallel", "zigzag", "none"


@dataclass(frozen=True)
class CPPath:
    """The path one layer kind takes at a CP size, and (for zigzag) why the heads did not split."""

    path: str
    reason: str = ""

    @property
    def head_parallel(self) -> bool:
        return self.path == HEAD_PARALLEL


def split_reason(heads: int, shared: int, tp: int, cp: int, shared_name: str) -> str:
    """Why `heads` heads sharing `shared` heads do not split over tp x cp ranks, or "" when they do."""
    h, s = heads // tp, shared // tp
    if h % cp:
        return f"{h} heads per TP rank do not divide by cp={cp}"
    if s == 0 or (s % cp and cp % s):
        return f"{s} {shared_name} per TP rank and cp={cp}: neither divides the other"
    return ""


def replicas(shared: int, tp: int, cp: int) -> int:
    """How many CP ranks hold each shared head (KV head, Mamba group) on the head-parallel path."""
    s = shared // tp
    return cp // s if s < cp else 1


def attention_path(heads: int, kv_heads: int, tp: int, cp: int) -> CPPath:
    if cp == 1:
        return CPPath(NO_CP)
    why = split_reason(heads, kv_heads, tp, cp, "KV heads")
    return CPPath(ZIGZAG, why) if why else CPPath(HEAD_PARALLEL)


def mamba_path(heads: int, groups: int, tp: int, cp: int) -> CPPath:
    if cp == 1:
        return CPPath(NO_CP)
    why = split_reason(heads, groups, tp, cp, "B/C groups")
    return CPPath(ZIGZAG, why) if why else CPPath(HEAD_PARALLEL)
