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

:func:`choose` takes, for every table, its fastest kind, then moves the tables whose memory
costs the most time to save onto kinds that hold less until the tables fit their budget
(largest memory saved per second lost first): the plan's choice and its reason per table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from graphpass.tables import balance_owners

KINDS = ("data_parallel", "table_wise", "row_wise", "column_wise")


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


@dataclass(frozen=True)
class TableOption:
    """One table under one kind: bytes on the rank that holds the most of it, and seconds per step."""

    kind: str
    bytes: float
    time_s: float


def options(table: TableCost, n: int, local_batch: float, state_per_element: int, state_per_row: int,
            time_of: Callable[[str, float], float]) -> list[TableOption]:
    """``table`` under each kind on ``n`` ranks; ``time_of(kind, bytes)`` is one collective over
    the data-parallel axis (``"all_to_all"``, ``"all_gather"``)."""
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
    return out


@dataclass(frozen=True)
class TableChoices:
    """The search's tables: each table's kind (and owner), the bytes on the fullest rank, the
    seconds per step, and a reason per table."""

    kinds: dict[str, tuple[str, int]]
    bytes: float
    time_s: float
    reasons: tuple[str, ...]


def choose(tables: Sequence[TableCost], n: int, local_batch: float, state_per_element: int, state_per_row: int,
           time_of: Callable[[str, float], float], budget_bytes: float) -> TableChoices | None:
    """Each table's kind: the fastest, then the cheapest trade of time for memory until the
    tables' fullest rank holds at most ``budget_bytes``; None when no choice fits."""
    opts = {t.name: options(t, n, local_batch, state_per_element, state_per_row, time_of) for t in tables}
    picked = {name: min(o, key=lambda x: (x.time_s, x.bytes)) for name, o in opts.items()}
    fastest = dict(picked)
    while True:
        owners_of, fullest = owners(tables, picked, n)
        if fullest <= budget_bytes:
            break
        # the move that saves the most memory per second it costs
        moves = [(name, alt) for name, o in opts.items() for alt in o if alt.bytes < picked[name].bytes]
        if not moves:
            return None
        name, alt = max(moves, key=lambda m: ((picked[m[0]].bytes - m[1].bytes)
                                             / max(m[1].time_s - picked[m[0]].time_s, 1e-12)))
        picked[name] = alt
    reasons = []
    for t in tables:
        chosen = picked[t.name]
        why = ("fastest" if chosen is fastest[t.name] else
               f"fits (fastest, {fastest[t.name].kind}, would hold {fastest[t.name].bytes / 2**30:.2f} GiB a rank)")
        reasons.append(f"table {t.name} [{t.rows:,} x {t.dim}]: {chosen.kind}"
                       + (f" on rank {owners_of[t.name]}" if chosen.kind == "table_wise" else "")
                       + f", {chosen.bytes / 2**30:.3f} GiB on its fullest rank, {chosen.time_s * 1e3:.2f} ms a step: {why}")
    kinds = {name: (o.kind, owners_of.get(name, 0)) for name, o in picked.items()}
    return TableChoices(kinds, fullest, sum(o.time_s for o in picked.values()), tuple(reasons))


def owners(tables: Sequence[TableCost], picked: dict[str, TableOption], n: int) -> tuple[dict[str, int], float]:
    """Table-wise tables' owners (:func:`graphpass.tables.balance_owners`, as the plan builder
    places them) and the fullest rank's bytes: theirs, plus every other table's share, which
    every rank holds."""
    spread = sum(picked[t.name].bytes for t in tables if picked[t.name].kind != "table_wise")
    owned, held = balance_owners({t.name: picked[t.name].bytes for t in tables if picked[t.name].kind == "table_wise"},
                                 n)
    return owned, spread + max(held, default=0.0)
