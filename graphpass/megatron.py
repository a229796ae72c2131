"""Megatron-LM's tensor-parallel layout for a captured graph: which weights to shard, how.

Reads the graph only (an analysis, no rewriting). Within each repeated layer, a linear whose
output flows — through elementwise, view/transpose and attention ops — into another linear of
the same layer is *column* parallel (weight ``Shard(0)``: q/k/v, MLP up/gate), and the linear it
flows into is *row* parallel (weight ``Shard(1)``: attention output, MLP down). A token embedding
(indexed by a graph input) is vocabulary parallel (``Shard(0)``), and so is a linear that produces
the logits of a cross-entropy, which gives a vocabulary-sharded loss without gathering logits.
Everything else stays replicated.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphpass import meta

aten = torch.ops.aten

# Ops through which a column-parallel output stays sharded on its feature/head dims.
_PASS_THROUGH = {
    aten.view, aten.reshape, aten._unsafe_view, aten.transpose, aten.permute, aten.contiguous, aten.clone,
    aten.gelu, aten.relu, aten.silu, aten.tanh, aten.sigmoid, aten.dropout, aten.mul, aten.add, aten.sub, aten.div,
    aten.neg, aten.cat, aten.slice, aten.unsqueeze, aten.expand, aten.scaled_dot_product_attention, aten.to,
    aten._to_copy, aten.alias, aten.unflatten, aten.flatten, aten.split, aten.chunk, aten.softmax,
    aten.matmul, aten.bmm, aten.type_as, operator.getitem,
}


def _packet(node: fx.Node):
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target


def _is_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target == aten.linear.default


def _weight(node: fx.Node) -> fx.Node | None:
    weight = node.args[1] if len(node.args) > 1 else None
    return weight if isinstance(weight, fx.Node) and weight.op == "get_attr" else None


def _bias(node: fx.Node) -> fx.Node | None:
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return bias if isinstance(bias, fx.Node) and bias.op == "get_attr" else None


def _downstream_linears(start: fx.Node, layer) -> list[fx.Node]:
    """Linears of ``layer`` reached from ``start`` through pass-through ops (not through norms,
    reductions or other linears)."""
    found, stack, seen = [], list(start.users), set()
    while stack:
        node = stack.pop()
        if node in seen or node.op != "call_function" or node.meta.get(meta.LAYER) != layer:
            continue
        seen.add(node)
        if _is_linear(node):
            found.append(node)
        elif _packet(node) in _PASS_THROUGH:
            stack.extend(node.users)
    return found


def _feeds_cross_entropy(node: fx.Node) -> bool:
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        if user.target == aten.cross_entropy_loss.default:
            return True
        if _packet(user) in (aten.view, aten.reshape, aten._unsafe_view, aten.to, aten._to_copy, aten.contiguous,
                             aten.flatten, aten.alias):
            stack.extend(user.users)
    return False


def megatron_placements(gm: fx.GraphModule) -> dict[str, str]:
    """``{get_attr node name: "Shard(0)" | "Shard(1)"}`` for the weights tensor parallelism shards."""
    out: dict[str, str] = {}
    for node in gm.graph.nodes:
        if not _is_linear(node) or _weight(node) is None:
            continue
        layer = node.meta.get(meta.LAYER)
        if layer is None:
            if _feeds_cross_entropy(node):
                out.setdefault(_weight(node).name, "Shard(0)")  # vocabulary-parallel logits
                if _bias(node) is not None:
                    out.setdefault(_bias(node).name, "Shard(0)")
            continue
        if _weight(node).name in out:
            continue
        rows = _downstream_linears(node, layer)
        if not rows:
            continue
        out[_weight(node).name] = "Shard(0)"
        if _bias(node) is not None:
            out[_bias(node).name] = "Shard(0)"
        for row in rows:
            if _weight(row) is not None:
                out.setdefault(_weight(row).name, "Shard(1)")
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.embedding.default:
            weight, idx = node.args[0], node.args[1]
            if isinstance(weight, fx.Node) and weight.op == "get_attr" and isinstance(idx, fx.Node) and idx.op == "placeholder":
                out.setdefault(weight.name, "Shard(0)")  # token embedding: vocabulary parallel
    # A weight shared by several linears (tied) must get one placement; column wins over row only
    # when every use is column-compatible, which setdefault above already ensured.
    return out
