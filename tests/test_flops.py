"""Model FLOPs (hetero/planner/flops.py, what the planner prices and the trainer logs as TFLOPS/GPU and MFU)
against torch's FlopCounterMode, the outside count of what the ops execute, on the tiny models and real batches.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_flops.py -x -q

The oracle runs SDPA on its math backend (FlopCounterMode does not count the fused CPU kernel) and therefore
counts the full S x S scores; the LLM's attention is causal, which a causal kernel computes half of, so its
attention counts are halved. The Mamba scan's einsums are left out of both sides: torch's reference chunked scan
(models/mamba2.py, per head, the whole chunk) is a different algorithm from the fused kernel the formula prices
(per group, the causal half); everything through a weight, the convolutions and attention are compared.
"""

from __future__ import annotations

import pytest
import torch
from _mcore_cpu import single_rank_world
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tessera.data.loader import close_loader
from tessera.data.pipeline import build_train_loader, encoder_tokens, synthetic_dataset
from tessera.models.encoders import video_temporal
from tessera.hetero.planner.flops import StepFlops, media_item_flops, peak_tflops
from tessera.hetero.planner.model import llm_blocks, describe_model
from tessera.models import configs

SEQ, ROWS = 256, 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("flops"))


def _batch(dataset, encoders):
    path, tok = dataset
    loader = build_train_loader(path, tok, encoders, SEQ, ROWS, decode=None, seed=3)
    b = next(iter(loader))
    close_loader(loader)
    return b


def _model(llm_fields, encoders):
    from tessera.models.hybrid_llm import HybridLM
    from tessera.models.multimodal import MultimodalModel, build_media_module
    from tessera.models.nemotron_h_hf import hybrid_config_from_hf

    pg = single_rank_world()
    torch.manual_seed(0)
    llm = HybridLM(hybrid_config_from_hf(llm_fields), pg)
    tubelets = video_temporal(encoders) > 1
    return MultimodalModel(llm, {m: build_media_module(name, llm_fields["hidden_size"], pg,
                                                       tubelets=tubelets and m == "vision")
                                 for m, name in encoders.items()})


def _oracle(model, b) -> dict[str, float]:
    """FlopCounterMode's forward FLOPs per module, the LLM's causal attention halved and its Mamba scans left out."""
    with FlopCounterMode(display=False) as fc, sdpa_kernel(SDPBackend.MATH):
        model(b.tokens, b.media, b.positions, labels=b.labels)
    counts = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
    bmm = {k: sum(c for op, c in v.items() if "bmm" in str(op)) for k, v in fc.get_flop_counts().items()}
    out = {key: counts.get(f"MultimodalModel.media.{key}", 0) for key in model.media}
    attn = sum(c for k, c in bmm.items() if k.endswith("core_attention"))
    scans = sum(c for k, c in bmm.items() if k.endswith(".mixer") and "layers" in k)
    out["language"] = counts["MultimodalModel.llm"] - attn / 2 - scans
    return out


@pytest.mark.parametrize("llm, encoders", [
    ("nemotron_h_tiny_dense", {"vision": "radio_vit_tiny"}),                                  # VL: tiles
    ("nemotron_h_tiny_dense", {"vision": "radio_vit_tiny", "audio": "fastconformer_tiny"}),   # omni: native, tubelets
    ("nemotron_h_tiny_moe", {"vision": "siglip_tiny"}),
])
def test_step_flops_match_flop_counter(dataset, llm, encoders):
    from tessera.data.tokens import Tokenizer

    fields = dict(configs.hf_fields(llm), vocab_size=-(-Tokenizer(dataset[1]).vocab_size // 64) * 64)
    b = _batch(dataset, encoders)
    kinds = {m[0] for row in b.media_meta for items in row.values() for m in items}
    want = _oracle(_model(fields, encoders), b)

    model_cfg = type("M", (), {"vision": encoders.get("vision"), "audio": encoders.get("audio")})
    flops = StepFlops(model_cfg, fields)
    got = {k: v / 3 for k, v in flops.step_flops([b]).items()}  # the step's forward
    c = fields
    di, n, g, Q = c["mamba_num_heads"] * c["mamba_head_dim"], c["ssm_state_size"], c["n_groups"], c["chunk_size"]
    ssd = g * n * Q + di * Q + 4 * di * n  # the formula's fused scan, left out like the oracle's (docstring)
    assert llm_blocks(c)["M"]["scan"] - 2 * (di + 2 * g * n) * c["conv_kernel"] == ssd
    got["language"] -= ROWS * SEQ * c["hybrid_override_pattern"].count("M") * ssd
    print(f"\n{llm} {sorted(encoders.values())} media {sorted(kinds)}: " + ", ".join(
        f"{k} {got[k] / 1e6:.2f} vs {want[k] / 1e6:.2f} MFLOP" for k in sorted(want)))
    assert set(got) == set(want)
    for key in want:
        assert want[key] > 0 and got[key] == pytest.approx(want[key], rel=0.05), key


def test_native_grid_costs_the_square_of_its_patches():
    """A native-resolution image is one sequence, so 4x its patches cost more than 4x (attention); tiles add up."""
    desc = describe_model("nemotron_h_tiny_dense", "radio_vit_tiny")["vision"]
    tok = encoder_tokens({"vision": "radio_vit_tiny"})
    one, four = media_item_flops(desc, tok, "image", (4, 4)), media_item_flops(desc, tok, "image", (8, 8))
    assert four > 4 * one
    assert media_item_flops(desc, tok, "image", 3) == 3 * media_item_flops(desc, tok, "image", 1)


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0  # the PCIe part before the SXM one
    assert peak_tflops("NVIDIA H200", "float32") == 66.9
    assert peak_tflops("cpu", "bfloat16") is None
