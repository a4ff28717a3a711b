"""What a run leaves in its directory (rank 0 only): metrics.jsonl, TensorBoard scalars, a progress bar,
loss.png at the end, and the same to W&B with trainer.wandb_project (hetero/training/tracking.py).

    m = RunMetrics(run_dir, max_steps, progress=True, tensorboard=True, log_every=10)
    m.log({"step": 1, "loss": 4.1, "lr": {"language": 1e-3}, "grad_norm": 2.0, "tokens_per_s": ...})
    m.log_val(10, {"synthetic": 3.9})   # a validation pass: its own line, val/<name>/loss in TensorBoard
    # every log_every steps one line: step, loss, lr, grad norm, tokens/s (real ones too), memory, skips
    m.close()    # writes loss.png

metrics.jsonl is appended and flushed line by line, so a crash keeps every finished step; on resume
the lines of steps after the checkpoint are dropped first, so the file again holds each step once.
Every step's record carries the world it ran on; a start on another world or layout than the last run's (an
elastic restart, issue 36) adds a {"step", "world_change": {...}} record and a log line (log_world_change).
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
    tflops, mfu = record.get("model_tflops_per_gpu"), record.get("mfu")
    worst = record.get("max_over_ranks", record)  # the slowest / fullest rank's (rank 0's alone in old records)
    speed = ""  # model FLOPs (hetero/planner/flops.py): MFU where the device's peak is known, else FLOP/s only
    if tflops is not None:
        speed = (f" {tflops:.1f} TFLOPS/GPU MFU {100 * mfu:.1f}%" if mfu is not None
                 else f" {tflops * 1e3:.2f} GFLOPS/rank")
    return (f"step {record['step']}/{max_steps} loss {record['loss']:.4f} lr {lr:.2e} grad_norm "
            f"{record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f} (real "
            f"{record.get('real_tokens_per_s', 0):.0f}){speed} step {record['step_time_s']:.2f}s (data wait "
            f"{worst.get('data_wait_s', 0):.2f}s, boundary {worst.get('boundary_s', 0):.2f}s) memory "
            f"{worst.get('peak_memory_gib', 0):.2f} GiB" + (f" skipped {skips}" if skips else ""))


def _kind(record: dict) -> str:
    return "val" if "val" in record else "world" if "world_change" in record else "train"


def read_metrics(run_dir: str | Path, kind: str = "train") -> list[dict]:
    """metrics.jsonl's records of one kind: "train" (one per step), "val" (one per validation pass:
    {"step", "val": {set name: {"loss": ..}}}), "world" (one per world change: {"step", "world_change": {..}})
    or "all", in file order."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return rows if kind == "all" else [r for r in rows if _kind(r) == kind]


class RunMetrics:
    def __init__(self, run_dir: str | Path, max_steps: int, first_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, log_every: int = 0, tracker=None):
        self.run_dir, self.max_steps, self.log_every = Path(run_dir), max_steps, log_every
        self.tracker = tracker  # hetero/training/tracking.py (W&B), or None
        self.path = self.run_dir / "metrics.jsonl"
        old = read_metrics(self.run_dir, "all")
        # what the last run trained past the checkpoint (redone now), and the world it ran on when it changed
        self._trained = max((r["step"] for r in old if _kind(r) == "train"), default=first_step)
        kept = [r for r in old if r["step"] <= first_step]
        self._last_change = next((r["world_change"] for r in reversed(kept) if _kind(r) == "world"), None)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=first_step + 1)
        self.bar = None
        if progress and sys.stderr.isatty():
            from tqdm import tqdm

            # disable=False: TQDM_DISABLE (recipes/train.py) silences the libraries' bars, not this one. Only on a
            # terminal: in a log (nemo-run's, torchrun's, Slurm's: line-prefixed pipes) every redraw, and every
            # line written above the bar, became another copy of the bar; there the step lines are the progress
            self.bar = tqdm(total=max_steps, initial=first_step, unit="step", dynamic_ncols=True, disable=False,
                            mininterval=0.5)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self._scalars(record)
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

    def log_world_change(self, step: int, world: int, layout: str, saved: tuple[int, str] | None,
                         spares: int = 0) -> dict | None:
        """At a start from checkpoint `step` (saved on world and layout `saved`): when the world or layout differs
        from the last run's (the last recorded change's new ones, else the checkpoint's), record the change: old
        and new world and layout, the launched ranks left out as spares, and the steps the last run trained after
        the checkpoint, which are redone."""
        last = ((self._last_change["new_world"], self._last_change["new_layout"]) if self._last_change
                else saved)
        if last is None or tuple(last) == (world, layout):
            return None
        change = {"old_world": last[0], "new_world": world, "old_layout": last[1], "new_layout": layout,
                  "spares": spares, "steps_redone": max(self._trained - step, 0)}
        self.file.write(json.dumps({"step": step, "world_change": change}) + "\n")
        self.file.flush()
        idle = ("" if not spares else " (1 more launched rank waits as a spare)" if spares == 1
                else f" ({spares} more launched ranks wait as spares)")
        line = (f"world change at step {step}: {last[0]} -> {world} ranks{idle}, layout {last[1]} -> {layout}; "
                f"{change['steps_redone']} steps redone from the checkpoint of step {step}")
        print(line, file=sys.stderr, flush=True)
        return change

    def log_val(self, step: int, losses: dict[str, float]) -> None:
        """A validation pass after `step`: {set name: loss} (hetero/training/validation.py)."""
        record = {"step": step, "val": {name: {"loss": loss} for name, loss in losses.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self._scalars(record)
        line = f"validation after step {step}: " + ", ".join(f"{n} loss {v:.4f}" for n, v in losses.items())
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def _scalars(self, record: dict) -> None:
        """TensorBoard and the tracker: every number of the record, nested keys joined by '/'."""
        flat = _flat(record)
        if self.tb is not None:
            for k, v in flat.items():
                self.tb.add_scalar(k, v, record["step"])
        if self.tracker is not None:
            self.tracker.log(flat, record["step"])

    def close(self) -> Path | None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()
        plot = plot_loss(self.run_dir)
        if self.tracker is not None:
            self.tracker.finish(plot)
        return plot


def plot_loss(run_dir: str | Path) -> Path | None:
    """loss.png of every step in metrics.jsonl (None when there is nothing to plot)."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker="o", markersize=2, label="train")
    val = read_metrics(run_dir, "val")
    for name in sorted({n for r in val for n in r["val"]}):
        points = [(r["step"], r["val"][name]["loss"]) for r in val if name in r["val"]]
        ax.plot(*zip(*points), marker="s", markersize=4, label=f"val/{name}")
    if val:
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    out = Path(run_dir) / "loss.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
