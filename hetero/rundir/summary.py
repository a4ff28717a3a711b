"""What a run tells its user at the end (rank 0), after the `done:` line: where everything is and how it went.

    for line in run_summary(summary, run_dir, export_dir, seconds):
        print(line)

    done: steps=20 first_loss=6.2699 last_loss=4.0191 layout=vision=dp4@0-3;language=tp2,dp2@0-3
      loss: train 6.2699 -> 4.0191; val synthetic 4.1012
      time: 1m 02s (20 steps, 1.21 s/step)
      run_dir: /work/runs/nemotron_vl_tiny-20261207-203242 (metrics.jsonl, loss.png, tensorboard/)
      checkpoints: step_000020 (latest), step_000010
      export: /tmp/hf_tuned: config.json 2.1 KiB, model.safetensors 1.4 MiB, language_model/ (5 files, 1.2 MiB), ...
"""

from __future__ import annotations

import re
from pathlib import Path

from tessera.hetero.checkpoint.source import latest_checkpoint


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe_folder(path: Path) -> str:
    """Its files with their sizes, largest first; a sub-folder as one entry with its file count and size."""
    entries = []
    for p in sorted(path.iterdir()):
        if p.is_dir():
            files = [f for f in p.rglob("*") if f.is_file()]
            entries.append((sum(f.stat().st_size for f in files), f"{p.name}/ ({len(files)} files, "
                                                                  f"{human_bytes(sum(f.stat().st_size for f in files))})"))
        elif p.is_file():
            entries.append((p.stat().st_size, f"{p.name} {human_bytes(p.stat().st_size)}"))
    return ", ".join(text for _, text in sorted(entries, key=lambda e: -e[0]))


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h {m:02d}m {s:02d}s" if hours else f"{m}m {s:02d}s" if m else f"{seconds:.1f}s"


def run_summary(summary: dict, run_dir: Path, export_dir: str | None, seconds: float) -> list[str]:
    """The lines after `done:`: losses, time, the run directory, its checkpoints, what the export wrote."""
    lines = []
    val = summary.get("val_loss") or {}
    loss = f"  loss: train {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}"
    lines.append(loss + ("; val " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()) if val else ""))
    trained = summary["steps"] - summary.get("start", 0)
    per_step = f", {summary['loop_s'] / trained:.2f} s/step" if trained and summary.get("loop_s") else ""
    lines.append(f"  time: {_duration(seconds)} ({trained} step{'' if trained == 1 else 's'}{per_step})")
    made = [name for name in ("metrics.jsonl", "loss.png", "tensorboard/") if (run_dir / name.rstrip("/")).exists()]
    lines.append(f"  run_dir: {run_dir}" + (f" ({', '.join(made)})" if made else ""))
    root = run_dir / "checkpoints"
    latest = latest_checkpoint(root)
    if latest is not None:
        steps = sorted((p.name for p in root.iterdir() if re.fullmatch(r"step_\d+", p.name)), reverse=True)
        lines.append("  checkpoints: " + ", ".join(f"{s} (latest)" if s == latest.name else s for s in steps)
                     + f" in {root}")
    if export_dir and Path(export_dir).is_dir():
        lines.append(f"  export: {Path(export_dir).resolve()}: {describe_folder(Path(export_dir))}")
    return lines
