"""Checkpoints: what model.checkpoint is, saving and resuming a run, and the loader's resume state.

    source.py        CheckpointSource: RELEASE | EXPORT | WEIGHTS | RUN, decided once from the directory's files;
                     every reader (launch checks, layout resolution, first weights, exports) asks it
    sharded.py       save / load with megatron-core dist_checkpointing, any layout in and out; each parameter's
                     layout-free name (checkpoint_name), atomic publish of `latest`, async writes, retention
    loader_state.py  the data loader's resume state as JSON (never a pickle)

The release's own names and their mapping to ours, per model family, are models/'s: nemotron_h_hf.py (the LLM),
multimodal_hf.py (towers and projectors), released.py (config.json -> our configs). source.py sits as low as
hetero/runspec (it reads files, builds nothing); the rest may import optim, runtime, plan and models.
"""
