"""Which values of a graph need a gradient in training.

Parameters do, and every floating-point value computed from one; graph inputs (data) and
buffers never do. The cost model prices backward from it, the profiler times ops with it, and
pipeline stages tell the engine which received activations to differentiate.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.fx as fx

from graphpass import meta


def grad_requiring_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value needs a gradient in training: parameters and every floating-point value
    computed from one. Placeholders (data) and buffers never do."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            kind = meta.get(node, meta.ATTR_KIND, None)
            if kind == "parameter" or kind is None and is_float(node.meta.get(meta.VAL)):
                out.add(node)
        elif node.op == "call_function" and is_float(node.meta.get(meta.VAL)):
            if any(a in out for a in node.all_input_nodes):
                out.add(node)
    return out


def is_float(value: Any) -> bool:
    """Whether ``value`` (a tensor, or nested tuples/lists/dicts of them) holds a floating or
    complex tensor."""
    return any(t.is_floating_point() or t.is_complex() for t in tensors(value))


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or nested tuples/lists/dicts of them), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)
