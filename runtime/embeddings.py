"""Lookups in embedding tables sharded over a data-parallel axis, with sparse gradients.

The ``shard_embeddings`` pass replaces each lookup of a sharded table (``aten.embedding_bag``,
``aten.embedding``) by three ops on this rank's shard (the kinds: :mod:`graphpass.tables`),
TorchRec's input and output distributions over the ``n`` ranks of the axis::

    specs = (("row_wise", rows, dim, 0, "sum", False, None, 0),)   # one Spec per lookup
    counts = table_counts([ids], [offsets], specs, "dp", 2)
    routed = table_dispatch([ids], [offsets], [weights], counts, specs, "dp")
    pooled, = table_combine([shard], routed, counts, [ids], [offsets], specs, "dp", 0.5)

- :func:`table_counts`: each id's bag from the offsets (a plain embedding: every id is a bag of
  one) and its destination (:func:`destinations`): the rank holding its row (row-wise; among
  its group, table-row-wise), the owner (table-wise), every
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


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from graphpass.layout import shard_rows
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


def destinations(ids: torch.Tensor, spec: tuple, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each id's destination rank and its row index in that rank's shard (row-, table- and
    table-row-wise; ``spec`` the table's :data:`Spec`)."""
    sharding, rows, owner, group = spec[0], spec[1], spec[3], spec[7]
    if sharding == "row_wise":
        c = shard_rows(rows, size)
        return ids // c, ids % c
    if sharding == "table_row_wise":  # row-wise among the group's ranks
        c = shard_rows(rows, group)
        return owner + ids // c, ids % c
    return torch.full_like(ids, owner), ids


def first_row(spec: tuple, size: int, rank: int) -> int:
    """The table row that row 0 of rank ``rank``'s shard is (``spec`` the table's :data:`Spec`,
    ``size`` ranks on the axis)."""
    if spec[0] == "row_wise":
        return rank * shard_rows(spec[1], size)
    if spec[0] == "table_row_wise":
        return (rank - spec[3]) * shard_rows(spec[1], spec[7])
    return 0


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


#: One lookup of a group, as the ops take it: ``(sharding, rows, dim, owner, mode,
#: include_last_offset, padding_idx, ranks)`` of its table (full shape ``[rows, dim]``), how it
#: pools, the row that takes no gradient (a plain lookup's ``padding_idx``; None: none), and a
#: table-row-wise table's group size (0 for the other kinds).
Spec = tuple


def _sent_counts(flat: torch.Tensor, spec: tuple, size: int) -> torch.Tensor:
    """How many of the ids go to each rank."""
    if spec[0] in ("column_wise", "data_parallel"):  # every rank gets all of them (or hears of them)
        return torch.full((size,), flat.numel(), dtype=torch.long)
    return torch.bincount(destinations(flat, spec, size)[0], minlength=size)


def table_counts(ids: list, offsets: list, specs: tuple, axis: str, size: int) -> torch.Tensor:
    """Exchange, for a group of lookups (``specs``, one :data:`Spec` each), how many ids each
    rank sends each rank of ``axis`` (``size`` ranks), and each rank's bag counts.

    Returns:
        ``counts`` ``[2, n, J, 2]`` int64 for ``J`` lookups: ``counts[0, p, j]`` the ids of lookup
        ``j`` this rank sends rank ``p`` and its own bag count, ``counts[1, p, j]`` what rank
        ``p`` sends this rank.
    """
    if is_fake(ids[0]):
        return torch.empty(2, size, len(specs), 2, dtype=torch.long, device=ids[0].device)
    mesh = mesh_lib.current()
    sent, bags = [], []
    for t, o, spec in zip(ids, offsets, specs):
        flat, _, _, b = _bags(t.long(), o, spec[4], spec[5])
        sent.append(_sent_counts(flat, spec, size))
        bags.append(torch.full_like(sent[-1], b))
    counts = torch.empty(2, size, len(specs), 2, dtype=torch.long)
    torch.stack([torch.stack(sent, 1), torch.stack(bags, 1)], 2, out=counts[0])
    _all_to_all(counts[1], counts[0], None, None, mesh.group(axis))
    return counts


def _blocks(counts: torch.Tensor, specs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_rows, back_rows)`` ``[n, J]``: the pooled rows this rank returns to each source
    for each lookup (its bags, where it sent ids here) and receives from each holder (this rank's
    bags, where it sent ids there); column-wise, every rank hears from every rank."""
    every = torch.tensor([spec[0] == "column_wise" for spec in specs])
    block_rows = torch.where((counts[1, :, :, 0] > 0) | every, counts[1, :, :, 1], 0)
    back_rows = torch.where((counts[0, :, :, 0] > 0) | every, counts[0, :, :, 1], 0)
    return block_rows, back_rows


def _arrived(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each id this rank received (source-major, then lookup): its source and its lookup."""
    received = counts[1, :, :, 0].reshape(-1)
    label = torch.searchsorted(received.cumsum(0), torch.arange(int(received.sum())), right=True)
    lookups = counts.shape[2]
    return label // lookups, label % lookups


def table_dispatch(ids: list, offsets: list, weights: list, counts: torch.Tensor, specs: tuple,
                   axis: str) -> torch.Tensor:
    """Send each id of a group of lookups to the ranks that hold its row (``counts`` from
    :func:`table_counts`), in one all-to-all.

    Returns:
        ``routed`` ``[m, 2]`` (``[m, 3]`` where a lookup has per-sample weights) int64, one row per
        id this rank received (source-major, then lookup): its row in the lookup's shard, the
        position of its bag among the bags this rank pools for that lookup (the sources' blocks
        one after the other), and its weight's float32 bits (1.0 where the lookup has none).
    """
    columns = 2 if all(w is None for w in weights) else 3
    if is_fake(ids[0]):
        return torch.empty(sum(t.numel() for t in ids), columns, dtype=torch.long, device=ids[0].device)
    mesh = mesh_lib.current()
    size = counts.shape[1]
    by_dest: list[list[torch.Tensor]] = [[] for _ in range(size)]
    for t, o, w, spec in zip(ids, offsets, weights, specs):
        flat, bag, _, _ = _bags(t.long(), o, spec[4], spec[5])
        dest, local = (None, flat) if spec[0] == "column_wise" else destinations(flat, spec, size)
        parts = [local, bag]
        if columns == 3:
            w = torch.ones(flat.numel()) if w is None else w.reshape(-1)[:flat.numel()]
            parts.append(w.to(torch.float32).view(torch.int32).to(torch.long))
        payload = torch.stack(parts, 1)
        if dest is None:  # column-wise: every rank gets every id
            for p in range(size):
                by_dest[p].append(payload)
        else:
            order = torch.argsort(dest, stable=True)
            ends = torch.bincount(dest, minlength=size).cumsum(0).tolist()
            ordered = payload[order]
            for p in range(size):
                by_dest[p].append(ordered[(ends[p - 1] if p else 0):ends[p]])
    payload = torch.cat([piece for pieces in by_dest for piece in pieces])
    received = counts[1, :, :, 0].sum(1)
    routed = payload.new_empty(int(received.sum()), columns)
    _all_to_all(routed, payload, received.tolist(), counts[0, :, :, 0].sum(1).tolist(), mesh.group(axis))
    block_rows, _ = _blocks(counts, specs)
    starts = block_rows.cumsum(0) - block_rows  # [n, J]: each source's first bag in each lookup's blocks
    source, lookup = _arrived(counts)
    routed[:, 1].add_(starts[source, lookup])  # bag -> its place among this rank's blocks of its lookup
    return routed


def _weights(routed: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The per-sample weights of routed ids ``rows`` (None without a weights column)."""
    if routed.shape[1] < 3:
        return None
    return routed[rows, 2].to(torch.int32).view(torch.float32).to(dtype).unsqueeze(1)


class _Combine(torch.autograd.Function):
    """:func:`table_combine` with its backward (the module docstring)."""

    @staticmethod
    def forward(ctx, routed, counts, lengths, specs, group, scale, *shards):
        block_rows, back_rows = _blocks(counts, specs)
        widths = [shard.shape[1] for shard in shards]
        source, lookup = _arrived(counts)
        at = _flat_offsets(block_rows, widths)  # [n, J]: where each source's block of each lookup starts
        starts = block_rows.cumsum(0) - block_rows
        # each lookup's rows added into their bags, written straight into the buffer sent back
        # (source-major, then lookup), one element index per column
        send = shards[0].new_zeros(int((block_rows * torch.tensor(widths)).sum()))
        mine, places = [], []
        for j, shard in enumerate(shards):
            rows = torch.nonzero(lookup == j).view(-1)
            place = at[source[rows], j] + (routed[rows, 1] - starts[source[rows], j]) * widths[j]
            place = (place.unsqueeze(1) + torch.arange(widths[j])).reshape(-1)
            values = shard[routed[rows, 0]]
            weights = _weights(routed, rows, values.dtype)
            if weights is not None:
                values = values * weights
            send.index_add_(0, place, values.reshape(-1))
            mine.append(rows)
            places.append(place)
        recv_sizes = (back_rows * torch.tensor(widths)).sum(1)
        blocks = send.new_empty(int(recv_sizes.sum()))
        _all_to_all(blocks, send, recv_sizes.tolist(), (block_rows * torch.tensor(widths)).sum(1).tolist(), group)
        bags = counts[0, 0, :, 1].tolist()
        pooled = _assemble(blocks, back_rows, widths, specs, bags)
        for j, spec in enumerate(specs):
            if spec[4] == "mean":
                pooled[j] = pooled[j] / lengths[j].clamp(min=1).unsqueeze(1).to(pooled[j].dtype)
        ctx.save_for_backward(routed, *lengths)
        ctx.shards, ctx.mine, ctx.places = shards, mine, places  # shards themselves: SparseGrads key on them
        ctx.plan = (group, specs, scale, block_rows, back_rows, widths, bags)
        ctx.rank = dist.get_rank(group) if group is not None else 0
        return tuple(pooled)

    @staticmethod
    def backward(ctx, *grads):
        routed, *lengths = ctx.saved_tensors
        group, specs, scale, block_rows, back_rows, widths, bags = ctx.plan
        outgoing = []
        for j, (grad, spec) in enumerate(zip(grads, specs)):
            grad = ctx.shards[j].new_zeros(bags[j], spec[2]) if grad is None else grad.reshape(-1, spec[2])
            if spec[4] == "mean":
                grad = grad / lengths[j].clamp(min=1).unsqueeze(1).to(grad.dtype)
            outgoing.append(grad)
        send, send_sizes = _to_holders(outgoing, back_rows, widths, specs)
        recv_sizes = (block_rows * torch.tensor(widths)).sum(1)
        blocks = send.new_empty(int(recv_sizes.sum()))
        _all_to_all(blocks, send, recv_sizes.tolist(), send_sizes.tolist(), group)
        for j, (shard, spec) in enumerate(zip(ctx.shards, specs)):
            rows = ctx.mine[j]
            values = blocks[ctx.places[j]].view(-1, widths[j])  # laid out as the forward's partial sums
            weights = _weights(routed, rows, values.dtype)
            if weights is not None:
                values = values * weights
            local = routed[rows, 0]
            if spec[6] is not None:  # the padding row takes no gradient
                first = first_row(spec, len(back_rows), ctx.rank)
                values = values * (local + first != spec[6]).unsqueeze(1).to(values.dtype)
            sparse_grad(shard).add(local, values * scale)
        return (None,) * (6 + len(ctx.shards))


def _flat_offsets(block_rows: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """``[n, J]``: where each source's block of each lookup starts in a flat buffer laid out
    source-major, then lookup (``block_rows[s, j]`` rows of ``widths[j]`` elements each)."""
    sizes = (block_rows * torch.tensor(widths)).reshape(-1)
    return (sizes.cumsum(0) - sizes).reshape(block_rows.shape)


def _assemble(blocks: torch.Tensor, back_rows: torch.Tensor, widths: list[int], specs: tuple,
              bags: list[int]) -> list[torch.Tensor]:
    """Each lookup's pooled rows from the blocks its holders sent (flat, holder-major then
    lookup): added where rows are split, side by side where columns are; ``bags`` rows of zeros
    where no id was sent at all (empty bags pool to zeros)."""
    parts: list[list[tuple[int, torch.Tensor]]] = [[] for _ in specs]
    at = 0
    for h in range(back_rows.shape[0]):
        for j, width in enumerate(widths):
            rows = int(back_rows[h, j])
            if rows:
                parts[j].append((h, blocks[at:at + rows * width].view(rows, width)))
                at += rows * width
    pooled = []
    for j, spec in enumerate(specs):
        if not parts[j]:
            pooled.append(blocks.new_zeros(bags[j], spec[2]))
        elif spec[0] == "column_wise":
            pooled.append(torch.cat([block for _, block in sorted(parts[j], key=lambda item: item[0])], 1))
        else:
            total = parts[j][0][1]
            for _, block in parts[j][1:]:
                total = total + block
            pooled.append(total)
    return pooled


def _to_holders(grads: list[torch.Tensor], back_rows: torch.Tensor, widths: list[int], specs: tuple
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward's outgoing blocks: to each holder that served this rank, the gradient of its bags
    (its columns of it), flat, holder-major then lookup; and their sizes."""
    pieces = []
    for h in range(back_rows.shape[0]):
        for j, (grad, spec) in enumerate(zip(grads, specs)):
            if int(back_rows[h, j]):
                width = widths[j]
                part = grad[:, h * width:(h + 1) * width] if spec[0] == "column_wise" else grad
                pieces.append(part.reshape(-1))
    send = torch.cat(pieces) if pieces else grads[0].new_empty(0)
    return send, (back_rows * torch.tensor(widths)).sum(1)


def table_combine(shards: list, routed: torch.Tensor, counts: torch.Tensor, ids: list, offsets: list, specs: tuple,
                  axis: str, scale: float) -> tuple[torch.Tensor, ...]:
    """Pool the rows of the ids this rank received (``routed``, from :func:`table_dispatch`) of
    each lookup's ``shard`` and send each source its bags, in one all-to-all; returns each
    lookup's pooled rows for this rank's samples (``[bags, dim]``; ``mode="none"``: each id's
    row, shaped like its ids). Backward adds each shard's row gradients, times ``scale``, to its
    :class:`SparseGrad` (no dense gradient)."""
    for spec in specs:
        if spec[4] not in ("sum", "mean", "none"):
            raise NotImplementedError(f"a sharded embedding table pools by sum or mean; mode {spec[4]!r} is not "
                                      "implemented (leave this table unsharded)")
    if is_fake(shards[0]) or is_fake(ids[0]):
        return tuple(shard.new_zeros(*_pooled_shape(t, o, spec[4], spec[5]), spec[2])
                     for shard, t, o, spec in zip(shards, ids, offsets, specs))
    lengths = [_bags(t.long(), o, spec[4], spec[5])[2] for t, o, spec in zip(ids, offsets, specs)]
    pooled = _Combine.apply(routed, counts, lengths, specs, mesh_lib.current().group(axis), scale, *shards)
    return tuple(p.view(*t.shape, spec[2]) if spec[4] == "none" else p for p, t, spec in zip(pooled, ids, specs))


def _pooled_shape(ids: torch.Tensor, offsets: torch.Tensor | None, mode: str, include_last_offset: bool
                  ) -> tuple[int, ...]:
    if mode == "none":
        return tuple(ids.shape)
    return (ids.shape[0] if offsets is None else offsets.shape[0] - (1 if include_last_offset else 0),)


class _Replicated(torch.autograd.Function):
    """:func:`table_replicated` with its backward."""

    @staticmethod
    def forward(ctx, ids, offsets, weights, counts, specs, group, scale, *shards):
        outs = []
        for t, o, w, spec, shard in zip(ids, offsets, weights, specs, shards):
            if spec[4] == "none":
                outs.append(F.embedding(t, shard.detach()))
            else:
                outs.append(F.embedding_bag(t, shard.detach(), o, mode=spec[4], per_sample_weights=w,
                                            include_last_offset=spec[5]))
        ctx.inputs = (ids, offsets, weights, counts)
        ctx.shards = shards  # the parameters themselves: their SparseGrads are keyed by the object
        ctx.plan = (group, specs, scale)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ids, offsets, weights, counts = ctx.inputs
        group, specs, scale = ctx.plan
        rows, values = [], []
        for t, o, w, spec, shard, grad in zip(ids, offsets, weights, specs, ctx.shards, grads):
            flat, bag, lengths, bags = _bags(t.long(), o, spec[4], spec[5])
            grad = shard.new_zeros(bags, shard.shape[1]) if grad is None else grad.reshape(bags, shard.shape[1])
            if spec[4] == "mean":
                grad = grad / lengths.clamp(min=1).unsqueeze(1).to(grad.dtype)
            v = grad[bag]
            if w is not None:
                v = v * w.reshape(-1)[:flat.numel()].to(v.dtype).unsqueeze(1)
            if spec[6] is not None:  # the padding row takes no gradient
                v = v * (flat != spec[6]).unsqueeze(1).to(v.dtype)
            rows.append(flat)
            values.append(v)
        everyone = _all_gather_rows(rows, values, counts[1, :, :, 0], group)
        for shard, pieces in zip(ctx.shards, everyone):
            for r, v in pieces:  # each rank's rows, as they arrived (SparseGrad sums them at the step)
                sparse_grad(shard).add(r, v * scale)
        return (None,) * (7 + len(ctx.shards))


def _all_gather_rows(rows: list[torch.Tensor], values: list[torch.Tensor], everyone: torch.Tensor, group
                     ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every rank's ``(rows, values)`` of each table (``everyone[p, j]`` rows of table ``j`` from
    rank ``p``), per table a list in rank order (views of what arrived): one all-gather of each
    rank's tables laid out one after the other, each as its rows' bits then its values, in the
    values' dtype (padded to the most any rank sends)."""
    if group is None:
        return [[(r, v)] for r, v in zip(rows, values)]
    dtype = values[0].dtype
    words = 8 // values[0].element_size()  # an int64 row index is this many values' bits

    def section(m: int, width: int) -> int:  # a table's rows' bits, then its values padded to whole words
        return m * words + -(-m * width // words) * words

    sizes = [sum(section(int(everyone[p, j]), v.shape[1]) for j, v in enumerate(values))
             for p in range(everyone.shape[0])]
    most = max(sizes)
    pieces = []
    for r, v in zip(rows, values):
        pieces += [r.view(dtype), v.reshape(-1)]
        pad = section(r.numel(), v.shape[1]) - r.numel() * words - v.numel()
        if pad:
            pieces.append(v.new_zeros(pad))
    mine = sum(p.numel() for p in pieces)
    if most > mine:
        pieces.append(values[0].new_zeros(most - mine))
    packed = torch.cat(pieces)
    out = packed.new_empty(len(sizes) * most)
    _all_gather(out, packed, group)
    gathered: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]
    for p in range(len(sizes)):
        at = p * most
        for j, v in enumerate(values):
            m, width = int(everyone[p, j]), v.shape[1]
            gathered[j].append((out[at:at + m * words].view(torch.long),
                                out[at + m * words:at + m * words + m * width].view(m, width)))
            at += section(m, width)
    return gathered


def table_replicated(shards: list, ids: list, offsets: list, weights: list, counts: torch.Tensor, specs: tuple,
                     axis: str, scale: float) -> tuple[torch.Tensor, ...]:
    """Data-parallel tables' lookups on this rank's ids (torch's own, each table whole here); the
    backward all-gathers every rank's rows and row gradients of all of them at once (``counts``
    from :func:`table_counts`: each rank's id count per lookup) and adds them, times ``scale``,
    to each table's :class:`SparseGrad`."""
    for spec in specs:
        if spec[4] not in ("sum", "mean", "none"):
            raise NotImplementedError(f"a sparse embedding table pools by sum or mean; mode {spec[4]!r} is not "
                                      "implemented")
    if is_fake(shards[0]) or is_fake(ids[0]):
        return tuple(shard.new_zeros(*_pooled_shape(t, o, spec[4], spec[5]), shard.shape[1])
                     for shard, t, o, spec in zip(shards, ids, offsets, specs))
    return _Replicated.apply(ids, offsets, weights, counts, specs, mesh_lib.current().group(axis), scale, *shards)


#: The ops the ``shard_embeddings`` pass emits (graphpass.transitions has an entry for each).
TABLE_OPS = (table_counts, table_dispatch, table_combine, table_replicated)
