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
- ``sparse.<key>.<state>``, ``sparse.steps``: the state of the sparse optimizer of the embedding
  tables a plan shards (:mod:`graphpass.runtime.sparse_optim`; laid out as the table, or one
  value per row), saved with the model, since the user's optimizer does not hold it;
- ``extra``: what the caller passed as ``extra`` on rank 0, encoded by :func:`encode_extra`.

Directory protocol (crash safety): a save writes ``<path>.partial`` and, once DCP has committed
its ``.metadata`` and graphpass its ``graphpass.json``, renames the previous ``<path>`` to
``<path>.old``, the new one to ``<path>``, and removes ``<path>.old``. A save killed at any point
leaves a complete checkpoint at ``<path>`` (or, killed between the two renames, at ``<path>.old``,
which :func:`load` then reads); a directory without ``graphpass.json`` is an incomplete save and
is refused.

Safe loading: DCP unpickles ``.metadata`` with plain ``pickle``; graphpass reads it with an
unpickler that admits only DCP's metadata classes, and reads byte entries with
``torch.load(weights_only=True)``, so a crafted checkpoint cannot run code. ``extra`` and the
param groups are encoded at save into what that loader admits (tagged dicts for numpy values,
dates, namespaces and dataclasses), so whatever :func:`save` accepts, :func:`load` reads back;
whatever cannot be encoded is refused before anything is written.

Integrity (format 2): ``graphpass.json`` records the size and CRC-32 of every file DCP wrote
(each rank sums its own files after writing them; rank 0 writes the record at commit) and the
optimizer's class; a load checks each file it reads, and the class, before using them. Every
failure of a save or load is a :class:`CheckpointError` naming the checkpoint, the file and the
cause, DCP's ``CheckpointException`` (a ``BaseException``) included. Format 1 checkpoints
(no sums, ``extra`` as saved) still load.
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
import logging
import zlib
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

from graphpass.runtime.checkpoint_extra import (  # noqa: F401  (SavedDataclass, SUPPORTED_EXTRA: re-exported)
    SUPPORTED_EXTRA,
    CheckpointError,
    SavedDataclass,
    decode_extra,
    encode_extra,
)
from graphpass.runtime.layout import HeldPieces

if TYPE_CHECKING:
    from graphpass.runtime.module import DistributedModule

FORMAT = 2  # 2: file sums, the optimizer's class path, extra and param groups encoded
MARKER = "graphpass.json"
METADATA = ".metadata"  # DCP's file name
MODEL, OPTIM, GROUPS, EXTRA = "model.", "optim.", "optim.param_groups", "extra"

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ pieces as DCP sees them


class _Pieces:
    """One key's local pieces in DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``): several rectangles per rank, from one or
    more local tensors (the slices of a split operator), which a DTensor (one chunk per rank)
    cannot describe, e.g. for fused tensor-parallel parts."""

    def __init__(self, entries: list[tuple[HeldPieces, torch.Tensor]]):
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
def _unwrapped(path: str | os.PathLike, doing: str) -> Iterator[None]:
    """DCP gathers each rank's exception into one ``CheckpointException``: a ``BaseException``
    (``except Exception`` misses it) whose message opens with ``ranks:dict_keys([0])`` and buries
    the cause in a formatted traceback. It is raised as a :class:`CheckpointError` naming the
    checkpoint, the rank that failed and its cause (graphpass's own errors, which name the file,
    as they are); the cause, where this process has it, is the error's ``__cause__``."""
    try:
        yield
    except CheckpointException as exc:
        error, cause = _from_dcp(exc, path, doing)
        raise error from cause


def _from_dcp(exc: CheckpointException, path: str | os.PathLike, doing: str) -> tuple[CheckpointError, BaseException]:
    failures = sorted(exc.failures.items())
    rank, failure = failures[0]
    inner, trace = failure if isinstance(failure, tuple) else (failure, None)
    where = ""
    if dist.is_initialized() and dist.get_world_size() > 1:
        others = [str(r) for r, _ in failures[1:]]
        where = f"rank {rank}{' (and ' + ', '.join(others) + ')' if others else ''}: "
    if isinstance(inner, CheckpointError):
        return CheckpointError(f"{where}{inner}"), inner
    cause = f"{type(inner).__name__}: {inner}"
    filename = getattr(inner, "filename", None)
    if filename and str(filename) not in cause:
        cause += f" (file {str(filename)!r})"
    if trace:
        cause += f"; raised at {trace[-1].filename}:{trace[-1].lineno} in {trace[-1].name}"
    return CheckpointError(f"{where}checkpoint {str(path)!r}: {doing} failed: {cause}"), inner


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
    def __init__(self, file: io.BufferedIOBase, path: pathlib.Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed_globals()
        if (module, name) not in allowed:
            raise CheckpointError(
                f"{str(self.path)!r}: the checkpoint metadata refers to {module}.{name}, which is not "
                "one of DCP's metadata types; graphpass does not unpickle it (it could run code). "
                "Load only checkpoints you trust with plain torch.distributed.checkpoint."
            )
        return allowed[(module, name)]


# Files are summed in pieces of this size: 8 MiB keeps the buffer small and zlib's per-call
# overhead negligible (CRC-32 runs at about 4 GB/s here: 27 ms for 100 MB in memory).
_CHUNK_BYTES = 8 << 20


def file_record(path: str | os.PathLike) -> dict[str, Any]:
    """``{"bytes": size, "crc32": "8 hex digits"}`` of the file at ``path``, as ``graphpass.json``
    records each file of a checkpoint."""
    crc, size = 0, 0
    view = memoryview(bytearray(_CHUNK_BYTES))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"bytes": size, "crc32": f"{crc:08x}"}


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by :class:`_MetadataUnpickler`, each file checked
    against the size and CRC-32 that ``graphpass.json`` recorded (``files``; None for a format 1
    checkpoint, which has none) before it is used, and a failure to read a file named."""

    def __init__(self, path: str | os.PathLike, files: Mapping[str, Mapping[str, Any]] | None = None):
        super().__init__(str(path))
        self.files = files
        self._checked: set[str] = set()
        self._reading: Any = None  # the _StorageInfo of the entry being read

    @property
    def where(self) -> str:
        return f"checkpoint {str(self.path)!r}"

    def check_file(self, name: str) -> None:
        """Raise a :class:`CheckpointError` unless file ``name`` has the size and sum recorded."""
        if self.files is None or name in self._checked:
            return
        saved = self.files.get(name)
        if saved is None:
            raise CheckpointError(f"{self.where}: file {name!r} is not one of the files {MARKER} records; "
                                  "the checkpoint was changed after the save")
        try:
            found = file_record(pathlib.Path(self.path) / name)
        except OSError as exc:
            raise CheckpointError(f"{self.where}: file {name!r} cannot be read: {exc}") from exc
        if found["bytes"] != saved["bytes"]:
            raise CheckpointError(
                f"{self.where}: file {name!r} is {found['bytes']} bytes but {saved['bytes']} were written: "
                f"it was {'truncated or replaced' if found['bytes'] < saved['bytes'] else 'changed'} after "
                "the save; load an earlier checkpoint"
            )
        if found["crc32"] != saved["crc32"]:
            raise CheckpointError(
                f"{self.where}: file {name!r} does not have the CRC-32 recorded at save ({found['crc32']}, "
                f"not {saved['crc32']}): its bytes changed after the save (a bad disk or copy); load an "
                "earlier checkpoint"
            )
        self._checked.add(name)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Unpickled (by the allow-list, so nothing runs) before the sum is checked: a crafted file
        # is refused as such, a damaged one named by its sum where it has one.
        path = pathlib.Path(self.path) / METADATA
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f, path).load()
        except CheckpointError:
            raise
        except Exception as exc:  # UnpicklingError, EOFError, ... of a damaged or truncated file
            self.check_file(METADATA)
            raise CheckpointError(
                f"{self.where}: DCP's metadata file {str(path)!r} cannot be read ({type(exc).__name__}: "
                f"{exc}): it is damaged or truncated; load an earlier checkpoint"
            ) from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{str(path)!r} does not hold DCP metadata (found {type(metadata).__name__})")
        for info in (metadata.storage_data or {}).values():
            # DCP opens <checkpoint>/<relative_path>: keep crafted entries inside the checkpoint.
            where = pathlib.PurePath(str(getattr(info, "relative_path", "")))
            if where.is_absolute() or ".." in where.parts:
                raise CheckpointError(f"{path} names the data file {str(where)!r} outside the checkpoint; refused")
        self.check_file(METADATA)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            self.check_file(name)
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except Exception as exc:
            raise self._read_error(exc) from exc

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self._reading = sinfo  # DCP slices each entry out of its file just before reading it
        return super()._slice_file(file, sinfo)

    def _read_error(self, exc: Exception) -> CheckpointError:
        cause = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        sinfo = self._reading
        if (isinstance(exc, OSError) and exc.filename) or sinfo is None:
            return CheckpointError(f"{self.where}: a data file cannot be read: {cause}")
        entry = next((index.fqn for index, info in self.storage_data.items() if info is sinfo), "?")
        end = sinfo.offset + sinfo.length
        try:
            size = os.path.getsize(pathlib.Path(self.path) / sinfo.relative_path)
        except OSError:
            size = end
        hint = f"; the file is {size} bytes and this entry ends at byte {end}: it is truncated" if size < end else ""
        return CheckpointError(
            f"{self.where}: data file {sinfo.relative_path!r} (entry {entry!r}, bytes {sinfo.offset}-{end}) "
            f"cannot be read: {cause}{hint}"
        )


# ------------------------------------------------------------------ directory protocol


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it "assumes the intent" of a single-process save or load; here it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _on_every_rank(step: Callable[[], Any], *, gather: bool = False) -> Any:
    """Run ``step`` on every rank and agree on the outcome: when it raised on any rank, every rank
    raises (that rank its own error, the others a :class:`CheckpointError` naming the first rank
    that failed), so that no rank goes on into a collective its peers have left. The exchange is
    also the ranks' barrier. With ``gather``, every rank gets the list of the ranks' results."""
    error, result = None, None
    try:
        result = step()
    except Exception as exc:  # any: a rank that raised past the exchange would leave its peers waiting
        error = exc
    said: list = [(None if error is None else f"{type(error).__name__}: {error}", result if gather else None)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        said = [None] * dist.get_world_size()
        dist.all_gather_object(said, (None if error is None else f"{type(error).__name__}: {error}",
                                      result if gather else None))
        first = next(((rank, text) for rank, (text, _) in enumerate(said) if text is not None), None)
        if error is None and first is not None:
            raise CheckpointError(f"rank {first[0]} failed: {first[1]}")
    if error is not None:
        raise error
    return [result for _, result in said] if gather else result


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
    with open(partial / MARKER, "w") as f:  # on disk before the renames make it the checkpoint
        f.write(json.dumps(info, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(partial, path)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------ state

Entries = Sequence[tuple[HeldPieces, torch.Tensor]]


def _by_key(entries: Entries) -> dict[str, list[tuple[HeldPieces, torch.Tensor]]]:
    out: dict[str, list[tuple[HeldPieces, torch.Tensor]]] = {}
    for layout, tensor in entries:
        out.setdefault(layout.key, []).append((layout, tensor))
    return out


def _optimizer_layouts(optimizer: torch.optim.Optimizer, entries: Entries) -> list[list[HeldPieces]]:
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
    per_key: dict[str, list[tuple[HeldPieces, torch.Tensor]]] = {}
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
    sparse: tuple[dict[str, list], dict[str, torch.Tensor]] | None = None,
) -> pathlib.Path:
    """Write a checkpoint (every rank calls it; see the module docstring for the protocol).

    Args:
        entries: (layout, local tensor) of each parameter and buffer this rank holds.
        unplaced: key -> tensor for state no rank's program reads (written whole).
        optimizer: over the local tensors of ``entries``, or None.
        extra: saved from rank 0, encoded by :func:`encode_extra`.
        info: written to ``graphpass.json`` (plan, world size) beside the format, the optimizer's
            class and each file's size and CRC-32.
        sparse: the sharded embedding tables' optimizer state
            (:meth:`graphpass.runtime.sparse_optim.SparseStep.checkpoint_entries`), or None.

    Raises:
        CheckpointError: ``extra`` or the param groups hold a value that cannot be saved safely
            (before anything is written), ``path`` is not a graphpass checkpoint, or writing
            failed (DCP's error, with the rank and cause); the previous checkpoint at ``path``
            stays as it was.
    """
    path = pathlib.Path(path)
    partial = path.with_name(path.name + ".partial")

    def prepare() -> dict[str, Any]:
        # Everything that can refuse the save runs before anything is written or removed.
        state: dict[str, Any] = {MODEL + k: _Pieces(v) for k, v in _by_key(entries).items()}
        state.update({MODEL + k: t.detach() for k, t in unplaced.items()})
        if sparse is not None:
            state.update({k: _Pieces(v) for k, v in sparse[0].items()})
            state.update(sparse[1])
        try:
            if optimizer is not None:
                state.update(_optimizer_state(optimizer, entries))
                state[GROUPS] = encode_extra(_hyper_parameters(optimizer), "optimizer.param_groups")
            if _rank() == 0 and extra is not None:
                state[EXTRA] = encode_extra(extra)
        except CheckpointError as exc:
            raise CheckpointError(f"gp.save to {str(path)!r}: {exc}") from None
        _check_target(path)
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        return state

    state = _on_every_rank(prepare)
    writer = _Writer(partial)
    with _quiet_single_process(), _unwrapped(path, f"saving (into {str(partial)!r})"):
        dcp.save(state, storage_writer=writer, planner=_SavePlanner(), no_dist=not dist.is_initialized())

    def sum_files() -> dict[str, dict[str, Any]]:
        # Each rank sums the files it wrote (DCP has fsynced them); rank 0 also DCP's .metadata,
        # which it wrote last as the coordinator.
        names = writer.written_files() + ([METADATA] if _rank() == 0 else [])
        return {name: file_record(partial / name) for name in names}

    files: dict[str, dict[str, Any]] = {}
    for rank_files in _on_every_rank(sum_files, gather=True):
        files.update(rank_files)
    info = {"format": FORMAT, "torch": torch.__version__, "optimizer": _class_path(optimizer), **(info or {}),
            "files": files}
    _on_every_rank(lambda: _commit(path, partial, info) if _rank() == 0 else None)
    return path


class _Writer(FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        self._results = super().write_data(plan, planner)
        return self._results

    def written_files(self) -> list[str]:
        results = self._results.value() if hasattr(self, "_results") else []
        return sorted({result.storage_data.relative_path for result in results})


def _class_path(obj: Any) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def read_info(path: pathlib.Path) -> dict[str, Any]:
    """The ``graphpass.json`` of the complete checkpoint directory ``path``.

    Raises:
        CheckpointError: the file is damaged or from a newer graphpass.
    """
    file = path / MARKER
    try:
        info = json.loads(file.read_text())
        if not isinstance(info, dict) or not isinstance(info.get("format"), int):
            raise ValueError(f"expected an object with an integer 'format', found {str(info)[:80]!r}")
    except (OSError, ValueError) as exc:  # json.JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"checkpoint {str(path)!r}: {str(file)!r} cannot be read ({type(exc).__name__}: "
                              f"{exc}): it is damaged; load an earlier checkpoint") from exc
    if info["format"] > FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r} has format {info['format']} ({str(file)!r}); this "
                              f"graphpass reads formats up to {FORMAT}: update graphpass")
    return info


def _decoded(value: Any, info: Mapping[str, Any], where: str) -> Any:
    """``extra`` or the param groups as saved: encoded from format 2 on, as they were before."""
    return decode_extra(value, where) if info["format"] >= 2 else value


def _check_optimizer(info: Mapping[str, Any], optimizer: torch.optim.Optimizer | None, path: pathlib.Path) -> None:
    saved, mine = info.get("optimizer"), _class_path(optimizer)
    if optimizer is None or saved is None:
        return
    # Format 1 recorded the class name alone; the name is compared, not the module, so that a
    # class that moved between modules (torch.optim.adamw.AdamW) still matches.
    if saved.rsplit(".", 1)[-1] != type(optimizer).__qualname__.rsplit(".", 1)[-1]:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds the state of a {saved} optimizer ({MARKER}), and this "
            f"optimizer is a {mine}: its state and settings would not fit (another class fails at "
            f"opt.step()). Build the optimizer with class {saved.rsplit('.', 1)[-1]} over "
            "dmodel.parameters(), or pass optimizer=None to load the model alone"
        )


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
    sparse: tuple[dict[str, list], dict[str, torch.Tensor]] | None = None,
) -> Any:
    """Read a checkpoint into this rank's tensors and ``optimizer`` (and the sharded tables'
    optimizer state into ``sparse``'s tensors, where the checkpoint has it); returns the saved
    ``extra``.

    ``expected`` is every key of the model that a checkpoint holds (also those held only by
    other pipeline stages), to tell a checkpoint of another model from this rank's partial read.
    """
    fresh: dict[int, dict[str, torch.Tensor]] = {}  # id(param) -> state name -> tensor read into

    def prepare() -> tuple[pathlib.Path, dict[str, Any], _SafeReader, dict[str, Any]]:
        # Each rank checks the tensors it holds (a pipeline stage its own): agreed on below.
        found = resolve(path)
        info = read_info(found)
        _check_optimizer(info, optimizer, found)
        reader = _SafeReader(found, info.get("files"))
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
        if sparse is not None:
            state.update(_sparse_state(sparse, metadata, found))
        if EXTRA in metadata.state_dict_metadata:
            state[EXTRA] = None
        return found, info, reader, state

    path, info, reader, state = _on_every_rank(prepare)
    with _quiet_single_process(), _unwrapped(path, "loading"):
        dcp.load(state, storage_reader=reader, planner=_LoadPlanner(), no_dist=not dist.is_initialized())

    def restore() -> Any:
        if optimizer is not None:
            groups = _decoded(state[GROUPS], info, "optimizer.param_groups")
            _restore_optimizer(optimizer, fresh, groups, path)
        return _decoded(state.get(EXTRA), info, "extra")

    return _on_every_rank(restore)


def _sparse_state(sparse: tuple[dict[str, list], dict[str, torch.Tensor]], metadata: Metadata,
                  path: pathlib.Path) -> dict[str, Any]:
    """What to read of the sharded tables' optimizer state: all of it, none where the
    checkpoint has none (saved with the tables dense: the state starts anew), and an error
    where it holds another optimizer's."""
    pieces, scalars = sparse
    saved = {k for k in metadata.state_dict_metadata if k.startswith("sparse.")}
    wanted = set(pieces) | set(scalars)
    if not saved:
        log.warning("checkpoint %s holds no sparse optimizer state (its embedding tables were not sharded): the "
                    "tables' optimizer state starts anew", path)
        return {}
    if not wanted <= saved:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds the embedding tables' optimizer state {sorted(saved)[:3]}, which lacks "
            f"{sorted(wanted - saved)[:3]}: it was saved with another Plan.embedding_optimizer; load it with the same "
            "kind of sparse optimizer")
    return {**{k: _Pieces(v) for k, v in pieces.items()}, **scalars}


def _fresh_optimizer_state(optimizer: torch.optim.Optimizer, entries: Entries, metadata: Metadata,
                           fresh: dict[int, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Tensors to read each saved optimizer state into, laid out as their parameter on this rank."""
    per_key: dict[str, list[tuple[HeldPieces, torch.Tensor]]] = {}
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
    try:
        optimizer.load_state_dict(sd)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: its optimizer state does not load into this "
                              f"{type(optimizer).__name__}: {type(exc).__name__}: {exc}") from exc


def save(dmodel: "DistributedModule", optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
         extra: Any = None) -> pathlib.Path:
    """Save ``dmodel``'s parameters and buffers and ``optimizer``'s state to directory ``path``.

    Every rank calls it (a collective); each writes its own pieces. ``extra`` (rank 0's) is what
    to keep with the checkpoint to resume: step count, data position, scheduler state, RNG states
    (``torch``, ``random``, ``numpy``), the run's ``argparse.Namespace`` or config dataclass, a
    ``datetime``; what it may hold is :data:`SUPPORTED_EXTRA`, and :func:`load` returns it without
    running code (dataclasses as :class:`SavedDataclass`). The checkpoint loads under any plan and
    world size (:func:`load`) and into the plain model (:func:`load_into`).

    Raises:
        CheckpointError: ``extra`` holds a value of another type (named with its place, e.g.
            ``extra['cfg'].lr``, before anything is written), ``path`` exists and is not a
            graphpass checkpoint, or writing failed (the rank, the file and the cause named); the
            previous checkpoint at ``path`` stays as it was.
        ValueError: ``optimizer`` holds tensors that are not ``dmodel``'s parameters.
    """
    dmodel.flush_cache()  # the tables' pending writes applied: the checkpoint holds every update
    if dmodel.plan.grad_compression is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning("gp.save: the plan's compressed gradient buckets (%s) keep their error feedback (and PowerSGD "
                    "its Q) on the ranks, not in the checkpoint: a run resumed from it starts them afresh, so it "
                    "does not continue the uninterrupted run's trajectory exactly", dmodel.plan.grad_compression)
    outer = getattr(dmodel, "outer_sync", None)
    if outer is not None:
        outer.flush()  # an outer step due after the last train step runs now
        if outer.pending:
            raise CheckpointError(
                f"gp.save under DiLoCo after {outer.pending} inner steps of {outer.diloco.inner_steps}: the workers' "
                "parameters differ until the next outer step; save after a multiple of "
                f"{outer.diloco.inner_steps} train steps")
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("gp.save: DiLoCo's outer momentum is not in the checkpoint: a run resumed from it starts "
                        "the outer optimizer afresh")
    entries, unplaced, _ = dmodel.checkpoint_state()
    info = {"world_size": dist.get_world_size() if dist.is_initialized() else 1, "mesh": dict(dmodel.plan.mesh)}
    with torch.no_grad():
        return save_state(entries, unplaced, optimizer, path, extra=extra, info=info,
                          sparse=_sparse_entries(dmodel, entries))


def _sparse_entries(dmodel: "DistributedModule", entries: Entries):
    """The sharded tables' optimizer state as a checkpoint holds it, or None without one."""
    sparse = dmodel.sparse_optimizer
    if sparse is None:
        return None
    by_tensor = {id(tensor): layout for layout, tensor in entries}
    return sparse.checkpoint_entries({target: by_tensor[id(shard)] for target, shard in sparse.shards.items()})


def load(dmodel: "DistributedModule", optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> Any:
    """Load a checkpoint saved by :func:`save` under any plan and world size into ``dmodel`` and
    ``optimizer`` (built over ``dmodel.parameters()``, with the same param groups); returns the
    ``extra`` it was saved with. Every rank calls it.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: an incomplete save, a file that is damaged, truncated or changed since
            the save (the file named), a checkpoint of another model (keys or shapes named) or of
            another optimizer class (both named), no optimizer state where ``optimizer`` is given,
            or metadata that would run code.
    """
    entries, unplaced, expected = dmodel.checkpoint_state()
    sparse = _sparse_entries(dmodel, entries)
    with torch.no_grad():
        extra = load_state(entries, unplaced, expected, optimizer, path, sparse)
    if sparse is not None:
        dmodel.sparse_optimizer.loaded()
    if getattr(dmodel, "outer_sync", None) is not None:  # DiLoCo starts from the loaded weights
        dmodel.outer_sync.reset()
    if dmodel.plan.grad_compression is not None:  # error feedback and Q start afresh, as gp.save warned
        from graphpass.runtime.compressed_sync import forget
        forget(dmodel.parameters())
    return extra


def load_into(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a graphpass checkpoint's model state into the plain single-device ``model``, in this
    process alone (no process group needed); the optimizer state stays in the checkpoint."""
    path = resolve(path)
    reader = _SafeReader(path, read_info(path).get("files"))
    metadata = reader.read_metadata()
    full = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for key, t in full.items():
        first.setdefault(id(t), key)
    whole = {k: t.detach() for k, t in full.items() if first[id(t)] == k}  # tied weights: saved once
    _check_model_keys(metadata, {k: tuple(t.shape) for k, t in whole.items()}, path)
    with torch.no_grad(), _quiet_single_process(), _unwrapped(path, "loading"):
        dcp.load({MODEL + k: t for k, t in whole.items()}, storage_reader=reader, planner=_LoadPlanner(),
                 no_dist=True)


def read(path: str | os.PathLike) -> dict[str, Any]:
    """Every entry of a checkpoint, whole, in this process (for inspection and export): the
    ``model.*`` and ``optim.*`` tensors, ``optim.param_groups`` and ``extra`` (decoded)."""
    path = resolve(path)
    info = read_info(path)
    reader = _SafeReader(path, info.get("files"))
    reader.read_metadata()  # raises here, not wrapped in DCP's per-rank exception
    state: dict[str, Any] = {}
    # dcp.load copies back only the keys the caller's dict had; DCP's own dcp_to_torch_save calls
    # _load_state_dict to get the rebuilt dict, as here.
    with _unwrapped(path, "reading"):
        _load_state_dict(state, storage_reader=reader, planner=_WholeLoadPlanner(), no_dist=True)
    for key, where in ((EXTRA, "extra"), (GROUPS, "optimizer.param_groups")):
        if key in state:
            state[key] = _decoded(state[key], info, where)
    return state
