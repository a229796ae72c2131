"""Expert parallelism's token exchange: rows sorted by expert go to the ranks that hold their
experts, and come back.

A Mixture-of-Experts layer (:mod:`graphpass.nn.moe`, Hugging Face's Mixtral / Qwen2-MoE) sorts
its routed rows by expert and multiplies each expert's rows by that expert's weights
(``grouped_mm(rows, weight, offs)``, ``offs`` the running row counts). With the experts sharded
over an ``ep`` group of ``n`` ranks (rank ``j`` holds experts ``j E/n .. (j+1) E/n - 1``), the
rows of one rank's experts are contiguous in that order, so the ``expert_parallel`` pass puts
three ops around the grouped products::

    splits = ep_counts(offs, 'ep', n)                 # [2, n, E/n]: rows sent to / received from each rank
    local_rows, local_offs = ep_dispatch(rows, splits, 'ep')
    ... grouped_mm(local_rows, local_weight, local_offs) ...
    out = ep_combine(local_out, splits, num_rows, 'ep')   # back home, in the rows' order

- :func:`ep_counts` exchanges the per-expert row counts (an all-to-all of ``E`` integers per
  rank, no gradient): Megatron-Core's and torchtitan's first step, so that every rank knows how
  many rows it will receive;
- :func:`ep_dispatch` sends to rank ``j`` the rows of its experts (an all-to-all with uneven
  splits) and orders what it received expert-major (all sources' rows of local expert 0, then of
  local expert 1, ...), returning the local experts' running counts;
- :func:`ep_combine` undoes it: back to source-major order, and the reverse all-to-all; rows
  that were not sent (a capacity's dropped ones, past ``offs[-1]``) come back zero.

Dispatch and combine are autograd functions whose backward is the same exchange with the splits
swapped (Megatron-Core's and torchtitan's form), each with its permutation. How many rows a
rank receives is data: under fake tensors the ops return the balanced expectation (as many rows
as were sent), which is what the cost model prices; the real ops return what routing decided.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime.fake import is_fake

#: The buffers a compiled program keeps for each Mixture-of-Experts layer ``i`` whose experts
#: are sharded over ``ep``: the expert in each slot, and the tally of rows routed to each expert
#: (:mod:`graphpass.runtime.expert_placement` reads and writes them).
PLACEMENT_PREFIX, LOAD_PREFIX = "ep_placement_", "ep_load_"


def _all_to_all(out: torch.Tensor, rows: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
                group) -> None:
    """The one all-to-all call of this module (tests count the bytes it moves)."""
    dist.all_to_all_single(out, rows, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)


def _transpose_blocks(counts: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder blocks laid out row-major by ``counts`` ``[p, q]`` (block
    ``(a, b)`` has ``counts[a, b]`` rows) into column-major block order ``(b, a)``."""
    flat = counts.reshape(-1)
    starts = (flat.cumsum(0) - flat).reshape(counts.shape).t().reshape(-1)
    sizes = counts.t().reshape(-1)
    shift = torch.repeat_interleave(starts - (sizes.cumsum(0) - sizes), sizes)
    return shift + torch.arange(shift.numel(), device=shift.device)


class TwoLevel:
    """The two-level (hierarchical) all-to-all of Tutel's 2DH / HetuMoE over an ``ep`` group of
    ``k`` ranks on each of ``m`` nodes: rows first cross the node to the local rank with the
    destination's index (intra-node all-to-all), then go to the destination's node in one
    message per node pair (inter-node all-to-all among the ranks with that index). The result
    is the flat exchange's, byte for byte and in the same order; the inter-node link carries
    ``m - 1`` messages per rank instead of ``(m - 1) k``. Each exchange first all-gathers the
    node's per-destination counts (``n`` integers from each of its ``k`` ranks), one more
    intra-node latency the cost model does not price.

    Args:
        intra, inter: this rank's process groups (its ep ranks on its node; those with its
            index on every node).
        k, m: ranks per node, nodes; ``index``: this rank's index within its node.
    """

    def __init__(self, intra, inter, k: int, m: int, index: int):
        self.intra, self.inter, self.k, self.m, self.index = intra, inter, k, m, index

    def exchange(self, out: torch.Tensor, rows: torch.Tensor, recv: list[int], send: list[int]) -> None:
        """``out`` receives from each ep rank ``recv[s]`` rows; ``rows`` holds ``send[d]`` rows
        for each ep rank ``d``, in rank order (the flat exchange's contract)."""
        k, m = self.k, self.m
        sent = torch.tensor(send, dtype=torch.long, device=rows.device)
        node = sent.new_empty(k * k * m)  # what each rank of my node sends where
        _all_gather_counts(node, sent, self.intra)
        node = node.reshape(k, m, k)[:, :, self.index]  # [source index, destination node] to my index
        across = rows.index_select(0, _transpose_blocks(sent.reshape(m, k)))  # by destination index
        mine = rows.new_empty(int(node.sum()), *rows.shape[1:])
        _all_to_all(mine, across, node.sum(1).tolist(), sent.reshape(m, k).sum(0).tolist(), self.intra)
        outbound = mine.index_select(0, _transpose_blocks(node))  # by destination node, then source
        arriving = torch.tensor(recv, dtype=torch.long).reshape(m, k).sum(1).tolist()
        _all_to_all(out, outbound, arriving, node.sum(0).tolist(), self.inter)


def _all_gather_counts(out: torch.Tensor, counts: torch.Tensor, group) -> None:
    dist.all_gather_into_tensor(out, counts, group=group)


def _exchange(out: torch.Tensor, rows: torch.Tensor, recv: list[int], send: list[int], route) -> None:
    """The all-to-all of ``rows`` (``send[d]`` to each ep rank) into ``out`` (``recv[s]`` from
    each) over ``route``: a process group (flat) or a :class:`TwoLevel`."""
    if isinstance(route, TwoLevel):
        route.exchange(out, rows, recv, send)
    else:
        _all_to_all(out, rows, recv, send, route)


def _route(axis: str, algorithm: str):
    """The process group of ``axis`` (flat), or its :class:`TwoLevel` route (``"hierarchical"``
    on a mesh built with nodes whose ep groups span them; else flat); None for one rank."""
    if algorithm not in ("flat", "hierarchical"):
        raise ValueError(f"expert exchange algorithm must be 'flat' or 'hierarchical', got {algorithm!r}")
    mesh = mesh_lib.current()
    two_level = mesh.two_level(axis) if algorithm == "hierarchical" else None
    if two_level is not None:
        intra, inter, k, m = two_level
        return TwoLevel(intra, inter, k, m, mesh.axis_rank(axis) % k)
    return mesh.group(axis)


def _expert_major(recv_counts: torch.Tensor) -> torch.Tensor:
    """The permutation that orders received rows (source-major: source ``s``'s rows of local
    expert 0, 1, ...) expert-major: ``received[order]``; ``recv_counts`` is ``[n sources, E local]``."""
    n, local = recv_counts.shape
    label = torch.repeat_interleave(recv_counts.reshape(-1))  # each row's s * local + e
    return ((label % local) * n + label // local).argsort(stable=True)  # by e * n + s


def ep_counts(offs: torch.Tensor, axis: str, size: int, placement: torch.Tensor | None = None,
              load: torch.Tensor | None = None) -> torch.Tensor:
    """Exchange the per-expert row counts over ``axis`` (``size`` ranks).

    Args:
        offs: running row counts over all ``E`` experts (``E`` divisible by ``size``).
        placement: the expert in each slot (``[E]``; rank ``j`` holds slots ``j E/size ..``),
            None for experts in order (:mod:`graphpass.runtime.expert_placement` moves them).
        load: a ``[E]`` int64 tally the per-expert counts are added to (routing statistics).

    Returns:
        ``splits`` ``[2, size, E/size]``: the rows this rank sends to each rank per slot of that
        rank, and the rows it receives from each rank per own slot.
    """
    num_experts = offs.shape[0]
    if num_experts % size:
        raise ValueError(f"ep_counts: {num_experts} experts do not divide over the {size} ranks of axis {axis!r}")
    local = num_experts // size
    if is_fake(offs):
        return offs.new_empty(2, size, local, dtype=torch.long)
    splits = offs.new_empty(2, size, local, dtype=torch.long)
    sent = splits[0].view(-1)
    torch.sub(offs, F.pad(offs, (1, -1)), out=sent)  # per-expert counts, written in place
    if load is not None:
        load.add_(sent)
    if placement is not None:
        sent.copy_(sent[placement])  # by slot
    group = mesh_lib.current().group(axis)
    if group is None:
        splits[1].copy_(splits[0])
    else:
        _all_to_all(splits[1].view(-1), sent, None, None, group)
    return splits


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, splits: torch.Tensor, group) -> torch.Tensor:
        send, recv = splits[0].sum(1).tolist(), splits[1].sum(1).tolist()
        order = _expert_major(splits[1])
        ctx.send, ctx.recv, ctx.order, ctx.group, ctx.num_rows = send, recv, order, group, rows.shape[0]
        received = rows.new_empty(sum(recv), *rows.shape[1:])
        _exchange(received, rows[: sum(send)].contiguous(), recv, send, group)
        return received.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        source_major = torch.empty_like(grad).index_copy_(0, ctx.order, grad)
        kept = sum(ctx.send)
        out = grad.new_empty(ctx.num_rows, *grad.shape[1:])
        _exchange(out[:kept], source_major, ctx.send, ctx.recv, ctx.group)
        out[kept:].zero_()  # rows that stayed home (dropped) got no gradient here
        return out, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_out: torch.Tensor, splits: torch.Tensor, num_rows: int, group) -> torch.Tensor:
        back, home = splits[1].sum(1).tolist(), splits[0].sum(1).tolist()  # reverse of dispatch
        order = _expert_major(splits[1])
        ctx.back, ctx.home, ctx.order, ctx.group = back, home, order, group
        source_major = torch.empty_like(local_out).index_copy_(0, order, local_out)
        out = local_out.new_empty(num_rows, *local_out.shape[1:])
        kept = sum(home)
        _exchange(out[:kept], source_major, home, back, group)
        out[kept:].zero_()  # rows that were not sent (dropped) contribute nothing
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        received = grad.new_empty(sum(ctx.back), *grad.shape[1:])
        _exchange(received, grad[: sum(ctx.home)].contiguous(), ctx.back, ctx.home, ctx.group)
        return received.index_select(0, ctx.order), None, None, None


def _moved(placement: torch.Tensor | None) -> bool:
    return placement is not None and not bool(torch.equal(placement, torch.arange(placement.numel(),
                                                                                   device=placement.device)))


def _slot_order(splits: torch.Tensor, placement: torch.Tensor) -> torch.Tensor:
    """Indices of the expert-sorted rows in slot order (slot ``s`` holds expert
    ``placement[s]``), from the counts sent per slot (``splits[0]``)."""
    by_slot = splits[0].reshape(-1)
    by_expert = torch.empty_like(by_slot).index_copy_(0, placement, by_slot)
    expert_start = by_expert.cumsum(0) - by_expert
    slot_start = by_slot.cumsum(0) - by_slot
    shift = torch.repeat_interleave(expert_start[placement] - slot_start, by_slot)
    return shift + torch.arange(shift.numel(), device=shift.device)


def ep_dispatch(rows: torch.Tensor, splits: torch.Tensor, axis: str, placement: torch.Tensor | None = None,
                algorithm: str = "flat", offs_dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``rows`` (sorted by expert, the kept ones first, ``splits`` from :func:`ep_counts`)
    to the ranks of ``axis`` that hold their experts (by ``placement``, as for ep_counts), by
    ``algorithm``: ``"flat"`` or ``"hierarchical"`` (:class:`TwoLevel`).

    Returns:
        ``(local_rows, local_offs)``: the rows of this rank's ``E/size`` slots from every rank,
        slot-major, and their running counts in ``offs_dtype`` (the layer's own offsets' dtype:
        torch's ``_grouped_mm`` takes int32 only) for ``grouped_mm`` with the local weights.
    """
    if is_fake(rows):
        return rows.new_empty(rows.shape), splits.new_empty(splits.shape[2], dtype=offs_dtype)
    local_offs = splits[1].sum(0).cumsum(0).to(offs_dtype)
    group = _route(axis, algorithm)
    if group is None:
        return rows, local_offs
    if _moved(placement):  # the rows of each slot's expert, in slot order
        rows = rows.index_select(0, _slot_order(splits, placement))
    return _Dispatch.apply(rows, splits, group), local_offs


def ep_combine(local_out: torch.Tensor, splits: torch.Tensor, num_rows: int, axis: str,
               placement: torch.Tensor | None = None, algorithm: str = "flat") -> torch.Tensor:
    """Send the local experts' results (``local_out``, slot-major as :func:`ep_dispatch` gave
    the rows) back to the ranks the rows came from, in their sorted order: ``num_rows`` rows,
    those that were not sent (dropped) zero."""
    if is_fake(local_out):
        return local_out.new_empty(num_rows, *local_out.shape[1:])
    group = _route(axis, algorithm)
    if group is None:
        return local_out
    if not _moved(placement):
        return _Combine.apply(local_out, splits, num_rows, group)
    order = _slot_order(splits, placement)
    home = _Combine.apply(local_out, splits, order.numel(), group)
    return home.new_zeros(num_rows, *home.shape[1:]).index_copy(0, order, home)


#: The ops the ``expert_parallel`` pass emits (graphpass.transitions has an entry for each).
EP_OPS = (ep_counts, ep_dispatch, ep_combine)

__all__ = ["ep_counts", "ep_dispatch", "ep_combine", "EP_OPS"]
