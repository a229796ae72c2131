"""What a graph node's op is called, in the two forms graphpass uses.

:func:`op_name` is the readable, qualified name the dumps, op counts and errors show
(``aten.linear``, ``all_reduce_grads``, ``get_attr``); :func:`op_base` is the bare op the cost
model keys its formulas on, the same for both capture routes (``aten.linear.default`` and
``F.linear`` are both ``linear``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


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
