"""expert_parallel: shard each Mixture-of-Experts layer's experts over the ``ep`` axis and move
the tokens to them by all-to-all.

Contract: finds every MoE layer of the graph by its grouped products (:func:`expert_regions`:
graphpass.nn's ``graphpass.grouped_mm``, Hugging Face's ``transformers.grouped_mm_fallback``,
torch's ``aten._grouped_mm``; the products of one layer share one ``offs``; the local offsets
keep the layer's offsets' dtype). For each layer
whose expert weights the plan places ``Shard(0)`` on ``ep``, the pass replaces every expert
weight by this rank's ``E/ep`` experts (recorded as ``gp.tp_shard`` on axis ``ep``, so
checkpoints and ``full_state_dict`` put them back together), and emits through the one emitter
(:func:`graphpass.passes.collectives.emit_expert_exchange`) the count exchange and dispatch
after the sorted rows and the combine after the last product; the products then run on the
rows of the local experts. Everything between the products must work row by row (an
activation, a gate times an up projection): those rows are whichever tokens routing sent here.
No ``ep`` axis, or no weight placed on it → logged no-op.

The gradients of the expert weights hold the contributions of every rank of the ``ep`` group
(the all-to-all's backward brings them); ``insert_collectives`` and ``shard_parameters`` reduce
them over the ``edp`` ranks that hold the same experts, still divided by the whole ``dp``.

Before/after (ep=2, 4 experts)::

    rows = aten.index(x, [order])        [256, 64]        rows = aten.index(x, [order])
    offs = aten.cumsum(counts, 0)        [4]              offs = aten.cumsum(counts, 0)
    w_in = get_attr[experts.w_in]        [4, 64, 192]  →  splits = ep_counts(offs, 'ep', 2)
    h = grouped_mm(rows, w_in, offs)                      ep_dispatch = ep_dispatch(rows, splits, 'ep')
    ...                                                   w_in = get_attr[experts.w_in]   [2, 64, 192]
    y = grouped_mm(h2, w_out, offs)                       h = grouped_mm(getitem, w_in, getitem_1)
                                                          ...
                                                          y = grouped_mm(h2, w_out, getitem_1)
                                                          ep_combine = ep_combine(y, splits, 256, 'ep')
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.placement_types import Shard

from graphpass import meta
from graphpass.mesh import EP
from graphpass.ops import op_base
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.passes import collectives
from graphpass.plan import Plan
from graphpass.runtime.expert_parallel import LOAD_PREFIX, PLACEMENT_PREFIX

log = logging.getLogger(__name__)

NAME = "expert_parallel"
#: The grouped products of Mixture-of-Experts layers graphpass recognises (op base names).
GROUPED_PRODUCTS = ("grouped_mm", "grouped_mm_fallback", "_grouped_mm")
#: Ops between an expert weight and its product that keep the expert dimension first.
_WEIGHT_VIEWS = ("to", "_to_copy", "transpose", "permute", "t", "contiguous", "alias", "clone", "detach", "type_as")


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
        raise NotImplementedError(f"{NAME}: grouped product {product.name!r} has no offsets tensor; expert "
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
            f"{NAME}: the weight operand of grouped product {product.name!r} is not an expert parameter reached "
            f"through casts and transposes (it comes from {getattr(node, 'name', node)!r}); expert parallelism "
            "shards stacked [experts, ...] parameters")
    shape = tuple(node.meta[meta.VAL].shape)
    if shape[0] != num_experts:
        raise NotImplementedError(f"{NAME}: expert weight {node.target!r} has shape {shape}, whose dim 0 is not the "
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
            f"{NAME}: the grouped products {[p.name for p in products]} (offsets {offs.name!r}) read "
            f"{len(entries)} different row tensors from outside ({sorted(e.name for e in entries)}); expert "
            "parallelism moves one tensor of rows sorted by expert")
    rows = entries.pop()
    num_rows = rows.meta[meta.VAL].shape[0]
    exits = [n for n in inside if any(u not in inside for u in n.users)]
    if len(exits) != 1 or exits[0] not in products:
        raise NotImplementedError(
            f"{NAME}: the expert computation of grouped products {[p.name for p in products]} hands rows out of "
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
        raise NotImplementedError(f"{NAME}: node {node.name!r} ({op_base(node)}) between the grouped products works "
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


@graph_pass(NAME, requires=(), provides=("expert_parallel",))
def expert_parallel(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Shard the experts placed on ``ep`` and exchange their tokens (see the module docstring)."""
    size = plan.mesh.size(EP)
    if size == 1:
        log.info("%s: no ep axis of size > 1; nothing to do", NAME)
        return gm
    index = plan.mesh.coordinate(ctx.rank, EP)
    regions = expert_regions(gm)
    _check_only_experts_sharded(gm, plan, {meta.plan_name(w) for region in regions for w in region.weights})
    sharded = 0
    for region in regions:
        placed = [isinstance(plan.placement(meta.plan_name(w), EP), Shard) for w in region.weights]
        if not any(placed):
            continue
        if not all(placed) or any(plan.placement(meta.plan_name(w), EP) != Shard(0) for w in region.weights):
            raise ValueError(
                f"Plan.placements shards only some expert weights of layer {region.layer!r} on 'ep' "
                f"({[meta.plan_name(w) for w in region.weights]}); place every one Shard(0) on 'ep', or none")
        if region.num_experts % size:
            raise ValueError(f"layer {region.layer!r} has {region.num_experts} experts, which the ep={size} ranks "
                             f"cannot share equally; choose ep dividing {region.num_experts}")
        placement, load = _layer_buffers(gm, region, sharded)
        for weight in region.weights:
            _shard(gm, weight, size, index, placement.target)
        local_rows, local_offs, _ = collectives.emit_expert_exchange(
            gm, region.rows, region.offs, region.out, EP, size, placement=placement, load=load,
            algorithm=plan.ep_all_to_all, created_by=NAME)
        for product in region.products:
            product.replace_input_with(region.offs, local_offs)
            if product.args[0] is region.rows:
                product.replace_input_with(region.rows, local_rows)
        sharded += 1
    log.info("%s: %d Mixture-of-Experts layers' experts sharded over ep=%d", NAME, sharded, size)
    gm.recompile()
    return gm


def _check_only_experts_sharded(gm: fx.GraphModule, plan: Plan, experts: set[str]) -> None:
    """Refuse a placement that shards anything but an expert weight on ``ep``: this pass shards
    expert weights only, and the gradient of any other tensor is averaged over ``ep`` like over
    the rest of ``dp``, so such an entry would be ignored or, for a gradient, wrong."""
    nodes = {meta.plan_name(n): n for n in gm.graph.nodes}
    stray = [name for name in plan.placements if name not in experts and name in nodes
             and nodes[name].op == "get_attr" and isinstance(plan.placement(name, EP), Shard)]
    if stray:
        raise ValueError(
            f"Plan.placements shards {stray[:5]} on 'ep', which are not expert weights of a Mixture-of-Experts "
            f"layer ({f'those are {sorted(experts)[:4]}' if experts else 'this model has none'}); only experts are "
            "sharded on ep: "
            "place these Replicate() on 'ep' (or leave 'ep' out), and shard them over dp with Plan.zero")


def _layer_buffers(gm: fx.GraphModule, region: ExpertRegion, i: int) -> tuple[fx.Node, fx.Node]:
    """The layer's two buffers, read where its rows are ready: the expert in each slot (in
    order until :mod:`graphpass.runtime.expert_placement` moves them) and the tally of rows
    routed to each expert since the last rebalance."""
    out = []
    for name, tensor, kind in ((f"{PLACEMENT_PREFIX}{i}", torch.arange(region.num_experts), "slots"),
                               (f"{LOAD_PREFIX}{i}", torch.zeros(region.num_experts, dtype=torch.long), "load")):
        gm.register_buffer(name, tensor.to(region.offs.meta[meta.VAL].device))
        with gm.graph.inserting_before(region.offs):
            node = gm.graph.get_attr(name)
        meta.copy_meta(region.offs, node, exclude=(meta.VAL, meta.STATE_KEYS, meta.ATTR_KIND, meta.SHARD,
                                                   meta.TP_SHARD, meta.PLACEMENT))
        node.meta.update({meta.ATTR_KIND: "buffer", meta.STATE_KEYS: (), meta.CREATED_BY: NAME, meta.VAL: tensor})
        out.append(node)
    return out[0], out[1]


def _shard(gm: fx.GraphModule, node: fx.Node, size: int, index: int, placement: str) -> None:
    """Replace expert weight ``node``'s tensor by this rank's experts (every node reading it)."""
    if meta.TP_SHARD in node.meta or meta.SHARD in node.meta:
        raise NotImplementedError(f"{NAME}: expert weight {node.target!r} is already sharded "
                                  f"({node.meta.get(meta.TP_SHARD) or node.meta.get(meta.SHARD)}); experts "
                                  "sharded over tp are not implemented yet")
    module_path, _, attr = node.target.rpartition(".")
    owner = gm.get_submodule(module_path)
    full, experts = getattr(owner, attr), node.meta[meta.VAL].shape[0]
    if full.shape[0] == experts:  # not sharded yet (a weight that several nodes read is sharded once)
        local = experts // size
        setattr(owner, attr, nn.Parameter(full.detach()[index * local:(index + 1) * local].clone(),
                                          requires_grad=full.requires_grad))
    node.meta[meta.TP_SHARD] = {"axis": EP, "dim": 0, "shape": list(node.meta[meta.VAL].shape), "placement": placement}
    node.meta[meta.PLACEMENT] = {**node.meta.get(meta.PLACEMENT, {}), EP: "Shard(0)"}


__all__ = ["expert_parallel", "expert_regions", "expert_weights", "ExpertRegion", "GROUPED_PRODUCTS"]
