"""Nemotron Nano V2 VL exact against an oracle that is not Tessera (issue 46, item 2).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_parity_nano_vl.py -q -s -p no:cacheprovider

transformers has no Nano V2 VL class: the oracle (models/nano_vl_reference.py) is transformers' RadioModel +
the release's pixel shuffle (v2) and mlp1 + transformers' NemotronHForCausalLM, wired as vLLM's
nano_nemotron_vl.py wires the release, on the tiny checkpoint's own tensors (scripts/tiny_release.nano_vl_checkpoint,
hub config.json, weights re-drawn at unit gain so the media move the logits). Samples: an image cut by the
release processor's tile rule (2x1 tiles + thumbnail), two images (1x3 + thumbnail, one tile), a video of three
frames (one tile and one <img> ... </img> chunk a frame), a video then an image (models/nano_vl_reference.py). Tessera's side: the trainer's modules built as a
fine-tune of that directory in each layout (hetero/tools/parity_multimodal.compare_multimodal). Logits <= 1e-4
(fp32) on one rank (the command) and in heterogeneous layouts on 4 gloo ranks, one spawn (non-colocated LLM
TP/CP/PP, colocated vision PP); the first-step loss on one rank equal to the oracle's cross entropy over the
same text targets (hetero/tools/parity_loss.py); breaks on purpose must fail.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from _hf_tiny import unit_gain_
from test_release_layouts import _release_tile_grid

TOL = 1e-4
LAYOUTS = {
    "noncolocated_llm_tp2": "vision=dp2@0-1;language=tp2@2-3",
    "noncolocated_llm_cp2": "vision=dp2@0-1;language=cp2@2-3",
    "noncolocated_llm_pp2": "vision=dp2@0-1;language=pp2@2-3",
    "colocated_vision_pp2_llm_tp2": "vision=pp2,dp2@0-3;language=tp2,dp2@0-3",
}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from tessera.scripts.tiny_release import nano_vl_checkpoint

    d = tmp_path_factory.mktemp("nano_vl") / "release"
    nano_vl_checkpoint(d, prepare=unit_gain_)
    return str(d)


def test_samples_follow_the_release_rules(release):
    """The tiles are the release rule's (grid of the InternVL rule as tests/test_release_layouts reimplements it,
    thumbnail last) and within PIL-vs-torch resampling of Tessera's own cut (data path: models/tiling.cut_tiles on
    the decoded image); every img_context position is one embedding, per_tile per tile or frame, in order."""
    from tessera.data.media import choose_grid
    from tessera.models.nano_vl_reference import hub_config, nano_vl_samples, release_tiles, sample_tiles
    from tessera.models.tiling import cut_tiles, hwc_to_nchw

    hub = hub_config(release)
    tile, context = hub["force_image_size"], hub["img_context_token_id"]
    per_tile = (tile // hub["patch_size"]) ** 2 // 4
    rng = np.random.default_rng(0)
    for w, h in ((150, 70), (60, 190), (50, 50), (300, 300), (700, 90)):
        image = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        cols, rows, thumb = _release_tile_grid(w, h, 12, tile, True)
        ours = release_tiles(image, tile)
        assert ours.shape == (cols * rows + thumb, 3, tile, tile), (w, h)
        grid = choose_grid(w, h, 12, True, tile)
        tessera = cut_tiles(hwc_to_nchw(image), grid.cols, grid.rows, grid.thumbnail, tile).numpy()
        assert tessera.shape == ours.shape
        assert np.abs(tessera.astype(int) - ours.astype(int)).mean() < 2.0, (w, h)  # bicubic: PIL vs torch
    samples = nano_vl_samples(release)
    assert [s.name for s in samples] == ["image", "two_images", "video", "video_then_image"]
    assert [[len(item[0] if k == "video" else item) for _, k, item, _, _ in s.media] for s in samples] == \
        [[3], [4, 1], [3], [2, 3]]
    for s in samples:
        assert int((s.tokens == context).sum()) == len(sample_tiles(s)) * per_tile == sum(n for *_, n in s.media)
    video = samples[2]
    assert [n for _, n in video.chunks[0]] == [per_tile] * 3
    starts = [a for a, _ in video.chunks[0]]
    assert all(int(video.tokens[a - 1]) != context and int(video.tokens[a + per_tile]) != context for a in starts)


def test_oracle_is_the_release_wiring(release):
    """The oracle's pieces against the release's definitions: pixel shuffle v2 moves patch (i, j)'s 2x2 block
    into one token (vLLM pixel_shuffle), the media reach the logits, and the oracle refuses a tensor it cannot
    place."""
    from tessera.models.nano_vl_reference import NanoVLReference, nano_vl_reference_logits, nano_vl_samples, \
        pixel_shuffle_v2

    x = torch.arange(4 * 4 * 2, dtype=torch.float32).view(1, 4, 4, 2)
    y = pixel_shuffle_v2(x, 0.5)
    assert y.shape == (1, 2, 2, 8)
    for p in range(2):
        for q in range(2):  # token (p, q) holds patches (2p, 2q), (2p, 2q+1), (2p+1, 2q), (2p+1, 2q+1), in order
            block = torch.cat([x[0, 2 * p, 2 * q], x[0, 2 * p, 2 * q + 1], x[0, 2 * p + 1, 2 * q],
                               x[0, 2 * p + 1, 2 * q + 1]])
            assert torch.equal(y[0, p, q], block), (p, q)
    model = NanoVLReference(release)
    samples = nano_vl_samples(release)
    ref = nano_vl_reference_logits(release, samples, model)
    with torch.no_grad():
        text_only = model(samples[0].tokens[None], None)[0]
    assert (ref[0] - text_only).abs().max() > 1e-2  # the image moves the logits
    from safetensors.torch import load_file, save_file

    import shutil
    from pathlib import Path

    stray = Path(release).parent / "stray"
    shutil.copytree(release, stray, dirs_exist_ok=True)
    tensors = load_file(str(stray / "model.safetensors"))
    tensors["sound_projection.norm.weight"] = torch.ones(4)
    save_file(tensors, str(stray / "model.safetensors"))
    with pytest.raises(KeyError, match="sound_projection.norm.weight belongs to no part"):
        NanoVLReference(str(stray))


def _verdict(out: str) -> tuple[str, float]:
    m = re.search(r"^parity: (PASS|FAIL) max_rel_err=(\S+)", out, re.M)
    assert m, out[-3000:]
    return m.group(1), float(m.group(2))


def test_one_rank_command_and_first_step_loss(release):
    """`python -m tessera.hetero.tools.parity --hf-dir VL_DIR` passes against the oracle; on one rank, Tessera's
    first-step loss equals the oracle's cross entropy over the same targets."""
    res = subprocess.run([sys.executable, "-m", "tessera.hetero.tools.parity", "--hf-dir", release],
                         capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    verdict, err = _verdict(out)
    print(f"\nnano vl one rank: {verdict} max_rel_err={err:.3e}")
    assert res.returncode == 0 and verdict == "PASS" and err <= TOL, out[-3000:]
    assert "samples image, two_images, video, video_then_image" in out and "video: compared, frame by frame" in out


def _layouts(hf_dir: str) -> list:
    from tessera.hetero.tools.parity_loss import first_step_loss
    from tessera.hetero.tools.parity_multimodal import compare_multimodal

    out = [(name, compare_multimodal(hf_dir, layout)["max_rel_err"]) for name, layout in LAYOUTS.items()]
    loss = first_step_loss(hf_dir, LAYOUTS["noncolocated_llm_tp2"])
    out.append(("first_step_loss_rel_err", abs(loss["loss"] - loss["oracle_loss"]) / loss["oracle_loss"]))
    out.append(("BROKEN_mlp1_weight_x1.01", compare_multimodal(hf_dir, LAYOUTS["noncolocated_llm_cp2"],
                                                                perturb={"mlp1.1.weight": 1.01})["max_rel_err"]))
    return out


def _one_rank_loss(hf_dir: str) -> dict:
    from tessera.hetero.tools.parity_loss import first_step_loss

    return first_step_loss(hf_dir)


def test_first_step_loss_on_one_rank(release):
    """Tessera's first-step loss (one hetero_step, the trainer's LanguageStage, before any update) equals the
    oracle's mean cross entropy over the same text targets (every next token that is not an img_context)."""
    from tessera.hetero.tools.spawn import run_on_ranks

    (res,) = run_on_ranks(1, _one_rank_loss, release, timeout=600)
    print(f"\nfirst-step loss: tessera {res['loss']:.10f} oracle {res['oracle_loss']:.10f} ({res['targets']} targets)")
    assert res["targets"] == 85  # 25 + 36 + 42 + 46 next tokens of the four samples, less 12 + 20 + 12 + 20 img_context
    assert abs(res["loss"] - res["oracle_loss"]) <= TOL * res["oracle_loss"], res


@pytest.mark.multiproc
def test_layouts_on_four_ranks_and_a_break_fails(release):
    from tessera.hetero.tools.spawn import run_on_ranks

    results = run_on_ranks(4, _layouts, release, timeout=900)
    assert all(r == results[0] for r in results), results  # every rank knows the verdicts
    print()
    for case, err in results[0]:
        print(f"{case:40s} {LAYOUTS.get(case, ''):45s} rel_err={err:.3e}")
        if case.startswith("BROKEN"):
            assert not err <= TOL, (case, err)  # NaN counts as a failure too
        else:
            assert err <= TOL, (case, err)
