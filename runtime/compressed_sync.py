"""Compressed gradient buckets: PowerSGD and int8 with error feedback (:mod:`graphpass.compression`
has the equations), as graph ops beside :func:`graphpass.runtime.grad_sync.all_reduce_grads`.

They fill their bucket as it does (the same flat buffer, microbatches accumulated, one reduction
on the step's last backward) and hand :class:`~graphpass.runtime.grad_sync.GradSync` a work
object whose :meth:`advance` starts the second round once the first is done (so it overlaps the
rest of backward) and whose :meth:`wait` writes the decompressed mean gradient into the bucket.
Each bucket keeps its compressor's state between steps (the error, PowerSGD's ``Q``), keyed by
its first parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from graphpass.compression import INT8_BLOCK, int8_padded, matrix_of
from graphpass.runtime import rank_progress
from graphpass.runtime.grad_sync import GradSync, bucket_grads

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: the seed of PowerSGD's first Q: the same on every rank, another for every bucket and matrix
_SEED = 20191208

# bucket's first parameter -> its compressor (error feedback and PowerSGD's Q between steps)
_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _all_to_all(out: torch.Tensor, send: torch.Tensor, group: Any, async_op: bool = True) -> Any:
    return dist.all_to_all_single(out, send, group=group, async_op=async_op)


# ---------------------------------------------------------------------------------- int8


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and a float32 scale per block of :data:`INT8_BLOCK` (``max |x| / 127``)."""
    blocks = x.view(-1, INT8_BLOCK)
    scales = blocks.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
    return torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8).view(-1), scales


def _done(work: Any, block: bool) -> bool:
    """Whether ``work`` (None: none in flight) has finished, waiting for it when ``block``."""
    if work is None or not (block or work.is_completed()):
        return False
    work.wait()
    return True


def _finite_or_zero(error: torch.Tensor) -> torch.Tensor:
    """An error to feed back, or zeros where the step's gradients were not finite (an overflow a
    gradient scaler skips): an inf or NaN kept would poison every later step."""
    return error if bool(torch.isfinite(error).all()) else torch.zeros_like(error)


def _dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (values.view(-1, INT8_BLOCK).to(torch.float32) * scales[:, None]).view(-1)


def _pack(values: torch.Tensor, scales: torch.Tensor, parts: int) -> torch.Tensor:
    """One uint8 buffer: for each of ``parts`` destinations, its int8 values then its scales' bytes."""
    chunks = []
    for v, s in zip(values.view(parts, -1), scales.view(parts, -1)):
        chunks += [v.view(torch.uint8), s.contiguous().view(torch.uint8)]
    return torch.cat(chunks)


def _unpack(buffer: torch.Tensor, parts: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_pack`'s inverse: ``parts`` chunks of ``numel`` int8 values and their scales."""
    rows = buffer.view(parts, -1)
    values = rows[:, :numel].contiguous().view(torch.int8)
    scales = rows[:, numel:].contiguous().view(torch.float32)
    return values, scales


class _Int8:
    """One bucket's int8 compressor: the worker error (its padded bucket) and the server error
    (its shard)."""

    def __init__(self) -> None:
        self.worker: torch.Tensor | None = None
        self.server: torch.Tensor | None = None

    def start(self, flat: torch.Tensor, params: tuple[torch.Tensor, ...], group: Any) -> "_Int8Work":
        return _Int8Work(self, flat, group)


class _Int8Work:
    """The two hops of one int8 reduction (module docstring of :mod:`graphpass.compression`)."""

    def __init__(self, state: _Int8, flat: torch.Tensor, group: Any):
        self.state, self.flat, self.group = state, flat, group
        n = self.n = dist.get_world_size(group)
        padded = int8_padded(flat.numel(), n)
        x = torch.zeros(padded, dtype=torch.float32, device=flat.device)  # float32 whatever the bucket's dtype
        x[: flat.numel()].copy_(flat)
        if state.worker is not None:
            x += state.worker
        values, scales = _quantize(x)
        state.worker = _finite_or_zero(x - _dequantize(values, scales))
        self.shard = padded // n
        send = _pack(values, scales, n)
        self.recv = torch.empty_like(send)
        rank_progress.enter("all_to_all of an int8 gradient bucket", 0)
        self.scatter = _all_to_all(self.recv, send, group, async_op=True)
        self.gather = self.gathered = None

    def advance(self, block: bool = False) -> None:
        if not _done(self.scatter, block):
            return
        self.scatter = None
        values, scales = _unpack(self.recv, self.n, self.shard)
        total = _dequantize(values, scales.reshape(-1)).view(self.n, -1).sum(dim=0)
        state = self.state
        if state.server is not None:
            total += state.server
        values, scales = _quantize(total)
        state.server = _finite_or_zero(total - _dequantize(values, scales))
        send = _pack(values, scales, 1)
        self.gathered = torch.empty(self.n * send.numel(), dtype=torch.uint8, device=send.device)
        rank_progress.enter("all_gather of an int8 gradient bucket", 0)
        self.gather = _all_gather_flat(self.gathered, send, group=self.group, async_op=True)

    def wait(self) -> None:
        self.advance(block=True)
        self.gather.wait()
        values, scales = _unpack(self.gathered, self.n, self.shard)
        full = _dequantize(values, scales.reshape(-1))
        self.flat.copy_(full[: self.flat.numel()])
        self.gather = self.gathered = self.recv = None


# ------------------------------------------------------------------------------ PowerSGD


def orthogonalize(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p``, in place (``eps`` keeps a zero column finite)."""
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        col.div_(torch.linalg.vector_norm(col) + eps)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(col * (col.T @ rest))
    return p


class _PowerSGD:
    """One bucket's PowerSGD compressor: each matrix's error and last ``Q``."""

    def __init__(self, rank: int, warm_start: bool, bucket: int):
        self.rank, self.warm_start, self.bucket = rank, warm_start, bucket
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}
        self.steps = 0

    def start(self, flat: torch.Tensor, params: tuple[torch.Tensor, ...], group: Any) -> "_PowerSGDWork":
        return _PowerSGDWork(self, flat, params, group)

    def first_q(self, index: int, cols: int) -> torch.Tensor:
        """A matrix's ``Q`` for this step: last step's (warm start), else one drawn from a seed
        every rank shares."""
        q = self.qs.get(index) if self.warm_start else None
        if q is not None:
            return q
        generator = torch.Generator().manual_seed(_SEED + 7919 * self.bucket + 104729 * index + self.steps)
        return torch.randn(cols, self.rank, generator=generator)


class _PowerSGDWork:
    """PowerSGD's two rounds on one bucket (the module docstring of :mod:`graphpass.compression`)."""

    def __init__(self, state: _PowerSGD, flat: torch.Tensor, params: tuple[torch.Tensor, ...], group: Any):
        self.state, self.flat, self.group = state, flat, group
        self.matrices: list[tuple[int, torch.Tensor]] = []  # (index, M: float32, the error added)
        self.views: list[torch.Tensor] = []  # where each matrix's approximation is written back
        self.whole: list[torch.Tensor] = []  # views of flat sent uncompressed
        offset = 0
        for index, p in enumerate(params):
            view = flat[offset : offset + p.numel()]
            offset += p.numel()
            shape = matrix_of(p.shape, state.rank)
            if shape is None:
                self.whole.append(view)
                continue
            m = view.view(shape)
            self.views.append(m)
            m = m.float()  # computed in float32 whatever the bucket's dtype (a copy only if it is not)
            error = state.errors.get(index)
            if error is not None:
                m = m + error
            self.matrices.append((index, m))
        self.ps = [m @ state.first_q(index, m.shape[1]).to(m.device) for index, m in self.matrices]
        self.first = torch.cat([p.reshape(-1) for p in self.ps] + [w.float() for w in self.whole])
        self.round1 = dist.all_reduce(self.first, group=group, async_op=True)
        self.round2 = self.second = None

    def advance(self, block: bool = False) -> None:
        if not _done(self.round1, block):
            return
        self.round1 = None
        offset = 0
        for i, p in enumerate(self.ps):
            self.ps[i] = orthogonalize(self.first[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.whole_sum = self.first[offset:]
        if not self.matrices:
            return
        qs = [m.T @ p for (_, m), p in zip(self.matrices, self.ps)]
        for (index, m), p, q in zip(self.matrices, self.ps, qs):
            # error feedback: what this rank's own factors (P^, its Q) leave out of its M
            self.state.errors[index] = _finite_or_zero(m - p @ q.T)
        self.second = torch.cat([q.reshape(-1) for q in qs])
        rank_progress.enter("all_reduce of a PowerSGD bucket's Q factors", 0)
        self.round2 = dist.all_reduce(self.second, group=self.group, async_op=True)

    def wait(self) -> None:
        self.advance(block=True)
        state = self.state
        if self.round2 is not None:
            self.round2.wait()
            self.round2 = None
        offset = 0
        for (index, m), p, view in zip(self.matrices, self.ps, self.views):
            q = self.second[offset : offset + m.shape[1] * state.rank].view(m.shape[1], state.rank)
            offset += q.numel()
            # kept either way (first_q reads it only with warm_start); a non-finite one starts afresh
            state.qs[index] = q.clone() if bool(torch.isfinite(q).all()) else None
            view.copy_(p @ q.T)
        offset = 0
        for view in self.whole:
            view.copy_(self.whole_sum[offset : offset + view.numel()])  # (cast back to the bucket's dtype)
            offset += view.numel()
        state.steps += 1
        self.first = self.second = self.ps = None


# ------------------------------------------------------------------------------- the ops


def _state(params: tuple[torch.Tensor, ...], config: tuple, make) -> Any:
    """The bucket's compressor: kept while the bucket (its parameters, in order) and the
    configuration stay the same, made anew otherwise (a recompile with another plan)."""
    key = (config, tuple(id(p) for p in params))
    entry = _STATES.get(params[0]) if params else None
    if entry is None or entry[0] != key:
        entry = _STATES[params[0]] = (key, make())
    return entry[1]


def forget(params: Any) -> None:
    """Drop the compressors of buckets led by any of ``params`` (``gp.load``: they start afresh)."""
    for p in params:
        _STATES.pop(p, None)


def replica_compressor(shards: tuple[torch.Tensor, ...], kind: str) -> _Int8:
    """The compressor of a ZeRO-2/3 group's hop across HSDP's replicas (``kind`` ``"int8"``):
    its reduced shard sent as int8 blocks with error feedback, every microbatch; kept between
    steps as a bucket's is (keyed by the group's shards)."""
    if kind != "int8":
        raise NotImplementedError(f"compression {kind!r} across HSDP's replicas: only int8 is built")
    return _state(tuple(shards), ("int8 replicas",), _Int8)


def all_reduce_grads_int8(sync: GradSync, *params: torch.Tensor, bucket: int = 0,
                          scale: float | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`~graphpass.runtime.grad_sync.all_reduce_grads` with the bucket sent as int8 blocks
    with error feedback (:mod:`graphpass.compression`)."""
    return bucket_grads(sync, params, bucket, scale, _state(params, ("int8",), _Int8) if params else None)


def all_reduce_grads_powersgd(sync: GradSync, *params: torch.Tensor, bucket: int = 0, scale: float | None = None,
                              rank: int = 4, warm_start: bool = True) -> tuple[torch.Tensor, ...]:
    """:func:`~graphpass.runtime.grad_sync.all_reduce_grads` with each matrix sent as PowerSGD's
    rank-``rank`` factors with error feedback (:mod:`graphpass.compression`)."""
    state = _state(params, ("powersgd", rank, warm_start), lambda: _PowerSGD(rank, warm_start, bucket)) if params else None
    return bucket_grads(sync, params, bucket, scale, state)


__all__ = ["all_reduce_grads_int8", "all_reduce_grads_powersgd", "forget", "orthogonalize", "replica_compressor"]
