"""Mixed precision as megatron does it (hetero/optim/optimizers.py): bf16 weights and activations, fp32 main grads
accumulated across microbatches, fp32 master weights and Adam states, masters rounded into the bf16 weights
after each step; bf16 checkpoints hold the masters and resume bitwise, in any layout.

bf16 keeps 8 significant bits: a weight w moves only when its update exceeds half an ulp, 2^-9 |w| relative
(2^-8 just below a power of two). AdamW's update is ~lr per step whatever the gradient's scale, so with
lr = 1e-3 a weight of 1.0 never moves in pure bf16, while the fp32 master collects every update."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tessera.hetero.optim.optimizers import ModuleOptimizers

# ---- (a) updates below bf16's resolution: lost in pure bf16, kept by the fp32 masters ---------------------

LR, STEPS = 1e-3, 12
# one optimizer step = two microbatches; each microbatch gradient is exact in bf16, their sum is not
# (1 + 2^-9 rounds to 1 in bf16): accumulating in bf16 would change the gradient and the grad norm
MICRO_GRADS = (torch.tensor([[1.0, -1.0], [0.5, 3.0]]), torch.tensor([[2.0 ** -9, -(2.0 ** -9)], [2.0 ** -10, 2.0 ** -8]]))


@pytest.fixture(scope="module")
def world1():
    """A one-rank gloo group in this process (the optimizer's all-reduces need one)."""
    from tessera.hetero.runtime.world import one_rank_world

    created = one_rank_world(backend="gloo")
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def _groups(pg):
    return {"m": SimpleNamespace(pgs=SimpleNamespace(dp_cp=pg, tp=pg, mp=pg, expt_dp=pg, ep=pg, tp_dp_cp=pg))}


def _run(pg, param_dtype, steps=STEPS):
    """`steps` optimizer steps of w (init 1.0) with the fixed microbatch gradients; returns (module, opt, norms).
    param_dtype None: the fp32 path; bfloat16: mixed precision (fp32 masters and main grads)."""
    module = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        module.weight.fill_(1.0)
    opt = ModuleOptimizers({"m": module}, _groups(pg), {"m": LR}, clip_grad=1.0, weight_decay=0.01,
                           param_dtype=param_dtype)
    norms = []
    for _ in range(steps):
        for g in MICRO_GRADS:  # loss = sum(w * g): d loss / d w = g exactly, in bf16 too
            (module.weight * g.to(module.weight.dtype)).sum().backward()
        norms.append(opt.step()["grad_norm"])
    return module, opt, norms


def test_masters_keep_updates_that_pure_bf16_loses(world1):
    ref, _, ref_norms = _run(world1, None)                 # fp32 reference (no masters: the fp32 path)
    mixed, opt, norms = _run(world1, torch.bfloat16)

    # pure bf16 (the trainer before mixed precision): torch's AdamW on bf16 weights, grads accumulated in bf16
    pure = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16))
    adam = torch.optim.AdamW([pure], lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, foreach=True)
    for _ in range(STEPS):
        for g in MICRO_GRADS:
            (pure * g.to(torch.bfloat16)).sum().backward()
        adam.step()
        adam.zero_grad()
    assert torch.equal(pure.detach(), torch.ones(2, 2, dtype=torch.bfloat16)), "pure bf16 should not move at all"

    w = mixed.weight
    assert w.dtype == torch.bfloat16 and opt.masters["m"][0].dtype == torch.float32
    # the fp32 master is the fp32 reference run, bit for bit: same gradients (summed in fp32), same norm,
    # same clipping, same AdamW in fp32
    assert norms == ref_norms and norms[0] > 1.0  # the clip is active
    assert torch.equal(opt.masters["m"][0], ref.weight.detach())
    state = opt.optimizers["m"].state[opt.masters["m"][0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # ... and the bf16 weight is the master rounded: every weight moved off 1.0, ~STEPS * LR
    assert torch.equal(w.detach(), opt.masters["m"][0].to(torch.bfloat16))
    assert (w.detach() != 1.0).all(), f"bf16 weights did not move: {w}"
    assert ((w.detach().float() - 1.0).abs() - STEPS * LR).abs().max() < 2 ** -8
    assert w.grad is None and w.main_grad.abs().sum() == 0  # freed and zeroed after the step


# ---- (b), (c): the real trainer, bf16 against fp32, and bf16 checkpoints ----------------------------------

LAYOUT = "vision=dp2@0-1;language=dp2@0-1"      # DP 2: the fp32 main grads are all-reduced
OTHER_LAYOUT = "vision=dp2@0-1;language=tp2@0-1"  # TP 2: the masters are resharded like their weights
TRAIN_STEPS, SAVE_AT, RESUME_TO = 30, 10, 14
# lr 1e-5 (after warm-up): AdamW moves each weight ~1e-5 per step, below half a bf16 ulp (2^-9 |w|) of every
# weight over ~0.005 in magnitude, i.e. nearly all of them: pure bf16 loses most of the training signal
TRAIN_LR = 1e-5
# Bound on |loss_bf16 - loss_fp32| / loss_fp32 at every step: 2^-9, bf16's relative rounding of one
# operation. Both runs start from the same fp32 weights and see the same batches; the bf16 run differs only
# by rounding in the forward/backward (its fp32 masters carry every update, the loss is taken in fp32), and
# averaging over thousands of tokens keeps the loss far inside one rounding step. Measured over 30 steps:
# max 1.4e-4 (step 1: 1e-5), a 13x margin; loss drop 0.2526 vs fp32's 0.2528. The old pure-bf16 trainer
# (AdamW on bf16 weights, grads summed in bf16) measured 2.3e-2 on the same run, 12x over the bound, its
# loss dropping only 0.113 (test (a) shows the mechanism in isolation). At lr 1e-4 the numbers are 5.7e-4
# (masters) vs 4.7e-3 (pure bf16): the bound separates them there too.
BF16_REL_TOL = 2.0 ** -9


def _train(run_dir: str, dtype: str, steps: int, save_every: int = 0, layout: str = LAYOUT):
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
    from tessera.recipes.train import train

    model = ModelConfig(vision="radio_vit_tiny", dtype=dtype)
    data = DataConfig(seq_length=128, rows_per_microbatch=4, microbatches=2)
    trainer = TrainerConfig(max_steps=steps, run_dir=run_dir, save_every=save_every, progress=False,
                            tensorboard=False)
    optim = OptimConfig(lr=TRAIN_LR, warmup_steps=2, min_lr_ratio=1.0)  # constant LR after warm-up
    return train(model, data, optim, trainer, layout=layout, name="mp")


def _reshard(src_run: str, dst_root: str) -> None:
    """Load src_run's latest checkpoint into OTHER_LAYOUT's modules and optimizer and save it again."""
    from megatron.core import dist_checkpointing

    from tessera.hetero.runtime.groups import destroy_module_groups
    from tessera.hetero.build.run_state import build_run
    from tessera.hetero.checkpoint.sharded import latest_checkpoint, save_checkpoint
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig

    cfg = RunConfig("mp", OTHER_LAYOUT, ModelConfig(vision="radio_vit_tiny", dtype="bfloat16"),
                    DataConfig(seq_length=128, rows_per_microbatch=4, microbatches=2),
                    OptimConfig(lr=TRAIN_LR, warmup_steps=2, min_lr_ratio=1.0),
                    TrainerConfig(max_steps=RESUME_TO, run_dir=src_run, progress=False, tensorboard=False))
    from tessera.recipes.checks import resolve

    run = build_run(cfg, resolve(cfg, dist.get_world_size()), Path(src_run), torch.device("cpu"))
    assert run.start == SAVE_AT and run.groups["language"].pgs.tp.size() == 2
    common = dist_checkpointing.load_common_state_dict(str(latest_checkpoint(src_run + "/checkpoints")))["common"]
    save_checkpoint(dst_root, SAVE_AT, run.modules, run.opt, run.groups, run.configs,
                    {k: v for k, v in common.items() if k not in ("world", "step")})
    destroy_module_groups(run.groups)


def _all_runs(root: str) -> None:
    root = Path(root)
    _train(str(root / "fp32"), "float32", TRAIN_STEPS)
    _train(str(root / "bf16"), "bfloat16", TRAIN_STEPS, save_every=SAVE_AT)
    if dist.get_rank() == 0:  # a fresh run directory whose latest checkpoint is the bf16 run's step 10
        src = root / "bf16" / "checkpoints" / f"step_{SAVE_AT:06d}"
        (root / "resumed" / "checkpoints").mkdir(parents=True)
        import shutil

        shutil.copytree(src, root / "resumed" / "checkpoints" / src.name)
        (root / "resumed" / "checkpoints" / "latest").write_text(src.name + "\n")
    dist.barrier()
    _reshard(str(root / "resumed"), str(root / "resharded"))
    _train(str(root / "resumed"), "bfloat16", RESUME_TO)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tessera.hetero.tools.spawn import run_on_ranks

    root = tmp_path_factory.mktemp("mixed")
    run_on_ranks(2, _all_runs, str(root), timeout=600)
    return root


def _losses(run_dir: Path) -> list[float]:
    from tessera.hetero.training.metrics import read_metrics

    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.multiproc
def test_bf16_follows_the_fp32_curve(trained):
    fp32, bf16 = _losses(trained / "fp32"), _losses(trained / "bf16")
    assert len(fp32) == len(bf16) == TRAIN_STEPS
    assert fp32[-1] < fp32[0] - 0.2, f"the model does not learn: {fp32[0]:.3f} -> {fp32[-1]:.3f}"
    gap = max(abs(b - f) / f for b, f in zip(bf16, fp32))
    assert gap <= BF16_REL_TOL, f"bf16 leaves the fp32 curve: max relative gap {gap:.2e} > {BF16_REL_TOL:.2e}"
    assert fp32 != bf16, "the bf16 run computed in fp32"
    drop_fp32, drop_bf16 = fp32[0] - fp32[-1], bf16[0] - bf16[-1]
    assert abs(drop_bf16 - drop_fp32) <= 0.02 * drop_fp32, f"bf16 learns {drop_bf16:.4f}, fp32 {drop_fp32:.4f}"


@pytest.mark.multiproc
def test_bf16_resume_is_bitwise_and_reshards_masters_exactly(trained, world1):
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    bf16, resumed = _losses(trained / "bf16"), _losses(trained / "resumed")
    assert resumed == bf16[SAVE_AT:RESUME_TO], "resume of a bf16 checkpoint must be bitwise identical"
    # the checkpoint holds fp32 masters and fp32 Adam states next to the bf16 weights
    src = trained / "bf16" / "checkpoints" / f"step_{SAVE_AT:06d}"
    dst = trained / "resharded" / f"step_{SAVE_AT:06d}"
    a, b = ({k: v for k, v in load_plain_tensors(str(p)).items() if isinstance(v, torch.Tensor)}  # whole tensors
            for p in (src, dst))
    masters = [k for k in a if k.startswith("optim.master.")]
    assert masters and all(a[k].dtype == torch.float32 for k in masters)
    assert all(a[k].dtype == torch.float32 for k in a if k.startswith("optim.exp_avg"))
    assert all(a[k].dtype == torch.bfloat16 for k in a if k.startswith("model.language.layers"))
    # loaded into TP 2 and saved again: every weight, master and Adam state bit for bit
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"changed by resharding: {diff[:5]}"

