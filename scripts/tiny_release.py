"""A tiny Nemotron 3 Nano Omni checkpoint, written offline by transformers as NVIDIA released the real one.

    .venv/bin/python -m tessera.scripts.tiny_release --out /tmp/omni_release              # vision + audio + MoE LLM
    .venv/bin/python -m tessera.scripts.tiny_release --out /tmp/omni_vl --no-audio --dense
    .venv/bin/python -m tessera.scripts.tiny_release --out /tmp/omni_hub --hub-layout   # config.json as downloaded
    .venv/bin/python -m tessera.scripts.tiny_release --out /tmp/nano_vl --nano-vl       # Nemotron Nano V2 VL

transformers' NemotronH_Omni_Reasoning_V3 with random weights and shapes unlike any Tessera registry entry
(RADIO 48 wide on 8-px patches with a 10x10 position table and 3 prefix tokens; a Parakeet of 24 without
attention biases; a hybrid LLM, MoE unless --dense), saved with save_pretrained: config.json +
model.safetensors in the released key layout, and, as a release ships them, its tokenizer: a byte-level BPE
tokenizer.json with the prompt templates' special tokens, tokenizer_config.json, chat_template.jinja (the turns
Tessera trains, data/templates.CHAT_TEMPLATE) and generation_config.json; config.json's media token ids,
eos and pad are that tokenizer's. What `model.checkpoint=OUT` fine-tunes in the README and the tests (with
OUT's tokenizer, data/run_tokenizer.py); transformers loads it back (and Tessera's export of it) with
from_pretrained.
"""

from __future__ import annotations

import argparse
import sys

from tessera.models import configs

VISION = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2.0, patch_size=8,
              max_img_size=80, num_cls_tokens=1, num_registers=2, video_temporal_patch_size=2, summary_idxs=[0])
AUDIO = dict(hidden_size=24, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, num_mel_bins=16,
             subsampling_factor=8, subsampling_conv_channels=8, conv_kernel_size=9, projection_hidden_size=40,
             projection_bias=False)
TEXT = dict(configs.TINY_MOE, hybrid_override_pattern="M*-E", vocab_size=512)
DENSE_TEXT = dict(configs.TINY_DENSE, vocab_size=512)
# what the tokenizer is trained on: the roles and the synthetic data set's kind of captions (data/prepare.py)
TOKENIZER_TEXTS = (["system\n", "user\n", "assistant\n", "You are a helpful multimodal assistant.",
                    "Describe the image.", "What is in this picture?", "Look at this: ", "How do they differ?"]
                   + [f"A {c} {s} on a {b} background, 640 by 480 pixels." for c in ("red", "green", "blue")
                      for s in ("circle", "square", "stripe") for b in ("white", "black", "yellow")]
                   + ["A steady 440 hertz tone lasting 1.5 seconds.", "A red square moves from left to right."])
TOKENIZER_VOCAB = 400


def release_tokenizer(directory) -> dict[str, int]:
    """Write a release's tokenizer files to `directory` (module docstring); returns the ids config.json takes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tessera.data.templates import CHAT_TEMPLATE, IM_END, PROCESSOR_TAGS, SPECIAL_TOKENS

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TOKENIZER_TEXTS * 8, trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=["<pad>", *SPECIAL_TOKENS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=IM_END, pad_token="<pad>",
                                  chat_template=CHAT_TEMPLATE)
    tok.save_pretrained(str(directory))
    ids = {f"{kind}_token_id": bpe.token_to_id(tag) for kind, tag in PROCESSOR_TAGS.items()}
    return {**ids, "eos_token_id": bpe.token_to_id(IM_END), "pad_token_id": bpe.token_to_id("<pad>")}


def omni_checkpoint(directory, audio: bool = True, seed: int = 0, text: dict = TEXT, tokenizer: bool = False,
                    **config):
    """Write a random tiny NemotronH_Omni_Reasoning_V3 to `directory`; returns the model. `config`: more
    top-level fields (e.g. image_token_id). tokenizer: also write a tokenizer (release_tokenizer) whose media,
    eos and pad ids config.json takes."""
    import torch
    from transformers import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    if tokenizer:
        ids = release_tokenizer(directory)
        text = dict(text, eos_token_id=ids.pop("eos_token_id"), pad_token_id=ids.pop("pad_token_id"))
        config = {**{k: v for k, v in ids.items() if audio or not k.startswith("audio")}, **config}
    cfg = NemotronH_Omni_Reasoning_V3_Config(
        vision_config=dict(VISION), text_config=dict(text), audio_config=dict(AUDIO) if audio else None,
        vision_hidden_size=VISION["hidden_size"], downsample_ratio=0.5, projector_hidden_size=72, **config)
    torch.manual_seed(seed)
    model = NemotronH_Omni_Reasoning_V3(cfg).eval()
    model.save_pretrained(str(directory))
    return model


# transformers' name -> the hub file's (NemotronH_Omni_Reasoning_V3_Config._legacy_field_names, reversed)
HUB_OMNI_NAMES = {"text_config": "llm_config", "audio_config": "sound_config", "image_token_id": "img_context_token_id",
                  "video_token_id": "video_context_token_id", "audio_token_id": "sound_context_token_id",
                  "vision_hidden_size": "vit_hidden_size"}


def hub_layout(directory, sound_model_type: str | None = None) -> dict:
    """Rewrite DIR/config.json (transformers' nemotron_h_omni) as the released Omni's hub file names it: model_type
    and architectures NemotronH_Nano_Omni_Reasoning_V3, the legacy field names, an auto_map to the remote code,
    and that code's files (HUB_REMOTE_CODE). The weights stay as they are. Returns the new config.
    sound_model_type: sound_config's model_type as the hub file sets it ("parakeet", which transformers 5.24's class
    cannot parse); None keeps transformers' own."""
    import json
    from pathlib import Path

    path = Path(directory) / "config.json"
    native = json.loads(path.read_text())
    hub = {HUB_OMNI_NAMES.get(k, k): v for k, v in native.items()}
    hub.update(model_type="NemotronH_Nano_Omni_Reasoning_V3", architectures=["NemotronH_Nano_Omni_Reasoning_V3"],
               auto_map={"AutoConfig": "configuration_nemotron_h.NemotronH_Nano_Omni_Reasoning_V3_Config",
                         "AutoModel": "modeling_nemotron_h.NemotronH_Nano_Omni_Reasoning_V3"})
    if sound_model_type and hub.get("sound_config"):
        hub["sound_config"]["model_type"] = sound_model_type
    path.write_text(json.dumps(hub, indent=2))
    for name, source in HUB_REMOTE_CODE.items():
        (Path(directory) / name).write_text(source)
    return hub


# The release's remote code, as files named by its auto_map (+ a module they import relatively, as the release's
# modeling file imports its helpers). Stand-ins: the release's own code is not available offline; what an export
# must do with these files is copy them byte for byte (hetero/export/hf.py).
_STAND_IN = ('"""Stand-in for the release\'s remote code (scripts/tiny_release.py writes it offline): the classes its '
             'auto_map names, as transformers\' native ones."""\n\n')
HUB_REMOTE_CODE = {
    "configuration_nemotron_h.py": _STAND_IN + (
        "from transformers import NemotronH_Omni_Reasoning_V3_Config\n\n\n"
        "class NemotronH_Nano_Omni_Reasoning_V3_Config(NemotronH_Omni_Reasoning_V3_Config):\n    pass\n"),
    "modeling_nemotron_h.py": _STAND_IN + (
        "from transformers import NemotronH_Omni_Reasoning_V3\n\n"
        "from .configuration_nemotron_h import NemotronH_Nano_Omni_Reasoning_V3_Config\n"
        "from .evs import VIDEO_PRUNING_RATE\n\n\n"
        "class NemotronH_Nano_Omni_Reasoning_V3(NemotronH_Omni_Reasoning_V3):\n"
        "    config_class = NemotronH_Nano_Omni_Reasoning_V3_Config\n"),
    "evs.py": _STAND_IN + "VIDEO_PRUNING_RATE = 0.7\n",
}


# Nemotron Nano V2 VL as downloaded (NemotronH_Nano_VL_V2, remote code): the fields vLLM's nano_nemotron_vl.py and
# Megatron-Bridge's NemotronVLBridge read from the hub file. The remote RADIO names its ViT by timm name; the
# smallest the loaders know is vit_small_patch16_224 (384 wide, 12 layers). 64-px tiles: 4x4 patches, 4 tokens.
NANO_VL = dict(
    model_type="NemotronH_Nano_VL_V2", architectures=["NemotronH_Nano_VL_V2"],
    auto_map={"AutoConfig": "configuration.NemotronH_Nano_VL_V2_Config", "AutoModel": "modeling.NemotronH_Nano_VL_V2"},
    llm_config=dict(DENSE_TEXT, model_type="nemotron_h", architectures=["NemotronHForCausalLM"]),
    vision_config=dict(model_type="radio", patch_size=16, preferred_resolution=[512, 512],
                       args=dict(model="vit_small_patch16_224", cpe_max_size=256, register_multiple=8,
                                 teachers=[{"name": "a"}, {"name": "b"}], cls_token_per_teacher=True)),
    force_image_size=64, patch_size=16, downsample_ratio=0.5, ps_version="v2", image_tag_type="internvl",
    template="nemotron5", use_thumbnail=True, norm_mean=[0.48, 0.46, 0.41], norm_std=[0.27, 0.26, 0.28],
    vit_hidden_size=384, projector_hidden_size=96, img_context_token_id=18)
NANO_VL_PREFIX_TOKENS = 4  # rows of its RADIO's cls_token table (2 class tokens, one per teacher, + 2 registers)
# what that release does not store (Megatron-Bridge's NemotronVLBridge maps no such tensor; vLLM loads the layer
# scales as identity): no video embedder, no layer scales, no RadioModel buffers
NOT_IN_NANO_VL = ("patch_generator.video_embedder.", ".layer_scale", "radio_model.summary_idxs",
                  "radio_model.input_conditioner.")
RADIO_CLS = "vision_model.radio_model.model.patch_generator.cls_token.token"


def nano_vl_config(directory, **over) -> dict:
    """DIR/config.json of a tiny Nano V2 VL (NANO_VL with `over`), and a model.safetensors holding only its RADIO's
    prefix-token table (what a remote RADIO's config does not state); returns the config."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    config = {**NANO_VL, **over}
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    save_file({RADIO_CLS: torch.zeros(NANO_VL_PREFIX_TOKENS, NANO_VL["vit_hidden_size"])}, str(d / "model.safetensors"))
    return config


def nano_vl_checkpoint(directory, seed: int = 0, prepare=None):
    """A random tiny Nano V2 VL in the release's layout: nano_vl_config's config.json, and the weights of transformers'
    RadioModel + RMSNorm/ReLU^2 projector + NemotronH (the Omni class of those tensors) saved under the released
    names, less NOT_IN_NANO_VL. prepare: applied to that model before saving (e.g. re-drawn weights). Returns it."""
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import NemotronH_Omni_Reasoning_V3

    from tessera.models.released import transformers_config

    d = Path(directory)
    nano_vl_config(d)
    torch.manual_seed(seed)
    model = NemotronH_Omni_Reasoning_V3(transformers_config(d)).eval()
    if prepare is not None:
        model = prepare(model)
    model.save_pretrained(str(d / "saved"))
    saved = load_file(str(d / "saved" / "model.safetensors"))
    save_file({k: v for k, v in saved.items() if not any(p in k for p in NOT_IN_NANO_VL)},
              str(d / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(d / "saved")
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-audio", action="store_true", help="a vision-only checkpoint (audio_config None)")
    ap.add_argument("--dense", action="store_true", help="a dense hybrid LLM instead of the MoE one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hub-layout", action="store_true", help="config.json in the hub's remote-code layout")
    ap.add_argument("--nano-vl", action="store_true", help="a Nemotron Nano V2 VL as downloaded (nano_vl_checkpoint)")
    args = ap.parse_args(argv)
    if args.nano_vl:
        nano_vl_checkpoint(args.out, seed=args.seed)
        print(f"wrote a tiny NemotronH_Nano_VL_V2 checkpoint to {args.out} in the hub's layout")
        return 0
    omni_checkpoint(args.out, audio=not args.no_audio, seed=args.seed, text=DENSE_TEXT if args.dense else TEXT,
                    tokenizer=True)
    if args.hub_layout:
        hub_layout(args.out)
    print(f"wrote a tiny NemotronH_Omni_Reasoning_V3 checkpoint (and its tokenizer) to {args.out}"
          + (" in the hub's config layout" if args.hub_layout else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
