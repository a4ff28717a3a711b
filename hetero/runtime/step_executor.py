"""Executes one training step's schedule (hetero/plan/schedule_plan.py) on this rank's process groups.

The plan says what each rank runs and in which order (colocated three-phase step, non-colocated
cross-module pipeline, LLM 1F1B); this module only carries tensors between the ops:

    result = hetero_step(layout, groups, encoders, language, comms, batches, like)
    ModuleOptimizers.step()                  # (hetero/optim/optimizers.py: gradients reduced, then stepped)

Module stages are supplied by the caller (models stay single-device code): an encoder stage maps its
input (or its own microbatch data on the first stage) to activations, the LLM's first stage takes each
encoder's boundary output, its last stage returns a loss already divided by the global token count.
Pipeline sends are isend (waited on at the end of the step), receives block; a boundary call is a
rendezvous of the ranks named by `schedule_plan.boundary_participants` — the semantics `check_schedule`
proves deadlock-free. A boundary forward posts its messages and returns (BoundaryCommunicator(defer=True)): the
rank goes on computing (the next microbatch's encoder) while they move, and waits only where the output is read
(the LLM's first stage), before the boundary's backward, and at the end of the step. Every op is still issued in
the schedule's order, and a wait only moves later, so the proof holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from tessera.hetero.runtime.boundary import BoundaryCommunicator
from tessera.hetero.plan.boundary_plan import BoundaryBatch
from tessera.hetero.runtime.groups import ModuleGroups
from tessera.hetero.runtime.progress import mark
from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout
from tessera.hetero.plan.schedule_plan import rank_schedule

# False: every boundary forward waits for its messages inside the op (what scripts/bench_train.py --overlap
# compares the deferred wait against); the trainer always defers
DEFER_BOUNDARY_WAIT = True
# each op's phase in this rank's published position (hetero/runtime/progress.py: a hang names where a rank stopped)
_PHASE = {"fwd": "forward", "bwd": "backward", "boundary_fwd": "boundary", "boundary_bwd": "boundary",
          "send": "pipeline", "recv": "pipeline"}


class EncoderStage(Protocol):
    def forward(self, x: torch.Tensor | None, mb: int) -> torch.Tensor:
        """This rank's stage for microbatch mb; x is None on the first stage (it reads its own input)."""

    def input_shape(self, mb: int) -> tuple[int, ...]:
        """Shape of the activation a non-first stage receives for microbatch mb."""


class PlacedMedia(NamedTuple):
    """An encoder's boundary output on an LLM first-stage rank: values [samples, seq/cp, hidden] and where they
    go (bool [samples, seq/cp]: the rows the boundary plan wrote; elsewhere the text embedding stays)."""
    values: torch.Tensor
    mask: torch.Tensor


class LanguageStage(Protocol):
    def forward(self, x: torch.Tensor | None, media: dict[str, PlacedMedia] | None, mb: int) -> torch.Tensor:
        """First stage: x is None and media holds each encoder's placed boundary output; later stages get x."""

    def input_shape(self, mb: int) -> tuple[int, ...]:
        ...

    def loss(self, y: torch.Tensor, mb: int) -> torch.Tensor:
        """Last stage: this rank's share of the step's loss (already divided by the global token count)."""


@dataclass
class StepResult:
    loss: torch.Tensor                    # sum of this rank's loss shares over microbatches (last LLM stage)
    outputs: list[torch.Tensor] = field(default_factory=list)  # last-stage LLM outputs per microbatch


class _StepState:
    """Tensors of one step, keyed by (module, microbatch); entries are dropped once their backward ran."""

    def __init__(self):
        self.inputs, self.outputs, self.grads = {}, {}, {}
        self.boundary, self.detached, self.written = {}, {}, {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []


def hetero_step(layout: HeteroLayout, groups: dict[str, ModuleGroups], encoders: dict[str, EncoderStage],
                language: LanguageStage | None, comms: dict[str, BoundaryCommunicator],
                batches: list[dict[str, BoundaryBatch]], like: torch.Tensor, forward_only: bool = False) -> StepResult:
    """Forward and backward of every microbatch on this rank. `batches[mb][key]` is encoder key's
    boundary metadata for microbatch mb (known on every rank), or a function of this rank's stage of the key
    (None where it has none) that returns it, called inside the boundary op; `like` gives dtype and device.
    forward_only (validation; call it under torch.no_grad()): the same schedule without its backward ops
    (backward, gradient sends and receives, the boundary's backward). Every rank drops the same ops, so what
    remains is each rank's forward ops in the same order, and dropping ops only removes waits: no new deadlock."""
    rank = dist.get_rank()
    lg = groups[LANGUAGE]
    st, result = _StepState(), StepResult(torch.zeros((), dtype=torch.float64, device=like.device))

    def stage(key):
        return language if key == LANGUAGE else encoders[key]

    for op in rank_schedule(layout, rank, len(batches)):
        key, mb, slot = op.module, op.mb, (op.module, op.mb)
        if forward_only and (op.kind in ("bwd", "boundary_bwd") or op.kind in ("send", "recv") and op.what != "act"):
            continue
        mark(_PHASE[op.kind], key)
        if op.kind == "recv" and op.what == "act":
            buf = torch.empty(stage(key).input_shape(mb), dtype=like.dtype, device=like.device)
            dist.recv(buf, op.peer)
            st.inputs[slot] = buf.requires_grad_()
        elif op.kind == "recv":
            buf = torch.empty_like(st.outputs[slot])
            dist.recv(buf, op.peer)
            st.grads[slot] = buf
        elif op.kind == "send":
            t = ((st.outputs.pop(slot) if forward_only else st.outputs[slot]) if op.what == "act"
                 else st.inputs.pop(slot).grad).detach().contiguous()
            st.sends.append((dist.isend(t, op.peer), t))
        elif op.kind == "fwd" and key != LANGUAGE:
            x = st.inputs.pop(slot, None) if forward_only else st.inputs.get(slot)  # kept for backward only
            st.outputs[slot] = encoders[key].forward(x, mb)
        elif op.kind == "fwd":
            if lg.first_stage:  # the LLM runs on detached boundary outputs: their grads meet the encoder later
                for k in sorted(layout.encoders):
                    comms[k].finish()  # its deferred exchanges: the outputs are read now
                take = st.boundary.pop if forward_only else st.boundary.__getitem__
                media = {k: take((k, mb)).detach().requires_grad_() for k in sorted(layout.encoders)}
                st.detached.update({(k, mb): t for k, t in media.items()})
                y = language.forward(None, {k: PlacedMedia(t, st.written.pop((k, mb))) for k, t in media.items()}, mb)
            else:
                y = language.forward(st.inputs.pop(slot) if forward_only else st.inputs[slot], None, mb)
            if lg.last_stage:
                result.outputs.append(y.detach())
                y = language.loss(y, mb)
                result.loss = result.loss + y.detach().double()
            st.outputs[slot] = y
        elif op.kind == "bwd":
            y = st.outputs.pop(slot)
            grad = st.grads.pop(slot, None)
            if y.requires_grad:
                torch.autograd.backward(y, grad)
        elif op.kind == "boundary_fwd":
            g = groups[key]
            x = st.outputs.pop(slot, None) if g.is_member and g.last_stage else None
            if x is not None and not x.requires_grad:  # frozen module: keep the exchange in the graph
                x = x.detach().requires_grad_()
            batch = batches[mb][key]
            if callable(batch):  # a layout settled at the boundary (EVS tubelet chunks: runtime/tubelet_settle.py)
                batch = batch(encoders.get(key))
            st.boundary[slot] = comms[key](x, batch, defer=DEFER_BOUNDARY_WAIT)
            if lg.is_member and lg.first_stage:
                st.written[slot] = comms[key].written(batch)
        elif op.kind == "boundary_bwd":
            comms[key].finish()
            out = st.boundary.pop(slot)
            if lg.is_member and lg.first_stage:
                d = st.detached.pop(slot)
                torch.autograd.backward(out, d.grad if d.grad is not None else torch.zeros_like(d))
            else:
                BoundaryCommunicator.backward_from(out)
        else:
            raise AssertionError(f"unknown op {op}")
    mark("pipeline")
    for work, _ in st.sends:
        work.wait()
    for k in sorted(comms):
        comms[k].finish()
    return result
