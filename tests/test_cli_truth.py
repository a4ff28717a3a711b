"""`nemo tessera pretrain|finetune` tells the truth: a job whose ranks fail exits non-zero and prints the
failing rank's last lines; inputs that can be checked before launch (data path, index, tokenizer, checkpoint)
are, with the fix named; Slurm jobs request GPUs from the layout and carry a time limit, requeue and signal.
Slurm runs themselves are in tests/test_slurm.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import fiddle as fdl
import pytest

from tessera.recipes import executors, prelaunch
from tessera.hetero.runspec.config import DataConfig, ModelConfig, TrainerConfig

ROOT = Path(__file__).resolve().parents[1]
NEMO = ROOT / ".venv" / "bin" / "nemo"
TWO_RANKS = "layout=vision=dp2@0-1;language=dp2@0-1"


def _nemo(args: list[str], tmp_path: Path, env_extra: dict | None = None, timeout: int = 600):
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", NEMORUN_HOME=str(tmp_path / "nrhome"),
               **(env_extra or {}))
    return subprocess.run([str(NEMO), "tessera", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _task(**data):
    return SimpleNamespace(model=ModelConfig(), data=DataConfig(**data), trainer=TrainerConfig())


# ---- exit status --------------------------------------------------------------------------------------------

@pytest.mark.multiproc
@pytest.mark.skipif(not NEMO.exists(), reason="nemo CLI not installed in .venv")
def test_failing_rank_fails_nemo_and_names_the_rank(tmp_path):
    """Rank 1 exits with 17 at its 2nd step: `nemo` exits non-zero, naming rank 1, its exit code and lines."""
    res = _nemo(["finetune", "--factory", "nemotron_vl_tiny", TWO_RANKS, "trainer.max_steps=3",
                 f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress=false", "trainer.tensorboard=false",
                 "data.seq_length=128", "run.executor=local", "--yes"], tmp_path, {"TESSERA_FAIL_AT_STEP": "1:1"})
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert "failing rank 1" in out and "exit code 17" in out, out[-3000:]
    assert "[rank 1]" in out and "ended FAILED" in out, out[-3000:]
    assert "Experiment.from_id" not in out, "nemo-run's goodbye (12 lines) is off: the run's own lines end the output"


def test_failing_rank_report_reads_torchruns_summary():
    log = "\n".join([
        "job/0 [default0]:run_dir: /x",
        "job/0 [default1]:loading shard 3",
        "job/0 [default0]:[rank0]: Traceback (most recent call last):",
        "job/0 [default0]:[rank0]: RuntimeError: Connection reset by peer",
        "job/0 Root Cause (first observed failure):",
        "job/0 [0]:",
        "job/0   rank      : 1 (local_rank: 1)",
        "job/0   exitcode  : -9 (pid: 123)",
    ])
    report = executors.failing_rank_report(log)
    assert "failing rank 1" in report and "signal 9" in report and "SIGKILL" in report, report
    assert "[rank 1] loading shard 3" in report, report
    assert "rank 0 raised: RuntimeError: Connection reset by peer" in report, report


# ---- pre-launch input checks ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A prepared dataset (shards + .nv-meta + tokenizer.model), 8 synthetic samples."""
    from tessera.data.prepare import make_synthetic

    out = tmp_path_factory.mktemp("ds") / "ds"
    make_synthetic(out, samples=8, shard_size=8)
    return out


def test_dataset_without_tokenizer_is_refused_before_launch(dataset, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(dataset, bare)
    (bare / "tokenizer.model").unlink()
    with pytest.raises(ValueError, match=r"tokenizer\.model is missing.*data\.tokenizer=PATH.*prepare_data"):
        prelaunch.check_inputs(_task(path=str(bare)))
    prelaunch.check_inputs(_task(path=str(bare), tokenizer=str(dataset / "tokenizer.model")))  # the fix works
    prelaunch.check_inputs(_task(path=str(dataset)))
    prelaunch.check_inputs(_task(path=None))  # synthetic data


def test_data_path_problems_name_the_fix(dataset, tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*prepare_data\.py"):
        prelaunch.check_inputs(_task(path=str(tmp_path / "nope")))
    (tmp_path / "raw").mkdir()
    with pytest.raises(ValueError, match=r"not a prepared dataset.*\.nv-meta.*energon prepare"):
        prelaunch.check_inputs(_task(path=str(tmp_path / "raw")))
    blend = tmp_path / "blend.yaml"
    blend.write_text("__module__: megatron.energon\n")
    with pytest.raises(ValueError, match=r"blend.*data\.tokenizer=PATH"):
        prelaunch.check_inputs(_task(path=str(blend)))
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*not a file"):
        prelaunch.check_inputs(_task(path=str(dataset), tokenizer=str(tmp_path / "tok.model")))
    (tmp_path / "junk.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match=r"does not load"):
        prelaunch.check_inputs(_task(path=str(dataset), tokenizer=str(tmp_path / "junk.model")))
    # a dry run reports it and goes on (the README's commands resolve before their data exists)
    prelaunch.check_inputs(_task(path=str(tmp_path / "nope")), dryrun=True)


def test_validation_sets_are_checked_before_launch(dataset, tmp_path):
    (tmp_path / "raw").mkdir()
    with pytest.raises(ValueError, match=r"data\.val_path \(held\)=.*raw is not a prepared dataset"):
        prelaunch.check_inputs(_task(path=str(dataset), val_path=f"ok={dataset};held={tmp_path / 'raw'}"))
    with pytest.raises(ValueError, match=r"data\.val_path: .*nope does not exist"):
        prelaunch.check_inputs(_task(path=str(dataset), val_path=str(tmp_path / "nope")))
    prelaunch.check_inputs(_task(path=str(dataset), val_path=f"synthetic;mine={dataset}"))


def test_checkpoint_must_be_hf_or_tessera(tmp_path):
    def check(path):
        t = _task()
        t.model.checkpoint = str(path)
        prelaunch.check_inputs(t)

    with pytest.raises(ValueError, match="is not a directory"):
        check(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"neither \*\.safetensors.*nor a `latest`"):
        check(tmp_path / "empty")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a whole safetensors file \(0 bytes"):
        check(tmp_path / "hf")  # an empty file (a download that never started) is no checkpoint
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "hf" / "model.safetensors"))
    check(tmp_path / "hf")
    ck = tmp_path / "run" / "checkpoints"
    (ck / "step_000004").mkdir(parents=True)
    (ck / "latest").write_text("step_000004\n")
    check(ck)
    with pytest.raises(ValueError, match=r"did you mean model\.checkpoint=.*checkpoints"):
        check(tmp_path / "run")
    (ck / "latest").write_text("step_000009\n")
    with pytest.raises(ValueError, match="step_000009, which is missing"):
        check(ck)


def test_full_size_recipe_says_loudly_synthetic_and_random(capsys):
    from tessera.recipes.registry import recipe

    cfg = fdl.build(recipe("nemotron_vl_12b"))
    prelaunch.check_inputs(cfg)
    err = capsys.readouterr().err
    assert "WARNING" in err and "SYNTHETIC data" in err and "RANDOM weights" in err, err
    prelaunch.check_inputs(fdl.build(recipe("nemotron_vl_tiny")))
    assert "WARNING" not in capsys.readouterr().err


@pytest.mark.skipif(not NEMO.exists(), reason="nemo CLI not installed in .venv")
def test_cli_refuses_a_dataset_without_tokenizer_before_launch(dataset, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(dataset, bare)
    (bare / "tokenizer.model").unlink()
    res = _nemo(["finetune", "--factory", "nemotron_vl_tiny", f"data.path={bare}", "run.executor=local", "--yes"],
                tmp_path, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "tokenizer.model is missing" in out and "data.tokenizer=PATH" in out, out[-3000:]
    assert "Launching" not in out, out[-3000:]
    # a refusal reads as one: nemo-run's "Error: ...", not its "Unexpected error: ..." (recipes/cli.cli_execute)
    assert "Error: data.path=" in res.stderr and "Unexpected error" not in out, out[-3000:]


def test_a_misspelt_layout_module_is_refused_before_launch():
    """The CLI's pre-launch check (checks.check_run, what TesseraRunContext.parse_fn calls) refuses `visoin=...`
    naming it and this model's modules; it was dropped and replaced by vision=dp4@0-3 (issue 33)."""
    from tessera.recipes import checks
    from tessera.recipes.registry import recipe

    cfg = fdl.build(recipe("nemotron_vl_tiny"))
    cfg.layout = "visoin=dp4@0-3;language=dp4@0-3"
    with pytest.raises(ValueError, match=r"layout module 'visoin' is not a module of this model .*; its modules "
                                         r"are: language, vision "):
        checks.check_run(cfg, 4)


# ---- `plan` and --to-yaml ---------------------------------------------------------------------------------------

@pytest.mark.skipif(not NEMO.exists(), reason="nemo CLI not installed in .venv")
def test_plan_neither_prompts_nor_launches(tmp_path):
    """`plan` launches nothing: no `Continue? [y/N]` (with stdin closed it ended in an empty `Unexpected
    error:`), no "Launching plan...", exit 0 and the table."""
    res = _nemo(["plan", "--factory", "nemotron_vl_tiny"], tmp_path, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "nemotron_vl_tiny_finetune: top layouts on 4 x h100" in out and "homogeneous*" in out, out[-3000:]
    assert "Launching" not in out and "Continue?" not in out and "Unexpected error" not in out, out[-3000:]


def test_to_yaml_round_trips_through_yaml(tmp_path, monkeypatch):
    """What --to-yaml writes loads back with --yaml into the factory's own task (it failed on `_partial_`; nemo-run's
    ConfigSerializer.load made `name: nemotron_vl_tiny_pretrain` the factory of that name), overrides on top."""
    from tessera.recipes.cli import TesseraRunContext, pretrain

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "task.yaml"
    TesseraRunContext(name="t", factory="nemotron_vl_tiny", to_yaml=str(path)).cli_execute(
        pretrain, ["run.executor=local", "model.vision=siglip_tiny"])
    assert "_partial_: true" in path.read_text()

    def task(args, **ctx):
        rc = TesseraRunContext(name="t", **ctx)
        rc.parse_args(["executor=local"])
        return rc.parse_fn(pretrain, args)

    factory = task(["model.vision=siglip_tiny"], factory="nemotron_vl_tiny")
    loaded = task([], yaml=str(path))
    assert loaded == factory and fdl.build(loaded).keywords == fdl.build(factory).keywords
    assert loaded.name == "nemotron_vl_tiny_pretrain" and loaded.model.vision == "siglip_tiny"
    assert task(["trainer.max_steps=3"], yaml=str(path)).trainer.max_steps == 3


# ---- Slurm: GPUs, time limit, requeue --------------------------------------------------------------------------

def _slurm(world: int, **kw):
    ex = fdl.build(executors.slurm(**kw))
    executors.fit_executor(ex, world)
    return ex


def test_slurm_gpus_come_from_the_layout_for_gpu_recipes():
    from tessera.recipes.registry import recipe

    big = fdl.build(recipe("nemotron_vl_12b", gpus=16)).model
    ex = _slurm(16, nodes=2)
    executors.request_gpus(ex, big)
    assert ex.gpus_per_node == 8 and ex.ntasks_per_node == 8
    ex = _slurm(16, nodes=2, gpus_per_node=0)
    with pytest.raises(ValueError, match="GPU recipe.*gpus_per_node=0"):
        executors.request_gpus(ex, big)
    tiny = fdl.build(recipe("nemotron_vl_tiny")).model
    ex = _slurm(4)
    executors.request_gpus(ex, tiny)
    assert ex.gpus_per_node is None  # CPU recipe on CPUs (the local Slurm of tests/test_slurm.py)


def test_slurm_defaults_time_limit_requeue_and_signal():
    ex = _slurm(4)
    assert ex.time == executors.DEFAULT_TIME == "04:00:00"
    assert ex.retries == executors.DEFAULT_RETRIES > 0
    assert ex.signal == executors.DEFAULT_SIGNAL == "TERM@300"


@pytest.mark.skipif(not NEMO.exists(), reason="nemo CLI not installed in .venv")
def test_cli_full_size_slurm_dry_run_requests_gpus_and_warns(tmp_path):
    """nemotron_vl_12b on 2 x 8 without gpus_per_node: GPUs from the layout, limit, signal, retries, and
    the loud synthetic-data / random-weights warning (the sbatch script itself: tests/test_slurm.py)."""
    res = _nemo(["finetune", "--factory", "nemotron_vl_12b(gpus=16)", "run.executor=slurm", "run.executor.nodes=2",
                 "run.executor.account=acc", "run.executor.time=08:00:00", "--dryrun"], tmp_path, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "requesting 8 GPUs per node" in out and "gpus_per_node=8" in out, out[-3000:]
    assert "time='08:00:00'" in out and "signal='TERM@300'" in out and "retries=3" in out, out[-3000:]
    assert "SYNTHETIC data" in out and "RANDOM weights" in out, out[-3000:]


def _run_dir_in(cwd: str) -> str:
    from tessera.recipes import train as train_mod

    os.chdir(cwd)
    return str(train_mod._run_dir("vl", TrainerConfig())[0])


def test_slurm_run_dir_is_the_job_id(monkeypatch, tmp_path):
    """A requeued job keeps its id: the default run directory is named after it, so the job resumes.
    (On a rank of its own: the run directory is agreed over the default process group.)"""
    from tessera.hetero.tools.spawn import run_on_ranks

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    path = run_on_ranks(1, _run_dir_in, str(tmp_path))[0]
    assert Path(path) == (tmp_path / "runs" / "vl-slurm4242").resolve()
