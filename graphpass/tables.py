"""Embedding tables: which weights of a graph are tables, how a plan shards each, and the sparse
optimizer that updates them.

A *table* is a weight that only embedding lookups read (``nn.EmbeddingBag``, ``nn.Embedding``
whose weight is not tied to another op, such as an LM head). Its gradient is sparse: a step
touches the rows its ids name. A plan that names a sharding for a table (its
:attr:`~graphpass.layout.TensorPlan.table`) takes it out of the dense data-parallel path: the
``shard_embeddings`` pass cuts it over the data-parallel axis and routes the ids to the ranks
that hold their rows (:mod:`graphpass.runtime.embeddings`), its gradient never becomes a dense
tensor, and the plan's :class:`SparseOptimizer` updates the rows a step touched, once per step,
with its state sharded like the table (:mod:`graphpass.runtime.sparse_optim`). The user's
optimizer steps the dense parameters only.

Sharding kinds (TorchRec's words), over the ``n`` ranks of the data-parallel axis:

- ``"data_parallel"``: every rank holds the whole table and looks up its own ids; the step's
  touched rows and their gradients are gathered from every rank, so every rank applies the same
  update;
- ``"table_wise"``: one rank (``owner``) holds the whole table; every rank sends it the ids of
  its samples and gets their pooled rows back;
- ``"row_wise"``: rank ``r`` holds rows ``[r c, (r + 1) c)``, ``c = ceil(rows / n)`` (the last
  shards padded, as ZeRO's); an id goes to the rank holding its row, and each bag's partial sums
  come back to be added;
- ``"column_wise"``: rank ``r`` holds columns ``[r d / n, (r + 1) d / n)`` of every row; every
  rank's ids go to every rank, and the pooled columns come back side by side;
- ``"table_row_wise"``: the ``ranks`` ranks from ``owner`` on (a node) hold the table row-wise
  among them, rank ``owner + i`` rows ``[i c, (i + 1) c)``, ``c = ceil(rows / ranks)``; the
  other ranks hold none of it. An id goes to the rank of its row in that group, as row-wise
  (TorchRec's table-row-wise: the table's exchange stays inside one node's fast links for the
  rows, and its pooled blocks come back from ``ranks`` holders instead of ``n``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx

#: the sharding kinds, as TorchRec names them
SHARDINGS = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise")
#: the sparse optimizers (FBGEMM's fused ones): plain SGD, Adagrad (a state per element),
#: row-wise Adagrad (one state per row), lazy Adam (torch.optim.SparseAdam: moments of the
#: touched rows only)
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "lazy_adam")

#: the lookup ops: the table is argument 0, the ids argument 1
LOOKUPS = {
    torch.ops.aten.embedding.default,
    torch.ops.aten.embedding_bag.default,
    torch.ops.aten.embedding_bag.padding_idx,
    torch.ops.aten._embedding_bag.default,
    torch.ops.aten._embedding_bag_forward_only.default,
}


@dataclass(frozen=True)
class TableSharding:
    """How a plan shards one embedding table over the data-parallel axis.

    Attributes:
        kind: one of :data:`SHARDINGS`.
        owner: for ``"table_wise"``, the data-parallel rank that holds the table; for
            ``"table_row_wise"``, the first rank of the group holding its rows.
        ranks: for ``"table_row_wise"``, how many consecutive ranks (from ``owner``) hold its
            rows (a node's); 0 for the other kinds.
        cache: HET's cache: how many rows of other ranks' shards each rank keeps (hot rows,
            evicted by use count; :mod:`graphpass.runtime.row_cache`); 0: none, every lookup goes
            to the rows' holders. Row-, table- and column-wise tables only.
        staleness: with a cache, how many steps old a cached row may be when read, and how many
            steps late a row's gradient may reach its holder; 0 is exact.
    """

    kind: str
    owner: int = 0
    cache: int = 0
    staleness: int = 0
    ranks: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SHARDINGS:
            raise ValueError(f"TableSharding.kind must be one of {SHARDINGS}, got {self.kind!r}")
        for name in ("owner", "cache", "staleness", "ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TableSharding.{name} must be an int >= 0, got {value!r}")
        if self.cache and self.kind == "data_parallel":
            raise ValueError(f"TableSharding(kind='data_parallel', cache={self.cache}): a data-parallel table is whole "
                             "on every rank, so there is nothing to cache; use cache=0, or a row_wise / table_wise / "
                             "column_wise table")
        if self.staleness and not self.cache:
            raise ValueError(f"TableSharding.staleness={self.staleness} bounds how old cached rows may be, but "
                             "cache=0 caches none; give the table a cache (rows) or use staleness=0")
        if (self.kind == "table_row_wise") != (self.ranks > 0):
            raise ValueError(f"TableSharding(kind={self.kind!r}, ranks={self.ranks}): "
                             + ("a table_row_wise table names how many ranks hold its rows (ranks >= 1, a node's)"
                                if self.kind == "table_row_wise" else "only a table_row_wise table takes ranks"))

    @property
    def holders(self) -> range:
        """The data-parallel ranks holding rows of the table, of ``n`` (row- and column-wise,
        data-parallel: all of them; table_wise: the owner; table_row_wise: its group)."""
        return range(self.owner, self.owner + (self.ranks or 1))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, **({"owner": self.owner} if self.kind in ("table_wise", "table_row_wise")
                                                    else {})}
        if self.ranks:
            out["ranks"] = self.ranks
        if self.cache:
            out.update(cache=self.cache, staleness=self.staleness)
        return out

    @classmethod
    def from_json(cls, data: Any) -> "TableSharding":
        if isinstance(data, str):
            return cls(data)
        fields = {"kind", "owner", "cache", "staleness", "ranks"}
        if not isinstance(data, Mapping) or "kind" not in data or set(data) - fields:
            raise ValueError(f"a table sharding is {{'kind': one of {SHARDINGS}, 'owner': rank, 'cache': rows, "
                             f"'staleness': steps, 'ranks': table_row_wise's group}}, got {data!r}")
        return cls(**data)

    def __str__(self) -> str:
        text = self.kind + (f" on rank {self.owner}" if self.kind == "table_wise" else
                            f" on ranks {self.owner}..{self.owner + self.ranks - 1}" if self.ranks else "")
        if self.cache:
            text += f", {self.cache} rows cached" + (f" {self.staleness} steps stale at most" if self.staleness
                                                     else " (exact)")
        return text


@dataclass(frozen=True)
class SparseOptimizer:
    """The optimizer of a plan's sharded embedding tables, applied to the rows each step touches.

    Attributes:
        kind: one of :data:`OPTIMIZERS`.
        lr: the learning rate.
        eps: Adagrad's and Adam's term added to the root of the second moment.
        betas: lazy Adam's moment decays.
    """

    kind: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-10
    betas: tuple[float, float] = field(default=(0.9, 0.999))

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"SparseOptimizer.kind must be one of {OPTIMIZERS}, got {self.kind!r}")
        for name in ("lr", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"SparseOptimizer.{name} must be a number >= 0, got {value!r}")
        object.__setattr__(self, "betas", tuple(self.betas))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"SparseOptimizer.betas must be two numbers in [0, 1), got {self.betas!r}")

    @property
    def states(self) -> int:
        """Optimizer state values per table element (row-wise Adagrad: one per row, priced as 0)."""
        return {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 0, "lazy_adam": 2}[self.kind]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "lr": self.lr, "eps": self.eps, "betas": list(self.betas)}

    @classmethod
    def from_json(cls, data: Any) -> "SparseOptimizer":
        if not isinstance(data, Mapping) or set(data) - {"kind", "lr", "eps", "betas"}:
            raise ValueError(f"Plan.embedding_optimizer must be an object with some of kind, lr, eps, betas; got {data!r}")
        return cls(**{k: tuple(v) if k == "betas" else v for k, v in data.items()})


def balance_owners(sizes: Mapping[str, float], num_ranks: int) -> tuple[dict[str, int], list[float]]:
    """Owners of table-wise tables of ``sizes`` (by name): largest first, each to the rank that
    holds the least so far (TorchRec's greedy balance by size); and what each rank then holds."""
    held = [0.0] * num_ranks
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(num_ranks), key=lambda r: (held[r], r))
        owners[name] = rank
        held[rank] += sizes[name]
    return owners, held


def tables(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """The graph's embedding tables: each ``get_attr`` of a parameter that only lookups read
    (as their table), with those lookups."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.users:
            continue
        users = list(node.users)
        if all(u.op == "call_function" and u.target in LOOKUPS and u.args[0] is node
               and node not in u.args[1:] for u in users):
            out[node] = users
    return out


#: each sharding's placement on ``dp`` in torch's words (None: ``Replicate()``)
PLACEMENT_DIM = {"row_wise": 0, "column_wise": 1, "data_parallel": None, "table_wise": None, "table_row_wise": 0}


def check_plan(plan) -> None:
    """Raise unless ``plan``'s table entries agree with each other and with its mesh.

    Raises:
        ValueError: naming the entry or field and what to change.
    """
    from torch.distributed.tensor.placement_types import Replicate, Shard

    sharded = {name: t for name, t in plan.tensors.items() if t.table is not None}
    optimizer = plan.embedding_optimizer
    if optimizer is not None and not isinstance(optimizer, SparseOptimizer):
        raise ValueError(f"Plan.embedding_optimizer must be a graphpass.SparseOptimizer, got {optimizer!r}")
    if sharded and optimizer is None:
        raise ValueError(f"Plan.tensors {sorted(sharded)[:3]} shard embedding tables, whose gradients are sparse and "
                         "reach no user optimizer: set Plan.embedding_optimizer (a graphpass.SparseOptimizer)")
    if optimizer is not None and not sharded:
        raise ValueError("Plan.embedding_optimizer is set, but no entry of Plan.tensors shards a table "
                         "(TensorPlan.table); drop it or shard the tables")
    dp = plan.mesh.size("dp")
    for name, t in sharded.items():
        if not isinstance(t.table, TableSharding):
            raise ValueError(f"Plan.tensors[{name!r}].table must be a graphpass.TableSharding, got {t.table!r}")
        field_name = f"Plan.tensors[{name!r}]"
        if t.zero:
            raise ValueError(f"{field_name}: a sharded table (table {t.table.kind}) is not also ZeRO-sharded; "
                             "drop zero")
        if t.table.kind == "table_wise" and t.table.owner >= dp:
            raise ValueError(f"{field_name}.table: owner {t.table.owner} is not a rank of dp={dp}; use 0..{dp - 1}")
        if t.table.kind == "table_row_wise" and t.table.holders.stop > dp:
            raise ValueError(f"{field_name}.table: ranks {t.table.owner}..{t.table.holders.stop - 1} hold its rows, "
                             f"but dp={dp} has ranks 0..{dp - 1}")
        dim = PLACEMENT_DIM[t.table.kind]
        want = Replicate() if dim is None else Shard(dim)
        if t.placement("dp") != want:
            raise ValueError(f"{field_name}: table {t.table.kind} is {_spelled(want)} on dp in torch's words, but its "
                             f"placement says {_spelled(t.placement('dp'))}; make them agree")
        others = [axis for axis, p in t.placements.items() if axis != "dp" and p != Replicate()]
        if others:
            raise ValueError(f"{field_name}: a sharded table is cut over dp only, not {others}")


def _spelled(placement) -> str:
    """A placement as graphpass writes it (``Shard(0)``; graphpass.layout's spelling, which
    imports this module)."""
    dim = getattr(placement, "dim", None)
    return f"Shard({dim})" if dim is not None else f"{type(placement).__name__}()"


def problems(plan, node: fx.Node) -> list[str]:
    """What keeps table ``node`` of the graph from the sharding ``plan`` gives it: readers other
    than lookups, more ranks than rows, columns that do not divide, lookups the sharded
    lookup does not compute (max pooling, gradients scaled by frequency, a padding index)."""
    t = plan.tensor(node.name)
    field_name = f"Plan.tensors[{node.name!r}].table"
    found = tables(node.graph.owning_module)
    if node not in found:
        readers = sorted(u.name for u in node.users)
        return [f"{field_name}: {node.target!r} is read by {readers[:4]}, not only by embedding lookups; only a "
                "table whose weight nothing else reads (not tied to an LM head) is sharded as a table"]
    rows, dim = node.meta["val"].shape  # graphpass.meta.VAL (meta imports the layout, which imports this)
    dp = plan.mesh.size("dp")
    out = []
    if t.table.kind == "row_wise" and rows < dp:
        out.append(f"{field_name}: row_wise over dp={dp} ranks, but {node.target!r} has {rows} rows: a table sharded "
                   f"more ways than its rows; use table_wise or data_parallel")
    if t.table.kind == "table_row_wise" and rows < t.table.ranks:
        out.append(f"{field_name}: table_row_wise over {t.table.ranks} ranks, but {node.target!r} has {rows} rows: a "
                   "table sharded more ways than its rows; use table_wise or data_parallel")
    if t.table.kind == "column_wise" and dim % dp:
        out.append(f"{field_name}: column_wise over dp={dp} ranks, but {node.target!r} has {dim} columns, which do "
                   "not divide; use row_wise or table_wise")
    for lookup in found[node]:
        why = _unsupported(lookup)
        if why:
            out.append(f"{field_name}: lookup {lookup.name!r} {why}; leave this table unsharded")
    return out


def lookup_args(node: fx.Node) -> dict[str, Any]:
    """A lookup node's arguments by name: ``ids``, ``offsets``, ``per_sample_weights``, ``mode``
    (``"sum"``, ``"mean"``, ``"max"``, or ``"none"`` for a plain embedding),
    ``include_last_offset``, ``padding_idx`` (None if none), ``scale_grad_by_freq``."""
    args = list(node.args) + [None] * 9
    if node.target is torch.ops.aten.embedding.default:
        padding = node.kwargs.get("padding_idx", args[2] if args[2] is not None else -1)
        return {"ids": args[1], "offsets": None, "per_sample_weights": None, "mode": "none",
                "include_last_offset": False, "padding_idx": None if padding == -1 else padding,
                "scale_grad_by_freq": bool(node.kwargs.get("scale_grad_by_freq", args[3] or False))}
    names = ("weight", "ids", "offsets", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
             "include_last_offset", "padding_idx")
    values = dict(zip(names, args))
    values.update(node.kwargs)
    return {"ids": values["ids"], "offsets": values["offsets"], "per_sample_weights": values["per_sample_weights"],
            "mode": ("sum", "mean", "max")[values["mode"] or 0], "include_last_offset": bool(values["include_last_offset"]),
            "padding_idx": values["padding_idx"] if values["padding_idx"] not in (None, -1) else None,
            "scale_grad_by_freq": bool(values["scale_grad_by_freq"])}


def _unsupported(lookup: fx.Node) -> str | None:
    args = lookup_args(lookup)
    if args["mode"] == "max":
        return "pools by max (a sharded table pools by sum or mean)"
    if args["scale_grad_by_freq"]:
        return "scales gradients by frequency (scale_grad_by_freq)"
    if args["padding_idx"] is not None and args["mode"] != "none":
        return f"has padding_idx={args['padding_idx']} (a bag lookup's padding ids are left out of its bags)"
    used = {u.args[1] for u in lookup.users if u.op == "call_function" and len(u.args) > 1 and u.users}
    if lookup.target is not torch.ops.aten.embedding.default and used - {0}:
        return "uses the bag outputs besides the pooled rows (offset2bag, bag sizes, max indices)"
    return None


def check_strategy(strategy) -> None:
    """Raise unless a Strategy's embedding fields agree (``Strategy.embeddings`` and the rest).

    Raises:
        ValueError: naming the field and what to change.
    """
    if isinstance(strategy.staleness, bool) or not isinstance(strategy.staleness, int) or strategy.staleness < 0:
        raise ValueError(f"Strategy.staleness must be an int >= 0 (steps a cached row may lag; 0 is exact), "
                         f"got {strategy.staleness!r}")
    cache = strategy.embedding_cache
    if isinstance(cache, bool) or not isinstance(cache, (int, float)) or not 0 <= cache <= 1:
        raise ValueError(f"Strategy.embedding_cache must be a share of each table's rows in [0, 1], got {cache!r}")
    if cache and strategy.embeddings in (None, "data_parallel"):
        raise ValueError(f"Strategy.embedding_cache={cache} caches rows of other ranks' table shards, but "
                         f"Strategy.embeddings={strategy.embeddings!r} "
                         + ("shards no table" if strategy.embeddings is None else "keeps every table whole on every rank")
                         + "; use embeddings='row_wise', 'table_wise' or 'column_wise', or embedding_cache=0")
    if strategy.staleness and not cache:
        raise ValueError(f"Strategy.staleness={strategy.staleness} bounds how old cached rows may be, but "
                         "Strategy.embedding_cache=0 caches none; set embedding_cache (a share of each table's rows, "
                         "e.g. 0.05) or staleness=0")
    if strategy.embeddings is None:
        if strategy.embedding_optimizer is not None:
            raise ValueError("Strategy.embedding_optimizer updates sharded embedding tables, but "
                             "Strategy.embeddings is None (tables are ordinary weights); set embeddings too")
        return
    if strategy.embeddings not in SHARDINGS:
        raise ValueError(f"Strategy.embeddings must be one of {SHARDINGS} or None, got {strategy.embeddings!r}")
    if not isinstance(strategy.embedding_optimizer, SparseOptimizer):
        raise ValueError(f"Strategy.embeddings={strategy.embeddings!r} gives the tables sparse gradients, which the "
                         "user's optimizer does not see: name their optimizer, e.g. "
                         "embedding_optimizer=gp.SparseOptimizer('rowwise_adagrad', lr=0.01)")


def cached_rows(share: float, rows: int) -> int:
    """Rows a cache of ``share`` of a table of ``rows`` holds (at least one for a share > 0)."""
    return max(1, math.ceil(share * rows)) if share else 0
