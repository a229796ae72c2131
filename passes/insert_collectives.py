"""insert_collectives: make the graph's placements consistent with explicit collectives.

Contract: reads the plan's placements of inputs and parameters on each mesh axis; for every axis
over which the batch is sharded (``Shard(0)`` inputs), parameters replicated on that axis have
partial gradients, so their gradients are all-reduced (bucketed, DDP-style), and the loss — a
per-rank mean — is averaged over the axis for reporting. Axes of size 1 need nothing (no-op).

Before/after (dp=2)::

    x = placeholder                              x = placeholder
    w = get_attr[h.0.q.weight]                   sync = grad_sync_begin('dp')
    linear = aten.linear(x, w)          →        w = get_attr[h.0.q.weight]
    ...                                          bucket_1 = all_reduce_grads(sync, w, b, bucket=1)
    return (loss,)                               linear = aten.linear(x, bucket_1[0])
                                                 loss_avg = all_reduce(loss, 'dp', op='avg')
                                                 return (loss, loss_avg)
"""

from __future__ import annotations

import math

import logging

import torch.fx as fx
from torch.distributed.tensor.placement_types import Replicate, Shard

from graphpass import meta
from graphpass.compression import matrix_of
from graphpass.diloco import step_axis
from graphpass.mesh import EDP, EP
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.passes import collectives
from graphpass.stages import stage_index
from graphpass.plan import Plan

log = logging.getLogger(__name__)

NAME = "insert_collectives"


def batch_axes(gm: fx.GraphModule, plan: Plan) -> list[str]:
    """Mesh axes (size > 1) over which some graph input is sharded along its batch dim."""
    axes = []
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for axis, size in plan.mesh.items():
        if size > 1 and any(isinstance(plan.placement(name, axis), Shard) for name in inputs):
            axes.append(axis)
    return axes


@graph_pass(NAME, requires=(), provides=("collectives",))
def insert_collectives(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Insert gradient all-reduces (and the loss average) for batch-sharded and tp-partial axes."""
    axes = batch_axes(gm, plan)
    if len(axes) > 1:
        raise NotImplementedError(
            f"{NAME}: the batch is sharded over several mesh axes {axes}; only one data-parallel "
            "axis is supported so far"
        )
    batch = axes[0] if axes else None
    dp = plan.mesh[batch] if batch else 1
    by_axes: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr" or meta.get(n, meta.ATTR_KIND) != "parameter":
            continue
        if not gm.get_parameter(n.target).requires_grad:
            continue
        if plan.tensor(meta.plan_name(n)).table is not None:
            continue  # a sharded embedding table: sparse gradients, its own exchange (shard_embeddings)
        zero_axis = getattr(meta.layout(n), "zero_axis", None)
        zero_sharded = batch is not None and zero_axis is not None and plan.mesh.within(zero_axis, batch)
        partial = n.meta.get(meta.GRAD_PARTIAL)
        if zero_sharded:
            continue  # shard_parameters reduces its gradient (summing partial axes first)
        # An expert weight sharded over ep already holds its whole ep group's gradient (the
        # all-to-all's backward brought it): it is reduced over the ranks holding the same
        # experts, still divided by all of dp (a group of one rank only divides).
        reduce_over = EDP if batch == "dp" and isinstance(plan.placement(meta.plan_name(n), EP), Shard) else batch
        group = ([reduce_over] if batch and plan.placement(meta.plan_name(n), batch) == Replicate() else []) + ([partial] if partial else [])
        if group:
            by_axes.setdefault(",".join(group), []).append(n)
    if not by_axes and batch is None:
        log.info("%s: no batch-sharded axis and no partial gradients; nothing to do", NAME)
        return gm
    # Pipeline stages: each stage's parameters are bucketed on their own (the cut follows).
    stage_of = stage_index(gm, plan.stages) if len(plan.stages) > 1 else None
    # DiLoCo's workers keep their gradients (runtime/diloco.py): a worker is one rank, or under
    # HSDP one shard group, whose replicated parameters' gradients are averaged inside it
    step = step_axis(plan.mesh, plan.diloco)
    if plan.diloco is not None and batch is not None:
        log.info("%s: DiLoCo: no gradient buckets across its workers (an outer step every %d inner steps instead)",
                 NAME, plan.diloco.inner_steps)
        params = by_axes.pop(batch, None)  # (Plan refuses diloco beside tp or ep: no partial sums are left)
        if step is not None and params:
            by_axes[step] = params
        dp = plan.mesh.size(step) if step is not None else 1
    compression = plan.grad_compression
    if compression is not None and compression.kind == "powersgd" and batch in by_axes:
        shapes = [tuple(meta.get(n, meta.VAL).shape) for n in by_axes[batch]]
        if not any(matrix_of(shape, compression.rank) for shape in shapes):
            largest = max((s for s in shapes if len(s) > 1), key=lambda s: min(s[0], math.prod(s[1:])), default=None)
            raise ValueError(
                f"{NAME}: GradCompression(kind='powersgd', rank={compression.rank}) compresses no gradient of this "
                "model: " + (f"its widest matrix is {largest[0]} x {math.prod(largest[1:])}, whose rank-"
                             f"{compression.rank} factors are no smaller than it" if largest else "it has no matrices")
                + "; choose a smaller rank, or int8")
    for axis, params in by_axes.items():
        # Average over the batch axis (the loss is a per-rank mean), sum over tp (partial sums).
        buckets = collectives.emit_grad_all_reduce(gm, params, axis, plan.bucket_cap_bytes, NAME, scale=1.0 / dp,
                                                   stage_of=stage_of,
                                                   compression=compression if axis == batch else None)
        log.info("%s: %d parameters in %d gradient buckets over %r", NAME, len(params), len(buckets), axis)
    # the reported loss: the global batch's mean; a DiLoCo worker's own (one rank's: no collective)
    reported_over = batch if plan.diloco is None else step
    if batch is not None and reported_over is not None:
        output = gm.graph.find_nodes(op="output")[0]
        roles = dict(meta.get(output, meta.ROLE))
        values = list(output.args[0])
        loss = values[roles["loss"]]
        report = collectives.emit_all_reduce(gm, loss, reported_over, "avg", NAME)
        roles["loss_report"] = len(values)
        output.args = (tuple(values) + (report,),)
        output.meta[meta.ROLE] = roles
    gm.recompile()
    return gm
