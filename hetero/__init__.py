"""Heterogeneous parallelism: layouts, process groups, boundary communicators, schedules, training, planner."""

from tessera.hetero.runtime.cpu_shims import turn_megatron_jit_off_at_its_import

turn_megatron_jit_off_at_its_import()  # before any megatron import of this process (cpu_shims.py, shim 6)
