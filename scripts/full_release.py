"""The released Nemotron Nano V2 VL 12B and Nemotron 3 Nano Omni 30B-A3B as downloaded, at their published sizes,
written offline without weights: what the full-size recipes' `model.checkpoint=DIR` reads.

    .venv/bin/python -m tessera.scripts.full_release --release omni_30b --out /tmp/omni_30b
    .venv/bin/python -m tessera.scripts.full_release --release vl_12b --out /tmp/vl_12b

Writes DIR/config.json in the hub's remote-code layout (models/release_layouts.py reads it) and safetensors shards
(model-0000i-of-0000n.safetensors + model.safetensors.index.json, 5 GB each as the releases are cut) whose headers
name every tensor the release holds, with its shape and dtype, over sparse files: each has its full length and no
weight byte is written (reading a tensor gives zeros; the shapes are what is checked).
The tensor list is transformers' own: NemotronH_Omni_Reasoning_V3 built on the meta device from the same config,
under the names save_pretrained writes (revert_weight_conversion); for Nano V2 VL (no transformers class) that class
of its tensors less what that release does not store (scripts/tiny_release.NOT_IN_NANO_VL); for Omni, plus the
Parakeet featurizer's fb/window the released file carries. Dtypes as the releases store them: bfloat16 weights,
float32 MoE correction biases and featurizer, int64 counters and indices.
Sizes: the LLMs are models/configs.py's (the releases' config.json fields), the encoders those
../shared/reference/released-models.md lists (RADIO ViT-H: 1280 x 32 layers, 10 prefix tokens, a 128 x 128
position table, video temporal patch 2; Parakeet 1024 x 24 layers, 8 heads, 128 mel bins, subsampling 8;
projectors 5120 -> 20480 -> LLM and 1024 -> 4096 -> LLM).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

from tessera.models import configs

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
RADIO_H = dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, mlp_ratio=4.0, patch_size=16,
               max_img_size=2048, num_cls_tokens=2, num_registers=8, summary_idxs=[0, 1], video_temporal_patch_size=2,
               norm_mean=CLIP_MEAN, norm_std=CLIP_STD,
               args=dict(model="vit_huge_patch16_224", cpe_max_size=2048, min_num_patches=1024,
                         max_num_patches=13312, separate_video_embedder=True))
PARAKEET = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, intermediate_size=4096,
                num_mel_bins=128, subsampling_factor=8, subsampling_conv_channels=256, conv_kernel_size=9,
                attention_bias=False, scale_input=False, projection_hidden_size=4096, projection_bias=False)
FEATURIZER = "sound_encoder.encoder.feature_extractor.featurizer."
N_FFT, WINDOW = 512, 400  # the Parakeet front end's STFT (its fb: [1, mels, n_fft / 2 + 1], its Hann window)


def _llm(name: str) -> dict:
    return dict(configs.hf_fields(name), model_type="nemotron_h", architectures=["NemotronHForCausalLM"])


RELEASES = {
    "omni_30b": dict(  # Nemotron 3 Nano Omni (hub layout NemotronH_Nano_Omni_Reasoning_V3)
        model_type="NemotronH_Nano_Omni_Reasoning_V3", architectures=["NemotronH_Nano_Omni_Reasoning_V3"],
        auto_map={"AutoConfig": "configuration_nemotron_h.NemotronH_Nano_Omni_Reasoning_V3_Config",
                  "AutoModel": "modeling_nemotron_h.NemotronH_Nano_Omni_Reasoning_V3"},
        llm_config=_llm("nemotron_3_nano_30b_a3b"), vision_config=RADIO_H, sound_config=PARAKEET,
        vit_hidden_size=1280, projector_hidden_size=20480, downsample_ratio=0.5, video_temporal_patch_size=2,
        # the ids public loaders of this release read (image 18, sound 27); none states the video one: unset
        video_pruning_rate=0.7, img_context_token_id=18, sound_context_token_id=27),
    "vl_12b": dict(  # Nemotron Nano V2 VL 12B (hub layout NemotronH_Nano_VL_V2)
        model_type="NemotronH_Nano_VL_V2", architectures=["NemotronH_Nano_VL_V2"],
        auto_map={"AutoConfig": "configuration.NemotronH_Nano_VL_V2_Config",
                  "AutoModel": "modeling.NemotronH_Nano_VL_V2"},
        llm_config=_llm("nemotron_nano_12b_v2"),
        vision_config=dict(model_type="radio", patch_size=16, preferred_resolution=[512, 512],
                           args=dict(model="vit_huge_patch16_224", cpe_max_size=2048, register_multiple=8)),
        force_image_size=512, patch_size=16, downsample_ratio=0.5, ps_version="v2", image_tag_type="internvl",
        use_thumbnail=True, norm_mean=CLIP_MEAN, norm_std=CLIP_STD, vit_hidden_size=1280,
        projector_hidden_size=20480, img_context_token_id=18),
}
RADIO_CLS = "vision_model.radio_model.model.patch_generator.cls_token.token"
PREFIX_TOKENS = 10  # RADIO ViT-H's class + register tokens (the cls_token table a remote RADIO is read from)
_DTYPE = {"torch.bfloat16": "BF16", "torch.float32": "F32", "torch.int64": "I64"}
_SIZE = {"BF16": 2, "F32": 4, "I64": 8}
SHARD_BYTES = 5 * 10**9  # huggingface_hub's default shard size ("5GB"), as the releases are cut


def release_tensors(directory: str | Path, release: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every tensor the release in DIR holds (config.json written)."""
    import torch
    from transformers import NemotronH_Omni_Reasoning_V3
    from transformers.core_model_loading import revert_weight_conversion

    from tessera.models.released import transformers_config
    from tessera.scripts.tiny_release import NOT_IN_NANO_VL

    with torch.device("meta"):
        model = NemotronH_Omni_Reasoning_V3(transformers_config(directory))
    saved = revert_weight_conversion(model, model.state_dict())
    out = {}
    for k, t in saved.items():
        if release == "vl_12b" and any(p in k for p in NOT_IN_NANO_VL):
            continue
        kind = "I64" if not t.is_floating_point() else "F32" if k.endswith("e_score_correction_bias") else "BF16"
        out[k] = (tuple(t.shape), kind)
    if release == "omni_30b":
        out[FEATURIZER + "fb"] = ((1, PARAKEET["num_mel_bins"], N_FFT // 2 + 1), "F32")
        out[FEATURIZER + "window"] = ((WINDOW,), "F32")
    return out


def write_sparse_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """A safetensors file of `tensors` (name -> (shape, dtype)) whose data is never written: the header the format
    defines (u64 little-endian length + JSON of dtype, shape, data_offsets) and a file cut to its full length, so the
    data is a hole. Returns the data bytes it describes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(tensors):
        shape, dtype = tensors[name]
        n = _SIZE[dtype] * _numel(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def write_sparse_shards(directory: Path, tensors: dict[str, tuple[tuple[int, ...], str]],
                        max_shard_bytes: int = SHARD_BYTES) -> list[str]:
    """`tensors` as the releases are cut: model-0000i-of-0000n.safetensors of at most max_shard_bytes each (a
    larger tensor alone) + model.safetensors.index.json, each shard sparse (write_sparse_safetensors)."""
    shards, size = [[]], 0
    for name in sorted(tensors):
        n = _SIZE[tensors[name][1]] * _numel(tensors[name][0])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(write_sparse_safetensors(directory / f, {k: tensors[k] for k in names})
                for f, names in zip(files, shards))
    index = {"metadata": {"total_size": total}, "weight_map": {k: f for f, names in zip(files, shards) for k in names}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def write_release(directory: str | Path, release: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """DIR/config.json + DIR/model.safetensors (sparse) of `release` (RELEASES); returns its tensors."""
    if release not in RELEASES:
        raise ValueError(f"unknown release {release!r}; releases: {', '.join(RELEASES)}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for old in (*d.glob("*.safetensors"), d / "model.safetensors.index.json"):  # a previous write's
        old.unlink(missing_ok=True)
    (d / "config.json").write_text(json.dumps(RELEASES[release], indent=2))
    if release == "vl_12b":  # its RADIO's prefix tokens are read from the cls_token table (release_layouts)
        write_sparse_safetensors(d / "model.safetensors", {RADIO_CLS: ((PREFIX_TOKENS, 1280), "BF16")})
    tensors = release_tensors(d, release)
    (d / "model.safetensors").unlink(missing_ok=True)
    write_sparse_shards(d, tensors)
    return tensors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--release", required=True, choices=sorted(RELEASES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    tensors = write_release(args.out, args.release)
    params = sum(_numel(shape) for shape, _ in tensors.values())
    print(f"wrote {args.release} to {args.out}: config.json (hub layout) and safetensors shards naming "
          f"{len(tensors)} tensors, {params / 1e9:.2f}B values (sparse: no weight written)")
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
