"""Image tiles and video frames from decoded pixels: the one resize rule, on the host or on the device.

The vision encoders take `tile`² uint8 tiles: an image's cols x rows grid (its aspect ratio, data/media.
choose_grid) plus a thumbnail of the whole image when the grid has more than one tile; a video frame is one
tile. `cut_tiles` is that rule: one bicubic antialiased resize of the whole image to the grid (torch's uint8
kernel, PIL's BICUBIC filter), the tiles cut from it row-major, the thumbnail last.

Where the tiles hold more pixels than the decoded source (small images and videos are upscaled), the loader
can hand over the source instead: `TileSource` is the decoded pixels plus the grid, and the module that
encodes it cuts the tiles on its own device after the transfer (models/multimodal.py). The loader workers
then skip the most expensive step for such media and the host-to-device copy shrinks by the same factor.
On the CPU the result is bit-identical to cutting in the loader (same function, same input). Elsewhere the
resize runs in float32, in the same two clamped passes: within 2 levels of the CPU result, ~0.5-0.8% of
pixels off by 1, <1e-5 by 2 (the uint8 kernel's fixed-point weights; tested on the CPU), as close as that
kernel is to PIL's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def resize(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [N, 3, h, w] → uint8 [N, 3, height, width], bicubic with antialiasing.

    On the CPU torch's uint8 kernel (PIL's BICUBIC filter: max difference 2/255, mean 0.001, at 3-10x its
    speed with one thread); it works on interleaved RGB, so channels-last input and output skip two layout
    conversions. Elsewhere resize_float."""
    if x.shape[-2:] == (height, width):
        return x
    if x.device.type == "cpu":
        return torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", antialias=True)
    return resize_float(x, height, width)


def resize_float(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The same resize in float32 for devices without the uint8 kernel: horizontal pass, rounded and clamped
    to uint8 values, then the vertical pass, as PIL and torch's uint8 kernel do (a single float pass skips
    that intermediate clamp and differs by up to ~20 levels where bicubic overshoots)."""
    def one(t, size):
        t = torch.nn.functional.interpolate(t, size=size, mode="bicubic", antialias=True)
        return t.add_(0.5).floor_().clamp_(0, 255)  # round half up, as the fixed-point kernels do

    y = x.float()
    if y.shape[-1] != width:
        y = one(y, (y.shape[-2], width))
    if y.shape[-2] != height:
        y = one(y, (height, width))
    return y.to(torch.uint8)


def cut_tiles(src: torch.Tensor, cols: int, rows: int, thumbnail: bool, tile: int) -> torch.Tensor:
    """uint8 source [1, 3, h, w] (any strides) → uint8 tiles [cols*rows (+1), 3, tile, tile].

    One resize for the whole grid, then the tiles are cut by a single copy into the output, whose memory is
    [T, tile, tile, 3]: every copied run is a whole tile row of interleaved RGB. The result is the
    [T, 3, tile, tile] view of it (channels-last strides; the encoders accept any strides)."""
    n = cols * rows
    out = torch.empty((n + int(thumbnail), tile, tile, 3), dtype=torch.uint8, device=src.device)
    big = resize(src, rows * tile, cols * tile)[0].permute(1, 2, 0)  # [gh, gw, 3]
    out[:n].view(rows, cols, tile, tile, 3).copy_(big.reshape(rows, tile, cols, tile, 3).permute(0, 2, 1, 3, 4))
    if thumbnail:
        out[n] = resize(src, tile, tile)[0].permute(1, 2, 0)
    return out.permute(0, 3, 1, 2)


def hwc_to_nchw(arr: np.ndarray) -> torch.Tensor:
    """A contiguous [h, w, 3] or [n, h, w, 3] uint8 array as an [n, 3, h, w] channels-last view (no copy).

    The batch axis is added before the permute so that its stride is h*w*3: with stride 3 torch no longer
    recognises the layout as channels-last and returns a channel-first result (a 2 ms conversion per image)."""
    t = torch.from_numpy(arr)
    return (t[None] if t.ndim == 3 else t).permute(0, 3, 1, 2)


@dataclass
class TileSource:
    """Decoded pixels whose tiles are cut where they are encoded (see the module docstring).

    source: uint8 [h, w, 3] for an image (its grid: cols x rows + thumbnail) or [n, h, w, 3] for n video
    frames (each frame one tile: cols = rows = 1, no thumbnail). Behaves like the uint8 [T, 3, tile, tile]
    array it stands for: `shape`, `len()`, and np.asarray() (which cuts the tiles on the host).
    native: (height, width) of a native-resolution image (the omni family, data/media.decode_native_image):
    the source becomes that one uint8 [1, 3, height, width] image instead of tiles (cols, rows, thumbnail and
    tile are then unused; TileSource.native_image makes one), or video frames of that size [n, 3, height, width]
    (the omni family's frame grid, data/media.decode_video)."""

    source: np.ndarray
    cols: int
    rows: int
    thumbnail: bool
    tile: int
    native: tuple[int, int] | None = None

    @classmethod
    def native_image(cls, source: np.ndarray, height: int, width: int) -> "TileSource":
        """A native-resolution image [h, w, 3] (or n video frames [n, h, w, 3]) to be resized to height x width."""
        return cls(source, 1, 1, False, 0, native=(height, width))

    @property
    def frames(self) -> int:
        return self.source.shape[0] if self.source.ndim == 4 else 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        if self.native is not None:  # an image, or each of n video frames, at that one size
            return (self.frames, 3, *self.native)
        per = self.cols * self.rows + int(self.thumbnail)
        return (self.frames * per, 3, self.tile, self.tile)

    def __len__(self) -> int:
        return self.shape[0]

    def tiles(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """uint8 [T, 3, tile, tile] (a native image: [1, 3, height, width]) on `device`: the source crosses to
        the device, the resize runs there."""
        src = hwc_to_nchw(self.source).to(device, non_blocking=True)
        if self.native is not None:
            return resize(src, *self.native)
        if self.source.ndim == 4:  # video: every frame resized to one tile, in one call
            return resize(src, self.tile, self.tile)
        return cut_tiles(src, self.cols, self.rows, self.thumbnail, self.tile)

    def __array__(self, dtype=None, copy=None):
        out = self.tiles("cpu").numpy()
        return out if dtype is None else out.astype(dtype)
