"""What a run leaves in its directory (rank 0 only): metrics.jsonl, TensorBoard scalars, a progress bar,
and loss.png at the end.

    m = RunMetrics(run_dir, max_steps, progress=True, tensorboard=True)
    m.log({"step": 1, "loss": 4.1, "lr": {"language": 1e-3}, "grad_norm": 2.0, "tokens_per_s": ...})
    m.close()    # writes loss.png

metrics.jsonl is appended and flushed line by line, so a crash keeps every finished step; on resume
the lines of steps after the checkpoint are dropped first, so the file again holds each step once.
"""

from __future__ import annotations

import json
from pathlib import Path


def _flat(record: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and k != "step":
            out[prefix + k] = float(v)
    return out


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class RunMetrics:
    def __init__(self, run_dir: str | Path, max_steps: int, first_step: int = 0, progress: bool = True,
                 tensorboard: bool = True):
        self.run_dir, self.max_steps = Path(run_dir), max_steps
        self.path = self.run_dir / "metrics.jsonl"
        kept = [r for r in read_metrics(self.run_dir) if r["step"] <= first_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=first_step + 1)
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, initial=first_step, unit="step", dynamic_ncols=True, mininterval=0.5)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in _flat(record).items():
                self.tb.add_scalar(k, v, record["step"])
        if self.bar is not None:
            self.bar.update(1)
            left = (self.max_steps - record["step"]) * record["step_time_s"]
            self.bar.set_postfix_str(f"loss={record['loss']:.4f} tok/s={record['tokens_per_s']:.0f} "
                                     f"eta={left:.0f}s", refresh=False)

    def close(self) -> Path | None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()
        return plot_loss(self.run_dir)


def plot_loss(run_dir: str | Path) -> Path | None:
    """loss.png of every step in metrics.jsonl (None when there is nothing to plot)."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker="o", markersize=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    out = Path(run_dir) / "loss.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
