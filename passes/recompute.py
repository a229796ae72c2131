"""recompute: activation checkpointing of the repeated layers the plan names.

Contract: for each layer index ``i`` in ``plan.recompute``, the layer's *region* — the
``call_function`` nodes whose ``gp.layer`` is ``i`` — is lifted into a parameter-free
sub-``GraphModule`` registered on the graph as ``recompute_layer_{i}``, and replaced by one node
``torch.utils.checkpoint.checkpoint(recompute_layer_i, *inputs, use_reentrant=False)`` (plus one
``getitem`` per value the rest of the graph uses, when there are several). Forward then keeps only
the region's inputs alive for backward; backward reruns the region (with the forward's RNG state,
so dropout masks repeat) to get the activations it needs. Loss and gradients are bitwise those of
the graph without the pass.

- Graph inputs and ``get_attr`` nodes are never in a region: parameters, buffers and the previous
  layer's output reach it as region inputs.
- Collective nodes and their ``getitem`` outputs stay outside (the DP ``grad_sync_begin`` /
  ``all_reduce_grads`` nodes, whose getitems carry the parameter's layer): the parameter views they
  hand out become region inputs, so gradient buckets still launch once, from the real backward.
- An in-place write to a tensor from outside the region (``num_batches_tracked.add_(1)``, a buffer
  ``copy_``, a training-mode ``batch_norm``'s running statistics) stays outside too, or recomputation
  would apply it twice. Where the checkpoint would move such a write (or any other outside write)
  to the other side of a read of the written tensor, the pass raises instead.
- A region must be convex: no path may leave it and come back (layer ``i``'s node uses a node
  outside the layer that itself uses layer ``i``). Such a layer is split at the node that comes
  back, into consecutive checkpoints ``recompute_layer_{i}``, ``recompute_layer_{i}_1``, ...
- An index the graph has no layer for is a ``ValueError``; an empty ``plan.recompute`` is a no-op.

Before/after (layer 0 of the zoo GPT: its 21 nodes become a get_attr and a call)::

    layer_norm = aten.layer_norm(dropout, [64], ln_1_w, ln_1_b)   recompute_layer_0 = get_attr[recompute_layer_0]
    linear = aten.linear(layer_norm, q_w, q_b)               →    checkpoint = checkpoint(recompute_layer_0, dropout,
    ...                                                                 ln_1_w, ln_1_b, q_w, q_b, ..., use_reentrant=False)
    add_2 = aten.add(add_1, dropout_1)                            layer_norm_2 = aten.layer_norm(checkpoint, [64], ...)
    layer_norm_2 = aten.layer_norm(add_2, [64], ln_2_w, ...)      # h.1 reads layer 0's one output
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint

from graphpass import meta
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.passes.collectives import is_collective
from graphpass.plan import Plan

log = logging.getLogger(__name__)

NAME = "recompute"
#: Prefix of the registered sub-GraphModules, ``recompute_layer_3`` (``_1``, ``_2`` for splits).
SUBMODULE_PREFIX = "recompute_layer_"


@graph_pass(NAME, requires=(), provides=("recompute",))
def recompute(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Replace each layer in ``plan.recompute`` by a ``torch.utils.checkpoint`` call.

    Raises:
        ValueError: ``plan.recompute`` names a layer the graph lacks, or checkpointing a layer
            would move an in-place write to the other side of the layer's read of that tensor.
    """
    if not plan.recompute:
        log.info("%s: plan.recompute is empty; nothing to do", NAME)
        return gm
    regions = layer_regions(gm)
    unknown = [i for i in plan.recompute if i not in regions]
    if unknown:
        have = f"its repeated layers are {sorted(regions)}" if regions else "it has no repeated layers"
        raise ValueError(
            f"Plan.recompute names layer {unknown[0] if len(unknown) == 1 else unknown}, which this "
            f"graph does not have ({have}, from gp.layer of its nodes); drop the index from "
            "Plan.recompute or make the plan for this model"
        )
    for layer in dict.fromkeys(plan.recompute):  # in plan order, each once
        region = regions[layer]
        _check_outside_writes(gm, region, layer)
        segments = convex_segments(region, layer)
        for k, segment in enumerate(segments):
            name = SUBMODULE_PREFIX + str(layer) + (f"_{k}" if k else "")
            _checkpoint_segment(gm, segment, name, layer)
        log.info(
            "%s: layer %d, %d nodes -> %d checkpoint%s",
            NAME, layer, len(region), len(segments), "" if len(segments) == 1 else "s",
        )
    gm.recompile()
    return gm


# --------------------------------------------------------------------------- regions


def stays_outside(node: fx.Node) -> bool:
    """True for the nodes of a layer that never join its region: collectives and their outputs.

    The DP gradient-sync nodes are built to run once per forward, from the graph's own backward;
    their ``getitem`` outputs carry the parameter's layer, but they are just that parameter's
    view, and reach the region as inputs.
    """
    if is_collective(node):
        return True
    return (
        node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and is_collective(node.args[0])
    )


def layer_regions(gm: fx.GraphModule) -> dict[int, list[fx.Node]]:
    """Layer index → the ``call_function`` nodes of that layer, in graph order.

    Leaves out nodes that :func:`stays_outside` and in-place writes to tensors from outside the
    layer (their write must happen once, so they are not recomputed).
    """
    regions: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        layer = node.meta.get(meta.LAYER)
        if node.op == "call_function" and layer is not None and not stays_outside(node):
            regions.setdefault(layer, []).append(node)
    for layer, nodes in regions.items():
        members = set(nodes)
        regions[layer] = [n for n in nodes if not any(t not in members for t in written_args(n))]
    return {layer: nodes for layer, nodes in regions.items() if nodes}


_aten = torch.ops.aten
#: Ops that update running statistics in place (args 3 and 4) when arg 5 (``training`` /
#: ``use_input_stats``) is True, although their schemas do not say so (no ``Tensor(a!)``).
#: Recomputing one would apply the momentum update twice, as eager checkpointing of BatchNorm does.
_UNDECLARED_WRITES = {
    _aten.batch_norm.default,
    _aten.native_batch_norm.default,
    _aten._batch_norm_impl_index.default,
    _aten.instance_norm.default,
    _aten.cudnn_batch_norm.default,
    _aten.miopen_batch_norm.default,
}


def written_args(node: fx.Node) -> list[fx.Node]:
    """The argument nodes ``node`` writes in place: its schema's ``Tensor(a!)`` arguments, and
    the running statistics of a batch norm in training mode."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    schema = target._schema
    values = [
        node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
        for i, arg in enumerate(schema.arguments)
    ]
    if target in _UNDECLARED_WRITES and values[5] is True:
        return [v for v in values[3:5] if isinstance(v, fx.Node)]
    return [
        value
        for arg, value in zip(schema.arguments, values)
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node)
    ]


def _check_outside_writes(gm: fx.GraphModule, region: list[fx.Node], layer: int) -> None:
    """Refuse in-place writes that the checkpoint would reorder against the region's reads.

    The checkpoint runs the whole region where its last node stood, and again in backward. A node
    outside the region (the layer's own writes to outside tensors included) that writes in place
    to a tensor the region reads therefore breaks it if the tensor is a region input (the write may
    now precede the reads, and it precedes the recomputation), or if a region node reads the
    tensor after the write. Writes after the region to its inputs that this misses are still
    caught, at backward, by autograd's version check of the inputs the checkpoint saves.
    """
    members = set(region)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first, last = order[region[0]], order[region[-1]]
    for node in gm.graph.nodes:
        if node in members or not (first < order[node] < last or node.meta.get(meta.LAYER) == layer):
            continue
        for target in written_args(node):
            readers = [
                u for u in target.users
                if u in members and (target not in members or order[u] > order[node])
            ]
            if readers:
                raise ValueError(
                    f"cannot recompute layer {layer}: node {node.name!r} ({node.target}) writes in "
                    f"place to {target.name!r}, which the layer's node {readers[0].name!r} reads; a "
                    "recomputed layer would either apply the write twice or read the tensor on the "
                    "wrong side of it. Make the write out of place in the model, or drop the layer "
                    "from Plan.recompute"
                )


@dataclass
class Segment:
    """A convex run of one layer's region: ``nodes`` in graph order, and ``later``, the nodes
    outside it but between its first and last node that depend on it (they must move after the
    checkpoint call, which stands where its last node stood)."""

    nodes: list[fx.Node]
    later: list[fx.Node]


def convex_segments(region: list[fx.Node], layer: int) -> list[Segment]:
    """Split ``region`` (graph order) into consecutive segments that are each convex.

    Walks the graph from the region's first node to its last, tracking which outside nodes depend
    on the current segment. A region node that uses one of them would make the segment's
    extraction a cycle (the checkpoint would need its own output), so it starts a new segment.
    """
    members = set(region)
    last = region[-1]
    segments = [Segment([], [])]
    current: set[fx.Node] = set()
    depends_on: dict[fx.Node, fx.Node] = {}  # outside node → a node of the current segment it uses
    pending: list[fx.Node] = []  # such outside nodes not yet followed by a node of the segment
    node = region[0]
    while True:
        if node in members:
            via = next((i for i in node.all_input_nodes if i in depends_on), None)
            if via is not None:
                log.warning(
                    "%s: layer %d cannot be one checkpoint; splitting it at %r, which uses %r "
                    "(not recomputed: outside the layer or a state update), which uses the layer's %r",
                    NAME, layer, node.name, via.name, depends_on[via].name,
                )
                segments.append(Segment([], []))
                current, depends_on, pending = set(), {}, []
            segments[-1].nodes.append(node)
            current.add(node)
            segments[-1].later.extend(pending)
            pending.clear()
        else:
            source = next(
                (depends_on.get(i, i) for i in node.all_input_nodes if i in current or i in depends_on),
                None,
            )
            if source is not None:
                depends_on[node] = source
                pending.append(node)
        if node is last:
            break
        node = node.next
    # Dependents after a segment's last node stay where they are: the call takes that node's place.
    return segments


# --------------------------------------------------------------------------- extraction


def _checkpoint_segment(gm: fx.GraphModule, segment: Segment, name: str, layer: int) -> None:
    """Lift ``segment`` into ``gm.<name>`` and call it through ``torch.utils.checkpoint``."""
    graph = gm.graph
    nodes = segment.nodes
    members = set(nodes)
    inputs = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in members))
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    if not outputs:
        log.info("%s: %s has no value used outside it; left as is", NAME, name)
        return
    if hasattr(gm, name):
        raise ValueError(f"{NAME}: the graph already has an attribute {name!r}; was the pass run twice?")
    gm.add_submodule(name, _region_module(nodes, inputs, outputs, f"RecomputeLayer{layer}"))

    shared = _shared_meta(nodes)
    with graph.inserting_after(nodes[-1]):
        attr = graph.get_attr(name)
    attr.meta.update(shared)
    # A module, not a tensor: no placement, no state_dict keys, and a None value (as for other
    # nodes that produce no tensor), so verification and the dumps read it like them.
    attr.meta[meta.ATTR_KIND] = "module"
    attr.meta[meta.STATE_KEYS] = ()
    attr.meta[meta.VAL] = None
    with graph.inserting_after(attr):
        call = graph.call_function(
            torch.utils.checkpoint.checkpoint, (attr, *inputs), {"use_reentrant": False}
        )
    call.meta.update(shared)
    anchor = call
    if len(outputs) == 1:
        meta.copy_meta(outputs[0], call)
        replacements = {outputs[0]: call}
    else:
        replacements = {}
        for index, out in enumerate(outputs):
            with graph.inserting_after(anchor):
                item = graph.call_function(operator.getitem, (call, index))
            meta.copy_meta(out, item)
            item.meta[meta.CREATED_BY] = NAME
            replacements[out] = item
            anchor = item
    for out, new in replacements.items():
        out.replace_all_uses_with(new, delete_user_cb=lambda user: user not in members)
    for node in segment.later:  # outside nodes that used the segment now follow the call
        anchor.append(node)
        anchor = node
    for node in reversed(nodes):
        graph.erase_node(node)


def _region_module(
    nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node], class_name: str
) -> fx.GraphModule:
    """A GraphModule computing ``outputs`` from ``inputs`` with copies of ``nodes`` (and their meta)."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in inputs:
        env[value] = sub.placeholder(value.name)
        meta.copy_meta(value, env[value], exclude=(meta.STATE_KEYS, meta.ATTR_KIND))
        env[value].meta[meta.VAL] = value.meta.get(meta.VAL)
    for node in nodes:
        env[node] = sub.node_copy(node, lambda n: env[n])
    result = env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs)
    sub.output(result)
    # Every region node is a call_function: the module owns no parameters, they are inputs.
    return fx.GraphModule(nn.Module(), sub, class_name=class_name)


def _shared_meta(nodes: list[fx.Node]) -> dict[str, Any]:
    """gp.* metadata for the nodes that stand for the region: every key all region nodes agree
    on, the module path they share (``h.3.attn.q`` and ``h.3.mlp`` → ``h.3``), and created_by."""
    first = nodes[0].meta
    shared = {
        key: value
        for key, value in first.items()
        if key.startswith("gp.")
        and key not in (meta.MODULE_PATH, meta.PLACEMENT)
        and all(key in n.meta and n.meta[key] == value for n in nodes[1:])
    }
    paths = [str(n.meta.get(meta.MODULE_PATH, "")).split(".") for n in nodes]
    common: list[str] = []
    for parts in zip(*paths):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    shared[meta.MODULE_PATH] = ".".join(common)
    shared[meta.CREATED_BY] = NAME
    return shared


__all__ = ["recompute", "layer_regions", "convex_segments", "stays_outside", "written_args"]
