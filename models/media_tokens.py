"""How many LLM positions one media item occupies: the encoders' token arithmetic, as one small interface.

The encoders (models/vision.py, models/video.py, models/audio.py) define these counts; the data side
(data/tokens.py) imports this module to size every media placeholder, so the two can only disagree if this
arithmetic disagrees with the encoders, which tests/test_data_tokens.py and the encoder tests check.
`models.encoders.tokens_config(cfg)` builds one from a registry entry. Plain arithmetic: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def native_patch_grid(height: int, width: int, patch: int, merge: int, min_patches: int,
                      max_patches: int) -> tuple[int, int]:
    """(rows, cols) in patches of the one grid an image of height x width pixels is resized to at native
    resolution: transformers 5.24 models/nemotron_h_omni/image_processing_nemotron_h_omni.py,
    get_patch_grid_size (l.51-82), step for step (tests/test_native_resolution.py runs that function):
      - the image's own grid, round(side / patch + 0.5): Python's round halves to even, so an exact multiple
        of the patch gives side/patch + 1 when side/patch is odd and side/patch when it is even (not the
        floor + 1 its comment says for every integer);
      - scaled down by sqrt(max / patches) when over max_patches (floor), up by sqrt(min / patches) when
        under min_patches (ceil; only while max > min);
      - each side rounded to a multiple of `merge` (the pixel shuffle), up when the grid stays within
        max_patches, else down (to at least merge).
    The release divides by zero when scaling down floors a side of an extreme aspect ratio to 0 patches;
    here that grid is refused with a ValueError, as is one with an empty side (the release's output when
    max <= min), since neither is an image the encoder can take."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image has an empty size {width}x{height}")
    rows, cols = round(height / patch + 0.5), round(width / patch + 0.5)
    factor = min(math.sqrt(max_patches / (rows * cols)), 1.0)
    rows, cols = math.floor(factor * rows), math.floor(factor * cols)
    if rows == 0 or cols == 0:
        raise ValueError(f"a {width}x{height} image has no patch grid within {max_patches} patches: its aspect "
                         f"ratio floors one side to 0 patches")
    if max_patches > min_patches and rows * cols < min_patches:
        factor = math.sqrt(min_patches / (rows * cols))
        rows, cols = math.ceil(factor * rows), math.ceil(factor * cols)
    if remainder := rows % merge:
        rows = rows + merge - remainder if (rows + merge - remainder) * cols <= max_patches else \
            max(merge, rows - remainder)
    if remainder := cols % merge:
        cols = cols + merge - remainder if rows * (cols + merge - remainder) <= max_patches else \
            max(merge, cols - remainder)
    if rows == 0 or cols == 0:
        raise ValueError(f"a {width}x{height} image gives an empty {rows}x{cols} patch grid")
    return rows, cols


def video_frame_grid(height: int, width: int, target: int, merge: int) -> tuple[int, int]:
    """(rows, cols) in patches of every frame of a height x width clip at native resolution: transformers 5.24
    models/nemotron_h_omni/video_processing_nemotron_h_omni.py, _compute_target_patches (l.86-110, aspect ratio
    kept), step for step: sides round(sqrt(target / aspect)) and round(sqrt(target * aspect)) (Python's round,
    at least 1), each then rounded to a multiple of `merge`, both up when the grid stays within `target`
    patches, else both down (to at least merge). A square clip gets sqrt(target) patches a side: 32 x 32 for
    the release's 1024, one 512-px tile of 16-px patches. tests/test_native_resolution.py runs that method."""
    if height <= 0 or width <= 0:
        raise ValueError(f"video frames have an empty size {width}x{height}")
    aspect = width / height
    rows, cols = max(round(math.sqrt(target / aspect)), 1), max(round(math.sqrt(target * aspect)), 1)
    if merge > 1:
        up_rows, up_cols = rows + (-rows) % merge, cols + (-cols) % merge
        if up_rows * up_cols <= target:
            rows, cols = up_rows, up_cols
        else:
            rows, cols = max(merge, rows - rows % merge), max(merge, cols - cols % merge)
    return rows, cols


def evs_kept_tokens(frames: int, per_frame: int, rate: float) -> int:
    """Tokens Efficient Video Sampling keeps of `frames` (tubelets) x `per_frame` tokens at pruning `rate`: the
    releases' rule, int(frames * per_frame * (1 - rate)) but never fewer than one frame's (transformers 5.24,
    models/nemotron_h_omni/modeling_nemotron_h_omni.py compute_retention_mask, l.119-121). It depends only on the
    counts, so the data side sizes the placeholders before anything is encoded."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"video pruning rate must be in [0, 1), got {rate}")
    return max(per_frame, int(frames * per_frame * (1 - rate))) if frames else 0


def evs_nominal_tubelet_counts(tubelets: int, per_tubelet: int, kept: int) -> list[int]:
    """How a pruned clip's `kept` tokens are first laid out over its tubelets' <img> ... </img> chunks, before
    encoding: the first tubelet whole (EVS always keeps it: its score is the maximum, and kept >= one tubelet's
    tokens), the rest spread evenly over the later tubelets, earlier ones first. Only the total is certain before
    encoding; once EVS has chosen, the trainer moves the chunks to each tubelet's actual count
    (data/packing.settle_tubelet_chunks), so these counts are a placeholder the row's length does not depend on."""
    if tubelets < 1 or not per_tubelet <= kept <= tubelets * per_tubelet:
        raise ValueError(f"{kept} kept tokens do not fit {tubelets} tubelets of {per_tubelet} with the first whole")
    base, extra = divmod(kept - per_tubelet, tubelets - 1) if tubelets > 1 else (0, 0)
    return [per_tubelet] + [base + (i < extra) for i in range(tubelets - 1)]


@dataclass(frozen=True)
class EncoderTokens:
    """How many LLM positions each media item occupies; mirrors the encoder configs.

    vision: an image is `tile`² tiles (data/media.choose_grid: at most max_tiles, plus a thumbnail) or, with
    `native_resolution` (the omni family, data/pipeline.chat_task_encoder), one rows x cols patch grid at the
    image's own aspect ratio (native_patch_grid, the released Omni image processor's rule). A grid of
    rows x cols patches gives (rows/shuffle) x (cols/shuffle) tokens after pixel shuffle (grid_tokens, the
    one count rule: a tile is a (tile/patch)² grid). video frames are one tile each. audio: the mel front end (hop, n_fft, center=True) gives
    n = (samples + 2 (n_fft // 2) - n_fft) // hop valid frames; `audio_tokens_of_frames` is the one rule that
    turns them into embeddings, for the data side's placeholders and the audio encoders' output alike
    (models/audio.py trims the encoder's output with it): `subsampling`× striding (log2(subsampling) conv
    stages, kernel 3, stride 2, padding 1, i.e. ceil-halving) of the frames `audio_token_frames` counts."""

    tile: int = 512
    patch: int = 16
    pixel_shuffle: int = 2
    max_tiles: int = 6
    thumbnail: bool = True
    # Native resolution: each image one patch grid of min_patches..max_patches patches (None: one tile's
    # patches .. (max_tiles + 1) tiles' patches, the patches the tiles and thumbnail of the tiled families hold;
    # for 512-px tiles of 16-px patches and max_tiles 12 that is 1024..13312, the released Omni image
    # processor's min_num_patches / max_num_patches defaults).
    native_resolution: bool = False
    min_patches: int | None = None
    max_patches: int | None = None
    video_frames: int = 8
    video_temporal: int = 1  # frames per video tubelet (the Omni release: 2, its video_embedder; else 1)
    video_pruning: float = 0.0  # fraction of video tokens the encoder drops (EVS, evs_kept_tokens)
    audio_rate: int = 16_000
    audio_hop: int = 160
    audio_n_fft: int = 512
    audio_subsampling: int = 8
    # Which mel frames the subsampling counts (each conformer family's token_frames, models/encoder_families):
    #   "valid"  NeMo (FastConformer): the n valid frames; the encoder's own valid length, ceil(n / subsampling).
    #   "stft"   the released Omni model (transformers' NemotronH_Omni_Reasoning_V3): n + 1, every centre-padded
    #            STFT frame, the last of which the front end zeroes and masks. Its processor announces
    #            subsample(1 + samples // hop) placeholders and get_audio_features keeps
    #            subsample(input_features_mask.sum(-1) + 1) embeddings, so when n is a multiple of the
    #            subsampling a clip keeps one embedding past the encoder's valid length (a masked position
    #            of its output: e.g. 1.28 s at 16 kHz is 17 tokens, not 16).
    audio_token_frames: str = "valid"
    # The released audio front end (Parakeet, in transformers' Omni processor) pads a clip shorter than 0.1 s
    # with zeros to 0.1 s; the data side does the same, so a short clip trains instead of ending the job.
    audio_min_seconds: float = 0.1
    # Fewest encoder frames a clip may give: the conformer's BatchNorm needs more than one value per channel in
    # training, and a rank whose microbatch holds one clip of one frame has exactly one.
    audio_min_tokens: int = 2
    # An audio encoder whose rows come from the samples through a stack of convolutions (transformers' Whisper and
    # wav2vec2 encoders, models/encoder_families/hf_transformers.py): (kernel, stride, padding) per stage over at
    # most audio_window samples (0: all of them). Empty: the mel front end and subsampling rule above.
    audio_convs: tuple = ()
    audio_window: int = 0

    def __post_init__(self):
        side = self.tile // self.patch
        if self.tile % self.patch or side % self.pixel_shuffle:
            raise ValueError(f"tile {self.tile} must be a multiple of patch {self.patch} * pixel_shuffle "
                             f"{self.pixel_shuffle}")
        if self.audio_subsampling & (self.audio_subsampling - 1):
            raise ValueError(f"audio_subsampling={self.audio_subsampling} must be a power of two (stride-2 stages)")
        if self.audio_token_frames not in ("valid", "stft"):
            raise ValueError(f"audio_token_frames={self.audio_token_frames!r} must be 'valid' or 'stft'")
        lo, hi = self.patch_budget
        if self.native_resolution and not 0 < lo <= hi:
            raise ValueError(f"native-resolution images need 0 < min_patches <= max_patches, got {lo}, {hi}")

    @property
    def patches_per_tile(self) -> int:
        return (self.tile // self.patch) ** 2

    @property
    def patch_budget(self) -> tuple[int, int]:
        """(min, max) patches of a native-resolution image (see the fields' comment)."""
        return (self.patches_per_tile if self.min_patches is None else self.min_patches,
                (self.max_tiles + 1) * self.patches_per_tile if self.max_patches is None else self.max_patches)

    def image_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) patches of a width x height image at native resolution (native_patch_grid)."""
        return native_patch_grid(height, width, self.patch, self.pixel_shuffle, *self.patch_budget)

    def grid_tokens(self, rows: int, cols: int) -> int:
        """Tokens of one rows x cols patch grid after pixel shuffle: every image count comes from here."""
        if rows % self.pixel_shuffle or cols % self.pixel_shuffle:
            raise ValueError(f"a {rows}x{cols} patch grid does not pixel-shuffle by {self.pixel_shuffle}")
        return (rows // self.pixel_shuffle) * (cols // self.pixel_shuffle)

    @property
    def tokens_per_tile(self) -> int:
        return self.grid_tokens(self.tile // self.patch, self.tile // self.patch)

    def image_tokens(self, units: int | tuple[int, int]) -> int:
        """Tokens of an image of `units` tiles, or of one native-resolution grid given as (rows, cols)."""
        if isinstance(units, tuple):
            return self.grid_tokens(*units)
        return units * self.tokens_per_tile

    def video_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) patches of each frame of a width x height clip at native resolution (video_frame_grid,
        the released Omni video processor's rule, its target a tile's patches)."""
        return video_frame_grid(height, width, self.patches_per_tile, self.pixel_shuffle)

    def tubelet_tokens(self, units: int | tuple[int, int, int]) -> tuple[int, int]:
        """(tubelets, tokens of each) of a clip of `units` frames, or (frames, rows, cols) at native resolution:
        `video_temporal` frames per tubelet (the last one repeated to fill), one tile or frame grid each."""
        if isinstance(units, int):
            return math.ceil(units / self.video_temporal), self.tokens_per_tile
        return math.ceil(units[0] / self.video_temporal), self.grid_tokens(*units[1:])

    def video_tokens(self, units: int | tuple[int, int, int]) -> int:
        """A clip's embeddings: its tubelets' tokens (tubelet_tokens), then what EVS pruning keeps
        (evs_kept_tokens, the rule models/video.py prunes by)."""
        return evs_kept_tokens(*self.tubelet_tokens(units), self.video_pruning)

    @property
    def audio_min_samples(self) -> int:
        return math.ceil(round(self.audio_min_seconds * self.audio_rate, 6))  # 0.1 * 16000 is not exact

    def audio_padded_samples(self, num_samples: int) -> int:
        """The length a clip of num_samples has after the front end's padding to audio_min_seconds."""
        return max(num_samples, self.audio_min_samples)

    def audio_mel_frames(self, num_samples: int) -> int:
        """Valid mel frames of a clip (the front end's feature length; its STFT has one more, centre-padded)."""
        return (num_samples + 2 * (self.audio_n_fft // 2) - self.audio_n_fft) // self.audio_hop

    def audio_subsampled(self, frames: int) -> int:
        """Frames after the conformer's subsampling (log2(subsampling) convolutions, kernel 3, stride 2, padding 1)."""
        for _ in range(int(math.log2(self.audio_subsampling))):
            frames = (frames + 2 * 1 - 3) // 2 + 1
        return max(frames, 0)

    def audio_tokens_of_frames(self, mel_frames: int) -> int:
        """Embeddings a clip of `mel_frames` valid mel frames gives: what the data side announces and what the
        audio encoders keep of their output (models/audio.py), one rule for both."""
        return self.audio_subsampled(mel_frames + (1 if self.audio_token_frames == "stft" else 0))

    def audio_encoder_rows(self, num_samples: int) -> int:
        """Rows of the conformer's output for one clip encoded alone: its input is the centre-padded STFT's
        valid + 1 mel frames (what audio pipeline stages hand on, models/audio.py); an audio_convs encoder's rows of
        its whole window (Whisper encodes the padded window) or of the clip."""
        if self.audio_convs:
            return self.audio_conv_rows(self.audio_window or num_samples)
        return self.audio_subsampled(self.audio_mel_frames(num_samples) + 1)

    def audio_conv_rows(self, num_samples: int) -> int:
        """Rows the audio_convs stack makes of num_samples samples (cut to audio_window)."""
        n = min(num_samples, self.audio_window) if self.audio_window else num_samples
        for kernel, stride, padding in self.audio_convs:
            n = (n + 2 * padding - kernel) // stride + 1
        return max(n, 0)

    def audio_tokens(self, num_samples: int) -> int:
        if self.audio_convs:
            return self.audio_conv_rows(num_samples)
        return self.audio_tokens_of_frames(self.audio_mel_frames(num_samples))

    def tokens(self, kind: str, units: int | tuple) -> int:
        """Tokens for one media item of `kind` with `units` tiles or a (rows, cols) native patch grid (image),
        frames or (frames, rows, cols) at native resolution (video) or 16 kHz samples."""
        return {"image": self.image_tokens, "video": self.video_tokens, "audio": self.audio_tokens}[kind](units)
