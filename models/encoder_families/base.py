"""What an encoder family is: one class that says everything the project needs to know about one kind of encoder.

A family (RADIO, SigLIP, NeMo FastConformer, transformers' Parakeet, ...) is a subclass of EncoderFamily in one
file; `register_family(MyFamily)` makes it known under `MyFamily.name`, and models/encoders.register_encoder(name,
family, **fields) registers a sized entry of it (a recipe then names that entry: model.vision / model.audio).
Nothing outside a family's file branches on a family name: the model build, the data side's token count, the
planner, the layout checks, checkpoint import/export and the release-config check all ask the family.

    @register_family
    class MyVit(EncoderFamily):
        name, modality = "my_vit", "vision"
        Config = MyVitConfig                       # a dataclass: the family's architecture fields
        def build(self, cfg, pg_collection, *, recompute="none", core_attention=None): ...
        def tokens(self, cfg): ...                 # models/media_tokens.EncoderTokens
        def planner_fields(self, cfg, llm_hidden): ...
        ...

A config as callers see it is the family's Config with the encoder's identity added (EncoderIdentity: `family`,
`modality`, `name`; models/encoders.encoder_config): a dataclass from registration to build, read by attribute;
every method below takes one. Methods are plain instance methods of the one instance register_family keeps
(families hold no state). README "Add an encoder" shows a complete family.

This file imports no torch: families import their modules (megatron, NeMo, transformers) inside their methods,
so the data side and the planner can ask a family its token count or cost without loading a model stack.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

BF16 = 2  # bytes per activation element in planner_fields (hetero/planner/model.py's unit)
MODALITIES = ("vision", "audio")  # the encoder module keys (hetero/plan/layout.ENCODER_KEYS) a family can serve


@dataclasses.dataclass
class EncoderIdentity:
    """Which encoder a config is, added to its family's Config fields (keyword-only, so they follow the Config's
    own fields whatever defaults those have)."""

    family: str = dataclasses.field(kw_only=True)     # the registered family's name
    modality: str = dataclasses.field(kw_only=True)   # "vision" or "audio": the module key it serves
    name: str = dataclasses.field(default="", kw_only=True)  # the registry entry or `hf:` name it was looked up by

    def __reduce__(self):  # the class is made per family (EncoderFamily.config): pickled as family + fields
        return _config_of, (self.family, dataclasses.asdict(self))


def _config_of(family: str, fields: dict):
    fields = dict(fields)
    fields.pop("family"), fields.pop("modality")
    return family_of(family).config(**fields)


_CONFIG_CLASSES: dict[type, type] = {}  # family class -> its Config with EncoderIdentity


class EncoderFamily(abc.ABC):
    """The contract of an encoder family. Class attributes describe it; methods build and describe a config of it.

    Class attributes (set by every family):
        name              the `family` value of its registry entries
        modality          "vision" or "audio": the module key it serves, which fixes the interface its built
                          module has (see build) and the media kinds it takes (vision: image, video; audio: audio)
        Config            a dataclass of the family's architecture fields; a registry entry is one instance,
                          variants are dataclasses.replace(base, field=...) of it
        tensor_parallel   its layers shard over pg_collection.tp (megatron Column/RowParallelLinear); False: a
                          layout must give the module tp1
        context_parallel  a vision family whose tower splits one item's tokens over CP ranks (core_attention is
                          injected by the runtime, models/vision_cp.py); False: cp1 (or item-parallel CP only)
        pipeline_parallel its layers split over pipeline stages (build's pg_collection.pp)
    """

    name: ClassVar[str]
    modality: ClassVar[str]
    Config: ClassVar[type]
    tensor_parallel: ClassVar[bool] = False
    context_parallel: ClassVar[bool] = False
    pipeline_parallel: ClassVar[bool] = False

    # -- config ----------------------------------------------------------------------------------------------
    def config(self, name: str = "", **fields):
        """The config of encoder `name` of this family from `fields`, the Config's (a TypeError from the dataclass
        names a missing or unknown field): an instance of the Config with EncoderIdentity's fields set."""
        return self.config_class()(**fields, family=self.name, modality=self.modality, name=name)

    def config_class(self) -> type:
        """The Config subclass that also holds EncoderIdentity (made once per family class; its repr reads as the
        Config's)."""
        cls = _CONFIG_CLASSES.get(type(self))
        if cls is None:
            cls = _CONFIG_CLASSES[type(self)] = dataclasses.make_dataclass(
                self.Config.__name__, [], bases=(EncoderIdentity, self.Config))
            cls.__module__ = self.Config.__module__
        return cls

    def field_names(self) -> tuple[str, ...]:
        """The Config's field names (what a registry entry and a checkpoint-derived config must both set)."""
        return tuple(f.name for f in dataclasses.fields(self.Config))

    # -- model -----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def build(self, cfg: EncoderIdentity, pg_collection, *, recompute: str = "none", core_attention=None):
        """The encoder module of `cfg` on this rank: an nn.Module, without projector (models/multimodal adds the
        module key's projector on the encoder's `out_dim`).

        pg_collection: megatron's ProcessGroupCollection of this module's ranks (tp, cp, pp, dp as the layout
        gives them; pp.rank() is this rank's pipeline stage, pp.size() the stage count). recompute: "none",
        "full" or "selective" (models/recompute.py). core_attention: the vision tower's core attention class
        under context parallelism (None: plain attention).

        The module's interface follows the modality (models/multimodal.MediaModule drives it):
          vision  as models/vision.VisionEncoder: `.vit` (a tower with cp, pp, stage, first_stage, last_stage,
                  embed, run_stage_layers, head), `normalize(uint8 tiles)`, `grid_tokens(tiles)`, `out_dim`,
                  forward(uint8 tiles [n, 3, H, W]) -> [tokens, out_dim]
          audio   as models/audio.FastConformerEncoder: `tokens` (EncoderTokens), pp, first_stage, last_stage,
                  out_dim, features(waves), encode_features(feats, lengths), encode_received(hidden, lengths),
                  keep(out, out_len, feat_len), forward(list of float waveforms) -> list of [tokens_i, out_dim]"""

    @abc.abstractmethod
    def preprocessor(self, cfg: EncoderIdentity):
        """How raw media becomes this encoder's input, as a module of its own (what a reference model outside
        Tessera is fed with too): vision, uint8 tiles [n, 3, H, W] -> normalised pixels; audio, a list of float
        waveforms at cfg's sample rate -> (features [b, ..., frames], valid frames [b])."""

    # -- data side -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def tokens(self, cfg: EncoderIdentity):
        """models/media_tokens.EncoderTokens with this encoder's fields set (vision: tile, patch, pixel_shuffle;
        audio: audio_rate, audio_hop, audio_n_fft, audio_subsampling, audio_token_frames): the one count of
        embeddings per item, which the data side sizes placeholders with and the built module must produce."""

    def video_temporal_patch(self, cfg: EncoderIdentity) -> int:
        """Frames a video tubelet of this vision encoder fuses (0: no tubelet embedder)."""
        return 0

    # -- planner ---------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def planner_fields(self, cfg: EncoderIdentity, llm_hidden: int) -> dict:
        """hetero/planner/model.ModuleDesc's fields (all but `name`) of this encoder plus its projector to
        `llm_hidden`: parameters, FLOPs and activation bytes per token (vision: per tile token; audio: per encoder
        row, with frames_per_second the rows a second of audio gives), as that dataclass documents them. The
        planner prices the module by these numbers alone; `kind` only names the calibrated efficiency constant
        its kernels run at (cluster.Constants.eff_<kind>), `cp_split` how CP would split it."""

    # -- checkpoints -----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def checkpoint_module(self, encoder):
        """The submodule of a built encoder whose state dict the two hooks below convert (e.g. the ViT tower,
        the inner conformer); the rest of the encoder holds no parameters."""

    @abc.abstractmethod
    def import_tensors(self, cfg: EncoderIdentity, hf, module_keys, tp_rank: int = 0, tp: int = 1) -> dict:
        """One TP rank's state dict of checkpoint_module from the checkpoint's tensors `hf` (a mapping from full
        names, e.g. a LazyCheckpoint: read only what is used). module_keys: that module's parameter names (a
        pipeline stage's few; None where the config alone fixes them, as for a whole ViT tower); a family may
        return the whole encoder's tensors, the caller keeps module_keys. A tensor the config needs that is
        missing, or an encoder tensor left unread, raises KeyError naming it."""

    @abc.abstractmethod
    def export_tensors(self, cfg: EncoderIdentity, shards: list[dict]) -> dict:
        """The checkpoint's tensors (full names) of this encoder from checkpoint_module's state dicts, one per
        TP rank in rank order (parameters only); import_tensors(export_tensors(shards)) is the shards again."""

    def lora_targets(self, cfg: EncoderIdentity, name: str, b) -> list[tuple[str, object]]:
        """(checkpoint module, rows of B) of a LoRA adapter on `name` (a linear of checkpoint_module, one-rank
        B [out, r]), for PEFT adapter files: where export_tensors puts that linear's weight."""
        raise ValueError(f"encoder family {self.name!r} does not map LoRA adapters to checkpoint modules; "
                         f"freeze this encoder or leave it out of model.lora")

    def release_issue(self, cfg: EncoderIdentity) -> str:
        """Why this encoder is not the one transformers' NemotronH_Omni_Reasoning_V3 runs for its modality
        (so a from-scratch export gets no release config.json, models/release_config.py), or "" when it is."""
        return f"{self.modality} family {self.name!r} is not the released Omni model's {self.modality} encoder"


FAMILIES: dict[str, EncoderFamily] = {}


def register_family(family):
    """Make `family` (an EncoderFamily subclass, or an instance) known under its `name`; returns what it got, so
    it serves as a class decorator. Registering another class under a taken name is refused (a second import of
    the same class is fine)."""
    cls = family if isinstance(family, type) else type(family)
    if not issubclass(cls, EncoderFamily):
        raise TypeError(f"{cls.__name__} is not an EncoderFamily subclass")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise TypeError(f"encoder family {cls.__name__} does not define {', '.join(missing)} (EncoderFamily's "
                        f"contract, models/encoder_families/base.py)")
    for attr in ("name", "modality", "Config"):
        if not hasattr(cls, attr):
            raise TypeError(f"encoder family {cls.__name__} sets no `{attr}` class attribute")
    if cls.modality not in MODALITIES:
        raise ValueError(f"encoder family {cls.name!r}: modality {cls.modality!r} is not one of {MODALITIES}")
    if not dataclasses.is_dataclass(cls.Config):
        raise TypeError(f"encoder family {cls.name!r}: Config must be a dataclass (its architecture fields)")
    taken = sorted({f.name for f in dataclasses.fields(cls.Config)} & {"family", "modality", "name"})
    if taken:
        raise TypeError(f"encoder family {cls.name!r}: Config fields {taken} are EncoderIdentity's; rename them")
    known = FAMILIES.get(cls.name)
    if known is not None and type(known).__qualname__ != cls.__qualname__:
        raise ValueError(f"encoder family {cls.name!r} is already registered ({type(known).__qualname__}); "
                         f"pick another name")
    FAMILIES[cls.name] = family() if isinstance(family, type) else family
    return family


def family_of(cfg_or_name) -> EncoderFamily:
    """The family of an encoder config (its `family`) or of a family name."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.family
    if name not in FAMILIES:
        raise KeyError(f"unknown encoder family {name!r}; registered families: {', '.join(sorted(FAMILIES))} "
                       f"(a new family: subclass models/encoder_families/base.EncoderFamily and call "
                       f"register_family on it)")
    return FAMILIES[name]
