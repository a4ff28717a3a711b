"""Training checkpoints with megatron-core dist_checkpointing (torch_dist): any layout in, any layout out.

    save_checkpoint(root, step, modules, opt, groups, layout, configs, common={"loader": ...})
    common = load_checkpoint(root / "step_000010", modules, opt, groups, layout, configs)

Every rank contributes its shards of every module it hosts under *global* keys: `language.layers.<global
layer index>...`, TP shards as offsets along the parameter's partition dim, replicas (DP, CP, TP copies of
norms) with non-zero replica ids so exactly one rank writes each element. So a checkpoint saved in one
heterogeneous layout loads into another (TP2 -> TP1, PP changes, colocated -> non-colocated): torch_dist
reads whatever slices each rank now needs. Fused Mamba tensors (in_proj = [z|x|B|C|dt], conv1d = [x|B|C])
hold one TP slice of *each* part, so they are stored as one sharded tensor per part.

Mixed precision (hetero/training/optim.py): a bf16 run also stores each trainable parameter's fp32 master
(`optim.master.<key>`) next to its fp32 Adam states, with the parameter's own offsets, pieces and replica ids,
so masters reshard into any layout exactly like the weights; on load the bf16 parameters are re-derived from
the masters, and steps after a resume are bitwise those of an uninterrupted run.

Crash safety: a step is written into `step_N.partial/`, and only after every rank finished does rank 0
rename it to `step_N/` and atomically replace the `latest` file. A crash mid-save leaves a `.partial`
directory that nothing points at; the last complete checkpoint is untouched.
`TESSERA_FAIL_IN_SAVE=N[:RANK]` makes RANK (default 0) exit abruptly in the save of step N, once every shard
is written and before the rename that publishes them (what the fault test uses).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from tessera.hetero.runtime.groups import ModuleGroups
from tessera.hetero.plan.layout import LANGUAGE
from tessera.models.nemotron_h_hf import _mamba_parts

LATEST = "latest"
VOCAB_ROWS = (f"{LANGUAGE}.embedding.weight", f"{LANGUAGE}.output_layer.weight")  # padded to TP


def _mamba_local_parts(config, tp: int) -> list[int]:
    """This TP rank's sizes of the fused [z|x|B|C|dt] parts (the HF converter's split, per rank)."""
    return [s // tp for s in _mamba_parts(config)]


def _pieces(name: str, t: torch.Tensor, mamba_parts: list[int] | None) -> list[tuple[str, torch.Tensor]]:
    """(key suffix, view) pieces of one local tensor: fused Mamba tensors split into their parts."""
    # (a LoRA adapter's B of in_proj has the weight's row layout: hetero/training/lora.py)
    if mamba_parts and (name.endswith("mixer.in_proj.weight") or name.endswith("mixer.in_proj.adapter.lora_B")):
        return [(f".part{i}", v) for i, v in enumerate(t.split(mamba_parts))]
    if mamba_parts and (name.endswith("mixer.conv1d_weight") or name.endswith("mixer.conv1d_bias")):
        return [(f".part{i}", v) for i, v in enumerate(t.split(mamba_parts[1:4]))]
    return [("", t)]


_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def _global_name(key: str, name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """The layout-free key: global layer index (PP) and global expert id (EP: this rank's local expert j is
    expert ep_rank * experts_per_rank + j; at EP1 the key is the local one, so older checkpoints still load)."""
    if key == LANGUAGE and layer_offset:
        name = re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m[1]) + layer_offset}.", name)
    if expert_offset:
        name = _LOCAL_EXPERT.sub(lambda m: f".experts.local_experts.{int(m[1]) + expert_offset}.", name)
    return f"{key}.{name}"


def _expert_offset(key: str, config, g: ModuleGroups) -> int:
    """Global id of this rank's first routed expert (0 without EP)."""
    experts = getattr(config, "num_moe_experts", None) if key == LANGUAGE else None
    return g.pgs.ep.rank() * (experts // g.pgs.ep.size()) if experts else 0


def _param_specs(key: str, module: torch.nn.Module, g: ModuleGroups, mamba_parts, layer_offset: int,
                 expert_offset: int = 0):
    """Per parameter and persistent buffer (MoE expert bias, BatchNorm statistics): (tensor, global key,
    pieces of a same-shaped tensor, rank_offsets, replica_id)."""
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

        def pieces(t, name=name):  # fused Mamba tensors split at every TP size, so keys never change
            return _pieces(name, t, mamba_parts)

        yield p, _global_name(key, name, layer_offset, expert_offset), pieces, offsets, replica


def _sharded_state(modules, opt, groups, configs, rank, world, with_rng=True) -> dict:
    # per trainable parameter: fp32 Adam states and (bf16 run) master, sharded like their parameter
    state, space = {}, (opt.param_space() if opt is not None else {})
    for key, module in modules.items():
        parts = _mamba_local_parts(configs[key], groups[key].pgs.tp.size()) if key == LANGUAGE else None
        extra = {id(p): d for p, d in zip(opt.params[key], space[key])} if key in space else {}
        for p, gkey, pieces, offsets, replica in _param_specs(key, module, groups[key], parts,
                                                              getattr(module, "layer_offset", 0),
                                                              _expert_offset(key, configs.get(key), groups[key])):
            tensors = {"model": p.data, **extra.get(id(p), {})}
            # the vocabulary's padded size depends on TP (models/hybrid_llm.py): as megatron does for its
            # embedding and output layer, a load reads the rows both layouts have and leaves the rest zero
            vocab = key == LANGUAGE and gkey in VOCAB_ROWS
            for prefix, t in tensors.items():
                for suffix, view in pieces(t):
                    k = f"{prefix}.{gkey}{suffix}"
                    state[k] = ShardedTensor.from_rank_offsets(k, view, *offsets, replica_id=replica,
                                                               allow_shape_mismatch=vocab)
    if with_rng:
        state["rng"] = ShardedObject("rng", {"torch": torch.get_rng_state()}, (world,), (rank,), replica_id=0)
    return state


def latest_checkpoint(root: str | Path) -> Path | None:
    """The last complete checkpoint under root (what `latest` names), or None."""
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    path = Path(root) / marker.read_text().strip()
    return path if path.is_dir() else None


def _maybe_fail_in_save(step: int, rank: int) -> None:
    spec = os.environ.get("TESSERA_FAIL_IN_SAVE")
    if spec:
        at, _, who = spec.partition(":")
        if step == int(at) and rank == int(who or 0):
            os._exit(17)  # an abrupt death: shards written, nothing published


def save_checkpoint(root: str | Path, step: int, modules, opt, groups, configs: dict, common: dict) -> Path:
    """Collective over the world. Returns the completed checkpoint directory."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(root)
    final, partial = root / f"step_{step:06d}", root / f"step_{step:06d}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(modules, opt, groups, configs, rank, world)
    state["common"] = dict(common, world=world, step=step)
    dist_checkpointing.save(state, str(partial), sharded_strategy=("torch_dist", 1))
    dist.barrier()
    _maybe_fail_in_save(step, rank)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        tmp = root / (LATEST + ".tmp")
        tmp.write_text(final.name + "\n")
        os.replace(tmp, root / LATEST)  # atomic: readers see the old or the new checkpoint, never half
    dist.barrier()
    return final


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
