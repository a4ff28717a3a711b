"""A Tessera checkpoint saved in any layout -> the Hugging Face layout, in one process on CPU.

    .venv/bin/python -m tessera.hetero.export.hf CHECKPOINT OUT [--max-shard-size 5GB]

The model is rebuilt with every module on one rank and dist_checkpointing reshards into it. Writes
  OUT/model.safetensors      the whole model in the NemotronH_Nano_VL_V2 / Omni key layout
                             (language_model.*, vision_model.*, mlp1.*, sound_encoder.*, sound_projection.*);
                             above --max-shard-size sharded as the releases are: model-0000i-of-0000n.safetensors
                             + model.safetensors.index.json (huggingface_hub's sharding, what save_pretrained uses);
                             from a release, also its tensors no module computes with (mtp.*, the Parakeet
                             featurizer's), copied unchanged (models/released.CARRIED)
  OUT/*.py                   from a release in the hub layout, its remote code (the auto_map targets of its
                             configs and the modules they import), copied byte for byte
  OUT/tokenizer.json|.model  the tokenizer the run trained with (its saved config names it,
                             hetero/build/run_state.resolve_inputs); when
                             that is the release's own (model.checkpoint=DIR), DIR's tokenizer files, chat template,
                             processor configs and generation_config.json as they are (data/run_tokenizer.py);
                             else tokenizer_config.json + chat_template.jinja of the turns Tessera trains
                             (data/templates.CHAT_TEMPLATE)
  OUT/generation_config.json the release's, or made from config.json's bos/eos/pad with the tokenizer's
                             <|im_end|> as an end of turn (what Tessera trains every assistant turn to end with)
  OUT/tessera.json           the run's model config (which encoders, which LLM), or, for a model fine-tuned
                             from a released checkpoint, OUT/config.json: the release's own (transformers
                             loads OUT like the release)
  OUT/config.json            for a model built from registry names, NemotronH_Omni_Reasoning_V3's config of it
                             when that architecture computes it alike (RADIO vision, Parakeet audio:
                             models/release_config.py), so transformers loads OUT too (its class, or
                             AutoModelForImageTextToText), with `architectures` and the media token ids of the
                             tokenizer OUT ships
  OUT/processor_config.json  with that config.json (the release's towers) and a tokenizer: transformers'
                             NemotronH_Omni_Reasoning_V3Processor of the run's patch budget, video grid and
                             tubelet, mel front end (hetero/export/processor.py)
  OUT/language_model/        config.json + model.safetensors: transformers' NemotronHForCausalLM loads it
A LoRA run (model.lora.rank > 0, hetero/build/lora.py) exports, per model.lora.export:
  merged     the files above with every adapted weight W + (alpha/r) B A (a plain model: no adapters needed)
  adapters   OUT/adapters/adapter_model.safetensors + adapter_config.json only: PEFT's files
             (base_model.model.<module>.lora_A.weight [r, in], .lora_B.weight [out, r]) naming the modules of
             the model transformers builds from OUT, so PeftModel.from_pretrained applies them
             (hetero/export/peft.py); a fused megatron linear_qkv becomes q/k/v_proj sharing its A,
             each with its rows of B
  both       (default) both of the above
The training loop runs this module in its own process after the last step (`trainer.export_hf`);
scripts/convert_hf.py is the user's command around it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from tessera.hetero.checkpoint.source import RUN, checkpoint_source


MAX_SHARD_SIZE = "5GB"  # huggingface_hub's default shard size (save_pretrained's), as the releases are cut


def _fields(model_cfg) -> dict:
    return dataclasses.asdict(model_cfg) if dataclasses.is_dataclass(model_cfg) else dict(vars(model_cfg))


def _single_rank_model(model_cfg, hf_fields: dict):
    """Every module of the model on rank 0 (dp1), as the training code builds it."""
    from tessera.hetero.runtime.groups import build_module_groups
    from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout
    from tessera.hetero.build.model_build import build_rank_modules, module_configs
    from tessera.hetero.runspec.modules import encoder_names

    keys = sorted(encoder_names(model_cfg)) + [LANGUAGE]
    layout = HeteroLayout.parse(";".join(f"{k}=dp1@0-0" for k in keys))
    groups = build_module_groups(layout)
    configs = module_configs(layout, hf_fields)
    return build_rank_modules(model_cfg, layout, groups, configs), groups, configs


def save_weights(tensors: dict, directory: Path, max_shard_size: int | str = MAX_SHARD_SIZE) -> None:
    """directory/model.safetensors, or its shards + model.safetensors.index.json above max_shard_size (a previous
    export's weight files are removed first: huggingface_hub's save_torch_state_dict)."""
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(tensors, directory, max_shard_size=max_shard_size)


def write_hf(out: Path, full: dict, model_cfg, hf_fields: dict, tokenizer: str | None = None,
             max_shard_size: int | str = MAX_SHARD_SIZE, data: dict | None = None) -> Path:
    """OUT/model.safetensors (or its shards) + config.json or tessera.json, the tokenizer files and
    generation_config.json (`tokenizer`: the run's, None = none written), processor_config.json of the run's
    media settings (`data`: its saved data config, None = the defaults) when the towers are the release's, +
    language_model/ loadable by transformers."""
    from tessera.models import released

    out.mkdir(parents=True, exist_ok=True)
    source = checkpoint_source(getattr(model_cfg, "checkpoint", None))
    from_release = source is not None and source.is_release
    # the release's tensors no module computes with (released.CARRIED: MTP layers, featurizer), as it has them
    save_weights({**full, **released.carried_tensors(source.given)} if from_release else full, out, max_shard_size)
    if from_release:
        # the same architecture as the released checkpoint it was fine-tuned from: its config.json describes
        # these tensors (transformers loads OUT as it loads the release; so does model.checkpoint=OUT)
        (out / "config.json").write_text((source.path / "config.json").read_text())
        (out / "tessera.json").unlink(missing_ok=True)
        _copy_remote_code(source.path, out)
    else:
        (out / "tessera.json").write_text(json.dumps({"model": _fields(model_cfg), "llm_hf_config": hf_fields},
                                                     indent=2))
        _write_release_config(out, full, model_cfg, hf_fields, tokenizer)
    write_serving_files(out, tokenizer, source.given if source is not None else None, hf_fields)
    if not from_release:  # a release's own processor files come with its tokenizer's (write_serving_files)
        from tessera.hetero.export.processor import write_processor

        write_processor(out, model_cfg, data)
    lm = out / "language_model"
    lm.mkdir(exist_ok=True)
    save_weights({k[len("language_model."):]: v for k, v in full.items() if k.startswith("language_model.")}, lm,
                 max_shard_size)
    from transformers import NemotronHConfig

    NemotronHConfig(**hf_fields).save_pretrained(str(lm))
    return out


def _copy_remote_code(src: Path, out: Path) -> None:
    """The release's remote code (its configs' auto_map targets and what they import), byte for byte: the hub
    layout's config.json names it, and trust_remote_code loaders (the release's own, vLLM's) run it."""
    import shutil

    from tessera.models.released import remote_code_files

    for name in remote_code_files(src):
        if (out / name).resolve() != (src / name).resolve():
            shutil.copyfile(src / name, out / name)


def write_serving_files(out: Path, tokenizer: str | None, source: str | None, hf_fields: dict) -> None:
    """What transformers / vLLM serve OUT with, next to config.json (module docstring). `source`: the run's
    model.checkpoint."""
    import shutil

    from tessera.data.run_tokenizer import RELEASE_FILES

    src = Path(source).expanduser() if source else None
    if src is not None and src.resolve() == out.resolve():
        return  # exported over the checkpoint it started from: its own files stay
    for name in RELEASE_FILES:  # a previous export's, which may be another tokenizer's (not the run's own)
        if tokenizer is None or (out / name).resolve() != Path(tokenizer).resolve():
            (out / name).unlink(missing_ok=True)
    own = tokenizer is not None and src is not None and Path(tokenizer).parent.resolve() == src.resolve()
    for name in RELEASE_FILES if own else ():
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    if tokenizer is not None and not own:
        _write_run_tokenizer(out, Path(tokenizer))
    elif tokenizer is None:
        print("export: the run's tokenizer is unknown or gone; no tokenizer files written", flush=True)
    if src is not None and not own and (src / "generation_config.json").is_file():  # the release's defaults
        shutil.copyfile(src / "generation_config.json", out / "generation_config.json")
    if not (out / "generation_config.json").exists():
        _write_generation_config(out, hf_fields, tokenizer)


def _write_run_tokenizer(out: Path, path: Path) -> None:
    """A tokenizer that is not a release's: the file, a tokenizer_config.json transformers loads it with (a
    SentencePiece .model is converted on load) and the chat template of the turns Tessera trains."""
    import shutil

    from tessera.data.templates import CHAT_TEMPLATE, IM_END
    from tessera.data.tokens import Tokenizer

    dest = out / ("tokenizer.json" if path.suffix == ".json" else "tokenizer.model")
    if dest.resolve() != path.resolve():
        shutil.copyfile(path, dest)
    tok = Tokenizer(path)
    pad = "<pad>" if tok.pad_id != tok.special[IM_END] else IM_END  # data/tokens.Tokenizer's pad rule
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": IM_END, "pad_token": pad}, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _write_generation_config(out: Path, hf_fields: dict, tokenizer: str | None) -> None:
    """From the LLM config's bos/eos/pad (config.json's text_config: its defaults where the run set none)."""
    from transformers import GenerationConfig, NemotronHConfig

    from tessera.data.templates import IM_END
    from tessera.data.tokens import Tokenizer

    llm = NemotronHConfig(**hf_fields)
    eos = [llm.eos_token_id]
    if tokenizer is not None and Tokenizer(tokenizer).special[IM_END] not in eos:
        eos.append(Tokenizer(tokenizer).special[IM_END])
    GenerationConfig(bos_token_id=llm.bos_token_id, eos_token_id=eos if len(eos) > 1 else eos[0],
                     pad_token_id=llm.pad_token_id).save_pretrained(str(out))


def _write_release_config(out: Path, full: dict, model_cfg, hf_fields: dict, tokenizer: str | None = None) -> None:
    """OUT/config.json of transformers' NemotronH_Omni_Reasoning_V3 for a model built from registry names,
    when that architecture computes it alike, with its class as `architectures` and the media token ids of the
    tokenizer the export ships; else a line saying why there is none."""
    from transformers import NemotronH_Omni_Reasoning_V3_Config

    from tessera.hetero.runspec.modules import release_config

    config, why = release_config(model_cfg, hf_fields, {k: tuple(v.shape) for k, v in full.items()})
    (out / "config.json").unlink(missing_ok=True)
    if config is None:
        print(f"export: no config.json for transformers' NemotronH_Omni_Reasoning_V3 ({why}); tessera.json "
              f"describes the model", flush=True)
        return
    NemotronH_Omni_Reasoning_V3_Config(**config, **media_token_ids(tokenizer),
                                       architectures=["NemotronH_Omni_Reasoning_V3"]).save_pretrained(str(out))


def media_token_ids(tokenizer: str | None) -> dict[str, int]:
    """{image,video,audio}_token_id: the ids of the media tags (data/templates.PROCESSOR_TAGS) in `tokenizer`, those
    it has; none without a tokenizer (the export then ships none either)."""
    if tokenizer is None:
        return {}
    from tessera.data.templates import PROCESSOR_TAGS
    from tessera.data.tokens import Tokenizer

    special = Tokenizer(tokenizer).special
    return {f"{kind}_token_id": special[tag] for kind, tag in PROCESSOR_TAGS.items() if tag in special}


def trained_tokenizer(saved: dict) -> str | None:
    """The tokenizer a run trained with, from its saved config: named there (hetero/build/run_state.resolve_inputs),
    or for a checkpoint saved before it was, chosen by the rule (data/run_tokenizer.run_tokenizer); None when it is
    gone."""
    from tessera.data.run_tokenizer import TokenizerMismatch, run_tokenizer

    data, model = saved.get("data") or {}, saved.get("model") or {}
    try:
        path = run_tokenizer(data.get("tokenizer"), model.get("checkpoint"), data.get("path")).path
    except TokenizerMismatch:
        return None
    return path if Path(path).is_file() else None


def load_trained(checkpoint: str | Path) -> tuple[dict, dict, SimpleNamespace, dict, dict]:
    """(modules, their groups, model config, LLM HF fields, saved run config) of a Tessera checkpoint (any layout;
    a run's checkpoints folder: its latest) on this one rank, LoRA adapters loaded and not merged: the model the
    run trained, as the export reads it. In the one-rank world its caller made (runtime/world.process_world)."""
    from megatron.core import dist_checkpointing

    from tessera.hetero.checkpoint.sharded import load_checkpoint
    from tessera.hetero.build.lora import apply_lora, lora_settings

    source = checkpoint_source(checkpoint)
    path = source.step if source.kind == RUN else source.path  # a run's checkpoints/ folder: its latest step
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    # the run's model config as saved (plain fields; model_build reads them by name)
    saved = json.loads(common["config"])
    model_cfg = SimpleNamespace(**saved["model"])
    hf_fields = json.loads(common["llm_hf_config"])
    modules, groups, configs = _single_rank_model(model_cfg, hf_fields)
    lora = lora_settings(model_cfg)
    if lora is not None:  # the adapters must exist to be loaded (their initial values do not matter)
        apply_lora(modules, groups, model_cfg, seed=0)
    load_checkpoint(path, modules, None, groups, configs)
    return modules, groups, model_cfg, hf_fields, saved


def export_checkpoint(checkpoint: str | Path, out: str | Path, max_shard_size: int | str = MAX_SHARD_SIZE) -> Path:
    """A Tessera checkpoint (any layout) -> HF layout files in `out`."""
    modules, _, model_cfg, hf_fields, saved = load_trained(checkpoint)
    return export_modules(modules, Path(out), model_cfg, hf_fields, trained_tokenizer(saved), max_shard_size,
                          saved.get("data"))


def export_modules(modules, out: Path, model_cfg, hf_fields: dict, tokenizer: str | None = None,
                   max_shard_size: int | str = MAX_SHARD_SIZE, data: dict | None = None) -> Path:
    """Write the one-rank model's modules in HF layout (LoRA: adapters and/or merged, model.lora.export)."""
    from tessera.hetero.build.lora import lora_settings, merge_lora
    from tessera.hetero.export.peft import adapter_base, adapter_model, peft_adapters, write_adapters
    from tessera.models.multimodal import MultimodalModel
    from tessera.models.multimodal_hf import export_hf

    lora = lora_settings(model_cfg)
    if lora is not None and lora.export in ("adapters", "both"):
        write_adapters(out, peft_adapters(modules), lora, adapter_model(model_cfg, hf_fields), adapter_base(model_cfg))
    if lora is not None and lora.export == "adapters":
        return out
    if lora is not None:
        merge_lora(modules)
    media = {k: m for k, m in modules.items() if k != "language"}
    return write_hf(out, export_hf(MultimodalModel(modules["language"], media)), model_cfg, hf_fields, tokenizer,
                    max_shard_size, data)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--max-shard-size", default=MAX_SHARD_SIZE, help="largest weight file, e.g. 5GB or 500MB")
    args = ap.parse_args()
    from tessera.hetero.runtime.world import process_world

    # one CPU rank whatever the machine has, also when a training rank starts it (its RANK is in our environment)
    with process_world(backend="gloo", alone=True):
        export_checkpoint(args.checkpoint, args.out, args.max_shard_size)
    sys.exit(0)
