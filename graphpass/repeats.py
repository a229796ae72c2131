"""Runs of identical layers, and the graph with each run's interior cut out.

A 96-layer model is 96 copies of one layer. What the planner learns from a fake-tensor run
(the bytes autograd saves per node, the bytes each block's backward allocates) is the same for
every layer of a run whose neighbours are alike, so it runs the graph once with a run's interior
layers cut out and gives each cut layer the figures of the layer standing in for it.

A run keeps its first two layers and its last: the first reads from what comes before the run,
the last feeds what comes after it, and the second stands in for every layer between the second
and the last (each reads the previous layer and is read by the next). The cut is made only where
that holds exactly, checked node by node: the same op with the same constant arguments, each
input at the same position in the same block, the previous layer, or outside the run (the same
node), and no value of a layer read beyond the next one. Anything else keeps the graph whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch.fx as fx

#: a run shorter than this has no interior to cut (first two layers + last)
MIN_RUN = 4


@dataclass
class Condensed:
    """``gm`` with the interior layers of each run cut out.

    Attributes:
        gm: the condensed graph (it shares ``original``'s parameters and buffers).
        node: original node -> the node of ``gm`` that is it, or stands in for it (a cut layer's
            node: the same position in the run's second layer).
        stand_in: cut block index -> the index of the block standing in for it.
    """

    gm: fx.GraphModule
    node: dict[fx.Node, fx.Node]
    stand_in: dict[int, int]


def condense(gm: fx.GraphModule, blocks: Sequence[Sequence[fx.Node]],
             signatures: Sequence[str]) -> Condensed | None:
    """Cut the interior of every run of ``MIN_RUN`` or more consecutive blocks with equal
    ``signatures`` (and equal wiring, checked). ``blocks`` are disjoint lists of call_function
    nodes in graph order. None when nothing can be cut."""
    owner = {n: i for i, nodes in enumerate(blocks) for n in nodes}
    stand_in: dict[int, int] = {}
    start = 0
    while start < len(blocks):
        end = start
        while end + 1 < len(blocks) and signatures[end + 1] == signatures[start] and blocks[start]:
            end += 1
        if end - start + 1 >= MIN_RUN and _cuttable(blocks, owner, start, end):
            stand_in.update({j: start + 1 for j in range(start + 2, end)})
        start = end + 1
    if not stand_in:
        return None

    # a cut node -> its counterpart in the standing-in layer, which comes before it
    counterpart = {a: b for j, ref in stand_in.items() for a, b in zip(blocks[j], blocks[ref])}
    graph = fx.Graph()
    node: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n in counterpart and counterpart[n] not in node:
            return None  # a cut node before the node standing in for it: not a plain run
        if n in counterpart:
            node[n] = node[counterpart[n]]
        elif not (n.op == "get_attr" and n.users and all(u in counterpart for u in n.users)):
            node[n] = graph.node_copy(n, lambda a: node[a])
    for j, ref in stand_in.items():  # a cut layer's parameters and buffers: its stand-in's
        for a, b in zip(_own_attrs(blocks[j], owner, j), _own_attrs(blocks[ref], owner, ref)):
            node[a] = node[b]
    return Condensed(fx.GraphModule(gm, graph), node, stand_in)


def _cuttable(blocks: Sequence[Sequence[fx.Node]], owner: dict[fx.Node, int], start: int, end: int) -> bool:
    """Whether every layer from ``start + 2`` to ``end`` is wired as layer ``start + 1`` is, and
    no value of layers ``start + 1 .. end - 1`` is read beyond the next layer."""
    for j in range(start + 1, end):
        if any(owner.get(u) not in (j, j + 1) for n in blocks[j] for u in n.users):
            return False
    ref = start + 1
    ref_keys = [_wiring(n, ref, blocks, owner) for n in blocks[ref]]
    for j in range(start + 2, end + 1):
        if len(blocks[j]) != len(blocks[ref]):
            return False
        for a, key in zip(blocks[j], ref_keys):
            try:
                if _wiring(a, j, blocks, owner) != key:
                    return False
            except Exception:  # noqa: BLE001 - a constant that does not compare: not provably alike
                return False
    return True


def _wiring(n: fx.Node, block: int, blocks: Sequence[Sequence[fx.Node]], owner: dict[fx.Node, int]) -> Any:
    """``n``'s op and arguments with each input named by where it is relative to ``block``."""
    position = {}

    def key(a: fx.Node) -> Any:
        where = owner.get(a)
        if where in (block, block - 1):
            index = position.setdefault(where, {m: i for i, m in enumerate(blocks[where])})[a]
            return ("own" if where == block else "previous", index)
        if where is not None:
            return ("block", where)  # elsewhere: the same block for every layer, or not alike
        if a.op == "get_attr" and a.users and all(owner.get(u) == block for u in a.users):
            return ("attr", _own_attrs(blocks[block], owner, block).index(a))
        return ("outside", a)

    return n.op, n.target, fx.node.map_arg(n.args, key), fx.node.map_arg(n.kwargs, key)


def _own_attrs(nodes: Sequence[fx.Node], owner: dict[fx.Node, int], block: int) -> list[fx.Node]:
    """The parameters and buffers only this block reads, in the order it first reads them."""
    attrs = (a for n in nodes for a in n.all_input_nodes if a.op == "get_attr")
    return [a for a in dict.fromkeys(attrs) if all(owner.get(u) == block for u in a.users)]
