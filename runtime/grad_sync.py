"""Data-parallel gradient synchronisation, once per step, written as graph nodes.

DDP's algorithm as graph ops (inserted only by ``graphpass.passes.collectives``)::

    sync = grad_sync_begin("dp")                     # backward runs last: waits, writes .grad
    w2_, b2_ = all_reduce_grads(sync, w2, b2, ...)   # backward: launch async all-reduce of one
    w1_, b1_ = all_reduce_grads(sync, w1, b1, ...)   #   flat bucket as soon as its grads exist

so communication of late layers overlaps the backward of early layers, as in DDP.

A step may run the graph several times (gradient accumulation; later, pipeline microbatches).
The step program (:mod:`graphpass.runtime.step`) opens one :class:`Accumulation` per stage
program for the whole step and says, before each backward, whether it is that program's last in
the step. Buckets (and ZeRO-1 groups, :mod:`graphpass.runtime.zero`) add their gradients into
the accumulation's buffers on the other backwards and reduce once, on the last one, overlapped
with it — DDP's ``no_sync``. ZeRO-2/3 groups reduce-scatter on every backward instead and sum
the shards, so gradient memory stays sharded through the step (DeepSpeed's choice for those
stages); the cost model prices both as they run.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime import rank_progress
from graphpass.runtime.fake import is_fake


class Accumulation:
    """One step's microbatches of one stage program, as gradient synchronisation sees them.

    Attributes:
        num_microbatches: forwards (and backwards) of the program in this step.
        last_backward: whether the backward about to run is the program's last of the step;
            the step program sets it before every backward.
        buffers: gradients held back from communication, per bucket or group (keyed by the id
            of its first parameter), summed over the backwards run so far. A bucket holds them
            in the flat buffer its ``.grad`` become views of, so accumulating costs no memory
            beyond the gradients themselves.
        gathered: ZeRO-1/2 weights gathered by the first forward, kept for the step's others
            (they do not change within a step), keyed like ``buffers``.
    """

    def __init__(self, num_microbatches: int = 1):
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.num_microbatches = num_microbatches
        self.last_backward = True
        self.buffers: dict[int, torch.Tensor] = {}
        self.gathered: dict[int, tuple[torch.Tensor, ...]] = {}

    def held(self, key: torch.Tensor) -> torch.Tensor | None:
        """The gradients held back so far for ``key``'s group (its first parameter), or None."""
        return self.buffers.get(id(key))

    def hold(self, key: torch.Tensor, flat: torch.Tensor) -> None:
        """Hold ``flat`` back as ``key``'s group's gradients until the step's last backward."""
        self.buffers[id(key)] = flat

    def release(self, key: torch.Tensor) -> torch.Tensor | None:
        """The held-back gradients of ``key``'s group (forgotten here), or None."""
        return self.buffers.pop(id(key), None)


_ACCUMULATIONS: list[Accumulation] = []


@contextlib.contextmanager
def accumulating(accumulation: Accumulation) -> Iterator[Accumulation]:
    """Make ``accumulation`` the one forwards run in this context synchronise through."""
    _ACCUMULATIONS.append(accumulation)
    try:
        yield accumulation
    finally:
        _ACCUMULATIONS.pop()


def current_accumulation() -> Accumulation:
    """The active accumulation; a one-microbatch one when no step program runs the graph."""
    return _ACCUMULATIONS[-1] if _ACCUMULATIONS else Accumulation(1)


class GradSync:
    """State shared by one ``grad_sync_begin`` node and its ``all_reduce_grads`` buckets.

    One object per forward call: buckets append their in-flight all-reduces in backward; the
    begin node's backward (which autograd runs after every bucket's) waits for them and writes
    each parameter's ``.grad``. ``accumulation`` is the step's, taken when the forward runs.
    """

    #: Reductions allowed in flight at once. An async collective keeps its input alive until it
    #: is waited on; ZeRO's reduce-scatter inputs are full-size gradient buffers, so without a
    #: cap every layer's would be alive at the end of backward (measured: +128 MiB, the whole
    #: model, on a 33.6M-parameter MLP with ZeRO-3 on 2 ranks). FSDP2 caps this the same way.
    MAX_IN_FLIGHT = 2

    def __init__(self, axis: str, token: torch.Tensor):
        self.axis = axis
        self.token = token
        self.accumulation = current_accumulation()
        self.pending: list[list[Any]] = []  # [work or None once waited, output, params]

    def add(self, work: Any, out: torch.Tensor, params: tuple[torch.Tensor, ...]) -> None:
        """Register an in-flight reduction whose ``out`` holds ``params``' gradients (flat)."""
        self.pending.append([work, out, params])
        for entry in self.pending:  # two-phase reductions (HSDP's) launch their second phase when they can
            if entry[0] is not None and hasattr(entry[0], "advance"):
                entry[0].advance()
        in_flight = [entry for entry in self.pending if entry[0] is not None]
        for entry in in_flight[: -self.MAX_IN_FLIGHT]:
            entry[0].wait()
            entry[0] = None  # drop the work object, and with it the reduction's input buffer

    def finish(self) -> None:
        """Wait for every bucket's reduction and accumulate the results into ``.grad``."""
        pending, self.pending = self.pending, []
        for work, flat, params in pending:
            if work is not None:
                work.wait()
            offset = 0
            for p in params:
                grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad += grad
                landed = _LANDED.get(p)
                if landed is not None:
                    landed(p)


# parameter -> called once its synchronised gradient is in .grad (offload sends it to the host)
_LANDED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def when_grad_lands(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Call ``hook(param)`` each time a synchronised gradient is written into ``param.grad``
    (autograd's own accumulation has ``register_post_accumulate_grad_hook``)."""
    _LANDED[param] = hook


class _SyncBegin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, leaf: torch.Tensor, sync_box: list) -> torch.Tensor:
        ctx.sync_box = sync_box
        return leaf.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.sync_box[0].finish()
        return None, None


def grad_sync_begin(axis: str) -> GradSync:
    """Open a gradient synchronisation over ``axis`` for this forward call.

    Returns a :class:`GradSync` whose token every ``all_reduce_grads`` bucket consumes, so the
    backward of this node runs after all buckets have launched their all-reduces. Its value is
    not a tensor: the emitter marks the node so (``gp.value_kind``).
    """
    leaf = torch.zeros((), requires_grad=True)
    box: list = [None]
    token = _SyncBegin.apply(leaf, box)
    sync = GradSync(axis, token)
    box[0] = sync
    return sync


# One flat buffer per gradient bucket, kept between steps and keyed by the bucket's first
# parameter (weakly, so it dies with the model). Allocating a fresh multi-MiB buffer every step
# is what made the bucket copy slow: glibc serves such sizes with a new mmap each time, and the
# copy then page-faults on every 4 KiB page (torch.cat of a 17 MB bucket here: 7.5 ms into a
# fresh buffer, 1.4 ms into a reused one; DDP likewise keeps its buckets for the whole run).
_BUCKET_BUFFERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The number of references a buffer's storage has when nothing but the cache holds it, measured
# rather than assumed; None where torch lacks the (private) counter, and then nothing is reused.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(t: torch.Tensor) -> int:
    return _storage_use_count(t.untyped_storage()._cdata)  # type: ignore[misc]


def _reusable_buffer(key: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The bucket's buffer from an earlier step, if it fits and nothing else still uses it.

    Gradients are handed out as views of the buffer, so it is reused only once every view (and
    anything derived from one) is gone, e.g. after ``optimizer.zero_grad()`` (set_to_none). If the
    caller keeps ``.grad`` (accumulation, ``zero_grad(set_to_none=False)``) or a reference to it,
    this step gets a fresh buffer and the old gradients are left untouched.
    """
    entry = _BUCKET_BUFFERS.get(key)
    if entry is None:
        return None
    buffer, idle_count = entry
    if buffer.numel() != numel or buffer.dtype != dtype or _use_count(buffer) != idle_count:
        return None
    return buffer


def resident_buffers(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient buckets' flat buffers kept between steps for buckets led by ``params``
    (DDP keeps its buckets alike): memory the ranks hold all the time, which a memory probe
    should count from the start of a region."""
    out = []
    for param in params:
        entry = _BUCKET_BUFFERS.get(param)
        if entry is not None:
            out.append(entry[0])
    return out


def _remember_buffer(key: torch.Tensor, buffer: torch.Tensor) -> None:
    if _storage_use_count is not None:
        _BUCKET_BUFFERS[key] = (buffer, _use_count(buffer))


class _AllReduceGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token: torch.Tensor, sync: GradSync, scale: float | None, bucket: int, reducer: Any,
                *params: torch.Tensor):
        ctx.sync = sync
        ctx.scale = scale
        ctx.bucket = bucket
        ctx.reducer = reducer
        # Held directly, not via save_for_backward: under saved-tensor hooks (ZeRO-3 re-gather)
        # autograd would hand back new tensor objects, and .grad must land on the real leaves.
        ctx.params = params
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        params = ctx.params
        sync: GradSync = ctx.sync
        pieces = [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)]
        done = (torch.zeros((), dtype=torch.float32), None, None, None, None) + (None,) * len(params)
        accumulation = sync.accumulation
        flat = accumulation.held(params[0])
        if flat is None:  # the step's first backward for this bucket: into the bucket's buffer
            numel = sum(piece.numel() for piece in pieces)
            dtype = functools.reduce(torch.promote_types, (piece.dtype for piece in pieces))
            flat = _reusable_buffer(params[0], numel, dtype)
            if flat is not None:
                torch.cat(pieces, out=flat)
            else:
                flat = torch.cat(pieces)
                _remember_buffer(params[0], flat)
        else:  # a later microbatch: summed into the held-back buffer, in place
            offset = 0
            for piece in pieces:
                flat[offset : offset + piece.numel()].add_(piece)
                offset += piece.numel()
        if not accumulation.last_backward:
            accumulation.hold(params[0], flat)  # reduced once, with the step's last backward
            return done
        accumulation.release(params[0])
        mesh = mesh_lib.current()
        group = mesh.group(sync.axis)
        work = None
        # Average over the batch axes, as DDP does (the loss is a mean over the global batch,
        # split evenly); sum over tensor-parallel axes (partial gradients): ``ctx.scale``. An
        # expert weight's group may be one rank (ep = dp) that still divides by dp.
        factor = ctx.scale if ctx.scale is not None else 1.0 / mesh.axis_size(sync.axis)
        if factor != 1.0:
            flat.mul_(factor)
        if group is not None:
            rank_progress.enter("all_reduce_grads bucket", ctx.bucket)
            # a compressed bucket's reducer (graphpass.runtime.compressed_sync) runs its own rounds
            work = (dist.all_reduce(flat, group=group, async_op=True) if ctx.reducer is None
                    else ctx.reducer.start(flat, params, group))
        sync.add(work, flat, params)
        return done


def all_reduce_grads(
    sync: GradSync, *params: torch.Tensor, bucket: int = 0, scale: float | None = None
) -> tuple[torch.Tensor, ...]:
    """Identity on ``params`` in forward; in backward, all-reduce their gradients as one bucket
    (on the step's last backward; the others hold them back, see the module docstring).

    Args:
        sync: the step's :class:`GradSync` (output of ``grad_sync_begin``).
        params: the bucket's parameters (replicated on ``sync.axis``).
        bucket: the bucket's index (for dumps and logs; buckets are numbered in launch order).
        scale: factor applied before the sum (default ``1 / size of sync.axis``: an average).
    """
    return bucket_grads(sync, params, bucket, scale, None)


def bucket_grads(sync: GradSync, params: tuple[torch.Tensor, ...], bucket: int, scale: float | None,
                 reducer: Any) -> tuple[torch.Tensor, ...]:
    """A gradient bucket whose reduction ``reducer.start(flat, params, group)`` begins (a work
    object: ``wait()``, optionally ``advance()``); None: a plain all-reduce."""
    if any(is_fake(p) for p in params) or not torch.is_grad_enabled():
        return tuple(p.view_as(p) for p in params)
    return _AllReduceGrads.apply(sync.token, sync, scale, bucket, reducer, *params)
