"""Gathered tensors that backward re-gathers instead of keeping.

A tensor that a collective assembled in forward — ZeRO-3's full weights, sequence parallelism's
all-gathered activation before the column linears — is cheap to rebuild from what every rank
keeps anyway (the weight shard, the sequence shard) and expensive to keep whole until its
backward. While :func:`rebuild_saved_tensors` is active (the step program enters it around
every forward), :func:`register` marks such tensors; a saved-tensor hook then replaces every
tensor autograd saves that lives in a marked storage by a small handle, and backward rebuilds
the group once, when it first needs it, for all the handles of that group.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch

from graphpass.runtime.fake import is_fake


class Rebuildable:
    """The tensors of one gather, how to gather them again, and the rebuilt cache."""

    def __init__(self, rebuild: Callable[[], Sequence[torch.Tensor]]):
        self.rebuild = rebuild
        self.outstanding = 0  # saved handles not yet unpacked
        self.cache: Sequence[torch.Tensor] | None = None

    def get(self, index: int) -> torch.Tensor:
        if self.cache is None:
            self.cache = self.rebuild()
        return self.cache[index]

    def release(self) -> None:
        self.outstanding -= 1
        if self.outstanding <= 0:
            self.cache = None


class _Registry:
    """Storages of live marked tensors (forward only), by data pointer."""

    def __init__(self) -> None:
        self.by_ptr: dict[int, tuple[Rebuildable, int, int]] = {}
        # while set: saved tensors that are not rebuilt go through it (a handle with unpack(),
        # or None to keep the tensor)
        self.spill: Callable[[torch.Tensor], Any] | None = None

    def add(self, tensor: torch.Tensor, group: Rebuildable, index: int) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        self.by_ptr[ptr] = (group, index, storage.nbytes())
        # Forget the pointer when the tensor dies: the allocator may hand the address to an
        # unrelated activation later, which must then be saved normally.
        weakref.finalize(tensor, self.by_ptr.pop, ptr, None)

    def lookup(self, tensor: torch.Tensor) -> tuple[Rebuildable, int] | None:
        if not self.by_ptr or tensor.layout != torch.strided or is_fake(tensor):
            return None
        storage = tensor.untyped_storage()
        entry = self.by_ptr.get(storage.data_ptr())
        if entry is None or entry[2] != storage.nbytes():
            return None
        return entry[0], entry[1]


_ACTIVE: list[_Registry] = []


class _Handle:
    """What autograd keeps instead of a view of a marked tensor."""

    __slots__ = ("group", "index", "size", "stride", "offset")

    def __init__(self, group: Rebuildable, index: int, t: torch.Tensor):
        self.group, self.index = group, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _pack(t: torch.Tensor) -> Any:
    registry = _ACTIVE[-1]
    found = registry.lookup(t)
    if found is None and registry.spill is not None:
        spilled = registry.spill(t)
        if spilled is not None:
            return spilled
    if found is None:
        # Not the tensor itself: a node saving its own output would then hold it through its
        # grad_fn, a cycle only a backward that runs the node breaks. The engine's split backward
        # (zero-bubble) never frees the nodes off the weight gradients' path: every microbatch's
        # saved outputs there stayed alive (116 MiB against 64 at m = 8 on bench/pipeline.py).
        return t.detach()
    group, index = found
    group.outstanding += 1
    return _Handle(group, index, t)


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    if not isinstance(packed, _Handle):
        return packed.unpack()
    full = packed.group.get(packed.index)
    packed.group.release()
    return full.as_strided(packed.size, packed.stride, packed.offset)


def forget(tensor: torch.Tensor) -> None:
    """Unmark ``tensor`` before its storage is freed while it lives on (a streamed parameter
    released after its last forward use): the address may be handed to another tensor, which
    must then be saved normally. Handles saved so far keep their rebuild."""
    if _ACTIVE and tensor.layout == torch.strided and not is_fake(tensor):
        _ACTIVE[-1].by_ptr.pop(tensor.untyped_storage().data_ptr(), None)


def current() -> "_Registry | None":
    """The registry of the forward running under :func:`rebuild_saved_tensors` (None outside)."""
    return _ACTIVE[-1] if _ACTIVE else None


def active() -> bool:
    """Whether a forward runs under :func:`rebuild_saved_tensors` (marking is worth it)."""
    return bool(_ACTIVE)


def register(tensors: Sequence[torch.Tensor], rebuild: Callable[[], Sequence[torch.Tensor]]) -> Rebuildable | None:
    """Mark ``tensors`` (one gather's outputs) as rebuilt by ``rebuild()`` when backward needs
    them (the group: its ``outstanding`` counts the handles autograd saved); a no-op outside
    :func:`rebuild_saved_tensors`."""
    if not _ACTIVE:
        return None
    group = Rebuildable(rebuild)
    for index, tensor in enumerate(tensors):
        _ACTIVE[-1].add(tensor, group, index)
    return group


@contextlib.contextmanager
def rebuild_saved_tensors() -> Iterator[None]:
    """While active, marked tensors saved for backward are rebuilt in backward instead."""
    _ACTIVE.append(_Registry())
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _ACTIVE.pop()
