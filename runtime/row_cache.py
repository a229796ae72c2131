"""HET's cache: each rank keeps hot rows of other ranks' table shards, read and written with
bounded staleness.

A table whose :class:`~graphpass.tables.TableSharding` has a ``cache`` (rows) is looked up by
:func:`table_cached` instead of the pooled exchange of :mod:`graphpass.runtime.embeddings`: each
rank gathers the rows its ids name and pools them itself (torch's ``embedding_bag`` on the
gathered rows), so a row it has cached needs no traffic at all. Per table, in one exchange for
every cached table of the step's lookups:

- the rows of the rank's own shard are read where they are (always current);
- a cached row is read if it is at most ``staleness`` steps old (pulled at step ``t0``, read at
  step ``t``: ``t - t0 <= staleness``; ``staleness=0``: only rows pulled earlier in the same
  step, by another microbatch or lookup);
- the rest (misses) are pulled from the ranks holding them: an all-to-all of how many rows each
  rank asks of each, one of the rows' indices in the holder's shard, one of the rows back (a
  column-wise row from every rank, its columns side by side). Pulled rows enter the cache; past
  its ``capacity`` the rows used least often leave it (LFU, the older pull first among equals).

Backward gives each gathered row its gradient (``embedding_bag``'s own backward on the gathered
rows). A row of the rank's own shard adds it to the shard's
:class:`~graphpass.runtime.embeddings.SparseGrad` at once; another rank's row keeps it here as a
*pending write*, summed over steps, until :func:`push` sends it to the row's holder, at the end
of the step it was made in plus ``staleness`` at most (``staleness=0``: the same step, so every
update is applied as one process applies it). The holder's sparse optimizer then applies it with
the step's other gradients. A cached row is never updated by its reader: it is the holder's row
as pulled, so a read lags the holder by at most ``staleness`` steps and the holder's row lags
the readers' gradients by at most ``staleness`` steps (HET's bounds on reads and on writes;
HET's workers also apply their own updates to their cached copy, which only SGD defines
without the holder's optimizer state).

:func:`push` with ``everything=True`` (a checkpoint's flush) sends every pending write and the
caches empty, so a checkpoint holds every update and a resumed run reads as the saving one does.
Counters (:attr:`RowCache.counters`) record the rows read from the cache, pulled and pushed,
for the benchmarks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from graphpass.runtime import embeddings
from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime.fake import is_fake


class RowCache:
    """One table shard's cache of other ranks' rows and its pending writes to them.

    Args:
        spec: its table's :data:`graphpass.runtime.embeddings.Spec` (sharding, rows, dim, owner...).
        capacity: rows kept at most.
        staleness: steps a cached row may be old when read, and a pending write late.
        dtype: the table's dtype.
    """

    def __init__(self, spec: tuple, capacity: int, staleness: int, dtype: torch.dtype):
        self.spec, self.capacity, self.staleness = spec, capacity, staleness
        width = spec[2]
        self.step = 0  # the steps pushed so far (:func:`push` advances it)
        self.ids = torch.empty(0, dtype=torch.long)  # sorted
        self.values = torch.empty(0, width, dtype=dtype)
        self.pulled = torch.empty(0, dtype=torch.long)  # the step each row was pulled in
        self.uses = torch.empty(0, dtype=torch.long)  # reads of each row since it entered
        self.pending_ids = torch.empty(0, dtype=torch.long)  # sorted
        self.pending = torch.empty(0, width, dtype=dtype)
        self.since = torch.empty(0, dtype=torch.long)  # the step of each row's oldest pending gradient
        self.counters = {"hits": 0, "pulled": 0, "pushed": 0}  # rows, since the cache was made

    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For sorted unique ``ids``: which are cached fresh enough to read now, and their slots."""
        slot = torch.searchsorted(self.ids, ids).clamp(max=max(self.ids.numel() - 1, 0))
        if not self.ids.numel():
            return torch.zeros_like(ids, dtype=torch.bool), slot
        fresh = (self.ids[slot] == ids) & (self.step - self.pulled[slot] <= self.staleness)
        return fresh, slot

    def admit(self, hit_slots: torch.Tensor, hit_uses: torch.Tensor, ids: torch.Tensor, values: torch.Tensor,
              uses: torch.Tensor) -> None:
        """Count the reads of the cached rows read (``hit_slots``), then take the rows just pulled
        (sorted ``ids``, read ``uses`` times), replacing stale copies, and keep the ``capacity``
        rows read most often (the newer pull first among equals)."""
        self.uses.index_add_(0, hit_slots, hit_uses)
        self.counters["hits"] += int(hit_slots.numel())
        if not ids.numel() or not self.capacity:
            return
        slot = torch.searchsorted(self.ids, ids).clamp(max=max(self.ids.numel() - 1, 0))
        stale = torch.zeros_like(self.ids, dtype=torch.bool)
        if self.ids.numel():
            again = self.ids[slot] == ids
            uses = uses + torch.where(again, self.uses[slot], 0)  # a refreshed row keeps its count
            stale[slot[again]] = True
        keep = ~stale
        all_ids = torch.cat([self.ids[keep], ids])
        all_values = torch.cat([self.values[keep], values.to(self.values.dtype)])
        all_pulled = torch.cat([self.pulled[keep], torch.full_like(ids, self.step)])
        all_uses = torch.cat([self.uses[keep], uses])
        if all_ids.numel() > self.capacity:  # most used first, then the latest pulled
            score = all_uses * (self.step + 2) + all_pulled
            chosen = torch.topk(score, self.capacity, sorted=False).indices
            all_ids, all_values, all_pulled, all_uses = (t[chosen] for t in (all_ids, all_values, all_pulled, all_uses))
        order = torch.argsort(all_ids)
        self.ids, self.values, self.pulled, self.uses = (t[order] for t in (all_ids, all_values, all_pulled, all_uses))

    def write(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Keep gradients of other ranks' rows ``ids`` (sorted, unique) until they are pushed."""
        if not ids.numel():
            return
        all_ids = torch.cat([self.pending_ids, ids])
        unique, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
        pending = grads.new_zeros(unique.numel(), grads.shape[1])
        pending.index_add_(0, inverse, torch.cat([self.pending.to(grads.dtype), grads]))
        since = torch.full_like(unique, self.step).scatter_reduce(0, inverse, torch.cat(
            [self.since, torch.full_like(ids, self.step)]), "amin")
        self.pending_ids, self.pending, self.since = unique, pending, since

    def due(self, everything: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the pending writes due at the end of this step (all of them: ``everything``)."""
        due = torch.ones_like(self.since, dtype=torch.bool) if everything else \
            self.since + self.staleness <= self.step
        ids, grads = self.pending_ids[due], self.pending[due]
        self.pending_ids, self.pending, self.since = self.pending_ids[~due], self.pending[~due], self.since[~due]
        return ids, grads

    def clear(self) -> None:
        """Forget every cached row (pending writes stay)."""
        self.ids, self.values = self.ids[:0], self.values[:0]
        self.pulled, self.uses = self.pulled[:0], self.uses[:0]


_CACHES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def row_cache(shard: torch.Tensor, spec: tuple, capacity: int, staleness: int) -> RowCache:
    """The :class:`RowCache` of a table shard (made on first use; ``spec`` is its table's
    :data:`graphpass.runtime.embeddings.Spec`)."""
    cache = _CACHES.get(shard)
    if cache is None:
        cache = _CACHES[shard] = RowCache(spec, capacity, staleness, shard.dtype)
    return cache


def cache_of(shard: torch.Tensor) -> RowCache | None:
    """The :class:`RowCache` of a table shard, None before its first lookup."""
    return _CACHES.get(shard)


def _holders(ids: torch.Tensor, spec: tuple, size: int, rank: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """For sorted ``ids`` of other ranks' rows: ``(rank, which ids, their rows in its shard)`` of
    every rank holding some of them (row-, table- and table-row-wise: the rank of each row,
    :func:`graphpass.runtime.embeddings.destinations`; column-wise: every rank, each with its
    columns of every row)."""
    if spec[0] == "column_wise":
        every = torch.ones_like(ids, dtype=torch.bool)
        return [(p, every, ids) for p in range(size)]
    dest, local = embeddings.destinations(ids, spec, size)
    out = []
    for p in range(size):
        if p != rank:
            which = dest == p
            out.append((p, which, local[which]))
    return out


def _own(ids: torch.Tensor, spec: tuple, size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of ``ids`` this rank's shard holds whole, and their rows in it."""
    if spec[0] == "column_wise":
        return torch.zeros_like(ids, dtype=torch.bool), ids
    dest, local = embeddings.destinations(ids, spec, size)
    return dest == rank, local


def _ask(asks: list[list[torch.Tensor]], group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send ``asks[p][t]`` (rows of table ``t``, as indices into rank ``p``'s shard) to each rank
    ``p``: two all-to-alls, the counts and the indices. Returns ``(sent, received, indices)``:
    ``[n, T]`` counts each way, and the indices received (source-major, then table)."""
    sent = torch.tensor([[a.numel() for a in per] for per in asks], dtype=torch.long)
    received = torch.empty_like(sent)
    embeddings._all_to_all(received, sent, None, None, group)
    indices = torch.cat([a for per in asks for a in per])
    arrived = indices.new_empty(int(received.sum()))
    embeddings._all_to_all(arrived, indices, received.sum(1).tolist(), sent.sum(1).tolist(), group)
    return sent, received, arrived


def _values(blocks: list[list[torch.Tensor]], sent: torch.Tensor, received: torch.Tensor, widths: torch.Tensor,
            dtype: torch.dtype, group) -> list[list[torch.Tensor]]:
    """Send ``blocks[p][t]`` (``sent[p, t]`` rows of ``widths[t]``) to each rank ``p`` in one
    all-to-all; returns what each rank sent here, ``[p][t]`` (``received[p, t]`` rows)."""
    out_sizes, in_sizes = (received * widths).sum(1), (sent * widths).sum(1)
    flat = torch.cat([b.reshape(-1).to(dtype) for per in blocks for b in per])
    arrived = flat.new_empty(int(out_sizes.sum()))
    embeddings._all_to_all(arrived, flat, out_sizes.tolist(), in_sizes.tolist(), group)
    out, at = [], 0
    for p in range(received.shape[0]):
        out.append([])
        for t, w in enumerate(widths.tolist()):
            m = int(received[p, t])
            out[-1].append(arrived[at:at + m * w].view(m, w))
            at += m * w
    return out


def _by_source(received: torch.Tensor, indices: torch.Tensor) -> list[list[torch.Tensor]]:
    """The indices :func:`_ask` received, ``[p][t]``."""
    out, at = [], 0
    for p in range(received.shape[0]):
        out.append([])
        for t in range(received.shape[1]):
            m = int(received[p, t])
            out[-1].append(indices[at:at + m])
            at += m
    return out


def _pull(asks: list[list[torch.Tensor]], shards: list[torch.Tensor], group) -> list[list[torch.Tensor]]:
    """Pull rows: ``asks[p][t]`` the rows of table ``t`` asked of rank ``p`` (indices into its
    shard); returns ``got[p][t]``, what rank ``p`` sent (its columns of those rows). Three
    all-to-alls: the counts, the indices, the rows."""
    sent, received, indices = _ask(asks, group)
    serve = [[shard.detach()[rows] for rows, shard in zip(per, shards)] for per in _by_source(received, indices)]
    widths = torch.tensor([shard.shape[1] for shard in shards])
    return _values(serve, received, sent, widths, shards[0].dtype, group)


def push(shards: list[torch.Tensor], axis: str, *, everything: bool = False) -> None:
    """Send every cached table's pending writes that are due (``everything``: all of them) to the
    ranks holding their rows, which add them to the shard's SparseGrad (for the sparse optimizer's
    next update); one exchange for all ``shards`` (every rank passes the same tables, in the same
    order). Without ``everything`` this ends the step: the caches' clocks advance."""
    group = mesh_lib.current().group(axis)
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    caches = [cache_of(shard) for shard in shards]
    empty = torch.empty(0, dtype=torch.long)
    asks = [[empty for _ in shards] for _ in range(size)]
    blocks = [[shard.new_empty(0, shard.shape[1]) for shard in shards] for _ in range(size)]
    for t, (shard, cache) in enumerate(zip(shards, caches)):
        if cache is None:
            continue
        ids, grads = cache.due(everything)
        width = shard.shape[1]
        for p, which, local in _holders(ids, cache.spec, size, rank):
            asks[p][t] = local
            blocks[p][t] = grads[which][:, p * width:(p + 1) * width] if cache.spec[0] == "column_wise" else grads[which]
        cache.counters["pushed"] += int(ids.numel())
    sent, received, indices = _ask(asks, group)
    widths = torch.tensor([shard.shape[1] for shard in shards])
    arrived = _values(blocks, sent, received, widths, shards[0].dtype, group)
    for per_table, rows_per_table in zip(arrived, _by_source(received, indices)):
        for shard, values, rows in zip(shards, per_table, rows_per_table):
            embeddings.sparse_grad(shard).add(rows, values)
    for cache in caches:
        if cache is not None:
            if everything:
                cache.clear()
            else:
                cache.step += 1


class _Gather(torch.autograd.Function):
    """Each cached table's rows for the ids its lookups read, with their backward (the module
    docstring): ``forward(plan, *shards) -> rows per table``."""

    @staticmethod
    def forward(ctx, plan, *shards):
        wanted, uses, specs, caches, group, size, rank, scale = plan
        gathered, reads = [], []
        asks = [[torch.empty(0, dtype=torch.long) for _ in shards] for _ in range(size)]
        misses = []
        for t, (ids, shard, spec, cache) in enumerate(zip(wanted, shards, specs, caches)):
            own, local = _own(ids, spec, size, rank)
            fresh, slots = cache.find(ids)
            fresh &= ~own
            miss = ~own & ~fresh
            for p, which, holder_rows in _holders(ids[miss], spec, size, rank):
                asks[p][t] = holder_rows
            rows = shard.new_empty(ids.numel(), spec[2])
            if spec[0] != "column_wise":  # a column-wise rank holds no row whole
                rows[own] = shard.detach()[local[own]]
            rows[fresh] = cache.values[slots[fresh]].to(rows.dtype)
            gathered.append(rows)
            misses.append(miss)
            reads.append((own, fresh, slots))
        got = _pull(asks, list(shards), group)
        for t, (ids, spec, cache, rows) in enumerate(zip(wanted, specs, caches, gathered)):
            miss = misses[t]
            pulled = ids[miss]
            if spec[0] == "column_wise":
                values = torch.cat([got[p][t] for p in range(size)], 1)
            else:
                values = rows.new_empty(pulled.numel(), spec[2])
                for p, which, _ in _holders(pulled, spec, size, rank):
                    values[which] = got[p][t]
            rows[miss] = values
            _, fresh, slots = reads[t]
            cache.admit(slots[fresh], uses[t][fresh], pulled, values, uses[t][miss])
            cache.counters["pulled"] += int(pulled.numel())
        ctx.plan = (wanted, specs, caches, size, rank, scale, reads)
        ctx.shards = shards  # the shards themselves: SparseGrads key on them
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *grads):
        wanted, specs, caches, size, rank, scale, reads = ctx.plan
        for ids, shard, spec, cache, (own, _, _), grad in zip(wanted, ctx.shards, specs, caches, reads, grads):
            if grad is None:
                continue
            grad = grad * scale
            local = _own(ids, spec, size, rank)[1]
            if spec[0] != "column_wise":
                embeddings.sparse_grad(shard).add(local[own], grad[own])
            cache.write(ids[~own], grad[~own])
        return (None,) * (1 + len(ctx.shards))


def table_cached(shards: list, ids: list, offsets: list, weights: list, specs: tuple, caches: tuple, axis: str,
                 scale: float) -> tuple[torch.Tensor, ...]:
    """Lookups of tables with a cache (the module docstring): each lookup's pooled rows for this
    rank's samples (``[bags, dim]``; ``mode="none"``: each id's row, shaped like its ids), from
    rows read where they are, from the cache, or pulled in one exchange. ``caches[j]`` is
    ``(capacity, staleness)`` of lookup ``j``'s table; gradients of rows, times ``scale``, go to
    the shard's SparseGrad (own rows) or wait in the cache to be pushed."""
    for spec in specs:
        if spec[4] not in ("sum", "mean", "none"):
            raise NotImplementedError(f"a sharded embedding table pools by sum or mean; mode {spec[4]!r} is not "
                                      "implemented (leave this table unsharded)")
    if is_fake(shards[0]) or is_fake(ids[0]):
        return tuple(shard.new_zeros(*embeddings._pooled_shape(t, o, spec[4], spec[5]), spec[2])
                     for shard, t, o, spec in zip(shards, ids, offsets, specs))
    mesh = mesh_lib.current()
    group = mesh.group(axis)
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    tables: list[torch.Tensor] = []  # each distinct shard once, in order
    of: list[int] = []
    for shard in shards:
        index = next((k for k, s in enumerate(tables) if s is shard), None)
        if index is None:
            index = len(tables)
            tables.append(shard)
        of.append(index)
    flat = [t.reshape(-1).long() for t in ids]
    wanted, inverses, uses = [], [None] * len(ids), []
    for k in range(len(tables)):
        mine = [j for j in range(len(ids)) if of[j] == k]
        unique, inverse, counts = torch.unique(torch.cat([flat[j] for j in mine]), sorted=True, return_inverse=True,
                                               return_counts=True)
        at = 0
        for j in mine:
            inverses[j] = inverse[at:at + flat[j].numel()]
            at += flat[j].numel()
        wanted.append(unique)
        uses.append(counts)
    first = [of.index(k) for k in range(len(tables))]
    table_specs = [specs[j] for j in first]
    table_caches = [row_cache(tables[k], specs[first[k]], *caches[first[k]]) for k in range(len(tables))]
    rows = _Gather.apply((wanted, uses, table_specs, table_caches, group, size, rank, scale), *tables)
    pooled = []
    for j, (t, o, w, spec) in enumerate(zip(ids, offsets, weights, specs)):
        table_rows, inverse = rows[of[j]], inverses[j].view(t.shape)
        if spec[4] == "none":
            padding = None
            if spec[6] is not None:
                at = torch.searchsorted(wanted[of[j]], torch.tensor([spec[6]]))
                if at < wanted[of[j]].numel() and wanted[of[j]][at] == spec[6]:
                    padding = int(at)
            pooled.append(F.embedding(inverse, table_rows, padding_idx=padding))
        else:
            pooled.append(F.embedding_bag(inverse, table_rows, o, mode=spec[4], per_sample_weights=w,
                                          include_last_offset=spec[5]))
    return tuple(pooled)
