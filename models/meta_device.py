"""Build modules on the meta device (shapes, no memory, no init), NeMo's included.

`torch.device("meta")` alone fails on NeMo's conformer, which computes its subsampled length with
torch.tensor(...).item(); here tensor factories go to meta except torch.tensor/as_tensor of data, and
torch.nn.init is a no-op (init on meta tensors is slow and meaningless). Used for the key/shape list of a
whole model (hetero/build/model_build.hf_shapes) and by the dry run's memory count (hetero/planner/meta_memory).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors


class MetaFactories(TorchFunctionMode):
    """torch.device("meta") for tensor factories, except torch.tensor/as_tensor of data (NeMo computes shapes
    with them and calls .item())."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and func not in (torch.tensor, torch.as_tensor) \
                and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def skip_init(tensor, *args, **kwargs):
    return tensor


@contextlib.contextmanager
def meta_build():
    """Modules built inside get meta parameters; torch.nn.init does nothing meanwhile."""
    inits = {n: getattr(nn.init, n) for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")}
    for n in inits:
        setattr(nn.init, n, skip_init)
    try:
        with MetaFactories():
            yield
    finally:
        for n, f in inits.items():
            setattr(nn.init, n, f)
