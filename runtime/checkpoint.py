"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP) that load under any plan.

Every rank writes its own pieces of each tensor (:mod:`graphpass.runtime.layout`) under the
original ``model.state_dict()`` key; nothing is gathered to one rank. DCP records where each piece
sits in the full tensor, so a load under another plan or world size reads, for each of its own
pieces, the overlapping parts of whatever pieces were saved. Replicated tensors are written once
(DCP deduplicates identical pieces across ranks); ZeRO padding rows are never written.

Keys in the checkpoint (flat, so ``dcp_to_torch_save`` gives a readable dict too):

- ``model.<key>``: parameters and buffers (tied weights under their first key);
- ``optim.<key>.<state>``: each optimizer state of the parameter saved as ``model.<key>``
  (momentum buffers, Adam moments: laid out as the parameter; step counts: whole);
- ``optim.param_groups``: the hyper-parameters of each group, its parameters named by key;
- ``extra``: what the caller passed as ``extra`` on rank 0 (plain containers and tensors).

Directory protocol (crash safety): a save writes ``<path>.partial`` and, once DCP has committed
its ``.metadata`` and graphpass its ``graphpass.json``, renames the previous ``<path>`` to
``<path>.old``, the new one to ``<path>``, and removes ``<path>.old``. A save killed at any point
leaves a complete checkpoint at ``<path>`` (or, killed between the two renames, at ``<path>.old``,
which :func:`load` then reads); a directory without ``graphpass.json`` is an incomplete save and
is refused.

Safe loading: DCP unpickles ``.metadata`` with plain ``pickle``; graphpass reads it with an
unpickler that admits only DCP's metadata classes, and reads byte entries with
``torch.load(weights_only=True)``, so a crafted checkpoint cannot run code.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pathlib
import pickle
import shutil
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from graphpass.runtime.layout import Layout

if TYPE_CHECKING:
    from graphpass.runtime.module import DistributedModule

FORMAT = 1
MARKER = "graphpass.json"
MODEL, OPTIM, GROUPS, EXTRA = "model.", "optim.", "optim.param_groups", "extra"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded here: incomplete, unsafe, or of another model."""


# ------------------------------------------------------------------ pieces as DCP sees them


class _Pieces:
    """One key's local pieces in DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``): several rectangles per rank, from one or
    more local tensors (the slices of a split operator), which a DTensor (one chunk per rank)
    cannot describe, e.g. for fused tensor-parallel parts."""

    def __init__(self, entries: list[tuple[Layout, torch.Tensor]]):
        self.shape = torch.Size(entries[0][0].shape)
        self.pieces = [(piece, view) for layout, tensor in entries
                       for piece, view in zip(layout.pieces, layout.views(tensor.detach()))]

    def size(self) -> torch.Size:  # DCP compares it with the saved size before reading
        return self.shape

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(piece.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=torch.Size(piece.sizes)),
                    properties=TensorProperties.create_from_tensor(view),
                    size=self.shape,
                ),
            )
            for piece, view in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes)) for p, _ in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.pieces):
            piece, view = self.pieces[index.index]
            if tuple(piece.offsets) == tuple(index.offset):
                return view
        for piece, view in self.pieces:
            if tuple(piece.offsets) == tuple(index.offset):
                return view
        raise CheckpointError(f"{index.fqn!r}: this rank holds no piece at offset {tuple(index.offset)}")


def _lookup(state_dict: Mapping[str, Any], index: MetadataIndex) -> Any:
    obj = state_dict[index.fqn]
    if isinstance(obj, _Pieces):
        return obj.__get_tensor_shard__(index)
    return obj


class _SavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        # DCP's own set-up materialises meta tensors and turns values of types it does not know
        # (our pieces) into None; graphpass's tensors are never on the meta device.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = _safe_torch_load(value, read_item.dest_index.fqn)


class _WholeLoadPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds every entry whole from the metadata, reading bytes safely."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = _safe_torch_load(value, read_item.dest_index.fqn)


def _safe_torch_load(value: io.BytesIO, key: str) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        said = [line.strip() for line in str(exc).splitlines() if "Unsupported global" in line]
        raise CheckpointError(
            f"checkpoint entry {key!r} holds objects other than tensors and plain containers, which "
            f"graphpass does not unpickle (it could run code){': ' + said[0] if said else ''}"
        ) from None


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    """DCP gathers each rank's exception into one ``CheckpointException``; graphpass's own errors
    (unsafe entries) are raised as themselves."""
    try:
        yield
    except CheckpointException as exc:
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointError):
                raise inner from None
        raise


# ------------------------------------------------------------------ safe metadata


@functools.lru_cache(maxsize=None)
def _allowed_globals() -> dict[tuple[str, str], Any]:
    import torch.distributed.checkpoint.filesystem as filesystem
    import torch.distributed.checkpoint.metadata as metadata
    import torch.serialization

    allowed = {("torch.distributed.checkpoint.metadata", name): getattr(metadata, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("pathlib", "WindowsPath")] = pathlib.WindowsPath
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed_globals()
        if (module, name) not in allowed:
            raise CheckpointError(
                f"checkpoint metadata refers to {module}.{name}, which is not one of DCP's metadata "
                "types; graphpass does not unpickle it (it could run code). Load only checkpoints "
                "you trust with plain torch.distributed.checkpoint."
            )
        return allowed[(module, name)]


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = pathlib.Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata (found {type(metadata).__name__})")
        for info in (metadata.storage_data or {}).values():
            # DCP opens <checkpoint>/<relative_path>: keep crafted entries inside the checkpoint.
            where = pathlib.PurePath(str(getattr(info, "relative_path", "")))
            if where.is_absolute() or ".." in where.parts:
                raise CheckpointError(f"{path} names the data file {str(where)!r} outside the checkpoint; refused")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


# ------------------------------------------------------------------ directory protocol


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it "assumes the intent" of a single-process save or load; here it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _on_every_rank(step: Callable[[], Any]) -> Any:
    """Run ``step`` on every rank and agree on the outcome: when it raised on any rank, every rank
    raises (that rank its own error, the others a :class:`CheckpointError` naming the first rank
    that failed), so that no rank goes on into a collective its peers have left. The exchange is
    also the ranks' barrier."""
    error, result = None, None
    try:
        result = step()
    except (CheckpointError, OSError, ValueError) as exc:  # FileNotFoundError is an OSError
        error = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        said: list = [None] * dist.get_world_size()
        dist.all_gather_object(said, None if error is None else f"{type(error).__name__}: {error}")
        first = next(((rank, text) for rank, text in enumerate(said) if text is not None), None)
        if error is None and first is not None:
            raise CheckpointError(f"rank {first[0]} failed: {first[1]}")
    if error is not None:
        raise error
    return result


def _is_complete(path: pathlib.Path) -> bool:
    return (path / MARKER).is_file() and (path / ".metadata").is_file()


def resolve(path: str | os.PathLike) -> pathlib.Path:
    """The complete checkpoint directory ``path`` names: ``path`` itself, or ``<path>.old`` when a
    save was killed between its two renames.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: ``path`` is an incomplete save (no ``graphpass.json``) or not a
            graphpass checkpoint.
    """
    path = pathlib.Path(path)
    if _is_complete(path):
        return path
    old = path.with_name(path.name + ".old")
    if not path.exists() and _is_complete(old):
        return old
    if path.is_dir():
        what = ("an incomplete save (DCP's .metadata is there, graphpass.json is not: the save was "
                "interrupted after writing)" if (path / ".metadata").is_file() else
                "not a complete checkpoint (no .metadata and no graphpass.json: an interrupted save, "
                "or a directory that is not a checkpoint)")
        raise CheckpointError(f"checkpoint {str(path)!r} is {what}; load an earlier checkpoint")
    partial = path.with_name(path.name + ".partial")
    hint = f" ({str(partial)!r} is an interrupted save, not loadable)" if partial.exists() else ""
    raise FileNotFoundError(f"no checkpoint at {str(path)!r}{hint}")


def _check_target(path: pathlib.Path) -> None:
    if path.exists() and not _is_complete(path) and any(path.iterdir()):
        raise CheckpointError(
            f"save path {str(path)!r} exists and is not a complete graphpass checkpoint; graphpass "
            "replaces only its own checkpoints: pick another path or remove it"
        )


def _commit(path: pathlib.Path, partial: pathlib.Path, info: Mapping[str, Any]) -> None:
    (partial / MARKER).write_text(json.dumps(info, indent=1, sort_keys=True))
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(partial, path)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------ state

Entries = Sequence[tuple[Layout, torch.Tensor]]


def _by_key(entries: Entries) -> dict[str, list[tuple[Layout, torch.Tensor]]]:
    out: dict[str, list[tuple[Layout, torch.Tensor]]] = {}
    for layout, tensor in entries:
        out.setdefault(layout.key, []).append((layout, tensor))
    return out


def _optimizer_layouts(optimizer: torch.optim.Optimizer, entries: Entries) -> list[list[Layout]]:
    """The layout of each parameter of each of ``optimizer``'s groups."""
    layout_of = {id(t): layout for layout, t in entries}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        layouts = []
        for p in group["params"]:
            if id(p) not in layout_of:
                raise ValueError(
                    f"optimizer.param_groups[{g}] holds a tensor of shape {tuple(p.shape)} that is not "
                    "a parameter of this compiled model; build the optimizer over dmodel.parameters()"
                )
            layouts.append(layout_of[id(p)])
        groups.append(layouts)
    return groups


def _optimizer_state(optimizer: torch.optim.Optimizer, entries: Entries) -> dict[str, Any]:
    """``optim.<key>.<state>`` -> what DCP writes: pieces laid out as the parameter, or a scalar."""
    per_key: dict[str, list[tuple[Layout, torch.Tensor]]] = {}
    scalars: dict[str, torch.Tensor] = {}
    for group, layouts in zip(optimizer.param_groups, _optimizer_layouts(optimizer, entries)):
        for p, layout in zip(group["params"], layouts):
            for name, value in optimizer.state.get(p, {}).items():
                fqn = f"{OPTIM}{layout.key}.{name}"
                if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) == layout.local:
                    per_key.setdefault(fqn, []).append((layout, value))
                elif isinstance(value, torch.Tensor) and value.numel() == 1:
                    scalars[fqn] = value.detach()
                else:
                    raise NotImplementedError(
                        f"optimizer state {name!r} of {layout.key!r} is a {type(value).__name__} of shape "
                        f"{tuple(getattr(value, 'shape', ()))}, neither laid out as the parameter "
                        f"(local shape {layout.local}) nor a scalar tensor; graphpass checkpoints only "
                        "per-element and scalar optimizer states"
                    )
    return {**{k: _Pieces(v) for k, v in per_key.items()}, **scalars}


def _hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's settings without its parameters (groups match by position; the parameters of
    a group differ from rank to rank under pipeline stages)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def save_state(
    entries: Entries,
    unplaced: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike,
    *,
    extra: Any = None,
    info: Mapping[str, Any] | None = None,
) -> pathlib.Path:
    """Write a checkpoint (every rank calls it; see the module docstring for the protocol).

    Args:
        entries: (layout, local tensor) of each parameter and buffer this rank holds.
        unplaced: key -> tensor for state no rank's program reads (written whole).
        optimizer: over the local tensors of ``entries``, or None.
        extra: saved from rank 0; plain containers, numbers, strings and tensors.
        info: written to ``graphpass.json`` (plan, world size).
    """
    path = pathlib.Path(path)
    partial = path.with_name(path.name + ".partial")

    def prepare() -> None:
        _check_target(path)
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)

    _on_every_rank(prepare)
    state: dict[str, Any] = {MODEL + k: _Pieces(v) for k, v in _by_key(entries).items()}
    state.update({MODEL + k: t.detach() for k, t in unplaced.items()})
    if optimizer is not None:
        state.update(_optimizer_state(optimizer, entries))
        state[GROUPS] = _hyper_parameters(optimizer)
    if _rank() == 0 and extra is not None:
        state[EXTRA] = extra
    with _quiet_single_process():
        dcp.save(state, storage_writer=FileSystemWriter(partial), planner=_SavePlanner(),
                 no_dist=not dist.is_initialized())
    info = {"format": FORMAT, "torch": torch.__version__, **(info or {})}
    _on_every_rank(lambda: _commit(path, partial, info) if _rank() == 0 else None)
    return path


def _check_model_keys(metadata: Metadata, shapes: Mapping[str, tuple[int, ...] | None], path: pathlib.Path) -> None:
    """``shapes``: every key of the model -> its full shape (None where this rank does not know it)."""
    saved = {k[len(MODEL):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith(MODEL)}
    missing = [k for k in shapes if k not in saved]
    unexpected = [k for k in saved if k not in shapes]
    if missing or unexpected:
        said = []
        if missing:
            said.append(f"{len(missing)} of the model's keys are not in it ({', '.join(missing[:5])}"
                        f"{', ...' if len(missing) > 5 else ''})")
        if unexpected:
            said.append(f"{len(unexpected)} of its keys are not in the model ({', '.join(unexpected[:5])}"
                        f"{', ...' if len(unexpected) > 5 else ''})")
        raise CheckpointError(f"checkpoint {str(path)!r} is not of this model: {'; '.join(said)}")
    for key, shape in shapes.items():
        md = saved[key]
        if shape is not None and isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {key!r} has shape {tuple(md.size)} there but {tuple(shape)} in "
                "this model (another model size or configuration?)"
            )


def load_state(
    entries: Entries,
    unplaced: Mapping[str, torch.Tensor],
    expected: Sequence[str],
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike,
) -> Any:
    """Read a checkpoint into this rank's tensors and ``optimizer``; returns the saved ``extra``.

    ``expected`` is every key of the model that a checkpoint holds (also those held only by
    other pipeline stages), to tell a checkpoint of another model from this rank's partial read.
    """
    fresh: dict[int, dict[str, torch.Tensor]] = {}  # id(param) -> state name -> tensor read into

    def prepare() -> tuple[pathlib.Path, _SafeReader, dict[str, Any]]:
        # Each rank checks the tensors it holds (a pipeline stage its own): agreed on below.
        found = resolve(path)
        reader = _SafeReader(str(found))
        metadata = reader.read_metadata()
        shapes: dict[str, tuple[int, ...] | None] = {k: None for k in expected}
        shapes.update({layout.key: layout.shape for layout, _ in entries})
        shapes.update({k: tuple(t.shape) for k, t in unplaced.items()})
        _check_model_keys(metadata, shapes, found)
        state: dict[str, Any] = {MODEL + k: _Pieces(v) for k, v in _by_key(entries).items()}
        state.update({MODEL + k: t.detach() for k, t in unplaced.items()})
        if optimizer is not None:
            if GROUPS not in metadata.state_dict_metadata:
                raise CheckpointError(
                    f"checkpoint {str(found)!r} has no optimizer state (it was saved with optimizer=None); "
                    "pass optimizer=None to load only the model"
                )
            state.update(_fresh_optimizer_state(optimizer, entries, metadata, fresh))
            state[GROUPS] = None
        if EXTRA in metadata.state_dict_metadata:
            state[EXTRA] = None
        return found, reader, state

    path, reader, state = _on_every_rank(prepare)
    with _quiet_single_process(), _unwrapped():
        dcp.load(state, storage_reader=reader, planner=_LoadPlanner(), no_dist=not dist.is_initialized())
    if optimizer is not None:
        _restore_optimizer(optimizer, fresh, state[GROUPS], path)
    return state.get(EXTRA)


def _fresh_optimizer_state(optimizer: torch.optim.Optimizer, entries: Entries, metadata: Metadata,
                           fresh: dict[int, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Tensors to read each saved optimizer state into, laid out as their parameter on this rank."""
    per_key: dict[str, list[tuple[Layout, torch.Tensor]]] = {}
    scalars: dict[str, torch.Tensor] = {}
    for group, layouts in zip(optimizer.param_groups, _optimizer_layouts(optimizer, entries)):
        for p, layout in zip(group["params"], layouts):
            prefix = f"{OPTIM}{layout.key}."
            for fqn, md in metadata.state_dict_metadata.items():
                if not fqn.startswith(prefix) or "." in fqn[len(prefix):] or not isinstance(md, TensorStorageMetadata):
                    continue
                if len(md.size) and tuple(md.size) == tuple(layout.shape):
                    value = torch.zeros(layout.local, dtype=md.properties.dtype, device=p.device)
                    per_key.setdefault(fqn, []).append((layout, value))
                else:
                    value = torch.zeros(md.size, dtype=md.properties.dtype)
                    scalars[fqn] = value
                fresh.setdefault(id(p), {})[fqn[len(prefix):]] = value
    return {**{k: _Pieces(v) for k, v in per_key.items()}, **scalars}


def _restore_optimizer(optimizer: torch.optim.Optimizer, fresh: Mapping[int, dict[str, torch.Tensor]],
                       groups: list[dict], path: pathlib.Path) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {str(path)!r} has {len(groups)} optimizer param groups, this optimizer "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups"
        )
    sd = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in sd["param_groups"] for i in group["params"]]
    sd["state"] = {i: dict(fresh[id(p)]) for i, p in zip(ids, params) if id(p) in fresh}
    sd["param_groups"] = [{**saved, "params": mine["params"]} for mine, saved in zip(sd["param_groups"], groups)]
    optimizer.load_state_dict(sd)


def save(dmodel: "DistributedModule", optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
         extra: Any = None) -> pathlib.Path:
    """Save ``dmodel``'s parameters and buffers and ``optimizer``'s state to directory ``path``.

    Every rank calls it (a collective); each writes its own pieces. ``extra`` (rank 0's) is any
    plain value to keep with the checkpoint: step count, data position, RNG state tensors.
    The checkpoint loads under any plan and world size (:func:`load`) and into the plain model
    (:func:`load_into`).

    Raises:
        CheckpointError: ``path`` exists and is not a graphpass checkpoint.
        ValueError: ``optimizer`` holds tensors that are not ``dmodel``'s parameters.
    """
    entries, unplaced, _ = dmodel.checkpoint_state()
    info = {"world_size": dist.get_world_size() if dist.is_initialized() else 1, "mesh": dict(dmodel.plan.mesh),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None}
    with torch.no_grad():
        return save_state(entries, unplaced, optimizer, path, extra=extra, info=info)


def load(dmodel: "DistributedModule", optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> Any:
    """Load a checkpoint saved by :func:`save` under any plan and world size into ``dmodel`` and
    ``optimizer`` (built over ``dmodel.parameters()``, with the same param groups); returns the
    ``extra`` it was saved with. Every rank calls it.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: an incomplete save, a checkpoint of another model (keys or shapes named),
            no optimizer state where ``optimizer`` is given, or metadata that would run code.
    """
    entries, unplaced, expected = dmodel.checkpoint_state()
    with torch.no_grad():
        return load_state(entries, unplaced, expected, optimizer, path)


def load_into(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a graphpass checkpoint's model state into the plain single-device ``model``, in this
    process alone (no process group needed); the optimizer state stays in the checkpoint."""
    path = resolve(path)
    reader = _SafeReader(str(path))
    metadata = reader.read_metadata()
    full = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for key, t in full.items():
        first.setdefault(id(t), key)
    whole = {k: t.detach() for k, t in full.items() if first[id(t)] == k}  # tied weights: saved once
    _check_model_keys(metadata, {k: tuple(t.shape) for k, t in whole.items()}, path)
    with torch.no_grad(), _quiet_single_process(), _unwrapped():
        dcp.load({MODEL + k: t for k, t in whole.items()}, storage_reader=reader, planner=_LoadPlanner(),
                 no_dist=True)


def read(path: str | os.PathLike) -> dict[str, Any]:
    """Every entry of a checkpoint, whole, in this process (for inspection and export): the
    ``model.*`` and ``optim.*`` tensors, ``optim.param_groups`` and ``extra``."""
    path = resolve(path)
    reader = _SafeReader(str(path))
    reader.read_metadata()  # raises here, not wrapped in DCP's per-rank exception
    state: dict[str, Any] = {}
    # dcp.load copies back only the keys the caller's dict had; DCP's own dcp_to_torch_save calls
    # _load_state_dict to get the rebuilt dict, as here.
    with _unwrapped():
        _load_state_dict(state, storage_reader=reader, planner=_WholeLoadPlanner(), no_dist=True)
    return state
