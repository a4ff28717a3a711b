"""Exports of a trained model: what transformers, PEFT and the released processors load.

    hf.py         a Tessera checkpoint (any layout) -> Hugging Face layout, one CPU rank
                  (`python -m tessera.hetero.export.hf CHECKPOINT OUT`); the loop calls it at a run's end
    peft.py       LoRA adapters as PEFT's adapter files, named by the release's modules
    processor.py  processor_config.json of the run's media settings, when the towers are the release's

What the export writes (config.json or tessera.json) follows hetero/checkpoint/source.py's kind of the run's
model.checkpoint. May import build, checkpoint, runtime, runspec, plan, data, models.
"""
