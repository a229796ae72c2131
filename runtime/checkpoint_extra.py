"""What a checkpoint's ``extra`` may hold, encoded at save into what ``torch.load(weights_only=True)``
reads back, and decoded at load: the resume metadata people keep with a checkpoint round-trips
without the loader running any code named by the file.

:func:`encode_extra` keeps plain values, tensors, lists, tuples and dicts as they are, turns the
values that plain pickling would store by reference to a class (numpy arrays and scalars, dates,
paths, sets, ``argparse.Namespace``, ``types.SimpleNamespace``, dataclasses) into dicts tagged with
:data:`TAG`, and refuses anything else, naming its place (``extra['cfg'].lr``) and its type.
:func:`decode_extra` rebuilds each tagged node from a fixed table of standard-library and numpy
types; a dataclass comes back as a :class:`SavedDataclass` (its fields and class name), never by
importing its class, since that would run code the checkpoint names::

    {"step": 7, "when": datetime(2025, 1, 2), "rng": np.random.get_state()}
    # encoded:
    {"step": 7, "when": {TAG: "datetime.datetime", "iso": "2025-01-02T00:00:00"},
     "rng": ("MT19937", {TAG: "numpy.ndarray", "dtype": "<u4", "shape": [624], "data": b"..."}, 624, 0, 0.0)}
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import pathlib
import sys
import types
from typing import Any

import torch
import torch.nn as nn


# Defined here, below runtime/checkpoint.py, which raises it too and re-exports it (gp.CheckpointError).
class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded here: incomplete, damaged, unsafe, of another
    model or optimizer, or a value in ``extra`` that cannot be saved safely. The message names
    the checkpoint, the file and the cause."""


#: The key that marks an encoded node; a user dict holding it is itself encoded.
TAG = "__graphpass__"
#: Saved as they are: ``torch.load(weights_only=True)`` reads these back (exact types only: a
#: subclass, e.g. ``numpy.float64`` of ``float`` or an ``IntEnum`` of ``int``, would be pickled by
#: reference to its class, which that loader refuses).
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.Size)
_KEYS = (type(None), bool, int, float, str, bytes)
_PATHS = {cls.__name__: cls for cls in (pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath,
                                        pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath)}
#: numpy dtype kinds saved as raw bytes: bool, integers, floats, complex, datetime64, timedelta64.
_NUMPY_KINDS = "biufcmM"
SUPPORTED_EXTRA = (
    "None, bool, int, float, complex, str, bytes; torch tensors, dtypes, devices and sizes; dict, "
    "OrderedDict, list, tuple, set, frozenset; numpy arrays and scalars of numbers, bools and "
    "dates; datetime, date, time, timedelta; pathlib paths; argparse.Namespace, "
    "types.SimpleNamespace and dataclass instances (read back as SavedDataclass)"
)


class SavedDataclass(types.SimpleNamespace):
    """A dataclass instance saved in ``extra``, as :func:`load` returns it: its fields as
    attributes (``vars(saved)`` gives them as a dict), the class it was saved from in
    ``dataclass_name`` (``"module.QualName"``).

    graphpass does not import and call the class again: that runs code named by the checkpoint.
    Where the class is trusted, ``MyConfig(**vars(saved))`` rebuilds it (nested dataclasses come
    back as ``SavedDataclass`` too). Saving it again saves it under the same name.
    """

    __slots__ = ("dataclass_name",)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"SavedDataclass[{self.dataclass_name}]({fields})"


def _attribute(where: str, name: str) -> str:
    return f"{where}.{name}" if name.isidentifier() else f"getattr({where}, {name!r})"


def _check_key(key: Any, where: str) -> None:
    """Dict keys and set members are saved as they are, so they must be plain (and hashable)."""
    if type(key) is tuple:
        for part in key:
            _check_key(part, where)
    elif type(key) not in _KEYS:
        raise CheckpointError(
            f"{where} has a key or member {key!r} of type {_type_name(key)}; keys and set "
            "members in extra must be str, int, float, bool, None, bytes or tuples of these. "
            "Nothing was written"
        )


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def encode_extra(value: Any, where: str = "extra") -> Any:
    """``value`` as a tree that ``torch.load(weights_only=True)`` reads back without running code:
    plain values and tensors as they are, numpy values, dates, paths, sets, namespaces and
    dataclasses as dicts tagged with :data:`TAG`. :func:`decode_extra` inverts it.

    Raises:
        CheckpointError: ``value`` holds something else (a function, a module, an instance of
            another class, a tensor subclass, a cycle); the message names its place, e.g.
            ``extra['cfg'].lr``, and its type.
    """
    return _encode(value, where, set())


def _encode(value: Any, where: str, open_: set[int]) -> Any:
    cls = type(value)
    if cls in _PLAIN:
        return value
    if cls in (torch.Tensor, nn.Parameter):
        return value
    if id(value) in open_:
        raise CheckpointError(f"{where} contains itself; extra must be a tree. Nothing was written")
    open_.add(id(value))
    try:
        return _encode_node(value, cls, where, open_)
    finally:
        open_.discard(id(value))


def _encode_node(value: Any, cls: type, where: str, open_: set[int]) -> Any:
    if cls in (dict, collections.OrderedDict):
        for key in value:
            _check_key(key, where)
        items = {k: _encode(v, f"{where}[{k!r}]", open_) for k, v in value.items()}
        if cls is dict and TAG not in items:
            return items
        return {TAG: cls.__name__, "items": list(items.items())}
    if cls is list:
        return [_encode(v, f"{where}[{i}]", open_) for i, v in enumerate(value)]
    if cls is tuple:  # e.g. random.getstate(), np.random.get_state()
        return tuple(_encode(v, f"{where}[{i}]", open_) for i, v in enumerate(value))
    if cls in (set, frozenset):
        for item in value:
            _check_key(item, where)
        return {TAG: cls.__name__, "items": list(value)}
    if cls in (datetime.datetime, datetime.date, datetime.time):
        return {TAG: f"datetime.{cls.__name__}", "iso": value.isoformat()}
    if cls is datetime.timedelta:
        return {TAG: "datetime.timedelta", "days": value.days, "seconds": value.seconds,
                "microseconds": value.microseconds}
    if cls.__name__ in _PATHS and _PATHS[cls.__name__] is cls:
        return {TAG: "pathlib", "class": cls.__name__, "path": str(value)}
    if cls in (argparse.Namespace, types.SimpleNamespace):
        return {TAG: f"{cls.__module__}.{cls.__name__}",
                "attrs": {k: _encode(v, _attribute(where, k), open_) for k, v in vars(value).items()}}
    if cls is SavedDataclass or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        if cls is SavedDataclass:
            name, fields = value.dataclass_name, vars(value)
        else:
            name = f"{cls.__module__}.{cls.__qualname__}"
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {TAG: "dataclass", "class": name,
                "fields": {k: _encode(v, _attribute(where, k), open_) for k, v in fields.items()}}
    np = sys.modules.get("numpy")
    if np is not None and (cls is np.ndarray or isinstance(value, np.generic)):
        if value.dtype.kind not in _NUMPY_KINDS or value.dtype.fields is not None:
            raise CheckpointError(
                f"{where} is a numpy {'array' if cls is np.ndarray else 'scalar'} of dtype "
                f"{value.dtype}, which graphpass cannot save safely (only numbers, bools and dates: "
                f"dtype kinds {_NUMPY_KINDS!r}); convert it (e.g. .tolist()). Nothing was written"
            )
        if cls is np.ndarray:
            return {TAG: "numpy.ndarray", "dtype": value.dtype.str, "shape": list(value.shape),
                    "data": np.ascontiguousarray(value).tobytes()}
        return {TAG: "numpy.scalar", "dtype": value.dtype.str, "data": value.tobytes()}
    raise CheckpointError(
        f"{where} is a {_type_name(value)}, which graphpass cannot save so that gp.load "
        f"reads it back without running code. extra may hold: {SUPPORTED_EXTRA}. Convert it "
        "(e.g. to a dict, its state_dict() or str) before saving. Nothing was written"
    )


def decode_extra(node: Any, where: str = "extra") -> Any:
    """The value :func:`encode_extra` encoded (dataclasses as :class:`SavedDataclass`)."""
    cls = type(node)
    if cls is list:
        return [decode_extra(v, f"{where}[{i}]") for i, v in enumerate(node)]
    if cls is tuple:
        return tuple(decode_extra(v, f"{where}[{i}]") for i, v in enumerate(node))
    if cls is not dict:
        return node
    if TAG not in node:
        return {k: decode_extra(v, f"{where}[{k!r}]") for k, v in node.items()}
    tag = node[TAG]
    try:
        return _decode_tagged(tag, node, where)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{where}: cannot decode a saved {tag!r} ({type(exc).__name__}: {exc})") from exc


def _decode_tagged(tag: str, node: dict, where: str) -> Any:
    if tag in ("dict", "OrderedDict"):
        items = ((k, decode_extra(v, f"{where}[{k!r}]")) for k, v in node["items"])
        return dict(items) if tag == "dict" else collections.OrderedDict(items)
    if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(node["items"])
    if tag in ("datetime.datetime", "datetime.date", "datetime.time"):
        return getattr(datetime, tag.split(".")[1]).fromisoformat(node["iso"])
    if tag == "datetime.timedelta":
        return datetime.timedelta(days=node["days"], seconds=node["seconds"], microseconds=node["microseconds"])
    if tag == "pathlib":
        return _PATHS[node["class"]](node["path"])
    if tag in ("argparse.Namespace", "types.SimpleNamespace"):
        cls = argparse.Namespace if tag == "argparse.Namespace" else types.SimpleNamespace
        return cls(**{k: decode_extra(v, _attribute(where, k)) for k, v in node["attrs"].items()})
    if tag == "dataclass":
        saved = SavedDataclass()
        vars(saved).update({k: decode_extra(v, _attribute(where, k)) for k, v in node["fields"].items()})
        saved.dataclass_name = node["class"]
        return saved
    if tag in ("numpy.ndarray", "numpy.scalar"):
        import numpy as np

        dtype = np.dtype(node["dtype"])
        if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
            raise CheckpointError(f"{where}: a saved numpy value of dtype {dtype}, which graphpass does not read")
        flat = np.frombuffer(node["data"], dtype=dtype)
        return flat.reshape(node["shape"]).copy() if tag == "numpy.ndarray" else flat[0]
    raise CheckpointError(
        f"{where}: a saved value tagged {tag!r}, which this graphpass does not know (saved by a newer one?)"
    )
