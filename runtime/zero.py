"""ZeRO parameter sharding at run time: gather shards into full parameters, scatter gradients.

A ZeRO-sharded parameter lives on each rank as a *shard*: rows ``[r*c, (r+1)*c)`` of the full
parameter along dim 0, with ``c = ceil(rows / N)`` and zero rows padding the last shards (as
FSDP2 does), so every rank's shard has the same shape and one flat collective moves a whole
group. The optimizer only ever sees shards.

``all_gather_params(sync, *shards, axis=, shapes=, stage=)`` is the graph op (inserted only by
``graphpass.passes.collectives``):

- forward: one ``all_gather_into_tensor`` of the group's flattened shards → full parameters
  (one copy out of the gathered buffer). Each forward learns the order the groups are gathered
  in, and the next forward launches every group's all-gather asynchronously as soon as the group
  before it is gathered, so it overlaps that group's compute (FSDP2's forward prefetch; one
  group ahead);
- backward: the full gradients are written once, divided by N on the way (the batch mean),
  into one rank-major buffer, and reduced: stage 2/3 with one async ``reduce_scatter_tensor``
  (each rank keeps its shard's gradient), stage 1 with an async ``all_reduce`` (full gradients,
  then a copy of this rank's rows, so ``.grad`` holds shards only).
  As for data parallel, :class:`~graphpass.runtime.grad_sync.GradSync` waits for them at the
  end of backward and writes each shard's ``.grad``;
- several microbatches per step (:class:`~graphpass.runtime.grad_sync.Accumulation`): stage 1
  holds the gradients back and all-reduces once, on the step's last backward (its gradients
  are full-size anyway); stages 2/3 reduce-scatter every backward and sum the shards, so their
  gradient memory stays sharded. Stages 1/2 gather the weights in the step's first forward and
  keep them for the others (they do not change within a step); stage 3 gathers every forward;
- stage 3 only: the gathered parameters are not kept for backward
  (:mod:`graphpass.runtime.regather`): backward re-gathers the group when it first needs it
  (one all-gather per group), so gathered weights are freed right after their forward use.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist

from torch.utils.weak import WeakIdKeyDictionary

from graphpass.layout import shard_rows
from graphpass.runtime import compressed_sync
from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime import offload
from graphpass.runtime import rank_progress
from graphpass.runtime import regather
from graphpass.runtime.fake import is_fake
from graphpass.runtime.grad_sync import GradSync


# torch 2.13 renamed the flat collectives; older torch (>= 2.6, which users may run) has the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_shape(full_shape: Sequence[int], num_shards: int) -> tuple[int, ...]:
    """Shape of one rank's shard of a parameter of ``full_shape``."""
    return (shard_rows(full_shape[0], num_shards), *full_shape[1:])


def make_shard(full: torch.Tensor, num_shards: int, index: int) -> torch.Tensor:
    """This rank's padded dim-0 shard of ``full`` (a copy; padding rows are zero)."""
    rows = shard_rows(full.shape[0], num_shards)
    start = min(index * rows, full.shape[0])
    stop = min(start + rows, full.shape[0])
    shard = full.new_zeros((rows, *full.shape[1:]))
    with torch.no_grad():
        shard[: stop - start].copy_(full[start:stop])
    return shard


class _Gather:
    """The all-gather of one group's flattened shards, launched and possibly still in flight.

    ``result()`` waits (once) and returns ``[num_shards, group_numel]``; waiting also drops the
    ``Work``, which holds the flattened input until then.
    """

    __slots__ = ("shards", "num", "out", "work")

    def __init__(self, shards: Sequence[torch.Tensor], group: Any, num_shards: int, async_op: bool):
        flat = torch.cat([s.detach().reshape(-1) for s in shards])
        self.shards, self.num = tuple(shards), num_shards
        self.out = flat.new_empty(num_shards * flat.numel())
        self.work = _all_gather_flat(self.out, flat, group=group, async_op=async_op)

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out.view(self.num, -1)


def _gather_flat(shards: Sequence[torch.Tensor], group: Any, num_shards: int) -> torch.Tensor:
    """All-gather the flattened shards of a group: result is ``[num_shards, group_numel]``."""
    return _Gather(shards, group, num_shards, async_op=False).result()


def _unpack_full(
    gathered: torch.Tensor, shards: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Full parameters from a ``[N, group_numel]`` gather: rows of every rank, padding dropped."""
    out, offset = [], 0
    for shard, shape in zip(shards, shapes):
        n = shard.numel()
        rows = gathered[:, offset : offset + n].reshape(-1, *shard.shape[1:])
        out.append(rows[: shape[0]].contiguous())
        offset += n
    return out


def gather_full_parameters(
    shards: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], axis: str
) -> list[torch.Tensor]:
    """Full tensors of sharded parameters (a collective: every rank of ``axis`` must call it)."""
    mesh = mesh_lib.current()
    group = mesh.group(axis)
    if group is None:
        return [s.detach()[: shape[0]].clone() for s, shape in zip(shards, shapes)]
    with offload.resident(shards):  # shards streamed from host memory come back for the gather
        return _unpack_full(_gather_flat(shards, group, mesh.axis_size(axis)), shards, shapes)


def _rank_major_grads(
    grads: Sequence[torch.Tensor | None], shards: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], num: int,
    divisor: int | None = None,
) -> torch.Tensor:
    """The gradients of a group laid out rank-major and divided by ``divisor`` (default ``num``):
    ``[num, group_numel]``.

    Block r holds rank r's rows of every parameter (zeros where rows are padding), the layout
    ``reduce_scatter`` and the shards use. The loss is a per-rank mean, so dividing by ``num``
    averages, as for data parallel (experts sharded over ``ep`` divide by all of ``dp``, more
    ranks than their ``edp`` axis holds). Each gradient is written once, divided on the way, into a
    buffer that is never zero-filled except for padding rows. The earlier ``new_zeros`` + copy per
    parameter, ``cat`` and a separate ``div_`` made four passes over fresh memory: 8.0 → 1.5 ms
    for one transformer block of the bench GPT (n_embd 512) on 2 ranks, 5.3 → 1.7 ms on 4; a
    whole ZeRO-3 ``train_step`` 4.0% (2 ranks) and 5.4% (4 ranks) faster in a paired A/B run.
    Bitwise the same values (the same fp32 division of each element).
    """
    present = [g.dtype for g in grads if g is not None]
    dtype = functools.reduce(torch.promote_types, present) if present else shards[0].dtype
    buffer = shards[0].new_empty((num, sum(s.numel() for s in shards)), dtype=dtype)
    divisor = divisor or num
    offset = 0
    for grad, shard, shape in zip(grads, shards, shapes):
        n, rows, rest = shard.numel(), shard.shape[0], shard.shape[1:]
        block = buffer[:, offset : offset + n].view(num, rows, *rest)
        offset += n
        if grad is None:
            block.zero_()
            continue
        full = shape[0] // rows  # ranks whose rows are all real
        if full:
            torch.div(grad[: full * rows].view(full, rows, *rest), divisor, out=block[:full])
        if full < num:
            tail = shape[0] - full * rows
            if tail:
                torch.div(grad[full * rows :], divisor, out=block[full, :tail])
            block[full, tail:].zero_()
            block[full + 1 :].zero_()
    return buffer


# The gather order of the last forward: first shard of a group -> (shards, axis) of the group
# gathered right after it. Learned as forward runs, so the next forward can launch each group's
# all-gather one group ahead (FSDP2's forward prefetch). Weak keys: it dies with the model.
_NEXT_GATHER: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _StepState:
    """Per forward call (per :class:`GradSync`): the group gathered last, gathers launched ahead."""

    def __init__(self) -> None:
        self.last_first_shard: torch.Tensor | None = None
        self.ahead: dict[int, _Gather] = {}  # id(first shard) -> prefetched gather


_STEP_STATE: "weakref.WeakKeyDictionary[GradSync, _StepState]" = weakref.WeakKeyDictionary()


def _step_state(sync: GradSync) -> _StepState:
    state = _STEP_STATE.get(sync)
    if state is None:
        state = _STEP_STATE[sync] = _StepState()
    return state


def _forward_gather(sync: GradSync, shards: tuple[torch.Tensor, ...], group: Any, num: int) -> torch.Tensor:
    """This group's gathered ``[num, group_numel]`` (prefetched if the last forward said so),
    after launching the all-gather of the group that came next in the last forward.

    Every rank runs the same graph, so every rank learns the same order and launches the same
    prefetches in the same order: the collectives match. A prefetch that turns out wrong (the
    graph's order changed) is only wasted, never used.

    Measured (paired A/B, bench GPT, ZeRO-3): time blocked in forward all-gathers per step
    51 → 19 ms on 2 ranks and 126 → 37 ms on 4; ``train_step`` 2.2% and 2.0% faster. The peak
    did not move (it is in backward), bench/memory.py and tests/test_zero.py alike.
    """
    state = _step_state(sync)
    if state.last_first_shard is not None:
        _NEXT_GATHER[state.last_first_shard] = (shards, sync.axis)
    state.last_first_shard = shards[0]
    gather = state.ahead.pop(id(shards[0]), None)
    if gather is None or len(gather.shards) != len(shards) or any(a is not b for a, b in zip(gather.shards, shards)):
        gather = _Gather(shards, group, num, async_op=True)  # not prefetched: first step, or order changed
    upcoming = _NEXT_GATHER.get(shards[0])
    kept = sync.accumulation.gathered  # groups a later microbatch does not gather again
    if upcoming is not None and id(upcoming[0][0]) not in state.ahead and id(upcoming[0][0]) not in kept:
        mesh = mesh_lib.current()
        next_group = mesh.group(upcoming[1])
        if next_group is not None:
            with offload.resident(upcoming[0]):
                state.ahead[id(upcoming[0][0])] = _Gather(upcoming[0], next_group, mesh.axis_size(upcoming[1]), True)
    return gather.result()


class _RowOfAllReduce:
    """Stage 1's in-flight all-reduce, as :meth:`GradSync.finish` waits for it (``wait()``).

    The all-reduce fills the whole rank-major buffer; ``wait`` copies this rank's row into the
    shard-sized ``out`` and lets the buffer go. Handing out ``buffer[rank]`` instead made every
    ``.grad`` a view that kept the full buffer alive until ``zero_grad``: 4Ψ bytes more model
    state (bench/memory.py, 2 ranks: ZeRO-1 state 160.9 → 128.7 MiB).
    """

    __slots__ = ("work", "buffer", "row", "out")

    def __init__(self, work: Any, buffer: torch.Tensor, row: int):
        self.work, self.buffer, self.row = work, buffer, row
        self.out = buffer.new_empty(buffer.shape[1])

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.out.copy_(self.buffer[self.row])
        self.work = self.buffer = None


class _ThenAllReduce:
    """HSDP's gradient reduction: the reduce-scatter inside the shard group, then an all-reduce
    of this rank's reduced shard across the replicas (``dp_replicate``), as FSDP2's HSDP does.

    The all-reduce can only start once the reduce-scatter is done: :meth:`advance` launches it
    (asynchronously) when it is, and :class:`GradSync` calls it on every reduction in flight
    each time a group adds one, so the cross-replica all-reduce overlaps the rest of backward;
    :meth:`wait` finishes both.
    """

    __slots__ = ("work", "out", "group", "index", "all_reduce", "compressor")

    def __init__(self, work: Any, out: torch.Tensor, group: Any, index: int, compressor: Any = None):
        self.work, self.out, self.group, self.index = work, out, group, index
        self.all_reduce = None
        self.compressor = compressor  # int8 across the replicas: its error feedback between steps

    def advance(self, block: bool = False) -> None:
        if self.work is None:
            if self.compressor is not None and self.all_reduce is not None:
                self.all_reduce.advance(block)  # the int8 reduction's second hop, once the first is done
            return
        if not (block or self.work.is_completed()):
            return
        self.work.wait()
        self.work = None
        if self.compressor is not None:
            rank_progress.enter("int8 all_reduce across replicas of all_gather_params group", self.index)
            self.all_reduce = self.compressor.start(self.out, (), self.group)
            return
        rank_progress.enter("all_reduce across replicas of all_gather_params group", self.index)
        self.all_reduce = dist.all_reduce(self.out, group=self.group, async_op=True)

    def wait(self) -> None:
        self.advance(block=True)
        if self.all_reduce is not None:
            self.all_reduce.wait()
            self.all_reduce = None


class _AllGatherParams(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, sync: GradSync, shapes, stage: int, partial, divisor, index: int, replicate, compression,
                *shards: torch.Tensor):
        mesh = mesh_lib.current()
        group = mesh.group(sync.axis)
        num = mesh.axis_size(sync.axis)
        ctx.sync, ctx.shapes, ctx.stage, ctx.num, ctx.partial = sync, shapes, stage, num, partial
        ctx.divisor, ctx.index, ctx.replicate, ctx.compression = divisor, index, replicate, compression
        ctx.shards = shards  # leaves: referencing them keeps nothing extra alive
        accumulation = sync.accumulation
        kept = accumulation.gathered.get(id(shards[0])) if stage < 3 else None
        if kept is not None:  # stage 1/2, a later microbatch: the weights of the first forward
            return tuple(t.view_as(t) for t in kept)
        if group is not None:
            rank_progress.enter("all_gather_params group", index)
        full = tuple(_unpack_full(_forward_gather(sync, shards, group, num), shards, shapes))
        if stage < 3 and accumulation.num_microbatches > 1:
            accumulation.gathered[id(shards[0])] = full
        return full

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        sync: GradSync = ctx.sync
        shards, num = ctx.shards, ctx.num
        mesh = mesh_lib.current()
        group = mesh.group(sync.axis)
        grads = _sum_partial_grads(grads, ctx.partial, mesh)
        buffer = _rank_major_grads(grads, shards, ctx.shapes, num, ctx.divisor)
        done = (torch.zeros(()), None, None, None, None, None, None, None, None) + (None,) * len(shards)
        if ctx.stage == 1:
            accumulation = sync.accumulation
            held = accumulation.held(shards[0])
            if held is not None:
                held.add_(buffer)
                buffer = held
            if not accumulation.last_backward:
                accumulation.hold(shards[0], buffer)  # all-reduced with the step's last backward
                return done
            accumulation.release(shards[0])
        if ctx.stage == 1:
            # all of dp at once: under HSDP the shard group and its replicas together
            axis = f"{sync.axis},{ctx.replicate}" if ctx.replicate else sync.axis
            rank_progress.enter("all_reduce of all_gather_params group", ctx.index)
            all_reduce = dist.all_reduce(buffer, group=mesh.group(axis), async_op=True)
            work = _RowOfAllReduce(all_reduce, buffer, mesh.axis_rank(sync.axis))
            out = work.out
        else:
            out = buffer.new_empty(buffer.shape[1])
            rank_progress.enter("reduce_scatter of all_gather_params group", ctx.index)
            work = _reduce_scatter_flat(out, buffer.view(-1), group=group, async_op=True)
            if ctx.replicate and mesh.group(ctx.replicate) is not None:
                compressor = compressed_sync.replica_compressor(shards, ctx.compression) if ctx.compression else None
                work = _ThenAllReduce(work, out, mesh.group(ctx.replicate), ctx.index, compressor)
        sync.add(work, out, shards)
        return done


def _sum_partial_grads(grads: tuple, partial, mesh) -> tuple:
    """Sum over their axis the gradients that are partial there (a norm weight applied to
    sequence-parallel shards), in one all-reduce per axis, before the ZeRO reduction over dp."""
    if not partial or not any(partial):
        return grads
    grads = list(grads)
    for axis in sorted({a for a in partial if a}):
        index = [i for i, a in enumerate(partial) if a == axis and grads[i] is not None]
        group = mesh.group(axis)
        if not index or group is None:
            continue
        flat = torch.cat([grads[i].reshape(-1) for i in index])
        rank_progress.enter(f"all_reduce of partial gradients over {axis}")
        dist.all_reduce(flat, group=group)
        offset = 0
        for i in index:
            grads[i] = flat[offset : offset + grads[i].numel()].view_as(grads[i])
            offset += grads[i].numel()
    return tuple(grads)


def all_gather_params(
    sync: GradSync,
    *shards: torch.Tensor,
    axis: str,
    shapes: Sequence[Sequence[int]],
    stage: int,
    group: int = 0,
    partial: Sequence[str | None] | None = None,
    divisor: int | None = None,
    replicate: str | None = None,
    compression: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Full parameters from their ZeRO shards over ``axis`` (see the module docstring).

    Args:
        sync: the step's gradient synchronisation (``grad_sync_begin`` output).
        shards: this rank's shards of the group's parameters.
        axis: the data-parallel mesh axis the parameters are sharded over.
        shapes: the full shape of each parameter.
        stage: ZeRO stage 1, 2 or 3 of the whole group.
        group: index of the gather group (for dumps).
        partial: per parameter, the mesh axis over which its gradient is a partial sum (summed
            there before the ZeRO reduction), or None.
        divisor: what the gradients are divided by (default the size of ``axis``: an average
            over it); expert weights sharded over ``ep`` and ZeRO-sharded over ``edp``, and every
            parameter under HSDP, divide by ``dp``.
        replicate: HSDP's ``dp_replicate`` axis, over which the shards are replicas: at stages
            2/3 each rank's reduced gradient shard is all-reduced there after the reduce-scatter;
            stage 1 all-reduces over the shard group and its replicas at once (all of ``dp``).
        compression: ``"int8"``: at stages 2/3 that all-reduce across the replicas goes as int8
            blocks with error feedback (:mod:`graphpass.runtime.compressed_sync`), the only hop
            that crosses sites when the shard groups are sites.
    """
    if any(is_fake(s) for s in shards):
        return tuple(s.new_empty(tuple(shape)) for s, shape in zip(shards, shapes))
    if not torch.is_grad_enabled():
        return tuple(gather_full_parameters(shards, shapes, axis))
    partial = tuple(partial) if partial else None
    full = _AllGatherParams.apply(sync.token, sync, tuple(map(tuple, shapes)), stage, partial, divisor, group,
                                  replicate, compression, *shards)
    if stage == 3 and regather.active():
        regather.register(full, functools.partial(_regathered, tuple(shards), tuple(map(tuple, shapes)), axis,
                                                  mesh_lib.current(), group))
    return full


def _regathered(shards, shapes, axis: str, mesh, index: int = 0) -> list[torch.Tensor]:
    """A stage-3 group's full weights gathered again for backward.

    Synchronous, unlike forward's gathers: launching the previous group's re-gather ahead
    (FSDP2's backward prefetch) saved at most 2-4% of a step here (within noise on 2 and 4
    ranks, bench model) but holds one more gathered group at the start of backward, which on
    the zoo GPT lifted the ZeRO-3 peak above ZeRO-2's (1.62 vs 1.58 MB on 4 ranks).
    """
    group = mesh.group(axis)
    if group is not None:
        rank_progress.enter("backward re-gather of all_gather_params group", index)
    with offload.resident(shards):  # shards streamed from host memory come back for the gather
        return _unpack_full(_gather_flat(shards, group, mesh.axis_size(axis)), shards, shapes)
