"""Pipeline stages: the one captured graph cut at layer boundaries into sequential stage graphs.

A stage graph is an ordinary ``fx.GraphModule`` whose attributes keep the original parameter
names. ``torch.distributed.pipelining`` runs stages as a chain (stage ``s`` receives exactly
what stage ``s - 1`` returns, and only stage 0 gets the step's inputs), so:

- stage 0 takes every graph input; stage ``s > 0`` takes, in order of definition, every tensor
  defined before it (graph inputs included) that it or a later stage reads: a value that skips a
  stage is carried through it (a later stage's targets, a residual read two stages on);
- stage ``s`` returns what stage ``s + 1`` takes, and the last stage returns the graph's own
  outputs (the loss);
- a parameter or buffer read by several stages (tied embedding and LM head) is kept in each of
  them under its one name: whoever runs the stages sums its gradient over the stages that share
  it (:func:`shared_parameters`);
- so is every node that reads only parameters, buffers or nothing (the gradient-sync handle, a
  collective over a parameter group and its items, a constant): it is copied into each stage
  that uses it, never sent. A collective over a parameter group used by several stages is an
  error: the passes that group parameters must group them per stage.

The cut works on the captured graph and on the graph after the other passes alike (their
collectives then fall into the stage whose ops they serve).

The cut is positional: stage ``s`` holds the ``call_function`` nodes from its first node up to
the next stage's first node, in the graph's (topological) order, so any cut is a valid program.
:func:`stage_starts` places the cuts at layer boundaries (``meta.LAYER``), the layers split
evenly; the planner places them where its predicted stage times balance.
"""

from __future__ import annotations

import bisect
from typing import Callable, Sequence

import torch
import torch.fx as fx

from graphpass import meta
from graphpass.grads import grad_requiring_nodes
from graphpass.ops import op_name
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.plan import Plan
from graphpass.passes.collectives import is_collective

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


@graph_pass("partition_stages", provides=("stages",))
def partition_stages(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Prepare the graph for its cut into ``plan.stages`` (made once every pass has run): every
    op is tagged with its stage (``meta.STAGE``, which the later passes carry onto the nodes
    they create in place of others), and a parameter or buffer read by several stages gets one
    ``get_attr`` node per stage, so that the passes after this one group and synchronise each
    stage's use on that stage (the runtime then sums a shared parameter's gradient over the
    stages that hold it)."""
    if len(plan.stages) == 1:
        return gm
    stage_of = stage_index(gm, plan.stages)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta[meta.STAGE] = stage_of(node)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        by_stage: dict[int, list[fx.Node]] = {}
        for user in node.users:
            by_stage.setdefault(stage_of(user), []).append(user)
        for s in sorted(by_stage)[1:]:
            first = min(by_stage[s], key=position.__getitem__)
            with gm.graph.inserting_before(first):
                copy = gm.graph.get_attr(node.target)
            copy.meta.update(node.meta)
            copy.meta[meta.PLAN_NAME] = meta.plan_name(node)
            for user in by_stage[s]:
                user.replace_input_with(node, copy)
    gm.recompile()
    return gm


def cut_stages(gm: fx.GraphModule, starts: Sequence[str]) -> list[fx.GraphModule]:
    """The stage graphs of ``gm`` cut before each node named in ``starts`` (``starts[0]`` is
    ``"*"``, the graph's start); see the module docstring for what each takes and returns.

    Raises:
        ValueError: (before :func:`partition_stages` tagged the ops) a start that is not a
            ``call_function`` node of ``gm``, or starts out of order.
        NotImplementedError: a value that is not a tensor crosses a stage boundary.
    """
    stage_of = stage_index(gm, starts)
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    last = len(starts) - 1

    # Nodes that read only parameters, buffers or nothing (a gradient-sync handle, a collective
    # over a parameter group and its items, a constant): copied into every stage that uses them,
    # as parameters are, never carried across a boundary.
    attached: set[fx.Node] = set()
    for node in nodes:
        if node.op == "get_attr" or (node.op == "call_function" and all(a in attached for a in node.all_input_nodes)):
            attached.add(node)
    used_in: dict[fx.Node, set[int]] = {}
    for node in reversed(nodes):
        if node in attached:
            here = set().union(*(used_in.get(u, set()) for u in node.users))
            if not here and node.op == "call_function":  # unused (a shape assertion): where it is
                here = {stage_of(node)}
            used_in[node] = here
            if len(here) > 1 and node.op == "call_function" and is_collective(node) and not node.meta.get(meta.OPAQUE):
                raise ValueError(
                    f"pipeline stages: {node.name} ({op_name(node)}) moves parameters used by stages {sorted(here)}; "
                    "a parameter group must not span a stage boundary (group the parameters per stage)"
                )
        elif node.op != "placeholder":
            used_in[node] = {stage_of(node)}

    ops = [n for n in nodes if n.op == "call_function" and n not in attached]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    # The last stage that reads each value (an op or a graph input): it is carried up to there.
    last_use: dict[fx.Node, int] = {}
    for user in [*ops, output]:
        for value in user.all_input_nodes:
            if value not in attached:
                last_use[value] = max(last_use.get(value, -1), stage_of(user))
    defined = {n: (0 if n.op == "placeholder" else stage_of(n)) for n in [*placeholders, *ops]}
    values = [*placeholders, *ops]
    grads = grad_requiring_nodes(gm)
    graphs = []
    for s in range(len(starts)):
        takes = placeholders if s == 0 else [n for n in values if defined[n] < s and last_use.get(n, -1) >= s]
        members = [n for n in nodes if n.op in ("get_attr", "call_function") and s in used_in[n]]
        returns = None if s == last else [n for n in values if defined[n] <= s and last_use.get(n, -1) > s]
        for value in [*takes, *(returns or ())]:
            if value.op != "placeholder" and not isinstance(value.meta.get(meta.VAL), torch.Tensor):
                raise NotImplementedError(
                    f"pipeline stage {s}: {value.name} ({type(value.meta.get(meta.VAL)).__name__}) crosses a "
                    "stage boundary and is not a tensor; torch.distributed.pipelining sends tensors only"
                )
        graphs.append(_stage_graph(gm, s, takes, members, returns, output, grads))
    return graphs


def _stage_graph(gm: fx.GraphModule, s: int, takes: list[fx.Node], members: list[fx.Node],
                 returns: list[fx.Node] | None, output: fx.Node, grads: set[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in takes:
        env[value] = graph.placeholder(value.name)
        env[value].meta.update(value.meta)
        env[value].meta[meta.REQUIRES_GRAD] = value in grads
    for node in members:
        env[node] = graph.node_copy(node, lambda n: env[n])
        env[node].meta[meta.STAGE] = s
    for value in returns or ():
        env[value].meta[meta.REQUIRES_GRAD] = value in grads
    if returns is None:
        out = graph.output(fx.node.map_arg(output.args[0], lambda n: env[n]))
        out.meta.update(output.meta)
    else:
        graph.output(tuple(env[n] for n in returns))
    stage = fx.GraphModule(gm, graph, class_name=f"Stage{s}")
    stage.graph.lint()
    return stage


def shared_parameters(stages: Sequence[fx.GraphModule]) -> dict[str, list[int]]:
    """Attribute name → the stages that read it, for every parameter read by more than one."""
    users: dict[str, list[int]] = {}
    for s, stage in enumerate(stages):
        for node in stage.graph.nodes:
            if node.op == "get_attr" and meta.get(node, meta.ATTR_KIND, None) == "parameter":
                users.setdefault(node.target, []).append(s)
    return {target: ss for target, ss in users.items() if len(ss) > 1}


__all__ = ["WHOLE", "cut_stages", "layer_starts", "partition_stages", "shared_parameters", "stage_index",
           "stage_starts"]
