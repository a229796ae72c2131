"""Which linears operator splitting (OSDP) can cut: an analysis, reading the graph only.

A linear can be split when its weight (and bias) are parameters that this linear alone reads: a
tied weight (GPT's ``lm_head`` and ``wte``) would come untied. :func:`default_split` is the
``Plan.split`` of a uniform ``Strategy(split=k)``; the planner prices the same candidates and
:mod:`graphpass.passes.split_operators` cuts them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.fx as fx
import torch.nn as nn

from graphpass import meta
from graphpass.layout import Split
from graphpass.ops import is_linear, linear_operands

log = logging.getLogger(__name__)


def _param_operand(gm: fx.GraphModule, operand: Any) -> nn.Parameter | None:
    if not (isinstance(operand, fx.Node) and operand.op == "get_attr"):
        return None
    if meta.get(operand, meta.ATTR_KIND, None) != "parameter":
        return None
    return gm.get_parameter(operand.target)


def unsplittable_reason(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """Why ``node`` cannot be split (None when it can): operands that are not this op's own params."""
    _, weight, bias = linear_operands(node)
    if _param_operand(gm, weight) is None:
        return "its weight is not a parameter get_attr"
    for what, operand in (("weight", weight), ("bias", bias)):
        if operand is None:
            continue
        if _param_operand(gm, operand) is None:
            return f"its {what} is not a parameter get_attr"
        # Every node reading the same attribute (pipeline stages each read a tied weight through
        # their own get_attr node).
        readers = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == operand.target]
        others = [u.name for reader in readers for u in reader.users if u is not node]
        if others:
            keys = ", ".join(meta.get(operand, meta.STATE_KEYS, ())) or operand.target
            return (
                f"its {what} {operand.target!r} ({keys}) is also used by {others}; splitting it "
                "would untie the weights"
            )
    return None


def default_split(gm: fx.GraphModule, parts: int) -> dict[str, Split]:
    """The linears a uniform ``Strategy(split=parts)`` splits, by node name, with their split.

    Every linear whose weight is a parameter used by that linear alone and has at least ``parts``
    rows is split ``parts`` ways along its output features; the others are skipped (logged).
    """
    out: dict[str, Split] = {}
    if parts <= 1:
        return out
    for node in gm.graph.nodes:
        if not is_linear(node):
            continue
        why = unsplittable_reason(gm, node)
        if why is None:
            rows = gm.get_parameter(linear_operands(node)[1].target).shape[0]
            if rows < parts:
                why = f"its weight has {rows} rows, fewer than split={parts}"
        if why is not None:
            log.info("split_operators: not splitting %s (%s): %s", node.name, meta.get(node, meta.MODULE_PATH, ""), why)
            continue
        out[node.name] = Split("out", parts)
    return out


__all__ = ["default_split", "unsplittable_reason"]
