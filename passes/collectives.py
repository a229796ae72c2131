"""The one emitter of collective nodes.

Every collective in a compiled graph is created here, so the transitions the cost model prices
and the nodes the runtime executes come from one table. A test fails if any other module inserts
a node whose target is one of :data:`graphpass.runtime.collectives.COLLECTIVE_OPS`.

Transitions emitted so far:

==========================  ====================================================  ===============
placement change            nodes                                                 backward
==========================  ====================================================  ===============
param grads Partial → R     ``grad_sync_begin`` + bucketed ``all_reduce_grads``   async all-reduce
value Partial → R (report)  ``all_reduce(x, axis, op)``                           none (detached)
==========================  ====================================================  ===============
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch.fx as fx

from graphpass import meta
from graphpass.runtime import collectives as ops


def _val_bytes(node: fx.Node) -> int:
    val = node.meta[meta.VAL]
    return val.numel() * val.element_size()


def _first_use_position(node: fx.Node, order: dict[fx.Node, int]) -> int:
    return min((order[u] for u in node.users), default=len(order))


def bucket_params(
    params: Sequence[fx.Node], bucket_cap_bytes: int, order: dict[fx.Node, int]
) -> list[list[fx.Node]]:
    """Group parameters into buckets in the order their gradients become ready.

    Backward visits the graph in reverse, so the parameter whose first use is latest gets its
    gradient first. Buckets are filled in that order up to ``bucket_cap_bytes`` (a parameter
    larger than the cap gets a bucket of its own).
    """
    ready_order = sorted(params, key=lambda p: -_first_use_position(p, order))
    buckets: list[list[fx.Node]] = []
    size = 0
    for p in ready_order:
        nbytes = _val_bytes(p)
        if not buckets or size + nbytes > bucket_cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def emit_grad_all_reduce(
    gm: fx.GraphModule,
    params: Sequence[fx.Node],
    axis: str,
    bucket_cap_bytes: int,
    created_by: str,
) -> list[fx.Node]:
    """Make the gradients of ``params`` (Partial on ``axis``) Replicate by bucketed all-reduce.

    Inserts one ``grad_sync_begin(axis)`` after the placeholders and one ``all_reduce_grads``
    node per bucket, right before the first use of any parameter in the bucket; every use of a
    parameter is rewired through its bucket's output. Returns the bucket nodes in launch order.
    """
    graph = gm.graph
    if not params:
        return []
    order = {n: i for i, n in enumerate(graph.nodes)}
    buckets = bucket_params(params, bucket_cap_bytes, order)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1].next if placeholders else next(iter(graph.nodes))
    with graph.inserting_before(anchor):
        begin = graph.call_function(ops.grad_sync_begin, (axis,))
    begin.meta[meta.CREATED_BY] = created_by
    begin.meta[meta.AXIS] = axis
    begin.meta[meta.MODULE_PATH] = ""
    begin.meta[meta.LAYER] = None
    bucket_nodes = []
    for index, bucket in enumerate(buckets):
        users = {p: list(p.users) for p in bucket}
        first_user = min(
            (u for p in bucket for u in p.users), key=lambda u: order[u], default=None
        )
        anchor = first_user if first_user is not None else graph.find_nodes(op="output")[0]
        for p in bucket:  # a get_attr has no inputs, so moving it earlier is always valid
            if order[p] > order[anchor]:
                anchor.prepend(p)
        with graph.inserting_before(anchor):
            node = graph.call_function(ops.all_reduce_grads, (begin, *bucket), {"bucket": index})
            node.meta[meta.CREATED_BY] = created_by
            node.meta[meta.AXIS] = axis
            node.meta[meta.MODULE_PATH] = ""
            node.meta[meta.LAYER] = None
            node.meta[meta.PLACEMENT] = {axis: "Replicate()"}
            for i, p in enumerate(bucket):
                item = graph.call_function(operator.getitem, (node, i))
                meta.copy_meta(p, item, exclude=(meta.VAL, meta.STATE_KEYS, meta.ATTR_KIND))
                item.meta[meta.CREATED_BY] = created_by
                for user in users[p]:
                    user.replace_input_with(p, item)
        bucket_nodes.append(node)
    return bucket_nodes


def emit_all_reduce(
    gm: fx.GraphModule, value: fx.Node, axis: str, op: str, created_by: str
) -> fx.Node:
    """Insert ``all_reduce(value, axis, op)`` right after ``value`` (no gradient path)."""
    with gm.graph.inserting_after(value):
        node = gm.graph.call_function(ops.all_reduce, (value, axis), {"op": op})
    meta.copy_meta(value, node)
    node.meta[meta.CREATED_BY] = created_by
    node.meta[meta.AXIS] = axis
    node.meta[meta.PLACEMENT] = {axis: "Replicate()"}
    return node


def is_collective(node: fx.Node) -> bool:
    """True for nodes that call one of the runtime's collective ops."""
    return node.op == "call_function" and node.target in ops.COLLECTIVE_OPS


__all__ = ["bucket_params", "emit_grad_all_reduce", "emit_all_reduce", "is_collective"]
