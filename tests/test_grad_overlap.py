"""Gradients reduced during backward (trainer.overlap_grad_reduce, hetero/optim/grad_buckets.py) on gloo ranks.

(a) The optimizer alone, 4 ranks, two microbatches (two backward calls) per step, buckets of ~64 elements (each
    part cut into several): in `language=dp4,ep2` (dense over DP4, experts over expert-DP2) and `language=tp2,dp2`
    (a sequence-parallel norm summed over TP first), for fp32, bf16 and bf16 ZeRO-1 (one shard per bucket), the
    overlapped steps' parameters are torch.equal to the synchronous steps', every bucket having started inside
    backward; and the small buckets' sums equal one bucket per part (today's reduction) to fp32 rounding.
    A weight that gets more gradients than the step has microbatches raises instead of reducing early.
(b) The trainer, bf16 ZeRO-1, the tiny MoE model with a vision encoder colocated (DP4 x EP2; TP2 x DP2 with
    sequence parallelism and full recompute): overlap on and off give the same losses and grad norms exactly,
    with buckets started during backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.hetero.tools.spawn import run_on_ranks
from tessera.hetero.optim.grad_buckets import overlapped_modules, split_buckets
from tessera.hetero.training.metrics import read_metrics

pytestmark = pytest.mark.multiproc

MICROBATCHES, STEPS, SMALL = 2, 2, 64
MODES = {"fp32": {}, "bf16": {"param_dtype": torch.bfloat16},
         "zero1": {"param_dtype": torch.bfloat16, "distributed": True}}


def _module(pgs, sp: bool):
    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Linear(9, 9), torch.nn.LayerNorm(9),
                                torch.nn.Linear(9, 5))  # 80 + 90 + 18 + 50 elements
    if sp:
        for p in dense[2].parameters():
            p.sequence_parallel = True  # summed over TP before DP
    torch.manual_seed(1 + pgs.ep.rank())  # each EP rank its own experts
    experts = torch.nn.Sequential(torch.nn.Linear(5, 6, bias=False), torch.nn.Linear(6, 3, bias=False))
    for p in experts.parameters():
        p.allreduce = False  # megatron's mark of an expert-parallel parameter
    return torch.nn.Sequential(dense, experts)


def _steps(layout: str, mode: str, overlap: bool, bucket_elements: int):
    """(weights after the last step, grad norms, buckets started in backward per step, buckets)."""
    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.runtime.groups import build_module_groups, destroy_module_groups
    from tessera.hetero.optim.optimizers import ModuleOptimizers

    groups = build_module_groups(HeteroLayout.parse(layout))
    module = _module(groups["language"].pgs, sp="tp2" in layout)
    opt = ModuleOptimizers({"language": module}, groups, {"language": 1e-2}, clip_grad=0.5, weight_decay=0.1,
                           overlap_modules=("language",) if overlap else (), bucket_elements=bucket_elements,
                           backwards_per_step=MICROBATCHES, **MODES[mode])
    dtype = MODES[mode].get("param_dtype", torch.float32)
    norms, in_backward = [], []
    for step in range(STEPS):
        for mb in range(MICROBATCHES):
            g = torch.Generator().manual_seed(1000 * step + 10 * mb + dist.get_rank())
            module(torch.randn(6, 7, generator=g).to(dtype)).float().pow(2).sum().backward()
        in_backward.append(opt.reducer.started_in_backward)
        norms.append(opt.step()["grad_norm"])
    weights = [p.detach().float().tolist() for p in module.parameters()]  # plain data to the parent
    buckets = sum(len(s) for s in opt.reducer.sequences)
    destroy_module_groups(groups)
    return weights, norms, in_backward, buckets


def _too_many_gradients() -> str:
    """A weight used by two backward calls of one microbatch, with overlap: the error, or '' if none."""
    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.runtime.groups import build_module_groups, destroy_module_groups
    from tessera.hetero.optim.optimizers import ModuleOptimizers

    groups = build_module_groups(HeteroLayout.parse("language=dp4@0-3"))
    layer = torch.nn.Linear(3, 3)
    opt = ModuleOptimizers({"language": layer}, groups, {"language": 1e-2}, overlap_modules=("language",),
                           backwards_per_step=1)
    message = ""
    try:
        layer(torch.ones(2, 3)).sum().backward()  # final: its bucket starts
        layer(torch.ones(2, 3)).sum().backward()  # one more: raises before touching the started reduction
    except RuntimeError as e:
        message = str(e)
    opt.reducer.finish()  # the started all-reduce completes on every rank
    destroy_module_groups(groups)
    return message


def _optimizer_runs():
    out = {}
    for layout in ("language=dp4,ep2@0-3", "language=tp2,dp2@0-3"):
        for mode in MODES:
            out[layout, mode] = {name: _steps(layout, mode, overlap, size) for name, overlap, size in
                                 (("sync", False, SMALL), ("overlap", True, SMALL), ("one_bucket", False, 10 ** 9))}
    out["error"] = _too_many_gradients()
    return out


@pytest.fixture(scope="module")
def optimizer_runs():
    return run_on_ranks(4, _optimizer_runs, timeout=600)


def test_split_buckets_cuts_at_parameters_last_first():
    assert split_buckets([80, 90, 18, 50], 64) == [range(2, 4), range(1, 2), range(0, 1)]
    assert split_buckets([80, 90, 18, 50], 100) == [range(1, 4), range(0, 1)]
    assert split_buckets([80, 90, 18, 50], 10 ** 9) == [range(0, 4)]
    assert split_buckets([], 64) == []
    with pytest.raises(ValueError, match="grad_bucket_elements"):
        split_buckets([3], 0)


def test_an_encoder_recomputed_per_item_is_reduced_after_backward():
    """Full recompute runs a nested backward per recomputed segment and an encoder runs once per item: its weights
    get a data-dependent number of gradients per microbatch, so its buckets cannot start on a count."""
    modes = {"language": "full", "vision": "none", "audio": "selective"}
    assert overlapped_modules(["audio", "language", "vision"], modes, "language") == ["language", "vision"]
    assert overlapped_modules(["language", "vision"], {}, "language") == ["language", "vision"]


def test_overlapped_reduction_is_bitwise_the_synchronous_one(optimizer_runs):
    for rank, runs in enumerate(optimizer_runs):
        for (layout, mode), got in ((k, v) for k, v in runs.items() if k != "error"):
            (w_sync, n_sync, in_bw_sync, buckets), (w_ovl, n_ovl, in_bw_ovl, _) = got["sync"], got["overlap"]
            assert buckets == 4, (layout, mode, buckets)  # dense: 3 buckets (18 + 50, 90, 80), experts: 1
            assert in_bw_sync == [0] * STEPS
            assert in_bw_ovl == [buckets] * STEPS, (layout, mode, rank, in_bw_ovl, buckets)
            same = [torch.equal(torch.tensor(a), torch.tensor(b)) for a, b in zip(w_sync, w_ovl)]
            assert all(same), (layout, mode, rank, same)
            assert n_sync == n_ovl, (layout, mode, rank, n_sync, n_ovl)
            # the buckets sum what one all-reduce per part sums (another summation order over 4 ranks in fp32;
            # bf16 parameters round that to their own last bit at most)
            w_one, n_one, _, one = got["one_bucket"]
            assert one == 2, one  # dense and experts: one bucket each
            tol = 1e-6 if mode == "fp32" else 2.0 ** -7
            for a, b in zip(w_one, w_sync):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=tol, atol=tol)
            assert max(abs(x - y) / y for x, y in zip(n_one, n_sync)) < 1e-5


def test_a_weight_with_more_gradients_than_microbatches_raises(optimizer_runs):
    for runs in optimizer_runs:
        assert "overlap_grad_reduce=false" in runs["error"] and "got gradient 2" in runs["error"], runs["error"]


TRAINER_RUNS = {  # name: (layout, model.recompute)
    "dp4_ep2": ("vision=dp4@0-3;language=dp4,ep2@0-3", "none"),
    # sequence parallel (TP sums in hooks), full recompute (the LLM overlapped, the ViT after backward)
    "tp2_dp2_recompute": ("vision=dp4@0-3;language=tp2,dp2@0-3", "full"),
}


def _train(run_dir: str, overlap: bool, layout: str, recompute: str):
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    model = ModelConfig(llm="nemotron_h_tiny_moe", vision="radio_vit_tiny", dtype="bfloat16", recompute=recompute)
    data = DataConfig(seq_length=128, rows_per_microbatch=4, microbatches=2)
    trainer = TrainerConfig(max_steps=3, run_dir=run_dir, progress=False, tensorboard=False,
                            overlap_grad_reduce=overlap, grad_bucket_elements=20_000)
    optim = OptimConfig(lr=2e-3, use_distributed_optimizer=True)
    return train(model, data, optim, trainer, layout=layout, name="overlap")


def _trainer_runs(root: str):
    for name, (layout, recompute) in TRAINER_RUNS.items():
        _train(f"{root}/{name}_sync", False, layout, recompute)
        _train(f"{root}/{name}_overlap", True, layout, recompute)


def test_trainer_with_overlap_trains_bitwise_as_without(tmp_path):
    run_on_ranks(4, _trainer_runs, str(tmp_path), timeout=900)
    for name in TRAINER_RUNS:
        sync, ovl = read_metrics(tmp_path / f"{name}_sync"), read_metrics(tmp_path / f"{name}_overlap")
        assert len(sync) == len(ovl) == 3
        assert [r["loss"] for r in sync] == [r["loss"] for r in ovl], name
        assert [r["grad_norm"] for r in sync] == [r["grad_norm"] for r in ovl], name
        assert all(r["grad_buckets_in_backward"] == 0 for r in sync)
        started = [(r["grad_buckets_in_backward"], r["grad_buckets"]) for r in ovl]
        assert all(2 < n <= total for n, total in started), (name, started)
