"""Test helpers: the production process groups (hetero/runtime/groups.py, the trainer's builder), never megatron's
global parallel_state. Multi-rank tests run their body with hetero.tools.spawn.run_on_ranks and build their groups
inside it with `module_pgs`; in-process tests take `single_rank_world()`.
The megatron-core CPU shims themselves live in hetero/runtime/cpu_shims.py."""

from __future__ import annotations

from tessera.hetero.runtime.cpu_shims import apply_cpu_shims


def single_rank_world():
    """A one-process gloo world (file store: no port race) and the trainer's groups of size one."""
    from tessera.hetero.runtime.world import one_rank_world
    from tessera.hetero.build.model_build import single_rank_pgs

    apply_cpu_shims()
    one_rank_world(backend="gloo")
    return single_rank_pgs()


def module_pgs(fields: str, key: str = "language"):
    """This rank's ProcessGroupCollection of module `key` laid out as `fields` (e.g. "tp2,cp2") over the whole
    world, built as the trainer builds it; call on every rank of a run_on_ranks world."""
    import torch.distributed as dist

    from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout
    from tessera.hetero.runtime.groups import build_module_groups

    ranks = f"@0-{dist.get_world_size() - 1}"
    spec = f"{key}={fields}{ranks}" + ("" if key == LANGUAGE else f";{LANGUAGE}=tp1{ranks}")  # encoders feed an LLM
    layout = HeteroLayout.parse(spec)
    return build_module_groups(layout)[key].pgs
