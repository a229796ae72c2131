"""Where a graph's pipeline stages start: an analysis, reading the graph only.

The repeated layers (``h.0``, ``h.1``, ... of an ``nn.ModuleList``) are where graphpass cuts a
model into stages: :func:`layer_starts` names each layer's first op, :func:`stage_starts` splits
the layers evenly into ``Plan.stages``, :func:`stage_index` says which stage a node runs in.
The planner and :mod:`graphpass.plan_builder` choose stages with them;
:mod:`graphpass.passes.partition_stages` cuts the graph there.
"""

from __future__ import annotations

import bisect
from typing import Callable, Sequence

import torch.fx as fx

from graphpass import meta

#: ``Plan.stages`` of a graph that is not cut.
WHOLE = ("*",)


def layer_starts(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """``(layer, name of its first node)`` for every repeated layer, in graph order; a layer is
    named by its module path up to its index (``"h.3"``), so an encoder's and a decoder's layer
    3 (``"encoder.block.3"``, ``"decoder.block.3"``) are two layers."""
    seen: dict[str, str] = {}
    for node in gm.graph.nodes:
        layer = node.meta.get(meta.LAYER) if node.op == "call_function" else None
        if layer is None:
            continue
        key = _layer_path(str(node.meta.get(meta.MODULE_PATH, "")), layer)
        if key not in seen:
            seen[key] = node.name
    return list(seen.items())  # in graph order: each layer where its first op is


def _layer_path(module_path: str, layer: int) -> str:
    """``"encoder.block.3.layer.0"`` with layer 3 → ``"encoder.block.3"``."""
    parts = module_path.split(".")
    index = parts.index(str(layer)) if str(layer) in parts else len(parts) - 1
    return ".".join(parts[: index + 1])


def stage_starts(gm: fx.GraphModule, stages: int, *, field: str = "Strategy.pp") -> tuple[str, ...]:
    """The first node of each of ``stages`` stages that split the repeated layers evenly (the
    earlier stages take one more layer where they do not divide); the first stage also runs what
    precedes the layers (embeddings), the last what follows them (final norm, head, loss).

    Raises:
        ValueError: the graph has no repeated layers, or fewer than ``stages``; names ``field``.
    """
    if stages == 1:
        return WHOLE
    layers = layer_starts(gm)
    if not layers:
        raise ValueError(
            f"{field}={stages}: the model has no repeated layers to cut into pipeline stages (graphpass "
            "cuts at the layers of an nn.ModuleList or nn.Sequential, e.g. 'h.0', 'h.1', ...); use "
            f"{field}=1"
        )
    if len(layers) < stages:
        raise ValueError(
            f"{field}={stages} is larger than the model's {len(layers)} repeated layers "
            f"({layers[0][0]} ... {layers[-1][0]}); use {field} <= {len(layers)}"
        )
    base, extra = divmod(len(layers), stages)
    starts, index = [], 0
    for s in range(stages):
        starts.append("*" if s == 0 else layers[index][1])
        index += base + (1 if s < extra else 0)
    return tuple(starts)


def stage_index(gm: fx.GraphModule, starts: Sequence[str]) -> Callable[[fx.Node], int]:
    """``node -> the stage it runs in`` for the cut before each node named in ``starts`` (by
    position in the graph as it is now; the output runs in the last stage).

    Once :func:`partition_stages` has run, the ops carry their stage (``meta.STAGE``; the later
    passes copy it onto the nodes they put in place of others, as they copy the layer), and the
    cut before stage ``s`` is at the first op tagged ``s`` or later: the start names may be gone
    by then (recompute replaces a layer by one checkpoint call, tensor parallelism a linear).

    Raises:
        ValueError: a start that is not a ``call_function`` node of ``gm``, or starts out of order.
    """
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    if not starts or starts[0] != "*":
        raise ValueError(f"Plan.stages must start with '*' (the graph's start), got {tuple(starts)!r}")
    tagged = [(position[n], n.meta[meta.STAGE]) for n in gm.graph.nodes
              if n.op == "call_function" and meta.STAGE in n.meta]
    if tagged:
        cuts = [min((p for p, tag in tagged if tag >= s), default=len(position)) for s in range(1, len(starts))]
    else:
        by_name = {n.name: n for n in gm.graph.nodes}
        cuts = []
        for name in starts[1:]:
            node = by_name.get(name)
            if node is None or node.op != "call_function":
                raise ValueError(f"Plan.stages names {name!r}, which is not an op of the captured graph")
            cuts.append(position[node])
    if cuts != sorted(set(cuts)):
        raise ValueError(f"Plan.stages {tuple(starts)!r} are not in graph order")

    def stage_of(node: fx.Node) -> int:
        if node.op == "output":
            return len(cuts)
        return bisect.bisect_right(cuts, position[node])

    return stage_of


__all__ = ["WHOLE", "layer_starts", "stage_index", "stage_starts"]
