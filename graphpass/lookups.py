"""The embedding lookups of a captured graph, and a check of the ids they read before each step.

An id outside its table (negative, or at least the table's row count) makes torch raise deep
inside the lookup (``IndexError: index out of range in self``), naming neither the table nor
the input, and only on the ranks whose share holds the id: the others go on to the step's
collectives and wait for a rank that has failed. Where a table is sharded, a rank looks up only
the ids in its rows, so an id past the end would read nothing at all. graphpass checks the ids
instead, on every rank, on the whole global batch, before the step starts, and names the input,
the table and the id.

:class:`IdCheck` holds, for each lookup (``aten.embedding``, ``aten.embedding_bag``) whose ids
are computed from the inputs alone (read as they are, picked out of a table-major tensor by
``select`` / ``unbind``, cast, hashed by ``%``...), a small program of just those nodes, which it
runs on the global batch and compares with the table's rows. A lookup whose ids pass through a
parameter or buffer (an id remapping table) is left to torch's own check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx

from graphpass import meta
from graphpass.tables import LOOKUPS

@dataclass(frozen=True)
class Lookup:
    """One embedding lookup: its node, the table's state key and rows, the input(s) its ids come from."""

    node: str
    table: str
    rows: int
    inputs: tuple[str, ...]


def _slice(ids: fx.Node) -> list[fx.Node] | None:
    """The nodes ``ids`` is computed from, if they are inputs and ops on them alone (else None)."""
    seen: dict[fx.Node, None] = {}
    stack = [ids]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op in ("get_attr", "call_module") or (node.op == "call_function" and meta.get(node, meta.OPAQUE, False)):
            return None
        seen[node] = None
        stack.extend(node.all_input_nodes)
    return list(seen)


class IdCheck:
    """The ids of a graph's lookups, computed from a global batch and checked against the tables.

    Args:
        gm: the captured graph (before any pass shards a table).
    """

    def __init__(self, gm: fx.GraphModule):
        self.lookups: list[Lookup] = []
        wanted: set[fx.Node] = set()
        outputs: list[fx.Node] = []
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target not in LOOKUPS:
                continue
            table, ids = node.args[0], node.args[1]
            if not (isinstance(table, fx.Node) and table.op == "get_attr" and isinstance(ids, fx.Node)):
                continue
            nodes = _slice(ids)
            if nodes is None:
                continue
            keys = meta.get(table, meta.STATE_KEYS, ()) or (table.target,)
            rows = meta.get(table, meta.VAL).shape[0]
            self.lookups.append(Lookup(node.name, keys[0], int(rows), tuple(n.name for n in nodes if n.op == "placeholder")))
            wanted.update(nodes)
            outputs.append(ids)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder" or node in wanted:
                env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in outputs))
        self._program = fx.GraphModule(torch.nn.Module(), graph) if self.lookups else None

    def __bool__(self) -> bool:
        return bool(self.lookups)

    def __call__(self, shares: Sequence[Sequence[torch.Tensor]]) -> None:
        """Check the ids of the batch given as ``shares`` (the whole batch as one share, or its
        equal shares when the program's shapes tie it to them).

        Raises:
            ValueError: naming the input, the table, its rows, the id and where it is.
        """
        if self._program is None:
            return
        for share in shares:
            with torch.no_grad():
                all_ids = self._program(*share)
            for lookup, ids in zip(self.lookups, all_ids):
                bad = (ids < 0) | (ids >= lookup.rows)
                if bool(bad.any()):
                    at = tuple(int(i) for i in bad.nonzero()[0])
                    value = int(ids[at])
                    raise ValueError(
                        f"input {' / '.join(repr(i) for i in lookup.inputs)} looks up id {value} in table "
                        f"{lookup.table!r} ({lookup.rows} rows, lookup {lookup.node!r}), at position {list(at)} of "
                        f"the ids that table reads; ids must be in 0..{lookup.rows - 1}")

    def ids(self, batch: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each table's ids in ``batch`` (all its lookups' ids, flat), by table state key: what
        the planner's profile of the id distribution counts."""
        if self._program is None:
            return {}
        with torch.no_grad():
            all_ids = self._program(*batch)
        out: dict[str, list[torch.Tensor]] = {}
        for lookup, ids in zip(self.lookups, all_ids):
            out.setdefault(lookup.table, []).append(ids.reshape(-1).long())
        return {table: torch.cat(parts) for table, parts in out.items()}

    def check(self, batch: Sequence[torch.Tensor], shares: Callable[[], Sequence[Sequence[torch.Tensor]]]) -> None:
        """Check ``batch`` as one share, or, where the program's shapes do not take the whole
        batch (a view of a share's size), each of ``shares()``."""
        try:
            self([batch])
        except (RuntimeError, IndexError):
            self(shares())
