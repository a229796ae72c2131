"""The tensor-parallel pass dry-run for a plan on a meta skeleton of the graph (rank 0): the
placements it gives every node and the collectives it emits, which the planner prices, so that
it prices exactly what the real pass emits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.placement_types import Shard

from graphpass import meta
from graphpass.passes import collectives
from graphpass.plan import Plan
from graphpass.transitions import TABLE
from graphpass.passes.tensor_parallel.walker import AXIS, NAME, R, MergedShard, PartsShard, Walker


class _Skeleton(fx.GraphModule):
    """A GraphModule that never generates its Python code: a dry run rewrites its graph but
    never calls it (whoever runs the program copies the graph into a module of its own), and
    generating the code of a 96-layer graph at every tp a planner prices costs seconds."""

    def recompile(self) -> Any:
        return None


def _skeleton(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose parameters and buffers are meta tensors of the same shapes.

    The tensor-parallel walk rewrites the graph and swaps attributes for their shards; on the
    skeleton that costs no memory and leaves ``gm`` untouched. Its code is not generated: copy
    its graph into a module of your own to run it.
    """
    root = nn.Module()
    for node in gm.graph.find_nodes(op="get_attr"):
        module_path, _, attr = node.target.rpartition(".")
        value = getattr(gm.get_submodule(module_path), attr)
        owner = root
        for part in module_path.split(".") if module_path else ():
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if isinstance(value, nn.Module):
            owner.add_module(attr, value)
        elif isinstance(value, nn.Parameter):
            owner.register_parameter(attr, nn.Parameter(_meta_like(value), value.requires_grad))
        elif isinstance(value, torch.Tensor):
            owner.register_buffer(attr, _meta_like(value))
        else:
            setattr(owner, attr, value)
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    output = graph.output(out)
    output.meta.update(gm.graph.find_nodes(op="output")[0].meta)
    return _Skeleton(root, graph)


def _meta_like(value: torch.Tensor) -> torch.Tensor:
    # not empty_like: on an nn.Parameter that dispatches through __torch_function__, ~0.4 ms a call
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


@dataclass(frozen=True)
class EmittedCollective:
    """One collective the pass would insert: the transition-table entry it carries out
    (:data:`graphpass.transitions.TABLE`), the full (global) shape and dtype of the tensor it
    moves, and the repeated layer it sits in (None outside layers)."""

    transition: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layer: int | None
    #: the captured node whose value it moves (through other inserted nodes), for attribution
    anchor: str = ""

    @property
    def size_bytes(self) -> float:
        """``S`` of its entry for the tensor it moves (`Transition.size_bytes`)."""
        return TABLE[self.transition].size_bytes(self.shape, self.dtype)


@dataclass(frozen=True)
class DryRun:
    """What the pass would do for a plan: each original node's ``tp`` placement, the emitted
    collectives, in graph order, and the program itself (rank 0's rewritten graph on a meta
    skeleton: sharded parameters, the pass's added ops and collectives; its fake values are
    not yet re-derived; None for tp 1)."""

    placements: dict[str, Any]
    collectives: tuple[EmittedCollective, ...]
    program: fx.GraphModule | None = None


def _dtype_of(node: fx.Node) -> torch.dtype:
    stack, seen = [node], set()
    while stack:
        n = stack.pop(0)
        if n in seen:
            continue
        seen.add(n)
        val = n.meta.get(meta.VAL)
        if isinstance(val, torch.Tensor):
            return val.dtype
        stack.extend(n.all_input_nodes)
    return torch.float32


def layout(gm: fx.GraphModule, plan: Plan) -> DryRun:
    """Dry-run this pass for ``plan`` (as rank 0) on a meta skeleton, leaving ``gm`` untouched.

    The planner prices tensor parallelism from the result, so it prices exactly the collectives
    the real pass emits.

    Raises:
        TensorParallelError: the plan cannot be applied (a sharded size not divisible by tp).
    """
    size = plan.mesh.get(AXIS, 1)
    if size == 1:
        return DryRun({n.name: R for n in gm.graph.nodes}, ())
    skeleton = _skeleton(gm)
    walker = Walker(skeleton, plan, size, 0)
    walker.run()
    emitted = []
    for node in skeleton.graph.nodes:
        if node.meta.get(meta.CREATED_BY) != NAME or not collectives.is_collective(node):
            continue
        source = node.args[0]
        shape = walker.gshape.get(source, ())
        anchor = source
        while anchor.meta.get(meta.CREATED_BY) == NAME and anchor.all_input_nodes:
            anchor = anchor.all_input_nodes[0]
        emitted.append(EmittedCollective(
            node.meta[meta.TRANSITION], tuple(shape), _dtype_of(source), node.meta.get(meta.LAYER), anchor.name,
        ))
    placements = {n.name: Shard(p.dim) if isinstance(p, (PartsShard, MergedShard)) else p
                  for n, p in walker.place.items() if n.meta.get(meta.CREATED_BY) != NAME}
    return DryRun(placements, tuple(emitted), skeleton)
