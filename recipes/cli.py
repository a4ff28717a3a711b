"""The `nemo tessera` CLI: entry points `pretrain` and `finetune`, every recipe as a --factory, executors.

    nemo tessera finetune --help                                   # recipes, encoders, LLMs, executors
    nemo tessera finetune --factory nemotron_vl_tiny model.vision=siglip_tiny \
        layout="vision=dp4@0-3;language=tp2,dp2@0-3" trainer.max_steps=20 run.executor=local --yes
    nemo tessera pretrain --factory nemotron_omni_tiny run.executor=local --dryrun   # resolved config, no run
    nemo tessera finetune --factory "nemotron_vl_12b(gpus=16)" run.executor=slurm run.executor.nodes=2 \
        run.executor.gpus_per_node=8 run.executor.account=ACC --yes

Registered with nemo-run through pyproject's `[project.entry-points."nemo_run.cli"] tessera = "tessera.recipes.cli"`.
Conventions are nemo-run's: `key=value` overrides, `run.executor=NAME` (+ `run.executor.field=v`), `--yes`
skips the prompt (`plan` launches nothing and never asks); `--to-yaml FILE` writes the task, `--yaml FILE` runs it
again. Before anything launches, TesseraRunContext checks the recipe name, every override key,
the encoder/LLM names against the registries and the layout against the model and the executor's ranks,
and prints one line naming what is wrong and what exists (nemo-run's own errors are far from the cause).
"""


import functools
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import fiddle as fdl
import nemo_run as run
from nemo_run.cli import cli_parser
from nemo_run.cli.api import RunContext

from tessera.hetero.plan.layout import HeteroLayout
from tessera.recipes import checks, elastic, executors, prelaunch, registry
from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
from tessera.recipes.overrides import apply_overrides  # noqa: F401  (also teaches nemo-run's parser our field types)

NAMESPACE = "tessera"



def _resolve_hub_id(task, executor) -> None:
    """model.checkpoint=ORG/NAME[@REV] -> its snapshot in the local HF cache (models/hub_cache.py), before anything
    reads it: every rank gets the directory. A cluster's paths (an SSH-tunnelled executor) are not looked up here."""
    from tessera.models.hub_cache import local_checkpoint

    model = getattr(task, "model", None)
    if model is None or not getattr(model, "checkpoint", None) or prelaunch._remote(executor):
        return
    path = local_checkpoint(model.checkpoint)
    if path != model.checkpoint:
        print(f"model.checkpoint: {model.checkpoint} -> {path} (the local Hugging Face cache)", flush=True)
        model.checkpoint = path


@dataclass(kw_only=True)
class TesseraRunContext(RunContext):
    """nemo-run's RunContext plus Tessera's pre-launch checks and executor sizing."""

    def cli_execute(self, fn, args, entrypoint_type="task"):
        """nemo-run's, with Tessera's refusals (a bad override, layout, input: ValueError, LookupError, OSError
        and their kinds, each naming the thing and the fix) raised as nemo-run's RunContextError, which it prints
        as `Error: ...`; anything else stays its `Unexpected error: ...` (a bug, not the user's input)."""
        from nemo_run.cli.api import RunContextError

        try:
            return super().cli_execute(fn, args, entrypoint_type)
        except RunContextError:
            raise
        except (ValueError, LookupError, OSError) as e:
            raise RunContextError(str(e)) from e

    def parse_fn(self, fn, args, **default_kwargs):
        _check_factory(fn, self.factory)
        checks.check_overrides(fn, args)
        task = _exported_task(fn, self.yaml, self.factory, args) or super().parse_fn(fn, args, **default_kwargs)
        _resolve_hub_id(task, getattr(self, "executor", None))
        checks.check_names(task.model)
        if fn.__name__ == "plan":  # nothing is launched: no executor to size
            return task
        spec = (task.layout or "").strip()
        layout_world = HeteroLayout.parse(spec).world_size if spec and spec != "auto" else None
        world = executors.fit_executor(getattr(self, "executor", None), layout_world)
        split = (task.data.rows_per_microbatch, task.data.microbatches)
        resolved = checks.check_run(task, world)  # may re-split the step's rows so that every DP gets whole rows
        layout = resolved.layout
        if split != (resolved.rows_per_microbatch, resolved.microbatches):
            print(f"data: rows_per_microbatch={resolved.rows_per_microbatch} microbatches={resolved.microbatches} "
                  f"(was {split[0]} x {split[1]}: the same {split[0] * split[1]} rows per step, whole rows for every "
                  f"module's DP in {layout})", flush=True)
        if spec != str(layout):  # "", auto, a scaled or completed layout: every rank gets the resolved one
            print(f"layout: {layout} ({world} ranks{', chosen by the planner' if spec == 'auto' else ''})",
                  flush=True)
            task.layout = str(layout)
        elastic.check_launch(task, getattr(self, "executor", None), world)
        if resolved.cp_line():  # which LLM layers run head-parallel (fused kernels) and which stay on torch kernels
            print(resolved.cp_line(), flush=True)
        prelaunch.check_inputs(task, getattr(self, "executor", None), dryrun=self.dryrun)
        for mount in executors.mount_run_paths(getattr(self, "executor", None), task):  # container_image only
            print(f"slurm: container mount {mount}", file=sys.stderr, flush=True)
        return task

    def _execute_task(self, fn, task_args):
        """nemo-run's task path (parse, dry run, confirm, launch), but the job's outcome is the exit status.

        nemo-run's run.run() waits for the job and returns nothing, so `nemo` exited 0 whatever the ranks
        did. Here the same Experiment is run, and a job that did not end SUCCEEDED (local torchrun's exit
        code, Slurm's sacct state) prints the failing rank's last lines and exits 1. Direct runs (no
        executor: an exception already exits 1), --detach, --repl and --to-yaml/... stay nemo-run's."""
        if fn.__name__ == "plan" and not (self.repl or any([self.to_yaml, self.to_toml, self.to_json])):
            return self._print_plan(fn, task_args)
        if self.direct or self.detach or self.repl or any([self.to_yaml, self.to_toml, self.to_json]) \
                or getattr(self, "executor", None) is None:
            return super()._execute_task(fn, task_args)
        from nemo_run.cli.api import RunContextError
        from rich.console import Console

        console = Console()
        task = self.parse_fn(fn, task_args)
        if fn.__name__ != "plan":
            executors.request_gpus(self.executor, task.model)
            prelaunch.check_save_schedule(task, self.executor, dryrun=self.dryrun)
        run.dryrun_fn(task, executor=self.executor)
        if self.dryrun:
            console.print(f"[bold cyan]Dry run for {self.name}:[/bold cyan]")
            return
        if not self._should_continue(self.skip_confirmation):
            console.print("[bold cyan]Exiting...[/bold cyan]")
            return
        console.print(f"[bold cyan]Launching {self.name}...[/bold cyan]")
        # no goodbye: nemo-run's 12 lines of how to reconstruct the experiment would follow the run's own summary
        with run.Experiment(title=self.name, executor=self.executor, enable_goodbye_message=False) as exp:
            exp.add(task, tail_logs=True, plugins=getattr(self, "plugins", None), name=self.name)
            exp.run(detach=False)
        executors.wait_out_requeues(exp)
        failure = executors.job_failure(exp)
        if failure:
            raise RunContextError(failure)

    def _print_plan(self, fn, task_args):
        """`plan` prints a table here and launches nothing, so it runs as nemo-run runs a task without an
        executor (run.run(direct=True): the function, in this process), minus the `Continue? [y/N]` and
        "Launching" that nemo-run's task path puts before every run (with stdin closed that prompt failed)."""
        task = self.parse_fn(fn, task_args)
        if self.dryrun:
            run.dryrun_fn(task)
            print(f"Dry run for {self.name}: nothing planned", flush=True)
            return
        run.run(task, direct=True)

    def parse_executor(self, name, *args):
        """`run.executor=NAME run.executor.k=v ...`: k that are the factory's arguments go to the factory
        (the tunnel and packager follow from ssh_host, so they must be known when it runs), the rest are
        applied to the executor's fields as nemo-run does."""
        if name not in executors.EXECUTORS:
            raise ValueError(f"unknown executor run.executor={name!r}; executors: {', '.join(executors.EXECUTORS)}")
        factory = executors.EXECUTORS[name]
        params = inspect.signature(factory).parameters
        mine = [a for a in args if re.split(r"[-+*/|&]?=", a, maxsplit=1)[0] in params]
        cfg = fdl.build(cli_parser.parse_cli_args(factory, mine, output_type=run.Partial))()
        return cli_parser.parse_cli_args(cfg, [a for a in args if a not in mine])


def _exported_task(fn, yaml, factory, args) -> run.Partial | None:
    """The task in a file that --to-yaml / --to-toml / --to-json wrote, with `args` applied; None for any other
    --yaml (nemo-run's overrides-by-key files). Such a file is the whole serialized run.Partial (top-level
    `_target_`, `_partial_`), which nemo-run's --yaml loader reads as arguments of `fn` (it fails on `_partial_`),
    and nemo-run's ConfigSerializer.load turns back into CLI strings (`name: nemotron_vl_tiny_pretrain` became
    the factory of that name); _buildable inverts the YAML representers that wrote it instead."""
    if not yaml or not Path(yaml).is_file():
        return None  # nemo-run's loader names the missing file
    from nemo_run.cli.config import ConfigSerializer

    raw = ConfigSerializer().load_dict(yaml)  # yaml, json or toml, by extension, as --to-* wrote it
    if not isinstance(raw, dict) or "_target_" not in raw:
        return None
    task = _buildable(raw)
    if getattr(task, "__fn_or_cls__", None) is not fn:
        raise ValueError(f"--yaml {yaml} is a task of {raw['_target_']}, not of `{NAMESPACE} {fn.__name__}`; "
                         f"export it with `{NAMESPACE} {fn.__name__} ... --to-yaml FILE`")
    if factory:
        raise ValueError(f"--yaml {yaml} is a whole task (written by --to-yaml): drop --factory {factory}, "
                         f"or override its fields with key=value")
    return cli_parser.parse_cli_args(task, list(args))


def _buildable(node):
    """The inverse of nemo-run's YAML representers (nemo_run/core/serialization/yaml.py): a mapping with
    `_target_` is a run.Config of it (run.Partial with `_partial_: true`; the object itself with `_call_: false`);
    values keep the types the file holds, as the serializer wrote them."""
    if isinstance(node, list):
        return [_buildable(v) for v in node]
    if not isinstance(node, dict):
        return node
    if "_target_" not in node:
        return {k: _buildable(v) for k, v in node.items()}
    node = dict(node)
    module, _, attr = node.pop("_target_").rpartition(".")
    target = getattr(importlib.import_module(module), attr)
    if node.pop("_call_", True) is False:
        return target
    kind = run.Partial if node.pop("_partial_", False) else run.Config
    return kind(target, **{k: _buildable(v) for k, v in node.items()})


def _check_factory(fn, factory) -> None:
    if not isinstance(factory, str):
        return
    name = re.match(r"^\s*([\w.]+)", factory)
    known = factories_of(fn)
    if name and name.group(1) not in known and "." not in name.group(1):
        raise ValueError(f"unknown recipe {name.group(1)!r} for `{NAMESPACE} {fn.__name__}`; recipes: "
                         f"{', '.join(known)}")


def _help(stage: str) -> str:
    # nemo-run shows this string on --help; the lists come from the registries, so they never go stale
    return (f"{stage} a Nemotron-style multimodal model (recipes/cli.py). Recipes: --factory NAME, "
            f"'NAME(gpus=16)' for full sizes. Encoders (model.vision=...): "
            f"{', '.join(checks.encoder_names('vision'))}. Audio encoders (model.audio=...): "
            f"{', '.join(checks.encoder_names('audio'))}. LLMs (model.llm=...): {', '.join(checks.llm_names())}. "
            f"Executors (run.executor=...): {', '.join(executors.EXECUTORS)}.")


@run.cli.entrypoint(namespace=NAMESPACE, run_ctx_cls=TesseraRunContext, help=_help("Pre-train (projector alignment)"))
def pretrain(model: ModelConfig, data: DataConfig, optim: OptimConfig, trainer: TrainerConfig, layout: str = "",
             name: str = "tessera") -> dict:
    """Stage 1: train the projectors with the encoders (and the LLM) frozen, as the *_pretrain recipes set."""
    from tessera.recipes.train import train  # lazily: torch, megatron and the models load only on the ranks

    return train(model=model, data=data, optim=optim, trainer=trainer, layout=layout, name=name)


@run.cli.entrypoint(namespace=NAMESPACE, run_ctx_cls=TesseraRunContext, help=_help("Fine-tune"))
def finetune(model: ModelConfig, data: DataConfig, optim: OptimConfig, trainer: TrainerConfig, layout: str = "",
             name: str = "tessera") -> dict:
    """Stage 2: train every module not frozen by the recipe, from model.checkpoint when given."""
    from tessera.recipes.train import train

    return train(model=model, data=data, optim=optim, trainer=trainer, layout=layout, name=name)


@run.cli.entrypoint(namespace=NAMESPACE, run_ctx_cls=TesseraRunContext,
                    help="Rank heterogeneous layouts of a recipe with the planner's cost model (hetero/planner): "
                         "nemo tessera plan --factory nemotron_vl_12b gpus=64 cluster=h100")
def plan(model: ModelConfig, data: DataConfig, optim: OptimConfig, trainer: TrainerConfig, layout: str = "",
         name: str = "tessera", gpus: int = 0, cluster: str = "h100", top: int = 10) -> str:
    """Print the top layouts for `gpus` GPUs of `cluster` (0: the recipe's own layout size) with the
    predicted gain over the best homogeneous layout; nothing is launched."""
    from tessera.hetero.planner.run_layout import plan_table_for_run
    from tessera.hetero.runspec.config import RunConfig

    cfg = RunConfig(name, layout, model, data, optim, trainer)
    gpus = gpus or (HeteroLayout.parse(layout).world_size if layout and layout != "auto" else 8)
    table = plan_table_for_run(cfg, gpus, cluster, top)
    print(f"{name}: top layouts on {gpus} x {cluster}\n{table}", flush=True)
    return table


ENTRYPOINTS = {"pretrain": pretrain, "finetune": finetune, "plan": plan}


def as_task(cfg: run.Config, entry) -> run.Partial:
    """A recipe's run.Config[RunConfig] as the run.Partial of an entry point that nemo-run launches."""
    return run.Partial(entry, model=cfg.model, data=cfg.data, optim=cfg.optim, trainer=cfg.trainer,
                       layout=cfg.layout, name=cfg.name)


def _register(entry, name: str, base, stage: str) -> None:
    @functools.wraps(base)  # keeps the base's signature (gpus=...) and docstring for --help and NAME(args)
    def factory(*args, **kwargs) -> run.Partial:
        # `plan` ranks layouts of the recipe as fine-tuned (the stage changes no shape the planner prices)
        return as_task(registry.STAGES.get(stage, registry.finetune_stage)(base(*args, **kwargs)), entry)

    run.cli.factory(factory, target=entry, name=name)


def factories_of(entry) -> list[str]:
    """The --factory names an entry point accepts (what its --help lists)."""
    return sorted([*registry.BASES, *(f"{b}_{entry.__name__}" for b in registry.BASES)])


# Each entry point takes the bare base name as its own stage (NeMo's `llm pretrain --factory llama3_8b`) and
# the explicit `<base>_<stage>` name of that stage.
for _stage, _entry in ENTRYPOINTS.items():
    for _name, _base in registry.BASES.items():
        _register(_entry, _name, _base, _stage)
        _register(_entry, f"{_name}_{_stage}", _base, _stage)
