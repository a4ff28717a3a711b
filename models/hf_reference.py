"""The single-device side of logit parity with transformers: fixed inputs and the reference logits.

transformers' NemotronHForCausalLM (float32, torch path) loaded from a local HF directory gives the reference
logits of `fixed_batch`; `max_rel_err = max|ours - ref| / max|ref|`. The command that runs Tessera's HybridLM
in a TP/PP/CP layout against it is hetero/tools/parity.py (`torchrun ... -m tessera.hetero.tools.parity`):
process groups live there, so models/ keeps no import of torch.distributed or hetero/.

For a released multimodal checkpoint (transformers' NemotronH_Omni_Reasoning_V3): `omni_samples` (an image,
an audio and mixed samples from the config, random from a fixed seed) and `omni_reference_logits` (the Omni
forward on each sample alone, fed exactly what Tessera's encoders see); the layout side is
hetero/tools/parity_multimodal.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tessera.models.encoder_families.vit import ViTConfig
from tessera.hetero.plan.zigzag import zigzag_multiple

BATCH, SEQ, SEED = 2, 37, 1234  # SEQ not a multiple of typical chunk sizes: exercises the padding


def seq_length(cp: int = 1, sp_tp: int = 1) -> int:
    """SEQ, cut to a multiple of 2*cp so the zigzag layout gives every CP rank two equal chunks, and under
    sequence parallelism over sp_tp ranks to one where each CP rank's positions split over them."""
    step = math.lcm(zigzag_multiple(cp) if cp > 1 else 1, cp * sp_tp)
    return SEQ - SEQ % step


def fixed_batch(vocab_size: int, length: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, length), generator=torch.Generator().manual_seed(SEED))


def reference_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import NemotronHForCausalLM

    ref = NemotronHForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(input_ids).logits.float()


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# ---- the released Omni model (NemotronH_Omni_Reasoning_V3): multimodal samples and their reference logits ----

OMNI_SEED = 4321


@dataclass
class OmniSample:
    """One sample (one document): token ids with media placeholders, and its media items in position order.

    media: [(module, kind, item, start, length)]; item is uint8 tiles [T, 3, tile, tile] (kind "image", each
    tile one image of (tile/patch)^2 patches), a float32 16 kHz waveform (kind "audio") or (frames, None) (kind
    "video"); tokens[start:start + length] are that item's placeholders (the config's image/audio token id).
    chunks: {media index: ((start, count), ...)} of a video written in per-tubelet <img> ... </img> chunks, the
    release's layout (its placeholders are the chunks' context positions, `length` in all)."""

    name: str
    tokens: torch.Tensor
    media: list = field(default_factory=list)
    chunks: dict = field(default_factory=dict)


def omni_token_ids(hf_dir: str) -> tuple[int, int, bool]:
    """(image token id, audio token id, taken from config.json): the config's ids; a config that sets none
    (transformers' default, e.g. scripts/tiny_release.py without image_token_id=...) gets the last two
    vocabulary ids, which omni_reference_logits then gives the reference model too."""
    from tessera.models.released import llm_fields_of, read_config

    config = read_config(hf_dir)
    vocab = llm_fields_of(config)["vocab_size"]
    image, audio = config.get("image_token_id"), config.get("audio_token_id")
    own = image is not None and (audio is not None or "audio" not in _modalities(hf_dir))
    spare = (i for i in range(vocab - 1, -1, -1) if i not in (image, audio))
    image = next(spare) if image is None else image
    audio = next(spare) if audio is None else audio
    return int(image), int(audio), own


def _modalities(hf_dir: str) -> list[str]:
    from tessera.models.released import modalities_of, read_config

    return modalities_of(read_config(hf_dir))


def _audio_samples(seconds: float, rate: int, hop: int) -> int:
    """Samples near `seconds` at `rate`: a whole number of mel hops plus half a hop (any frame count; the
    audio sample's 1.28 s is n = 128 frames, a multiple of the 8x subsampling, where the release keeps one
    embedding more than the encoder's valid length: models/media_tokens.audio_tokens_of_frames)."""
    return round(seconds * rate) // hop * hop + hop // 2


def video_pruning_rate(hf_dir: str) -> float:
    """DIR's config's EVS rate (video_pruning_rate; 0 when absent, the release's default)."""
    from tessera.models.released import read_config

    return float(read_config(hf_dir).get("video_pruning_rate") or 0.0)


def omni_samples(hf_dir: str, seed: int = OMNI_SEED, video_temporal: int = 0) -> list[OmniSample]:
    """Four samples from DIR's config, random from `seed` (pixels, waveforms, text ids): an image (two tiles),
    an audio clip, a mixed one (text, image, text, audio, text) and a mixed one in the other order; with
    `video_temporal` (frames per tubelet, as the caller's model build encodes video) the audio sample also holds a
    5-frame video after its clip ("audio_video"; the release puts video at its image token id and prunes it by the
    config's video_pruning_rate), in the release's per-tubelet chunks: a label of random text ids, <img>, the
    tubelet's placeholders, </img> (stand-in ids for both); under EVS at nominal counts
    (evs_nominal_tubelet_counts: which tubelet keeps how many is known only after encoding). The clip ends
    still, so EVS keeps none of its last tubelet. Without an
    audio encoder the audio sample is text only and the mixed ones keep their images. Placeholder counts come
    from the encoders' own token arithmetic (models/encoders.tokens_config), as the data side sizes them."""
    import dataclasses

    import numpy as np

    from tessera.models.encoders import encoder_config, tokens_config
    from tessera.models.media_tokens import evs_nominal_tubelet_counts
    from tessera.models.released import encoder_name, llm_fields_of, read_config

    vocab = llm_fields_of(read_config(hf_dir))["vocab_size"]
    image_id, audio_id, _ = omni_token_ids(hf_dir)
    cfgs = {m: encoder_config(encoder_name(hf_dir, m)) for m in _modalities(hf_dir)}
    rng = np.random.default_rng(seed)
    text_ids = np.setdiff1d(np.arange(vocab), [image_id, audio_id])

    def tiles(n):
        side = cfgs["vision"].tile
        return rng.integers(0, 256, size=(n, 3, side, side), dtype=np.uint8)

    def wave(seconds):
        a = cfgs["audio"]
        n = _audio_samples(seconds, a.sample_rate, round(a.window_stride * a.sample_rate))
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    plans = {"image": [7, ("image", 2), 9], "audio": [5, ("audio", 1.28), 8],
             "mixed": [6, ("image", 1), 5, ("audio", 0.9), 11],
             "mixed_audio_first": [3, ("audio", 0.7), 4, ("image", 1), 8]}
    if video_temporal and "vision" in cfgs:  # beside audio, not an image: the release prunes every image-token
        plans["audio_video"] = plans.pop("audio") + [("video", 5), 6]  # position of a sample with video as video
        plans = {k: plans[k] for k in ("image", "audio_video", "mixed", "mixed_audio_first")}  # (four rows still)
    rate = video_pruning_rate(hf_dir)
    img_start, img_end = (int(i) for i in text_ids[:2])  # stand-ins for <img> and </img> (plain text ids)
    samples = []
    for name, plan in plans.items():
        tokens, media, chunks = [], [], {}
        for part in plan:
            if isinstance(part, int):
                tokens += rng.choice(text_ids, size=part).tolist()
                continue
            kind, amount = part
            module = "audio" if kind == "audio" else "vision"
            if module not in cfgs:
                continue  # a checkpoint without this encoder: the sample keeps its text
            item = wave(amount) if kind == "audio" else tiles(amount)
            rule = tokens_config(cfgs[module])
            if kind == "video":
                rule = dataclasses.replace(rule, video_temporal=video_temporal, video_pruning=rate)
            count = rule.tokens(kind, len(item))
            if kind == "video":
                # the clip ends still (its last frames one picture): EVS keeps no token of its last tubelet, so the
                # chunks settle away from their nominal counts (hetero/runtime/tubelet_settle.py)
                item[len(item) // 2:] = item[len(item) // 2]
                tubelets, per = rule.tubelet_tokens(len(item))
                nominal = evs_nominal_tubelet_counts(tubelets, per, count) if rate else [per] * tubelets
                placed = []
                for c, n in enumerate(nominal):
                    tokens += rng.choice(text_ids, size=4 if c else 3).tolist() + [img_start]  # ("\n" +) label
                    placed.append((len(tokens), n))
                    tokens += [image_id] * n + [img_end]
                chunks[len(media)] = tuple(placed)
                media.append((module, kind, (item, None), placed[0][0], count))
                continue
            media.append((module, kind, item, len(tokens), count))
            tokens += [audio_id if kind == "audio" else image_id] * count
        samples.append(OmniSample(name if media or not name.startswith("audio") else "text", torch.tensor(tokens),
                                  media, chunks))
    return samples


def processor_pixels(tiles: torch.Tensor, patch: int, mean, std) -> torch.Tensor:
    """uint8 [T, 3, H, W] -> [T * (H/p)(W/p), 3 * p * p]: NemotronH_Omni_Reasoning_V3ImageProcessor's steps for
    an image already at its patch grid (its module needs torchvision, which this venv lacks): float32, the
    fused rescale + normalize (mean and std scaled by 1 / rescale_factor, then torchvision's normalize:
    subtract, divide) and convert_image_to_patches (row-major patches, each channel-major)."""
    x = tiles.to(torch.float32)
    rescale_factor = 1 / 255
    fused_mean = torch.tensor(mean) * (1.0 / rescale_factor)
    fused_std = torch.tensor(std) * (1.0 / rescale_factor)
    x = x.sub_(fused_mean.view(-1, 1, 1)).div_(fused_std.view(-1, 1, 1))
    n, c, h, w = x.shape
    x = x.reshape(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n * (h // patch) * (w // patch), c * patch * patch)


def release_video_tokens(tokens: torch.Tensor, chunks, per_tubelet: int) -> torch.Tensor:
    """A document's tokens with a video's <img> ... </img> chunks ((start, count), ...), at the counts Tessera
    placed, widened to every tubelet's `per_tubelet` tokens: what the release's processor writes. Its forward
    then keeps input_ids[retention_mask] of them under EVS."""
    context = int(tokens[next(a for a, n in chunks if n)])
    for a, n in reversed(chunks):  # from the last: earlier chunks keep their starts
        tokens = torch.cat([tokens[:a], tokens.new_full((per_tubelet,), context), tokens[a + n:]])
    return tokens


def release_video_pixels(frames, vcfg: ViTConfig) -> torch.Tensor:
    """uint8 frames [F, 3, H, W] -> the forward's pixel_values_videos [1, tubelets, T*3, H, W]: rescaled and
    normalised as the video processor does (processor_pixels without patching), then packed as it packs them,
    T = temporal_patch consecutive frames per tubelet along the channels, the last frame repeated to fill the
    last tubelet."""
    import numpy as np

    mean, std = (torch.tensor(x).view(-1, 1, 1) * 255 for x in (vcfg.mean, vcfg.std))
    x = (torch.as_tensor(np.asarray(frames)).to(torch.float32) - mean) / std
    t = vcfg.temporal_patch
    if len(x) % t:
        x = torch.cat([x, x[-1:].expand(t - len(x) % t, -1, -1, -1)])
    return x.reshape(1, len(x) // t, t * x.shape[1], *x.shape[-2:])


def omni_inputs(sample: OmniSample, vcfg: ViTConfig | None, audio_frontend) -> dict:
    """The Omni forward's inputs for one sample (omni_forward_inputs of its tokens, images and clip). A video's
    chunks, at Tessera's nominal counts, are widened to the release's (release_video_tokens) and its frames go in
    as pixel_values_videos (release_video_pixels)."""
    from tessera.models.encoders import tokens_config

    tokens, inputs_extra = sample.tokens, {}
    for i, (_, kind, item, _, _) in enumerate(sample.media):
        if kind != "video":
            continue
        frames, p = item[0], vcfg.patch
        tokens = release_video_tokens(tokens, sample.chunks[i],
                                      tokens_config(vcfg).grid_tokens(frames.shape[-2] // p, frames.shape[-1] // p))
        inputs_extra["pixel_values_videos"] = release_video_pixels(frames, vcfg)
    inputs = omni_forward_inputs(tokens, [item for m, kind, item, _, _ in sample.media if kind == "image"],
                                 [item for m, kind, item, _, _ in sample.media if kind == "audio"], vcfg,
                                 audio_frontend, sample.name)
    return {**inputs, **inputs_extra}


def omni_forward_inputs(tokens, images: list, clips: list, vcfg: ViTConfig | None, audio_frontend,
                        name: str = "sample") -> dict:
    """The Omni forward's inputs for one document: exactly what Tessera's encoders see (every uint8 [H, W]
    image of an item, a tile or a native-resolution image, one image of its (H/patch) x (W/patch) patch grid;
    the mel features of Tessera's audio front end, with their mask). At most one clip: a batch of clips would
    share the conformer's BatchNorm statistics, and Tessera encodes every clip alone."""
    import numpy as np

    inputs = {"input_ids": tokens[None]}
    if images:
        items = [torch.as_tensor(np.asarray(item)) for item in images]  # each [n, 3, H, W]
        p = vcfg.patch
        inputs["pixel_values"] = torch.cat([processor_pixels(x, p, vcfg.mean, vcfg.std) for x in items])
        inputs["image_grid_hw"] = torch.tensor([[x.shape[-2] // p, x.shape[-1] // p] for x in items for _ in x])
    if clips:
        if len(clips) > 1:
            raise ValueError(f"{name}: one clip per document (a batch of clips would share the conformer's "
                             f"BatchNorm statistics; Tessera encodes every clip alone)")
        feats, feat_len = audio_frontend.features([torch.as_tensor(np.asarray(clips[0]))])  # [1, mels, t]
        inputs["input_features"] = feats.transpose(1, 2)
        inputs["input_features_mask"] = torch.arange(feats.shape[-1])[None] < feat_len[:, None]
    return inputs


def release_reference_model(hf_dir: str):
    """transformers' NemotronH_Omni_Reasoning_V3 of DIR in float32. A config.json transformers' class reads (its
    own layout, or the Omni hub layout, whose legacy names it remaps itself) is read by it. Nano V2 VL has no
    transformers class: its tensors load into the same class built from the config of those tensors
    (models/released.transformers_config) - transformers' RadioModel, pixel shuffle, RMSNorm/ReLU^2 projector and
    NemotronH as that release wires them per tile (vLLM nano_nemotron_vl.py: extract_feature, ps_version v2,
    mlp1), no video embedder, its layer scales the identity the release has (it stores none)."""
    from transformers import NemotronH_Omni_Reasoning_V3

    from tessera.models.released import HUB_VL, file_layout, transformers_config

    if file_layout(hf_dir) == HUB_VL:
        return NemotronH_Omni_Reasoning_V3.from_pretrained(hf_dir, config=transformers_config(hf_dir),
                                                           dtype=torch.float32)
    return NemotronH_Omni_Reasoning_V3.from_pretrained(hf_dir, dtype=torch.float32)


def omni_reference_logits(hf_dir: str, samples: list[OmniSample], model=None) -> list[torch.Tensor]:
    """transformers' NemotronH_Omni_Reasoning_V3 (float32) on every sample alone: logits [n_i, vocab]. `model`:
    one built by the caller from DIR (e.g. wrapped by PEFT with adapters) instead of DIR's own.

    Eval mode except the Parakeet conformer's BatchNorm: Tessera encodes each clip alone in a training step, so
    it normalises a clip with the clip's own statistics; in eval transformers would use the running statistics
    (another function). Same choice as tests/test_released_loss.py."""

    from tessera.models.encoders import encoder_config, family_of
    from tessera.models.released import encoder_name

    if model is None:
        model = release_reference_model(hf_dir)
    model.eval()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.train()
    # the Omni model itself under a wrapper (PEFT's get_base_model): the ids are read from its attributes
    omni = model.get_base_model() if hasattr(model, "get_base_model") else model
    omni.image_token_id, omni.audio_token_id, _ = omni_token_ids(hf_dir)  # the config's, when it sets them
    modalities = _modalities(hf_dir)
    vcfg = encoder_config(encoder_name(hf_dir, "vision"))
    audio_frontend = None
    if "audio" in modalities:
        acfg = encoder_config(encoder_name(hf_dir, "audio"))
        audio_frontend = family_of(acfg).preprocessor(acfg)  # the encoder's mel front end
    out = []
    with torch.no_grad():
        for sample in samples:
            inputs = omni_inputs(sample, vcfg, audio_frontend)
            if "input_features" in inputs:  # placeholders Tessera sized vs embeddings transformers keeps
                keeps = int(omni.audio_tower._get_subsampling_output_length(
                    inputs["input_features_mask"].sum(-1) + 1).sum())
                placed = sum(n for _, kind, _, _, n in sample.media if kind == "audio")
                if keeps != placed:
                    raise ValueError(f"sample {sample.name}: {placed} audio placeholders but transformers keeps "
                                     f"{keeps} audio embeddings (a mel frame count that is a multiple of the "
                                     f"subsampling)")
            logits = model(**inputs).logits[0].float()
            assert logits.shape == (len(sample.tokens), omni.config.text_config.vocab_size), logits.shape
            out.append(logits)
    return out
