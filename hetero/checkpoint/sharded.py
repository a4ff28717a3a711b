"""Training checkpoints with megatron-core dist_checkpointing (torch_dist): any layout in, any layout out.

    save_checkpoint(root, step, modules, opt, groups, configs, common={"loader": ...}, keep=KeepPolicy(3), queue=None)
    common = load_checkpoint(root / "step_000010", modules, opt, groups, configs)

Every rank contributes its shards of every module it hosts under *global* keys: `language.layers.<global
layer index>...`, TP shards as offsets along the parameter's partition dim, replicas (DP, CP, TP copies of
norms) with non-zero replica ids so exactly one rank writes each element. So a checkpoint saved in one
heterogeneous layout loads into another (TP2 -> TP1, PP changes, colocated -> non-colocated): torch_dist
reads whatever slices each rank now needs. Fused Mamba tensors (in_proj = [z|x|B|C|dt], conv1d = [x|B|C])
hold one TP slice of *each* part, so they are stored as one sharded tensor per part.

Mixed precision (hetero/optim/optimizers.py): a bf16 run also stores each trainable parameter's fp32 master
(`optim.master.<key>`) next to its fp32 Adam states, with the parameter's own offsets, pieces and replica ids,
so masters reshard into any layout exactly like the weights; on load the bf16 parameters are re-derived from
the masters, and steps after a resume are bitwise those of an uninterrupted run.

ZeRO-1 (hetero/optim/zero.py): a rank's optimizer state is a contiguous slice of each parameter's elements,
written as the rectangles that tile it (hetero/plan/flat_boxes.py; uneven sharding, which torch_dist stores as
DCP chunks) - views of the live shards, never gathered - under the same keys and global shapes as the replicated
optimizer's, so a load in any layout, DP size or optimizer reads the elements it needs, into its own views.

Crash safety: a step is written into `step_N.partial/`, and only after every rank finished does rank 0
rename it to `step_N/`, atomically replace the `latest` file and delete what the KeepPolicy lets go
(hetero/plan/retention.py). A crash mid-save leaves a `.partial` directory that nothing points at; the last
complete checkpoint is untouched; a failed write (a full disk) raises SaveFailed on every rank, naming the fix.
Async (`queue`): the same, with the shards written by a forked helper while training goes on and the publish
run when every rank's helper is done (finish_async_saves, called by the loop after every step).
`TESSERA_FAIL_IN_SAVE=N[:RANK]` makes RANK (default 0) exit abruptly in the save of step N, once every shard
is written and before the rename that publishes them (what the fault test uses).
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException

from tessera.hetero.runtime.groups import ModuleGroups
from tessera.hetero.plan.flat_boxes import flat_boxes
from tessera.hetero.plan.layout import LANGUAGE
from tessera.hetero.plan.retention import KeepPolicy
from tessera.hetero.checkpoint.source import LATEST, latest_checkpoint  # noqa: F401  (its readers import it here too)
from tessera.hetero.optim.zero import FlatSlice
from tessera.models.nemotron_h_hf import mamba_parts

VOCAB_ROWS = (f"{LANGUAGE}.embedding.weight", f"{LANGUAGE}.output_layer.weight")  # padded to TP


def _mamba_local_parts(config, tp: int) -> list[int]:
    """This TP rank's sizes of the fused [z|x|B|C|dt] parts (the HF converter's split, per rank)."""
    return [s // tp for s in mamba_parts(config)]


def _piece_rows(name: str, rows: int, mamba_parts: list[int] | None) -> list[tuple[str, int, int]]:
    """(key suffix, first row, last row + 1) of each stored piece of a local tensor with `rows` rows along
    dim 0: fused Mamba tensors split into their parts, anything else one piece."""
    sizes = None
    # (a LoRA adapter's B of in_proj has the weight's row layout: hetero/build/lora.py)
    if mamba_parts and (name.endswith("mixer.in_proj.weight") or name.endswith("mixer.in_proj.adapter.lora_B")):
        sizes = mamba_parts
    elif mamba_parts and (name.endswith("mixer.conv1d_weight") or name.endswith("mixer.conv1d_bias")):
        sizes = mamba_parts[1:4]
    if sizes is None:
        return [("", 0, rows)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(f".part{i}", a, a + n) for i, (a, n) in enumerate(zip(starts, sizes))]


_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def checkpoint_name(key: str, name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """The layout-free key: global layer index (PP) and global expert id (EP: this rank's local expert j is
    expert ep_rank * experts_per_rank + j; at EP1 the key is the local one, so older checkpoints still load)."""
    if key == LANGUAGE and layer_offset:
        name = re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m[1]) + layer_offset}.", name)
    if expert_offset:
        name = _LOCAL_EXPERT.sub(lambda m: f".experts.local_experts.{int(m[1]) + expert_offset}.", name)
    return f"{key}.{name}"


def expert_id_offset(key: str, config, g: ModuleGroups) -> int:
    """Global id of this rank's first routed expert (0 without EP)."""
    experts = getattr(config, "num_moe_experts", None) if key == LANGUAGE else None
    return g.pgs.ep.rank() * (experts // g.pgs.ep.size()) if experts else 0


def _param_specs(key: str, module: torch.nn.Module, g: ModuleGroups, mamba_parts, layer_offset: int,
                 expert_offset: int = 0):
    """Per parameter and persistent buffer (MoE expert bias, BatchNorm statistics): (tensor, global key,
    its pieces as (suffix, first row, end row), its TP rank offsets, replica_id)."""
    tp, tp_rank = g.pgs.tp.size(), g.pgs.tp.rank()
    seen = set()
    for name, p in module.state_dict(keep_vars=True).items():
        if not isinstance(p, torch.Tensor) or name.endswith("_extra_state") or id(p) in seen:
            continue  # (a tensor shared by two submodules, e.g. the video path's image encoder, once)
        seen.add(id(p))
        sharded = bool(getattr(p, "tensor_model_parallel", False)) and tp > 1
        offsets = ((getattr(p, "partition_dim", 0), tp_rank, tp),) if sharded else ()
        # replicas: dense tensors over DP x CP, routed experts (distinct per EP rank) over expert-DP
        rep = (g.pgs.expt_dp if _LOCAL_EXPERT.search("." + name) else g.pgs.dp_cp).rank()
        replica = (0, rep) if sharded else (tp_rank, rep)  # exactly one writer per element
        # fused Mamba tensors split at every TP size, so keys never change
        rows = _piece_rows(name, p.shape[0] if p.dim() else 1, mamba_parts)
        yield p, checkpoint_name(key, name, layer_offset, expert_offset), rows, offsets, replica


def parameter_counts(modules: dict, groups: dict, configs: dict, device=None) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model, each element counted once over every layout (the owners
    a checkpoint writes: replica (0, 0) of _param_specs); collective over the world. device: the rank's (NCCL
    reduces device tensors only)."""
    counts = torch.zeros(2, dtype=torch.float64)
    for key, module in modules.items():
        config = configs.get(key)
        for p, gkey, _, _, replica in _param_specs(key, module, groups[key], None, getattr(module, "layer_offset", 0),
                                                   expert_id_offset(key, config, groups[key])):
            if isinstance(p, torch.nn.Parameter) and replica == (0, 0):
                n = p.numel()
                if key == LANGUAGE and gkey in VOCAB_ROWS:  # the true vocabulary's rows, not TP's padding
                    n = n * config.vocab_size / config.padded_vocab_size
                counts += torch.tensor([n if p.requires_grad else 0, n], dtype=torch.float64)
    counts = counts.to(device or "cpu")
    dist.all_reduce(counts)
    return round(float(counts[0])), round(float(counts[1]))


def _flat_slice_tensors(k: str, fs: FlatSlice, shape: torch.Size, rows: tuple[int, int], offsets, replica,
                        vocab: bool) -> list[ShardedTensor]:
    """A ZeRO-1 rank's range of one piece of a parameter as rectangles with global offsets (uneven sharding:
    axis_fragmentations=None, which torch_dist stores as DCP chunks), each a view of the live shard. The
    owner of an element in its reduction group is unique, so only TP replicas of an unsharded tensor repeat."""
    r0, r1 = rows
    row = math.prod(shape[1:])
    lo, hi = max(fs.start, r0 * row), min(fs.start + fs.data.numel(), r1 * row)
    if lo >= hi:
        return []
    local = (r1 - r0,) + tuple(shape[1:])
    glob, base = list(local), [0] * len(local)
    for axis, tp_rank, tp in offsets:
        glob[axis], base[axis] = local[axis] * tp, local[axis] * tp_rank
    out = []
    for box_off, box_shape, first in flat_boxes(local, lo - r0 * row, hi - r0 * row):
        at = first + r0 * row - fs.start
        data = fs.data[at:at + math.prod(box_shape)].view(box_shape)
        out.append(ShardedTensor(k, data, data.dtype, box_shape, tuple(glob),
                                 tuple(b + o for b, o in zip(base, box_off)), None,
                                 (replica[0], 0), allow_shape_mismatch=vocab))
    return out


def _sharded_state(modules, opt, groups, configs, rank, world, with_rng=True) -> dict:
    # per trainable parameter: fp32 Adam states and (bf16 run) master, sharded like their parameter
    state, space = {}, (opt.param_space() if opt is not None else {})
    for key, module in modules.items():
        parts = (_mamba_local_parts(configs[key], groups[key].pgs.tp.size())
                 if key == LANGUAGE and configs.get(key) is not None else None)
        extra = {id(p): d for p, d in zip(opt.params[key], space[key])} if key in space else {}
        for p, gkey, rows, offsets, replica in _param_specs(key, module, groups[key], parts,
                                                            getattr(module, "layer_offset", 0),
                                                            expert_id_offset(key, configs.get(key), groups[key])):
            tensors = {"model": p.data, **extra.get(id(p), {})}
            # the vocabulary's padded size depends on TP (models/hybrid_llm.py): as megatron does for its
            # embedding and output layer, a load reads the rows both layouts have and leaves the rest zero
            vocab = key == LANGUAGE and gkey in VOCAB_ROWS
            for prefix, t in tensors.items():
                for suffix, r0, r1 in rows:
                    k = f"{prefix}.{gkey}{suffix}"
                    if isinstance(t, FlatSlice):  # ZeRO-1: this rank's range only, never gathered
                        for i, sh in enumerate(_flat_slice_tensors(k, t, p.shape, (r0, r1), offsets, replica, vocab)):
                            state[f"{k}#{i}"] = sh
                        continue
                    view = t if len(rows) == 1 else t[r0:r1]
                    state[k] = ShardedTensor.from_rank_offsets(k, view, *offsets, replica_id=replica,
                                                               allow_shape_mismatch=vocab)
    if with_rng:
        state["rng"] = ShardedObject("rng", {"torch": torch.get_rng_state()}, (world,), (rank,), replica_id=0)
    return state


def _maybe_fail_in_save(step: int, rank: int) -> None:
    spec = os.environ.get("TESSERA_FAIL_IN_SAVE")
    if spec:
        at, _, who = spec.partition(":")
        if step == int(at) and rank == int(who or 0):
            os._exit(17)  # an abrupt death: shards written, nothing published


_STEP_DIR = re.compile(r"^step_(\d+)(\.partial)?$")


def _prune(root: Path, published: int, keep: KeepPolicy) -> list[str]:
    """Rank 0, right after publishing step `published`: delete what `keep` lets go, and `.partial` directories of
    older steps (saves that died). A save in flight is always newer (a new save waits for the last), so its
    `.partial` is never touched."""
    found = {}
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir():
            found[d.name] = (int(m[1]), bool(m[2]))
    doomed = [f"step_{s:06d}" for s in keep.to_delete([s for s, p in found.values() if not p], published)]
    doomed += [name for name, (s, partial) in found.items() if partial and s < published]
    for name in doomed:
        shutil.rmtree(root / name, ignore_errors=True)
    return doomed


def _publish(root: Path, step: int, keep: KeepPolicy) -> None:
    """Collective, once every rank's shards of `step` are written: rank 0 renames step_N.partial to step_N,
    points `latest` at it (atomically) and prunes."""
    rank = dist.get_rank()
    dist.barrier()
    _maybe_fail_in_save(step, rank)
    if rank == 0:
        final, partial = root / f"step_{step:06d}", root / f"step_{step:06d}.partial"
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        tmp = root / (LATEST + ".tmp")
        tmp.write_text(final.name + "\n")
        os.replace(tmp, root / LATEST)  # atomic: readers see the old or the new checkpoint, never half
        _prune(root, step, keep)
    dist.barrier()


class SaveFailed(RuntimeError):
    """A checkpoint write failed on some rank; nothing of it was published."""


def _save_failed(root: Path, what: str, err: BaseException, needed: int = 0) -> SaveFailed:
    """The error every rank raises: which save, why, what is intact, the fix. Rank 0 removes the unpublished
    `.partial` directories (a full disk gets its room back for the relaunch). A full file system is told by its
    free space (less than this rank had to write): torch's writer reports ENOSPC as a bare "unexpected pos"."""
    free = shutil.disk_usage(root).free if root.exists() else 0
    nospace = free < max(needed, 1 << 20) or "No space left on device" in str(err)
    fix = ("the file system is full: free space there, or set trainer.keep_last=N to keep only the newest N "
           "checkpoints" if nospace else "the error above says why")
    last = latest_checkpoint(root)
    if dist.get_rank() == 0:
        for d in root.glob("step_*.partial"):
            shutil.rmtree(d, ignore_errors=True)
    return SaveFailed(f"saving {what} under {root} failed ({type(err).__name__}: {str(err)[:500]}); {fix}. "
                      f"The last complete checkpoint, {last.name if last else 'none yet'}, is intact and `latest` "
                      f"names it: a relaunch resumes from there")


def save_checkpoint(root: str | Path, step: int, modules, opt, groups, configs: dict, common: dict,
                    keep: KeepPolicy = KeepPolicy(), queue=None) -> Path:
    """Collective over the world: write `step` into step_N.partial/, then publish it (_publish).

    queue: a dist_checkpointing AsyncCallsQueue to save asynchronously: the shards are written by a forked
    helper (a copy-on-write snapshot of this step) while training goes on, and the publish runs when every
    rank's helper has finished (queue.maybe_finalize_async_calls, called by the loop each step). The caller
    first waits for the previous save (one save in flight at a time). Returns the directory the step is (or
    will be) published as. A failed write raises SaveFailed naming the fix; nothing is published then."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(root)
    final, partial = root / f"step_{step:06d}", root / f"step_{step:06d}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(modules, opt, groups, configs, rank, world)
    state["common"] = dict(common, world=world, step=step)
    needed = sum(t.data.numel() * t.data.element_size() for t in state.values() if isinstance(t, ShardedTensor))
    try:
        request = dist_checkpointing.save(state, str(partial), sharded_strategy=("torch_dist", 1),
                                          async_sharded_save=queue is not None)
    except (Exception, CheckpointException) as e:  # (a BaseException) every write error: which step, the fix
        raise _save_failed(root, f"checkpoint step {step}", e, needed) from e
    if queue is None:
        _publish(root, step, keep)
    else:
        request.add_finalize_fn(lambda: _publish(root, step, keep))
        queue.schedule_async_request(request)
    return final


def finish_async_saves(queue, root: str | Path, blocking: bool) -> None:
    """Publish the async saves whose writes finished on every rank (all of them, waiting, when `blocking`).
    Collective; a failed write raises SaveFailed (nothing of it is published)."""
    if queue is None or not queue.get_num_unfinalized_calls():
        return
    try:
        queue.maybe_finalize_async_calls(blocking=blocking)
    except (Exception, CheckpointException) as e:
        raise _save_failed(Path(root), "an asynchronous checkpoint", e) from e


def load_checkpoint(path: str | Path, modules, opt, groups, configs: dict) -> dict:
    """Load into this rank's modules (and optimizer) whatever layout they have; returns the common state.
    RNG states come back only when the world size is unchanged (they are per rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    state = _sharded_state(modules, opt, groups, configs, rank, world, with_rng=common["world"] == world)
    targets = {k: v.data for k, v in state.items() if isinstance(v, ShardedTensor)}
    loaded = dist_checkpointing.load(state, str(path), sharded_strategy=None)
    with torch.no_grad():
        for k, view in targets.items():
            if loaded[k] is not view:
                view.copy_(loaded[k])
    if "rng" in loaded:
        torch.set_rng_state(loaded["rng"]["torch"])
    if opt is not None:
        opt.load_param_space(common["step"])  # ZeRO-1 shards, Adam step counts, bf16 params from the masters
    return common
