"""expert_parallel: shard each Mixture-of-Experts layer's experts over the ``ep`` axis and move
the tokens to them by all-to-all.

Contract: finds every MoE layer of the graph by its grouped products (:func:`expert_regions`:
graphpass.nn's ``graphpass.grouped_mm``, Hugging Face's ``transformers.grouped_mm_fallback``,
torch's ``aten._grouped_mm``; the products of one layer share one ``offs``; the local offsets
keep the layer's offsets' dtype). For each layer
whose expert weights the plan places ``Shard(0)`` on ``ep``, the pass replaces every expert
weight by this rank's ``E/ep`` experts (its ``gp.layout`` is ``Shard(0)`` on axis ``ep``, so
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

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.placement_types import Shard

from graphpass import meta
from graphpass.layout import TensorLayout
from graphpass.experts import ExpertRegion, expert_regions
from graphpass.mesh import EP
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.passes import collectives
from graphpass.plan import Plan
from graphpass.runtime.expert_parallel import LOAD_PREFIX, PLACEMENT_PREFIX

log = logging.getLogger(__name__)

NAME = "expert_parallel"
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
    stray = [name for name in plan.tensors if name not in experts and name in nodes
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
        meta.copy_meta(region.offs, node, exclude=meta.TENSOR_KEYS)
        node.meta.update({meta.ATTR_KIND: "buffer", meta.STATE_KEYS: (), meta.CREATED_BY: NAME, meta.VAL: tensor})
        out.append(node)
    return out[0], out[1]


def _shard(gm: fx.GraphModule, node: fx.Node, size: int, index: int, placement: str) -> None:
    """Replace expert weight ``node``'s tensor by this rank's experts (every node reading it)."""
    if meta.layout(node) is not None:
        raise NotImplementedError(f"{NAME}: expert weight {node.target!r} is already sharded "
                                  f"({meta.layout(node)}); experts sharded over tp are not implemented yet")
    module_path, _, attr = node.target.rpartition(".")
    owner = gm.get_submodule(module_path)
    full, experts = getattr(owner, attr), node.meta[meta.VAL].shape[0]
    if full.shape[0] == experts:  # not sharded yet (a weight that several nodes read is sharded once)
        local = experts // size
        setattr(owner, attr, nn.Parameter(full.detach()[index * local:(index + 1) * local].clone(),
                                          requires_grad=full.requires_grad))
    node.meta[meta.LAYOUT] = TensorLayout.whole(node.meta[meta.VAL].shape).with_shard(EP, 0, size).with_experts(placement)


__all__ = ["expert_parallel"]
