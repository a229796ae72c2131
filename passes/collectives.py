"""The one emitter of collective nodes.

Every collective in a compiled graph is created here, from an entry of the transition table
(:mod:`graphpass.transitions`): the entry names the runtime op to insert, and the cost model
prices the same entry, so the plan and the emitted graph cannot disagree. A test fails if any
other module inserts a node whose target is one of
:data:`graphpass.runtime.collectives.COLLECTIVE_OPS`.

Which entry each function emits: ``ensure_grad_sync`` "dp step"; ``emit_grad_all_reduce`` "dp
gradient bucket"; ``emit_all_reduce`` "dp reported loss"; ``emit_param_all_gather`` "zero{k}
weights"; ``emit_tp_redistribute`` the tp placement changes, found by
:func:`graphpass.transitions.redistribution` (``Shard(d) → Shard(e)`` is a gather then a
scatter; a replicated value into sharded compute "tp Replicate into sharded compute");
``emit_vocab_parallel_cross_entropy`` "tp vocabulary-parallel loss"; ``emit_expert_exchange`` "ep
token counts", "ep dispatch" and "ep combine"; ``emit_table_lookups`` "table counts", "table ids",
"table pooled", "table cached rows" and "table replicated gradients".
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Sequence

import torch.fx as fx

from torch.distributed.tensor.placement_types import Placement, Replicate

from graphpass import meta
from graphpass.compression import GradCompression
from graphpass.runtime import collectives as ops
from graphpass.layout import placement_to_str
from graphpass.transitions import TABLE, Transition, redistribution, transition


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
        {meta.CREATED_BY: created_by, meta.AXIS: axis, meta.MODULE_PATH: "", meta.LAYER: None, meta.OPAQUE: True,
         meta.TRANSITION: "dp step"}
    )
    return begin


def _insert_group(
    gm: fx.GraphModule,
    entry: Transition,
    params: Sequence[fx.Node],
    args: tuple,
    kwargs: dict,
    axis: str,
    placement: str,
    created_by: str,
) -> fx.Node:
    """Insert ``entry``'s op ``(*args, *params, **kwargs)`` before the first use of any of ``params`` and
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
        node = graph.call_function(_op(entry), (*args, *params), kwargs)
        layers = {p.meta.get(meta.LAYER) for p in params}
        node.meta.update(
            {
                meta.CREATED_BY: created_by,
                meta.AXIS: axis,
                meta.MODULE_PATH: "",
                meta.LAYER: layers.pop() if len(layers) == 1 else None,
                meta.PLACEMENT: {axis: placement},
                meta.TRANSITION: entry.name,
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
    compression: GradCompression | None = None,
) -> list[fx.Node]:
    """Make the gradients of ``params`` (Partial on ``axis``) Replicate by bucketed all-reduce.

    ``axis`` may join several mesh axes (``"dp,tp"``); ``scale`` multiplies the gradients before
    the sum (default: average over ``axis``); ``compression``: the buckets go compressed
    ("dp gradient bucket powersgd" / "int8", :mod:`graphpass.compression`).

    Uses the graph's ``grad_sync_begin(axis)`` and inserts one ``all_reduce_grads`` node per
    bucket, right before the first use of any parameter in the bucket; every use of a parameter
    is rewired through its bucket's output. Returns the bucket nodes in launch order.
    """
    if not params:
        return []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    begin = ensure_grad_sync(gm, axis, created_by)
    entry = TABLE["dp gradient bucket" + ("" if compression is None else f" {compression.kind}")]
    options = {} if compression is None or compression.kind != "powersgd" else {
        "rank": compression.rank, "warm_start": compression.warm_start}
    return [
        _insert_group(
            gm, entry, bucket, (begin,),
            {"bucket": index, **options} if scale is None else {"bucket": index, "scale": scale, **options},
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
    compression: str | None = None,
) -> list[fx.Node]:
    """Make ZeRO-sharded parameters (``Shard(0)`` on ``axis``) Replicate where they are used.

    One ``all_gather_params`` node per gather group (:func:`gather_groups`), right before the
    group's first use. Its backward reduce-scatters (stage 2/3) or all-reduces (stage 1) the
    gradients through the graph's ``grad_sync_begin(axis)``, divided by ``divisor`` (default:
    the axis size), then all-reduced over ``replicate`` (HSDP's replicas), if given: as int8
    blocks with error feedback where ``compression`` is ``"int8"`` (the table's "zero replicas
    int8"). Returns the gather nodes.
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
            if compression is not None:
                kwargs.update(TABLE[f"zero replicas {compression}"].op_kwargs)
        nodes.append(_insert_group(gm, transition("all_gather_params", stage=stage), group, (begin,), kwargs, axis, "Shard(0)", created_by))
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
    node.meta[meta.TRANSITION] = "dp reported loss"
    return node


def _tp_node(gm: fx.GraphModule, entry: Transition, args: tuple, source: fx.Node, before: fx.Node,
             axis: str, placement: str, created_by: str) -> fx.Node:
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(_op(entry), args, dict(entry.op_kwargs))
    meta.copy_meta(source, node, exclude=meta.TENSOR_KEYS)
    node.meta.update({meta.CREATED_BY: created_by, meta.AXIS: axis, meta.PLACEMENT: {axis: placement},
                      meta.TRANSITION: entry.name})
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
    grad: Placement | None = None,
    created_by: str,
) -> fx.Node:
    """Nodes converting ``value`` from ``src`` to ``dst`` on the tensor-parallel ``axis``, one
    per entry of :func:`graphpass.transitions.redistribution` (``value`` itself where nothing
    changes). ``grad``: the placement the gradient arrives in at ``dst`` where it is not
    ``dst``: ``Partial()`` when ``dst`` feeds only sharded compute (Megatron's f before a column
    linear; a sequence-parallel gather into column linears, whose backward reduce-scatters).

    Raises:
        NotImplementedError: no entry of the table makes this change.
    """
    out, placed = value, src
    for entry in redistribution(axis, src, dst, grad):
        # each entry's dim: the one its Shard side names (a gather's source, a scatter's target)
        dim = (placed.dim,) if entry.src == "Shard(d)" else (dst.dim,) if entry.dst == "Shard(d)" else ()
        placed = dst if entry.dst != "Replicate()" else Replicate()
        out = _tp_node(gm, entry, (out, axis, size, *dim), value, before, axis, placement_to_str(placed), created_by)
    return out


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
    node.meta.update({meta.CREATED_BY: created_by, meta.AXIS: axis, meta.PLACEMENT: {axis: "Replicate()"},
                      meta.TRANSITION: "tp vocabulary-parallel loss"})
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
    for node, name in ((splits, "ep token counts"), (dispatch, "ep dispatch"), (combined, "ep combine")):
        node.meta[meta.AXIS] = axis
        node.meta[meta.TRANSITION] = name
    return local_rows, local_offs, combined


def emit_table_lookups(
    gm: fx.GraphModule, lookups: Sequence[tuple[fx.Node, fx.Node, tuple, tuple | None]], axis: str, size: int, *,
    scale: float, created_by: str,
) -> list[fx.Node]:
    """Sharded tables' lookups in place of ``lookups`` (each ``(lookup, shard, spec, cache)``: an
    ``aten.embedding`` / ``embedding_bag`` node, whose arguments
    :func:`graphpass.tables.lookup_args` reads, the ``get_attr`` of this rank's shard of its
    table, the runtime's ``Spec``, and ``(capacity, staleness)`` of its table's cache or None),
    over ``axis`` (``size`` ranks). Row-, table- and column-wise lookups go as one group: "table
    counts", "table ids" and "table pooled"; lookups of tables with a cache as another: "table
    cached rows"; data-parallel tables' lookups as a third: "table counts" and "table
    replicated gradients"; each placed before its first lookup (the nodes computing the others'
    ids are moved up to it; the caller groups only lookups whose ids no lookup computes).
    Returns each lookup's pooled rows; the caller points the lookup's uses at them."""
    from graphpass.tables import lookup_args

    graph = gm.graph
    args = [lookup_args(lookup) for lookup, *_ in lookups]
    pooled: list[fx.Node | None] = [None] * len(lookups)
    made = []
    order = {node: k for k, node in enumerate(graph.nodes)}

    def kind(spec: tuple, cache: tuple | None) -> str:
        return "replicated" if spec[0] == "data_parallel" else "cached" if cache else "routed"

    for exchange in ("routed", "cached", "replicated"):
        group = [i for i, (_, _, spec, cache) in enumerate(lookups) if kind(spec, cache) == exchange]
        if not group:
            continue
        first = min((lookups[i][0] for i in group), key=order.__getitem__)
        _move_before(first, [n for i in group for n in (lookups[i][1], args[i]["ids"], args[i]["offsets"],
                                                         args[i]["per_sample_weights"]) if n is not None], order)
        ids = [args[i]["ids"] for i in group]
        offsets = [args[i]["offsets"] for i in group]
        weights = [args[i]["per_sample_weights"] for i in group]
        shards = [lookups[i][1] for i in group]
        specs = tuple(lookups[i][2] for i in group)
        with graph.inserting_before(first):
            if exchange == "cached":
                caches = tuple(lookups[i][3] for i in group)
                combined = graph.call_function(_op(TABLE["table cached rows"]),
                                               (shards, ids, offsets, weights, specs, caches, axis, scale))
                made.append((combined, first, "table cached rows"))
            else:
                counts = graph.call_function(_op(TABLE["table counts"]), (ids, offsets, specs, axis, size))
                made.append((counts, first, "table counts"))
            if exchange == "replicated":
                combined = graph.call_function(_op(TABLE["table replicated gradients"]),
                                               (shards, ids, offsets, weights, counts, specs, axis, scale))
                made.append((combined, first, "table replicated gradients"))
            elif exchange == "routed":
                routed = graph.call_function(_op(TABLE["table ids"]), (ids, offsets, weights, counts, specs, axis))
                combined = graph.call_function(_op(TABLE["table pooled"]),
                                               (shards, routed, counts, ids, offsets, specs, axis, scale))
                made += [(routed, first, "table ids"), (combined, first, "table pooled")]
            for k, i in enumerate(group):
                pooled[i] = graph.call_function(operator.getitem, (combined, k))
                made.append((pooled[i], lookups[i][0], None))
        order = {node: k for k, node in enumerate(graph.nodes)}
    for node, source, name in made:
        meta.copy_meta(source, node, exclude=meta.TENSOR_KEYS)
        node.meta[meta.CREATED_BY] = created_by
        if name is not None:
            node.meta[meta.AXIS] = axis
            node.meta[meta.TRANSITION] = name
    return pooled  # type: ignore[return-value]


def _move_before(anchor: fx.Node, needed: Sequence[fx.Node], order: dict[fx.Node, int]) -> None:
    """Move the nodes ``needed`` and what they are computed from to just before ``anchor``
    where they come after it, keeping their order (they compute from inputs alone)."""
    late: set[fx.Node] = set()
    stack = [n for n in needed if order[n] > order[anchor]]
    while stack:
        node = stack.pop()
        if node in late or order[node] < order[anchor]:
            continue
        late.add(node)
        stack.extend(node.all_input_nodes)
    for node in sorted(late, key=order.__getitem__):
        anchor.prepend(node)


def is_collective(node: fx.Node) -> bool:
    """True for nodes that call one of the runtime's collective ops."""
    return node.op == "call_function" and node.target in ops.COLLECTIVE_OPS


def is_bucket(node: fx.Node) -> bool:
    """True for a data-parallel gradient bucket (``all_reduce_grads``): in forward it hands out
    views of its parameters, reading none of their data."""
    return node.op == "call_function" and node.target is _op(TABLE["dp gradient bucket"])


__all__ = [
    "bucket_params",
    "emit_all_reduce",
    "emit_expert_exchange",
    "emit_grad_all_reduce",
    "emit_param_all_gather",
    "emit_table_lookups",
    "emit_tp_redistribute",
    "emit_vocab_parallel_cross_entropy",
    "is_bucket",
    "ensure_grad_sync",
    "gather_groups",
    "is_collective",
]
