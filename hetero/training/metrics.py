"""What a run leaves in its directory (rank 0 only): metrics.jsonl, TensorBoard scalars, a progress bar,
and loss.png at the end.

    m = RunMetrics(run_dir, max_steps, progress=True, tensorboard=True, log_every=10)
    m.log({"step": 1, "loss": 4.1, "lr": {"language": 1e-3}, "grad_norm": 2.0, "tokens_per_s": ...})
    # every log_every steps one line: step, loss, lr, grad norm, tokens/s (real ones too), memory, skips
    m.close()    # writes loss.png

metrics.jsonl is appended and flushed line by line, so a crash keeps every finished step; on resume
the lines of steps after the checkpoint are dropped first, so the file again holds each step once.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch


def _flat(record: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and k != "step":
            out[prefix + k] = float(v)
    return out


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory: CUDA's max allocated on a GPU, the peak resident set on CPU (Linux: KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def summary_line(record: dict, max_steps: int) -> str:
    """One log line of a step's record."""
    lr = record["lr"]
    lr = max(lr.values()) if isinstance(lr, dict) else lr
    skips = ", ".join(f"{k}={v}" for k, v in sorted(record.get("skipped_by_reason", {}).items()))
    return (f"step {record['step']}/{max_steps} loss {record['loss']:.4f} lr {lr:.2e} grad_norm "
            f"{record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f} (real "
            f"{record.get('real_tokens_per_s', 0):.0f}) step {record['step_time_s']:.2f}s memory "
            f"{record.get('peak_memory_gib', 0):.2f} GiB" + (f" skipped {skips}" if skips else ""))


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class RunMetrics:
    def __init__(self, run_dir: str | Path, max_steps: int, first_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, log_every: int = 0):
        self.run_dir, self.max_steps, self.log_every = Path(run_dir), max_steps, log_every
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
        if self.log_every and (record["step"] % self.log_every == 0 or record["step"] == self.max_steps):
            line = summary_line(record, self.max_steps)
            if self.bar is not None:
                self.bar.write(line, file=sys.stderr)  # above the bar, which stays
            else:
                print(line, file=sys.stderr, flush=True)

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
