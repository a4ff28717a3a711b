"""Every command the README shows is one CI runs, or names the test that covers it instead.

COMMANDS below is the table: one row per README command (matched by a regular expression), saying how CI checks it:
  run      run as written (its /tmp/ paths moved into a test folder, DIR and data.jsonl made here; `short` appended
           where the command would take minutes: fewer steps or iterations), exit status 0 and the line the
           README promises (`expect`) in its output. Rows run in README order: later ones read what earlier
           ones wrote (the tiny release, the fine-tuned export).
  dryrun   a `nemo tessera` line that trains for minutes: resolved as written with --dryrun (config parsed, names
           and layout validated, executor sized), and `covered_by` names the tests that train the same path.
  standin  needs a GPU, a real cluster or minutes: `covered_by` names the tests that cover its logic, `why` says why.
A README command with no row, or with two, fails; so does a row that matches no command (a stale row) and a
`covered_by` that names no test. The release chain's rows run in tests/test_readme_release.py and the benches' in
tests/test_readme_benches.py (files of their own, so that pytest-xdist runs them side by side)."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEMO = ROOT / ".venv" / "bin" / "nemo"


@dataclass(frozen=True)
class Row:
    match: str                      # regex searched in the README command (continuations joined, comment dropped)
    how: str                        # "run" | "dryrun" | "standin"
    expect: str = ""                # run: regex its output must contain
    short: str = ""                 # run: arguments appended (a short mode of a long command)
    covered_by: tuple[str, ...] = ()  # dryrun / standin: tests (file::function) that run its logic
    why: str = ""                   # standin: what it needs that CI has not
    group: str = "tools"            # which file runs it: tools (this one), release (test_readme_release.py),
                                    # bench (test_readme_benches.py): each under 3 minutes, side by side under xdist


TRAIN_STEP = "trainer.max_steps=1 trainer.progress=false trainer.tensorboard=false data.val_path=None"
COMMANDS = [
    Row(r"^bash scripts/main\.sh", "standin", why="minutes: 20 steps on 4 ranks then its checks",
        covered_by=("tests/test_readme.py::test_readme_command_resolves",
                    "tests/test_train_hetero.py::test_loss_and_grad_norm_match_homogeneous_at_every_step")),
    Row(r"^bash scripts/test\.sh$", "standin", why="the suite itself: .ci/run runs it",
        covered_by=("tests/test_readme.py::test_every_readme_command_has_one_row",)),
    Row(r"^bash scripts/test\.sh --quick$", "standin", why="a part of the suite itself (2 minutes): its tests run in CI",
        covered_by=("tests/test_quick_tier.py::test_quick_is_the_marker_test_sh_selects", "tests/test_quick_tier.py::"
                    "test_a_test_that_starts_a_process_directly_or_through_its_file_is_not_quick")),
    Row(r"finetune --help", "run", expect=r"nemotron_omni_tiny(.|\n)*Registered executors"),
    Row(r"nemotron_vl_tiny trainer\.max_steps=20 run\.executor=local", "dryrun",
        covered_by=("tests/test_train_hetero.py::test_loss_and_grad_norm_match_homogeneous_at_every_step",
                    "tests/test_cli_truth.py::test_failing_rank_fails_nemo_and_names_the_rank")),
    Row(r"nemotron_omni_tiny run\.executor=local --dryrun", "run", expect=r"Dry run for finetune"),
    Row(r"^bash scripts/slurm_local\.sh (up|down)", "standin", why="a real Slurm (root, Debian packages, minutes)",
        covered_by=("tests/test_slurm.py::test_slurm_trains_tiny_recipe",)),
    Row(r"run\.executor=slurm run\.executor\.partition=debug", "standin", why="a real Slurm cluster",
        covered_by=("tests/test_slurm.py::test_slurm_trains_tiny_recipe",
                    "tests/test_slurm.py::test_slurm_job_saves_on_its_signal_is_requeued_and_resumes_bitwise")),
    Row(r"nemotron_vl_12b\(gpus=16\)", "dryrun", covered_by=(
        "tests/test_elastic.py::test_a_lost_node_shrinks_the_job_which_redoes_the_steps_since_the_checkpoint",
        "tests/test_elastic_rules.py::test_the_sbatch_script_of_an_elastic_job")),
    Row(r"convert_hf --init", "run", expect=r"\[convert\] wrote \S+/hf_tiny/model\.safetensors"),
    Row(r"model\.checkpoint=/tmp/hf_tiny model\.freeze_vision", "dryrun",
        covered_by=("tests/test_finetune.py::test_finetune_hf_checkpoint_with_frozen_encoder_and_export",)),
    Row(r"model\.checkpoint=/tmp/hf_tiny model\.lora", "dryrun",
        covered_by=("tests/test_lora.py::test_lora_run_learns_keeps_base_frozen_and_resumes_exactly",)),
    Row(r"tiny_release --out /tmp/omni_release --dense --hub-layout", "run", group="release",
        expect=r"wrote a tiny NemotronH_Omni_Reasoning_V3 checkpoint"),
    # a real `nemo ... --yes` launch, one step: the fine-tune of the tiny release, exported for the next row
    Row(r"model\.checkpoint=/tmp/omni_release layout=", "run", short=TRAIN_STEP, group="release",
        expect=r"done: steps=1 "),
    Row(r"M\.from_pretrained\('/tmp/omni_tuned'\)", "run", group="release"),
    Row(r"tools\.parity --hf-dir /tmp/omni_release --layout", "run", group="release",
        expect=r"parity: PASS max_rel_err="),
    Row(r"full_release --release omni_30b --out /tmp/omni_30b", "run", group="release",
        expect=r"wrote omni_30b to .*naming 7484 tensors"),
    Row(r"scripts\.dryrun --recipe nemotron_omni_30b_a3b --checkpoint /tmp/omni_30b", "run", group="release",
        expect=r"memory per rank, GiB \(meta-device build(.|\n)*dry run: PASS"),
    Row(r"tiny_release --out /tmp/nano_vl --nano-vl", "standin",
        covered_by=("tests/test_parity_nano_vl.py::test_samples_follow_the_release_rules",),
        why="the fixture of the test writes the same checkpoint (nano_vl_checkpoint); its parity run is 4 ranks"),
    Row(r"tools\.parity --hf-dir /tmp/nano_vl --layout", "standin",
        covered_by=("tests/test_parity_nano_vl.py::test_layouts_on_four_ranks_and_a_break_fails",
                    "tests/test_parity_nano_vl.py::test_one_rank_command_and_first_step_loss"),
        why="4 gloo ranks for a minute: the test runs this layout and three more in one spawn"),
    Row(r"model\.vision=siglip_tiny", "dryrun",
        covered_by=("tests/test_encoders_multimodal.py::test_tiny_multimodal_forward_backward",)),
    Row(r"model\.audio=parakeet_hf_tiny", "dryrun",
        covered_by=("tests/test_encoders_multimodal.py::test_tiny_multimodal_forward_backward",)),
    Row(r"model\.vision=hf:/models/dinov2-with-registers-base", "standin", why="a downloaded transformers model directory",
        covered_by=("tests/test_hf_encoders.py::test_recipe_trains_with_one_override_equal_to_one_device",
                    "tests/test_hf_any_encoder.py::"
                    "test_vision_features_equal_the_models_own_forward_through_its_processor")),
    Row(r"model\.audio=hf:/models/wavlm-base-plus", "standin", why="a downloaded transformers model directory",
        covered_by=("tests/test_hf_encoders.py::test_recipe_trains_with_one_override_equal_to_one_device",
                    "tests/test_hf_any_encoder.py::"
                    "test_audio_features_equal_the_models_own_forward_through_its_feature_extractor")),
    Row(r"nemotron_vl_tiny layout=\"vision=dp2@0-1;language=tp2@2-3\"", "dryrun",
        covered_by=("tests/test_train_hetero.py::test_loss_and_grad_norm_match_homogeneous_at_every_step",)),
    Row(r"tessera plan --factory nemotron_vl_12b", "run", expect=r"top layouts on 64 x h100"),
    Row(r"scripts\.dryrun --recipe nemotron_vl_12b --world 1024", "run", expect=r"dry run: PASS"),
    Row(r"scripts\.bench_dryrun", "run", short="--worlds 1024 --auto 64 --recipes nemotron_vl_12b",
        expect=r"load average", group="bench"),
    Row(r"nemotron_vl_tiny layout=auto", "dryrun",
        covered_by=("tests/test_recipes.py::test_cli_layout_auto_prints_the_layout_it_chose_before_launch",)),
    Row(r"prepare_data\.py --manifest data\.jsonl", "run", expect=r"\[prepare\] format caption: wrote 2 samples"),
    # the README's own-format module (its python block, written by workspace()) on its notes.jsonl
    Row(r"--format my_notes:convert", "run", expect=r"\[prepare\] format \S*my_notes\.py:convert: wrote 2 samples"),
    Row(r"data\.path=/data/mine", "dryrun",
        covered_by=("tests/test_data_end_to_end.py::test_prepared_data_trains_a_tiny_multimodal_model",)),
    Row(r"^energon prepare /data/coco", "standin", why="energon's own CLI on the user's COCO shards (not shipped)",
        covered_by=("tests/test_energon_sample_types.py::"
                    "test_sample_type_gives_the_ids_mask_and_media_of_the_same_conversation",)),
    Row(r"data\.path=/data/coco", "dryrun", covered_by=(
        "tests/test_energon_sample_types.py::"
        "test_blend_of_an_energon_set_and_a_prepared_llava_set_trains_in_a_heterogeneous_layout",)),
    Row(r"recipes\.verify --recipe nemotron_omni_tiny layout=", "standin",
        why="minutes: each layout trained on 4 ranks and again on one",
        covered_by=("tests/test_verify_trainer.py::test_verify_trains_a_heterogeneous_layout_and_matches_one_device",)),
    Row(r"recipes\.verify --recipe nemotron_omni_tiny model\.llm=nemotron_h_tiny_moe", "standin",
        why="minutes: each layout trained on 4 ranks and again on one",
        covered_by=("tests/test_verify_moe.py::test_verify_moe_layouts_match_single_device",)),
    # 4-rank chain-model checks, 20-30 s each: the same entry point runs under torchrun in test_hetero_gloo
    Row(r"hetero\.tools\.verify --layout", "standin", why="half a minute of 4 ranks; its CLI runs on 2 ranks there",
        covered_by=("tests/test_hetero_gloo.py::test_verify_cli_under_torchrun",
                    "tests/test_hetero_gloo.py::test_hetero_matches_single_device")),
    Row(r"hetero\.tools\.verify --llm moe", "standin", why="half a minute of 4 ranks; its layouts run there",
        covered_by=("tests/test_hetero_gloo.py::test_verify_cli_under_torchrun",
                    "tests/test_verify_moe.py::test_verify_moe_layouts_match_single_device")),
    # the LLM alone against transformers' NemotronH at CP 2, on tiny dense and MoE checkpoints (DIR, made here)
    Row(r"tools\.parity --hf-dir DIR --cp 2", "run", expect=r"parity: PASS max_rel_err="),
    Row(r"bench_boundary\.py", "run", short="--iters 1 --seq 128 --hidden 64", group="bench",
        expect=r"bytes = minimum on every row: True"),
    Row(r"bench_llm\.py", "run", short="--iters 1 --seq 64 --batch 1", group="bench", expect=r"mamba mixer"),
    Row(r"bench_loader\.py", "run", short="--media small --kinds image --window 0.5 --repeat 1 --samples 6 "
        "--warmup 2 --out {ws}/bench_media", group="bench", expect=r"plain/s +loader/s +ratio"),
    Row(r"bench_reads\.py", "run", short="--media small --steps 1 --rows 2 --samples 6 --out {ws}/bench_media "
        "--layouts vision=dp2@0-1;language=dp2@0-1", group="bench", expect=r"counted"),
    Row(r"bench_train\.py", "standin", why="minutes: 4 ranks train every layout",
        covered_by=("tests/test_bench_train.py::test_summary_uses_median_after_warmup_and_ratio_to_homogeneous",
                    "tests/test_train_hetero.py::test_loss_and_grad_norm_match_homogeneous_at_every_step")),
    Row(r"bench_progress\.py", "run", short="--steps 3 --pairs 1", group="bench", expect=r"\| on \| [\d.]+ \| 1 \|"),
    Row(r"bench_cp\.py", "run", short="--seqs 256 --cps 2 --repeat 1", group="bench", expect=r"\| 256 \| 2 \| mamba \|"),
    Row(r"bench_cp_kernels", "run", short="--device cpu --seqs 512 --cps 2 --tp 16 --repeat 1", group="bench",
        expect=r"\| 512 \| 2 \| head \| conv1d"),
    Row(r"calibrate_planner\.py", "standin", why="minutes: 10 layouts trained on 4 ranks, 5 repeats",
        covered_by=("tests/test_planner_calibrate.py::test_fit_recovers_the_generating_constants",)),
]


def readme_commands() -> list[str]:
    """Every command in the README's bash blocks, continuations joined, trailing comments dropped."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+", " ", re.sub(r"\s+#.*$", "", l)).strip() for l in lines
            if l.strip() and not l.strip().startswith("#")]


def readme_nemo_commands() -> list[str]:
    return [c for c in readme_commands() if c.startswith(".venv/bin/nemo tessera")]


def rows_of(command: str) -> list[Row]:
    return [r for r in COMMANDS if re.search(r.match, command)]


def _test_exists(node: str) -> bool:
    path, _, name = node.partition("::")
    tree = ast.parse((ROOT / path).read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def test_every_readme_command_has_one_row():
    commands = readme_commands()
    assert len(commands) > 30, commands
    for c in commands:
        assert len(rows_of(c)) == 1, f"README command needs exactly one row in tests/test_readme.py COMMANDS, " \
                                     f"has {len(rows_of(c))}: {c}"
    for r in COMMANDS:
        assert any(re.search(r.match, c) for c in commands), f"stale row (no README command matches): {r.match}"
        assert r.how in ("run", "dryrun", "standin") and r.group in ("tools", "release", "bench"), r
        assert r.how == "run" or r.covered_by, f"{r.match}: a {r.how} row names the tests that cover it"
        assert r.how != "standin" or r.why, f"{r.match}: a standin row says why CI cannot run it"
        assert r.how == "dryrun" or not r.match.startswith(".venv/bin/nemo"), r
        for node in r.covered_by:
            assert _test_exists(node), f"{r.match}: covered_by names no test: {node}"
    nemo = [c for c in commands if c.startswith(".venv/bin/nemo tessera finetune") and "--yes" in c]
    assert all(rows_of(c)[0].how in ("dryrun", "run", "standin") for c in nemo)


def test_readme_shows_the_cli_for_every_user_task():
    cmds = readme_nemo_commands()
    assert any(" finetune " in c and "run.executor=slurm" in c for c in cmds)          # run on Slurm
    assert any("model.checkpoint=" in c for c in cmds)                                # fine-tune a checkpoint
    assert any("model.vision=" in c for c in cmds) and any("model.audio=" in c for c in cmds)  # swap
    assert any(" plan " in c for c in cmds) and any("layout=" in c for c in cmds)     # choose a layout


@pytest.mark.skipif(not NEMO.exists(), reason="nemo CLI not installed in .venv")
@pytest.mark.parametrize("cmd", [c for c in readme_nemo_commands() if rows_of(c) and rows_of(c)[0].how == "dryrun"])
def test_readme_command_resolves(cmd):
    args = shlex.split(cmd)
    args = [a for a in args if a not in ("--yes", "--dryrun")] + ["--dryrun"]
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    res = subprocess.run([str(ROOT / args[0])] + args[1:], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Error" not in out.replace("error_handling", ""), out[-3000:]
    assert "Dry run" in out or "dryrun" in out.lower(), out[-2000:]


# ---- the commands CI runs as written --------------------------------------------------------------------

def workspace(tmp: Path) -> Path:
    """What the README's commands read that no earlier command writes: tiny NemotronH checkpoints (DIR of the
    parity line, dense and MoE, saved by transformers), a two-sample manifest (data.jsonl, as the data section
    describes it) and the own-format example (my_notes.py from the README, notes.jsonl)."""
    from PIL import Image

    from tessera.models import configs
    from tests._hf_tiny import make_tiny_checkpoint

    make_tiny_checkpoint(configs.TINY_DENSE, tmp / "nemotron_h_dense", seed=0)
    make_tiny_checkpoint(configs.TINY_MOE, tmp / "nemotron_h_moe", seed=1)
    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp / "red.png")
    (tmp / "data.jsonl").write_text('{"image": "red.png", "caption": "a red square"}\n'
                                    '{"image": "red.png", "caption": "a red picture"}\n')
    from tests.test_formats import readme_format_example

    (tmp / "my_notes.py").write_text(readme_format_example())
    Image.new("RGB", (64, 48), (120, 120, 120)).save(tmp / "cat.jpg")
    (tmp / "notes.jsonl").write_text('{"photo": "cat.jpg", "question": "What is this?", "answer": "A grey cat."}\n'
                                     '{"photo": "cat.jpg", "question": "And now?", "answer": "Still a grey cat."}\n')
    return tmp


def as_run_here(command: str, row: Row, ws: Path) -> list[list[str]]:
    """The argv(s) that run `command` here: paths into `ws`, the venv's programs, DIR once per tiny checkpoint."""
    text = command.replace("/tmp/", f"{ws}/").replace("/data/mine", f"{ws}/mine").replace("data.jsonl",
                                                                                        f"{ws}/data.jsonl")
    text = text.replace("/data/notes", f"{ws}/notes").replace(" notes.jsonl", f" {ws}/notes.jsonl").replace(
        "my_notes:convert", f"{ws}/my_notes.py:convert")  # the module in ws, not in the current directory
    args, extra = shlex.split(text), shlex.split(row.short.format(ws=ws))
    if "--yes" in args:  # overrides before nemo's flags; the run's folder here, not runs/
        extra.append(f"trainer.run_dir={ws}/run{len(list(ws.glob('run*')))}")
        args[args.index("--yes"):args.index("--yes")] = extra
    else:
        args += extra
    if args[0] == "python3":
        args[0] = ".venv/bin/python"
    args[0] = str(ROOT / args[0]) if args[0].startswith(".venv/") else args[0]
    if "DIR" in args:
        return [[a if a != "DIR" else str(ws / f"nemotron_h_{kind}") for a in args] for kind in ("dense", "moe")]
    return [args]


def run_rows(group: str, ws: Path) -> list[str]:
    """Runs every `run` row of `group` in README order; the failures, each with its output's tail."""
    failures = []
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    for command in readme_commands():
        row = rows_of(command)[0]
        if row.how != "run" or row.group != group:
            continue
        for argv in as_run_here(command, row, ws):
            t0 = time.monotonic()
            res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            out = res.stdout + res.stderr
            print(f"{time.monotonic() - t0:6.1f} s  exit {res.returncode}  {shlex.join(argv)[:150]}", flush=True)
            if res.returncode != 0 or (row.expect and not re.search(row.expect, out)):
                failures.append(f"{shlex.join(argv)}\n  exit {res.returncode}, expected /{row.expect}/\n"
                                f"{out[-2500:]}")
    return failures


@pytest.mark.multiproc
def test_readme_commands_run_as_written(tmp_path):
    failures = run_rows("tools", workspace(tmp_path))
    assert not failures, "\n\n".join(failures)
