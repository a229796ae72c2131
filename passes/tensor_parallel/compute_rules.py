"""Tensor-parallel rules of the ops that compute with weights (DTensor's matrix and math ops):
linear (column / row / vocabulary parallel), embedding, cross-entropy, attention, matmul, layer
norm, convolutions (channel parallel), batch norm and pooling.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Shard

from graphpass import meta
from graphpass.ops import CONVOLUTIONS, POOLS
from graphpass.megatron import Projection, keeps_features, projection
from graphpass.passes import collectives
from graphpass.passes.tensor_parallel.pointwise_rules import binary
from graphpass.passes.tensor_parallel.walker import (
    AXIS, NAME, P, R, aten, MergedShard, no_rule, PartsShard, rule, TensorParallelError, Walker,
)


# ---------------------------------------------------------------------- rules: compute


@rule(aten.linear.default, aten.addmm.default, carries=(MergedShard,))
def _linear(w: Walker, node: fx.Node) -> Any:
    """A projection (``aten.linear``, or ``Conv1D``'s ``addmm`` with its ``[in, out]`` weight:
    :func:`graphpass.megatron.projection`): column parallel when the weight is sharded on its
    output features, row parallel when sharded on its input features."""
    proj = projection(node)
    if proj is None:  # an addmm of activations: no layout, replicated as ops without a rule
        w.gather_merged(node)
        return no_rule(w, node)
    x, weight, bias, xi, bi = proj.x, proj.weight, proj.bias, proj.x_index, proj.bias_index
    wp, xp = w.placement(weight), w.placement(x)
    last = w.ndim(x) - 1
    if wp == Shard(proj.out_dim):  # the weight's output features: column parallel
        if isinstance(xp, (Shard, MergedShard)):  # sequence parallel: gathered, reduce-scattered back
            new_x = w.redistribute(x, R, node, grad=P)
        else:
            new_x = w.copy_for_sharded_use(w.redistribute(x, R, node), node)
        w.set_arg(node, xi, new_x)
        if bias is not None and w.placement(bias) == R:
            w.set_arg(node, bi, w.redistribute(bias, Shard(0), node))
        parts = w.parts.get(weight)
        if parts is not None:
            if bias is not None and w.parts.get(bias) != parts:
                raise TensorParallelError(f"{w.where(node)}: the fused weight's bias is not sharded by the same parts")
            return PartsShard(last, parts)
        return Shard(last)
    if wp == Shard(1 - proj.out_dim):  # its input features, row parallel: partial sums
        w.set_arg(node, xi, w.redistribute(x, Shard(last), node))
        if bias is not None:
            _bias_after_reduction(w, node, proj)
        return P
    # Replicated weight: sharding of the batch/sequence dims passes through.
    if isinstance(xp, (Shard, MergedShard)) and xp.dim == last:
        w.set_arg(node, xi, w.redistribute(x, R, node))
        xp = R
    if xp == P and bias is not None:
        w.set_arg(node, xi, w.redistribute(x, R, node))
        xp = R
    if xp != R:
        w.mark_partial_grad(weight)
        if bias is not None:
            w.mark_partial_grad(bias)
    return xp


def _bias_after_reduction(w: Walker, node: fx.Node, proj: Projection) -> None:
    """A row-parallel projection computes partial sums without its bias; the bias is added to
    their sum. ``Conv1D``'s ``addmm`` becomes ``mm``, and its bias is added after the view back
    to ``[B, T, out]`` that follows it, so that under sequence parallelism the partial sums are
    reduce-scattered along the sequence there."""
    anchor = node
    if node.target == aten.addmm.default:
        node.target = aten.mm.default
        node.args = (node.args[proj.x_index], proj.weight)
        users = list(node.users)
        if len(users) == 1 and keeps_features(users[0]) and w.ndim(users[0]) > w.ndim(node):
            anchor = users[0]  # [B, T, out], batch first as Conv1D's models are
    else:
        node.args = tuple(node.args[:2])
    node.kwargs = {}
    with w.graph.inserting_after(anchor):
        add = w.graph.call_function(aten.add.Tensor, (anchor, proj.bias))
    meta.copy_meta(anchor, add)
    add.meta[meta.VAL] = anchor.meta.get(meta.VAL)
    anchor.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
    w.gshape[add] = w.gshape.get(anchor, ())
    w.inherit_grad(anchor, add)
    if anchor is node:
        w.place[node] = P
        w.place[add] = binary(w, add)
    else:  # placed when the walk reaches it, right after the view
        w.after.setdefault(anchor, []).append(add)


@rule(aten.embedding.default)
def _embedding(w: Walker, node: fx.Node) -> Placement:
    weight, idx = node.args[0], node.args[1]
    wp = w.placement(weight)
    if wp == Shard(0):  # vocabulary parallel: look up local rows, zero the others
        idx = w.redistribute(idx, R, node)
        rows = w.gshape[weight][0] // w.size
        start, stop = w.rank * rows, (w.rank + 1) * rows
        g = w.graph

        def local_op(target, *args):
            new = g.call_function(target, args)
            meta.copy_meta(node, new)
            new.meta[meta.CREATED_BY] = NAME
            w.place[new] = R
            return new

        with g.inserting_before(node):
            below = local_op(aten.lt.Scalar, idx, start)
            above = local_op(aten.ge.Scalar, idx, stop)
            outside = local_op(aten.logical_or.default, below, above)
            shifted = local_op(aten.sub.Tensor, idx, start)
            local_idx = local_op(aten.where.ScalarSelf, outside, 0, shifted)  # outside ? 0 : idx - start
        w.set_arg(node, 1, local_idx)
        padding = node.args[2] if len(node.args) > 2 else -1
        if padding is not None and padding >= 0:  # padding_idx is a global row: local or none
            w.set_arg(node, 2, padding - start if start <= padding < stop else -1)
        with g.inserting_before(node.next):  # in order, right after the lookup
            inside = local_op(aten.logical_not.default, outside)
            keep = local_op(aten.unsqueeze.default, inside, -1)
            masked = local_op(aten.mul.Tensor, node, keep)
        node.replace_all_uses_with(masked, delete_user_cb=lambda u: u is not masked)
        w.gshape[masked] = w.gshape.get(node, ())
        w.inherit_grad(node, masked)
        w.place[node] = P
        w.place[masked] = P
        return P
    if wp == Shard(1):
        return Shard(w.ndim(node) - 1)
    ip = w.placement(idx)
    if ip != R:
        w.mark_partial_grad(weight)
    return ip


@rule(aten.cross_entropy_loss.default)
def _cross_entropy(w: Walker, node: fx.Node) -> Placement:
    logits, target = node.args[0], node.args[1]
    args = list(node.args) + [None] * (6 - len(node.args))
    weight, reduction, ignore_index, smoothing = args[2], args[3], args[4], args[5]
    reduction = 1 if reduction is None else reduction
    ignore_index = -100 if ignore_index is None else ignore_index
    lp = w.placement(logits)
    vocab_dim = w.ndim(logits) - 1
    if lp == Shard(vocab_dim) and w.ndim(logits) == 2 and weight is None and reduction in (1, 2) and not smoothing:
        target = w.redistribute(target, R, node)
        rows = w.gshape[logits][1] // w.size
        with w.graph.inserting_before(node):
            new = collectives.emit_vocab_parallel_cross_entropy(
                w.gm, logits, target, AXIS, w.size, w.rank * rows, ignore_index, created_by=NAME,
                reduction="mean" if reduction == 1 else "sum",  # a sum: global_loss_mean's
            )
        meta.copy_meta(node, new)
        node.replace_all_uses_with(new)
        w.graph.erase_node(node)
        w.place[new] = R
        return R
    return w.to_replicate_all(node)


@rule(aten.scaled_dot_product_attention.default)
def _attention(w: Walker, node: fx.Node) -> Placement:
    q, k, v = node.args[:3]
    places = [w.placement(t) for t in (q, k, v)]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if places[0] == Shard(1) and _same_heads(w, node):
        # Replicated keys/values (kv heads fewer than tp, repeated to the query's heads): keep
        # this rank's heads, a local slice whose backward all-gathers the gradient.
        for i in (1, 2):
            if places[i] == R:
                w.set_arg(node, i, w.redistribute(node.args[i], Shard(1), node))
        places = [w.placement(t) for t in node.args[:3]]
    if all(p == Shard(1) for p in places):  # heads split across ranks
        if isinstance(mask, fx.Node) and len(w.gshape.get(mask, ())) == 4 and w.gshape[mask][1] != 1:
            local_mask = w.redistribute(mask, Shard(1), node)  # a per-head mask: keep our heads
            if len(node.args) > 3:
                w.set_arg(node, 3, local_mask)
            else:
                node.update_kwarg("attn_mask", local_mask)
        return Shard(1)
    return w.to_replicate_all(node)


def _same_heads(w: Walker, node: fx.Node) -> bool:
    """Whether an attention's q, k and v have the same global head count (dim 1): not grouped
    attention that maps several query heads onto one kv head inside the op."""
    shapes = [w.gshape.get(t, ()) for t in node.args[:3] if isinstance(t, fx.Node)]
    return len(shapes) == 3 and all(len(s) == 4 for s in shapes) and len({s[1] for s in shapes}) == 1


def _matmul_out(w: Walker, node: fx.Node, a: fx.Node, b: fx.Node) -> Any:
    """Placement of ``a @ b`` (both at least 2-D, batch dims broadcast) from its operands', or
    None when they do not combine locally: the same batch dim sharded on both (the heads of
    eager attention), rows of ``a`` or columns of ``b`` sharded with the other operand
    replicated (or broadcast along that batch dim), or the contracted dim sharded on both (a
    partial sum)."""
    na, nb, out = w.ndim(a), w.ndim(b), w.ndim(node)
    pa, pb = w.placement(a), w.placement(b)
    if pa == P or pb == P:
        return None

    def broadcast_in(x: fx.Node, out_dim: int) -> bool:
        """Whether ``x`` broadcasts along output batch dim ``out_dim`` (absent, or of size 1)."""
        dim = out_dim - (out - w.ndim(x))
        return dim < 0 or w.gshape[x][dim] == 1

    if isinstance(pa, Shard) and isinstance(pb, Shard):
        da, db = pa.dim + out - na, pb.dim + out - nb
        if pa.dim < na - 2 and pb.dim < nb - 2 and da == db:
            return Shard(da)
        if pa.dim == na - 1 and pb.dim == nb - 2:
            return P
        return None
    if isinstance(pa, Shard):
        da = pa.dim + out - na
        return Shard(da) if pa.dim == na - 2 or (pa.dim < na - 2 and broadcast_in(b, da)) else None
    if isinstance(pb, Shard):
        db = pb.dim + out - nb
        return Shard(db) if pb.dim == nb - 1 or (pb.dim < nb - 2 and broadcast_in(a, db)) else None
    return R


def _narrow_batch_operand(w: Walker, node: fx.Node, a: fx.Node, b: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """When one operand is sharded on a batch dim (heads) and the other is replicated with that
    dim whole (keys or values replicated for kv heads fewer than tp, repeated to every head): the
    replicated one narrowed to this rank's slice of the dim, a local slice."""
    out = w.ndim(node)
    for sharded, other, first in ((a, b, True), (b, a, False)):
        ps, po = w.placement(sharded), w.placement(other)
        ns, no = w.ndim(sharded), w.ndim(other)
        if not (isinstance(ps, Shard) and ps.dim < ns - 2 and po == R):
            continue
        dim = ps.dim + out - ns  # the output batch dim
        odim = dim - (out - no)
        if odim < 0 or w.gshape[other][odim] != w.gshape[sharded][ps.dim]:
            continue
        narrowed = w.redistribute(other, Shard(odim), node)
        return (sharded, narrowed) if first else (narrowed, sharded)
    return None


@rule(aten.matmul.default, aten.bmm.default)
def _matmul(w: Walker, node: fx.Node) -> Placement:
    a, b = node.args[0], node.args[1]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or w.ndim(a) < 2 or w.ndim(b) < 2:
        return w.to_replicate_all(node)
    placed = _matmul_out(w, node, a, b)
    if placed is None:
        narrowed = _narrow_batch_operand(w, node, a, b)
        placed = _matmul_out(w, node, *narrowed) if narrowed else None
        if placed is None:
            return w.to_replicate_all(node)
        for i, operand in enumerate(narrowed):
            w.set_arg(node, i, operand)
        a, b = narrowed
    if placed not in (R, P):
        for i, operand in enumerate((a, b)):
            if w.placement(operand) != R:
                continue
            # A replicated operand meeting sharded compute has a partial gradient.
            if operand.op == "get_attr":
                w.mark_partial_grad(operand)
            else:
                w.set_arg(node, i, w.copy_for_sharded_use(operand, node))
    return placed


@rule(aten.layer_norm.default)
def _layer_norm(w: Walker, node: fx.Node) -> Placement:
    x, normalized = node.args[0], node.args[1]
    xp = w.placement(x)
    if isinstance(xp, Shard) and xp.dim < w.ndim(x) - len(normalized):
        for param in node.args[2:4]:
            w.mark_partial_grad(param)
        return xp
    w.set_arg(node, 0, w.redistribute(x, R, node))
    return R




@rule(*CONVOLUTIONS)
def _conv(w: Walker, node: fx.Node) -> Placement:
    """A convolution by a held weight ``[out, in, *kernel]`` (``groups == 1``), channel parallel:
    *column* when the weight is sharded on its output channels (dim 0): a replicated input (its
    gradient partial, Megatron's f), an output sharded on its channels (dim 1), the bias with it;
    *row* when sharded on its input channels (dim 1): the input sharded on its channels, partial
    sums, the bias added after their reduction. A replicated weight gathers a sharded input."""
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    groups = node.args[6] if len(node.args) > 6 else 1
    wp = w.placement(weight)
    if groups != 1 and isinstance(wp, Shard):
        raise TensorParallelError(f"{w.where(node)}: a grouped convolution (groups={groups}) cannot be "
                                  "channel parallel; leave its weight replicated")
    if wp == Shard(0):
        w.set_arg(node, 0, w.copy_for_sharded_use(w.redistribute(x, R, node), node))
        if isinstance(bias, fx.Node) and w.placement(bias) == R:
            w.set_arg(node, 2, w.redistribute(bias, Shard(0), node))
        return Shard(1)
    if wp == Shard(1):
        w.set_arg(node, 0, w.redistribute(x, Shard(1), node))
        if isinstance(bias, fx.Node):
            _conv_bias_after_reduction(w, node, bias)
        return P
    if w.placement(x) != R:
        w.set_arg(node, 0, w.redistribute(x, R, node))
    return R


def _conv_bias_after_reduction(w: Walker, node: fx.Node, bias: fx.Node) -> None:
    """A row-parallel convolution computes partial sums without its bias; the bias, viewed as
    ``[out, 1, ...]``, is added to their sum."""
    w.set_arg(node, 2, None)
    spatial = w.ndim(node) - 2
    with w.graph.inserting_after(node):
        shaped = w.graph.call_function(aten.reshape.default, (bias, [-1] + [1] * spatial))
    with w.graph.inserting_after(shaped):
        add = w.graph.call_function(aten.add.Tensor, (node, shaped))
    meta.copy_meta(bias, shaped, exclude=meta.TENSOR_KEYS)
    shaped.meta[meta.VAL] = bias.meta[meta.VAL].reshape([-1] + [1] * spatial)
    meta.copy_meta(node, add)
    add.meta[meta.VAL] = node.meta.get(meta.VAL)
    node.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
    w.gshape[shaped] = (w.gshape[bias][0], *[1] * spatial)
    w.gshape[add] = w.gshape.get(node, ())
    w.place[shaped] = R
    w.inherit_grad(node, add)
    w.place[node] = P
    w.place[add] = binary(w, add)


def _keeps_channels(node: fx.Node, source: fx.Node, dim: int) -> int | None:
    """Ops on each channel (dim 1) apart keep a channel shard (batch norm: with its weights and
    statistics sharded alike)."""
    return 1 if dim == 1 else None


@rule(aten.batch_norm.default, keeps=_keeps_channels)
def _batch_norm(w: Walker, node: fx.Node) -> Placement:
    """Batch norm normalises each channel (dim 1) apart: with its weight, bias and running
    statistics sharded on their channels (dim 0), its input is sharded on its channels and stays
    so (each rank updates its channels' statistics); otherwise the input is gathered."""
    x = node.args[0]
    params = [a for a in node.args[1:5] if isinstance(a, fx.Node)]
    placed = [w.placement(a) for a in params]
    if params and all(p == Shard(0) for p in placed):
        w.set_arg(node, 0, w.redistribute(x, Shard(1), node))
        return Shard(1)
    if any(isinstance(p, Shard) for p in placed):
        raise TensorParallelError(f"{w.where(node)}: batch norm needs its weight, bias and running statistics "
                                  "sharded together on their channels (Shard(0)), or none of them")
    w.set_arg(node, 0, w.redistribute(x, R, node))
    return R


@rule(*POOLS, keeps=_keeps_channels)
def _pool(w: Walker, node: fx.Node) -> Placement:
    """Pooling works on each channel (dim 1) apart: a channel-sharded input stays so."""
    x = node.args[0]
    xp = w.placement(x)
    if xp == R or xp == Shard(1):
        return xp
    w.set_arg(node, 0, w.redistribute(x, R, node))
    return R
