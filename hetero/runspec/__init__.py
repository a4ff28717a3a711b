"""A run as its config describes it, resolved once: above the pure plan (hetero/plan) and models/, below
training, the planner and recipes (tests/test_layering.py keeps it there).

    config.py       RunConfig and its parts: the fields recipes set and users override
    modules.py      config -> one ModuleSpec per module (registry name, frozen, lr, tensor-parallel), and the run
                    resolved on a world (hetero/plan/resolved_run.resolve_run)
"""
