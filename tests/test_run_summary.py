"""What a run tells its user at the end (hetero/rundir/summary.py): losses, time, the run directory and what
it holds, the checkpoints kept, and every file the export wrote with its size. The lines of a real run under
torchrun are checked in tests/test_train_fault.py (the double launch's winner)."""

from __future__ import annotations

from pathlib import Path

from tessera.hetero.rundir.summary import describe_folder, human_bytes, run_summary


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (run / "checkpoints" / "step_000020").mkdir()
    (run / "checkpoints" / "step_000030.partial").mkdir()  # a save that died: not a checkpoint
    (run / "checkpoints" / "latest").write_text("step_000020\n")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "loss.png").write_bytes(b"png")
    return run


def test_the_summary_names_losses_time_run_dir_checkpoints_and_the_export(tmp_path):
    run = _run_dir(tmp_path)
    export = tmp_path / "export"
    (export / "language_model").mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"\0" * 3 * 1024 * 1024)
    (export / "config.json").write_bytes(b"{" * 2150)
    (export / "language_model" / "a.safetensors").write_bytes(b"\0" * 1024)
    (export / "language_model" / "config.json").write_bytes(b"{" * 1024)
    summary = {"steps": 20, "start": 10, "first_loss": 6.27, "last_loss": 4.01, "loop_s": 25.0,
               "val_loss": {"synthetic": 4.1012}}
    assert run_summary(summary, run, str(export), 62.4) == [
        "  loss: train 6.2700 -> 4.0100; val synthetic 4.1012",
        "  time: 1m 02s (10 steps, 2.50 s/step)",
        f"  run_dir: {run} (metrics.jsonl, loss.png)",
        f"  checkpoints: step_000020 (latest), step_000010 in {run / 'checkpoints'}",
        f"  export: {export}: model.safetensors 3.0 MiB, config.json 2.1 KiB, language_model/ (2 files, 2.0 KiB)"]


def test_a_run_without_validation_checkpoints_or_export_says_only_what_there_is(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    summary = {"steps": 1, "first_loss": 6.0, "last_loss": 6.0, "loop_s": 1.5, "val_loss": {}}
    assert run_summary(summary, run, None, 3700.0) == [
        "  loss: train 6.0000 -> 6.0000", "  time: 1h 01m 40s (1 step, 1.50 s/step)", f"  run_dir: {run}"]


def test_sizes_read_as_a_person_would():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536 * 1024, 5 * 1024 ** 3)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 MiB", "5.0 GiB"]


def test_a_folder_lists_its_largest_first(tmp_path):
    (tmp_path / "b").write_bytes(b"x" * 10)
    (tmp_path / "a").write_bytes(b"x" * 2048)
    assert describe_folder(tmp_path) == "a 2.0 KiB, b 10 B"


def _fails_before_its_first_step(run_dir: str, data_path: str):
    from tessera.recipes.registry import build_recipe_kwargs
    from tessera.recipes.train import train

    try:
        train(**build_recipe_kwargs("nemotron_vl_tiny", ["layout=vision=dp1@0-0;language=dp1@0-0",
                                                         f"trainer.run_dir={run_dir}", f"data.path={data_path}"]))
    except Exception as e:
        return type(e).__name__
    return None


def test_a_run_that_fails_before_its_first_step_removes_the_folder_it_made(tmp_path):
    """A run whose data cannot be read (a bad data.path past the pre-launch check: the direct `python -m` entry)
    fails before any step: the run directory it created goes (no empty folders in runs/); one that existed before
    stays, as it was."""
    from tessera.hetero.tools.spawn import run_on_ranks

    made = tmp_path / "made"
    assert run_on_ranks(1, _fails_before_its_first_step, str(made), str(tmp_path / "no_such_data")) == [
        "TokenizerMismatch"]
    assert not made.exists(), sorted(p.name for p in made.rglob("*"))
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert run_on_ranks(1, _fails_before_its_first_step, str(kept), str(tmp_path / "no_such_data"))[0]
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
