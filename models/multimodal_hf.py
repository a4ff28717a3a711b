"""Hugging Face import/export of the encoders and projectors in the NemotronH_Nano_VL_V2 / Omni key layout.

    encoders         each family's own layout (its import_tensors / export_tensors): RADIO under
                     vision_model.radio_model.* (models/encoder_families/radio.py), SigLIP under vision_model.*
                     (siglip.py), the conformers under sound_encoder.encoder.* in transformers' ParakeetEncoder
                     names (conformer.py, fastconformer.py)
    projector        mlp1.{0,1,3}.weight          sound projector  sound_projection.{norm,linear1,linear2}.weight
The language model goes through models/nemotron_h_hf under `language_model.`.
"""

from __future__ import annotations

import torch

from tessera.models.encoder_families.base import EncoderIdentity, family_of
from tessera.models.encoder_families.conformer import SOUND_ROOT  # noqa: F401 (the sound encoder's layout root)
from tessera.models.encoder_families.fastconformer import nemo_to_parakeet_name  # noqa: F401
from tessera.models.encoder_families.radio import (RADIO_FINAL_NORM, RADIO_ROOT, RADIO_TOWER,  # noqa: F401
                                                   radio_buffers)
from tessera.models.encoder_families.siglip import SIGLIP_ROOT  # noqa: F401

PROJECTOR_ROOT = {"vision": "mlp1.", "audio": "sound_projection."}


def vision_adapter_targets(name: str, b: torch.Tensor, cfg: EncoderIdentity) -> list[tuple[str, torch.Tensor]]:
    """(HF module, rows of B) of a LoRA adapter on the ViT layer linear `layers.N.<megatron suffix>` (one-rank
    B [out, r]), for PEFT's adapter files: the family's lora_targets."""
    return family_of(cfg).lora_targets(cfg, name, b)


def vision_from_hf(hf: dict, cfg: EncoderIdentity, tp_rank: int = 0, tp: int = 1) -> dict[str, torch.Tensor]:
    """One TP rank's VisionTransformer state dict from HF-layout tensors (the family's import_tensors)."""
    return family_of(cfg).import_tensors(cfg, hf, None, tp_rank, tp)


def vision_to_hf(shards: list[dict], cfg: EncoderIdentity) -> dict[str, torch.Tensor]:
    """Merge per-TP-rank VisionTransformer state dicts (index = tp rank) into HF-layout tensors."""
    return family_of(cfg).export_tensors(cfg, shards)


def sound_to_hf(encoder_sd: dict, family: str) -> dict[str, torch.Tensor]:
    """State dict of the inner conformer of a `family` encoder -> sound_encoder.encoder.*"""
    return family_of(family).export_tensors(None, [encoder_sd])  # (a conformer's names need no config)


def sound_from_hf(hf: dict, encoder_keys, family: str) -> dict[str, torch.Tensor]:
    """The inner conformer's state dict for `encoder_keys` (its own names) from sound_encoder.encoder.*"""
    return family_of(family).import_tensors(None, hf, encoder_keys)


def encoder_from_hf(hf, mod, tp_rank: int = 0, tp: int = 1) -> None:
    """Load a media module's encoder (this TP rank's shard; a pipeline stage keeps the tensors it holds) from the
    checkpoint's tensors through its family; every parameter must be given."""
    fam = family_of(mod.cfg)
    inner = fam.checkpoint_module(mod.encoder)
    mine = _params_only(inner.state_dict()).keys()
    full = fam.import_tensors(mod.cfg, hf, mine, tp_rank, tp)
    _load_params(inner, {k: v for k, v in full.items() if k in mine})


def media_to_hf(key: str, mod, tp_shards: list[dict] | None = None) -> dict[str, torch.Tensor]:
    """HF-layout tensors of one media module (encoder + projector); tp_shards: the encoder's checkpoint_module
    state dicts per TP rank when it ran with TP>1."""
    sd = {k: v.detach().clone() for k, v in mod.projector.state_dict().items()}
    out = {PROJECTOR_ROOT[key] + k: v for k, v in sd.items()}
    fam = family_of(mod.cfg)
    shards = tp_shards or [fam.checkpoint_module(mod.encoder).state_dict()]
    out.update(fam.export_tensors(mod.cfg, [_params_only(s) for s in shards]))
    return out


def export_hf(model, tp_shards: dict[str, list[dict]] | None = None) -> dict[str, torch.Tensor]:
    """HF-layout tensors of a MultimodalModel's encoders, projectors and (TP=1) LLM.
    tp_shards: module key -> per-TP-rank vision tower state dicts, when the tower ran with TP>1."""
    from tessera.models.nemotron_h_hf import megatron_to_hf

    out = {}
    for key, mod in model.media.items():
        out.update(media_to_hf(key, mod, (tp_shards or {}).get(key)))
    llm = megatron_to_hf({(0, 0, 0): model.llm.state_dict()}, model.llm.config)
    out.update({"language_model." + k: v for k, v in llm.items()})
    return out


def import_hf(model, hf: dict, tp_rank: int = 0) -> None:
    """Load HF-layout tensors into a MultimodalModel (this rank's TP shard); every parameter must be given."""
    from tessera.models.nemotron_h_hf import PrefixView, load_into

    tp = model.llm.pg_collection.tp.size()
    for key, mod in model.media.items():
        root = PROJECTOR_ROOT[key]
        mod.projector.load_state_dict({k[len(root):]: hf[k] for k in hf if k.startswith(root)})
        encoder_from_hf(hf, mod, tp_rank, tp)
    lm = PrefixView(hf, "language_model.")  # read on access: a LazyCheckpoint reads only what is used
    load_into(model.llm, lm, tp_rank, 0)


def _params_only(sd: dict) -> dict:
    """Drop megatron's `_extra_state` entries (fp8 metadata, None here): not model weights."""
    return {k: v for k, v in sd.items() if not k.endswith("_extra_state")}


def _load_params(module, sd: dict) -> None:
    missing, unexpected = module.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"{type(module).__name__}: missing {missing[:8]}, unexpected {unexpected[:8]}")
