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

A mean written by hand, ``(loss * mask).sum() / mask.sum()``, is made one process's too: a
division whose numerator is a sum of all its elements computed through the model from the batch,
and whose denominator is ``f(s)``, ``s`` such a sum computed from the batch alone and ``f`` a chain
of 0-dim ops on it (``clamp(min=1)``, ``+ eps``, a cast), becomes ``numerator * n / f(S)``, ``S``
the sum of ``s`` over the global batch (a buffer filled as ``G`` is).

Left as they are: targets that are class probabilities (every piece counts its rows alike), a
batch that is not split (``n = 1``), a hand-written mean whose denominator reads anything but one
sum of the batch (such a mean is still averaged per piece). Refused (``NotImplementedError``,
naming the node): class weights (the mean divides by the targets' summed weights), a target
computed from a parameter or buffer (no count from the batch alone), and a loss that reaches the
output through an op that is not linear in it (a mean of squared means is no square of the
mean): with the batch split these cannot be exact.

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
from graphpass.diloco import step_axis
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


#: Reductions of every element to one sum (with all dims named, or none).
_FULL_SUMS = (aten.sum.default, aten.sum.dim_IntList)


@dataclass(frozen=True)
class LossCount:
    """What a mean loss divides by, counted on one microbatch: ``program(*inputs)`` returns it (a
    0-dim tensor: the targets that are not ``ignore_index``, or a hand-written mean's
    denominator). ``what`` says which (what a dump shows)."""

    program: fx.GraphModule
    what: str

    def __repr__(self) -> str:
        return f"LossCount({self.what})"


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


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    needed, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in needed:
            needed.add(current)
            stack.extend(current.all_input_nodes)
    return needed


def _from_state(needed: set[fx.Node]) -> fx.Node | None:
    """A parameter or buffer among ``needed``, if any."""
    return next((n for n in needed if n.op == "get_attr"), None)


def _counter(gm: fx.GraphModule, value: fx.Node, ignore_index: int | None) -> fx.GraphModule:
    """The program computing ``value`` from the graph's inputs, then (with ``ignore_index``)
    counting its elements that are not ``ignore_index``."""
    needed = _ancestors(value)
    graph, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        elif node in needed:
            env[node] = graph.node_copy(node, env.__getitem__)
    if ignore_index is None:
        graph.output(env[value])
    else:
        valid = graph.call_function(aten.ne.Scalar, (env[value], ignore_index))
        graph.output(graph.call_function(aten.sum.default, (valid,)))
    return fx.GraphModule(torch.nn.Module(), graph, class_name="LossCount")


def _full_sum(node: object) -> bool:
    """Whether ``node`` sums every element of its input into a 0-dim value."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _FULL_SUMS:
        return False
    val = node.meta.get(meta.VAL)
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        return False
    if node.target is aten.sum.dim_IntList:
        source = node.args[0].meta.get(meta.VAL) if isinstance(node.args[0], fx.Node) else None
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return dims in (None, []) or (isinstance(source, torch.Tensor) and len(set(dims)) == source.dim())
    return True


def _hand_written_mean(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """For ``a.sum() / f(b.sum())``, with ``b`` from the batch alone, ``a`` from the model and ``f``
    a chain of 0-dim ops on the sum alone (``clamp(min=1)``, ``+ eps``, a cast): the sum of ``b``
    and the chain from it to the denominator, each node used once; else None. One process divides
    by ``f`` of the sum over the whole batch, the sum of every piece's ``b.sum()``."""
    if node.op != "call_function" or node.target is not aten.div.Tensor or len(node.args) != 2:
        return None
    numerator, denominator = node.args
    if not _full_sum(numerator) or not isinstance(denominator, fx.Node):
        return None
    from_numerator = _ancestors(numerator)  # a sum over the batch's rows, through the model
    if _from_state(from_numerator) is None or not any(n.op == "placeholder" for n in from_numerator):
        return None
    chain, current = [], denominator
    while not _full_sum(current):
        inputs = current.all_input_nodes
        val = current.meta.get(meta.VAL)
        if (current.op != "call_function" or len(inputs) != 1 or len(current.users) != 1
                or not isinstance(val, torch.Tensor) or val.dim() != 0):
            return None
        chain.insert(0, current)
        current = inputs[0]
    needed = _ancestors(current)
    if _from_state(needed) is not None or not any(n.op == "placeholder" for n in needed) or (
            not chain and len(current.users) != 1):
        return None
    return current, chain


def _reaches_output(node: fx.Node) -> bool:
    return any(user.op == "output" for user in _dependents(node))


def _count_buffer(gm: fx.GraphModule, node: fx.Node, index: int, count: LossCount, dtype: torch.dtype) -> fx.Node:
    """A 0-dim buffer for the global count, read just before ``node`` (whose metadata it takes),
    ``count`` in its metadata for the runtime to fill."""
    val = node.meta.get(meta.VAL)
    name = f"{COUNT_PREFIX}{index}"
    tensor = torch.ones((), dtype=dtype, device=val.device if isinstance(val, torch.Tensor) else "cpu")
    gm.register_buffer(name, tensor)
    with gm.graph.inserting_before(node):
        total = gm.graph.get_attr(name)
    meta.copy_meta(node, total, exclude=meta.TENSOR_KEYS)
    total.meta.update({meta.ATTR_KIND: "buffer", meta.STATE_KEYS: (), meta.CREATED_BY: NAME, meta.VAL: tensor,
                       meta.LOSS_COUNT: count})
    return total


def _scaled(gm: fx.GraphModule, value: fx.Node, pieces: float, like: fx.Node) -> fx.Node:
    """``value * pieces``, inserted after ``value`` (metadata from ``like``)."""
    with gm.graph.inserting_after(value):
        scaled = gm.graph.call_function(aten.mul.Tensor, (value, float(pieces)))
    meta.copy_meta(like, scaled)
    scaled.meta[meta.CREATED_BY] = NAME
    return scaled


def _divide_by_count(gm: fx.GraphModule, loss: fx.Node, total: fx.Node, pieces: float) -> None:
    """Make ``loss`` (a sum over this piece) ``loss * pieces / total`` in every other use."""
    scaled = _scaled(gm, loss, pieces, loss)
    with gm.graph.inserting_after(scaled):
        mean = gm.graph.call_function(aten.div.Tensor, (scaled, total))  # float32: counts past 256 tokens
    new_nodes = [scaled, mean]
    loss_val = loss.meta.get(meta.VAL)
    if isinstance(loss_val, torch.Tensor) and loss_val.dtype != torch.float32:
        with gm.graph.inserting_after(mean):
            new_nodes.append(gm.graph.call_function(aten.to.dtype, (mean, loss_val.dtype)))
    loss.replace_all_uses_with(new_nodes[-1], delete_user_cb=lambda user: user is not scaled)
    for new in new_nodes[1:]:
        meta.copy_meta(loss, new)
        new.meta[meta.CREATED_BY] = NAME


@graph_pass(NAME, requires=(), provides=("global_loss_mean",))
def global_loss_mean(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Make each mean loss a mean over the global batch (see the module docstring)."""
    # DiLoCo's workers train on their own shares: the mean over a worker's (its ranks' under
    # HSDP) microbatches only
    axis = step_axis(plan.mesh, plan.diloco)
    pieces = (plan.mesh.size(axis) if axis else 1) * plan.microbatches
    if pieces == 1:
        log.info("%s: the batch is not split; nothing to do", NAME)
        return gm
    # Uneven data-parallel shares (Plan.dp_shares): this rank's loss, a mean over its b of the B
    # samples, weighs b/B of the global mean, not 1/dp: the output loss is scaled by dp b / B
    # (exact for a mean over the batch, the contract), and each counted mean rewritten with
    # pieces / that, so that it stays the global one.
    share = _share_scale(plan, ctx.rank)
    pieces = pieces / share
    counted = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in COUNTED_LOSSES:
            _, target, weight, reduction, ignore_index = _args(node)
            val = target.meta.get(meta.VAL) if isinstance(target, fx.Node) else None
            if reduction != _MEAN or (isinstance(val, torch.Tensor) and val.is_floating_point()):
                continue  # a sum, or per-token losses; class probabilities: every piece counts alike
            if weight is not None:
                raise NotImplementedError(
                    f"{NAME}: {node.name!r} is a class-weighted mean loss, whose mean divides by the targets' "
                    f"summed weights; with the batch split into {plan.mesh.dp * plan.microbatches} pieces (dp={plan.mesh.dp}, microbatches="
                    f"{plan.microbatches}) graphpass cannot make it one process's yet: weight the loss yourself "
                    "with reduction='none', or train without class weights")
            source = _from_state(_ancestors(target))
            if source is not None:
                raise NotImplementedError(
                    f"{NAME}: the targets {target.name!r} of the mean loss {node.name!r} are computed from "
                    f"{source.target!r}, a parameter or buffer, so they cannot be counted from the batch alone")
            _check_linear(node)
            count = LossCount(_counter(gm, target, ignore_index), f"targets {target.name!r} != {ignore_index}")
            args = list(_args(node))
            args[3] = _SUM
            node.args, node.kwargs = tuple(args) + tuple(node.args[5:]), {
                k: v for k, v in node.kwargs.items() if k not in ("weight", "reduction", "ignore_index")}
            _divide_by_count(gm, node, _count_buffer(gm, node, counted, count, torch.float32), pieces)
        elif (found := _hand_written_mean(node)) is not None and _reaches_output(node):
            _check_linear(node)
            total_of, chain = found
            count = LossCount(_counter(gm, total_of, None), f"the sum {total_of.name!r} over the batch")
            total = _count_buffer(gm, chain[0] if chain else node, counted, count,
                                  total_of.meta[meta.VAL].dtype)
            # the denominator from the global sum; the numerator, this piece's sum, times the pieces
            (chain[0] if chain else node).replace_input_with(total_of, total)
            node.replace_input_with(node.args[0], _scaled(gm, node.args[0], pieces, node))
        else:
            continue
        counted += 1
    if share != 1.0:
        _scale_output_loss(gm, share)
    log.info("%s: %d mean losses divided by their global count (%g pieces)", NAME, counted, pieces)
    gm.recompile()
    return gm


def _share_scale(plan: Plan, rank: int) -> float:
    """``dp b / B`` for this rank's uneven share of ``b`` of the ``B`` samples; 1 for even shares."""
    if plan.dp_shares is None:
        return 1.0
    counts = plan.dp_shares
    return plan.mesh.dp * counts[plan.mesh.coordinate(rank, "dp")] / sum(counts)


def _scale_output_loss(gm: fx.GraphModule, scale: float) -> None:
    output = gm.graph.find_nodes(op="output")[0]
    roles = meta.get(output, meta.ROLE)
    values = list(output.args[0])
    loss = values[roles["loss"]]
    values[roles["loss"]] = _scaled(gm, loss, scale, loss)
    output.args = (tuple(values),)
