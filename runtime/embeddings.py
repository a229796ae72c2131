"""Lookups in embedding tables sharded over a data-parallel axis, with sparse gradients.

The ``shard_embeddings`` pass replaces each lookup of a sharded table (``aten.embedding_bag``,
``aten.embedding``) by three ops on this rank's shard (the kinds: :mod:`graphpass.tables`),
TorchRec's input and output distributions over the ``n`` ranks of the axis::

    counts = table_counts(ids, offsets, "row_wise", "dp", 2, rows, 0, "sum", False)
    routed = table_dispatch(ids, offsets, weights, counts, "row_wise", "dp", rows, 0, "sum", False)
    pooled = table_combine(shard, routed, counts, ids, offsets, "row_wise", "dp", dim, "sum", False, 0.5)

- :func:`table_counts`: each id's bag from the offsets (a plain embedding: every id is a bag of
  one) and its destination: the rank holding its row (row-wise), the owner (table-wise), every
  rank (column-wise); an all-to-all of how many ids go to each rank and of each rank's bag count;
- :func:`table_dispatch`: an all-to-all of the ids (as rows of the receiving shard), each with
  the position of its bag among the bags the receiver pools, and its per-sample weight's bits
  (``int64 [m, 2 or 3]``; no gradient);
- :func:`table_combine`: each holder reads its rows of the ids it received, weights them and adds
  them into their bags, one block ``[bags of the source, columns held]`` per source that sent
  ids, and an all-to-all sends the blocks home, where they are added (rows split) or laid side
  by side (columns split); a mean divides by the bag's length. The result is the rank's samples'
  pooled rows, exactly what the lookup computed on the whole table.

Backward (of :func:`table_combine`) sends the pooled gradient the reverse way (a mean divided
by the lengths first): each holder gets the gradient blocks of the sources whose ids it served
and turns them into the gradient of each row it read (``block[bag] * weight``), times ``scale``
(``1 / dp``: dense gradients are averaged over the data-parallel ranks), added to the shard's
:class:`SparseGrad`. A data-parallel (replicated) table is looked up locally with torch's own
ops (:func:`table_replicated`), and its backward all-gathers every rank's rows and row
gradients so every rank adds the same. No dense gradient is made: the table's ``.grad`` stays
None, and :mod:`graphpass.runtime.sparse_optim` applies the step's rows once the step's last
backward is done.

Under fake tensors (the pass runner's verification, the planner) the ops return the shapes of
a balanced exchange (as many ids received as sent), which is what the cost model prices.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime.fake import is_fake


class SparseGrad:
    """The rows a step's backwards touched in one table shard and their gradients (local row
    indices into the shard), kept as the backwards left them until :meth:`take` sums them."""

    def __init__(self):
        self._rows: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        if rows.numel():
            self._rows.append(rows)
            self._values.append(values)

    def __bool__(self) -> bool:
        return bool(self._rows)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The touched rows (sorted, unique) and their summed gradients; the store empties."""
        rows, values = torch.cat(self._rows), torch.cat(self._values)
        self._rows, self._values = [], []
        unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        summed = values.new_zeros(unique.numel(), values.shape[1]).index_add_(0, inverse, values)
        return unique, summed


_GRADS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def sparse_grad(shard: torch.Tensor) -> SparseGrad:
    """The :class:`SparseGrad` of a table shard (made on first use)."""
    grad = _GRADS.get(shard)
    if grad is None:
        grad = _GRADS[shard] = SparseGrad()
    return grad


def shard_rows(rows: int, size: int) -> int:
    """Rows of each row-wise shard: ``ceil(rows / size)``."""
    return max(1, math.ceil(rows / size))


def _bags(ids: torch.Tensor, offsets: torch.Tensor | None, mode: str, include_last_offset: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(ids, bag of each id, length of each bag, bags)``: a plain lookup (``mode="none"``)
    makes every id a bag of its own; bags without offsets are the rows of 2-D ids; ids past a
    last offset are dropped."""
    if mode == "none" or offsets is None:
        per = 1 if mode == "none" else ids.shape[1]
        flat = ids.reshape(-1)
        bags = flat.numel() // per
        return flat, torch.arange(bags, device=ids.device).repeat_interleave(per), \
            torch.full((bags,), per, dtype=torch.long, device=ids.device), bags
    offsets = offsets.long()
    if include_last_offset:
        ids, starts = ids[:int(offsets[-1])], offsets[:-1]
        ends = offsets[1:]
    else:
        starts = offsets  # each bag ends where the next starts, the last at the end of the ids
        last = torch.arange(offsets.numel(), device=offsets.device) == offsets.numel() - 1
        ends = torch.where(last, ids.numel(), offsets.roll(-1))
    bags = starts.numel()
    # bag of each id: the last bag starting at or before it (empty bags start where the next does)
    bag = torch.searchsorted(starts, torch.arange(ids.numel(), device=ids.device), right=True) - 1
    return ids, bag, ends - starts, bags


def _destinations(ids: torch.Tensor, sharding: str, rows: int, size: int, owner: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each id's destination rank and its row index in that rank's shard (row- and table-wise)."""
    if sharding == "row_wise":
        c = shard_rows(rows, size)
        return ids // c, ids % c
    return torch.full_like(ids, owner), ids


def _all_to_all(out: torch.Tensor, send: torch.Tensor, out_splits, in_splits, group) -> None:
    """The one all-to-all call of this module (tests count the bytes it moves); without a group
    (one rank) the data stays."""
    if group is None:
        out.copy_(send)
    else:
        dist.all_to_all_single(out, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)


_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """The one all-gather call of this module (tests count the bytes it moves)."""
    _all_gather_flat(out, tensor, group=group)


def _sent_counts(flat: torch.Tensor, sharding: str, rows: int, size: int, owner: int) -> torch.Tensor:
    """How many of the ids go to each rank."""
    if sharding in ("column_wise", "data_parallel"):  # every rank gets all of them (or hears of them)
        return torch.full((size,), flat.numel(), dtype=torch.long)
    return torch.bincount(_destinations(flat, sharding, rows, size, owner)[0], minlength=size)


def table_counts(ids: torch.Tensor, offsets: torch.Tensor | None, sharding: str, axis: str, size: int, rows: int,
                 owner: int, mode: str, include_last_offset: bool) -> torch.Tensor:
    """Exchange how many ids each rank sends each rank of ``axis`` (``size`` ranks), and each
    rank's bag count.

    Returns:
        ``counts`` ``[2, n, 2]`` int64: ``counts[0, p]`` the ids this rank sends rank ``p`` and
        its own bag count, ``counts[1, p]`` the ids rank ``p`` sends this rank and its bag count.
    """
    if is_fake(ids):
        return torch.empty(2, size, 2, dtype=torch.long, device=ids.device)
    mesh = mesh_lib.current()
    flat, _, _, bags = _bags(ids.long(), offsets, mode, include_last_offset)
    counts = torch.empty(2, size, 2, dtype=torch.long)
    sent = _sent_counts(flat, sharding, rows, size, owner)
    torch.stack([sent, torch.full_like(sent, bags)], 1, out=counts[0])
    _all_to_all(counts[1], counts[0], None, None, mesh.group(axis))
    return counts


def _blocks(counts: torch.Tensor, sharding: str) -> tuple[list[int], list[int]]:
    """``(block_rows, back_rows)``: the pooled rows this rank returns to each source (its bags,
    where it sent ids here) and receives from each holder (this rank's bags, where it sent ids
    there); column-wise, every rank hears from every rank."""
    every = sharding == "column_wise"
    block_rows = [int(b) if every or int(m) else 0 for m, b in counts[1].tolist()]
    back_rows = [int(b) if every or int(m) else 0 for m, b in counts[0].tolist()]
    return block_rows, back_rows


def table_dispatch(ids: torch.Tensor, offsets: torch.Tensor | None, per_sample_weights: torch.Tensor | None,
                   counts: torch.Tensor, sharding: str, axis: str, rows: int, owner: int, mode: str,
                   include_last_offset: bool) -> torch.Tensor:
    """Send each id to the ranks that hold its row (``counts`` from :func:`table_counts`).

    Returns:
        ``routed`` ``[m, 2]`` (``[m, 3]`` with per-sample weights) int64, one row per id this rank
        received: its row in this rank's shard, the position of its bag among the bags this
        rank pools (the sources' blocks one after the other), and its weight's float32 bits.
    """
    columns = 2 if per_sample_weights is None else 3
    if is_fake(ids):
        return torch.empty(ids.numel(), columns, dtype=torch.long, device=ids.device)
    mesh = mesh_lib.current()
    size = mesh.axis_size(axis)
    flat, bag, _, _ = _bags(ids.long(), offsets, mode, include_last_offset)
    dest, local = (None, flat) if sharding == "column_wise" else _destinations(flat, sharding, rows, size, owner)
    parts = [local, bag]
    if per_sample_weights is not None:
        bits = per_sample_weights.reshape(-1)[:flat.numel()].to(torch.float32).view(torch.int32)
        parts.append(bits.to(torch.long))
    payload = torch.stack(parts, 1)
    if dest is None:  # column-wise: every rank gets every id
        payload = torch.cat([payload] * size)
    else:
        payload = payload[torch.argsort(dest, stable=True)]
    received = counts[1, :, 0]
    routed = payload.new_empty(int(received.sum()), columns)
    _all_to_all(routed, payload, received.tolist(), counts[0, :, 0].tolist(), mesh.group(axis))
    blocks = torch.where((received > 0) | (sharding == "column_wise"), counts[1, :, 1], 0)  # as _blocks says
    starts = blocks.cumsum(0) - blocks
    source = torch.searchsorted(received.cumsum(0), torch.arange(routed.shape[0]), right=True)
    routed[:, 1].add_(starts[source])  # bag -> its place among this rank's blocks
    return routed


def _weights(routed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The per-sample weights travelling in ``routed``'s third column (None without one)."""
    if routed.shape[1] < 3:
        return None
    return routed[:, 2].to(torch.int32).view(torch.float32).to(dtype).unsqueeze(1)


class _Combine(torch.autograd.Function):
    """:func:`table_combine` with its backward (the module docstring)."""

    @staticmethod
    def forward(ctx, shard, routed, counts, lengths, sharding, group, dim, mode, scale):
        block_rows, back_rows = _blocks(counts, sharding)
        bags = int(counts[0, 0, 1])
        values = shard[routed[:, 0]]
        weights = _weights(routed, values.dtype)
        if weights is not None:
            values = values * weights
        partial = shard.new_zeros(sum(block_rows), shard.shape[1]).index_add_(0, routed[:, 1], values)
        blocks = shard.new_empty(sum(back_rows), shard.shape[1])
        _all_to_all(blocks, partial, back_rows, block_rows, group)
        blocks = blocks.view(-1, bags, shard.shape[1])
        pooled = blocks.permute(1, 0, 2).reshape(bags, dim) if sharding == "column_wise" else blocks.sum(0)
        if mode == "mean":
            pooled = pooled / lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)
        ctx.save_for_backward(routed, lengths)
        ctx.shard = shard  # the parameter itself: its SparseGrad is keyed by the object
        ctx.plan = (group, sharding, mode, scale, block_rows, back_rows, bags, dim)
        return pooled

    @staticmethod
    def backward(ctx, grad):
        routed, lengths = ctx.saved_tensors
        shard = ctx.shard
        group, sharding, mode, scale, block_rows, back_rows, bags, dim = ctx.plan
        grad = grad.reshape(bags, dim)
        if mode == "mean":
            grad = grad / lengths.clamp(min=1).unsqueeze(1).to(grad.dtype)
        width = shard.shape[1]
        # to each holder that served this rank: the gradient of its bags (its columns of it)
        if sharding == "column_wise":
            out = grad.view(bags, len(back_rows), width).transpose(0, 1).reshape(-1, width)
        else:
            out = torch.cat([grad] * sum(1 for rows in back_rows if rows) or [grad[:0]])
        blocks = grad.new_empty(sum(block_rows), width)
        _all_to_all(blocks, out, block_rows, back_rows, group)
        values = blocks[routed[:, 1]]  # laid out as the forward's partial sums
        weights = _weights(routed, values.dtype)
        if weights is not None:
            values = values * weights
        sparse_grad(shard).add(routed[:, 0], values * scale)
        return (None,) * 9


def table_combine(shard: torch.Tensor, routed: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor,
                  offsets: torch.Tensor | None, sharding: str, axis: str, dim: int, mode: str,
                  include_last_offset: bool, scale: float) -> torch.Tensor:
    """Pool the rows of the ids this rank received (``routed``, from :func:`table_dispatch`) of
    its ``shard`` and send each source its bags; returns this rank's samples' pooled rows
    (``[bags, dim]``; ``mode="none"``: each id's row, shaped like ``ids``). Backward adds the
    shard's row gradients, times ``scale``, to its :class:`SparseGrad` (no dense gradient)."""
    if mode not in ("sum", "mean", "none"):
        raise NotImplementedError(f"a sharded embedding table pools by sum or mean; mode {mode!r} is not implemented "
                                  "(leave this table unsharded)")
    if is_fake(shard) or is_fake(ids):
        return shard.new_zeros(*_pooled_shape(ids, offsets, mode, include_last_offset), dim)
    _, _, lengths, _ = _bags(ids.long(), offsets, mode, include_last_offset)
    pooled = _Combine.apply(shard, routed, counts, lengths, sharding, mesh_lib.current().group(axis), dim, mode, scale)
    return pooled.view(*ids.shape, dim) if mode == "none" else pooled


def _pooled_shape(ids: torch.Tensor, offsets: torch.Tensor | None, mode: str, include_last_offset: bool
                  ) -> tuple[int, ...]:
    if mode == "none":
        return tuple(ids.shape)
    return (ids.shape[0] if offsets is None else offsets.shape[0] - (1 if include_last_offset else 0),)


class _Replicated(torch.autograd.Function):
    """:func:`table_replicated` with its backward."""

    @staticmethod
    def forward(ctx, shard, ids, offsets, per_sample_weights, counts, group, mode, include_last_offset, scale):
        if mode == "none":
            out = F.embedding(ids, shard.detach())
        else:
            out = F.embedding_bag(ids, shard.detach(), offsets, mode=mode, per_sample_weights=per_sample_weights,
                                  include_last_offset=include_last_offset)
        ctx.save_for_backward(ids, offsets, per_sample_weights, counts)
        ctx.shard = shard  # the parameter itself: its SparseGrad is keyed by the object
        ctx.plan = (group, mode, include_last_offset, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        ids, offsets, psw, counts = ctx.saved_tensors
        shard = ctx.shard
        group, mode, include_last_offset, scale = ctx.plan
        flat, bag, lengths, bags = _bags(ids.long(), offsets, mode, include_last_offset)
        grad = grad.reshape(bags, shard.shape[1])
        if mode == "mean":
            grad = grad / lengths.clamp(min=1).unsqueeze(1).to(grad.dtype)
        values = grad[bag]
        if psw is not None:
            values = values * psw.reshape(-1)[:flat.numel()].to(values.dtype).unsqueeze(1)
        rows, values = _all_gather_rows(flat, values, counts[1, :, 0], group)
        sparse_grad(shard).add(rows, values * scale)
        return (None,) * 9


def _all_gather_rows(rows: torch.Tensor, values: torch.Tensor, everyone: torch.Tensor, group
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``(rows, values)``, ``everyone[p]`` from rank ``p``, in rank order: one
    all-gather of ``[rows' bits, values]`` rows in the values' dtype (padded to a whole number of
    int64 words, and to the most rows any rank has)."""
    if group is None:
        return rows, values
    words = 8 // values.element_size()  # an int64 row index is this many values' bits
    pad = -(words + values.shape[1]) % words
    pieces = [rows.view(values.dtype).view(-1, words), values] + ([values.new_zeros(len(rows), pad)] if pad else [])
    most, size = int(everyone.max()), everyone.numel()
    if most > rows.numel():
        pieces = [torch.cat([p, p.new_zeros(most - rows.numel(), p.shape[1])]) for p in pieces]
    packed = torch.cat(pieces, 1)
    out = packed.new_empty(size * most, packed.shape[1])
    _all_gather(out, packed, group)
    if bool((everyone != most).any()):  # drop the padding rows
        out = out[(torch.arange(most) < everyone.unsqueeze(1)).reshape(-1)]
    return out.view(torch.long)[:, 0], out[:, words:words + values.shape[1]]


def table_replicated(shard: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None,
                     per_sample_weights: torch.Tensor | None, counts: torch.Tensor, axis: str, mode: str,
                     include_last_offset: bool, scale: float) -> torch.Tensor:
    """A data-parallel table's lookup on this rank's ids (torch's own); its backward all-gathers
    every rank's rows and row gradients (``counts`` from :func:`table_counts`: each rank's id
    count) and adds them, times ``scale``, to the table's :class:`SparseGrad`."""
    if mode not in ("sum", "mean", "none"):
        raise NotImplementedError(f"a sparse embedding table pools by sum or mean; mode {mode!r} is not implemented")
    if is_fake(shard) or is_fake(ids):
        return shard.new_zeros(*_pooled_shape(ids, offsets, mode, include_last_offset), shard.shape[1])
    return _Replicated.apply(shard, ids, offsets, per_sample_weights, counts, mesh_lib.current().group(axis), mode,
                             include_last_offset, scale)


#: The ops the ``shard_embeddings`` pass emits (graphpass.transitions has an entry for each).
TABLE_OPS = (table_counts, table_dispatch, table_combine, table_replicated)
