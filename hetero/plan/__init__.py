"""Pure descriptions: layouts, boundary plans, the zigzag split, schedules, what can train, a run resolved on a
world. Functions of their arguments, tested over many layouts in milliseconds; nothing here imports torch.distributed,
models or the runtime (tests/test_layering.py), everything else may import it."""
