"""global_loss_mean: a mean cross-entropy over the tokens of the whole batch, as one process
computes it, when the batch is split over data-parallel ranks and microbatches.

A cross-entropy or NLL loss with ``reduction="mean"`` divides by the number of targets that are
not ``ignore_index``: Hugging Face pads its labels with -100, and masks prompts the same way. Each
rank's share and each microbatch counts its own targets, so the mean of the shares' means that
data parallelism and gradient accumulation take weights a token of a share with few targets
more than one of a full share: training differs from one process (silently, by the padding).

Contract: when the plan splits the batch into ``n = dp x microbatches`` pieces, every such loss
``ce(x, t, reduction=mean)`` becomes ``ce(x, t, reduction=sum) * n / G``, where ``G``, read from a
0-dim buffer this pass adds (``gp.loss_count`` in its metadata, no state key), is the number of
counted targets in the whole step's batch. The mean over the ``n`` pieces that the runtime takes
(the data-parallel average, the ``1/k`` weight of each microbatch) is then the sum over the global
batch divided by ``G``, exactly one process's loss; its gradients likewise. The runtime fills
``G`` before each step (:mod:`graphpass.runtime.loss_count`): it runs the :class:`LossCount`
program, the ops that compute the target from the batch followed by the count, on this rank's
microbatches and sums over the ranks that hold the other shares.

Left as they are: targets that are class probabilities (every piece counts its rows alike), a
batch that is not split (``n = 1``). Refused (``NotImplementedError``, naming the node): class
weights (the mean divides by the targets' summed weights), a target computed from a parameter or
buffer (no count from the batch alone), and a loss that reaches the output through an op that
is not linear in it (a mean of squared means is no square of the mean): with the batch split
these cannot be exact.

Before/after (dp=2, labels padded with -100)::

    cross_entropy_loss = aten.cross_entropy_loss(view_6, to_17)
                              →  loss_count_0 = get_attr[_gp_loss_count_0]        (G, filled per step)
                                 cross_entropy_loss = aten.cross_entropy_loss(view_6, to_17, None, 2)
                                 mul = aten.mul(cross_entropy_loss, 2)
                                 div = aten.div(mul, loss_count_0)
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from graphpass import meta
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.plan import Plan

log = logging.getLogger(__name__)

NAME = "global_loss_mean"
#: The buffers holding each loss's count, ``f"{COUNT_PREFIX}{i}"``.
COUNT_PREFIX = "_gp_loss_count_"
_MEAN, _SUM = 1, 2

aten = torch.ops.aten
#: Losses with ``(input, target, weight, reduction, ignore_index, ...)`` arguments.
COUNTED_LOSSES = tuple(op for op in (
    aten.cross_entropy_loss.default, aten.nll_loss.default, getattr(aten, "nll_loss_nd", None) and aten.nll_loss_nd.default,
    aten.nll_loss2d.default,
) if op)
#: Ops through which the loss stays linear in the value (``mul``/``div`` only by what does not
#: depend on it); anything else between a counted loss and the output is refused.
_LINEAR = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
    aten.neg.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.alias.default,
    aten.clone.default, aten.detach.default, aten.view.default, aten.reshape.default, aten.squeeze.default,
    aten.unsqueeze.default, aten.add.Scalar, aten.sub.Scalar, operator.add, operator.mul, operator.truediv,
    operator.sub, operator.neg,
}


@dataclass(frozen=True)
class LossCount:
    """How a counted loss's targets are counted from one microbatch: ``program(*inputs)`` returns
    the number of targets that are not ``ignore_index`` (a 0-dim int64 tensor). ``target`` names
    the target node of the loss (what a dump shows)."""

    program: fx.GraphModule
    target: str
    ignore_index: int

    def __repr__(self) -> str:
        return f"LossCount(targets {self.target!r} != {self.ignore_index})"


def _args(node: fx.Node) -> tuple:
    """``(input, target, weight, reduction, ignore_index)`` with torch's defaults filled in."""
    names = ("input", "target", "weight", "reduction", "ignore_index")
    defaults = (None, None, None, _MEAN, -100)
    values = list(node.args[:5]) + [node.kwargs.get(n, d) for n, d in zip(names[len(node.args):], defaults[len(node.args):])]
    return tuple(values)


def _dependents(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _check_linear(node: fx.Node) -> None:
    """Refuse a loss that reaches the output through an op not linear in it."""
    after = _dependents(node)
    for user in sorted(after, key=lambda n: n.name):
        if user.op == "output":
            continue
        if user.op != "call_function" or user.target not in _LINEAR:
            raise NotImplementedError(
                f"{NAME}: the mean loss {node.name!r} reaches the output through {user.name!r} ({user.target}), "
                "which is not linear in it: with the batch split over ranks or microbatches its mean over the "
                "pieces differs from one process's; return the loss itself (or a sum of losses)")
        if user.target in (aten.mul.Tensor, operator.mul) and all(
                isinstance(a, fx.Node) and (a is node or a in after) for a in user.args[:2]):
            raise NotImplementedError(f"{NAME}: {user.name!r} multiplies the mean loss {node.name!r} by itself")
        if user.target in (aten.div.Tensor, operator.truediv) and isinstance(user.args[1], fx.Node) and (
                user.args[1] is node or user.args[1] in after):
            raise NotImplementedError(f"{NAME}: {user.name!r} divides by the mean loss {node.name!r}")


def _counter(gm: fx.GraphModule, target: fx.Node, ignore_index: int, loss: fx.Node) -> fx.GraphModule:
    """The program computing ``target`` from the graph's inputs, then counting what is not
    ``ignore_index``."""
    needed, stack = set(), [target]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        if node.op == "get_attr":
            raise NotImplementedError(
                f"{NAME}: the targets {target.name!r} of the mean loss {loss.name!r} are computed from "
                f"{node.target!r}, a parameter or buffer, so they cannot be counted from the batch alone")
        stack.extend(node.all_input_nodes)
    graph, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        elif node in needed:
            env[node] = graph.node_copy(node, env.__getitem__)
    valid = graph.call_function(aten.ne.Scalar, (env[target], ignore_index))
    graph.output(graph.call_function(aten.sum.default, (valid,)))
    return fx.GraphModule(torch.nn.Module(), graph, class_name="LossCount")


@graph_pass(NAME, requires=(), provides=("global_loss_mean",))
def global_loss_mean(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Make each mean cross-entropy a mean over the global batch (see the module docstring)."""
    pieces = plan.mesh.dp * plan.microbatches
    if pieces == 1:
        log.info("%s: the batch is not split; nothing to do", NAME)
        return gm
    counted = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in COUNTED_LOSSES:
            continue
        _, target, weight, reduction, ignore_index = _args(node)
        val = target.meta.get(meta.VAL) if isinstance(target, fx.Node) else None
        if reduction != _MEAN or (isinstance(val, torch.Tensor) and val.is_floating_point()):
            continue  # a sum, or per-token losses; class probabilities: every piece counts alike
        if weight is not None:
            raise NotImplementedError(
                f"{NAME}: {node.name!r} is a class-weighted mean loss, whose mean divides by the targets' summed "
                f"weights; with the batch split into {pieces} pieces (dp={plan.mesh.dp}, microbatches="
                f"{plan.microbatches}) graphpass cannot make it one process's yet: weight the loss yourself with "
                "reduction='none', or train without class weights")
        _check_linear(node)
        count = LossCount(_counter(gm, target, ignore_index, node), target.name, ignore_index)
        name = f"{COUNT_PREFIX}{counted}"
        tensor = torch.ones((), dtype=torch.float32, device=val.device if isinstance(val, torch.Tensor) else "cpu")
        gm.register_buffer(name, tensor)
        loss_val = node.meta.get(meta.VAL)
        with gm.graph.inserting_before(node):
            total = gm.graph.get_attr(name)
        meta.copy_meta(node, total, exclude=(meta.VAL, meta.STATE_KEYS, meta.ATTR_KIND, meta.SHARD, meta.TP_SHARD,
                                             meta.PLACEMENT))
        total.meta.update({meta.ATTR_KIND: "buffer", meta.STATE_KEYS: (), meta.CREATED_BY: NAME,
                           meta.VAL: tensor, meta.LOSS_COUNT: count})
        args = list(_args(node))
        args[3] = _SUM
        node.args, node.kwargs = tuple(args) + tuple(node.args[5:]), {
            k: v for k, v in node.kwargs.items() if k not in ("weight", "reduction", "ignore_index")}
        with gm.graph.inserting_after(node):
            scaled = gm.graph.call_function(aten.mul.Tensor, (node, float(pieces)))
        with gm.graph.inserting_after(scaled):
            mean = gm.graph.call_function(aten.div.Tensor, (scaled, total))  # float32: counts past 256 tokens
        new_nodes = [scaled, mean]
        if isinstance(loss_val, torch.Tensor) and loss_val.dtype != torch.float32:
            with gm.graph.inserting_after(mean):
                new_nodes.append(gm.graph.call_function(aten.to.dtype, (mean, loss_val.dtype)))
        node.replace_all_uses_with(new_nodes[-1], delete_user_cb=lambda user: user is not scaled)
        for new in new_nodes:
            meta.copy_meta(node, new)
            new.meta[meta.CREATED_BY] = NAME
        counted += 1
    log.info("%s: %d mean losses counted over the global batch (%d pieces)", NAME, counted, pieces)
    gm.recompile()
    return gm
