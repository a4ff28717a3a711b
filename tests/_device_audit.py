"""A second device on a CPU-only machine, for checking that code moves what it must (tests/test_gpu_path.py).

On a GPU, a tensor lives in host memory until something moves it: factories without `device=`, numpy
conversions and the loader's batches are host tensors, and a module, an op mixing them with device tensors,
or an NCCL collective fails on them. On CPU every tensor is a CPU tensor, so nothing fails. DeviceAudit
restores the distinction while real CPU code runs (a TorchFunctionMode plus wrapped collectives and
Module.__call__):

  - the run's device is `torch.device("cpu", 0)` (RUN): it computes on the CPU, but is a device value of
    its own, so a move to "cpu" or a device re-derived as torch.device("cpu") is not a move to it;
  - host tensors: what a factory makes without `device=` (torch.zeros, torch.tensor, as_tensor/from_numpy/
    frombuffer of arrays), what `.cpu()` / `.to(<not RUN>)` returns, what is registered with `host()` (the loader's
    batches), and what is computed from host tensors only. Tracked by storage (a view of a host tensor is
    host; `param.data = moved` is not), with every host storage kept alive so its address is never reused;
  - device tensors: everything else — `.to(RUN)` / `device=RUN` results, results of ops on device tensors,
    and what autograd makes (gradients live where their tensors live, as on a GPU). `t.device` reports
    RUN for them and cpu for host tensors, so code deriving a device from a tensor behaves as on a GPU;
  - a violation (what would raise on a GPU): a host tensor reaching a collective or a module's forward, an
    op mixing host and device tensors (0-dim host scalars and advanced-indexing indices allowed, as CUDA
    allows them), `.numpy()` of a device tensor.

Remove any one `.to(device)` of the path and the step records a violation naming the file and line.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

RUN = torch.device("cpu", 0)
ROOT = Path(__file__).resolve().parents[1]
_DEVICE_GET = torch.Tensor.device.__get__
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
               "broadcast", "reduce", "send", "recv", "isend", "irecv", "all_to_all_single", "all_to_all",
               "gather", "scatter", "_all_gather_base", "_reduce_scatter_base")


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _where() -> str:
    """The innermost frame of this repository's code (not this file): where the offending call is."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if path.name != "_device_audit.py" and ROOT in path.parents and ".venv" not in path.parts:
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    return "?"


class DeviceAudit(TorchFunctionMode):
    def __init__(self, device: torch.device = RUN):
        super().__init__()
        self.device = device
        self._host: dict[int, torch.UntypedStorage] = {}  # data_ptr -> storage (kept alive: no address reuse)
        self.violations: list[str] = []
        self.checked = {"collective": 0, "module": 0}
        self.collectives: set[str] = set()
        self.modules: set[str] = set()
        self._undo = []

    # ---- host / device bookkeeping -------------------------------------------------------------------
    def is_host(self, t: torch.Tensor) -> bool:
        with torch._C.DisableTorchFunction():
            try:
                if t.device.type != "cpu":
                    return False
                if t.numel() and t.untyped_storage().nbytes():
                    return t.untyped_storage().data_ptr() in self._host
            except (RuntimeError, NotImplementedError):  # storage-less tensors
                return False
        return bool(getattr(t, "_audit_host", False))

    def _mark(self, out, host: bool) -> None:
        with torch._C.DisableTorchFunction():
            for t in _tensors(out):
                if t.device.type != "cpu":
                    continue
                try:
                    t._audit_host = host
                except (AttributeError, RuntimeError):
                    pass
                if host and t.numel():
                    storage = t.untyped_storage()
                    if storage.nbytes():
                        self._host[storage.data_ptr()] = storage

    def host(self, tree):
        """Register every tensor in `tree` as host memory (what a loader hands over); returns `tree`."""
        self._mark(tree, True)
        return tree

    def host_batches(self, it):
        """The loader's iterator with each PackedBatch's tensors registered as host memory."""
        for batch in it:
            self.host([batch.tokens, batch.labels, batch.position_ids, list(batch.cu_seqlens)])
            yield batch

    def _violation(self, what: str) -> None:
        self.violations.append(f"{what} at {_where()}")

    # ---- the mode ------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GET:
            real = func(*args)
            return real if real.type != "cpu" or self.is_host(args[0]) else self.device
        name = getattr(func, "__name__", "")
        if name == "numpy" and args and isinstance(args[0], torch.Tensor) and not self.is_host(args[0]):
            self._violation("numpy() of a device tensor")
        out = func(*args, **kwargs)
        host = self._result_is_host(func, name, args, kwargs, out)
        if host is not None:
            if name == "to" and not host and self.is_host(args[0]) and out is args[0]:
                out = out.clone()  # a GPU copies host -> device; never alias the host tensor
            self._mark(out, host)
        return out

    def _target(self, name, args, kwargs):
        """The device an op is told to produce on (None: not told)."""
        if name == "to":
            if len(args) > 1 and isinstance(args[1], torch.Tensor):
                return "like", args[1]
            try:
                device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
            except (TypeError, RuntimeError):
                return None
            return None if device is None else ("device", device)
        if name == "cpu":
            return "device", torch.device("cpu")
        if kwargs.get("device") is not None:
            return "device", torch.device(kwargs["device"])
        return None

    def _result_is_host(self, func, name, args, kwargs, out):
        if not _tensors(out):
            return None
        target = self._target(name, args, kwargs)
        if target is not None:
            kind, value = target
            return self.is_host(value) if kind == "like" else value != self.device
        if name == "__getitem__":       # CUDA takes host index tensors
            inputs = [args[0]]
        elif name == "__setitem__":     # indices as above; the value must be on the device
            inputs = [args[0]] + _tensors(args[2:])
        elif name in ("copy_", "to"):   # copies cross devices
            inputs = [args[0]]
        else:
            inputs = _tensors((args, kwargs))
        if not inputs:
            return True                 # a factory without device=: host memory
        hosts = [self.is_host(t) for t in inputs if t.dim() > 0]
        if any(hosts) and not all(hosts):
            self._violation(f"{name or func} mixes host and device tensors")
        if hosts:
            return all(hosts)
        return all(self.is_host(t) for t in inputs)

    # ---- collectives and module inputs ---------------------------------------------------------------
    def _check(self, kind: str, what: str, tensors) -> None:
        self.checked[kind] += 1
        (self.collectives if kind == "collective" else self.modules).add(what)
        for t in tensors:
            if self.is_host(t):
                self._violation(f"host tensor {tuple(t.shape)} {t.dtype} into {kind} {what}")

    def _wrap_collective(self, name: str):
        orig = getattr(dist, name)

        def wrapped(*args, **kwargs):
            self._check("collective", name, _tensors((args, kwargs)))
            return orig(*args, **kwargs)

        wrapped.__name__ = name
        return orig, wrapped

    def __enter__(self):
        import torch.distributed.distributed_c10d as c10d

        for name in COLLECTIVES:
            if hasattr(dist, name):
                orig, wrapped = self._wrap_collective(name)
                for ns in (dist, c10d):  # P2POp checks its op against c10d's isend/irecv
                    if getattr(ns, name, None) is orig:
                        setattr(ns, name, wrapped)
                        self._undo.append((ns, name, orig))
        call = torch.nn.Module.__call__

        def module_call(module, *args, **kwargs):
            self._check("module", type(module).__name__, _tensors((args, kwargs)))
            return call(module, *args, **kwargs)

        torch.nn.Module.__call__ = module_call
        self._undo.append((torch.nn.Module, "__call__", call))
        for name in ("from_numpy", "frombuffer"):  # factories torch-function modes do not see: host memory
            orig = getattr(torch, name)
            setattr(torch, name, lambda *a, _orig=orig, **k: self.host(_orig(*a, **k)))
            self._undo.append((torch, name, orig))
        return super().__enter__()

    def __exit__(self, *exc):
        for ns, name, orig in reversed(self._undo):
            setattr(ns, name, orig)
        self._undo.clear()
        return super().__exit__(*exc)
