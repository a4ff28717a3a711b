"""LoRA (hetero/build/lora.py): merged export = base + (alpha/r) B A, adapters-only export, trainable count
from the targets, TP1 == TP2 with the same adapters, a heterogeneous LoRA run that learns with frozen base
weights and resumes bitwise (and into another layout), the vision tower's adapters (target `vision`) included."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.hetero.plan.lora import DEFAULT_LORA_TARGETS
from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.training.metrics import read_metrics
from tests._run_curves import curves as _curves, rel as _rel
from tessera.models.configs import REGISTRY
from tessera.models.encoders import encoder_config

pytestmark = pytest.mark.multiproc
RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK
EPS = torch.finfo(torch.float32).eps
PATTERN = REGISTRY["nemotron_h_tiny_dense"]["hybrid_override_pattern"]
# name -> (targets, LLM); the MoE LLM's linear_fc1/fc2 are its shared and routed experts'
TARGET_SETS = {"all": (None, "nemotron_h_tiny_dense"), "subset": (("linear_qkv", "in_proj", "projector"),
                                                                   "nemotron_h_tiny_dense"),
               "moe_all": (None, "nemotron_h_tiny_moe"),
               # the vision tower too: PEFT names and qkv row order of RADIO's blocks.N.{attn.qkv, attn.proj, mlp.fc*}
               "vision": (("linear_qkv", "vision", "projector"), "nemotron_h_tiny_dense")}
VIT_LAYERS = encoder_config("radio_vit_tiny").layers


def _model_cfg(targets=None, vision="radio_vit_tiny", audio="fastconformer_tiny", llm="nemotron_h_tiny_dense"):
    from tessera.hetero.runspec.config import LoraConfig, ModelConfig

    lora = LoraConfig(rank=RANK, alpha=ALPHA, **({"targets": targets} if targets else {}))
    return ModelConfig(llm=llm, vision=vision, audio=audio, lora=lora)


# ---- config ----------------------------------------------------------------------------------------------

def test_lora_config_errors_name_the_field_and_list_the_valid_targets():
    from tessera.hetero.runspec.config import LoraConfig

    with pytest.raises(ValueError, match=r"unknown \['qkv'\]; valid targets: linear_qkv, linear_proj"):
        LoraConfig(rank=8, targets=("qkv",))
    with pytest.raises(ValueError, match="model.lora.rank"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="model.lora.dropout"):
        LoraConfig(rank=8, dropout=0.1)
    assert LoraConfig(rank=8, targets="linear_qkv, in_proj").targets == ("linear_qkv", "in_proj")


def test_cli_overrides_reach_model_lora():
    import fiddle as fdl

    from tessera.recipes.overrides import apply_overrides
    from tessera.recipes.registry import recipe

    cfg = fdl.build(apply_overrides(recipe("nemotron_vl_tiny"), ["model.lora.rank=8", "model.lora.alpha=16",
                                                                "model.lora.targets=['linear_qkv','projector']"]))
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.targets) == (8, 16.0, ("linear_qkv", "projector"))
    with pytest.raises(Exception, match="valid targets: linear_qkv"):
        fdl.build(apply_overrides(recipe("nemotron_vl_tiny"), ["model.lora.rank=8", "model.lora.targets=['qkv']"]))


# ---- export and trainable count (one rank) -----------------------------------------------------------------

def _export_worker(out: str):
    from tessera.hetero.export.hf import _single_rank_model, export_modules
    from tessera.hetero.build.lora import apply_lora
    from tessera.hetero.build.model_build import llm_fields, load_full_state
    from tessera.hetero.build.seeded_init import full_hf_state
    from tessera.hetero.optim.optimizers import ModuleOptimizers

    results = {}
    for name, (targets, llm) in TARGET_SETS.items():
        cfg = _model_cfg(targets, llm=llm)
        fields = llm_fields(cfg, 0)
        modules, groups, _ = _single_rank_model(cfg, fields)
        base = full_hf_state(cfg, fields, seed=7)
        load_full_state(modules, base, groups)
        adapters = apply_lora(modules, groups, cfg, seed=7)
        opt = ModuleOptimizers(modules, groups, {k: 1e-3 for k in modules})
        names = {id(p): f"{k}.{n}" for k, m in modules.items() for n, p in m.named_parameters()}
        trained = [names[id(p)] for ps in opt.params.values() for p in ps]
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # as if trained: B no longer zero
            for a in adapters.values():
                a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g))
        export_modules(modules, Path(out) / name, cfg, fields)
        save_file(base, str(Path(out) / name / "base.safetensors"))
        results[name] = {"trainable": sum(p.numel() for ps in opt.params.values() for p in ps), "trained": trained,
                         "states": sum(len(o.state_dict()["param_groups"][0]["params"]) +
                                       len(o.state_dict()["param_groups"][1]["params"]) for o in opt.optimizers.values())}
    return results


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_export")
    return root, run_on_ranks(1, _export_worker, str(root), timeout=600)[0]


def _expected_modules(name: str) -> set[str]:
    """HF module names (language_model.backbone.layers.i.mixer.*, mlp1.*, sound_projection.*) the targets adapt."""
    targets, llm = TARGET_SETS[name]
    targets = targets or ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj", "projector")
    experts = range(REGISTRY[llm].get("n_routed_experts", 0))
    per_symbol = {"M": {"in_proj": ["in_proj"], "out_proj": ["out_proj"]},
                  "*": {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"]},
                  "-": {"linear_fc1": ["up_proj"], "linear_fc2": ["down_proj"]},
                  "E": {"linear_fc1": ["shared_experts.up_proj", *(f"experts.{j}.up_proj" for j in experts)],
                        "linear_fc2": ["shared_experts.down_proj", *(f"experts.{j}.down_proj" for j in experts)]}}
    out = set()
    for i, sym in enumerate(REGISTRY[llm]["hybrid_override_pattern"]):
        for t, hf in per_symbol[sym].items():
            if t in targets:
                out |= {f"language_model.backbone.layers.{i}.mixer.{n}" for n in hf}
    if "projector" in targets:
        out |= {"mlp1.1", "mlp1.3", "sound_projection.linear1", "sound_projection.linear2"}
    if "vision" in targets:
        out |= {f"vision_model.radio_model.model.blocks.{i}.{n}" for i in range(VIT_LAYERS)
                for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    return out


@pytest.mark.parametrize("name", list(TARGET_SETS))
def test_merged_export_is_base_plus_scaled_BA_and_adapters_alone(exported, name):
    root, _ = exported
    d = root / name
    base, merged = load_file(str(d / "base.safetensors")), load_file(str(d / "model.safetensors"))
    adapters = load_file(str(d / "adapters" / "adapter_model.safetensors"))
    cfg = json.loads((d / "adapters" / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA and cfg["peft_type"] == "LORA"
    adapted = {k[len("base_model.model."):-len(".lora_A.weight")] for k in adapters if k.endswith(".lora_A.weight")}
    assert adapted == _expected_modules(name) == set(cfg["target_modules"])
    assert merged.keys() == base.keys()
    for k, w in base.items():
        module = k[:-len(".weight")]
        if module in adapted:
            a, b = adapters[f"base_model.model.{module}.lora_A.weight"], adapters[f"base_model.model.{module}.lora_B.weight"]
            assert a.shape == (RANK, w.shape[1]) and b.shape == (w.shape[0], RANK), k
            want = w + SCALE * (b @ a)
            assert torch.allclose(merged[k], want, rtol=4 * EPS, atol=4 * EPS * float(want.abs().max())), k
            assert not torch.equal(merged[k], w), k
        else:
            assert torch.equal(merged[k], w), f"{k} is not targeted but changed"


def _expected_trainable(shapes: dict, name: str) -> int:
    """r * (in + out) per adapted layer, from the base HF shapes; a fused qkv has one A for q, k and v."""
    n, mods = 0, _expected_modules(name)
    for m in mods:
        if m.endswith(("k_proj", "v_proj")):
            continue
        out, inp = shapes[m + ".weight"]
        if m.endswith("q_proj"):
            out = sum(shapes[m[:-6] + f"{x}_proj.weight"][0] for x in "qkv")
        n += RANK * (out + inp)
    return n


@pytest.mark.parametrize("name", list(TARGET_SETS))
def test_trainable_parameter_count_is_what_the_targets_imply(exported, name):
    root, results = exported
    shapes = {k: tuple(v.shape) for k, v in load_file(str(root / name / "base.safetensors")).items()}
    got = results[name]
    assert got["trainable"] == _expected_trainable(shapes, name) > 0
    assert all(".adapter.lora_" in n for n in got["trained"]), "a base weight is trainable"
    assert got["states"] == len(got["trained"]) == 2 * len({m for m in _expected_modules(name)
                                                            if not m.endswith(("k_proj", "v_proj"))})


# ---- TP1 == TP2 (two ranks) ------------------------------------------------------------------------------

def _built(cfg, fields, base, spec: str):
    """(this rank's modules with the base weights loaded, their groups) in layout `spec`; destroy the groups after."""
    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.runtime.groups import build_module_groups
    from tessera.hetero.build.model_build import build_rank_modules, load_full_state, module_configs

    layout = HeteroLayout.parse(spec)
    groups = build_module_groups(layout)
    modules = build_rank_modules(cfg, layout, groups, module_configs(layout, fields))
    load_full_state(modules, base, groups)
    return modules, groups


def _randomise(adapters: dict) -> None:
    """Every adapter's full A and B drawn from its global name (the same in any layout), then sharded."""
    for gname, a in sorted(adapters.items()):
        gen = torch.Generator().manual_seed(zlib.crc32(gname.encode()))
        a.set_full(torch.randn(a.rank, a.full_in, generator=gen) * 0.1,
                   torch.randn(a.full_out, a.rank, generator=gen) * 0.1)


def _sharded_grad_diff(tp2: dict, tp1: dict) -> float:
    """Largest difference of a TP2 adapter gradient from this rank's shard of the TP1 one, relative to the
    latter's largest entry."""
    diff = 0.0
    for gname, a2 in tp2.items():
        a1 = tp1[gname]
        want_a, want_b = a2.shard(a1.lora_A.grad, a1.lora_B.grad)
        for got, want in ((a2.lora_A.grad, want_a), (a2.lora_B.grad, want_b)):
            diff = max(diff, float((got - want).abs().max() / want.abs().max().clamp(min=1e-30)))
    return diff


def _tp_worker(llm: str = "nemotron_h_tiny_dense"):
    import dataclasses

    import torch.distributed as dist

    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.runtime.groups import destroy_module_groups
    from tessera.hetero.checkpoint.sharded import parameter_counts
    from tessera.hetero.build.lora import apply_lora
    from tessera.hetero.build.model_build import llm_fields, module_configs
    from tessera.hetero.build.seeded_init import full_hf_state

    cfg = dataclasses.replace(_model_cfg(vision=None, audio=None), llm=llm)
    fields = llm_fields(cfg, 0)
    base = full_hf_state(cfg, fields, seed=3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, fields["vocab_size"], (2, 32), generator=g)
    labels = torch.roll(tokens, -1, 1)
    out = {}
    specs = [("tp1", "language=dp2@0-1"), ("tp2", "language=tp2@0-1")]
    if "moe" in llm:  # expert parallelism: each rank adapts its own experts, named by their global ids
        specs.append(("ep2", "language=dp2,ep2@0-1"))
    for name, spec in specs:
        modules, groups = _built(cfg, fields, base, spec)
        lm = modules["language"]
        # frozen first: megatron computes a frozen weight's matmul on another path (linear_with_frozen_weight),
        # about one ulp off the trainable one
        lm.requires_grad_(False)
        with torch.no_grad():
            plain = lm(tokens, labels)
        adapters = apply_lora(modules, groups, cfg, seed=3)
        # what the run prints at its start (trainable of total), counted over the ranks: the same in every layout
        counts = parameter_counts(modules, groups, module_configs(HeteroLayout.parse(spec), fields))
        one_rank = (sum(p.numel() for p in lm.parameters() if p.requires_grad), sum(p.numel() for p in lm.parameters()))
        with torch.no_grad():
            initial = lm(tokens, labels)  # B = 0: exactly the base model
        _randomise(adapters)
        loss = lm(tokens, labels).sum()
        loss.backward()
        for a in adapters.values():  # what the optimizer's sync_gradients does under sequence parallelism
            for p in (a.lora_A, a.lora_B):
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=groups["language"].pgs.tp)
        sp = lm.config.sequence_parallel
        out[name] = {"plain": plain, "initial": initial, "loss": float(loss), "adapters": adapters, "sp": sp,
                     "counts": counts, "one_rank": one_rank}
        destroy_module_groups(groups)
    grad_diff = _sharded_grad_diff(out["tp2"]["adapters"], out["tp1"]["adapters"])
    ep = {}
    if "ep2" in out:  # both ranks feed the same tokens: an EP2 expert sees both ranks' (2x one EP1 rank's gradient)
        ep_diff, experts = 0.0, 0
        for gname, a2 in out["ep2"]["adapters"].items():
            a1, times = out["tp1"]["adapters"][gname], 2.0 if a2.expert else 1.0
            experts += a2.expert
            for got, want in ((a2.lora_A.grad, a1.lora_A.grad), (a2.lora_B.grad, a1.lora_B.grad)):
                ep_diff = max(ep_diff, float((got - times * want).abs().max() / want.abs().max().clamp(min=1e-30)))
        ep = {"ep_loss": out["ep2"]["loss"], "ep_diff": ep_diff, "ep_experts": experts,
              "ep_n": len(out["ep2"]["adapters"])}
    return {"initial_is_base": all(torch.equal(r["plain"], r["initial"]) for r in out.values()),
            "loss1": out["tp1"]["loss"], "loss2": out["tp2"]["loss"], "plain": float(out["tp1"]["plain"].sum()),
            "grad_diff": grad_diff, "n": len(out["tp2"]["adapters"]), "sp": out["tp2"]["sp"],
            "counts": {name: r["counts"] for name, r in out.items()}, "one_rank": out["tp1"]["one_rank"], **ep}


def _both_llms():
    return {llm: _tp_worker(llm) for llm in ("nemotron_h_tiny_dense", "nemotron_h_tiny_moe")}


@pytest.mark.parametrize("llm", ["nemotron_h_tiny_dense", "nemotron_h_tiny_moe"])
def test_tp1_and_tp2_give_the_same_lora_loss_and_gradients(tp_runs, llm):
    """The MoE LLM at TP2 runs with sequence parallelism (megatron needs it): its adapters gather / reduce-scatter
    A x over the sequence and sum the replicated factor's gradient over TP, and still equal TP1."""
    from tessera.models.configs import REGISTRY

    pattern = REGISTRY[llm]["hybrid_override_pattern"]
    experts = REGISTRY[llm].get("n_routed_experts", 0)
    for ranks in tp_runs:
        r = ranks[llm]
        assert r["sp"] == (llm == "nemotron_h_tiny_moe")
        assert r["initial_is_base"], "B must start at zero: the first forward is the frozen base model's, bitwise"
        # MoE layers "E": the shared expert's linear_fc1/fc2 and every routed expert's
        assert r["n"] == 2 * sum(pattern.count(c) for c in "M*-E") + 2 * experts * pattern.count("E")
        assert abs(r["loss1"] - r["plain"]) > 1e-3, "the adapters changed nothing"
        assert abs(r["loss1"] - r["loss2"]) <= 1e-5 * abs(r["loss1"]), (r["loss1"], r["loss2"])
        assert r["grad_diff"] <= 1e-5, r["grad_diff"]
        # trainable / total parameters as the run prints them: each element once, whatever the layout (TP shards,
        # EP's experts), equal to one rank holding the whole model (dp2: every rank does)
        assert all(c == r["one_rank"] for c in r["counts"].values()), (r["counts"], r["one_rank"])
        if experts:  # EP2: half the routed experts' adapters per rank, same loss, same gradients
            assert r["ep_experts"] == experts // 2 * pattern.count("E") * 2
            assert r["ep_n"] == r["n"] - experts // 2 * pattern.count("E") * 2
            assert abs(r["ep_loss"] - r["loss1"]) <= 1e-5 * abs(r["loss1"]), (r["ep_loss"], r["loss1"])
            assert r["ep_diff"] <= 1e-5, r["ep_diff"]


def _vision_tp_worker():
    """The vision tower with target `vision` at TP1 and TP2 (same base weights, same random adapters): its
    projected output's weighted sum and every adapter gradient."""
    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.runtime.groups import destroy_module_groups
    from tessera.hetero.checkpoint.sharded import parameter_counts
    from tessera.hetero.build.lora import apply_lora
    from tessera.hetero.build.model_build import llm_fields, module_configs
    from tessera.hetero.build.seeded_init import full_hf_state

    cfg = _model_cfg(("vision",), audio=None)
    fields = llm_fields(cfg, 0)
    base = full_hf_state(cfg, fields, seed=5)
    g = torch.Generator().manual_seed(0)
    items = [("image", torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8, generator=g)),
             ("image", torch.randint(0, 256, (1, 3, 32, 96), dtype=torch.uint8, generator=g))]
    out = {}
    for name, spec in (("tp1", "vision=dp2@0-1;language=dp2@0-1"), ("tp2", "vision=tp2@0-1;language=dp2@0-1")):
        modules, groups = _built(cfg, fields, base, spec)
        tower = modules["vision"]
        tower.requires_grad_(False)
        with torch.no_grad():
            plain = tower(items)
        adapters = apply_lora(modules, groups, cfg, seed=5)
        with torch.no_grad():
            initial = tower(items)  # B = 0: exactly the base tower
        _randomise(adapters)
        y = tower(items)
        loss = (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(1))).sum()
        loss.backward()
        out[name] = {"plain": plain, "initial": initial, "loss": float(loss), "adapters": adapters}
        destroy_module_groups(groups)
    grad_diff = _sharded_grad_diff(out["tp2"]["adapters"], out["tp1"]["adapters"])
    return {"initial_is_base": all(torch.equal(r["plain"], r["initial"]) for r in out.values()),
            "loss1": out["tp1"]["loss"], "loss2": out["tp2"]["loss"],
            "plain": float((out["tp1"]["plain"] * torch.randn(out["tp1"]["plain"].shape,
                                                             generator=torch.Generator().manual_seed(1))).sum()),
            "grad_diff": grad_diff, "names": sorted(out["tp2"]["adapters"])}


def test_vision_tower_adapters_give_the_same_output_and_gradients_at_tp1_and_tp2():
    """Target `vision`: an adapter on every ViT layer's linear_qkv / linear_proj / linear_fc1 / linear_fc2 (by
    global layer name), none on the projector or the LLM; TP2 (column / row parallel factors) == TP1."""
    r = run_on_ranks(2, _vision_tp_worker, timeout=600)[0]
    assert r["names"] == sorted(f"vision.encoder.vit.layers.{i}.{n}" for i in range(VIT_LAYERS)
                                for n in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                          "mlp.linear_fc1", "mlp.linear_fc2"))
    assert r["initial_is_base"], "B must start at zero: the first forward is the frozen base tower's, bitwise"
    assert abs(r["loss1"] - r["plain"]) > 1e-3, "the adapters changed nothing"
    assert abs(r["loss1"] - r["loss2"]) <= 1e-5 * abs(r["loss1"]), (r["loss1"], r["loss2"])
    assert r["grad_diff"] <= 1e-5, r["grad_diff"]


def test_a_frozen_tower_cannot_take_vision_adapters():
    from tessera.hetero.build.lora import target_layers

    class Frozen:
        frozen = True

    with pytest.raises(ValueError, match="'vision' but model.freeze_vision"):
        target_layers("vision", Frozen(), ("vision",))


@pytest.fixture(scope="module")
def tp_runs():
    return run_on_ranks(2, _both_llms, timeout=600)


# ---- a heterogeneous LoRA run: learns, base frozen, resumes exactly (four ranks) ---------------------------

# the vision tower adapted too (target `vision`): trained at TP2, resumed in a vision pipeline (adapters named by
# global layer, checkpointed by TP offsets like any weight)
LAYOUT = "vision=tp2@0-1;language=tp2@2-3"
RESUME = (("same", LAYOUT), ("tp1", "vision=pp2@0-1;language=dp2@2-3"))
RUN_TARGETS = DEFAULT_LORA_TARGETS + ("vision",)
# the default targets with a vision pipeline: the first stage has nothing to train (no adapter before the
# projector on the last stage), and the run equals the unsplit tower's
PIPELINED = (("default_dp2", "vision=dp2@0-1;language=dp2@2-3"), ("default_pp2", "vision=pp2@0-1;language=dp2@2-3"))
STEPS, SAVE = 6, 3


def _train(run_dir: str, layout: str, export: str | None = None, targets=RUN_TARGETS, steps: int = STEPS):
    from tessera.hetero.runspec.config import DataConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    trainer = TrainerConfig(max_steps=steps, run_dir=run_dir, save_every=SAVE, progress=False, tensorboard=False,
                            export_hf=export)
    optim = OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0)  # constant LR: a resume follows the schedule
    return train(_model_cfg(targets, audio=None), DataConfig(seq_length=128, rows_per_microbatch=4, microbatches=2),
                 optim, trainer, layout=layout, name="lora")


def _base_weights(export: str):
    """base.safetensors next to the export: the run's initial weights, rebuilt from the seed (1234)."""
    import torch.distributed as dist

    from tessera.hetero.build.seeded_init import full_hf_state

    fields = json.loads((Path(export) / "tessera.json").read_text())["llm_hf_config"]
    base = full_hf_state(_model_cfg(RUN_TARGETS, audio=None), fields, 1234)  # every rank: a first call is collective
    if dist.get_rank() == 0:
        save_file(base, str(Path(export) / "base.safetensors"))


def _all_runs(root: str):
    """The whole scenario in one launch: the 6-step run with its export, the base weights, then the step-3
    checkpoint resumed in the same layout and at TP 1."""
    import torch.distributed as dist

    root = Path(root)
    _train(str(root / "run"), LAYOUT, str(root / "export"))
    _base_weights(str(root / "export"))
    if dist.get_rank() == 0:
        ckpt = root / "run" / "checkpoints" / f"step_{SAVE:06d}"
        for name, _ in RESUME:
            (root / name / "checkpoints").mkdir(parents=True)
            shutil.copytree(ckpt, root / name / "checkpoints" / ckpt.name)
            (root / name / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    dist.barrier()
    for name, layout in RESUME:
        _train(str(root / name), layout)
    for name, layout in PIPELINED:
        _train(str(root / name), layout, targets=DEFAULT_LORA_TARGETS, steps=3)


# the run's export has transformers' config.json (RADIO, no audio), so its adapters name the modules of
# transformers' NemotronH_Omni_Reasoning_V3 (hetero/export/peft.py); the released weights they adapt:
TO_RELEASED = ((r"^language_model\.model\.", "language_model.backbone."),
               (r"^multi_modal_projector\.linear_1$", "mlp1.1"), (r"^multi_modal_projector\.linear_2$", "mlp1.3"),
               (r"^vision_model\.encoder\.layer\.", "vision_model.radio_model.model.blocks."),
               (r"\.attention\.o_proj$", ".attn.proj"), (r"\.attention\.[qkv]_proj$", ".attn.qkv"))


def _released_deltas(adapters: dict) -> dict[str, torch.Tensor]:
    """Released weight key -> (alpha/r) B A of the exported adapters; RADIO's q/k/v_proj share A and stack B
    ([q; k; v] rows) into its fused attn.qkv."""
    parts = {}
    for key in adapters:
        if key.endswith(".lora_A.weight"):
            module = key[len("base_model.model."):-len(".lora_A.weight")]
            released = module
            for pattern, repl in TO_RELEASED:
                released = re.sub(pattern, repl, released)
            qkv = re.search(r"\.attention\.([qkv])_proj$", module)
            b = adapters[key[:-len("lora_A.weight")] + "lora_B.weight"]
            parts.setdefault(released, {})["qkv".index(qkv[1]) if qkv else 0] = (adapters[key], b)
    return {f"{m}.weight": SCALE * torch.cat([p[i][1] for i in sorted(p)]) @ p[0][0] for m, p in parts.items()}


def test_lora_run_learns_keeps_base_frozen_and_resumes_exactly(tmp_path):
    export = tmp_path / "export"
    run_on_ranks(4, _all_runs, str(tmp_path), timeout=1200)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == STEPS and losses[-1] < losses[0], losses

    base, merged = load_file(str(export / "base.safetensors")), load_file(str(export / "model.safetensors"))
    deltas = _released_deltas(load_file(str(export / "adapters" / "adapter_model.safetensors")))
    assert merged.keys() == base.keys() and deltas.keys() <= base.keys(), sorted(deltas.keys() - base.keys())
    assert any(m.startswith("vision_model.") for m in deltas), "the vision tower's adapters were not exported"
    for k, w in base.items():  # every base weight unchanged by training: merged = base (+ the trained delta)
        want = w + deltas[k] if k in deltas else w
        assert torch.allclose(merged[k], want, rtol=4 * EPS, atol=4 * EPS * float(want.abs().max())), k

    same = [r["loss"] for r in read_metrics(tmp_path / "same")]
    assert same == losses[SAVE:], ("resume in the same layout must be bitwise identical", same, losses)
    tp1 = [r["loss"] for r in read_metrics(tmp_path / "tp1")]
    assert max(abs(a - b) / abs(b) for a, b in zip(tp1, losses[SAVE:])) <= 1e-5, (tp1, losses)
    (dp, _), (pp, _) = [_curves(tmp_path / name) for name, _ in PIPELINED]
    assert len(pp) == 3 and pp[-1] < pp[0] and _rel(pp, dp) <= 1e-5, (pp, dp)
