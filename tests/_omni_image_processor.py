"""transformers' Omni image (and video) processor rules, loaded without torchvision, for their pure-math grids.

transformers 5.24 models/nemotron_h_omni/image_processing_nemotron_h_omni.py imports
`torchvision.transforms.v2.functional` at the top (for the resize, which it uses only inside
NemotronH_Omni_Reasoning_V3ImageProcessor._preprocess); torchvision is absent from this venv and not installable
here. Its `get_patch_grid_size` (l.51-82) is plain `math` on ints, and the class's defaults (patch_size,
downsample_ratio, min_num_patches, max_num_patches, max_model_len) are class attributes. So the module's own
source is executed with an empty stand-in module under the four torchvision names, present in sys.modules only
while the module body runs and removed afterwards; nothing of the stand-in is ever called (the module body only
binds `tvF`; its uses are in string annotations and in _preprocess, which is never called), so every value a
test takes from here is computed by transformers' code alone. The module is loaded under a private name, so a
later real import of transformers' module is unaffected.
"""

from __future__ import annotations

import types


def release_image_module() -> types.ModuleType:
    """transformers' image_processing_nemotron_h_omni, its own source run as described above (the loader is the
    export's, hetero/export/processor.image_processing_module: one way to load it)."""
    from tessera.hetero.export.processor import image_processing_module

    return image_processing_module()


def release_grid(height: int, width: int, n_images: int = 1, **overrides) -> tuple[int, int]:
    """(grid_height, grid_width) the released image processor gives a height x width image in a call with
    n_images images: its class defaults (or `overrides` of them, as processor kwargs), the per-call patch budget
    of _preprocess (l.144-150, restated: those lines sit inside the torchvision path) and get_patch_grid_size
    (called as is)."""
    module = release_image_module()
    defaults = module.NemotronH_Omni_Reasoning_V3ImageProcessor
    p = {k: overrides.get(k, getattr(defaults, k))
         for k in ("patch_size", "downsample_ratio", "min_num_patches", "max_num_patches", "max_model_len")}
    merge_size = round(1 / p["downsample_ratio"])
    num_patches = max((p["max_model_len"] - 4) * merge_size ** 2, p["min_num_patches"] * n_images)
    if p["max_num_patches"]:
        num_patches = min(num_patches, p["max_num_patches"])
    num_patches = max(num_patches, p["min_num_patches"])
    return module.get_patch_grid_size(height, width, p["patch_size"], merge_size, p["min_num_patches"], num_patches)


def release_video_grid(height: int, width: int, target: int = 1024) -> tuple[int, int]:
    """(rows, cols) patches of every frame of a height x width clip: transformers' video processor's own rule,
    NemotronH_Omni_Reasoning_V3VideoProcessor._compute_target_patches, called as is (that module imports no
    torchvision; defaults: 16-px patches, downsample 0.5; `target` its video_target_num_patches)."""
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import \
        NemotronH_Omni_Reasoning_V3VideoProcessor

    cols, rows = NemotronH_Omni_Reasoning_V3VideoProcessor(video_target_num_patches=target)._compute_target_patches(
        height, width)
    return rows, cols
