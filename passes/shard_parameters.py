"""shard_parameters: ZeRO stage per parameter inside the data-parallel axis (OSDP mixes them).

Contract: for every parameter the plan gives ZeRO stage 1, 2 or 3 (``plan.zero``), the pass
replaces the parameter attribute by this rank's padded dim-0 shard (``runtime.zero.make_shard``),
adds ZeRO's ``Shard(0)`` to its ``get_attr``'s ``gp.layout``, and routes every use through an ``all_gather_params``
node that rebuilds the full tensors right before the group's first use. Gradients are
reduce-scattered (stage 2/3) or all-reduced (stage 1) in that node's backward; under HSDP
(``dp_shard``) the shards lie on ``dp_shard`` and each reduced shard is all-reduced across
``dp_replicate`` (:meth:`Mesh.zero_axis`, :meth:`Mesh.replicate_axis`); stage 3 also
frees the gathered weights after forward and re-gathers them in backward. Parameters are grouped
by (stage, layer of first use) up to ``plan.bucket_cap_bytes``, so a transformer block gathers
with one collective. Expert weights sharded over ``ep`` are ZeRO-sharded over ``edp`` (the ranks
holding the same experts), their gradients still divided by all of ``dp``. No parameter with a
ZeRO stage → logged no-op.

Before/after (zero=3, dp=2)::

    w = get_attr[h.0.q.weight]        f32[64, 64]     sync = grad_sync_begin('dp')
    b = get_attr[h.0.q.bias]          f32[64]    →    w = get_attr[h.0.q.weight]   f32[32, 64] (shard)
    linear = aten.linear(x, w, b)                     g = all_gather_params(sync, w, b, axis='dp', shapes=..., stage=3)
                                                      linear = aten.linear(x, g[0], g[1])
"""

from __future__ import annotations

import logging

import torch.fx as fx
import torch.nn as nn

from torch.distributed.tensor.placement_types import Shard

from graphpass import meta
from graphpass.layout import TensorLayout
from graphpass.compression import across_replicas
from graphpass.diloco import worker_axis
from graphpass.mesh import EP
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.passes import collectives
from graphpass.plan import Plan
from graphpass.runtime.zero import make_shard

log = logging.getLogger(__name__)

NAME = "shard_parameters"
AXIS = "dp"


def _check_zero_entries(gm: fx.GraphModule, plan: Plan) -> dict[str, tuple[fx.Node, int]]:
    nodes = {n.name: n for n in gm.graph.nodes}
    # split_operators replaced some parameters by slices: each slice inherits the original's stage.
    slices: dict[str, list[fx.Node]] = {}
    for n in nodes.values():
        slice_ = meta.slice_of(n) if n.op == "get_attr" else None
        if slice_ is not None:
            slices.setdefault(slice_.source, []).append(n)
    out = {}
    for name, stage in plan.zero.items():
        if not stage:
            continue
        if name not in nodes and name in slices:
            out.update((s.name, (s, stage)) for s in slices[name])
            continue
        node = nodes.get(name)
        if node is None or node.op != "get_attr" or meta.get(node, meta.ATTR_KIND) != "parameter":
            raise ValueError(
                f"Plan.zero names {name!r}, which is not a parameter node of the captured graph; "
                "ZeRO stages apply to parameter get_attr nodes"
            )
        out[name] = (node, stage)
        # A parameter several pipeline stages read has one node per stage (partition_stages):
        # each takes the stage of the node the plan names.
        for other in nodes.values():
            if other is not node and other.op == "get_attr" and other.target == node.target:
                out.setdefault(other.name, (other, stage))
    return out


def _axis(node: fx.Node, plan: Plan) -> str:
    """The axis a parameter's ZeRO shards lie on (:meth:`Mesh.zero_axis`): ``dp``, or HSDP's
    ``dp_shard``; for an expert weight sharded over ``ep``, those of its ranks that hold the
    same experts."""
    return plan.mesh.zero_axis(expert=isinstance(plan.placement(meta.plan_name(node), EP), Shard))


@graph_pass(NAME, requires=(), provides=("sharded_parameters",))
def shard_parameters(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Shard every parameter with a ZeRO stage and insert its all-gather (see module docstring)."""
    targets = {name: (node, stage) for name, (node, stage) in _check_zero_entries(gm, plan).items()
               if plan.mesh.size(_axis(node, plan)) > 1}  # experts with ep = dp: nothing to shard over
    if not targets:
        log.info("%s: no ZeRO-sharded parameters on a dp axis of size > 1; nothing to do", NAME)
        return gm
    by_stage: dict[tuple[str, int], list[fx.Node]] = {}
    layout_of: dict[str, TensorLayout] = {}  # target -> its layout, sharded once per target
    for name, (node, stage) in targets.items():
        axis = _axis(node, plan)
        module_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(module_path)
        if node.target in layout_of:  # another stage's node of a parameter sharded already
            node.meta[meta.LAYOUT] = layout_of[node.target]
            by_stage.setdefault((axis, stage), []).append(node)
            continue
        full = getattr(owner, attr)
        if full.dim() == 0:
            raise ValueError(
                f"ZeRO shards parameters along dim 0, but {node.target!r} (node {name!r}) is 0-dim; "
                "leave it out of Plan.zero"
            )
        if not full.requires_grad:
            raise ValueError(f"Plan.zero names {node.target!r}, which does not require grad")
        shard = nn.Parameter(make_shard(full.detach(), plan.mesh.size(axis), plan.mesh.coordinate(ctx.rank, axis)),
                             requires_grad=True)
        setattr(owner, attr, shard)
        before = meta.layout(node) or TensorLayout.whole(full.shape)
        assert before.local_shape == tuple(full.shape), (node.name, before, tuple(full.shape))
        node.meta[meta.LAYOUT] = layout_of[node.target] = before.with_zero(axis, plan.mesh.size(axis), stage)
        by_stage.setdefault((axis, stage), []).append(node)
    # DiLoCo's workers as HSDP's shard groups: each averages inside itself, nothing across
    workers = plan.diloco is not None and worker_axis(plan.mesh) is not None
    for (axis, stage), nodes in sorted(by_stage.items(), key=lambda item: (item[0][0] != AXIS, item[0])):
        # Gradients are averaged over all of dp: expert weights' hold their whole ep group's
        # share, and HSDP's shard groups are one replica of several.
        replicate = None if workers else plan.mesh.replicate_axis(axis)
        compressed = replicate is not None and across_replicas(plan.grad_compression, stage)
        groups = collectives.emit_param_all_gather(
            gm, nodes, axis, stage, plan.bucket_cap_bytes, created_by=NAME,
            divisor=plan.mesh.dp if axis != AXIS and not workers else None,
            replicate=replicate, compression=plan.grad_compression.kind if compressed else None,
        )
        log.info("%s: %d parameters at ZeRO stage %d over %s in %d gather groups", NAME, len(nodes), stage, axis,
                 len(groups))
    gm.recompile()
    return gm


__all__ = ["shard_parameters"]
