"""Experiment tracking: Weights & Biases, on rank 0, next to metrics.jsonl and TensorBoard (metrics.py).

    trainer.wandb_project=PROJECT [trainer.wandb_mode=offline|online] [trainer.wandb_entity=TEAM]

The W&B run's id comes from the run directory, so a resumed or requeued run (same run_dir) continues the same
W&B run instead of starting a new one. It gets the run's whole config, every step's metrics, each validation
pass's val/<name>/loss and loss.png at the end. Offline (no network on most training nodes) it writes
run_dir/wandb/offline-run-*/run-<id>.wandb, which `wandb sync DIR` uploads later. mode None follows
WANDB_MODE (wandb's own default: online, which needs `wandb login`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def wandb_run_id(run_dir: str | Path) -> str:
    """A stable id per run directory: a resumed run logs into the same W&B run."""
    return "tessera-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


class WandbTracker:
    def __init__(self, project: str, run_dir: Path, name: str, config: dict, mode: str | None = None,
                 entity: str | None = None):
        import wandb

        try:
            self.run = wandb.init(project=project, entity=entity, name=name, dir=str(run_dir), config=config,
                                  id=wandb_run_id(run_dir), resume="allow", mode=mode,
                                  settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # no login, no network: name the fix before any step is lost
            raise RuntimeError(f"trainer.wandb_project={project}: W&B could not start ({e}); run `wandb login`, "
                               f"or log offline with trainer.wandb_mode=offline (`wandb sync` uploads later)") from e

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, loss_png: Path | None) -> None:
        """The run's last records, and its run file whole on return: run.finish() returns before wandb-core's writer
        has flushed them (measured: 3 of 6 reads of run-<id>.wandb right after it lacked the last steps and the
        exit record), and only the service's teardown waits for that writer. A later run in this process starts a
        new service."""
        import wandb

        if loss_png is not None:
            self.run.log({"loss_png": wandb.Image(str(loss_png))})
        self.run.finish()
        wandb.teardown()


def make_tracker(trainer, run_dir: Path, name: str, config: dict) -> WandbTracker | None:
    """The run's tracker (rank 0), or None without trainer.wandb_project."""
    if not trainer.wandb_project:
        return None
    return WandbTracker(trainer.wandb_project, run_dir, name, config, trainer.wandb_mode, trainer.wandb_entity)
