"""Logit parity with transformers' released Omni model (NemotronH_Omni_Reasoning_V3) in heterogeneous layouts
(issue 15, item 2): hetero/tools/parity_multimodal.py, reached through `-m tessera.hetero.tools.parity`.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_parity_multimodal.py -q -s -p no:cacheprovider

Two tiny releases written offline by transformers (scripts/tiny_release.py): vision + audio + MoE LLM with the
config's own image/audio token ids, and vision + dense LLM with none (the tool's stand-in ids). Every weight
that starts small or constant is re-drawn at unit gain (as tests/test_released_loss.py does), so the media
reach the logits measurably and a broken encoder or projector shows. One-rank: the command itself (exit code,
verdict line). Four ranks, one launch: several layouts in sequence, then two breaks on purpose that must fail
(the sound projector without its ReLU^2, patched in the workers only; one checkpoint tensor scaled through the
tool's test-only `perturb` hook).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch
from _hf_tiny import unit_gain_

TOL = 1e-4
IMAGE_ID, AUDIO_ID = 20, 21
LAYOUTS = {
    "noncolocated_llm_tp2": "vision=dp2@0-1;audio=dp2@0-1;language=tp2@2-3",
    "colocated_tp2_dp2": "vision=tp2@0-1;audio=dp2@0-1;language=tp2@0-1",  # grown by DP to 4 ranks
    "noncolocated_llm_pp2": "vision=dp2@0-1;audio=dp2@0-1;language=pp2@2-3",
    "noncolocated_llm_cp2": "vision=dp2@0-1;audio=dp2@0-1;language=cp2@2-3",
    # the video's EVS counts come from the vision pipeline's last stage; colocated, its first stage's ranks hold
    # LLM first-stage rows too (they take part in the boundary without counts of their own)
    "noncolocated_vision_pp2": "vision=pp2@0-1;audio=dp2@0-1;language=tp2@2-3",
    "colocated_vision_pp2": "vision=pp2,dp2@0-3;audio=dp4@0-3;language=tp2,dp2@0-3",
}
VISION_ONLY_LAYOUT = "vision=dp2@0-1;language=tp2@2-3"


def _release(directory, audio: bool, **config) -> None:
    from tessera.scripts.tiny_release import DENSE_TEXT, TEXT, omni_checkpoint

    model = omni_checkpoint(directory, audio=audio, text=TEXT if audio else DENSE_TEXT, **config)
    unit_gain_(model).save_pretrained(str(directory))


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni_parity")
    _release(root / "omni", audio=True, image_token_id=IMAGE_ID, audio_token_id=AUDIO_ID, video_pruning_rate=0.5)
    _release(root / "omni_vl", audio=False)
    # the first release with config.json as the hub ships it (legacy names, hub model_type; weights untouched):
    # transformers' class, called directly, stays the reference (it remaps the names itself)
    from tessera.scripts.tiny_release import hub_layout

    shutil.copytree(root / "omni", root / "omni_hub")
    hub_layout(root / "omni_hub")
    # Nemotron Nano V2 VL as downloaded: tests/test_parity_nano_vl.py (its oracle has no transformers class)
    return {"omni": str(root / "omni"), "omni_vl": str(root / "omni_vl"), "omni_hub": str(root / "omni_hub")}


def _verdict(out: str) -> tuple[str, float]:
    m = re.search(r"^parity: (PASS|FAIL) max_rel_err=(\S+)", out, re.M)
    assert m, out[-3000:]
    return m.group(1), float(m.group(2))


def test_samples_and_batch_follow_the_config(releases):
    """Placeholders carry the config's ids, one per embedding the encoders' arithmetic announces; the packed
    batch puts every item's positions on them; a row covered twice or not at all is never scored."""
    import numpy as np

    from tessera.hetero.tools.parity_multimodal import _score, packed_batch, seq_length_for
    from tessera.models.hf_reference import omni_samples, omni_token_ids

    samples = omni_samples(releases["omni"])
    assert omni_token_ids(releases["omni"]) == (IMAGE_ID, AUDIO_ID, True)
    assert [s.name for s in samples] == ["image", "audio", "mixed", "mixed_audio_first"]
    assert [[k for _, k, *_ in s.media] for s in samples] == [["image"], ["audio"], ["image", "audio"],
                                                              ["audio", "image"]]
    for s in samples:
        ids = {"image": IMAGE_ID, "audio": AUDIO_ID}
        assert int((s.tokens == IMAGE_ID).sum() + (s.tokens == AUDIO_ID).sum()) == sum(n for *_, n in s.media)
        for _, kind, _, start, n in s.media:
            assert bool((s.tokens[start:start + n] == ids[kind]).all())
    seq = seq_length_for(samples)
    batch = packed_batch(samples, seq)
    for r, s in enumerate(samples):
        for m, pos in batch.positions[r].items():
            assert set(batch.tokens[r, pos].tolist()) == {IMAGE_ID if m == "vision" else AUDIO_ID}
    assert [s.name for s in omni_samples(releases["omni_vl"])] == ["image", "text", "mixed", "mixed_audio_first"]
    assert omni_token_ids(releases["omni_vl"])[2] is False  # none in that config: stand-ins

    vocab = 8
    ref = tuple(torch.randn(len(s.tokens), vocab) for s in samples)
    full = np.zeros((len(samples), seq, vocab), np.float32)
    for r, x in enumerate(ref):
        full[r, : len(x)] = x.numpy()
    rows, pos = list(range(len(samples))), list(range(seq))
    assert _score([(rows, pos, full)], samples, seq, ref) == (0.0, sum(x.numel() for x in ref))
    assert _score([(rows, pos, full), None], samples, seq, ref)[1] > 0  # a rank without logits sends None
    assert _score([(rows[:2], pos, full[:2])], samples, seq, ref)[1] == -1.0  # rows missing
    assert _score([(rows, pos[:8], full[:, :8]), (rows, pos[4:], full[:, 4:])], samples, seq, ref)[1] == -1.0  # twice
    full[1, 3, 2] += 0.5
    err, _ = _score([(rows, pos, full)], samples, seq, ref)
    assert err == pytest.approx(0.5 / max(float(x.abs().max()) for x in ref), rel=1e-6)


@pytest.mark.parametrize("release", ["omni", "omni_hub"])
def test_one_rank_command(releases, release):
    """`python -m tessera.hetero.tools.parity --hf-dir DIR`: one rank, every module on it; DIR's config.json in
    transformers' layout or the hub's."""
    res = subprocess.run([sys.executable, "-m", "tessera.hetero.tools.parity", "--hf-dir", releases[release]],
                         capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    verdict, err = _verdict(out)
    print(f"\none rank: {verdict} max_rel_err={err:.3e}")
    assert res.returncode == 0 and verdict == "PASS" and err <= TOL, out[-3000:]
    # the omni release's video (after the audio sample's clip): 5 frames in tubelets of 2, EVS at its 0.5 rate
    assert "samples image, audio_video, mixed, mixed_audio_first" in out and "video: compared" in out
    assert "stand in" not in out  # this config sets its image/audio token ids


def _layouts(dirs: dict) -> list:
    """On every rank of a 4-rank world: (case, layout, max_rel_err) for each layout, then the breaks."""
    from tessera.hetero.tools.parity_multimodal import compare_multimodal
    from tessera.models import audio

    out = []
    for name, layout in LAYOUTS.items():
        out.append((name, *_run(compare_multimodal, dirs["omni"], layout)))
    out.append(("vision_only_dense", *_run(compare_multimodal, dirs["omni_vl"], VISION_ONLY_LAYOUT)))
    out.append(("hub_layout_noncolocated_llm_cp2", *_run(compare_multimodal, dirs["omni_hub"],
                                                         LAYOUTS["noncolocated_llm_cp2"])))
    # breaks on purpose (in these workers only; the files are untouched)
    forward = audio.SoundProjector.forward
    audio.SoundProjector.forward = lambda self, x: self.linear2(self.linear1(self.norm(x)))  # no ReLU^2
    try:
        out.append(("BROKEN_sound_projector_no_relu2", *_run(compare_multimodal, dirs["omni"], LAYOUTS[
            "noncolocated_llm_tp2"])))
    finally:
        audio.SoundProjector.forward = forward
    out.append(("BROKEN_vision_projector_weight_x1.01", *_run(compare_multimodal, dirs["omni"], LAYOUTS[
        "colocated_tp2_dp2"], perturb={"mlp1.1.weight": 1.01})))
    return out


def _run(compare, hf_dir, layout, **kw):
    res = compare(hf_dir, layout, **kw)
    return res["layout"], res["max_rel_err"]


@pytest.mark.multiproc
def test_layouts_on_four_ranks_and_breaks_fail(releases):
    from tessera.hetero.tools.spawn import run_on_ranks

    results = run_on_ranks(4, _layouts, releases, timeout=600)
    assert all(r == results[0] for r in results), results  # every rank knows the verdicts
    print()
    for case, layout, err in results[0]:
        verdict = "FAIL" if case.startswith("BROKEN") else "PASS"
        print(f"{case:40s} {layout:70s} max_rel_err={err:.3e}")
        if verdict == "PASS":
            assert err <= TOL, (case, layout, err)
        else:
            assert not err <= TOL, (case, layout, err)  # NaN counts as a failure too
