"""The processor of an export whose towers are the release's: processor_config.json as transformers'
NemotronH_Omni_Reasoning_V3Processor.save_pretrained writes it, configured with the run's own settings.

    write_processor(out, model_cfg, data)   # after config.json and the tokenizer files are in OUT

An export built from registry names gets transformers' NemotronH_Omni_Reasoning_V3 config.json when its towers
are the release's (RADIO vision, transformers' Parakeet audio: models/release_config.py); those towers have the
release's processors, so OUT also gets them, from the run's settings rather than the release's defaults:
  image  NemotronH_Omni_Reasoning_V3ImageProcessor: the encoder's patch, pixel shuffle (downsample_ratio), mean
         and std, the omni family's native-resolution patch budget (data.min/max_patches, else from max_tiles:
         models/media_tokens.EncoderTokens.patch_budget), max_model_len = data.seq_length (the per-call cap the
         run refuses to be below, data/pipeline.chat_task_encoder)
  video  NemotronH_Omni_Reasoning_V3VideoProcessor: the same patch/shuffle/mean/std, a frame grid near one tile's
         patches (EncoderTokens.video_grid), the encoder's temporal patch as tubelet size
  audio  ParakeetFeatureExtractor: the encoder's mel bins, sample rate, window, hop and n_fft; the processor's
         audio_subsampling_factor / hop / rate for its placeholder count. A model without an audio tower gets the
         release's defaults: transformers' processor cannot be built or loaded without a feature extractor
The tokenizer the processor wraps is the one OUT ships (loaded from OUT; its files are left as written). Without
a tokenizer there is no processor (transformers' processor cannot be built without one): a line says so.

transformers' image processor module imports torchvision at its top, only for the resize inside _preprocess; its
class, constructor and to_dict do not use it. Where torchvision is absent (this project's CPU venv: the PyPI
torchvision wheels are CUDA builds that need libtorch_cuda), the module is executed with an empty stand-in bound
to `tvF` while its body runs, so the export still writes the config the class writes; loading and running it
(AutoProcessor.from_pretrained(OUT)) then needs torchvision where it is served, as the release's does.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import sys
import tempfile
import types
from pathlib import Path

PROCESSOR_FILE = "processor_config.json"  # what transformers 5's ProcessorMixin.save_pretrained writes
_TORCHVISION = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                "torchvision.transforms.v2.functional")


def image_processor_class():
    """transformers' NemotronH_Omni_Reasoning_V3ImageProcessor (image_processing_module's)."""
    return image_processing_module().NemotronH_Omni_Reasoning_V3ImageProcessor


@functools.cache
def image_processing_module() -> types.ModuleType:
    """transformers' image_processing_nemotron_h_omni: imported, or without torchvision its own source run with a
    stand-in `tvF` (module docstring) under a private name (a later real import is unaffected); the tests' grid
    oracle reads the same module (tests/_omni_image_processor.py)."""
    if importlib.util.find_spec("torchvision") is not None:
        from transformers.models.nemotron_h_omni import image_processing_nemotron_h_omni
        return image_processing_nemotron_h_omni
    import transformers.models.nemotron_h_omni as package

    path = Path(package.__file__).parent / "image_processing_nemotron_h_omni.py"
    name = f"{package.__name__}._image_processing_without_torchvision"
    saved = {n: sys.modules.get(n) for n in (*_TORCHVISION, name)}
    stand_ins = {n: types.ModuleType(n) for n in _TORCHVISION}
    stand_ins["torchvision.transforms.v2"].functional = stand_ins["torchvision.transforms.v2.functional"]
    try:
        sys.modules.update(stand_ins)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        for n, m in saved.items():
            if n != name:
                sys.modules.pop(n, None) if m is None else sys.modules.__setitem__(n, m)
    return module


def run_tokens(model_cfg, data: dict | None):
    """The data side's EncoderTokens of the run (data/pipeline.encoder_tokens, the omni family's native
    resolution) and its seq_length."""
    from tessera.data.pipeline import encoder_tokens
    from tessera.hetero.runspec.config import DataConfig

    data = {**vars(DataConfig()), **(data or {})}
    encoders = {k: getattr(model_cfg, k) for k in ("vision", "audio") if getattr(model_cfg, k, None)}
    enc = encoder_tokens(encoders, data["max_tiles"], data["video_frames"], getattr(model_cfg, "video_pruning", 0.0),
                         native_resolution=True, min_patches=data.get("min_patches"),
                         max_patches=data.get("max_patches"))
    return enc, data["seq_length"]


def release_processor(model_cfg, data: dict | None, tokenizer):
    """transformers' NemotronH_Omni_Reasoning_V3Processor with the run's settings (module docstring)."""
    from transformers import NemotronH_Omni_Reasoning_V3Processor, ParakeetFeatureExtractor
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import \
        NemotronH_Omni_Reasoning_V3VideoProcessor

    from tessera.models.encoders import encoder_config

    enc, seq_length = run_tokens(model_cfg, data)
    v = encoder_config(model_cfg.vision)
    ratio = 1 / enc.pixel_shuffle
    low, high = enc.patch_budget
    image = image_processor_class()(patch_size=enc.patch, downsample_ratio=ratio, min_num_patches=low,
                                    max_num_patches=high, max_model_len=seq_length, image_mean=list(v.mean),
                                    image_std=list(v.std))
    video = NemotronH_Omni_Reasoning_V3VideoProcessor(
        patch_size=enc.patch, downsample_ratio=ratio, video_target_num_patches=enc.patches_per_tile,
        temporal_patch_size=enc.video_temporal, norm_mean=list(v.mean), norm_std=list(v.std))
    # transformers' processor is not built (nor loaded) without a feature extractor: a model with no audio tower
    # gets the release's (its defaults), which the model never runs
    audio, kwargs = ParakeetFeatureExtractor(), {}
    if getattr(model_cfg, "audio", None):
        a = encoder_config(model_cfg.audio)
        audio = ParakeetFeatureExtractor(feature_size=a.n_mels, sampling_rate=enc.audio_rate,
                                         hop_length=enc.audio_hop, n_fft=enc.audio_n_fft,
                                         win_length=round(a.window_size * enc.audio_rate))
        kwargs = dict(audio_sampling_rate=enc.audio_rate, audio_subsampling_factor=enc.audio_subsampling,
                      audio_hop_length=enc.audio_hop)

    class Processor(NemotronH_Omni_Reasoning_V3Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name in ("image_processor", "video_processor"):
                return None  # transformers' own classes; its check resolves them through torchvision
            return super().check_argument_for_proper_class(argument_name, argument)

    Processor.__name__ = Processor.__qualname__ = NemotronH_Omni_Reasoning_V3Processor.__name__  # processor_class
    return Processor(image_processor=image, video_processor=video, tokenizer=tokenizer, feature_extractor=audio,
                     video_temporal_patch_dim=enc.video_temporal, **kwargs)


def write_processor(out: Path, model_cfg, data: dict | None) -> bool:
    """OUT/processor_config.json when OUT/config.json is transformers' Omni (its towers the release's) and OUT ships
    a tokenizer; a previous export's is removed first. Returns whether it was written."""
    import json

    out = Path(out)
    (out / PROCESSOR_FILE).unlink(missing_ok=True)
    config = out / "config.json"
    if not config.is_file() or json.loads(config.read_text()).get("model_type") != "nemotron_h_omni":
        return False
    if not any((out / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        print("export: no tokenizer, so no processor_config.json (transformers' processor needs one)", flush=True)
        return False
    from transformers import AutoTokenizer

    processor = release_processor(model_cfg, data, AutoTokenizer.from_pretrained(str(out)))
    with tempfile.TemporaryDirectory() as tmp:  # the processor's file only: the tokenizer's stay as written
        processor.save_pretrained(tmp)
        shutil.copyfile(Path(tmp) / PROCESSOR_FILE, out / PROCESSOR_FILE)
    return True
