"""This rank's modules of the multimodal model, built in its layout and loaded from one full-model state.

    configs, hf_fields = module_configs(model_cfg, layout, vocab_size)
    modules = build_rank_modules(model_cfg, layout, groups, configs)
    load_full_state(modules, SeededState(model_cfg, hf_fields, seed), groups)   # hetero/build/seeded_init.py

Initial weights are defined once, as a Hugging Face (NemotronH_Nano_VL_V2 / Omni) state dict of the whole
model from the seed, read lazily (hetero/build/seeded_init.py: unit by unit, each rank only the units of
its shards), and every rank imports its TP/PP/EP shard of it through the same converters that load released
checkpoints (models/multimodal_hf.py, models/nemotron_h_hf.py). So any two layouts start from identical
weights — what loss parity between layouts needs — and fine-tuning a provided checkpoint is the same call
with the checkpoint's tensors (a LazyCheckpoint).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from tessera.hetero.runtime.groups import DENSE_GROUPS, EXPERT_GROUPS, ModuleGroups
from tessera.hetero.parallel.cp_tile_attention import TileCPCoreAttention
from tessera.hetero.parallel.kernel_choice import select_kernels
from tessera.hetero.plan.layout import LANGUAGE, HeteroLayout
from tessera.hetero.plan.recompute import parse_recompute
from tessera.hetero.parallel.vocab_parallel_ce import vocab_parallel_cross_entropy_for
from tessera.models.configs import REGISTRY as LLM_REGISTRY, hf_fields as llm_hf_fields
from tessera.models.encoders import video_temporal
from tessera.models.hybrid_llm import HybridLM
from tessera.models.meta_device import meta_build
from tessera.models.multimodal import MultimodalModel, build_media_module
from tessera.models.multimodal_hf import PROJECTOR_ROOT, encoder_from_hf, export_hf, media_to_hf
from tessera.models.nemotron_h_hf import PrefixView, hybrid_config_from_hf, load_into
from tessera.models.released import is_carried
from tessera.hetero.runspec.modules import encoder_names, module_specs

_single_rank_pgs: ProcessGroupCollection | None = None


def llm_fields(model_cfg, vocab_size: int) -> dict:
    """HF config fields of the LLM, with the vocabulary grown to the tokenizer's when it is larger
    (rounded up to 128 so every TP size divides it)."""
    if model_cfg.llm not in LLM_REGISTRY:
        raise KeyError(f"model.llm={model_cfg.llm!r} is not a registered LLM; known: {', '.join(sorted(LLM_REGISTRY))}")
    fields = llm_hf_fields(model_cfg.llm)
    if vocab_size > fields["vocab_size"]:
        fields["vocab_size"] = -(-vocab_size // 128) * 128
    return fields


def single_rank_pgs() -> ProcessGroupCollection:
    """Groups of size one (collective on first call): lets every rank build a TP=1/PP=1 module."""
    global _single_rank_pgs
    if _single_rank_pgs is None:
        own, _ = dist.new_subgroups(group_size=1)
        names = [n for n, _ in DENSE_GROUPS + EXPERT_GROUPS]
        _single_rank_pgs = ProcessGroupCollection(expt_tp=own, **{n: own for n in names})
    return _single_rank_pgs


def media_module(spec, model_cfg, llm_hidden: int, pgs, recompute: str = "none"):
    # a context-parallel vision tower gathers each tile's keys/values over its CP group; video in tubelets when
    # the model's family encodes it so (models/encoders.video_temporal: the placeholders follow the same rule)
    cp = getattr(pgs, "cp", None)
    return build_media_module(spec.name, llm_hidden, pgs, frozen=spec.freeze, pruning_rate=model_cfg.video_pruning,
                              recompute=recompute, tubelets=video_temporal(encoder_names(model_cfg)) > 1,
                              core_attention=TileCPCoreAttention if cp is not None and cp.size() > 1 else None)


def hf_shapes(model_cfg, hf_fields: dict, specs: dict | None = None) -> dict[str, tuple[int, ...]]:
    """The HF-layout key -> shape of the whole model, from a build on the meta device (no memory, no init).
    `specs`: the run's module specs (hetero/runspec/modules.module_specs), resolved from model_cfg when None."""
    pgs, specs = single_rank_pgs(), specs or module_specs(model_cfg)
    with meta_build():
        llm = HybridLM(hybrid_config_from_hf(hf_fields), pgs)
        media = {k: media_module(spec, model_cfg, llm.config.hidden_size, pgs)
                 for k, spec in specs.items() if k != LANGUAGE}
        return {k: tuple(v.shape) for k, v in export_hf(MultimodalModel(llm, media)).items()}


def media_keys(model_cfg, hf_fields: dict, specs: dict | None = None) -> dict[str, list[str]]:
    """Per media module key, the HF-layout keys of its tensors (a meta-device build)."""
    pgs, hidden = single_rank_pgs(), hybrid_config_from_hf(hf_fields).hidden_size
    with meta_build():
        return {k: list(media_to_hf(k, media_module(spec, model_cfg, hidden, pgs)))
                for k, spec in (specs or module_specs(model_cfg)).items() if k != LANGUAGE}


def check_checkpoint_tensors(source: str, full: dict[str, torch.Tensor], model_cfg, hf_fields: dict) -> None:
    """Every tensor of the checkpoint is one the model holds, with its shape, and none is missing: otherwise
    one error listing every difference (key, shapes), before any weight is loaded."""
    shape = getattr(full, "shape", lambda k: tuple(full[k].shape))  # a LazyCheckpoint: from the file headers
    # a release's tensors no module computes with (mtp.*, the featurizer's) are carried to the export, not loaded
    want, got = hf_shapes(model_cfg, hf_fields), {k: shape(k) for k in full if not is_carried(k)}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = [f"{k}: checkpoint {got[k]}, model {want[k]}" for k in sorted(set(want) & set(got)) if want[k] != got[k]]
    if missing or extra or wrong:
        parts = [f"{len(missing)} missing (the model needs them): " + ", ".join(f"{k} {want[k]}" for k in missing[:20]),
                 f"{len(extra)} left over (the model has no such tensor): " + ", ".join(
                     f"{k} {got[k]}" for k in extra[:20]),
                 f"{len(wrong)} of another shape: " + "; ".join(wrong[:20])]
        raise ValueError(f"model.checkpoint={source} does not hold this model's tensors ("
                         f"{' | '.join(p for p, n in zip(parts, (missing, extra, wrong)) if n)}); give the "
                         f"checkpoint's own config.json, or a checkpoint of the model named by model.llm/vision/audio")


def module_configs(layout: HeteroLayout, hf_fields: dict, aux_loss_coeff: float = 0.0) -> dict:
    """Per module key the config its layout needs (the LLM's HybridConfig carries TP/PP/CP/EP sizes)."""
    lang = layout[LANGUAGE]
    return {LANGUAGE: hybrid_config_from_hf(hf_fields, tp=lang.tp, pp=lang.pp, cp=lang.cp, ep=lang.ep,
                                            aux_loss_coeff=aux_loss_coeff)}


def build_rank_modules(model_cfg, layout: HeteroLayout, groups: dict[str, ModuleGroups],
                       configs: dict, specs: dict | None = None) -> dict[str, torch.nn.Module]:
    """The modules (or pipeline stage of the LLM) this rank hosts, empty-initialised. `specs`: the run's module
    specs (build_run resolves them once), resolved from model_cfg when None (tools, tests)."""
    specs, out = specs or module_specs(model_cfg), {}
    # activation recompute per module (model.recompute; getattr: configs saved before the field existed)
    modes = parse_recompute(getattr(model_cfg, "recompute", "none"))
    hidden = configs[LANGUAGE].hidden_size
    for key in layout.modules:
        g = groups[key]
        if not g.is_member:
            continue
        if key == LANGUAGE:
            # the dtype the run computes in (modules are built fp32 and cast by the loop): TE only in bf16
            kernels = select_kernels(g.pgs, dtype=getattr(torch, model_cfg.dtype), config=configs[key])
            out[key] = HybridLM(configs[key], g.pgs, core_attention=kernels.core_attention,
                                mamba_mixer=kernels.mamba_mixer, moe_experts=kernels.moe_experts,
                                cross_entropy=vocab_parallel_cross_entropy_for(g.pgs.tp), recompute=modes[LANGUAGE])
            if specs[LANGUAGE].freeze:
                out[key].requires_grad_(False)
        else:
            out[key] = media_module(specs[key], model_cfg, hidden, g.pgs, modes[key])
    return out


def load_full_state(modules: dict[str, torch.nn.Module], hf, groups: dict[str, ModuleGroups]) -> None:
    """Import this rank's shard of an HF-layout state dict (a dict, or a LazyCheckpoint read tensor by tensor)
    into every module it hosts; only the tensors these modules need are read."""
    for key, module in modules.items():
        pgs = groups[key].pgs
        if key == LANGUAGE:
            load_into(module, PrefixView(hf, "language_model."), pgs.tp.rank(), pgs.pp.rank(), pgs.ep.rank())
            continue
        root = PROJECTOR_ROOT[key]
        if module.projector is not None:  # (a vision pipeline stage holds it on its last stage only)
            module.projector.load_state_dict({k[len(root):]: hf[k] for k in hf if k.startswith(root)})
        # the family reads (and checks) the whole encoder's tensors; a pipeline stage keeps the ones it holds
        encoder_from_hf(hf, module, pgs.tp.rank(), pgs.tp.size())
