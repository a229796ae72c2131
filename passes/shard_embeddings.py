"""shard_embeddings: cut each embedding table the plan shards over ``dp`` and route its lookups.

Contract: for every ``get_attr`` whose plan entry has a :attr:`~graphpass.layout.TensorPlan.table`
(:class:`graphpass.tables.TableSharding`; a weight only embedding lookups read), the pass replaces
the table by this rank's shard (row-wise: rows ``[r c, (r + 1) c)`` padded as ZeRO's;
column-wise: columns ``[r d/n, (r + 1) d/n)``; table-wise: the whole table on its owner, no rows
elsewhere; table-row-wise: row-wise among its group's ranks, no rows elsewhere; data-parallel: the whole table), gives the node the matching ``gp.layout``
(checkpoints and ``full_state_dict`` put the table back together), and replaces each lookup by
the sharded lookups the emitter makes (:func:`graphpass.passes.collectives.emit_table_lookups`:
counts, ids to the rows' holders, pooled rows back; :mod:`graphpass.runtime.embeddings`). The
table's gradient is sparse from then on: no data-parallel all-reduce takes it (insert_collectives
skips it), and the plan's sparse optimizer updates the rows each step touches. No table sharded
→ logged no-op.

Before/after (row-wise over dp=2, a [1000, 16] table)::

    w = get_attr[tables.0.weight]   [1000, 16]     w = get_attr[tables.0.weight]   [500, 16]
    bag = embedding_bag(w, ids, offsets, ...)  →   counts = table_counts([ids], [offsets], specs, 'dp', 2)
    pooled = getitem(bag, 0)        [8, 16]        routed = table_dispatch([ids], [offsets], [None], counts, ...)
                                                   combined = table_combine([w], routed, counts, [ids], ...)
                                                   pooled = getitem(combined, 0)         [8, 16]

All the row-, table- and column-wise lookups of the step go in one exchange (TorchRec's
grouped input and output distributions): one all-to-all of the counts, one of the ids, one of
the pooled rows back, and one in backward, whatever the number of tables.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
import torch.nn as nn

from graphpass import meta
from graphpass.layout import TensorLayout, shard_rows
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.passes import collectives
from graphpass.plan import Plan
from graphpass.tables import TableSharding, lookup_args, tables

log = logging.getLogger(__name__)

NAME = "shard_embeddings"
AXIS = "dp"


@graph_pass(NAME, requires=(), provides=("sharded_tables",))
def shard_embeddings(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Shard the tables the plan shards and route their lookups (see the module docstring)."""
    found = {node: lookups for node, lookups in tables(gm).items() if plan.tensor(meta.plan_name(node)).table}
    if not found:
        log.info("%s: no embedding table sharded; nothing to do", NAME)
        return gm
    for axis in ("tp", "pp", "ep"):
        if plan.mesh.size(axis) > 1:
            raise NotImplementedError(f"{NAME}: sharded embedding tables with {axis}={plan.mesh.size(axis)} are not "
                                      f"implemented yet; use a mesh of dp only, or Strategy(embeddings=None)")
    size = plan.mesh.size(AXIS)
    index = plan.mesh.coordinate(ctx.rank, AXIS) if AXIS in plan.mesh else 0
    lookups = []
    for node, users in found.items():
        sharding = plan.tensor(meta.plan_name(node)).table
        rows, dim = node.meta[meta.VAL].shape
        _shard(gm, node, sharding, size, index)
        for lookup in users:
            args = lookup_args(lookup)
            lookups.append((lookup, node, (sharding.kind, int(rows), int(dim), sharding.owner, args["mode"],
                                           args["include_last_offset"], args["padding_idx"], sharding.ranks),
                            (sharding.cache, sharding.staleness) if sharding.cache else None))
    # one exchange for every lookup whose ids come from the inputs alone (a lookup reading
    # another's result, rare, goes on its own where it stands)
    inputs_only = [entry for entry in lookups if not _after_a_lookup(entry[0], {e[0] for e in lookups})]
    groups = [inputs_only] + [[entry] for entry in lookups if entry not in inputs_only]
    for group in groups:
        if not group:
            continue
        pooled = collectives.emit_table_lookups(gm, group, AXIS, size, scale=1.0 / size, created_by=NAME)
        for (lookup, *_), result in zip(group, pooled):
            _take_uses(gm, lookup, result)
    log.info("%s: %d tables sharded over %s=%d (%s)", NAME, len(found), AXIS, size,
             ", ".join(sorted({plan.tensor(meta.plan_name(n)).table.kind for n in found})))
    gm.recompile()
    return gm


def _after_a_lookup(lookup: fx.Node, all_lookups: set[fx.Node]) -> bool:
    """Whether ``lookup``'s ids, offsets or weights are computed from another lookup's result."""
    stack, seen = [n for n in lookup.all_input_nodes if n.op != "get_attr"], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in all_lookups:
            return True
        stack.extend(node.all_input_nodes)
    return False


def _take_uses(gm: fx.GraphModule, lookup: fx.Node, pooled: fx.Node) -> None:
    """Point the lookup's result at ``pooled``: its uses for a plain embedding, the uses of its
    pooled output (``getitem 0``) for a bag lookup; then drop the lookup and its unused outputs."""
    if lookup.target is torch.ops.aten.embedding.default:
        lookup.replace_all_uses_with(pooled)
    else:
        for user in list(lookup.users):
            if user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0:
                user.replace_all_uses_with(pooled)
            if not user.users:
                gm.graph.erase_node(user)
    if not lookup.users:
        gm.graph.erase_node(lookup)


def _shard(gm: fx.GraphModule, node: fx.Node, sharding: TableSharding, size: int, index: int) -> None:
    """Replace table ``node``'s tensor by this rank's shard and record its layout."""
    module_path, _, attr = node.target.rpartition(".")
    owner = gm.get_submodule(module_path) if module_path else gm
    full = getattr(owner, attr).detach()
    rows, dim = full.shape
    layout = TensorLayout.whole(full.shape)
    if sharding.kind == "row_wise":
        c = shard_rows(rows, size)
        local = full.new_zeros(c, dim)
        mine = full[index * c:(index + 1) * c]
        local[:mine.shape[0]] = mine
        layout = layout.with_rows(AXIS, size)
    elif sharding.kind == "column_wise":
        width = dim // size
        local = full[:, index * width:(index + 1) * width].clone()
        layout = layout.with_shard(AXIS, 1, size)
    elif sharding.kind == "table_wise":
        local = full.clone() if index == sharding.owner else full.new_zeros(0, dim)
        layout = layout.with_owner(AXIS, sharding.owner)
    elif sharding.kind == "table_row_wise":  # row-wise inside its group, nothing elsewhere
        c = shard_rows(rows, sharding.ranks)
        local = full.new_zeros(c if index in sharding.holders else 0, dim)
        if index in sharding.holders:
            mine = full[(index - sharding.owner) * c:(index - sharding.owner + 1) * c]
            local[:mine.shape[0]] = mine
        layout = layout.with_rows(AXIS, sharding.ranks).with_owner(AXIS, sharding.owner)
    else:
        local = full.clone()
    setattr(owner, attr, nn.Parameter(local, requires_grad=True))
    if layout.sharded:
        node.meta[meta.LAYOUT] = layout


__all__ = ["shard_embeddings"]
