"""The training loop and what runs inside it, on every rank, step after step.

    loop.py         train(): the rank's run (hetero/build) -> loader -> steps -> checkpoints, metrics, export
    step_parts.py   what a step runs with: boundary communicators, the rank's stages, the EVS tubelet settle
    stages.py       the single-device models as the step executor's encoder / language stages
    validation.py   the held-out loss through the run's layout
    metrics.py      metrics.jsonl, TensorBoard, the progress bar, loss.png (rank 0); tracking.py: W&B
    preemption.py   a stop signal: finish the step, save it, exit non-zero so the job is requeued

May import everything below it in hetero/ (build, export, checkpoint, optim, runtime, parallel, runspec, plan),
data and models; never the planner or the tools (tests/test_layering.py).
"""
