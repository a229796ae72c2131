"""Measure the peak bytes of live CPU tensor storages on this rank.

There is no allocator peak counter on CPU (``torch.cuda.max_memory_allocated`` has no CPU
twin), so :class:`MemoryProbe` counts storages itself. It is a ``TorchDispatchMode``: every op
output whose storage it has not seen is added at the storage's ``nbytes()``, and a weak reference
to the storage takes it off again when the storage is freed. That works because an
``UntypedStorage`` keeps one Python object for as long as its C++ storage lives (PyObject
preservation, as for tensors): ``t.untyped_storage()`` returns the same object for ``t`` and all
its views, and a weakref callback on it fires exactly when the last tensor using it, including
a tensor saved by autograd, lets go. Peak = the largest current total seen after an allocation.

What it sees, and so what counts:

- Forward, backward (the autograd engine runs CPU backward on the thread that called
  ``backward()``, where the mode is active), optimizer steps (``_foreach_*`` kernels) and
  collectives' output buffers (``torch.empty`` and the c10d ops go through dispatch).
- Tensor subclasses (DTensor, FSDP2's sharded parameters): the mode steps aside so the subclass
  desugars into ops on its local tensors, and those local storages are counted. Metadata-only
  ops run by DTensor under its own ``FakeTensorMode`` are ignored.
- Storage resizes: FSDP2 frees an unsharded parameter with ``untyped_storage().resize_(0)`` and
  re-allocates it with ``resize_(n)``, which does not go through dispatch; while a probe is active
  ``torch.UntypedStorage.resize_`` is wrapped so the new size is re-read (a tracked storage changes
  size; an untracked one that grows from nothing is a new allocation). Tensor-level ``resize_``
  and ``set_`` do go through dispatch: the storages of their outputs are re-read after each op.
- ``baseline`` tensors (parameters, gradients, optimizer state, inputs: whatever is alive before
  the region) count from the start, each distinct storage once, for as long as they stay alive;
  an op writing into them in place adds nothing.

It measures what ``torch.distributed._tools.mem_tracker.MemTracker`` measures, and its peak
equals MemTracker's to the byte (tests/test_memory.py: eager MLP, GPT and TransformerEncoder;
FSDP2 and DTensor TP on 2 gloo ranks; graphpass data parallel), but it also works when a module
runs more than once per step (microbatches, pipeline schedules), where MemTracker raises. To run
both at once, enter the probe inside MemTracker: MemTracker wraps ``UntypedStorage.resize_``
with the function it saw when it was constructed, so a probe entered before it stops seeing
resizes while it is active.

Limits: memory that never surfaces as an op output is invisible: scratch buffers inside a
kernel, gloo's internal staging buffers (allocated on gloo's own threads), DDP's gradient
buckets (allocated in C++ at construction), allocator slack and fragmentation. Ops run on
another Python thread than the one that entered the probe are not seen either (dispatch modes
are thread-local); their frees are. A tensor alive before the region but not in ``baseline`` is
counted from the first time an op returns it (a view, an in-place write), so pass every
pre-existing tensor that matters in ``baseline``. Only CPU storages are counted.

Host memory on a machine without an accelerator (offload): the device is the host, so which
bytes are "on the device" is bookkeeping. Storages passed to :func:`mark_host` (the offload
runtime's master copies, gradients and saved activations in host memory) are host memory and
never counted, and neither is the output of an op whose tensor inputs are all host memory (the
optimizer stepping host-resident state allocates its state there): the peak is the emulated
device's. With nothing marked, every CPU storage counts, as before.

Use with a compiled :class:`graphpass.runtime.module.DistributedModule`::

    grads = [p.grad for p in dmodel.parameters() if p.grad is not None]
    baseline = list(dmodel.parameters()) + grads + optimizer_state_tensors(opt)
    with MemoryProbe(baseline=baseline) as probe:
        dmodel.train_step(*batch)
        opt.step()
    log.info("rank %d peak %.1f MiB", rank, probe.peak_bytes / 2**20)
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryProbe", "is_host", "mark_host", "measure_peak_bytes", "optimizer_state_tensors", "tensor_bytes"]

# Storages that stand for host memory (offload on a CPU-only machine): weak, so marking keeps
# nothing alive. An UntypedStorage keeps one Python object while it lives, so membership holds
# for every tensor and view on it.
_HOST: "weakref.WeakSet[torch.UntypedStorage]" = weakref.WeakSet()


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor``'s storage as host memory (offload): a :class:`MemoryProbe` does not count
    it, nor what ops on host tensors alone allocate. Returns ``tensor``."""
    if tensor.device.type == "cpu" and tensor.layout == torch.strided:
        storage = tensor.untyped_storage()
        if storage not in _HOST:
            _HOST.add(storage)
            for probe in list(_ACTIVE_PROBES):  # counted when it was allocated: not device memory after all
                probe._untrack(storage)
    return tensor


def is_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in host memory: on a machine with an accelerator, any CPU tensor;
    on a CPU-only one, a tensor :func:`mark_host` marked (the emulated device is the rest)."""
    if tensor.device.type != "cpu":
        return False
    if torch.cuda.is_available():
        return True
    try:
        return tensor.untyped_storage() in _HOST
    except (RuntimeError, NotImplementedError):
        return False


def _storages(t: torch.Tensor, fake: bool = False) -> Iterator[torch.UntypedStorage]:
    """The CPU storages behind ``t``: its own, or its inner tensors' for a wrapper subclass; with
    ``fake``, a fake tensor's (of any device) instead."""
    stack = [t]
    while stack:
        obj = stack.pop()
        if is_traceable_wrapper_subclass(obj):
            inner_names, _ = obj.__tensor_flatten__()
            inners = (getattr(obj, name) for name in inner_names)
            stack.extend(inner for inner in inners if isinstance(inner, torch.Tensor))
            continue
        if isinstance(obj, FakeTensor) != fake or (not fake and obj.device.type != "cpu") or obj.layout != torch.strided:
            continue
        try:
            yield obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            # Functional or otherwise storage-less tensors own no memory of their own.
            continue


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct CPU storages behind ``tensors``.

    Views and tensors sharing one storage count it once, at its full size; a DTensor counts its
    local shard. Non-tensors (e.g. ``None`` gradients) are skipped.
    """
    seen: dict[int, torch.UntypedStorage] = {}  # holding the storage keeps its id unique
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for storage in _storages(t):
                seen.setdefault(id(storage), storage)
    return sum(storage.nbytes() for storage in seen.values())


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in ``opt.state`` (momentum buffers, Adam moments, ``step`` counters)."""
    flat, _ = tree_flatten([dict(state) for state in opt.state.values()])
    return [value for value in flat if isinstance(value, torch.Tensor)]


# Ops that resize an argument's storage but whose schema does not mark it mutated (FSDP2 under
# torch.compile frees and re-allocates parameters with this one).
try:
    _STORAGE_RESIZING_OPS = {torch.ops.inductor.resize_storage_bytes_.default}
except (AttributeError, RuntimeError):  # a build without it
    _STORAGE_RESIZING_OPS = set()

# ``torch.UntypedStorage.resize_`` does not go through dispatch, so it is wrapped while any probe
# is active: one wrapper per stretch of time during which some probe is active, serving them all.
# When the last probe exits, the wrapper is taken out unless something else (e.g. a MemTracker
# entered inside the probe) has wrapped it since; then it stays in their chain, and only passes
# through, as it calls what it wrapped and no longer notifies.
_ACTIVE_PROBES: list["MemoryProbe"] = []
_PATCH_LOCK = threading.Lock()
_notifying_resize: Callable[..., Any] | None = None


def _install_resize_hook(probe: "MemoryProbe") -> None:
    global _notifying_resize
    with _PATCH_LOCK:
        if not _ACTIVE_PROBES:
            previous = torch.UntypedStorage.resize_

            @functools.wraps(previous)
            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                result = previous(storage, size)
                if _notifying_resize is resize_:
                    for active in list(_ACTIVE_PROBES):
                        active._on_storage_resized(storage)
                return result

            resize_.graphpass_previous = previous  # type: ignore[attr-defined]
            _notifying_resize = resize_
            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        _ACTIVE_PROBES.append(probe)


def _remove_resize_hook(probe: "MemoryProbe") -> None:
    global _notifying_resize
    with _PATCH_LOCK:
        _ACTIVE_PROBES.remove(probe)
        if not _ACTIVE_PROBES and _notifying_resize is not None:
            if torch.UntypedStorage.resize_ is _notifying_resize:
                torch.UntypedStorage.resize_ = _notifying_resize.graphpass_previous  # type: ignore
            _notifying_resize = None


class MemoryProbe(TorchDispatchMode):
    """Context manager: peak bytes of live CPU tensor storages while active.

    Args:
        baseline: Tensors alive before entering (parameters, gradients, optimizer state, inputs).
            Their distinct storages count from entry until they are freed. Not kept alive.
        fake: count fake tensors (of any device) instead of real CPU ones: a simulation of a
            region run under the ``FakeTensorMode`` that is active when the probe is entered
            (the planner's, on shapes only). Real tensors are then not counted.

    Attributes:
        peak_bytes: Max over the region of (baseline bytes + bytes of storages allocated in the
            region and still alive). Frozen at exit.
        current_bytes: That total now (frozen at exit).

    Entering again starts a fresh measurement from the same ``baseline`` (as it is then).
    """

    def __init__(self, baseline: Iterable[torch.Tensor] = (), *, fake: bool = False):
        super().__init__()
        self._fake = fake
        # Weak references only: the probe must not change what is alive.
        self._baseline: list[weakref.ref] = []
        for t in baseline:
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"MemoryProbe: baseline holds a {type(t).__name__}, expected tensors"
                )
            self._baseline.append(weakref.ref(t))
        self.peak_bytes = 0
        self.current_bytes = 0
        # id(storage) -> (weakref to the storage whose callback untracks it, its nbytes as counted)
        self._tracked: dict[int, tuple[weakref.ref, int]] = {}
        # Weakref callbacks run on whichever thread drops the last reference (gloo's, autograd's).
        self._lock = threading.RLock()
        self._fake_mode_on_entry: Any = None
        self._active = False

    # ---- bookkeeping --------------------------------------------------------------------------

    def _track(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` if new, else re-read its size (it may have been resized)."""
        if _HOST and storage in _HOST:
            return
        key = id(storage)
        with self._lock:
            entry = self._tracked.get(key)
            nbytes = storage.nbytes()
            if entry is None:
                ref = weakref.ref(storage, functools.partial(self._on_storage_freed, key))
                self._tracked[key] = (ref, nbytes)
                self._add(nbytes)
            elif entry[1] != nbytes:
                self._tracked[key] = (entry[0], nbytes)
                self._add(nbytes - entry[1])

    def _add(self, delta: int) -> None:
        self.current_bytes += delta
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes

    def _on_storage_freed(self, key: int, _ref: weakref.ref) -> None:
        with self._lock:
            entry = self._tracked.pop(key, None)
            if entry is not None:
                self.current_bytes -= entry[1]

    def _untrack(self, storage: torch.UntypedStorage) -> None:
        with self._lock:
            entry = self._tracked.pop(id(storage), None)
            if entry is not None:
                self.current_bytes -= entry[1]

    def _on_storage_resized(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type != "cpu" or active_fake_mode() is not self._fake_mode_on_entry:
            return
        with self._lock:
            if id(storage) in self._tracked or storage.nbytes() > 0:
                # Tracked: re-read. Untracked and now non-empty: allocated here (FSDP2 re-gather
                # into an unsharded parameter that was freed before the region began).
                self._track(storage)

    def reset_peak(self) -> None:
        """Set ``peak_bytes`` to ``current_bytes`` (e.g. between phases of a step)."""
        with self._lock:
            self.peak_bytes = self.current_bytes

    # ---- context manager ----------------------------------------------------------------------

    def __enter__(self) -> "MemoryProbe":
        if self._active:
            raise RuntimeError("MemoryProbe is already active; nest a second MemoryProbe instead")
        with self._lock:
            self._tracked.clear()
            self.current_bytes = 0
            self.peak_bytes = 0
            for ref in self._baseline:
                t = ref()
                if t is not None:
                    for storage in _storages(t, self._fake):
                        self._track(storage)
            self._fake_mode_on_entry = active_fake_mode()
            self._active = True
        _install_resize_hook(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _remove_resize_hook(self)
        with self._lock:
            self._active = False
            # Dropping the weakrefs also drops their callbacks: the figures stay as they were.
            self._tracked.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # `types` lists only tensor subclasses that override dispatch (empty for plain tensors).
        # Stepping aside lets a wrapper subclass such as DTensor run its own dispatch, which
        # re-enters this mode with the ops on its local tensors: those are what occupy memory.
        # FakeTensor (DTensor's shape propagation) is no wrapper and must not be stepped around:
        # nothing else would handle its op.
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if _HOST and not self._fake and _on_host(args, kwargs):
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    mark_host(value)
            return out
        # DTensor propagates shapes with ops on fake tensors under its own FakeTensorMode;
        # they allocate nothing.
        if active_fake_mode() is self._fake_mode_on_entry:
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    for storage in _storages(value, self._fake):
                        self._track(storage)
            schema = getattr(func, "_schema", None)  # higher-order ops have none
            if func in _STORAGE_RESIZING_OPS or (schema is not None and schema.is_mutable):
                # In-place and out= ops may change the size of an argument's storage without
                # returning it.
                for value in tree_flatten((args, kwargs))[0]:
                    if isinstance(value, torch.Tensor):
                        for storage in _storages(value, self._fake):
                            if id(storage) in self._tracked:
                                self._track(storage)
        return out


def _on_host(args: Any, kwargs: Any) -> bool:
    """Whether an op's tensor arguments are all (and at least one) host memory: it ran there."""
    tensors = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(is_host(t) for t in tensors)


def measure_peak_bytes(
    fn: Callable[..., Any], *args: Any, baseline: Iterable[torch.Tensor] = (), **kwargs: Any
) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` under a :class:`MemoryProbe`; return ``(result, peak_bytes)``."""
    with MemoryProbe(baseline=baseline) as probe:
        result = fn(*args, **kwargs)
    return result, probe.peak_bytes
