"""Where a graph's Mixture-of-Experts layers are: an analysis, reading the graph only.

A layer is found by its grouped products (graphpass.nn's ``graphpass.grouped_mm``, Hugging
Face's ``transformers.grouped_mm_fallback``, torch's ``aten._grouped_mm``): the products of one
layer share one ``offs`` (the rows' running counts per expert). :func:`expert_regions` gives each
layer's products, the sorted rows that enter them, the result that leaves, the expert weights
and every node between them, refusing what expert parallelism could not shard; the planner prices
the layers, :mod:`graphpass.plan_builder` places their weights and
:mod:`graphpass.passes.expert_parallel` rewrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from graphpass import meta
from graphpass.ops import COPIES, op_base

#: The grouped products of Mixture-of-Experts layers graphpass recognises (op base names).
GROUPED_PRODUCTS = ("grouped_mm", "grouped_mm_fallback", "_grouped_mm")
#: Ops between an expert weight and its product that keep the expert dimension first.
_WEIGHT_VIEWS = {op.__name__ for op in COPIES} | {"transpose", "permute", "t"}


@dataclass(frozen=True)
class ExpertRegion:
    """One Mixture-of-Experts layer's expert computation in a graph.

    Attributes:
        offs: the running row counts over the experts (all products read it).
        products: the grouped products, in graph order.
        rows: the rows sorted by expert that enter the first product.
        out: the last product, whose rows leave the experts.
        weights: the expert weights' ``get_attr`` nodes (dim 0: the experts).
        num_experts: ``E``.
        nodes: the products and every node between them, in graph order (the experts' compute).
    """

    offs: fx.Node
    products: tuple[fx.Node, ...]
    rows: fx.Node
    out: fx.Node
    weights: tuple[fx.Node, ...]
    num_experts: int
    nodes: tuple[fx.Node, ...] = ()

    @property
    def layer(self) -> str:
        return meta.get(self.products[0], meta.MODULE_PATH, "") or self.products[0].name


def _offs(product: fx.Node) -> fx.Node:
    offs = product.args[2] if len(product.args) > 2 else product.kwargs.get("offs")
    if not isinstance(offs, fx.Node):
        raise NotImplementedError(f"expert parallelism: grouped product {product.name!r} has no offsets tensor; expert "
                                  "parallelism needs the rows' running counts per expert")
    return offs


def _weight(product: fx.Node, num_experts: int) -> fx.Node:
    """The parameter ``get_attr`` behind a product's weight operand (through dtype casts and
    transposes that keep the experts first)."""
    node = product.args[1]
    while isinstance(node, fx.Node) and node.op == "call_function":
        base = op_base(node)
        if base not in _WEIGHT_VIEWS:
            break
        if base == "transpose" and 0 in [d % node.args[0].meta[meta.VAL].dim() for d in node.args[1:3]]:
            break
        if base == "permute" and list(node.args[1])[0] % node.args[0].meta[meta.VAL].dim() != 0:
            break
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.op == "get_attr" and meta.get(node, meta.ATTR_KIND, "") == "parameter"):
        raise NotImplementedError(
            f"expert parallelism: the weight operand of grouped product {product.name!r} is not an expert parameter reached "
            f"through casts and transposes (it comes from {getattr(node, 'name', node)!r}); expert parallelism "
            "shards stacked [experts, ...] parameters")
    shape = tuple(node.meta[meta.VAL].shape)
    if shape[0] != num_experts:
        raise NotImplementedError(f"expert parallelism: expert weight {node.target!r} has shape {shape}, whose dim 0 is not the "
                                  f"{num_experts} experts of grouped product {product.name!r}")
    return node


def _reached(nodes: list[fx.Node], step) -> set[fx.Node]:
    """Every node reached from ``nodes`` by repeatedly following ``step(node)`` (its inputs, or
    its users), ``nodes`` themselves only if reached again."""
    seen, stack = set(), list(nodes)
    while stack:
        for other in step(stack.pop()):
            if other not in seen:
                seen.add(other)
                stack.append(other)
    return seen


def _region(offs: fx.Node, products: list[fx.Node]) -> ExpertRegion:
    inside = (_reached(products, lambda n: n.users) & _reached(products, lambda n: n.all_input_nodes)) | set(products)
    entries = {p.args[0] for p in products if p.args[0] not in inside}
    if len(entries) != 1:
        raise NotImplementedError(
            f"expert parallelism: the grouped products {[p.name for p in products]} (offsets {offs.name!r}) read "
            f"{len(entries)} different row tensors from outside ({sorted(e.name for e in entries)}); expert "
            "parallelism moves one tensor of rows sorted by expert")
    rows = entries.pop()
    num_rows = rows.meta[meta.VAL].shape[0]
    exits = [n for n in inside if any(u not in inside for u in n.users)]
    if len(exits) != 1 or exits[0] not in products:
        raise NotImplementedError(
            f"expert parallelism: the expert computation of grouped products {[p.name for p in products]} hands rows out of "
            f"{sorted(n.name for n in exits)}; expert parallelism needs one result, the last grouped product")
    for node in inside - set(products):
        _check_row_wise(node, num_rows, inside, rows)
    num_experts = offs.meta[meta.VAL].shape[0]
    weights = tuple(dict.fromkeys(_weight(p, num_experts) for p in products))
    order = {n: i for i, n in enumerate(rows.graph.nodes)}
    return ExpertRegion(offs, tuple(products), rows, exits[0], weights, num_experts,
                        tuple(sorted(inside, key=order.__getitem__)))


def _check_row_wise(node: fx.Node, num_rows: int, inside: set[fx.Node], rows: fx.Node) -> None:
    """Refuse a node between the products that would not work on another number of rows: one
    that spells the row count, or reads another row-aligned tensor from outside (a per-row bias
    indexed by expert would need moving too)."""
    val = node.meta.get(meta.VAL)
    why = None
    if isinstance(val, torch.Tensor) and (val.dim() == 0 or val.shape[0] != num_rows):
        why = f"its result {tuple(val.shape)} is not {num_rows} rows"
    for arg in node.args:
        if isinstance(arg, (list, tuple)) and arg and arg[0] == num_rows:
            why = f"it spells the row count {num_rows} in {list(arg)}"
    for arg in node.all_input_nodes:
        other = arg.meta.get(meta.VAL)
        if (arg not in inside and arg is not rows and isinstance(other, torch.Tensor) and other.dim()
                and other.shape[0] == num_rows):
            why = f"it reads {arg.name!r}, another tensor of {num_rows} rows, from outside the experts"
    if why:
        raise NotImplementedError(f"expert parallelism: node {node.name!r} ({op_base(node)}) between the grouped products works "
                                  f"on all routed rows: {why}; expert parallelism runs it on the rows routed to "
                                  "this rank's experts only")


def expert_regions(gm: fx.GraphModule) -> list[ExpertRegion]:
    """Every Mixture-of-Experts layer's expert computation in ``gm``, in graph order.

    Raises:
        NotImplementedError: grouped products that expert parallelism cannot shard, naming why.
    """
    by_offs: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_base(node) in GROUPED_PRODUCTS:
            by_offs.setdefault(_offs(node), []).append(node)
    return [_region(offs, products) for offs, products in by_offs.items()]


def expert_weights(gm: fx.GraphModule) -> list[str]:
    """The node names of every expert weight (what ``Plan.placements`` shards on ``ep``)."""
    return [w.name for region in expert_regions(gm) for w in region.weights]


__all__ = ["ExpertRegion", "GROUPED_PRODUCTS", "expert_regions", "expert_weights"]
