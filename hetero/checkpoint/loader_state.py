"""The data loader's resume state as JSON text: what a checkpoint stores instead of a pickle.

A checkpoint may come from someone else, and unpickling runs whatever code the pickle names; the common
state is loaded with torch.load(weights_only=True), and the loader state inside it must be as safe. So it
is stored as JSON text and read back by a decoder that builds only the types listed here.

energon 7.4's SavableDataLoader.save_state_rank() returns a SavableDataLoaderState. What it holds:
  - energon's state dataclasses: SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState,
    SystemRngState, SliceState (every State dataclass energon 7.4.1 defines; looked up here by name, never
    imported by a name the text gives);
  - FlexState (a dict subclass: every dataset's own state), dicts, lists, tuples, str, int, float, bool,
    None, bytes (a worker's torch.Generator state);
  - with worker processes, the global RNG states SystemRngState captures: a torch uint8 tensor, numpy's
    ("MT19937", uint32 array, pos, has_gauss, cached_gaussian) tuple and random.getstate()'s nested tuple.
Each maps to JSON losslessly: lists and the JSON scalars as themselves (Python's json writes floats with
repr, which reads back to the same float), everything else as a tagged object {"$": tag, ...}. Saving
anything else (a future energon with a new state type) raises TypeError naming the type, rather than
storing a state that would not restore exactly.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math

import numpy as np
import torch
from megatron.energon.flavors.webdataset.sample_loader import SliceState
from megatron.energon.rng import SystemRngState
from megatron.energon.savable_loader import SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState
from megatron.energon.state import FlexState

FORMAT, VERSION = "tessera-loader-state", 1
_STATES = {c.__name__: c for c in (SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState,
                                   SystemRngState, SliceState)}
_FIX = ("resume from a checkpoint written by this version of Tessera (it stores the loader state as JSON), "
        "or start the run afresh: trainer.resume=false or a new trainer.run_dir")


def encode_loader_state(state) -> str:
    """JSON text of a loader.save_state_rank() result; decode_loader_state(text) gives an equal state back."""
    return json.dumps({"format": FORMAT, "version": VERSION, "state": _enc(state, "state")},
                      allow_nan=False, separators=(",", ":"))


def decode_loader_state(text):
    """The loader state encode_loader_state wrote. Anything else (a pickle from an older Tessera or from
    someone else, malformed or unknown JSON) raises ValueError saying what is wrong and what to do."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        kind = "a pickle" if bytes(text[:1]) == b"\x80" else "binary data"
        raise ValueError(f"checkpoint loader state is {kind} ({len(text)} bytes), not Tessera's JSON loader "
                         f"state: refusing to load it, since unpickling a checkpoint can run arbitrary code; {_FIX}")
    if not isinstance(text, str):
        raise ValueError(f"checkpoint loader state is a {type(text).__name__}, not Tessera's JSON loader state "
                         f"(a str); {_FIX}")
    try:
        doc = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"checkpoint loader state is not valid JSON ({type(e).__name__}: {e}); {_FIX}") from None
    if not (isinstance(doc, dict) and doc.keys() == {"format", "version", "state"} and doc["format"] == FORMAT):
        raise ValueError(f"checkpoint loader state is JSON but not a {FORMAT!r} document; {_FIX}")
    if doc["version"] != VERSION:
        raise ValueError(f"checkpoint loader state has format version {doc['version']!r}; this Tessera reads "
                         f"version {VERSION}; {_FIX}")
    return _dec(doc["state"], "state")


def _no_constant(name):
    raise ValueError(f"bare {name} is not allowed")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _array(a: np.ndarray) -> dict:
    if a.dtype.kind not in "biufc" or a.dtype.fields is not None:
        raise TypeError(f"loader state holds an array of dtype {a.dtype}, which has no JSON form here")
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "v": _b64(a.tobytes())}


def _enc(x, path: str):
    if x is None or type(x) in (bool, int, str):
        return x
    if type(x) is float:
        return x if math.isfinite(x) else {"$": "float", "v": repr(x)}
    if type(x) is list:
        return [_enc(v, f"{path}[{i}]") for i, v in enumerate(x)]
    if type(x) is tuple:
        return {"$": "tuple", "v": [_enc(v, f"{path}[{i}]") for i, v in enumerate(x)]}
    if type(x) in (dict, FlexState):
        return {"$": type(x).__name__, "v": [[_enc(k, f"{path} key"), _enc(v, f"{path}[{k!r}]")]
                                              for k, v in x.items()]}
    if type(x) is bytes:
        return {"$": "bytes", "v": _b64(x)}
    if type(x) is np.ndarray:
        return {"$": "ndarray", **_array(x)}
    if isinstance(x, np.generic) and type(x).__module__ == "numpy":
        return {"$": "npscalar", **_array(np.asarray(x))}
    if type(x) is torch.Tensor:
        if x.layout != torch.strided or x.is_quantized or x.requires_grad:
            raise TypeError(f"loader state at {path} holds a tensor ({x.layout}, {x.dtype}) with no JSON form here")
        return {"$": "tensor", **_array(x.detach().cpu().numpy())}
    if _STATES.get(type(x).__name__) is type(x):
        return {"$": type(x).__name__,
                "v": {f.name: _enc(getattr(x, f.name), f"{path}.{f.name}") for f in dataclasses.fields(x)}}
    raise TypeError(f"loader state at {path} holds a {type(x).__module__}.{type(x).__qualname__}, which "
                    f"hetero/checkpoint/loader_state.py does not know how to store as JSON (a new energon state type?)")


def _bad(path: str, what: str):
    return ValueError(f"checkpoint loader state is malformed at {path}: {what}; {_FIX}")


def _arr(node: dict, path: str) -> np.ndarray:
    if node.keys() != {"$", "dtype", "shape", "v"}:
        raise _bad(path, f"{node['$']} needs exactly the keys dtype, shape, v")
    try:
        dtype = np.dtype(node["dtype"]) if isinstance(node["dtype"], str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biufc" or dtype.fields is not None:
        raise _bad(path, f"unsupported dtype {node['dtype']!r}")
    shape = node["shape"]
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise _bad(path, f"bad shape {shape!r}")
    data = _unb64(node["v"], path)
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise _bad(path, f"{len(data)} bytes for shape {shape} of {dtype}")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def _unb64(v, path: str) -> bytes:
    if not isinstance(v, str):
        raise _bad(path, "bytes must be a base64 string")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(path, "invalid base64") from None


def _dec(x, path: str):
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [_dec(v, f"{path}[{i}]") for i, v in enumerate(x)]
    if type(x) is not dict or not isinstance(x.get("$"), str):
        raise _bad(path, "an object without a type tag")
    tag = x["$"]
    if tag in ("ndarray", "tensor", "npscalar"):
        a = _arr(x, path)
        if tag == "npscalar" and a.ndim:
            raise _bad(path, "npscalar with a shape")
        return torch.from_numpy(a) if tag == "tensor" else a if tag == "ndarray" else a[()]
    if x.keys() != {"$", "v"}:
        raise _bad(path, f"{tag!r} needs exactly the keys $, v")
    v = x["v"]
    if tag == "float":
        if v not in ("nan", "inf", "-inf"):
            raise _bad(path, f"float {v!r}")
        return float(v)
    if tag == "bytes":
        return _unb64(v, path)
    if tag == "tuple":
        if type(v) is not list:
            raise _bad(path, "tuple needs a list")
        return tuple(_dec(e, f"{path}[{i}]") for i, e in enumerate(v))
    if tag in ("dict", "FlexState"):
        if not (type(v) is list and all(type(kv) is list and len(kv) == 2 for kv in v)):
            raise _bad(path, f"{tag} needs a list of [key, value] pairs")
        out = {} if tag == "dict" else FlexState()
        for k, e in v:
            k = _dec(k, f"{path} key")
            try:
                out[k] = _dec(e, f"{path}[{k!r}]")
            except TypeError:  # an unhashable key
                raise _bad(path, f"unhashable key {k!r}") from None
        return out
    cls = _STATES.get(tag)
    if cls is None:
        raise _bad(path, f"unknown type {tag!r} (only {', '.join(sorted(_STATES))} and plain data are accepted)")
    names = {f.name for f in dataclasses.fields(cls)}
    if type(v) is not dict or v.keys() != names:
        raise _bad(path, f"{tag} needs exactly the fields {sorted(names)}")
    return cls(**{k: _dec(e, f"{path}.{k}") for k, e in v.items()})

