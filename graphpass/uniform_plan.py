"""The plan a uniform :class:`~graphpass.plan.Strategy` implies for a captured graph.

``compile(strategy=gp.Strategy(...))``, the planner's pricing of uniform strategies and the
tests all build their plans here, so a uniform strategy means one thing everywhere.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from graphpass import meta
from graphpass.megatron import megatron_layout
from graphpass.passes.split_operators import default_split
from graphpass.plan import Plan, Strategy


def plan_from_strategy(gm: fx.GraphModule, strategy: Strategy, reasons: Sequence[str]) -> Plan:
    """The plan a uniform strategy implies for a captured graph.

    Data parallel: every input is ``Shard(0)`` on ``dp`` (the batch is split), every parameter
    and buffer ``Replicate()``, and the loss ``Partial(avg)`` (a per-rank mean). ``zero=k``
    gives every trainable parameter ZeRO stage k; ``recompute=True`` recomputes every repeated
    layer; ``split=k`` splits every linear with an untied weight of at least k rows k ways along
    its output features (``split_operators.default_split``).
    """
    mesh = {"dp": strategy.dp}
    tp_placements: dict[str, str] = {}
    tp_parts: dict[str, tuple[int, ...]] = {}
    if strategy.tp > 1:
        mesh["tp"] = strategy.tp
        tp_placements, tp_parts = megatron_layout(gm)
    placements: dict[str, dict[str, str]] = {}
    zero: dict[str, int] = {}
    layers: set[int] = set()
    for node in gm.graph.nodes:
        layer = node.meta.get(meta.LAYER)
        if layer is not None and node.op == "call_function":
            layers.add(layer)
        if node.op == "placeholder":
            placements[node.name] = {"dp": "Shard(0)"}
        elif node.op == "get_attr":
            placements[node.name] = {"dp": "Replicate()"}
            if node.name in tp_placements:
                placements[node.name]["tp"] = tp_placements[node.name]
            if strategy.zero and meta.get(node, meta.ATTR_KIND) == "parameter":
                tensor = gm.get_parameter(node.target)
                if tensor.dim() > 0 and tensor.requires_grad:  # ZeRO shards along dim 0
                    zero[node.name] = strategy.zero
    output = gm.graph.find_nodes(op="output")[0]
    loss = output.args[0][meta.get(output, meta.ROLE)["loss"]]
    placements[loss.name] = {"dp": "Partial(avg)"}
    return Plan(
        mesh=mesh,
        placements=placements,
        strategy=strategy,
        zero=zero,
        recompute=tuple(sorted(layers)) if strategy.recompute else (),
        sequence_parallel=strategy.sequence_parallel,
        split=default_split(gm, strategy.split),
        microbatches=strategy.microbatches,
        tp_parts=tp_parts,
        reasons=tuple(reasons),
    )
