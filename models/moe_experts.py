"""Routed MoE experts as two grouped GEMMs (torch's `_grouped_mm`), parameter for parameter megatron's
SequentialMLP, which stays the oracle.

    experts: GroupedGemmExperts (this file)  - fc1 of every local expert in one grouped GEMM, the activation
             and router weight once over all tokens, fc2 in a second grouped GEMM; no host sync on the
             token counts (SequentialMLP's tokens_per_expert.tolist() is one per layer and microbatch)
    oracle:  SequentialMLP (megatron)        - one MLP per local expert over its slice of the tokens

The parameters are SequentialMLP's own (local_experts.J.linear_fc1/linear_fc2, [ffn/etp, h] and [h, ffn/etp]),
so the HF import and export, checkpoints, seeded init, LoRA targets and the EP/expert-TP sharding read the
same names. So that the grouped GEMM reads them as one [E, ffn, h] operand without copying the expert weights
every call, each weight is a row of one tensor per projection (`_pack`, redone after every .to()/.cuda()); where
something re-homes a weight anyway, the call stacks a copy (`stacked_weights`), same numbers. Expert compute is
rank-local in megatron (explicit_expert_comm: the token dispatcher does the EP all-to-all/all-gather and the
expert-TP reduce), so nothing here communicates and TP, EP and the dropless dispatch are unchanged.

`_grouped_mm` (torch 2.13) takes fp32/bf16/fp16 on CPU (not fp64) and int32 offsets only, and refuses operands
whose row stride is not a multiple of 16 bytes ("strides should be multiple of 16 bytes", forward and backward):
a width that is not (4 fp32 / 8 bf16 elements) is zero-padded, which is exact (grouped_linear). On CUDA its
kernel is bf16 on Hopper and newer (what the GPU recipes run); other dtypes, older GPUs and the cases the grouped
path does not cover run SequentialMLP's loop, each with the reason in `grouped_gemm_unsupported`. Not yet run on
a GPU (none was lent to the session that wrote it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

ALIGN_BYTES = 16  # _grouped_mm's row-stride rule
GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


def grouped_mm_available() -> bool:
    """torch has the grouped GEMM op (torch >= 2.8; the project pins 2.13)."""
    return hasattr(torch, "_grouped_mm")


def _aligned(width: int, element_size: int) -> int:
    step = ALIGN_BYTES // element_size
    return -(-width // step) * step


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[j-1]:offsets[j] of x [T, K] times weights[j].T ([E, N, K], nn.Linear layout) -> [T, N].
    K and N are zero-padded to _grouped_mm's 16-byte rows (its backward multiplies by both): padded columns of x
    and w add exact zeros, padded output columns are sliced off (so their gradient is zero)."""
    n, k = weights.shape[1:]
    n_pad, k_pad = _aligned(n, x.element_size()) - n, _aligned(k, x.element_size()) - k
    if n_pad or k_pad:
        x, weights = F.pad(x, (0, k_pad)), F.pad(weights, (0, k_pad, 0, n_pad))
    out = torch._grouped_mm(x, weights.transpose(1, 2), offs=offsets)
    return out[:, :n] if n_pad else out


class _StackedView(torch.autograd.Function):
    """[E, out, in] view of E same-shaped weights that lie back to back in one storage: no copy forward; backward,
    each weight's gradient is its row of the stacked gradient."""

    @staticmethod
    def forward(ctx, *weights):
        first = weights[0]
        return first.as_strided((len(weights), *first.shape), (first.numel(), *first.stride()))

    @staticmethod
    def backward(ctx, grad):
        return grad.unbind(0)


def _back_to_back(weights: list[torch.Tensor]) -> bool:
    """The weights are contiguous rows of one storage, in order (what _pack leaves)."""
    first = weights[0]
    base, step = first.untyped_storage().data_ptr(), first.numel()
    return all(w.is_contiguous() and w.shape == first.shape and w.untyped_storage().data_ptr() == base
               and w.storage_offset() == first.storage_offset() + j * step for j, w in enumerate(weights))


class GroupedGemmExperts(SequentialMLP):
    """megatron's SequentialMLP computed as grouped GEMMs; forward(permuted tokens [T, h], tokens_per_expert [E],
    permuted probs [T]) -> ([T, h], None) as SequentialMLP, equal to its loop (tests/test_moe_experts.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pack()

    def _pack(self) -> None:
        """Re-home every local expert's fc1 (fc2) weight as a row of one [E, out, in] tensor: parameters, names and
        values unchanged, their storage shared (in-place updates, copy_ and load_state_dict keep it)."""
        with torch.no_grad():
            for name in ("linear_fc1", "linear_fc2"):
                weights = [getattr(e, name).weight for e in self.local_experts]
                for w, row in zip(weights, torch.stack([w.data for w in weights])):
                    w.data = row

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to()/.cuda()/.half() give every weight its own new tensor: pack them again
        self._pack()
        return self

    def stacked_weights(self, name: str) -> torch.Tensor:
        """[E, out, in] of every local expert's `name` weight: a view where packed, else a stacked copy."""
        weights = [getattr(e, name).weight for e in self.local_experts]
        return _StackedView.apply(*weights) if _back_to_back(weights) else torch.stack(weights)

    def grouped_gemm_unsupported(self, hidden: torch.Tensor) -> str | None:
        """Why this call runs the per-expert loop instead (None: it runs grouped)."""
        cfg = self.config
        if not grouped_mm_available():
            return f"torch {torch.__version__} has no _grouped_mm"
        if hidden.dtype not in GROUPED_DTYPES.get(hidden.device.type, ()):
            return f"_grouped_mm on {hidden.device.type} takes {GROUPED_DTYPES.get(hidden.device.type, ())}"
        if hidden.device.type == "cuda" and torch.cuda.get_device_capability(hidden.device) < (9, 0):
            return "_grouped_mm's CUDA kernel is for Hopper (sm90) and newer"
        if cfg.fp8 or cfg.fp4:
            return "fp8/fp4 experts pad tokens per expert for quantisation (SequentialMLP does)"
        if cfg.gated_linear_unit or cfg.add_bias_linear or cfg.moe_apply_probs_on_input:
            return "gated, biased or probs-on-input experts: only the Nemotron-H expert (no GLU, no bias) is grouped"
        for expert in self.local_experts:
            for linear in (expert.linear_fc1, expert.linear_fc2):
                if linear._forward_hooks or linear._forward_pre_hooks:  # e.g. LoRA's adapter hook
                    return "an expert linear has forward hooks (LoRA adapters) that the grouped GEMM would skip"
        return None

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        hidden = permuted_local_hidden_states
        if self.grouped_gemm_unsupported(hidden) is not None:
            return super().forward(hidden, tokens_per_expert, permuted_probs)
        counts = torch.as_tensor(tokens_per_expert, device=hidden.device)
        offsets = counts.cumsum(0).to(torch.int32)
        inter = grouped_linear(hidden, self.stacked_weights("linear_fc1"), offsets)  # [E, ffn/etp, h]
        # MLP's unfused path with a per-token scale: act(x) * probs, back to the activations' dtype
        inter = (self.local_experts[0].activation_func(inter) * permuted_probs.unsqueeze(-1)).to(inter.dtype)
        return grouped_linear(inter, self.stacked_weights("linear_fc2"), offsets), None  # [E, h, ffn/etp]
