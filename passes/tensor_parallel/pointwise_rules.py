"""Tensor-parallel rules of elementwise ops: unary ops keep their input's placement (a partial
sum only through ops linear in it), binary ops broadcast placements as DTensor's pointwise
strategies do.
"""

from __future__ import annotations


import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Shard

from graphpass.ops import BINARY, ELEMENTWISE_UNARY, LINEAR_UNARY, SOFTMAXES, packet as _packet
from graphpass.passes.tensor_parallel.walker import P, R, aten, norm_dim, rule, shape_of, Walker


# ---------------------------------------------------------------------- rules: elementwise

def _gathers(node: fx.Node, dim: int, ndim: int) -> bool:
    """A softmax needs whole the dim it normalises along; elementwise ops need nothing whole."""
    return _packet(node) in SOFTMAXES and dim == norm_dim(node.args[1], ndim)


def _keeps_unary(node: fx.Node, source: fx.Node, dim: int) -> int | None:
    return None if _gathers(node, dim, len(shape_of(source))) else dim


@rule(*ELEMENTWISE_UNARY, aten.softmax.int, aten.log_softmax.int, keeps=_keeps_unary)
def _unary(w: Walker, node: fx.Node) -> Placement:
    x = node.args[0]
    xp = w.placement(x)
    packet = _packet(node)
    if xp == P and packet not in LINEAR_UNARY:
        # Sequence parallel: materialise partial sums as sequence shards (reduce-scatter).
        dst = Shard(1) if w.sp and w.ndim(x) >= 3 else R
        w.set_arg(node, 0, w.redistribute(x, dst, node))
        return dst
    if isinstance(xp, Shard) and _gathers(node, xp.dim, w.ndim(x)):
        w.set_arg(node, 0, w.redistribute(x, R, node))
        return R
    return xp


def binary(w: Walker, node: fx.Node) -> Placement:
    out_nd = len(w.gshape.get(node, ()))
    operands = [(i, a) for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a in w.place]
    if not operands:
        return R
    packet = node.target.overloadpacket if isinstance(node.target, torch._ops.OpOverload) else None
    additive = packet in (aten.add, aten.sub)
    places = {i: w.placement(a) for i, a in operands}
    partial = [i for i, p in places.items() if p == P]
    if partial:
        others = [i for i in places if i not in partial]
        if additive and not others:
            return P
        if (packet in (aten.mul, aten.div) and len(partial) == 1 and (packet is aten.mul or partial[0] == 0)
                and all(places[i] == R and node.args[i] not in w.needs_grad for i in others)):
            return P  # (sum x_r) * c = sum (x_r * c) for a constant c (an embedding's scale): stay partial
        # A partial sum meets another value: reduce it (to the other's shard if it has one).
        target = R
        sharded = [places[i] for i in others if isinstance(places[i], Shard)]
        if sharded:
            target = _to_out(sharded[0], w.ndim(node.args[others[0]]), out_nd)
        elif additive and w.sp and out_nd >= 3:
            target = Shard(1)  # sequence parallel: reduce-scatter along the sequence
        for i in partial:
            arg = node.args[i]
            dst = _to_in(target, w.ndim(arg), out_nd) if isinstance(target, Shard) else R
            w.set_arg(node, i, w.redistribute(arg, dst, node))
            places[i] = dst
    shards = {_to_out(p, w.ndim(node.args[i]), out_nd) for i, p in places.items() if isinstance(p, Shard)}
    if not shards:
        return R
    if len(shards) > 1:
        for i, _ in operands:
            w.set_arg(node, i, w.redistribute(node.args[i], R, node))
        return R
    (out_shard,) = shards
    for i, arg in operands:
        if isinstance(places[i], Shard):
            continue
        nd = w.ndim(arg)
        in_dim = out_shard.dim - (out_nd - nd)
        if in_dim >= 0 and w.gshape[arg][in_dim] != 1:
            w.set_arg(node, i, w.redistribute(arg, Shard(in_dim), node))  # local chunk, no traffic
        elif arg.op == "get_attr":
            w.mark_partial_grad(arg)  # broadcast against shards: each rank has part of its grad
        else:
            w.set_arg(node, i, w.copy_for_sharded_use(arg, node))
    return out_shard


def _to_out(p: Shard, in_nd: int, out_nd: int) -> Shard:
    return Shard(p.dim + (out_nd - in_nd))


def _to_in(p: Shard, in_nd: int, out_nd: int) -> Shard:
    return Shard(p.dim - (out_nd - in_nd))


def _keeps_binary(node: fx.Node, source: fx.Node, dim: int) -> int | None:
    """A broadcasting op keeps an operand's shard, on the output's dim it broadcasts to (the
    other operands sliced to it locally)."""
    return _to_out(Shard(dim), len(shape_of(source)), len(shape_of(node))).dim


rule(*BINARY, keeps=_keeps_binary)(binary)
