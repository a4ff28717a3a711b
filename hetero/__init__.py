"""Heterogeneous parallelism: layouts, process groups, boundary communicators, schedules, training, planner."""

from tessera.hetero.runtime.cpu_shims import turn_megatron_jit_off_at_its_import
from tessera.hetero.runtime.quiet import quiet_third_party_notices

turn_megatron_jit_off_at_its_import()  # before any megatron import of this process (cpu_shims.py, shim 6)
quiet_third_party_notices()  # before NeMo's and megatron's imports print what a user cannot act on (quiet.py)
