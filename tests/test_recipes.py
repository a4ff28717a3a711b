"""Every recipe builds and its layout validates; encoder swaps; executor sizing; the `nemo tessera` CLI.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_recipes.py -x -q      # ~40 s (5 CLI subprocesses)
"""

import os
import subprocess
import sys
from pathlib import Path

import fiddle as fdl
import re

import pytest

import nemo_run as run
from tessera.hetero.plan.layout import HeteroLayout, LayoutError
from tessera.recipes.full_size import RECIPES as PLANNED
from tessera.hetero.runspec.modules import run_model
from tessera.recipes import checks, executors, registry
from tessera.recipes.cli import ENTRYPOINTS, TesseraRunContext, factories_of
from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig

NEMO = Path(sys.executable).with_name("nemo")
FULL = {"nemotron_vl_12b", "nemotron_video_12b", "nemotron_omni_30b_a3b"}
GPUS = (8, 16, 32, 64)


def _variants():
    for name in registry.recipe_names():
        base = name.removesuffix("_pretrain").removesuffix("_finetune")
        for gpus in (GPUS if base in FULL else (None,)):
            yield name, gpus


@pytest.mark.parametrize("name,gpus", list(_variants()))
def test_every_recipe_builds_and_validates(name, gpus):
    cfg = fdl.build(registry.recipe(name, **({"gpus": gpus} if gpus else {})))
    assert isinstance(cfg, RunConfig) and isinstance(cfg.model, ModelConfig) and isinstance(cfg.data, DataConfig)
    assert isinstance(cfg.optim, OptimConfig) and isinstance(cfg.trainer, TrainerConfig)
    world = gpus or registry.TINY_WORLD
    shapes = run_model(cfg.model).shapes(cfg.data.seq_length, cfg.data.rows_per_microbatch)
    layout = HeteroLayout.parse(cfg.layout).validate(shapes, world_size=world)
    assert layout.world_size == world
    assert set(layout.modules) == set(run_model(cfg.model).keys)
    assert checks.check_run(cfg, world).layout == layout
    # a microbatch is exactly what every module's DP can share, no more
    assert cfg.data.rows_per_microbatch % registry.rows_for(cfg.layout) == 0
    frozen = (cfg.model.freeze_vision, cfg.model.freeze_audio, cfg.model.freeze_llm)
    if name.endswith("_pretrain"):
        assert cfg.name.endswith("_pretrain")
        assert frozen == (cfg.model.vision is not None, cfg.model.audio is not None, True)
    else:
        assert cfg.name.endswith("_finetune") and frozen == (False, False, False)
    if gpus is None:  # tiny: registry tiny LLM, synthetic data, a short CPU run
        assert cfg.model.llm == "nemotron_h_tiny_dense" and cfg.data.path is None and cfg.trainer.max_steps <= 20


def test_full_sizes_default_to_the_planner_layout_and_grow_by_dp():
    for name, planned in PLANNED.items():
        cfg = fdl.build(registry.recipe(name))
        assert cfg.layout == str(HeteroLayout.parse(planned.layout)) and cfg.data.seq_length == planned.workload.seq_length
        assert cfg.data.rows_per_microbatch * cfg.data.microbatches == planned.workload.global_batch
        big = HeteroLayout.parse(fdl.build(registry.recipe(name, gpus=4 * planned.gpus)).layout)
        assert big.world_size == 4 * planned.gpus
        assert all(big[k].dp_size == 4 * m.dp_size for k, m in HeteroLayout.parse(planned.layout).modules.items())


def test_recipe_families_pick_the_named_modules():
    vl, video, omni = (fdl.build(registry.recipe(n)) for n in ("nemotron_vl_12b", "nemotron_video_12b",
                                                                "nemotron_omni_30b_a3b"))
    assert (vl.model.vision, vl.model.llm, vl.model.audio) == ("radio_vit_h", "nemotron_nano_12b_v2", None)
    assert (video.model.vision, video.model.llm) == (vl.model.vision, vl.model.llm)
    assert video.model.video_pruning > 0 and video.data.video_frames > vl.data.video_frames
    assert (omni.model.vision, omni.model.audio, omni.model.llm) == (
        "radio_vit_h", "fastconformer_parakeet_0_6b", "nemotron_3_nano_30b_a3b")
    tiny_video = fdl.build(registry.recipe("nemotron_video_tiny"))
    assert HeteroLayout.parse(tiny_video.layout).placement == "non-colocated" and tiny_video.model.video_pruning > 0


def test_pretrain_stage_raises_lr_over_finetune():
    for base in registry.BASES:
        pre, fin = fdl.build(registry.recipe(f"{base}_pretrain")), fdl.build(registry.recipe(base))
        assert pre.optim.lr == pytest.approx(10 * fin.optim.lr)


def test_unknown_recipe_and_gpu_count_errors_list_choices():
    with pytest.raises(ValueError, match="nemotron_vl_tiny_pretrain"):
        registry.recipe("nemotron_vl_tny")
    with pytest.raises(ValueError, match=r"gpus in \[8, 16\] or a multiple of 16"):
        registry.recipe("nemotron_vl_12b", gpus=12)


@pytest.mark.parametrize("base", sorted(registry.BASES))
def test_encoder_swap_resolves_and_validates(base):
    world = registry.default_gpus(base) if base in FULL else registry.TINY_WORLD
    for modality in checks.MODALITIES:
        cfg = registry.recipe(base)
        if getattr(cfg.model, modality) is None:
            continue
        for name in checks.encoder_names(modality):
            cfg.model.__setattr__(modality, name)
            built = fdl.build(cfg)
            assert getattr(built.model, modality) == name
            checks.check_run(built, world)


def test_name_checks_reject_wrong_modality_and_unknown_llm():
    m = ModelConfig(vision="fastconformer_tiny")
    with pytest.raises(ValueError, match="modality 'audio'.*radio_vit_tiny"):
        checks.check_names(m)
    with pytest.raises(ValueError, match="nemotron_h_tiny_dense"):
        checks.check_names(ModelConfig(llm="llama"))


def _run(layout: str, **model) -> RunConfig:
    return RunConfig(layout=layout, model=ModelConfig(**model), data=DataConfig(rows_per_microbatch=4))


def test_empty_layout_is_every_module_dp_on_the_world():
    hl = checks.check_run(_run("", audio="fastconformer_tiny"), 4).layout
    assert str(hl) == "vision=dp4@0-3;audio=dp4@0-3;language=dp4@0-3"


def test_an_added_encoder_gets_a_layout_derived_from_the_recipes():
    # colocated recipe layout: the new encoder joins the existing encoder's ranks, data-parallel
    hl = checks.check_run(_run("vision=dp4@0-3;language=tp2,dp2@0-3", audio="fastconformer_tiny"), 4).layout
    assert str(hl) == "vision=dp4@0-3;audio=dp4@0-3;language=tp2,dp2@0-3"
    # non-colocated: on the encoder ranks, not the LLM's
    hl = checks.check_run(_run("vision=dp2@0-1;language=tp2@2-3", audio="fastconformer_tiny"), 4).layout
    assert str(hl) == "vision=dp2@0-1;audio=dp2@0-1;language=tp2,dp1@2-3"
    # no encoder in the layout: on the LLM's ranks
    hl = checks.check_run(_run("language=tp2,dp2@0-3", vision=None, audio="fastconformer_tiny"), 4).layout
    assert str(hl) == "audio=dp4@0-3;language=tp2,dp2@0-3"


def test_a_dropped_encoder_leaves_its_layout_entry_only_when_ranks_are_shared():
    hl = checks.check_run(_run("vision=dp4@0-3;language=dp4@0-3", vision=None), 4).layout
    assert str(hl) == "language=dp4@0-3"
    with pytest.raises(LayoutError, match=r"no 'vision' module, and ranks 0-1 hold nothing else"):
        checks.check_run(_run("vision=dp2@0-1;language=tp2@2-3", vision=None), 4)


def test_the_one_resolution_scales_handles_auto_and_refuses_what_cannot_train():
    # a 4-rank layout launched on 8 ranks grows by data parallelism
    hl = checks.check_run(RunConfig(layout="vision=dp2@0-1;language=tp2@2-3",
                                    data=DataConfig(rows_per_microbatch=4)), 8).layout
    assert str(hl) == "vision=dp4@0-3;language=tp2,dp2@4-7"
    # auto: the planner's best trainable layout, valid for this world
    auto = checks.check_run(_run("auto"), 4).layout
    from tessera.hetero.plan.trainable import untrainable_reasons

    assert auto.world_size == 4 and untrainable_reasons(auto, run_model(_run("auto").model).encoder_tp) == []
    # the trainer's rule, before launch: an encoder's cp x pp, and audio TP
    for bad, why in (("vision=cp2,pp2@0-3;language=dp4@0-3", "splits over cp or pp, not both"),
                     ("vision=dp4@0-3;audio=cp2,pp2@0-3;language=dp4@0-3", "audio encoder splits over cp or pp"),
                     ("vision=dp4@0-3;audio=tp2,dp2@0-3;language=dp4@0-3", "audio encoder has no tensor parallelism")):
        with pytest.raises(LayoutError, match=re.escape(why)):
            checks.check_run(_run(bad, audio="fastconformer_tiny"), 4)


def test_override_keys_are_checked():
    fn = ENTRYPOINTS["finetune"]
    checks.check_overrides(fn, ["model.vision=siglip_tiny", "trainer.max_steps*=2", 'layout="x"', "--yes"])
    with pytest.raises(ValueError, match="trainer has no 'max_stepz'; its keys: max_steps"):
        checks.check_overrides(fn, ["trainer.max_stepz=3"])
    with pytest.raises(ValueError, match="layout is a plain value"):
        checks.check_overrides(fn, ["layout.tp=2"])


def test_local_executor_takes_the_layout_world_size():
    ex = fdl.build(executors.local())
    assert executors.fit_executor(ex, 4) == 4 and ex.ntasks_per_node == 4 and ex.launcher == "torchrun"
    assert ex.env_vars.get("OMP_NUM_THREADS") == "1"  # this box has no GPU
    assert Path(ex.env_vars["PATH"].split(":")[0], "torchrun").exists()  # found without an activated venv
    ex = fdl.build(executors.local(ntasks_per_node=2))
    with pytest.raises(ValueError, match="needs 4 ranks but run.executor.ntasks_per_node=2"):
        executors.fit_executor(ex, 4)
    with pytest.raises(ValueError, match="add run.executor=local"):
        executors.fit_executor(None, 4)


def test_slurm_executor_world_size_is_checked_before_submission():
    ex = fdl.build(executors.slurm(account="a", nodes=2, gpus_per_node=8))
    assert executors.fit_executor(ex, 16) == 16 and ex.ntasks_per_node == 8
    assert isinstance(ex.tunnel, run.LocalTunnel) and ex.tunnel.job_dir == "" and type(ex.packager) is run.Packager
    assert Path(ex.env_vars["PATH"].split(":")[0], "torchrun").exists()
    with pytest.raises(ValueError, match=r"nodes x tasks per node = 2 x 8 = 16"):
        executors.fit_executor(fdl.build(executors.slurm(nodes=2, gpus_per_node=8)), 8)
    cpu = fdl.build(executors.slurm())  # no GPUs: one node, tasks from the layout
    assert executors.fit_executor(cpu, 4) == 4 and cpu.ntasks_per_node == 4
    ssh = fdl.build(executors.slurm(ssh_host="login", ssh_user="me", remote_job_dir="/lustre/me/jobs"))
    assert isinstance(ssh.tunnel, run.SSHTunnel) and ssh.tunnel.host == "login" and "PATH" not in ssh.env_vars


def test_executors_carry_the_users_encoder_modules_to_every_rank(monkeypatch):
    # README "Add an encoder": the family's module, named in the launching shell, reaches the job's processes even
    # where they do not inherit that shell (a container, another machine)
    from tessera.models.encoders import MODULES_ENV

    monkeypatch.delenv(MODULES_ENV, raising=False)
    assert MODULES_ENV not in fdl.build(executors.local()).env_vars
    monkeypatch.setenv(MODULES_ENV, "my_vit,lab.encoders")
    for ex in (executors.local(), executors.slurm(container_image="img.sqsh"),
               executors.slurm(ssh_host="login", remote_job_dir="/j")):
        assert fdl.build(ex).env_vars[MODULES_ENV] == "my_vit,lab.encoders"


def test_executor_overrides_route_to_factory_arguments_and_fields():
    ctx = TesseraRunContext(name="t")
    cfg = ctx.parse_executor("slurm", "nodes=2", "gpus_per_node=8", "ssh_host=login", "remote_job_dir=/j", "mem=0")
    ex = fdl.build(cfg)
    assert (ex.nodes, ex.gpus_per_node, ex.mem, ex.tunnel.host) == (2, 8, "0", "login")
    with pytest.raises(ValueError, match="executors: local, slurm"):
        ctx.parse_executor("locl")


def test_every_entrypoint_lists_every_base_and_its_own_stage():
    for stage, entry in ENTRYPOINTS.items():
        names = factories_of(entry)
        assert set(registry.BASES) <= set(names) and all(f"{b}_{stage}" in names for b in registry.BASES)
        task = run.cli.resolve_factory(entry, "nemotron_omni_tiny")()
        assert task.__fn_or_cls__ is entry and task.model.freeze_llm == (stage == "pretrain")


# ---- the real CLI, as a user types it ---------------------------------------------------------------------

def _nemo(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="250")  # wide: rich would truncate the tables
    return subprocess.run([str(NEMO), "tessera", *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_help_lists_recipes_encoders_and_executors():
    p = _nemo("finetune", "--help")
    assert p.returncode == 0, p.stderr
    for name in [*registry.BASES, "siglip_tiny", "radio_vit_h", "fastconformer_tiny", "nemotron_nano_12b_v2",
                 "local", "slurm"]:
        assert name in p.stdout, name


def test_cli_dryrun_prints_the_resolved_config():
    p = _nemo("finetune", "--factory", "nemotron_vl_tiny", "model.vision=siglip_tiny",
              "layout=vision=dp4@0-3;language=tp2,dp2@0-3", "trainer.max_steps=20", "run.executor=local", "--dryrun")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "vision='siglip_tiny'" in p.stdout and "ntasks_per_node=4" in p.stdout
    assert "'vision=dp4@0-3;language=tp2,dp2@0-3'" in p.stdout and "max_steps=20" in p.stdout


@pytest.mark.parametrize("args,message", [
    (["--factory", "nemotron_vl_tny"], "unknown recipe 'nemotron_vl_tny' for `tessera finetune`; recipes: "),
    (["--factory", "nemotron_vl_tiny", "model.vision=clip_l"], "registered vision encoders"),
    (["--factory", "nemotron_vl_tiny", "trainer.max_stepz=3"], "trainer has no 'max_stepz'; its keys: max_steps"),
    # what the trainer cannot run is refused before launch (not on the ranks after a Slurm queue)
    (["--factory", "nemotron_vl_tiny", "layout=vision=cp2,pp2@0-3;language=tp2,dp2@0-3"],
     "the vision encoder splits over cp or pp, not both"),
    (["--factory", "nemotron_omni_tiny", "layout=vision=dp4@0-3;audio=tp2,dp2@0-3;language=tp2,cp2@0-3"],
     "the audio encoder has no tensor parallelism"),
])
def test_cli_errors_name_what_exists(args, message):
    p = _nemo("finetune", *args, "run.executor=local", "--dryrun")
    out = p.stdout + p.stderr
    assert p.returncode == 1 and message in out, out


def test_cli_layout_auto_prints_the_layout_it_chose_before_launch():
    p = _nemo("finetune", "--factory", "nemotron_vl_tiny", "layout=auto", "run.executor=local", "--dryrun")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    chosen = re.search(r"^layout: (\S+) \(4 ranks, chosen by the planner\)$", p.stdout, flags=re.M)
    assert chosen, out
    # the task launched carries the resolved layout, not "auto", so every rank trains exactly that one
    assert re.search(r"layout\s*│\s*'" + re.escape(chosen.group(1)) + "'", p.stdout), out
    cfg = fdl.build(registry.recipe("nemotron_vl_tiny"))
    resolved = checks.check_run(RunConfig(layout=chosen.group(1), model=cfg.model, data=cfg.data), 4)
    assert str(resolved.layout) == chosen.group(1)


def test_cli_plan_ranks_only_trainable_layouts_first():
    p = _nemo("plan", "--factory", "nemotron_video_12b", "gpus=16", "--yes")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    first = re.search(r"^\s*1\s.*?((?:\w+=[\w,]+@\d+-\d+;?)+)", p.stdout, flags=re.M)
    assert first, out
    from tessera.hetero.plan.trainable import untrainable_reasons

    cfg = fdl.build(registry.recipe("nemotron_video_12b"))
    assert untrainable_reasons(HeteroLayout.parse(first.group(1)), run_model(cfg.model).encoder_tp) == [], first.group(1)



@pytest.mark.parametrize("name", sorted(FULL))
def test_a_full_recipe_sized_for_its_gpus_runs_and_plans_its_default_on_four_times_as_many(name):
    """`nemo tessera finetune --factory NAME` (sized for PLANNED gpus) launched on 4x the GPUs: the default layout
    grows by DP, the step's rows are re-split so every DP gets whole rows (same global batch), and the planner's
    first trainable layout there is not ranked below an untrainable one for want of rows."""
    from tessera.hetero.planner.run_layout import best_layout_for_run, plan_table_for_run

    cfg = fdl.build(registry.recipe(name))
    gpus, step = 4 * PLANNED[name].gpus, cfg.data.rows_per_microbatch * cfg.data.microbatches
    resolved = checks.check_run(cfg, gpus)
    hl = resolved.layout
    assert str(hl) == str(HeteroLayout.parse(registry.full_layout(name, gpus)))
    assert resolved.rows_per_microbatch * resolved.microbatches == step
    assert all(resolved.rows_per_microbatch % m.dp_size == 0 for m in hl.modules.values())
    if name != "nemotron_vl_12b":  # the planner's search takes ~10 s a recipe: one recipe shows it
        return
    table = plan_table_for_run(fdl.build(registry.recipe(name)), gpus)
    assert "cannot take an equal share" not in table, table
    best = best_layout_for_run(fdl.build(registry.recipe(name)), gpus)
    assert re.search(r"^\s*1\s.*" + re.escape(best) + "$", table, flags=re.M), (best, table)


@pytest.mark.parametrize("name,gpus", [("nemotron_vl_12b", 8), ("nemotron_vl_12b", 16), ("nemotron_video_12b", 8),
                                       ("nemotron_video_12b", 16), ("nemotron_omni_30b_a3b", 32)])
def test_full_recipe_defaults_are_the_planners_best_trainable_layout(name, gpus):
    """Issue 16 item 3: the default at the recipe's own GPU count and at the counts its layout cannot be scaled to
    is the planner's best layout that this run trains and that fits (larger counts grow it by DP)."""
    from tessera.hetero.planner.run_layout import best_layout_for_run

    cfg = fdl.build(registry.recipe(name, gpus=gpus))
    best = best_layout_for_run(fdl.build(registry.recipe(name, gpus=gpus)), gpus)
    assert str(HeteroLayout.parse(cfg.layout)) == str(HeteroLayout.parse(best))


@pytest.mark.parametrize("name,gpus", [("nemotron_vl_12b", 16), ("nemotron_omni_30b_a3b", 32)])
def test_the_planner_prices_the_microbatches_the_trainer_runs(name, gpus):
    """For a run, every layout the planner ranks and the trainer can run is priced at the trainer's own split of
    the step (ResolvedRun: rows per microbatch and microbatches), not at a split of the planner's own."""
    from tessera.hetero.planner.run_layout import ranked_for_run
    from tessera.hetero.plan.layout import LayoutError
    from tessera.hetero.runspec.modules import resolve_config

    cfg = fdl.build(registry.recipe(name))
    compared = 0
    for pred in ranked_for_run(cfg, gpus)[:40]:
        try:
            resolved = resolve_config(cfg, gpus, layout=pred.layout)
        except LayoutError:
            continue  # the trainer refuses it (the plan table marks it)
        lang_dp = resolved.layout["language"].dp_size
        assert (pred.micro_batch * lang_dp, pred.microbatches) == (resolved.rows_per_microbatch,
                                                                   resolved.microbatches), pred.layout
        compared += 1
    assert compared >= 10, compared


def test_a_scalar_override_that_does_not_parse_is_named_plainly():
    """Issue 62 item 7: trainer.max_steps=three got nemo-run's error wrapped in itself twice."""
    from tessera.recipes.cli import finetune

    with pytest.raises(ValueError) as e:
        checks.check_overrides(finetune, ["trainer.max_steps=three"])
    assert str(e.value) == "trainer.max_steps=three: give an integer, e.g. trainer.max_steps=3"
    with pytest.raises(ValueError, match=r"optim.lr=fast: give a number, e.g. optim.lr=0.5"):
        checks.check_overrides(finetune, ["optim.lr=fast"])
    checks.check_overrides(finetune, ["trainer.max_steps=3", "optim.lr=1e-4", "trainer.run_dir=x"])
