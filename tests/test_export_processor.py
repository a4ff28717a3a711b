"""A registry-name export with the release's towers carries transformers' processor (issue 62, item 4): OUT's
processor_config.json is what NemotronH_Omni_Reasoning_V3Processor.save_pretrained writes, configured with the
run's own settings (hetero/export/processor.py), so AutoProcessor loads OUT and gives, for an image, a
video and an audio clip of one conversation, the input_ids and the features the trained model saw.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_export_processor.py -x -q -p no:cacheprovider

One export of a tiny omni model (RADIO tiny + Parakeet tiny, run settings unlike the defaults: seq_length 320,
max_tiles 3 so the native patch budget is 16..64 patches), one conversation with the three kinds. Tessera's side is
the run's data path on the raw sample (the loader's task encoder: preencode for the ids, _decode_item for the media
it decodes) and the model's front ends (the audio encoder's mel features, models/audio.MelFeatures; pixels
normalised by the vision encoder's mean/std, as its input conditioner does). transformers' side starts from the
raw files: the clip through its own load_video (PyAV), the wave through the processor's own feature extractor.
The image is already its patch grid (96 x 64 px = 4 x 6 patches) and the frames their frame grid (64 x 64 = one
64-px tile), so neither side resizes (the two resizes differ by design: data/media.decode_native_image).

torchvision: transformers' image processor imports it (and its video processor's public name asks for it), and
PyPI's torchvision 0.28.0 (the build matching torch 2.13.0) is a CUDA build whose ops need libtorch_cuda, absent
from the CPU torch ("operator torchvision::nms does not exist"); the CPU build is not on PyPI. So where torchvision
does not import, AutoProcessor.from_pretrained(OUT) is asserted to refuse naming torchvision (transformers' own
check), then run with its image processor built by its class from OUT's saved fields (what from_pretrained passes
it; the module loaded without torchvision: processor_export.image_processor_class) and its video processor class
taken from its module (it needs no torchvision); the image's placeholder count comes from transformers' own grid
rule and per-call budget on those saved fields (tests/_omni_image_processor.release_grid) and its pixels are not
compared; the saved fields are checked one by one against the run's settings. With torchvision, AutoProcessor
loads OUT as it is and the image's pixel_values are compared too.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from tests._omni_image_processor import release_grid

from tests._mcore_cpu import single_rank_world

ENCODERS = {"vision": "radio_vit_tiny", "audio": "parakeet_hf_tiny"}
DATA = {"seq_length": 320, "max_tiles": 3, "video_frames": 4}  # the run's own settings, not the defaults
IMAGE_SIZE = (96, 64)  # (width, height): its own 4 x 6 patch grid of 16 px, within 16..64 patches
FRAMES, SIDE, FPS = 4, 64, 8  # 4 frames of one 64-px tile: two tubelets of 2
SAMPLES = 12000  # 0.75 s at 16 kHz
TURNS = [{"role": "user", "content": "<audio> then <video><image> Compare them."},
         {"role": "assistant", "content": "A steady tone."}]
# max |difference| of the mel features (Tessera's NeMo front end vs transformers' Parakeet extractor from OUT's
# config): measured 0.0 on this clip (the same steps in the same order)
MEL_TOL = 1e-4


def _torchvision() -> bool:
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
        return True
    except Exception:  # ImportError, or the CUDA build's RuntimeError on a CPU torch
        return False


def _media():
    from tessera.data.prepare import encode_mp4

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE[1], IMAGE_SIZE[0], 3), dtype=np.uint8))
    png = io.BytesIO()
    image.save(png, format="PNG")
    frames = np.full((FRAMES, SIDE, SIDE, 3), 20, dtype=np.uint8)
    for t in range(FRAMES):
        frames[t, 24:40, 12 * t:12 * t + 16] = (220, 40, 40)
    t = np.arange(SAMPLES) / 16000
    wave = (0.3 * np.sin(2 * math.pi * 440 * t) + 0.05 * rng.standard_normal(SAMPLES)).astype(np.float32)
    wav = io.BytesIO()
    sf.write(wav, wave, 16000, format="WAV", subtype="FLOAT")
    return {"audio": wav.getvalue(), "video": encode_mp4(frames, fps=FPS), "image": png.getvalue()}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(OUT, tokenizer path): write_hf of a tiny omni model with the run's data settings and its tokenizer."""
    single_rank_world()
    from tessera.data.tokens import Tokenizer
    from tessera.hetero.runspec.config import ModelConfig
    from tessera.hetero.export.hf import write_hf
    from tessera.hetero.build.model_build import llm_fields
    from tessera.hetero.build.seeded_init import full_hf_state
    from tessera.scripts.tiny_release import release_tokenizer

    tmp = tmp_path_factory.mktemp("export")
    release_tokenizer(tmp / "tok")
    path = tmp / "tok" / "tokenizer.json"
    cfg = ModelConfig(llm="nemotron_h_tiny_moe", **ENCODERS)
    fields = llm_fields(cfg, Tokenizer(path).vocab_size)
    out = tmp / "out"
    write_hf(out, full_hf_state(cfg, fields, seed=5), cfg, fields, str(path), data=DATA)
    return out, path


def _load(out, monkeypatch):
    """AutoProcessor.from_pretrained(OUT); without torchvision its image processor is built by its class from OUT's
    saved fields (module docstring)."""
    from transformers import AutoImageProcessor, AutoProcessor

    if not _torchvision():
        # the video processor's class needs no torchvision, but the name AutoVideoProcessor resolves is transformers'
        # placeholder that asks for it: the class from its module, loading OUT itself
        from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import \
            NemotronH_Omni_Reasoning_V3VideoProcessor

        from tessera.hetero.export.processor import image_processor_class

        with pytest.raises(ValueError, match="torchvision"):  # transformers' own refusal, naming the package
            AutoProcessor.from_pretrained(str(out))
        saved = json.loads((out / "processor_config.json").read_text())["image_processor"]
        monkeypatch.setattr(AutoImageProcessor, "from_pretrained",
                            classmethod(lambda cls, *a, **k: image_processor_class()(**saved)))
        monkeypatch.setattr("transformers.models.auto.video_processing_auto.AutoVideoProcessor", type(
            "AutoVideoProcessor", (), {"from_pretrained": staticmethod(
                lambda *a, **k: NemotronH_Omni_Reasoning_V3VideoProcessor.from_pretrained(*a, **k))}))
        monkeypatch.setattr("transformers.processing_utils.ProcessorMixin.check_argument_for_proper_class",
                            lambda self, name, arg: None)  # the class check resolves the image class via torchvision
    return AutoProcessor.from_pretrained(str(out))


def test_export_processor_gives_the_ids_and_features_the_run_trained_on(export, monkeypatch, tmp_path):
    from transformers import BatchFeature, NemotronH_Omni_Reasoning_V3Processor
    from transformers.video_utils import load_video

    from tessera.data.loader import RawSample
    from tessera.data.pipeline import chat_task_encoder
    from tessera.data.tokens import Tokenizer
    from tessera.models.audio import MelFeatures
    from tessera.models.encoders import encoder_config

    out, tokenizer = export
    processor = _load(out, monkeypatch)
    assert type(processor).__name__ == NemotronH_Omni_Reasoning_V3Processor.__name__
    vision, audio = encoder_config(ENCODERS["vision"]), encoder_config(ENCODERS["audio"])

    # the run's settings, field by field, as transformers reads them back
    ip, vp, fe = processor.image_processor, processor.video_processor, processor.feature_extractor
    assert (ip.patch_size, ip.downsample_ratio, ip.min_num_patches, ip.max_num_patches, ip.max_model_len) == \
        (16, 0.5, 16, 64, DATA["seq_length"])
    assert list(ip.image_mean) == list(vision.mean) and list(ip.image_std) == list(vision.std)
    assert (vp.patch_size, vp.downsample_ratio, vp.video_target_num_patches, vp.temporal_patch_size,
            processor.video_temporal_patch_dim) == (16, 0.5, 16, 2, 2)
    assert list(vp.norm_mean) == list(vision.mean) and list(vp.norm_std) == list(vision.std)
    assert (fe.feature_size, fe.sampling_rate, fe.hop_length, fe.n_fft, fe.win_length) == \
        (audio.n_mels, 16000, 160, 512, 400)
    assert (processor.audio_sampling_rate, processor.audio_subsampling_factor, processor.audio_hop_length) == \
        (16000, 8, 160)

    # Tessera's data path on the raw sample
    media = _media()
    members = {"m0.wav": media["audio"], "m1.mp4": media["video"], "m2.png": media["image"],
               "json": json.dumps({"conversation": TURNS, "media": [
                   {"kind": "audio", "field": "m0.wav"}, {"kind": "video", "field": "m1.mp4"},
                   {"kind": "image", "field": "m2.png"}]}).encode()}
    raw = RawSample(__key__="s", __restore_key__=(), __subflavors__=None, __sources__=None, members=members)
    te = chat_task_encoder(Tokenizer(tokenizer), ENCODERS, DATA["seq_length"], max_tiles=DATA["max_tiles"],
                           video_frames=DATA["video_frames"])
    encoded = te.preencode_sample(raw)
    wave, (frames, _), image = (te._decode_item(k, d, u, "s", "shard")
                                for (k, d), u in zip(encoded.raw_media, encoded.units))

    # transformers' side from the raw files, the turns as ChatML with the processor's tags
    (tmp_path / "clip.mp4").write_bytes(media["video"])
    video, meta = load_video(str(tmp_path / "clip.mp4"))
    text = "".join(f"<|im_start|>{t['role']}\n" + t["content"].replace("<audio>", processor.audio_token)
                   .replace("<image>", processor.image_token) + "<|im_end|>\n" for t in TURNS)
    pil = Image.open(io.BytesIO(media["image"])).convert("RGB")
    if not _torchvision():  # the image's grid by transformers' own rule on the saved fields; no pixels
        grid = release_grid(pil.height, pil.width, 1, **{k: getattr(ip, k) for k in (
            "patch_size", "downsample_ratio", "min_num_patches", "max_num_patches", "max_model_len")})
        processor.image_processor = lambda images, **kw: BatchFeature({"image_grid_hw": torch.tensor([grid])})
        processor.image_processor.downsample_ratio = ip.downsample_ratio
    got = processor(text=text, images=[pil], videos=[torch.from_numpy(video).permute(0, 3, 1, 2)],
                    video_metadata=meta, do_sample_frames=False, audio=[sf.read(io.BytesIO(media["audio"]),
                                                                             dtype="float32")[0]])
    processor.image_processor = ip

    ids = np.asarray(got["input_ids"][0])
    np.testing.assert_array_equal(encoded.prompt.tokens, ids)
    assert (ids == processor.image_token_id).sum() == 6 + 2 * 4  # the image's 4x6/4, two tubelets of 4x4/4
    assert (ids == processor.audio_token_id).sum() == te.enc.audio_tokens_of_frames(te.enc.audio_mel_frames(SAMPLES))

    # video: the frames the run decoded, normalised by the encoder's mean/std, two frames a tubelet
    mean, std = (torch.tensor(x, dtype=torch.float32).view(1, 3, 1, 1) for x in (vision.mean, vision.std))
    want = ((torch.from_numpy(np.asarray(frames)).float() / 255 - mean) / std).reshape(1, -1, 6, SIDE, SIDE)
    torch.testing.assert_close(got["pixel_values_videos"], want, rtol=0, atol=1e-6)
    # audio: the encoder's own mel front end on the decoded wave, its valid frames
    mel, valid = MelFeatures(audio).features([torch.from_numpy(wave)])
    n = int(valid[0])
    assert int(got["input_features_mask"][0].sum()) in (n, n + 1)
    diff = (got["input_features"][0, :n] - mel[0, :, :n].T).abs().max().item()

    assert diff < MEL_TOL, diff
    if _torchvision():  # the image's patches: the decoded image normalised, channel-major 16-px patches
        img = (torch.from_numpy(np.asarray(image)).float() / 255 - mean) / std
        patches = img.reshape(1, 3, 4, 16, 6, 16).permute(0, 2, 4, 1, 3, 5).reshape(24, 768)
        torch.testing.assert_close(got["pixel_values"], patches, rtol=0, atol=1e-5)
        assert got["image_grid_hw"].tolist() == [[4, 6]]


def test_export_without_the_release_towers_or_a_tokenizer_has_no_processor(tmp_path):
    """No NemotronH_Omni config.json (a SigLIP tower), or no tokenizer: no processor_config.json, and a previous
    export's is removed."""
    single_rank_world()
    from tessera.hetero.runspec.config import ModelConfig
    from tessera.hetero.export.processor import write_processor

    (tmp_path / "processor_config.json").write_text("{}")
    assert not write_processor(tmp_path, ModelConfig(llm="nemotron_h_tiny_moe", **ENCODERS), DATA)
    assert not (tmp_path / "processor_config.json").exists()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nemotron_h_omni"}))
    assert not write_processor(tmp_path, ModelConfig(llm="nemotron_h_tiny_moe", **ENCODERS), DATA)
