"""Entry points for a training loop: a synthetic data set prepared once, and the loader sized by the model.

    ds, tok = synthetic_dataset(Path("/tmp/tessera_data"))             # every rank may call it at once
    plan = decode_plan(layout, rank, rows_per_microbatch)              # data/sharding.py
    loader = build_train_loader(ds, tok, {"vision": "radio_vit_tiny", "audio": "fastconformer_tiny"},
                                seq_length=1024, rows_per_microbatch=4, decode=plan)

The placeholder sizes come from the same registry configs the model is built from (models/encoders.py),
so the data side and the encoders cannot disagree about how many embeddings a tile, frame or second of
audio produces.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from tessera.data.loader import ChatTaskEncoder, build_loader
from tessera.data.run_tokenizer import ChatTemplate
from tessera.data.templates import prompt_template, template_for_encoders
from tessera.data.tokens import SPECIAL_TOKENS, EncoderTokens

_DONE = ".complete"  # written last inside the temporary folder, so a renamed folder is always whole


def _complete(path: Path) -> bool:
    return (path / _DONE).exists()


SHARD_FORMAT = "meta1"  # media metadata in each sample's JSON (data/media_meta.py)
# data.val_path=synthetic: a held-out synthetic set (another seed: other media and texts than the training set's)
SYNTHETIC_VAL, SYNTHETIC_VAL_SET = "synthetic", {"samples": 32, "seed": 1}


def synthetic_root() -> Path:
    """Where synthetic sets are cached: $TESSERA_CACHE/synthetic (default ~/.cache/tessera)."""
    return Path(os.environ.get("TESSERA_CACHE", "~/.cache/tessera")).expanduser() / "synthetic"


#: data.val_path=auto (the tiny recipes'): validate on what the training data holds out (val_sets)
AUTO_VAL = "auto"


class SplitPath(str):
    """A dataset path (a str, as every other val set's) that names which of energon's splits to read."""

    def __new__(cls, path: str, split: str):
        self = super().__new__(cls, path)
        self.energon_split = split  # not `split`: str.split is a method of every path
        return self


def split_of(path: str) -> str:
    """The energon split a val set is read from: a SplitPath's, else the one a prepared dataset trains from."""
    return getattr(path, "energon_split", "train")


def has_val_split(path: str | Path) -> bool:
    """Whether energon's split of a prepared dataset (.nv-meta/split.yaml: a non-empty `val`, as
    `prepare_data.py --val-ratio` writes) or a blend YAML (a `val` entry under `splits`) holds out a val split."""
    import yaml

    path = Path(path).expanduser()
    if path.is_dir():
        split = path / ".nv-meta" / "split.yaml"
        parts = (yaml.safe_load(split.read_text()) or {}).get("split_parts", {}) if split.is_file() else {}
        return bool(parts.get("val"))
    return path.is_file() and "val" in ((yaml.safe_load(path.read_text()) or {}).get("splits") or {})


def val_sets(spec: str | None, train_path: str | None = None) -> dict[str, str]:
    """data.val_path as {name: path}: None or "" -> {}; "synthetic"; one dataset directory or blend YAML (named
    after it); or several named ones, "NAME=PATH;NAME=PATH". Paths must exist (checked before launch).
    "auto" (AUTO_VAL) follows the training data (`train_path`, data.path): synthetic training data -> the held-out
    synthetic set; a dataset or blend with a val split -> that split ({"val": SplitPath(train_path, "val")});
    else none (never synthetic media for a model trained on the user's own data)."""
    if (spec or "").strip() == AUTO_VAL:
        if train_path is None:
            return {SYNTHETIC_VAL: SYNTHETIC_VAL}
        return {"val": SplitPath(str(train_path), "val")} if has_val_split(train_path) else {}
    parts = [p.strip() for p in (spec or "").split(";") if p.strip()]
    out: dict[str, str] = {}
    for part in parts:
        name, eq, path = part.partition("=")
        name, path = (name.strip(), path.strip()) if eq else (Path(part).stem or part, part)
        if not name or not path or "/" in name:
            raise ValueError(f"data.val_path: {part!r} is not PATH or NAME=PATH (NAME without '/')")
        if name in out:
            raise ValueError(f"data.val_path: the set name {name!r} is given twice; name them: a=PATH;b=PATH")
        if path != SYNTHETIC_VAL and not Path(path).exists():
            raise ValueError(f"data.val_path: {path} does not exist; prepare it with scripts/prepare_data.py "
                             f"or use data.val_path={SYNTHETIC_VAL}")
        out[name] = path
    return out


def synthetic_kinds(modules) -> tuple[str, ...]:
    """The synthetic data set's sample kinds for a model with these encoder modules: only the media it encodes
    (a VL model's synthetic set holds no audio, which it would skip as no_encoder), and chats."""
    from tessera.data.tokens import MODULE_OF_KIND

    return (*(k for k, m in MODULE_OF_KIND.items() if m in set(modules)), "chat")


def synthetic_dataset(root: Path, samples: int = 96, seed: int = 0,
                      kinds: tuple[str, ...] | None = None) -> tuple[Path, Path]:
    """(dataset path, tokenizer path) of the synthetic data set under `root`, generating it on first use.
    kinds: synthetic_kinds of the model (None: every media kind); a set of fewer kinds is its own folder.

    Safe when several ranks (processes, hosts on a shared filesystem) call it at once: each builds a
    private temporary folder next to the target and renames it into place; a rename onto an existing
    folder fails, so exactly one copy wins and the others delete theirs. Nobody ever sees a partial set,
    and a crash leaves only a temporary folder behind (named `.synthetic-*.tmp*`), never a broken target.
    The folder's name carries a digest of the template's special tokens: a set cached with another token set
    has a tokenizer that Tokenizer refuses, so it is never reused (a new one is built beside it); and the shards'
    format (SHARD_FORMAT), so a set cached before the media metadata is built again with it."""
    from tessera.data.prepare import make_synthetic  # lazily: media encoders load only when generating

    root = Path(root)
    tokens_digest = hashlib.sha1("\0".join(SPECIAL_TOKENS).encode()).hexdigest()[:8]
    every = kinds is None or {"image", "video", "audio"} <= set(kinds)
    only = "" if every else "-" + "".join(k[0] for k in kinds if k != "chat")  # e.g. -iv: images and videos
    path = root / f"synthetic-{samples}-{seed}-{tokens_digest}-{SHARD_FORMAT}{only}"
    if not _complete(path):
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp", dir=root))
        try:
            make_synthetic(tmp, samples=samples, seed=seed, **({} if every else {"kinds": kinds}))
            (tmp / _DONE).write_text(f"{samples} samples, seed {seed}\n")
            try:
                os.rename(tmp, path)
            except OSError:  # another rank renamed its copy first (ENOTEMPTY / EEXIST)
                if not _complete(path):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path, path / "tokenizer.model"


def settles_tubelet_chunks(encoders: dict[str, str], video_pruning: float) -> bool:
    """Whether a model's EVS-pruned clips are written in per-tubelet chunks at nominal counts, which the trainer
    settles once the encoder has chosen (data/tokens.media_placeholders, hetero/runtime/tubelet_settle.py): EVS
    on a family whose video the release wraps per tubelet (omni)."""
    if "vision" not in encoders or not video_pruning:
        return False
    wrap = prompt_template(template_for_encoders(encoders)).media.get("video")
    return wrap is not None and wrap.per_tubelet


def encoder_tokens(encoders: dict[str, str], max_tiles: int = 2, video_frames: int = 4,
                   video_pruning: float = 0.0, *, native_resolution: bool = False, min_patches: int | None = None,
                   max_patches: int | None = None) -> EncoderTokens:
    """EncoderTokens from registry names: vision tile/patch/pixel shuffle, audio rate/hop/n_fft/subsampling
    and which mel frames the audio count covers (models/encoders.tokens_config); native_resolution and the
    patch budget (None: from max_tiles, models/media_tokens.EncoderTokens) as given.

    encoders maps module key ("vision", "audio") to a registry name; each config must be of that modality."""
    from tessera.models.encoders import encoder_config, tokens_config, video_temporal

    fields = {}
    for module, name in encoders.items():
        cfg = encoder_config(name)
        if cfg.modality != module:
            raise ValueError(f"encoder {name!r} is a {cfg.modality} encoder, not a {module!r} one")
        t = tokens_config(cfg)
        if module == "vision":
            fields.update(tile=t.tile, patch=t.patch, pixel_shuffle=t.pixel_shuffle)
        else:
            fields.update(audio_rate=t.audio_rate, audio_hop=t.audio_hop, audio_n_fft=t.audio_n_fft,
                          audio_subsampling=t.audio_subsampling, audio_token_frames=t.audio_token_frames,
                          audio_convs=t.audio_convs, audio_window=t.audio_window)
    return EncoderTokens(max_tiles=max_tiles, video_frames=video_frames, video_pruning=video_pruning,
                         video_temporal=video_temporal(encoders), native_resolution=native_resolution,
                         min_patches=min_patches, max_patches=max_patches, **fields)


def chat_task_encoder(tokenizer, encoders: dict[str, str], seq_length: int, *,
                      decode: dict[str, range | int] | None = None, max_tiles: int = 2, video_frames: int = 4,
                      video_pruning: float = 0.0, defer_upscale: bool = False, min_patches: int | None = None,
                      max_patches: int | None = None, log_skips: bool = True, assignment=None,
                      caption_prompt: str | None = None, chat_template: ChatTemplate | None = None) -> ChatTaskEncoder:
    """The task encoder of a model with these encoders: placeholder sizes from their registry configs
    (encoder_tokens) and the prompt template of their family (omni with an audio encoder, else vl:
    data/templates.template_for_encoders), the one place a run's template, and with it the image mode, is
    chosen: omni takes each image at native resolution (one patch grid of min_patches..max_patches; None:
    derived from max_tiles, models/media_tokens.EncoderTokens), vl cuts max_tiles tiles + a thumbnail.
    chat_template: a release's chat template (data/run_tokenizer.run_chat_template): the turns in its format, the
    media wrapped as the family's (data/release_prompt.py); None: the project's turns."""
    template = template_for_encoders(encoders)
    enc = encoder_tokens(encoders, max_tiles, video_frames, video_pruning,
                         native_resolution=prompt_template(template).native_resolution,
                         min_patches=min_patches, max_patches=max_patches)
    context_patches = (seq_length - 4) * enc.pixel_shuffle ** 2
    if "vision" in encoders and enc.native_resolution and context_patches < enc.patch_budget[1]:
        # the release's image processor gives every image of a call at most (max_model_len - 4) x merge²
        # patches (image_processing_nemotron_h_omni.py l.145-150) when that is below max_num_patches: a
        # budget that depends on the call's images, which Tessera does not follow; such a run is refused
        raise ValueError(f"seq_length {seq_length} holds fewer than max_patches {enc.patch_budget[1]} patches "
                         f"(seq_length - 4 tokens of {enc.pixel_shuffle ** 2}): the released processor would "
                         f"shrink every image's budget to the context; lower max_patches or max_tiles")
    return ChatTaskEncoder(tokenizer, seq_length, enc, decode=decode, modules=set(encoders),
                           defer_upscale=defer_upscale, template=template, log_skips=log_skips, assignment=assignment,
                           caption_prompt=caption_prompt, chat_template=chat_template)


def build_train_loader(path: str | Path, tokenizer: str | Path, encoders: dict[str, str], seq_length: int,
                       rows_per_microbatch: int, *, decode: dict[str, range | int] | None, num_workers: int = 0,
                       seed: int = 0, max_tiles: int = 2, video_frames: int = 4, video_pruning: float = 0.0,
                       state=None, defer_upscale: bool = False, min_patches: int | None = None,
                       max_patches: int | None = None, log_skips: bool = True, assignment=None,
                       caption_prompt: str | None = None, split: str = "train",
                       chat_template: ChatTemplate | None = None):
    """The resumable loader of global PackedBatch microbatches for one rank (data/loader.build_loader).

    decode: what data.sharding.decode_plan returns for this rank (None: decode every row, one process), or with
    `assignment` (hetero/plan/encoder_balance.ItemAssignment) the rank's DP rank per encoder (ResolvedRun.decode_items).
    state: a loader.save_state_rank() result to resume from (same num_workers, see build_loader).
    defer_upscale: media smaller than their tiles are resized on the encoding device (ChatTaskEncoder).
    min_patches / max_patches: an omni model's native-resolution image budget (chat_task_encoder).
    log_skips: log examples of the stream's skips (one rank of a run: every rank skips the same samples).
    caption_prompt: the user turn of energon CaptioningSample datasets (data/sample_types.py).
    split: which of energon's splits to read (a dataset's own "val": val_sets).
    chat_template: the release's chat template the conversations are written in (chat_task_encoder)."""
    te = chat_task_encoder(tokenizer, encoders, seq_length, decode=decode, max_tiles=max_tiles,
                           video_frames=video_frames, video_pruning=video_pruning, defer_upscale=defer_upscale,
                           min_patches=min_patches, max_patches=max_patches, log_skips=log_skips,
                           assignment=assignment, caption_prompt=caption_prompt, chat_template=chat_template)
    return build_loader(path, te, rows_per_microbatch, num_workers=num_workers, seed=seed, state=state, split=split)
