"""What a graph node's op is called, in the two forms graphpass uses, and the classes of ops
graphpass reasons about.

:func:`op_name` is the readable, qualified name the dumps, op counts and errors show
(``aten.linear``, ``all_reduce_grads``, ``get_attr``); :func:`op_base` is the bare op the cost
model keys its formulas on, the same for both capture routes (``aten.linear.default`` and
``F.linear`` are both ``linear``).

The op classes (elementwise, copies, views, per-channel, convolutions) are written here once,
as DTensor groups its op strategies: the tensor-parallel pass registers its rules on them
(`graphpass.passes.tensor_parallel`), Megatron's pattern and the op-level problem
(`graphpass.megatron`, `graphpass.planner.op_placement`) follow shards through them, and the
cost model prices views as free (:data:`VIEW_NAMES`).
"""

from __future__ import annotations

from typing import Any

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

#: Ops that copy or cast their input element by element (linear in it: a partial sum stays one).
COPIES = frozenset({aten.clone, aten.contiguous, aten.alias, aten.detach, aten.to, aten._to_copy,
                    aten.lift_fresh_copy, aten.type_as})
#: Unary ops on each element apart (a value sharded on any dim stays so through them).
ELEMENTWISE_UNARY = COPIES | {
    aten.gelu, aten.relu, aten.silu, aten.tanh, aten.sigmoid, aten.exp, aten.log, aten.cos, aten.sin, aten.rsqrt,
    aten.sqrt, aten.pow.Tensor_Scalar, aten.dropout, aten.neg, aten.abs, aten.reciprocal, aten.logical_not, aten.bitwise_not,
    aten.erf, aten.square,
}
#: Unary ops linear in their input: a partial sum goes through them unreduced.
LINEAR_UNARY = COPIES | {aten.neg}
#: Arithmetic on each element pair apart (broadcasting).
ARITHMETIC = frozenset({aten.add, aten.sub, aten.mul, aten.div})
#: Every binary op on each element pair apart (broadcasting): arithmetic, comparisons, selects.
BINARY = ARITHMETIC | {aten.where, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.logical_and,
                       aten.logical_or, aten.maximum, aten.minimum, aten.masked_fill, aten.rsub}
#: The elementwise ops Megatron's pattern and the op-level problem follow a feature shard through.
ELEMENTWISE = ELEMENTWISE_UNARY | ARITHMETIC
#: Normalisations along one dim: elementwise elsewhere, whole along it.
SOFTMAXES = frozenset({aten.softmax, aten.log_softmax})
#: Views that take a target shape.
RESHAPES = frozenset({aten.view, aten.reshape, aten._unsafe_view})
#: Pooling: on each channel (dim 1) apart.
POOLS = frozenset({aten.max_pool1d, aten.max_pool2d, aten.max_pool3d, aten.avg_pool1d, aten.avg_pool2d,
                   aten.avg_pool3d, aten.adaptive_avg_pool1d, aten.adaptive_avg_pool2d, aten.adaptive_avg_pool3d})
#: Ops on each channel (dim 1) apart beside the elementwise ones: batch norm and pooling.
PER_CHANNEL = POOLS | {aten.batch_norm}
#: Convolutions (their weight ``[out, in, *kernel]``).
CONVOLUTIONS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
#: Ops through which a parameter's gradient flows back whole to it (its pieces, views and casts).
PARAM_VIEWS = RESHAPES | (COPIES - {aten.clone, aten.lift_fresh_copy, aten.type_as}) | {
    operator.getitem, aten.split, aten.split_with_sizes, aten.chunk, aten.t, aten.transpose, aten.slice,
    aten.unflatten, aten.flatten}
#: Ops that only reinterpret or select storage (by base name, :func:`op_base`): no FLOPs, no bytes.
VIEW_NAMES = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "expand_as",
    "unsqueeze", "squeeze", "slice", "select", "alias", "detach", "as_strided", "unflatten",
    "flatten", "split", "split_with_sizes", "chunk", "unbind", "narrow", "view_as", "getitem",
    "contiguous", "size", "dim",
})


def op_name(node: fx.Node) -> str:
    """Short readable name of a node's op: ``aten.linear``, ``all_reduce_grads``, ``get_attr``."""
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def op_base(node: fx.Node) -> str:
    """The op's base name for both capture routes: ``aten.linear.default`` and ``F.linear`` →
    ``"linear"``, ``operator.getitem`` → ``"getitem"``, ``Tensor.view`` → ``"view"``."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    return getattr(target, "__name__", str(target))


def is_in(node: fx.Node, ops: frozenset) -> bool:
    """Whether ``node`` calls one of ``ops`` (packets, or overloads where a class names one)."""
    return node.op == "call_function" and (node.target in ops or packet(node) in ops)


def packet(node: fx.Node):
    """The op of a ``call_function`` node without its overload (``aten.view`` for
    ``aten.view.default``), to compare against ``torch.ops.aten`` packets; other targets as
    they are."""
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target


#: Targets that are a linear: the export route's aten op, the symbolic_trace route's F.linear.
LINEAR_TARGETS = (torch.ops.aten.linear.default, torch._C._nn.linear, torch.nn.functional.linear)


def is_linear(node: fx.Node) -> bool:
    """True for a ``call_function`` node that computes ``x @ W.T + b``."""
    return node.op == "call_function" and node.target in LINEAR_TARGETS


def linear_operands(node: fx.Node) -> tuple[Any, Any, Any]:
    """(input, weight, bias or None) of a linear node, whether passed by position or keyword."""
    names = ("input", "weight", "bias")
    values = dict(zip(names, node.args))
    values.update({k: v for k, v in node.kwargs.items() if k in names})
    return values.get("input"), values.get("weight"), values.get("bias")
