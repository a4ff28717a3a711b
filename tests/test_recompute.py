"""Activation recompute (`model.recompute`, models/recompute.py): with `full` and `selective` the loss and every
parameter gradient equal the run without recompute bit for bit (the same CPU ops run in the same order; the
recomputed forward restores the RNG states, so dropout masks repeat), and the recompute really happens: autograd
keeps fewer activation bytes for backward (saved_tensors_hooks) and the recomputed submodules run twice.
Plus: bad `model.recompute` values fail with one clear error before anything is built.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_recompute.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _mcore_cpu import single_rank_world

from tessera.hetero.plan.recompute import parse_recompute
from tessera.models import configs
from tessera.models.encoders import encoder_config
from tessera.models.hybrid_llm import HybridLM
from tessera.models.nemotron_h_hf import hybrid_config_from_hf

MODES = ("none", "selective", "full")


@pytest.fixture(scope="module")
def pg():
    return single_rank_world()


def _step(model: torch.nn.Module, loss_fn, train: bool = True) -> tuple[torch.Tensor, dict, int, dict]:
    """One training forward + backward from a fixed RNG state: (loss, {param: grad}, activation bytes autograd
    kept for backward (unique storages, parameters and buffers such as position tables excluded),
    {submodule: forward calls})."""
    seen, kept = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}, [0]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            kept[0] += storage.nbytes()
        return t

    calls: dict[str, int] = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
             for n, m in model.named_modules()]
    model.train(train)
    torch.manual_seed(1234)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model)
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, kept[0], calls


def _compare(build, loss_fn, extra=lambda m: {}, exact: bool = True) -> dict[str, tuple[int, dict]]:
    """Same weights in every mode; loss, grads and `extra` state equal to mode none: bitwise when `exact`, else
    to 1e-5 of the largest gradient (see the encoder tests for why). Returns {mode: (kept bytes, forward calls)}."""
    torch.manual_seed(0)
    ref_state = build("none").state_dict()
    out, base = {}, None
    for mode in MODES:
        model = build(mode)
        model.load_state_dict(ref_state)
        loss, grads, kept, calls = _step(model, loss_fn)
        state = extra(model)
        if base is None:
            base = (loss, grads, state)
            scale = max(g.abs().max() for g in grads.values())
        else:
            assert grads.keys() == base[1].keys() and grads, mode
            for name, (got, want) in {"loss": (loss, base[0]), **{f"grad of {n}": (g, base[1][n])
                                      for n, g in grads.items()}, **{n: (v, base[2][n]) for n, v in state.items()}
                                      }.items():
                if exact or not got.is_floating_point():
                    assert torch.equal(got, want), f"{mode}: {name} differs"
                else:
                    bound = 1e-5 * (want.abs().max() if name == "loss" else scale)
                    assert (got - want).abs().max() <= bound, f"{mode}: {name} differs"
        out[mode] = (kept, calls)
    return out


def _counts(calls: dict, suffix: str) -> list[int]:
    """The distinct forward-call counts of the submodules whose name ends with `suffix`."""
    return sorted({count for name, count in calls.items() if name.endswith(suffix)})


# ---- LLM -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,dropout", [("nemotron_h_tiny_dense", 0.0), ("nemotron_h_tiny_moe", 0.0),
                                          ("nemotron_h_tiny_dense", 0.1)])
def test_llm_recompute_is_exact_and_keeps_fewer_activations(pg, name, dropout):
    # dropout 0.1: the tiny configs have none, so this case shows the recompute replays the same masks
    cfg = dataclasses.replace(hybrid_config_from_hf(configs.hf_fields(name)), hidden_dropout=dropout,
                              attention_dropout=dropout)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    routers = lambda m: {n: b.clone() for n, b in m.named_buffers() if n.endswith("local_tokens_per_expert")}
    res = _compare(lambda mode: HybridLM(cfg, pg, recompute=mode), lambda m: m(ids, labels).sum(), routers)
    (none, calls_none), (sel, calls_sel), (full, calls_full) = (res[m] for m in MODES)
    print(f"{name} dropout={dropout}: kept bytes none {none}, selective {sel} ({sel / none:.3f}), "
          f"full {full} ({full / none:.3f})")
    assert full < 0.15 * none  # only each layer's input [s, b, h] (+ the head) is kept
    assert full < sel < 0.8 * none  # selective: mostly the Mamba SSD scan's decay/score tensors (SDPA keeps little)
    layers = [n for n in calls_none if n.count(".") == 1 and n.startswith("layers.")]
    assert {calls_none[n] for n in layers} == {1} and {calls_full[n] for n in layers} == {2}
    # selective: core attention runs again (megatron's SelfAttention), the MLP/MoE and projections do not
    assert _counts(calls_sel, "core_attention") == [2] and _counts(calls_sel, "linear_qkv") == [1]
    assert _counts(calls_sel, ".mlp") == [1] and {calls_sel[n] for n in layers} == {1}


def test_llm_eval_and_no_grad_forward_do_not_recompute(pg):
    cfg = hybrid_config_from_hf(configs.hf_fields("nemotron_h_tiny_dense"))
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    plain, full = HybridLM(cfg, pg), HybridLM(cfg, pg, recompute="full")
    full.load_state_dict(plain.state_dict())
    _, _, kept_plain, _ = _step(plain, lambda m: m(ids, ids).sum(), train=False)
    _, _, kept_full, calls = _step(full, lambda m: m(ids, ids).sum(), train=False)
    assert kept_full == kept_plain and calls["layers.0"] == 1  # eval: exactly what a plain model keeps
    with torch.no_grad():
        assert not full.train()(ids, ids).requires_grad


def test_llm_full_recompute_trains_weights_behind_a_frozen_input(pg):
    """A reentrant checkpoint gives weights no gradient when its input needs none (frozen embedding, as with
    LoRA): the first layers must still get exactly the gradients of the plain run."""
    cfg = hybrid_config_from_hf(configs.hf_fields("nemotron_h_tiny_dense"))
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def build(mode):
        model = HybridLM(cfg, pg, recompute=mode)
        model.embedding.requires_grad_(False)
        return model

    res = _compare(build, lambda m: m(ids, ids).sum())
    assert res["full"][0] < res["none"][0]


# ---- encoders --------------------------------------------------------------------------------------------

# Encoder gradients agree to float round-off rather than bitwise: the reentrant checkpoint hands each layer the
# gradient of its output as a detached leaf's .grad, which AccumulateGrad stores contiguous, while the plain run
# passes on the non-contiguous gradient of the final transpose (the ViT's [s, b, h] -> [b, s, h]), so reductions
# over tokens (biases, layer scales, norms) add in another order. transformers' Parakeet also takes another SDPA
# kernel without grad (the checkpoint's first forward) than with it: its activations differ at 1e-6 already.
# The LLM's output path keeps gradients contiguous and has no biases: it matches bitwise.

def test_vit_recompute_is_exact_and_keeps_fewer_activations(pg):
    from tessera.models.vision import VisionTransformer

    cfg = encoder_config("radio_vit_tiny")
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(2, 4, 4, cfg.hidden, generator=torch.Generator().manual_seed(2))
    res = _compare(lambda mode: VisionTransformer(cfg, pg, recompute=mode), lambda m: (m(pixels) * weight).sum(),
                   exact=False)
    (none, _), (sel, calls_sel), (full, calls_full) = (res[m] for m in MODES)
    print(f"radio_vit_tiny: kept bytes none {none}, selective {sel} ({sel / none:.3f}), full {full} "
          f"({full / none:.3f})")
    # SDPA keeps only q, k, v, out and a logsumexp, so selective saves little (the logsumexp) but must run twice
    assert full < sel < none  # full: the patch embedding, position table and output keep theirs (2 tiny layers)
    assert _counts(calls_sel, "core_attention") == [2] and _counts(calls_sel, "linear_fc1") == [1]
    assert _counts(calls_full, "linear_fc1") == [2]


@pytest.mark.parametrize("name", ["fastconformer_tiny", "parakeet_hf_tiny"])
def test_audio_recompute_is_exact_and_counts_batchnorm_statistics_once(name, pg):  # pg: the CPU shims
    from tessera.models.encoders import family_of

    cfg = encoder_config(name)
    waves = [torch.randn(8000, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
    stats = lambda m: {n: b.clone() for n, b in m.named_buffers() if "running" in n or "num_batches" in n}
    # a fixed random weight per output, not o * o: the squares' gradients (~1e8 here) lose the bound to fp32
    # rounding that depends on the thread count (OMP_NUM_THREADS=2 failed it), not to the recompute
    weight = lambda o: torch.randn(o.shape, generator=torch.Generator().manual_seed(o.numel()))
    res = _compare(lambda mode: family_of(cfg).encoder_class()(cfg, recompute=mode),
                   lambda m: sum((o * weight(o)).sum() for o in m(waves)), stats, exact=False)
    (none, _), (sel, calls_sel), (full, calls_full) = (res[m] for m in MODES)
    print(f"{name}: kept bytes none {none}, selective {sel} ({sel / none:.3f}), full {full} ({full / none:.3f})")
    assert full < sel < none
    # the recomputed modules' own forward runs inside the checkpoint (no hook); their submodules run twice
    assert _counts(calls_sel, "q_proj" if "parakeet" in name else "linear_q") == [2]
    assert _counts(calls_sel, "feed_forward1.linear1") == [1] and _counts(calls_full, "feed_forward1.linear1") == [2]


def test_recomputed_module_keeps_its_parameter_names_and_class():
    from tessera.models.audio import FastConformerEncoder

    cfg = encoder_config("fastconformer_tiny")
    plain, full = FastConformerEncoder(cfg), FastConformerEncoder(cfg, recompute="full")
    assert plain.state_dict().keys() == full.state_dict().keys()
    assert isinstance(full.encoder.layers[0], type(plain.encoder.layers[0]))


# ---- config ----------------------------------------------------------------------------------------------

def test_parse_recompute():
    assert parse_recompute("full") == {"language": "full", "vision": "full", "audio": "full"}
    assert parse_recompute(" language=full , vision=selective") == {"language": "full", "vision": "selective",
                                                                    "audio": "none"}
    assert parse_recompute("selective,language=full")["audio"] == "selective"


@pytest.mark.parametrize("value,bad", [("fulll", "'fulll'"), ("language=everything", "'everything'"),
                                       ("text=full", "unknown module 'text'"), ("", "non-empty"),
                                       ("full,selective", "more than one default"),
                                       ("vision=full,vision=none", "given twice")])
def test_bad_recompute_values_name_the_field_and_the_choices(value, bad):
    import fiddle as fdl

    from tessera.recipes import checks
    from tessera.hetero.runspec.config import ModelConfig
    from tessera.recipes.overrides import apply_overrides
    from tessera.recipes.registry import recipe

    cli = lambda: checks.check_names(apply_overrides(recipe("nemotron_vl_tiny"), [f"model.recompute={value}"]).model)
    # the CLI path holds a run.Config, checked before launch without building it ("" is nemo-run's own error)
    for make in (lambda: ModelConfig(recompute=value), *([cli] if value else [])):
        with pytest.raises(ValueError) as err:
            make()
        msg = str(err.value)
        assert "model.recompute=" in msg and bad in msg and "none|selective|full" in msg, msg
        assert "language, vision, audio" in msg, msg
    cfg = fdl.build(apply_overrides(recipe("nemotron_vl_tiny"), ["model.recompute=language=full,vision=selective"]))
    assert parse_recompute(cfg.model.recompute)["vision"] == "selective"
