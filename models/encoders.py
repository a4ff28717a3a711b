"""Media encoders registered by name, so a recipe swaps one with a single field: name -> family + its fields.

A family (models/encoder_families/: radio, siglip, fastconformer, parakeet_hf, or one a user registers with
register_family) says what its fields mean and everything else about it; a registry entry is one sized config of
a family (a variant: dataclasses.replace of another). `encoder_config(name)` returns a fresh copy of the entry: the
family's Config with `family`, `modality` ("vision" or "audio", the module key of hetero/plan/layout.py and
data/tokens.MODULE_OF_KIND) and `name` (models/encoder_families/base.EncoderIdentity), so a caller may change it
(e.g. a recipe override) without touching the registry.

    register_encoder("radio_vit_l", "radio", **dataclasses.asdict(replace(RADIO_VIT_H, hidden=1024, layers=24)))
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os

from tessera.models.encoder_families import fastconformer, hf_transformers, parakeet_hf, radio, siglip  # noqa: F401
from tessera.models.encoder_families.base import FAMILIES, family_of
from tessera.models.encoder_families.conformer import FASTCONFORMER_PARAKEET_0_6B, FASTCONFORMER_TINY
from tessera.models.released import PREFIX as CHECKPOINT_PREFIX, encoder_config_of

REGISTRY: dict = {}  # name -> the entry as encoder_config returns it (its family's Config with EncoderIdentity)


def register_encoder(name: str, family: str, **fields) -> None:
    """Register encoder `name`: a config of `family` (a registered family's name) with `fields` (its Config's
    fields; the dataclass refuses a missing or unknown one). Re-registering a name replaces it."""
    fam = family_of(family)
    try:
        REGISTRY[name] = fam.config(name, **fields)
    except TypeError as e:
        raise TypeError(f"encoder {name!r} of family {family!r}: {e}; its fields: {', '.join(fam.field_names())}") \
            from None


for _name, _family, _cfg in (
        ("radio_vit_h", "radio", radio.RADIO_VIT_H), ("radio_vit_tiny", "radio", radio.RADIO_VIT_TINY),
        ("siglip_so400m", "siglip", siglip.SIGLIP_SO400M), ("siglip_tiny", "siglip", siglip.SIGLIP_TINY),
        ("fastconformer_parakeet_0_6b", "fastconformer", FASTCONFORMER_PARAKEET_0_6B),
        ("fastconformer_tiny", "fastconformer", FASTCONFORMER_TINY),
        ("parakeet_hf_0_6b", "parakeet_hf", FASTCONFORMER_PARAKEET_0_6B),
        ("parakeet_hf_tiny", "parakeet_hf", FASTCONFORMER_TINY)):
    register_encoder(_name, _family, **dataclasses.asdict(_cfg))


def names(modality: str | None = None) -> list[str]:
    """Registered encoder names (of one modality), sorted."""
    return sorted(n for n, c in REGISTRY.items() if modality is None or c.modality == modality)


def has_tensor_parallel(name: str) -> bool:
    """Whether encoder `name` can be split over tensor-parallel ranks."""
    return family_of(encoder_config(name)).tensor_parallel


def is_known(name: str) -> bool:
    """A registry name, a checkpoint's encoder (`hf:<dir>#<modality>`, models/released.py) or a transformers
    encoder (`hf:<dir>`, models/encoder_families/hf_transformers.py)."""
    return name in REGISTRY or name.startswith(CHECKPOINT_PREFIX)


def encoder_config(name: str, **overrides):
    """A copy of the registered config `name` (or of the encoder a checkpoint's config.json describes, for
    `hf:<dir>#<modality>`, or of a transformers encoder, `hf:<dir>`) with `overrides` applied (unknown fields are
    refused, since a typo would otherwise silently build the default architecture): its family's Config with
    EncoderIdentity (models/encoder_families/base.py)."""
    if hf_transformers.is_transformers_encoder(name):  # `hf:DIR` of a transformers encoder (its config.json says)
        cfg = hf_transformers.encoder_config_of(name)
    elif name.startswith(CHECKPOINT_PREFIX):
        fields = encoder_config_of(name)  # the fields models/released.py derives from config.json: a dict
        fam = family_of(fields.pop("family"))
        want = {"modality", *fam.field_names()}
        if set(fields) - {"name"} != want:  # models/released.py must set exactly its family's fields
            raise KeyError(f"{name}: derived fields {sorted(set(fields) ^ want - {'name'})} differ from the "
                           f"{fam.name} family's")
        del fields["modality"]
        cfg = fam.config(**fields)
    elif name not in REGISTRY:
        raise KeyError(f"unknown encoder {name!r}; known encoders: {', '.join(sorted(REGISTRY))}")
    else:
        cfg = copy.deepcopy(REGISTRY[name])
    known = [f.name for f in dataclasses.fields(cfg) if f.name != "name"]
    bad = sorted(set(overrides) - set(known))
    if bad:
        raise KeyError(f"encoder {name!r} has no fields {bad}; its fields: {', '.join(sorted(known))}")
    return dataclasses.replace(cfg, **overrides, name=name)


def video_temporal(encoders) -> int:
    """Frames per video tubelet of a model with these encoders (module key -> encoder name): a model with a sound
    encoder is the released Omni architecture, which embeds a video's frames in tubelets of its vision family's
    temporal patch (get_video_features); a vision-only one (the Nano V2 VL) frame by frame, 1. The one rule for
    the data side's placeholders (EncoderTokens.video_temporal) and the model build (tubelets=)."""
    if "vision" not in encoders or "audio" not in encoders:
        return 1
    cfg = encoder_config(encoders["vision"])
    return family_of(cfg).video_temporal_patch(cfg) or 1


def tokens_config(cfg):
    """The data side's EncoderTokens for an encoder config (its family's count: one source for both sides)."""
    return family_of(cfg).tokens(cfg)


# A user's own families and entries (README "Add an encoder"): modules named here, comma-separated, are imported with
# the registry, so that every process of a run (the launcher, each rank, the HF export's subprocess) has them: the
# environment reaches all of them, a registration made in one process reaches none of the others.
MODULES_ENV = "TESSERA_ENCODER_MODULES"


def import_user_modules(value: str | None = None) -> None:
    """Import the modules $TESSERA_ENCODER_MODULES (or `value`) names; an unimportable one is an error naming it."""
    for module in filter(None, (m.strip() for m in (os.environ.get(MODULES_ENV, "") if value is None
                                                    else value).split(","))):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"{MODULES_ENV}: cannot import {module!r} ({e}); put the directory that holds it on "
                              f"PYTHONPATH, or drop it from {MODULES_ENV}") from e


import_user_modules()

__all__ = ["FAMILIES", "REGISTRY", "encoder_config", "family_of", "has_tensor_parallel", "import_user_modules",
           "is_known", "names", "register_encoder", "tokens_config", "video_temporal"]
