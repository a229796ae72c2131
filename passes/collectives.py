"""The one emitter of collective nodes.

Every collective in a compiled graph is created here, from an entry of the transition table
(:mod:`graphpass.transitions`): the entry names the runtime op to insert, and the cost model
prices the same entry, so the plan and the emitted graph cannot disagree. A test fails if any
other module inserts a node whose target is one of
:data:`graphpass.runtime.collectives.COLLECTIVE_OPS`.

Which entry each function emits: ``ensure_grad_sync`` "dp step"; ``emit_grad_all_reduce`` "dp
gradient bucket"; ``emit_all_reduce`` "dp reported loss"; ``emit_param_all_gather`` "zero{k}
weights"; ``emit_tp_redistribute`` the tp placement changes (``Shard(d) → Shard(e)`` is a
gather then a scatter); ``emit_tp_copy`` "tp Replicate into sharded compute";
``emit_vocab_parallel_cross_entropy`` "tp vocabulary-parallel loss"; ``emit_expert_exchange`` "ep
token counts", "ep dispatch" and "ep combine".
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Sequence

import torch.fx as fx

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from graphpass import meta
from graphpass.runtime import collectives as ops
from graphpass.transitions import TABLE, Transition, transition


def _op(entry: Transition):
    """The runtime function that carries out a table entry."""
    return getattr(ops, entry.op)


def _val_bytes(node: fx.Node) -> int:
    val = node.meta[meta.VAL]
    return val.numel() * val.element_size()


def _first_use_position(node: fx.Node, order: dict[fx.Node, int]) -> int:
    return min((order[u] for u in node.users), default=len(order))


def bucket_params(
    params: Sequence[fx.Node], bucket_cap_bytes: int, order: dict[fx.Node, int],
    stage_of: Callable[[fx.Node], int] | None = None,
) -> list[list[fx.Node]]:
    """Group parameters into buckets in the order their gradients become ready.

    Backward visits the graph in reverse, so the parameter whose first use is latest gets its
    gradient first. Buckets are filled in that order up to ``bucket_cap_bytes`` (a parameter
    larger than the cap gets a bucket of its own). With ``stage_of`` (the pipeline stage of a
    node), a bucket never holds parameters of two stages.
    """
    ready_order = sorted(params, key=lambda p: -_first_use_position(p, order))
    buckets: list[list[fx.Node]] = []
    size, stage = 0, None

    def stage_of_param(p: fx.Node):
        first = min(p.users, key=lambda u: order[u], default=None)
        return stage_of(first) if stage_of is not None and first is not None else None

    for p in ready_order:
        nbytes = _val_bytes(p)
        p_stage = stage_of_param(p)
        if not buckets or size + nbytes > bucket_cap_bytes or p_stage != stage:
            buckets.append([])
            size, stage = 0, p_stage
        buckets[-1].append(p)
        size += nbytes
    return buckets


def ensure_grad_sync(gm: fx.GraphModule, axis: str, created_by: str) -> fx.Node:
    """The graph's ``grad_sync_begin(axis)`` node, inserted after the placeholders if absent.

    Every pass whose collectives reduce gradients over ``axis`` shares this one node, so all of
    them are waited for at the very end of backward.
    """
    graph = gm.graph
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _op(TABLE["dp step"]) and node.args[0] == axis:
            return node
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1].next if placeholders else next(iter(graph.nodes))
    with graph.inserting_before(anchor):
        begin = graph.call_function(_op(TABLE["dp step"]), (axis,))
    begin.meta.update(
        {meta.CREATED_BY: created_by, meta.AXIS: axis, meta.MODULE_PATH: "", meta.LAYER: None, meta.OPAQUE: True}
    )
    return begin


def _insert_group(
    gm: fx.GraphModule,
    target,
    params: Sequence[fx.Node],
    args: tuple,
    kwargs: dict,
    axis: str,
    placement: str,
    created_by: str,
) -> fx.Node:
    """Insert ``target(*args, *params, **kwargs)`` before the first use of any of ``params`` and
    route every use of a parameter through the matching element of its tuple output."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    users = {p: list(p.users) for p in params}
    first_user = min((u for p in params for u in p.users), key=lambda u: order[u], default=None)
    anchor = first_user if first_user is not None else graph.find_nodes(op="output")[0]
    for p in params:  # a get_attr has no inputs, so moving it earlier is always valid
        if order[p] > order[anchor]:
            anchor.prepend(p)
    with graph.inserting_before(anchor):
        node = graph.call_function(target, (*args, *params), kwargs)
        layers = {p.meta.get(meta.LAYER) for p in params}
        node.meta.update(
            {
                meta.CREATED_BY: created_by,
                meta.AXIS: axis,
                meta.MODULE_PATH: "",
                meta.LAYER: layers.pop() if len(layers) == 1 else None,
                meta.PLACEMENT: {axis: placement},
            }
        )
        for i, p in enumerate(params):
            item = graph.call_function(operator.getitem, (node, i))
            meta.copy_meta(p, item, exclude=meta.TENSOR_KEYS)
            item.meta[meta.CREATED_BY] = created_by
            item.meta[meta.PLACEMENT] = {axis: "Replicate()"}
            for user in users[p]:
                user.replace_input_with(p, item)
    return node


def emit_grad_all_reduce(
    gm: fx.GraphModule,
    params: Sequence[fx.Node],
    axis: str,
    bucket_cap_bytes: int,
    created_by: str,
    scale: float | None = None,
    stage_of: Callable[[fx.Node], int] | None = None,
) -> list[fx.Node]:
    """Make the gradients of ``params`` (Partial on ``axis``) Replicate by bucketed all-reduce.

    ``axis`` may join several mesh axes (``"dp,tp"``); ``scale`` multiplies the gradients before
    the sum (default: average over ``axis``).

    Uses the graph's ``grad_sync_begin(axis)`` and inserts one ``all_reduce_grads`` node per
    bucket, right before the first use of any parameter in the bucket; every use of a parameter
    is rewired through its bucket's output. Returns the bucket nodes in launch order.
    """
    if not params:
        return []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    begin = ensure_grad_sync(gm, axis, created_by)
    return [
        _insert_group(
            gm, _op(TABLE["dp gradient bucket"]), bucket, (begin,),
            {"bucket": index} if scale is None else {"bucket": index, "scale": scale},
            axis, "Replicate()", created_by,
        )
        for index, bucket in enumerate(bucket_params(params, bucket_cap_bytes, order, stage_of))
    ]


def gather_groups(
    params: Sequence[fx.Node], bucket_cap_bytes: int, order: dict[fx.Node, int]
) -> list[list[fx.Node]]:
    """Group sharded parameters for all-gather in forward order of first use.

    A group never spans two repeated layers (a transformer block gathers as a unit, as FSDP
    wraps blocks) and stays under ``bucket_cap_bytes`` of full parameters. A slice of a split
    operator (a ``gp.layout`` with a slice, from ``split_operators``) gathers only with the other parameters of
    its own slice op (weight and bias of one slice linear): that each slice is gathered, and at
    stage 3 freed, on its own is the point of splitting.
    """
    in_use_order = sorted(params, key=lambda p: _first_use_position(p, order))
    groups: list[list[fx.Node]] = []
    size, layer, slice_op = 0, object(), None
    for p in in_use_order:
        first_user = min(p.users, key=lambda u: order[u], default=None)
        p_layer = first_user.meta.get(meta.LAYER) if first_user is not None else None
        p_slice_op = first_user if meta.slice_of(p) is not None else None
        nbytes = _full_bytes(p)
        if not groups or p_layer != layer or p_slice_op is not slice_op or size + nbytes > bucket_cap_bytes:
            groups.append([])
            size, layer, slice_op = 0, p_layer, p_slice_op
        groups[-1].append(p)
        size += nbytes
    return groups


def _gathered_shape(node: fx.Node) -> tuple[int, ...]:
    """The shape ZeRO's gather rebuilds for parameter ``node`` (its own shape when not ZeRO-sharded)."""
    layout = meta.layout(node)
    if layout is None or not layout.zero:
        return tuple(node.meta[meta.VAL].shape)
    return layout.shape_on(layout.zero_axis)


def _full_bytes(node: fx.Node) -> int:
    return math.prod(_gathered_shape(node)) * node.meta[meta.VAL].element_size()


def emit_param_all_gather(
    gm: fx.GraphModule,
    params: Sequence[fx.Node],
    axis: str,
    stage: int,
    bucket_cap_bytes: int,
    created_by: str,
    divisor: int | None = None,
    replicate: str | None = None,
) -> list[fx.Node]:
    """Make ZeRO-sharded parameters (``Shard(0)`` on ``axis``) Replicate where they are used.

    One ``all_gather_params`` node per gather group (:func:`gather_groups`), right before the
    group's first use. Its backward reduce-scatters (stage 2/3) or all-reduces (stage 1) the
    gradients through the graph's ``grad_sync_begin(axis)``, divided by ``divisor`` (default:
    the axis size), then all-reduced over ``replicate`` (HSDP's replicas), if given. Returns the
    gather nodes.
    """
    if not params:
        return []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    begin = ensure_grad_sync(gm, axis, created_by)
    nodes = []
    for index, group in enumerate(gather_groups(params, bucket_cap_bytes, order)):
        shapes = tuple(_gathered_shape(p) for p in group)
        kwargs = {"axis": axis, "shapes": shapes, "stage": stage, "group": index}
        partial = tuple(p.meta.get(meta.GRAD_PARTIAL) for p in group)
        if any(partial):  # e.g. norm weights under sequence parallelism: summed over tp first
            kwargs["partial"] = partial
        if divisor is not None:
            kwargs["divisor"] = divisor
        if replicate is not None:
            kwargs["replicate"] = replicate
        nodes.append(_insert_group(gm, _op(transition("all_gather_params", stage=stage)), group, (begin,), kwargs, axis, "Shard(0)", created_by))
    return nodes


def emit_all_reduce(
    gm: fx.GraphModule, value: fx.Node, axis: str, op: str, created_by: str
) -> fx.Node:
    """Insert ``all_reduce(value, axis, op)`` right after ``value`` (no gradient path)."""
    with gm.graph.inserting_after(value):
        node = gm.graph.call_function(_op(TABLE["dp reported loss"]), (value, axis), {"op": op})
    meta.copy_meta(value, node)
    node.meta[meta.CREATED_BY] = created_by
    node.meta[meta.AXIS] = axis
    node.meta[meta.PLACEMENT] = {axis: "Replicate()"}
    return node


def _tp_node(gm: fx.GraphModule, target, args: tuple, kwargs: dict, source: fx.Node, before: fx.Node,
             axis: str, placement: str, created_by: str) -> fx.Node:
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(target, args, kwargs)
    meta.copy_meta(source, node, exclude=meta.TENSOR_KEYS)
    node.meta.update({meta.CREATED_BY: created_by, meta.AXIS: axis, meta.PLACEMENT: {axis: placement}})
    if meta.STAGE in before.meta:  # it runs where it is inserted: in its user's pipeline stage
        node.meta[meta.STAGE] = before.meta[meta.STAGE]
    return node


def emit_tp_redistribute(
    gm: fx.GraphModule,
    value: fx.Node,
    src: Placement,
    dst: Placement,
    axis: str,
    size: int,
    *,
    before: fx.Node,
    grad: str = "slice",
    created_by: str,
) -> fx.Node:
    """Nodes converting ``value`` from ``src`` to ``dst`` on the tensor-parallel ``axis``.

    ``grad`` chooses the backward of an all-gather: ``"slice"`` when the gathered tensor's
    gradient is the same on every rank, ``"reduce_scatter"`` when it only feeds sharded compute
    (Megatron's sequence-parallel all-gather).
    """
    def node(target, x, *extra, **kw):
        return _tp_node(gm, target, (x, axis, size, *extra), kw, value, before, axis, str(dst), created_by)

    scatter = _op(TABLE["tp Replicate -> Shard"])
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return node(_op(transition("tp_all_gather", grad=grad)), value, src.dim, grad=grad)
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return node(_op(TABLE["tp Partial -> Replicate"]), value)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return node(_op(TABLE["tp Partial -> Shard"]), value, dst.dim)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return node(scatter, value, dst.dim)
    if isinstance(src, Shard) and isinstance(dst, Shard):
        gathered = node(_op(transition("tp_all_gather", grad="slice")), value, src.dim, grad="slice")
        return _tp_node(gm, scatter, (gathered, axis, size, dst.dim), {}, value, before, axis, str(dst), created_by)
    raise NotImplementedError(f"no collective turns {src} into {dst} (node {value.name!r})")


def emit_tp_copy(gm: fx.GraphModule, value: fx.Node, axis: str, size: int, *, before: fx.Node, created_by: str) -> fx.Node:
    """``tp_copy(value)``: identity whose backward all-reduces the gradient (Megatron's f)."""
    return _tp_node(gm, _op(TABLE["tp Replicate into sharded compute"]), (value, axis, size), {}, value, before, axis,
                    "Replicate()", created_by)


def emit_vocab_parallel_cross_entropy(
    gm: fx.GraphModule, logits: fx.Node, target: fx.Node, axis: str, size: int, vocab_start: int,
    ignore_index: int, *, created_by: str, reduction: str = "mean",
) -> fx.Node:
    """Cross-entropy of vocabulary-sharded logits, its ``reduction`` ``"mean"`` or ``"sum"``
    (inserted at the current insertion point)."""
    kwargs = {"ignore_index": ignore_index, **({"reduction": reduction} if reduction != "mean" else {})}
    node = gm.graph.call_function(
        _op(TABLE["tp vocabulary-parallel loss"]), (logits, target, axis, size, vocab_start), kwargs
    )
    node.meta.update({meta.CREATED_BY: created_by, meta.AXIS: axis, meta.PLACEMENT: {axis: "Replicate()"}})
    return node


def emit_expert_exchange(
    gm: fx.GraphModule, rows: fx.Node, offs: fx.Node, last: fx.Node, axis: str, size: int, *,
    placement: fx.Node, load: fx.Node, algorithm: str = "flat", created_by: str,
) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Expert parallelism around one Mixture-of-Experts layer's grouped products: the count
    exchange and the dispatch of ``rows`` (sorted by expert, ``offs`` their running counts)
    right after ``rows``, and the combine right after ``last`` (the products' result leaving the
    experts), which takes over ``last``'s uses; ``placement`` and ``load`` are the layer's
    buffers of the expert in each slot and of its routing tally; ``algorithm`` ``"flat"`` or
    ``"hierarchical"`` (``Plan.ep_all_to_all``). Returns ``(local_rows,
    local_offs, combined)``; the caller points the products at the local rows and offsets."""
    graph = gm.graph
    anchor = rows if list(graph.nodes).index(rows) > list(graph.nodes).index(offs) else offs
    with graph.inserting_after(anchor):
        splits = graph.call_function(_op(TABLE["ep token counts"]), (offs, axis, size),
                                     {"placement": placement, "load": load})
    with graph.inserting_after(splits):
        dispatch = graph.call_function(_op(TABLE["ep dispatch"]), (rows, splits, axis),
                                       {"placement": placement, "algorithm": algorithm,
                                        "offs_dtype": offs.meta[meta.VAL].dtype})
    with graph.inserting_after(dispatch):
        local_rows = graph.call_function(operator.getitem, (dispatch, 0))
    with graph.inserting_after(local_rows):
        local_offs = graph.call_function(operator.getitem, (dispatch, 1))
    num_rows = int(rows.meta[meta.VAL].shape[0])
    with graph.inserting_after(last):
        combined = graph.call_function(_op(TABLE["ep combine"]), (last, splits, num_rows, axis),
                                       {"placement": placement, "algorithm": algorithm})
    last.replace_all_uses_with(combined, delete_user_cb=lambda user: user is not combined)
    for node, source in ((splits, offs), (dispatch, rows), (local_rows, rows), (local_offs, offs), (combined, last)):
        meta.copy_meta(source, node, exclude=meta.TENSOR_KEYS)
        node.meta[meta.CREATED_BY] = created_by
    for node in (splits, dispatch, combined):
        node.meta[meta.AXIS] = axis
    return local_rows, local_offs, combined


def is_collective(node: fx.Node) -> bool:
    """True for nodes that call one of the runtime's collective ops."""
    return node.op == "call_function" and node.target in ops.COLLECTIVE_OPS


__all__ = [
    "bucket_params",
    "emit_all_reduce",
    "emit_expert_exchange",
    "emit_grad_all_reduce",
    "emit_param_all_gather",
    "emit_tp_copy",
    "emit_tp_redistribute",
    "emit_vocab_parallel_cross_entropy",
    "ensure_grad_sync",
    "gather_groups",
    "is_collective",
]
