"""The GPU path, checked on CPU: device placement of a real training step, kernel choice, launchers, pins.

The step test runs the loop's own pieces (hetero/training/loop.py: build, loader, one `_train_step`) on 2
gloo ranks under tests/_device_audit.DeviceAudit, with the run's device a device value of its own
(cpu:0) and the loader's batches registered as host memory: every tensor that reaches a collective or a
module must have been moved to the run's device, as NCCL and CUDA kernels require. Then the same ranks run
a step with the language stage's move and the media module's move taken out, and the audit must name them.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tessera.hetero.tools.spawn import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
# PP=2 language (p2p activations: step_executor's recv buffers), encoders DP=2 (gradient all-reduces, boundary
# p2p from rank 1's rows to the first LLM stage on rank 0)
LAYOUT = "vision=dp2@0-1;audio=dp2@0-1;language=pp2@0-1"


def _audited_steps(run_dir: str) -> dict:
    import numpy as np
    import torch.distributed as dist

    from _device_audit import RUN, DeviceAudit
    from tessera.data.loader import close_loader
    from tessera.hetero.training import loop, stages
    from tessera.hetero.build.run_state import build_run
    from tessera.hetero.training.step_parts import run_loader, step_context
    from tessera.models import multimodal
    from tessera.hetero.runspec.config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig

    cfg = RunConfig("gpu_path", LAYOUT, ModelConfig(vision="radio_vit_tiny", audio="fastconformer_tiny"),
                    # 192: both steps hold images and audio clips (the audit must reach every module)
                    DataConfig(seq_length=192, rows_per_microbatch=2, microbatches=2), OptimConfig(),
                    TrainerConfig(max_steps=3, run_dir=run_dir, progress=False, tensorboard=False))
    from tessera.recipes.checks import resolve

    out = {}
    with DeviceAudit(RUN) as audit:
        run = build_run(cfg, resolve(cfg, dist.get_world_size()), Path(run_dir), RUN)
        loader = run_loader(run, run.data_path)
        ctx = step_context(run)
        it = audit.host_batches(iter(loader))
        record, _ = loop._train_step(run, 0, it, ctx)
        out["clean"] = list(audit.violations)
        out["loss"], out["checked"] = record["loss"], dict(audit.checked)
        out["collectives"], out["modules"] = sorted(audit.collectives), sorted(audit.modules)

        # mutations: the batch slice and the decoded media items left in host memory
        audit.violations.clear()
        local, device = stages.LanguageStage._local, multimodal.MediaModule.device
        stages.LanguageStage._local = lambda self, t: t[self.rows][:, self.pos]
        multimodal.MediaModule.device = property(lambda self: torch.device("cpu"))
        try:
            loop._train_step(run, 1, it, ctx)
        except Exception as e:  # a host tensor may also break an op further on; the audit names it first
            out["mutant_error"] = repr(e)
        finally:
            stages.LanguageStage._local, multimodal.MediaModule.device = local, device
        out["mutant"] = list(audit.violations)
    close_loader(loader)
    return out


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    return run_on_ranks(2, _audited_steps, str(tmp_path_factory.mktemp("gpu_path")), timeout=300)


@pytest.mark.multiproc
def test_every_tensor_reaching_a_collective_or_a_module_is_on_the_run_device(audited):
    for rank, res in enumerate(audited):
        assert res["clean"] == [], f"rank {rank}:\n" + "\n".join(res["clean"][:20])
        # the audit really saw the step: gradient/loss all-reduces, pipeline and boundary p2p, the modules
        assert {"all_reduce", "isend", "irecv"} <= set(res["collectives"]), res["collectives"]
        assert res["checked"]["module"] > 50
    seen = set(audited[0]["modules"]) | set(audited[1]["modules"])
    # decoded tiles/frames reach the ViT, waves the mel front end and the conformer, on the device
    assert {"HybridLM", "MediaModule", "VisionTransformer", "AudioToMelSpectrogramPreprocessor",
            "FastConformerEncoder"} <= seen, seen
    assert audited[0]["loss"] == audited[1]["loss"] > 0


@pytest.mark.multiproc
def test_audit_names_a_missing_move(audited):
    """Without the language stage's `.to(device)` (stages.py) and the media module's move (multimodal.py)
    the same step records host tensors entering the LLM and the vision/audio encoders."""
    both = "\n".join(v for res in audited for v in res["mutant"])
    assert "into module HybridLM" in both, both[:3000]
    assert re.search(r"into module (VisionEncoder|VideoEncoder|FastConformerEncoder)", both), both[:3000]


def test_audit_basics():
    from _device_audit import RUN, DeviceAudit

    with DeviceAudit(RUN) as audit:
        lin = torch.nn.Linear(4, 2)
        x = torch.ones(3, 4)
        lin(x)  # both host: computes on the host, but a module input from the host is flagged
        assert len(audit.violations) == 1 and "into module Linear" in audit.violations[0]
        lin.to(RUN)
        assert lin.weight.device == RUN and x.device == torch.device("cpu")
        lin(x)  # host input into a device module
        y = x.to(RUN)
        assert y.device == RUN and not audit.is_host(y) and audit.is_host(x)
        lin(y) + torch.zeros(2)  # device output mixed with a host tensor
        assert torch.zeros(2, device=y.device).device == RUN  # a device taken from a tensor is the run's
        assert lin(y)[torch.tensor([0, 1])].device == RUN      # host indices are fine
        y.sum() * torch.tensor(2.0)                             # so are host scalars
    assert [v.split(" at ")[0] for v in audit.violations] == [
        "host tensor (3, 4) torch.float32 into module Linear", "host tensor (3, 4) torch.float32 into module Linear",
        "linear mixes host and device tensors", "add mixes host and device tensors"]


# ---- kernel choice, launch, pins ----------------------------------------------------------------------

class _Group:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


class _PGs:
    def __init__(self, cp):
        self.cp = _Group(cp)


HEADS = SimpleNamespace(num_attention_heads=4, num_query_groups=2, mamba_num_heads=8, mamba_num_groups=2)


def test_transformer_engine_only_in_half_precision():
    from tessera.hetero.parallel.cp_heads import HeadParallelCoreAttention
    from tessera.hetero.parallel.kernel_choice import select_kernels
    from tessera.models.sdpa_attention import SDPACoreAttention

    have_all = lambda m: True  # noqa: E731
    fp32_cp = select_kernels(_PGs(2), gpu=True, have=have_all, dtype=torch.float32, config=HEADS)
    # fp32 at CP > 1: head-parallel around SDPA (TE's fused backends take only half precision)
    assert issubclass(fp32_cp.core_attention, HeadParallelCoreAttention)
    assert fp32_cp.core_attention.inner_class is SDPACoreAttention
    assert select_kernels(_PGs(1), gpu=True, have=have_all).core_attention is SDPACoreAttention
    assert "transformer_engine" not in fp32_cp.line
    # bf16 picks TE whenever it imports (the class is built lazily from megatron's TE extension, so only the
    # choice is checked here: the name in the log line), at CP > 1 inside the head-parallel all-to-alls, so
    # TE sees whole packed documents of its heads and never its own CP
    from tessera.hetero.parallel import kernel_choice

    chosen = []
    orig = kernel_choice.te_document_attention
    kernel_choice.te_document_attention = lambda: chosen.append(1) or SDPACoreAttention
    try:
        bf16 = select_kernels(_PGs(1), gpu=True, have=have_all, dtype=torch.bfloat16)
        bf16_cp = select_kernels(_PGs(2), gpu=True, have=have_all, dtype=torch.bfloat16, config=HEADS)
    finally:
        kernel_choice.te_document_attention = orig
    assert chosen and "attention=transformer_engine" in bf16.line and "dtype=bfloat16" in bf16.line
    assert "attention=head-parallel(cp=2)+transformer_engine" in bf16_cp.line, bf16_cp.line
    assert "mamba=head-parallel(cp=2)+mamba_ssm" in bf16_cp.line, bf16_cp.line


def test_a_broken_kernel_build_is_not_picked(tmp_path, monkeypatch):
    """find_spec finds a package whose import fails (a build against another torch/CUDA); the probe imports."""
    import importlib.util

    from tessera.hetero.parallel import kernel_choice

    pkg = tmp_path / "tessera_broken_ext"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    (tmp_path / "tessera_good_ext.py").write_text("causal_conv1d_fn = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("tessera_broken_ext") is not None
    monkeypatch.setitem(kernel_choice.PROBES, "causal_conv1d", [("tessera_good_ext", "causal_conv1d_fn")])
    monkeypatch.setitem(kernel_choice.PROBES, "mamba_ssm", [("tessera_broken_ext", "mamba_chunk_scan_combined")])
    kernel_choice.installed.cache_clear()
    try:
        assert kernel_choice.installed("causal_conv1d") and not kernel_choice.installed("mamba_ssm")
        assert select_ok(kernel_choice) == "torch-ssd"
    finally:
        kernel_choice.installed.cache_clear()


def select_ok(kernel_choice) -> str:
    return kernel_choice.select_kernels(_PGs(1), gpu=True).line.split("mamba=")[1].split()[0]


def _fake_mamba_ssm(monkeypatch, conv: bool):
    """mamba_ssm importable (its Triton scan replaced by the torch SSD scan, seq_idx read as documents, which is
    what the kernel does with it); causal_conv1d importable only when `conv`. Triton cannot run on this CPU."""
    import types

    from tessera.models.mamba2 import document_starts, ssd_chunk_scan

    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, initial_states=None, seq_idx=None):
        assert x.is_contiguous() and (seq_idx is None or seq_idx.dtype == torch.int32)
        return ssd_chunk_scan(x, dt, A, B, C, chunk_size, initial_states, resets=document_starts(seq_idx))[0]

    names = ["mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.ops.triton.ssd_combined"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].mamba_chunk_scan_combined = mamba_chunk_scan_combined
    fake_conv = types.ModuleType("causal_conv1d")
    fake_conv.causal_conv1d_fn = None
    monkeypatch.setitem(sys.modules, "causal_conv1d", fake_conv if conv else None)  # None: ImportError


def test_fused_mamba_scan_whenever_mamba_ssm_imports_conv_chosen_on_its_own(monkeypatch):
    """mamba_ssm without causal_conv1d (a MAMBA_SKIP_CUDA_BUILD wheel, no nvcc for causal_conv1d): the fused scan
    with torch's conv, not the torch scan; with both, both fused; the `kernels:` line names each."""
    from tessera.hetero.parallel import kernel_choice as kc

    moe = SimpleNamespace(num_moe_experts=4)
    for conv, one_rank, head_parallel, name in [
            (False, kc.MambaSSMScanMixer, kc.HeadParallelMambaSSMScanMixer, "mamba_ssm+torch-conv"),
            (True, kc.MambaSSMMixer, kc.HeadParallelMambaSSMMixer, "mamba_ssm+causal_conv1d")]:
        _fake_mamba_ssm(monkeypatch, conv)
        kc.installed.cache_clear()
        try:
            gpu = kc.select_kernels(_PGs(1), gpu=True, config=moe)
            assert gpu.mamba_mixer is one_rank, (conv, gpu.line)
            assert gpu.line == f"kernels: attention=torch-sdpa mamba={name} experts=torch-grouped-mm device=cuda"
            cp = kc.select_kernels(_PGs(2), gpu=True, config=HEADS)
            assert cp.mamba_mixer is head_parallel and f"mamba=head-parallel(cp=2)+{name} " in cp.line, cp.line
            assert kc.select_kernels(_PGs(1), gpu=False).mamba_mixer is kc.Mamba2Mixer  # no GPU: torch's scan
        finally:
            kc.installed.cache_clear()


def test_mamba_ssm_built_without_cuda_extensions_gives_its_triton_scan(tmp_path, monkeypatch):
    """A MAMBA_SKIP_CUDA_BUILD=TRUE build (README: shipped to a cluster without package access) has no
    selective_scan_cuda, which mamba_ssm/__init__.py imports; its Triton scan still imports and is picked."""
    from tessera.hetero.parallel import kernel_choice as kc

    triton_dir = tmp_path / "mamba_ssm" / "ops" / "triton"
    triton_dir.mkdir(parents=True)
    (tmp_path / "mamba_ssm" / "__init__.py").write_text("import selective_scan_cuda  # as mamba_ssm 2.x does\n")
    (tmp_path / "mamba_ssm" / "ops" / "__init__.py").write_text("")
    (triton_dir / "__init__.py").write_text("")
    (triton_dir / "ssd_combined.py").write_text("def mamba_chunk_scan_combined(*args, **kwargs):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # not shipped: torch's conv
    kc.installed.cache_clear()
    try:
        with pytest.raises(ImportError, match="selective_scan_cuda"):
            importlib.import_module("mamba_ssm.ops.triton.ssd_combined")  # what a plain import does
        assert kc.installed("mamba_ssm")
        chosen = kc.select_kernels(_PGs(1), gpu=True)
        assert chosen.mamba_mixer is kc.MambaSSMScanMixer and "mamba=mamba_ssm+torch-conv" in chosen.line
    finally:
        kc.installed.cache_clear()
        for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
            del sys.modules[name]


def test_fused_scan_mixer_with_torch_conv_equals_the_torch_mixer(monkeypatch):
    """MambaSSMScanMixer's call into mamba_chunk_scan_combined (layouts, packed documents as int32 seq_idx) against
    the torch mixer, the kernel faked by the torch scan: what is left to differ on a GPU is the kernel itself
    (scripts/gpu_check.py mamba_ssm_scan, both sides in IEEE fp32)."""
    from _mcore_cpu import single_rank_world
    from megatron.core.models.backends import LocalSpecProvider

    from tessera.hetero.parallel.kernel_choice import MambaSSMScanMixer
    from tessera.models import configs
    from tessera.models.mamba2 import Mamba2Mixer, Mamba2Submodules
    from tessera.models.nemotron_h_hf import hybrid_config_from_hf

    pgs = single_rank_world()
    _fake_mamba_ssm(monkeypatch, conv=False)
    cfg = hybrid_config_from_hf(configs.TINY_DENSE)
    backend = LocalSpecProvider()
    sub = Mamba2Submodules(in_proj=backend.column_parallel_linear(), out_proj=backend.row_parallel_linear())
    torch.manual_seed(0)
    ref, fused = Mamba2Mixer(cfg, sub, pg_collection=pgs), MambaSSMScanMixer(cfg, sub, pg_collection=pgs)
    fused.load_state_dict(ref.state_dict())
    hidden = torch.randn(20, 2, cfg.hidden_size)
    doc_ids = torch.tensor([[0] * 7 + [1] * 13, [0] * 20])
    for kwargs in ({}, {"doc_ids": doc_ids}):
        assert torch.equal(fused(hidden, **kwargs)[0], ref(hidden, **kwargs)[0]), kwargs


def test_local_rank_is_checked_against_the_gpus(monkeypatch):
    from tessera.hetero.runtime import device

    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device.bind_local_device() == torch.device("cuda", 1) and picked == [1]
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 but this node shows 2 GPU"):
        device.bind_local_device()
    assert picked == [1]


def test_launchers_bind_the_device_before_the_process_group():
    """Every real world (hetero/runtime/world.py: process_world, join_world, one_rank_world) calls
    bind_local_device before init_process_group; every entry point (the trainer, verify, parity, spawn's ranks,
    the recipe check, the LLM bench, the GPU check and step, the export) joins through process_world, the one
    bootstrap, and creates no group itself."""
    import ast

    for path in ("hetero/runtime/world.py",):
        tree = ast.parse((ROOT / path).read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            text = ast.unparse(fn)
            init = text.find("init_process_group(")
            if init >= 0 and "'fake'" not in text[init:init + 40]:
                # bound on the path that reaches init: after any early return
                assert text.rfind("bind_local_device(", 0, init) > text.rfind("return", 0, init), (path, fn.name)
    for path in ("recipes/train.py", "hetero/tools/parity.py", "hetero/tools/verify.py", "hetero/tools/spawn.py",
                 "recipes/verify.py", "scripts/bench_llm.py", "scripts/gpu_check.py", "scripts/gpu_step.py",
                 "hetero/export/hf.py", "scripts/convert_hf.py", "scripts/bench_progress.py"):
        text = (ROOT / path).read_text()
        assert "process_world(" in text, path
        for own in ("init_process_group(", "join_world(", "one_rank_world(", "apply_cpu_shims("):
            assert own not in text, (path, own)


def test_gpu_extra_pins_megatron_cores_ranges():
    """The `gpu` extra carries exactly the ranges megatron-core declares for TE, mamba-ssm, causal-conv1d."""
    import tomllib
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    ours = {Requirement(r).name: Requirement(r) for r in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]}
    theirs = {Requirement(r).name: Requirement(r) for r in requires("megatron-core")
              if Requirement(r).name in ours and 'extra == "dev"' in r}
    assert set(ours) == set(theirs) == {"transformer-engine", "mamba-ssm", "causal-conv1d"}
    for name, req in ours.items():
        assert req.specifier == theirs[name].specifier, name
    assert "pytorch" in ours["transformer-engine"].extras


def test_gpu_check_dry_run_and_no_gpu_message():
    cmd = [sys.executable, "-m", "tessera.scripts.gpu_check"]
    dry = subprocess.run(cmd + ["--dry"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert dry.returncode == 0, dry.stderr
    for needle in ("te_attention", "te_attention_thd", "mamba_ssm_scan", "causal_conv1d", "train_step_bf16",
                   "nemotron_nano_12b_v2", "nemotron_3_nano_30b_a3b", "TFLOPS"):
        assert needle in dry.stdout, needle
    if not torch.cuda.is_available():
        real = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert real.returncode == 2 and "no CUDA GPU" in real.stderr, real.stderr


def test_gpu_step_smoke_runs_the_layer_table_and_the_trainer(capsys):
    """scripts/gpu_step.py --smoke: the per-layer table and one slice's trainer run at tiny shapes on this CPU, the
    same functions the GPU run uses (the trainer's own FLOP count read back from its metrics.jsonl)."""
    from tessera.scripts import gpu_step

    assert gpu_step.main(["--recipes", "nemotron_omni_30b_a3b"]) == 2  # no GPU here: says so, runs nothing
    assert "no CUDA GPU" in capsys.readouterr().err
    res = subprocess.run([sys.executable, "-m", "tessera.scripts.gpu_step", "--smoke", "--recipes",
                          "nemotron_omni_30b_a3b", "--iters", "1"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    layers = {ln.split()[1]: ln.split() for ln in lines if ln.startswith("nemotron_h_tiny_moe ")}
    assert set(layers) == {"M", "*", "E"}, res.stdout
    assert all(float(row[4]) > 0 for row in layers.values()), res.stdout  # TFLOPS of a real forward+backward
    step = [ln.split() for ln in lines if ln.startswith("nemotron_omni_30b_a3b ")]
    assert len(step) == 1 and step[0][1] == "nemotron_h_tiny_moe" and step[0][2] == "1", res.stdout
    assert float(step[0][4]) > 0 and "experts=torch-grouped-mm" in lines[-1], res.stdout

