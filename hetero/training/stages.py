"""Glue between the single-device models and the step executor (hetero/runtime/step_executor.py).

An encoder stage encodes the media of its DP rows of a microbatch; a language stage runs this rank's
TP/CP/PP piece of the hybrid LLM on its DP rows and zigzag CP positions. The models never see a process
group other than the ones injected at construction.

Layout invariance (what makes a heterogeneous run equal a homogeneous one): every media item is encoded
on its own, so an item's embedding never depends on which other items share its DP rank (batch padding
and BatchNorm statistics would otherwise change with the layout); the loss is a sum over this rank's
tokens divided by the step's *global* token count, so summing gradients over any DP x CP group gives the
same gradient for every module (hetero/optim/optimizers.py).

Device: batches come from the loader in host memory; `device` (the run's, hetero/training/loop.py) is
where every tensor a module receives lives. The language stage indexes its rows/positions on the host and
moves only its slice (`_local`); media items are moved by the media module itself (models/multimodal.py).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

from tessera.data.packing import PackedBatch
from tessera.hetero.plan.resolved_run import IGNORE, dp_rows
from tessera.hetero.parallel.cp_gather_attention import gather_rows
from tessera.hetero.plan.encoder_cp import encoder_path, item_cp_index, item_owners
from tessera.hetero.plan.zigzag import zigzag_positions
from tessera.hetero.plan.layout import ModuleLayout, RankCoord
from tessera.hetero.runtime.step_executor import PlacedMedia
from tessera.models.sdpa_attention import document_ids


def global_token_count(batches: list[PackedBatch]) -> int:
    """Label tokens of a whole step (all microbatches, all rows): the one loss normaliser of every module."""
    return int(sum(int((b.labels != IGNORE).sum()) for b in batches))


class MediaEncoderStage:
    """One encoder's pipeline stage: on the last stage, [tokens, llm_hidden] embeddings of the items this DP rank
    encodes (its rows' items, or those the run's assignment by cost gave it: hetero/plan/encoder_balance.py), in
    (row, position) order — the source order hetero.plan.boundary_plan expects.

    Under CP (cp > 1) a rank hands on, per row, its CP rank's contiguous part of the row's tokens it encodes, as the boundary
    plan's source shards are cut (hetero/plan/encoder_cp.py): the vision tower computes just those tokens, other
    encoders (audio) encode whole items per rank and gather the outputs.
    A vision tower split over pp > 1 stages (models/multimodal.MediaModule.forward_stage) hands on every item's
    hidden states concatenated, [sum over items of tiles x (prefix + patches), hidden]: every stage of one DP
    rank decodes the same items (data/loader.py), so each knows the items and the shape it receives."""

    def __init__(self, module, key: str, layout: ModuleLayout, coord: RankCoord, batches: list[PackedBatch],
                 device: torch.device, cp_group=None):
        self.module, self.key, self.layout, self.coord, self.batches = module, key, layout, coord, batches
        self.device = device  # where the module lives; MediaModule moves its decoded items there
        self.cp_group = cp_group  # item-parallel CP gathers the items' outputs over it
        if layout.cp > 1 and cp_group is None:
            raise ValueError(f"{key}={layout.to_spec()}: an encoder stage under CP needs its cp group")
        self._kept: dict[int, dict[tuple[int, int], list[int]]] = {}  # mb -> {(row, item): per-tubelet kept}

    def _rows(self, mb: int) -> list[list[tuple[int, tuple]]]:
        """Per row of microbatch mb, (item index in the row, item) of each of the row's items of this encoder that
        this DP rank encodes (PackedBatch.item_owners: the loader's assignment by cost, or the rows this rank owns),
        in (row, item) order: the order the boundary plan expects of its source."""
        b, dp = self.batches[mb], self.coord.dp
        out = []
        for r, owners in enumerate(b.item_owners(self.key, self.layout.dp_size)):
            mine = [j for j, o in enumerate(owners) if o == dp]
            media = b.media[r].get(self.key) if mine else None
            if mine and (media is None or any(media[j] is None or media[j][1] is None for j in mine)):
                raise RuntimeError(f"{self.key} dp rank {dp}: microbatch {mb} row {r} has items this rank encodes "
                                   f"that its loader did not decode; the loader must share the run's assignment")
            out.append([(j, media[j]) for j in mine])
        return out

    def _items(self, mb: int) -> list:
        return [it for row in self._rows(mb) for _, it in row]

    def input_shape(self, mb: int):
        if self.layout.pp == 1:
            raise AssertionError(f"{self.key} runs as one pipeline stage: it receives no activation")
        return self.module.stage_shape(self._items(mb))

    def forward(self, x, mb: int) -> torch.Tensor:
        path = encoder_path(self.key, self.layout.cp, self.layout.pp)  # the module refuses any other entry
        rows = self._rows(mb)
        if path == "token_cp":  # this CP rank's part of the tokens (models/vision_cp.py)
            return self.module.forward_cp([[it for _, it in row] for row in rows])
        if path == "item_cp":
            return self._forward_items_cp([[it for _, it in row] for row in rows])
        items, kept = [it for row in rows for _, it in row], []
        if path == "pipeline":
            out = self.module.forward_stage(items, x)
            kept = list(self.module.tubelet_kept)
        elif not items:
            out = self.module([])
        else:
            outs = []
            for it in items:
                outs.append(self.module([it]))
                kept += self.module.tubelet_kept
            out = torch.cat(outs)
        if kept:  # EVS: each pruned clip's per-tubelet kept counts, by (row, item index) of the batch
            videos = [(r, j) for r, row in enumerate(rows) for j, (kind, _) in row if kind == "video"]
            self._kept[mb] = dict(zip(videos, kept, strict=True))
        return out

    def tubelet_kept(self, mb: int) -> dict[tuple[int, int], list[int]]:
        """{(row, item index): tokens each tubelet kept} of microbatch mb's EVS-pruned clips this rank encoded
        (its last stage; empty elsewhere), for hetero/runtime/tubelet_settle.py."""
        return self._kept.pop(mb, {})

    def _forward_items_cp(self, rows: list[list]) -> torch.Tensor:
        """Item-parallel CP (hetero/plan/encoder_cp.item_owners): this rank encodes the items dealt to it, the
        outputs are gathered over the CP group, and it keeps its contiguous part of each row's tokens."""
        cp, rank = self.layout.cp, self.coord.cp
        counts = [[self.module.num_tokens(kind, item) for kind, item in row] for row in rows]
        owners = item_owners(counts, cp)
        mine = [it for row, own in zip(rows, owners) for it, q in zip(row, own) if q == rank]
        local = torch.cat([self.module([it]) for it in mine]) if mine else self.module([])
        per_rank = [sum(n for row, own in zip(counts, owners) for n, q in zip(row, own) if q == r) for r in range(cp)]
        if not sum(per_rank):
            return local
        if torch.is_grad_enabled() and not local.requires_grad:
            local = local.detach().requires_grad_()  # no item here: still join the gather's backward all-reduce
        gathered = gather_rows(local, self.cp_group, per_rank)
        return gathered[torch.as_tensor(item_cp_index(counts, owners, cp, rank), device=gathered.device)]


class LanguageStage:
    """This rank's piece of the LLM over its DP rows and zigzag CP positions of each microbatch."""

    def __init__(self, llm, layout: ModuleLayout, coord: RankCoord, batches: list[PackedBatch], total_tokens: int,
                 device: torch.device, settle=None):
        self.llm, self.layout, self.coord, self.batches, self.total = llm, layout, coord, batches, total_tokens
        self.device, self.settle = device, settle  # settle: the run's TubeletSettle (EVS chunks), or None
        n, seq = batches[0].tokens.shape
        self.rows = torch.as_tensor(list(dp_rows(n, layout.dp_size, coord.dp)))
        self.pos = torch.as_tensor(zigzag_positions(seq, layout.cp, coord.cp))
        if getattr(llm.config, "moe_aux_loss_coeff", 0.0):
            # megatron scales the MoE aux loss's gradient by cp/microbatches and DDP then averages over DP x CP;
            # gradients here are summed over DP x CP, so the same aux gradient is 1/(microbatches x dp)
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / (len(batches) * layout.dp_size), device=device))

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows and zigzag positions of a host [N, S] batch tensor, on the run's device (the
        slice is cut on the host, so only it crosses to the device)."""
        return t[self.rows][:, self.pos].to(self.device, non_blocking=True)

    def input_shape(self, mb: int):
        """[s, b, h] handed between pipeline stages: under sequence parallelism each TP rank's 1/tp of s."""
        seq = len(self.pos) // (self.layout.tp if self.llm.config.sequence_parallel else 1)
        return (seq, len(self.rows), self.llm.config.hidden_size)

    def forward(self, x, media: dict[str, PlacedMedia] | None, mb: int) -> torch.Tensor:
        batch = self.batches[mb]
        labels = self._local(batch.labels) if self.llm.post_process else None
        # packed documents of this rank's rows and zigzag positions: no attention, conv or SSM state crosses them
        docs = self._local(document_ids(batch.cu_seqlens, batch.tokens.shape[1]))
        if x is None:  # first stage: text embeddings with each encoder's boundary output at its positions
            if self.settle is not None:
                self.settle.require_settled(mb)  # the tokens as settled at the boundary (runtime/tubelet_settle.py)
            hidden = self.llm.embedding(self._local(batch.tokens))
            for key in sorted(media or {}):  # the boundary plan placed each encoder's rows: keep its placement
                hidden = torch.where(media[key].mask[..., None], media[key].values.to(hidden.dtype), hidden)
            return self.llm(decoder_input=hidden.transpose(0, 1).contiguous(), labels=labels, doc_ids=docs)
        self.llm.set_input_tensor(x)
        return self.llm(labels=labels, doc_ids=docs)

    def loss(self, per_token: torch.Tensor, mb: int) -> torch.Tensor:
        """This rank's share of the step loss (per-token losses are 0 where the label is ignored)."""
        return per_token.float().sum() / self.total
