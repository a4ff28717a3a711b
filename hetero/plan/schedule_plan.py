"""The training step's schedule as data: for every rank, the ordered list of operations it runs.

    schedules = build_schedule(HeteroLayout.parse("vision=dp2@0-1;language=tp2,pp2@2-5"), microbatches=4)
    check_schedule(schedules, layout)     # raises ScheduleError on a deadlock or an unmatched message

Pure function of (layout, number of microbatches): hetero/runtime/step_executor.py executes it on real process
groups, and the at-scale dry run checks it for thousands of ranks without any.

The LLM runs one-forward-one-backward (1F1B) over its PP stages: stage s does min(P - s - 1, M) warm-up
forwards, then alternates forward and backward, then drains the remaining backwards (PipeDream-flush, as
megatron's non-interleaved schedule). Encoders, by placement:

* colocated (an encoder on the LLM's ranks), LLM and every colocated encoder at pp 1 — per microbatch
  (`colocated_per_microbatch`): the encoders' forward and boundary right before the LLM's forward of that
  microbatch, the boundary backward (which runs the encoder backward) right after its backward. One
  microbatch of encoder activations is alive at a time, as in Megatron's homogeneous schedule.
* colocated, otherwise — the three-phase step: (1) every microbatch's encoder forward and boundary, (2) the
  LLM's 1F1B on the boundary outputs, (3) every microbatch's boundary backward. An encoder pipeline fills
  once and the LLM's stages need no encoder work inside their 1F1B, but every microbatch's encoder
  activations stay alive across phase 2, as in Megatron's MIMO schedule.
* non-colocated (disjoint ranks) — one pipeline across modules: the encoder ranks follow the event order
  of the LLM's first stage (its forwards and backwards by microbatch), so an encoder's microbatch m+1
  forward runs while the LLM works on microbatch m; stages = longest path of PP depths.

Communication semantics (what `check_schedule` assumes and the executor implements): pipeline sends are
non-blocking (isend; the executor waits on them at the end of the step), receives block until the matching
send was issued, messages on one (src, dst) channel arrive in order. A boundary op is a rendezvous of its
participants (the encoder's last-stage ranks and the LLM's first-stage ranks).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout


@dataclass(frozen=True)
class Op:
    """kind: fwd | bwd (compute), send | recv (pipeline p2p of `what` = act | grad), boundary_fwd |
    boundary_bwd (module is the encoder key). peer is the other rank of a send/recv."""

    kind: str
    module: str
    mb: int
    peer: int = -1
    what: str = ""

    def __str__(self) -> str:
        p = f" {self.what}{'->' if self.kind == 'send' else '<-'}{self.peer}" if self.peer >= 0 else ""
        return f"{self.kind}({self.module},mb{self.mb}{p})"


class ScheduleError(RuntimeError):
    """A schedule that would deadlock or leave a message unmatched; the message says where."""


def one_f_one_b(stages: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """[("F", mb) | ("B", mb)] of one pipeline stage, PipeDream-flush order."""
    warmup = min(stages - stage - 1, microbatches)
    events = [("F", m) for m in range(warmup)]
    for i in range(microbatches - warmup):
        events += [("F", warmup + i), ("B", i)]
    return events + [("B", m) for m in range(microbatches - warmup, microbatches)]


def boundary_participants(layout: HeteroLayout, key: str) -> set[int]:
    """Ranks that take part in encoder `key`'s boundary: its last PP stage and the LLM's first."""
    src, dst = layout[key], layout[LANGUAGE]
    last = {r for r in src.ranks if src.coord(r).pp == src.pp - 1}
    return last | {r for r in dst.ranks if dst.coord(r).pp == 0}


def _stage_ops(layout: HeteroLayout, key: str, rank: int, event: tuple[str, int],
               boundary: list[str]) -> list[Op]:
    """One F or B event of module `key` on `rank`: receive, compute, send; `boundary` lists the encoder
    boundaries this event carries (before an LLM first-stage forward, after its backward)."""
    m = layout[key]
    c, (kind, mb) = m.coord(rank), event
    prev = m.rank_of(c.tp, c.cp, c.dp, c.pp - 1) if c.pp > 0 else -1
    nxt = m.rank_of(c.tp, c.cp, c.dp, c.pp + 1) if c.pp < m.pp - 1 else -1
    is_encoder_last = key != LANGUAGE and nxt < 0
    # an earlier stage of a colocated encoder on an LLM first-stage rank: the rank receives (and sends back the
    # gradient of) its LLM rows of that encoder's boundary, right after handing its activation on (before
    # taking its gradient back), in the order the encoder's last stage runs the boundary
    lang = layout[LANGUAGE]
    joins_boundary = (key != LANGUAGE and nxt >= 0 and layout.colocated(key, LANGUAGE) and rank in lang.ranks
                      and lang.coord(rank).pp == 0)
    ops: list[Op] = []
    if kind == "F":
        ops += [Op("boundary_fwd", k, mb) for k in boundary]
        if prev >= 0:
            ops.append(Op("recv", key, mb, prev, "act"))
        ops.append(Op("fwd", key, mb))
        if nxt >= 0:
            ops.append(Op("send", key, mb, nxt, "act"))
            ops += [Op("boundary_fwd", key, mb)] if joins_boundary else []
        elif is_encoder_last:
            ops.append(Op("boundary_fwd", key, mb))
    else:
        if nxt >= 0:
            ops += [Op("boundary_bwd", key, mb)] if joins_boundary else []
            ops += [Op("recv", key, mb, nxt, "grad"), Op("bwd", key, mb)]
        elif is_encoder_last:
            ops.append(Op("boundary_bwd", key, mb))  # runs this stage's backward through autograd
        else:
            ops.append(Op("bwd", key, mb))  # LLM last stage: the loss backward
        if prev >= 0:
            ops.append(Op("send", key, mb, prev, "grad"))
        ops += [Op("boundary_bwd", k, mb) for k in boundary]
    return ops


def colocated_per_microbatch(layout: HeteroLayout) -> bool:
    """Whether the colocated encoders run inside the LLM's microbatch loop (one microbatch of their
    activations alive) rather than in three phases: when the LLM and every colocated encoder have pp 1, so
    every rank runs each microbatch end to end and nothing is gained by running the encoders ahead."""
    return layout[LANGUAGE].pp == 1 and all(layout[k].pp == 1 for k in layout.encoders
                                            if layout.colocated(k, LANGUAGE))


def rank_schedule(layout: HeteroLayout, rank: int, microbatches: int) -> list[Op]:
    """The ordered operations of one rank for one step of `microbatches` microbatches."""
    lang = layout[LANGUAGE]
    colocated = [k for k in sorted(layout.encoders) if layout.colocated(k, LANGUAGE)]
    remote = [k for k in sorted(layout.encoders) if not layout.colocated(k, LANGUAGE)]
    first_stage_order = one_f_one_b(lang.pp, 0, microbatches)
    inline = colocated_per_microbatch(layout)
    phased = [] if inline else colocated
    ops: list[Op] = []
    # phase 1: colocated encoders' forwards and boundaries for every microbatch
    if rank in lang.ranks:
        for mb in range(microbatches):
            for k in phased:
                ops += _stage_ops(layout, k, rank, ("F", mb), [])
    # phase 2: the LLM's 1F1B (per microbatch: colocated encoders' forward before, backward after);
    # remote encoders follow its first stage's event order
    if rank in lang.ranks:
        first = lang.coord(rank).pp == 0
        for event in one_f_one_b(lang.pp, lang.coord(rank).pp, microbatches):
            around = [] if not inline else [op for k in colocated for op in _stage_ops(layout, k, rank, event, [])]
            llm = _stage_ops(layout, LANGUAGE, rank, event, remote if first else [])
            ops += around + llm if event[0] == "F" else llm + around
    mine = [k for k in remote if rank in layout[k].ranks]  # several encoders may share disjoint ranks
    for event in first_stage_order if mine else []:
        for k in mine:
            ops += _stage_ops(layout, k, rank, event, [])
    # phase 3: colocated encoders' boundary backward (and with it the encoder backward)
    if rank in lang.ranks:
        for mb in range(microbatches):
            for k in phased:
                ops += _stage_ops(layout, k, rank, ("B", mb), [])
    return ops


def build_schedule(layout: HeteroLayout, microbatches: int, ranks=None) -> dict[int, list[Op]]:
    """rank -> ordered ops, for every rank of the layout (or just `ranks`)."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    ranks = range(layout.world_size) if ranks is None else ranks
    return {r: rank_schedule(layout, r, microbatches) for r in ranks}


def check_schedule(schedules: dict[int, list[Op]], layout: HeteroLayout) -> int:
    """Simulate every rank's ops with the executor's semantics; returns the number of ops run.

    Raises ScheduleError when no rank can progress (deadlock: names the blocked ops), when a receive
    meets a message for a different microbatch or tensor (out of order), or when a message is left
    unreceived at the end."""
    participants = {k: boundary_participants(layout, k) for k in layout.encoders}
    pc = {r: 0 for r in schedules}
    channels: dict[tuple[int, int], deque] = defaultdict(deque)
    # participants standing at each pending boundary op: counted as they arrive, so a rendezvous costs its
    # group size once, not once per arrival (that made the check quadratic in the world size)
    arrived: dict[Op, set[int]] = defaultdict(set)
    ran = 0
    while True:
        progressed = False
        for r, ops in schedules.items():
            while pc[r] < len(ops):
                op = ops[pc[r]]
                if op.kind == "send":
                    channels[(r, op.peer)].append((op.module, op.mb, op.what))
                elif op.kind == "recv":
                    queue = channels[(op.peer, r)]
                    if not queue:
                        break
                    got = queue.popleft()
                    if got != (op.module, op.mb, op.what):
                        raise ScheduleError(f"rank {r} {op} received {got} from {op.peer}: out of order")
                elif op.kind.startswith("boundary"):
                    group = participants[op.module]
                    if r not in group:
                        raise ScheduleError(f"rank {r} runs {op} but is not one of its participants")
                    here = arrived[op]
                    here.add(r)
                    if len(here) < len(group):
                        break
                    del arrived[op]
                    for q in group:  # the rendezvous completes for all participants at once
                        if q != r:
                            pc[q] += 1
                            ran += 1
                pc[r] += 1
                ran += 1
                progressed = True
        if all(pc[r] == len(ops) for r, ops in schedules.items()):
            break
        if not progressed:
            blocked = [f"rank {r}: {schedules[r][pc[r]]}" for r in schedules if pc[r] < len(schedules[r])]
            raise ScheduleError("deadlock; blocked: " + "; ".join(blocked[:8]) +
                                (f" (+{len(blocked) - 8} more)" if len(blocked) > 8 else ""))
    left = {ch: list(q) for ch, q in channels.items() if q}
    if left:
        raise ScheduleError(f"messages never received: {dict(list(left.items())[:4])}")
    return ran
