"""One rank's run, constructed: what the loop (hetero/training) and the exports read, built once.

    run_state.py    build_run(): inputs -> process groups -> modules -> first weights -> LoRA -> optimizers -> resume
    model_build.py  this rank's modules in its layout, loaded from one full-model state (a release, a seed)
    seeded_init.py  first weights from a seed, one unit at a time, the same in every layout
    lora.py         LoRA adapters on the built modules, and their merge for an export

Where the first weights come from is hetero/checkpoint/source.py's decision; saving and resuming are
hetero/checkpoint/sharded.py's. May import optim, checkpoint, runtime, parallel, runspec, plan, data, models.
"""
