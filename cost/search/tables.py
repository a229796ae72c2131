"""Embedding tables in the search: each table's sharding, priced per rank, chosen under memory.

A plan that shards tables (``graphpass.tables``) holds each table's rows once over ``n``
data-parallel ranks (or whole on every rank) and moves ids and pooled rows instead of the
table's gradient. For every table and kind this prices, per rank and step:

- memory: the table and its sparse optimizer's state where the kind puts them (whole on every
  rank for ``data_parallel``; on its owner for ``table_wise``, the search then balancing
  owners; ``1/n`` of the rows or columns for ``row_wise`` / ``column_wise``; a row-wise state is
  one value per row, kept whole under column-wise);
- time: the collectives of the transition table's entries for the exchange, with ``b`` samples
  per rank, ``f`` ids and ``g`` bags per sample (measured from the example batch), a row of
  ``d`` elements of ``e`` bytes: ``table ids`` moves ``16 f b`` bytes (``16 n f b`` column-wise:
  every rank gets every id), ``table pooled`` ``n g b d e`` (row-wise: a block from every
  holder; ``g b d e`` table- and column-wise), forward and backward; ``table replicated
  gradients`` all-gathers ``n f b (d + 2) e``. The counts exchange is one latency.

With a profile of the table's ids (:attr:`TableCost.id_counts`, counted in the example batch)
each routed kind is also priced with HET's cache (``graphpass.runtime.row_cache``) of
:data:`CACHE_SHARES` of its rows: a rank reading ``m = f b`` ids drawn from the profile reads
row ``i`` in a step with chance ``q_i = 1 - (1 - p_i)^m``. A row among the ``C`` most read
(what an LFU cache of ``C`` rows keeps) is pulled, then read from the cache for ``s`` steps
(staleness ``s``), so it is pulled ``q_i / (1 + s q_i)`` times a step (once a step when read
every step, once every ``s + 1`` steps at most), and its gradient pushed as often; the others
``q_i``. ``r`` times that many rows go each way (``r``: the share of rows on other ranks,
``(n - 1) / n``; column-wise every row, a part from each rank), each with its 8-byte index:
the table's "table cached rows" entry, and the cache's ``C`` rows (plus 24 bytes of index each)
in memory. At ``s = 0`` the cache reads nothing across steps and the option is the exact
pull-style lookup: rows gathered to the reader instead of pooled at their holders. A profile
from one batch sees only the ids that batch reads: rarer ids are missing from it, so the
predicted hit share is an upper bound (sample more batches for a closer one).

:func:`choose` takes, for every table, its fastest kind, then moves the tables whose memory
costs the most time to save onto kinds that hold less until the tables fit their budget
(largest memory saved per second lost first): the plan's choice and its reason per table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from graphpass.tables import balance_owners, cached_rows
from graphpass.transitions import TABLE

KINDS = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise")
#: the cache sizes priced, as shares of a table's rows
CACHE_SHARES = (0.01, 0.05, 0.2)


@dataclass(frozen=True)
class TableCost:
    """One embedding table as the graph side measures it.

    Attributes:
        name: its ``get_attr`` node's name (the plan's key).
        rows, dim: its shape; ``element_bytes`` its dtype's size.
        ids_per_sample: ids the step's lookups read per sample (all lookups of the table).
        bags_per_sample: pooled rows per sample (one per bag lookup; a plain lookup's ids each).
    """

    name: str
    rows: int
    dim: int
    element_bytes: int
    ids_per_sample: float
    bags_per_sample: float
    #: the profile of its ids: how often each distinct id was read in the example batch, most
    #: read first (empty: no profile, e.g. ids on the meta device; no cache is priced)
    id_counts: tuple[int, ...] = ()

    def reads(self, ids: float, capacity: int, staleness: int) -> tuple[float, float]:
        """``(D, P)``: the distinct rows a rank reading ``ids`` ids drawn from the profile reads
        in a step, and how many of them it pulls with a cache of the ``capacity`` most read rows
        at ``staleness`` (the module docstring)."""
        counts = torch.tensor(self.id_counts, dtype=torch.float64)
        q = 1.0 - (1.0 - counts / counts.sum()) ** ids  # each row's chance to be read in a step
        kept = q[:capacity]
        return float(q.sum()), float(q[capacity:].sum() + (kept / (1.0 + staleness * kept)).sum())


@dataclass(frozen=True)
class TableOption:
    """One table under one kind: bytes on the rank that holds the most of it, and seconds per
    step; with a cache, its rows and the share of the rows read that it serves."""

    kind: str
    bytes: float
    time_s: float
    cache: int = 0
    hits: float = 0.0


def _cached(table: TableCost, kind: str, held: float, n: int, local_batch: float, staleness: int,
            time_of: Callable[[str, float], float], shares: Sequence[float]) -> list[TableOption]:
    """``kind`` (holding ``held`` bytes a rank) with a cache of each of ``shares`` of its rows
    (the module docstring)."""
    out = []
    e, d = table.element_bytes, table.dim
    holders = n if kind == "column_wise" else 1
    # the share of a rank's rows on other ranks: all of them column-wise, (n - 1) / n row-wise and
    # on average table-wise (and table-row-wise: a group of g holds g / n of the tables)
    remote = 1.0 if kind == "column_wise" else (n - 1) / n
    entry = TABLE["table cached rows"]
    for share in shares:
        capacity = cached_rows(share, table.rows)
        distinct, pulled = table.reads(table.ids_per_sample * local_batch, capacity, staleness)
        rows = remote * pulled  # pulled, and pushed, a step
        requests = time_of("all_to_all", 8.0 * n) + time_of("all_to_all", 8.0 * rows * holders)
        pull = requests + sum(time_of("all_to_all", size) for _, size in entry.movements(rows * d * e, n))
        push = requests + time_of("all_to_all", rows * d * e)
        hits = 1.0 - rows / (remote * distinct) if distinct else 0.0
        out.append(TableOption(kind, held + capacity * (d * e + 24), pull + push, capacity, hits))
    return out


def options(table: TableCost, n: int, local_batch: float, state_per_element: int, state_per_row: int,
            time_of: Callable[[str, float], float], staleness: int = 0,
            shares: Sequence[float] = CACHE_SHARES, group: int = 0) -> list[TableOption]:
    """``table`` under each kind on ``n`` ranks (table-row-wise over ``group`` ranks, a node's,
    where ``group`` divides ``n``), and each routed kind with a cache of each of
    ``shares`` of its rows at ``staleness`` where the table has an id profile; ``time_of(kind,
    bytes)`` is one collective over the data-parallel axis (``"all_to_all"``, ``"all_gather"``)."""
    e, d, rows = table.element_bytes, table.dim, table.rows
    whole = rows * d * e * (1 + state_per_element) + rows * 4 * state_per_row
    ids = 16.0 * table.ids_per_sample * local_batch
    pooled = table.bags_per_sample * local_batch * d * e
    counts = time_of("all_to_all", 16.0 * n)
    out = [TableOption("data_parallel", whole,
                       counts + time_of("all_gather", n * table.ids_per_sample * local_batch * (d + 2) * e))]
    if n == 1:
        return out
    out.append(TableOption("table_wise", whole, counts + time_of("all_to_all", ids) + 2 * time_of("all_to_all", pooled)))
    out.append(TableOption("row_wise", math.ceil(rows / n) * (d * e * (1 + state_per_element) + 4 * state_per_row),
                           counts + time_of("all_to_all", ids) + 2 * time_of("all_to_all", n * pooled)))
    if d % n == 0:
        out.append(TableOption("column_wise", rows * d // n * e * (1 + state_per_element) + rows * 4 * state_per_row,
                               counts + time_of("all_to_all", n * ids) + 2 * time_of("all_to_all", pooled)))
    if group and n % group == 0:  # a block from each of the group's holders (all n: row-wise's twin)
        out.append(TableOption("table_row_wise",
                               math.ceil(rows / group) * (d * e * (1 + state_per_element) + 4 * state_per_row),
                               counts + time_of("all_to_all", ids) + 2 * time_of("all_to_all", group * pooled)))
    if table.id_counts:
        out += [cached for option in out[1:] for cached in _cached(table, option.kind, option.bytes, n, local_batch,
                                                                   staleness, time_of, shares)]
    return out


@dataclass(frozen=True)
class TableChoices:
    """The search's tables: each table's kind (and owner), the bytes on the fullest rank, the
    seconds per step, and a reason per table."""

    kinds: dict[str, tuple[str, int, int]]  # (kind, owner, cached rows)
    bytes: float
    time_s: float
    reasons: tuple[str, ...]


def frontier(tables: Sequence[TableCost], n: int, local_batch: float, state_per_element: int, state_per_row: int,
             time_of: Callable[[str, float], float], staleness: int = 0, group: int = 0) -> list[TableChoices]:
    """The tables' choices from the fastest (each table's fastest kind and cache) to the
    smallest, each step the move that saves the most memory per second it costs: the trade of
    time for memory the search walks (fullest rank's bytes falling, seconds rising)."""
    opts = {t.name: options(t, n, local_batch, state_per_element, state_per_row, time_of, staleness, group=group)
            for t in tables}
    picked = {name: min(o, key=lambda x: (x.time_s, x.bytes)) for name, o in opts.items()}
    fastest = dict(picked)
    path = [_choices(tables, picked, fastest, n, staleness, group)]
    while True:
        moves = [(name, alt) for name, o in opts.items() for alt in o if alt.bytes < picked[name].bytes]
        if not moves:
            return path
        name, alt = max(moves, key=lambda m: ((picked[m[0]].bytes - m[1].bytes)
                                             / max(m[1].time_s - picked[m[0]].time_s, 1e-12)))
        picked[name] = alt
        step = _choices(tables, picked, fastest, n, staleness, group)
        if step.bytes < path[-1].bytes:  # a move that balances owners worse saves nothing: not a point
            path.append(step)


def choose(tables: Sequence[TableCost], n: int, local_batch: float, state_per_element: int, state_per_row: int,
           time_of: Callable[[str, float], float], budget_bytes: float, staleness: int = 0,
           group: int = 0) -> TableChoices | None:
    """The fastest point of the :func:`frontier` whose fullest rank holds at most
    ``budget_bytes``; None when none fits."""
    return next((c for c in frontier(tables, n, local_batch, state_per_element, state_per_row, time_of, staleness,
                                     group) if c.bytes <= budget_bytes), None)


def _choices(tables: Sequence[TableCost], picked: dict[str, TableOption], fastest: dict[str, TableOption], n: int,
             staleness: int, group: int) -> TableChoices:
    owners_of, fullest = owners(tables, picked, n, group)
    reasons = []
    for t in tables:
        chosen = picked[t.name]
        why = ("fastest" if chosen is fastest[t.name] else
               f"fits (fastest, {fastest[t.name].kind}, would hold {fastest[t.name].bytes / 2**30:.2f} GiB a rank)")
        reasons.append(f"table {t.name} [{t.rows:,} x {t.dim}]: {chosen.kind}"
                       + (f" on rank {owners_of[t.name]}" if chosen.kind == "table_wise" else
                          f" on ranks {owners_of[t.name]}..{owners_of[t.name] + group - 1}"
                          if chosen.kind == "table_row_wise" else "")
                       + (_cache_reason(chosen, staleness) if chosen.cache else "")
                       + f", {chosen.bytes / 2**30:.3f} GiB on its fullest rank, {chosen.time_s * 1e3:.2f} ms a step: {why}")
    kinds = {name: (o.kind, owners_of.get(name, 0), o.cache) for name, o in picked.items()}
    return TableChoices(kinds, fullest, sum(o.time_s for o in picked.values()), tuple(reasons))


def _cache_reason(option: TableOption, staleness: int) -> str:
    if staleness == 0:
        return (f", rows pulled to their readers and pooled there (exact: staleness 0; its {option.cache:,}-row cache "
                "serves only repeats within a step)")
    return (f", {option.cache:,} rows cached at staleness {staleness} ({max(option.hits, 0.0):.0%} of the other "
            "ranks' rows predicted read from the cache)")


def owners(tables: Sequence[TableCost], picked: dict[str, TableOption], n: int, group: int = 0
           ) -> tuple[dict[str, int], float]:
    """Table-wise tables' owners and table-row-wise tables' groups (their first rank), each
    balanced by :func:`graphpass.tables.balance_owners` as the plan builder places them, and the
    fullest rank's bytes: its own and its group's, plus every other table's share, which every
    rank holds."""
    def of(kind: str) -> dict[str, float]:
        return {t.name: picked[t.name].bytes for t in tables if picked[t.name].kind == kind}

    spread = sum(picked[t.name].bytes for t in tables if picked[t.name].kind not in ("table_wise", "table_row_wise"))
    owned, held = balance_owners(of("table_wise"), n)
    groups, group_held = balance_owners(of("table_row_wise"), n // group if group else 1)
    owned.update({name: g * group for name, g in groups.items()})
    return owned, spread + max(held[r] + group_held[r // group if group else 0] for r in range(n))
