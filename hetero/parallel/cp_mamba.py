"""Context-parallel Mamba-2 mixer: the CPU mixer (models/mamba2.py) with its two sequence-mixing steps
(causal conv1d and SSD scan) made exact across CP ranks in the zigzag layout.

Layout: the sequence is cut into 2*cp chunks; CP rank r holds chunks r and 2cp-1-r (as the CP attention,
hetero/parallel/cp_attention_module.py). Everything in the mixer except the conv and the scan is per token, so only
those two need the other ranks.

Scheme chosen: state passing, computed in parallel, not gathering the sequence.
  * conv1d (kernel k): a chunk's first k-1 outputs need the k-1 inputs before it. Every rank all-gathers
    the last k-1 conv inputs of its two chunks (a 2*(k-1)-token halo per rank) and convolves each chunk
    with its predecessor's tail as left context (zeros before chunk 0).
  * scan: the SSD recurrence h_t = exp(a_t) h_{t-1} + B_t x_t dt_t, y_t = C_t h_t is linear in the state.
    Each rank scans its chunks from a zero state, giving y0 and the chunk's final state S_c, plus the
    chunk's total log-decay L_c = sum(a_t). Every rank all-gathers (S_c, L_c) of all 2cp chunks and runs
    the short recurrence E_0 = 0, E_{c+1} = exp(L_c) E_c + S_c for the state entering each chunk; then
    y_t = y0_t + C_t exp(cumsum a up to t) E_c, which is exactly the scan started from E_c.
Why not all-gather the layer input and scan the full sequence: that is simpler but costs cp x the Mamba
compute and O(S) activations per rank, i.e. it undoes CP for the layers that dominate Nemotron-H. Why not
pass the state rank to rank in chunk order: zigzag order visits the ranks 0..cp-1 and back, 2cp serial
steps with every rank idle but one. Here each rank sends O(cp * b * heads * head_dim * state) floats
(the chunk states) plus the halo, all ranks work at once, and the result equals the one-device scan up
to float round-off. Gradients flow through the gathers (backward sums over the CP group), so training
is exact too.
Packed documents (doc_ids, this rank's zigzag slice): the conv halo carries its tokens' document ids and
taps across a document start are zeroed; a document start has log-decay -inf, inside the local scans and
in the chunk decays L_c passed between ranks, so no state crosses it (the first token of a chunk is
compared with the predecessor chunk's last id, gathered like the halo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.hetero.parallel.cp_gather_attention import gather_rows
from tessera.hetero.plan.zigzag import zigzag_chunks, zigzag_owner
from tessera.models.mamba2 import Mamba2Mixer, causal_depthwise_conv1d, document_starts, ssd_chunk_scan


def _entry(chunk: int, cp: int) -> int:
    """Row of global chunk `chunk` in a rank-major gather of (first chunk, second chunk) per rank."""
    owner = int(zigzag_owner(chunk, cp))  # the zigzag split of hetero/plan/zigzag.py, not a copy of it
    return 2 * owner + zigzag_chunks(cp, owner).index(chunk)


class ZigzagCPMamba2Mixer(Mamba2Mixer):
    """Mamba2Mixer whose conv and scan see the whole zigzag-sharded sequence through its CP group."""

    def __init__(self, config, submodules, layer_number: int = 1, tp_group=None, pg_collection=None):
        super().__init__(config, submodules, layer_number, tp_group=tp_group, pg_collection=pg_collection)
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            raise ValueError("ZigzagCPMamba2Mixer needs a pg_collection with a cp group")
        self.cp_group = pg_collection.cp

    def _cp(self) -> tuple[int, int]:
        return dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)

    def _halves(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if t.shape[1] % 2:
            raise ValueError(f"zigzag CP needs an even local length (two chunks per rank), got {t.shape[1]}")
        return t.chunk(2, dim=1)

    def _doc_tails(self, doc_ids: torch.Tensor, width: int) -> torch.Tensor:
        """Every chunk's last `width` document ids, gathered rank-major: [2cp, b, width]."""
        first, second = self._halves(doc_ids)
        return gather_rows(torch.stack([first[:, -width:], second[:, -width:]]), self.cp_group)

    def conv(self, xbc: torch.Tensor, doc_ids: torch.Tensor | None = None, weight=None, bias=None) -> torch.Tensor:
        cp, rank = self._cp()
        weight, bias = (self.conv1d_weight, self.conv1d_bias) if weight is None else (weight, bias)
        if cp == 1:
            return super().conv(xbc, doc_ids, weight, bias)
        halo = weight.shape[-1] - 1
        first, second = self._halves(xbc)
        if first.shape[1] < halo:
            raise ValueError(f"CP chunks of {first.shape[1]} tokens are shorter than the conv halo {halo}")
        tails = gather_rows(torch.stack([first[:, -halo:], second[:, -halo:]]), self.cp_group)  # [2cp, b, k-1, d]
        docs = (None, None) if doc_ids is None else self._halves(doc_ids)
        doc_tails = None if doc_ids is None else self._doc_tails(doc_ids, halo)  # [2cp, b, k-1]
        out = []
        for chunk, part, part_docs in zip(zigzag_chunks(cp, rank), (first, second), docs):
            before = tails[_entry(chunk - 1, cp)] if chunk > 0 else torch.zeros_like(part[:, :halo])
            window_docs = None
            if part_docs is not None:  # the halo keeps its tokens' documents (zeros before chunk 0: any id)
                before_docs = (doc_tails[_entry(chunk - 1, cp)] if chunk > 0
                               else part_docs[:, :1].expand(-1, halo))
                window_docs = torch.cat([before_docs, part_docs], dim=1)
            # conv over [predecessor tail | chunk]; dropping the first k-1 outputs leaves exactly the chunk.
            full = causal_depthwise_conv1d(torch.cat([before, part], dim=1), weight, bias, window_docs)
            out.append(full[:, halo:])
        return torch.cat(out, dim=1)

    def scan(self, x, dt, A, B, C, initial_state=None, doc_ids=None) -> torch.Tensor:
        cp, rank = self._cp()
        if cp == 1:
            return super().scan(x, dt, A, B, C, initial_state, doc_ids)
        parts = list(zip(*(self._halves(t) for t in (x, dt, B, C))))  # [(x, dt, B, C) of each local chunk]
        resets = [None, None]
        if doc_ids is not None:
            # a chunk's first token starts a document when its id differs from the predecessor chunk's last
            last = self._doc_tails(doc_ids, 1)[..., 0]  # [2cp, b]
            for i, (chunk, part_docs) in enumerate(zip(zigzag_chunks(cp, rank), self._halves(doc_ids))):
                resets[i] = document_starts(part_docs, last[_entry(chunk - 1, cp)] if chunk > 0 else None)
        y0, finals, log_decay, cum_decay = [], [], [], []
        for (xc, dtc, Bc, Cc), reset in zip(parts, resets):
            y, final = ssd_chunk_scan(xc, dtc, A, Bc, Cc, self.config.mamba_chunk_size, resets=reset)
            adt = dtc.float() * A.float()  # [b, l, h] per-step log-decay
            if reset is not None:  # a document start zeroes the state carried into it (and across ranks)
                adt = adt.masked_fill(reset[..., None], float("-inf"))
            y0.append(y)
            finals.append(final)
            log_decay.append(adt.sum(dim=1))
            cum_decay.append(torch.exp(adt.cumsum(dim=1)))
        states = gather_rows(torch.stack(finals), self.cp_group)    # [2cp, b, h, p, n]
        decays = gather_rows(torch.stack(log_decay), self.cp_group)  # [2cp, b, h]
        entering = [initial_state.float() if initial_state is not None else torch.zeros_like(finals[0])]
        for c in range(2 * cp - 1):
            e = _entry(c, cp)
            entering.append(torch.exp(decays[e])[..., None, None] * entering[-1] + states[e])
        heads_per_group = x.shape[2] // B.shape[2]
        out = []
        for (xc, _, _, Cc), y, decay, chunk in zip(parts, y0, cum_decay, zigzag_chunks(cp, rank)):
            c_heads = Cc.float().repeat_interleave(heads_per_group, dim=2)  # [b, l, h, n]
            out.append(y + torch.einsum("blhn,bhpn,blh->blhp", c_heads, entering[chunk], decay))
        return torch.cat(out, dim=1)
