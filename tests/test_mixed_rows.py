"""Oracles on mixed rows (issue 34, item 1): packed rows of several samples each, with images, EVS-pruned and
unpruned clips and audio in varying order, against transformers' processor ids and its released forward.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_mixed_rows.py -q -s -p no:cacheprovider

Every other EVS / oracle test puts a clip first (or alone) in its row, so a wrong offset between the media items
of a row (an image before a pruned clip) passed them all. Here:
  - ids: rows packed by the loader's own task encoder and pack_row, several samples each, clips after images
    (in the row and inside one document), two clips in one row, audio between; pruned (rate 0.5) and unpruned.
    Each clip's tubelet chunks are settled to the counts Tessera's EVS chooses on some embeddings; the row must
    equal the concatenation of every sample's ids from transformers' NemotronH_Omni_Reasoning_V3Processor (one
    call per sample: it takes one video per call) with transformers' own retention mask on the same embeddings
    applied to that clip's placeholders (input_ids[retention_mask], its forward's statement), and each module's
    positions must be where those ids hold its placeholder id. The processor is tests/test_prompt_parity.py's.
  - forward: a tiny released-architecture Omni checkpoint (unit-gain weights, tests/test_parity_multimodal.py);
    such rows built by the loader's path (preencode, pack_row, decode, collate) go through Tessera's trainer
    modules and one hetero_step on one rank (hetero/tools/parity_multimodal.py's steps: the LLM's last stage
    returns logits, documents separated by the row's cu_seqlens, the clips' chunks settled at the vision
    boundary); every document's logits must equal transformers' forward on that document alone (with its EVS
    where the checkpoint prunes). Transformers prunes every image-token position of a document with a clip, so
    there a clip has its document of its own; inside one document the ids oracle covers an image before a clip.
"""

from __future__ import annotations

import io
import json
import math
import random
import shutil

import numpy as np
import pytest
import soundfile as sf
import test_prompt_parity as parity
import torch
from _omni_image_processor import release_grid, release_video_grid
from PIL import Image

from tessera.data.loader import RawSample
from tessera.data.packing import collate, pack_row
from tessera.data.prepare import encode_mp4

processor, tokenizer_json = parity.processor, parity.tokenizer_json  # its fixtures: the released processor

EXT = {"audio": "wav", "image": "png", "video": "mp4"}


def _raw(key: str, turns: list, media: list[tuple[str, bytes]]) -> RawSample:
    """The raw sample the loader's cooker yields: JSON conversation + media members."""
    members = {f"m{i}.{EXT[kind]}": data for i, (kind, data) in enumerate(media)}
    refs = [{"kind": kind, "field": f"m{i}.{EXT[kind]}"} for i, (kind, _) in enumerate(media)]
    members["json"] = json.dumps({"conversation": turns, "media": refs}).encode()
    return RawSample(__key__=key, __restore_key__=(), __subflavors__=None, __sources__=None, members=members)


def _chat(user: str, answer: str) -> list:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


# ---- ids: the processor's ids, sample by sample, are the packed row's ----

# media by name from test_prompt_parity's tables (its processor call reads them): clips 5f and 12f are square,
# 4f is 160x90 (a non-square frame grid)
SAMPLES = {
    "image": (_chat("<image>\nDescribe the image.", "A red circle on a blue background."), ["image:wide"]),
    "clip": (_chat("Watch this: <video>\nWhat moves?", "A red square, left to right."), ["video:5f"]),
    "audio": (_chat("Listen to this clip: <audio>\nWhat is it?", "A steady tone, then silence."), ["audio:1.28s"]),
    "clip_sampled": (_chat("<video> What happens?", "It moves."), ["video:12f"]),
    "audio_image": (_chat("<audio> and <image>: compare the sound and the picture.", "The first is longer."),
                    ["audio:0.5s", "image:strip"]),
    "image_then_clip": (_chat("<image> first, then <video>: what changed?", "The square moved."),
                        ["image:square", "video:5f"]),
    "audio_clip_image": (_chat("<audio> then <video><image> Compare them.", "A steady tone."),
                         ["audio:0.5s", "video:4f", "image:wide"]),
}
# an image sample then a clip; two clips with a mixed sample between; an image before a clip in one document and
# a clip between audio and an image
ROWS = [["image", "clip", "audio"], ["clip_sampled", "audio_image", "clip"], ["image_then_clip", "audio_clip_image"]]


def _parity_raw(name: str) -> tuple[list, list, RawSample]:
    turns, items = SAMPLES[name]
    items = [tuple(i.split(":")) for i in items]
    media = [(kind, parity._wav_bytes(parity.WAVES[n]) if kind == "audio" else parity._png_bytes(
        parity.IMAGE_SIZES[n]) if kind == "image" else encode_mp4(parity._frames(*parity.VIDEOS[n]), fps=parity.FPS))
             for kind, n in items]
    return turns, items, _raw(name, turns, media)


def _release_ids(processor, te, name: str, rate: float, seed: int) -> tuple[np.ndarray, list]:
    """(what transformers' forward keeps of the processor's ids for sample `name`, [(clip embeddings, tubelets,
    per-tubelet grid)]): under EVS each clip's placeholders are filtered by compute_retention_mask of some random
    embeddings (the ones Tessera's EVS gets too)."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import compute_retention_mask

    turns, items, _ = _parity_raw(name)
    ids = parity._processor_ids(processor, turns, items, te)
    vision = np.flatnonzero(ids == processor.image_token_id)
    keep, clips, at = np.ones(len(ids), dtype=bool), [], 0
    n_images = sum(kind == "image" for kind, _ in items)
    for kind, n in items:
        if kind == "image":  # the image processor's grid (every image of the call shares its budget)
            at += math.prod(release_grid(*parity.IMAGE_SIZES[n][::-1], n_images=n_images)) // 4
        elif kind == "video":
            frames, (w, h) = parity.VIDEOS[n]
            rows, cols = (g // 2 for g in release_video_grid(h, w))
            tubelets = math.ceil(min(frames, te.enc.video_frames) / 2)
            embeds = torch.randn(tubelets * rows * cols, 8, generator=torch.Generator().manual_seed(seed + len(clips)))
            if rate:
                keep[vision[at:at + len(embeds)]] = compute_retention_mask(embeds, tubelets, rate).numpy()
            clips.append((embeds, tubelets, rows * cols))
            at += len(embeds)
    assert at == len(vision), "the sample's vision placeholders are not its items' (the oracle would misplace EVS)"
    return ids[keep], clips


def _evs_kept(tokens: int, per_frame: int, rate: float) -> int:
    from tessera.models.media_tokens import evs_kept_tokens

    return evs_kept_tokens(tokens // per_frame, per_frame, rate)  # rate 0: every token


def _pack_row(te, names: list[str], seq: int):
    """The loader's row of these samples, in this order (its packer keeps the stream's order inside a row)."""
    return pack_row([te.preencode_sample(_parity_raw(n)[2]) for n in names], seq, te.tok.pad_id)


@pytest.mark.parametrize("rate", [0.5, 0.0])
def test_mixed_rows_are_the_released_processors_ids(rate, processor, tokenizer_json):
    from tessera.data.pipeline import chat_task_encoder
    from tessera.data.tokens import Tokenizer
    from tessera.models.video import evs_prune, evs_tubelet_counts

    te = chat_task_encoder(Tokenizer(tokenizer_json), parity.ENCODERS, parity.SEQ, max_tiles=12, video_frames=8,
                           video_pruning=rate)
    wants, clips = [], []
    for r, names in enumerate(ROWS):
        parts = [_release_ids(processor, te, name, rate, seed=100 * r + 10 * i) for i, name in enumerate(names)]
        wants.append([ids for ids, _ in parts])
        clips += [c for _, cs in parts for c in cs]
    seq = max(sum(map(len, w)) for w in wants) + 5
    batch = collate([_pack_row(te, names, seq) for names in ROWS], {})
    labels = batch.labels.clone()

    chunked = batch.chunked_items("vision")
    assert [(len(c), sum(n for _, n in c)) for _, _, c in chunked] == [
        (t, _evs_kept(t * per, per, rate)) for _, t, per in clips], "one chunk per tubelet, the clip's kept total"
    if rate:  # the counts Tessera's EVS chooses on each clip's embeddings
        counts, moved = {}, 0
        for (r, j, nominal), (embeds, t, per) in zip(chunked, clips):
            _, chosen = evs_prune(embeds.reshape(t, per, 1, -1), rate)  # (a grid flattened per tubelet)
            counts[(r, j)] = evs_tubelet_counts(chosen, t, per)
            moved += counts[(r, j)] != [n for _, n in nominal]
        assert moved >= 3, "EVS kept the nominal counts: the settling would not be tested"
        batch.settle_tubelet_chunks("vision", counts)
    batch.check()  # strictly increasing positions, one per planned token, after settling too

    placeholder = {"vision": processor.image_token_id, "audio": processor.audio_token_id}
    for r, want in enumerate(wants):
        row = np.concatenate(want)
        np.testing.assert_array_equal(batch.tokens[r, :len(row)].numpy(), row, err_msg=f"row {r} {ROWS[r]}")
        assert bool((batch.tokens[r, len(row):] == te.tok.pad_id).all())
        np.testing.assert_array_equal(batch.cu_seqlens[r][:len(want) + 1].numpy(), np.cumsum([0, *map(len, want)]))
        for module, token_id in placeholder.items():
            np.testing.assert_array_equal(batch.positions[r].get(module, []), np.flatnonzero(row == token_id),
                                          err_msg=f"row {r} {module}")
    assert torch.equal(batch.labels, labels)  # media chunks are never targets: settling moves no label


# ---- forward: Tessera's trainer on mixed packed rows == transformers' forward on every document alone ----

# max|ours - ref| / max|ref| over every real-vocabulary logit of every document. Measured 6.0e-6 (pruned and
# unpruned, fp32, CPU); the pruned rows with their chunks left at the nominal counts are off by 1.3, the rows
# without document ids (attention and Mamba state across documents) by 1.06: 3e-5 tells them apart with room.
TOL = 3e-5
FRAMES = 6  # _clip's frames: three tubelets, the last still (EVS at 0.5 keeps none of it: the counts move)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """The same tiny release pruning clips (rate 0.5) and not (0): its tokenizer's media ids in config.json."""
    from test_parity_multimodal import _release

    root = tmp_path_factory.mktemp("mixed_rows")
    _release(root / "pruned", audio=True, tokenizer=True, video_pruning_rate=0.5)
    shutil.copytree(root / "pruned", root / "unpruned")
    config = json.loads((root / "unpruned" / "config.json").read_text())
    (root / "unpruned" / "config.json").write_text(json.dumps({**config, "video_pruning_rate": 0.0}))
    return {0.5: str(root / "pruned"), 0.0: str(root / "unpruned")}


def _forward_rows() -> list[list[RawSample]]:
    """Row 0: an image sample, a clip, audio; row 1: a clip, an image + audio document, another clip. Random
    pixels (a misplaced patch embedding shows), clips that move then stand still (test_released_loss._clip)."""
    from test_released_loss import _clip

    rng, gen = random.Random(7), np.random.default_rng(7)

    def png(w, h):
        buf = io.BytesIO()
        Image.fromarray(gen.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        return "image", buf.getvalue()

    def wav(seconds):
        buf = io.BytesIO()
        sf.write(buf, (0.1 * gen.standard_normal(round(16000 * seconds))).astype(np.float32), 16000,
                 format="WAV", subtype="FLOAT")
        return "audio", buf.getvalue()

    def clip(key):
        data, _, text = _clip(rng)
        return _raw(key, _chat("<video> What moves?", text), [("video", data)])

    return [[_raw("image", _chat("<image>\nDescribe the image.", "A red circle."), [png(64, 48)]), clip("clip_a"),
             _raw("audio", _chat("Listen: <audio> What is it?", "A steady tone."), [wav(1.28)])],
            [clip("clip_b"),
             _raw("image_audio", _chat("<image> and <audio>: how do they differ?", "One is a picture."),
                  [png(48, 64), wav(0.7)]),
             clip("clip_c")]]


def _batch(hf_dir: str, rate: float):
    """The loader's microbatch of _forward_rows with the release's tokenizer and encoders (its task encoder:
    preencode, pack_row, decode every item, collate)."""
    from tessera.data.pipeline import chat_task_encoder
    from tessera.data.tokens import Tokenizer
    from tessera.hetero.tools.parity_multimodal import model_config
    from tessera.hetero.runspec.modules import encoder_names

    te = chat_task_encoder(Tokenizer(f"{hf_dir}/tokenizer.json"), encoder_names(model_config(hf_dir)), 1024,
                           video_frames=FRAMES, video_pruning=rate)
    rows = [[te.preencode_sample(s) for s in row] for row in _forward_rows()]
    seq = -(-max(sum(map(len, r)) for r in rows) // 32) * 32  # the rows' own length: a short LLM sequence
    return te.batch([pack_row(r, seq, te.tok.pad_id) for r in rows])


def _tessera_logits(hf_dir: str, batch) -> torch.Tensor:
    """[N, S, vocab]: the trainer's modules built and loaded from DIR on one rank, one hetero_step on the batch
    whose LLM last stage returns logits (compare_multimodal's steps; the clips settle at the vision boundary)."""
    from _mcore_cpu import single_rank_world

    from tessera.hetero.plan.layout import LANGUAGE
    from tessera.hetero.runtime.groups import destroy_module_groups
    from tessera.hetero.runtime.step_executor import hetero_step
    from tessera.hetero.tools.parity_multimodal import _LogitsOnly, _LogitsStage, release_run
    from tessera.hetero.training.stages import MediaEncoderStage
    from tessera.hetero.training.step_parts import boundary_batches, step_context

    single_rank_world()
    run = release_run(hf_dir, "", len(batch.keys), batch.seq_length)  # as compare_multimodal builds it
    layout, device = run.layout, run.device
    ctx = step_context(run)
    settle = ctx.settle
    enc = {k: MediaEncoderStage(run.modules[k], k, layout[k], run.groups[k].coord, [batch], device,
                                run.groups[k].pgs.cp) for k in run.modules if k != LANGUAGE}
    lang = _LogitsStage(_LogitsOnly(run.modules[LANGUAGE]), layout[LANGUAGE], run.groups[LANGUAGE].coord, [batch], 1,
                        device, settle)
    try:
        (logits,) = hetero_step(layout, run.groups, enc, lang, ctx.comms,
                                boundary_batches([batch], layout, settle), ctx.like).outputs
        with torch.no_grad():
            return run.modules[LANGUAGE].full_vocab_logits(logits).float()
    finally:
        if settle is not None:
            settle.close()
        destroy_module_groups(run.groups)


@pytest.mark.parametrize("rate", [0.5, 0.0])
def test_mixed_rows_give_the_released_forwards_logits(rate, releases):
    from test_released_loss import _documents, _oracle_inputs
    from transformers import NemotronH_Omni_Reasoning_V3

    from tessera.hetero.tools.parity_multimodal import _eval_but_batchnorm
    from tessera.models.encoders import encoder_config, family_of
    from tessera.models.released import encoder_name

    hf_dir = releases[rate]
    batch = _batch(hf_dir, rate)
    nominal = [c for _, _, c in batch.chunked_items("vision")]
    assert len(nominal) == 3 and batch.keys == [["image", "clip_a", "audio"], ["clip_b", "image_audio", "clip_c"]]
    ours = _tessera_logits(hf_dir, batch)  # settles the batch's clips in place (pruned release)
    settled = [c for _, _, c in batch.chunked_items("vision")]
    batch.check()
    if rate:  # the chunks moved to EVS's counts (else the release's layout and the nominal one would coincide)
        assert all([n for _, n in a] != [n for _, n in b] for a, b in zip(nominal, settled)), (nominal, settled)
    else:
        assert settled == nominal

    ref_model = NemotronH_Omni_Reasoning_V3.from_pretrained(hf_dir, dtype=torch.float32)
    _eval_but_batchnorm(ref_model)
    vcfg, acfg = encoder_config(encoder_name(hf_dir, "vision")), encoder_config(encoder_name(hf_dir, "audio"))
    frontend = family_of(acfg).preprocessor(acfg)  # its mel front end
    spans = [(r, int(cu[j]), int(cu[j + 1])) for r, (cu, keys) in enumerate(zip(batch.cu_seqlens, batch.keys))
             for j in range(len(keys))]  # every packed document: row, first and end token
    diff = scale = 0.0
    with torch.no_grad():
        for doc, (r, a, b) in zip(_documents(batch), spans, strict=True):
            ref = ref_model(**_oracle_inputs(doc, vcfg, frontend)).logits[0]  # the document alone
            assert ref.shape == (b - a, ours.shape[-1]), (doc["key"], ref.shape, b - a)
            diff, scale = max(diff, float((ours[r, a:b] - ref).abs().max())), max(scale, float(ref.abs().max()))
    print(f"\nmixed rows, video pruning {rate}: max|tessera - transformers| {diff:.3e}, rel {diff / scale:.3e}")
    assert diff / scale <= TOL
