"""One training step of a heterogeneous model over several microbatches, for both placements.

Every rank walks the same global sequence of phases, and only talks to peers inside the current phase,
so no placement or PP depth can deadlock:

    forward,  for each microbatch:   encoder pipelines (stage s -> s+1)  ->  boundaries  ->  LLM pipeline
    backward, for each microbatch:   LLM pipeline (s+1 -> s)  ->  boundaries  ->  encoder pipelines

Colocated (all modules on the same ranks): this is the three-phase scheme — encoder forward and boundary,
the LLM on *detached* boundary outputs, then the boundary and encoder backward with the accumulated
gradient — which is what lets the LLM use PP>1 while the encoders share its ranks.
Non-colocated: encoder ranks only block on the boundary, so they run the next microbatch's forward while
the LLM ranks are still busy with the previous one (GPipe order: all forwards, then all backwards;
activation memory grows with the number of microbatches).

Module stages are supplied by the caller (models stay single-device code); this module only moves
activations between stages and across boundaries. Gradient reduction over each module's DP x CP group
happens after the step (`reduce_gradients`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from hetero.boundary import BoundaryCommunicator
from hetero.boundary_plan import BoundaryBatch
from hetero.groups import ModuleGroups
from hetero.layout import LANGUAGE, HeteroLayout


class EncoderStage(Protocol):
    def forward(self, x: torch.Tensor | None, mb: int) -> torch.Tensor:
        """This rank's stage for microbatch mb; x is None on the first stage (it reads its own input)."""

    def input_shape(self, mb: int) -> tuple[int, ...]:
        """Shape of the activation a non-first stage receives for microbatch mb."""


class LanguageStage(Protocol):
    def forward(self, x: torch.Tensor | None, media: dict[str, torch.Tensor] | None, mb: int) -> torch.Tensor:
        """First stage: x is None and media holds each encoder's boundary output; later stages get x."""

    def input_shape(self, mb: int) -> tuple[int, ...]:
        ...

    def loss(self, y: torch.Tensor, mb: int) -> torch.Tensor:
        """Last stage: this rank's share of the step's loss (already divided by the global token count)."""


@dataclass
class StepResult:
    loss: torch.Tensor                    # sum of this rank's loss shares over microbatches (last LLM stage)
    outputs: list[torch.Tensor] = field(default_factory=list)  # last-stage LLM outputs per microbatch


def _neighbour(groups: ModuleGroups, step: int) -> int:
    c, m = groups.coord, groups.layout
    return m.rank_of(c.tp, c.cp, c.dp, c.pp + step)


def _recv(shape, peer, like: torch.Tensor) -> torch.Tensor:
    buf = torch.empty(shape, dtype=like.dtype, device=like.device)
    dist.recv(buf, peer)
    return buf.requires_grad_()


def hetero_step(layout: HeteroLayout, groups: dict[str, ModuleGroups], encoders: dict[str, EncoderStage],
                language: LanguageStage | None, comms: dict[str, BoundaryCommunicator],
                batches: list[dict[str, BoundaryBatch]], like: torch.Tensor,
                on_output: Callable[[torch.Tensor, int], None] | None = None) -> StepResult:
    """Forward and backward of every microbatch on this rank. `batches[mb][key]` is encoder key's
    boundary metadata for microbatch mb (known on every rank); `like` gives dtype and device."""
    rank, keys = dist.get_rank(), sorted(layout.encoders)
    lg = groups[LANGUAGE]
    saved, loss_total = [], torch.zeros((), dtype=torch.float64, device=like.device)

    for mb, meta in enumerate(batches):
        enc_io, outs, detached = {}, {}, {}
        for key in keys:  # encoder pipelines
            g = groups[key]
            if g.is_member:
                x = None if g.first_stage else _recv(encoders[key].input_shape(mb), _neighbour(g, -1), like)
                h = encoders[key].forward(x, mb)
                if not g.last_stage:
                    dist.send(h.contiguous(), _neighbour(g, +1))
                enc_io[key] = (x, h)
        for key in keys:  # boundaries: last encoder stage -> first LLM stage
            src = layout[key]
            if rank in src.ranks or rank in layout[LANGUAGE].ranks:
                g = groups[key]
                outs[key] = comms[key](enc_io[key][1] if g.is_member and g.last_stage else None, meta[key])
        y = x = None
        if lg.is_member:  # LLM pipeline on detached boundary outputs
            if lg.first_stage:
                detached = {k: o.detach().requires_grad_() for k, o in outs.items()}
                y = language.forward(None, detached, mb)
            else:
                x = _recv(language.input_shape(mb), _neighbour(lg, -1), like)
                y = language.forward(x, None, mb)
            if not lg.last_stage:
                dist.send(y.contiguous(), _neighbour(lg, +1))
        saved.append((enc_io, outs, detached, x, y))

    result = StepResult(loss_total)
    for mb, (enc_io, outs, detached, x, y) in enumerate(saved):
        if lg.is_member:
            if lg.last_stage:
                loss = language.loss(y, mb)
                loss.backward()
                result.loss = result.loss + loss.detach().double()
                result.outputs.append(y.detach())
            else:
                grad = torch.empty_like(y)
                dist.recv(grad, _neighbour(lg, +1))
                torch.autograd.backward(y, grad)
            if not lg.first_stage:
                dist.send(x.grad.contiguous(), _neighbour(lg, -1))
        for key in keys:  # boundary backward, then the encoder pipeline backward
            if key in outs:
                if lg.is_member and lg.first_stage:
                    torch.autograd.backward(outs[key], detached[key].grad)
                else:
                    BoundaryCommunicator.backward_from(outs[key])
            g = groups[key]
            if g.is_member:
                x_in, h = enc_io[key]
                if not g.last_stage:
                    grad = torch.empty_like(h)
                    dist.recv(grad, _neighbour(g, +1))
                    torch.autograd.backward(h, grad)
                if not g.first_stage:
                    dist.send(x_in.grad.contiguous(), _neighbour(g, -1))
    return result


def reduce_gradients(modules: dict[str, torch.nn.Module], groups: dict[str, ModuleGroups]) -> None:
    """Sum each module's parameter gradients over its own DP x CP group (losses are pre-normalised by
    the global token count, so a sum is right for every module alike)."""
    for key, module in modules.items():
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=groups[key].pgs.dp_cp)
