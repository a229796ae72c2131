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

from typing import Sequence

import torch
import torch.fx as fx

from graphpass import meta
from graphpass.grads import grad_requiring_nodes
from graphpass.ops import op_name
from graphpass.stages import stage_index
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.plan import Plan
from graphpass.passes.collectives import is_collective

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


__all__ = ["cut_stages", "partition_stages", "shared_parameters"]
