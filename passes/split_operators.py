"""split_operators: OSDP operator splitting — a linear runs as k slices with separate weights.

Contract: for every operator split in the plan (``Plan.tensors[weight].split = Split("out" |
"in", k)`` on a linear's weight; a plan JSON written before the per-tensor form named the linear
itself: :meth:`graphpass.plan.Plan.splits` reads both) the pass rewrites the linear node (``aten.linear``, or ``F.linear`` on the symbolic_trace route)
into k linears whose weights are k new parameters, so that later passes treat each slice's
weight as a parameter of its own. With ZeRO-3 each slice is then gathered right before its own
linear and freed after it (``collectives.gather_groups`` never groups two slices), so the
gathered weight memory of the op falls by about k; the numerics are those of the unsplit op up
to fp32 summation order.

- ``"out"``: ``W [out, in]`` → ``W_i = W[rows_i]`` (bias likewise); ``y = cat([linear(x, W_i, b_i)], -1)``.
  Every output element is the same dot product as before.
- ``"in"``: ``W_i = W[:, cols_i]``, ``x_i = x[..., cols_i]``; ``y = sum_i linear(x_i, W_i) + b``
  (bias added once, not split). The sum is re-associated: fp32 rounding differs (~1e-7 relative).
- Uneven sizes split as ``torch.tensor_split`` does: the first ``size % k`` slices get one extra
  row (column). ``k`` larger than the size is a ``ValueError`` naming the node, its module path and
  the sizes; ``parts == 1`` leaves the op alone; an empty ``Plan.split`` is a logged no-op.
- The slice of parameter ``h.0.mlp.up.weight`` is registered as ``h.0.mlp.up.weight.split{i}``
  (the old path becomes a holder module, so the full tensor is gone from the graph module and
  ``compile`` releases the user's copy, as it does for ZeRO shards). Its ``get_attr`` has no
  ``gp.state_keys`` but its ``gp.layout`` carries a ``Slice`` (original node, target, keys, dim, start, size, index, parts):
  ``shard_parameters`` gives it the original's ZeRO stage and ``full_state_dict`` concatenates the
  slices back under the original key.
- A weight or bias used by any other node (tied weights, e.g. GPT's ``lm_head``/``wte``) cannot be
  split without untying it: ``ValueError``. :func:`default_split` skips such linears. A weight
  placed other than ``Replicate()`` (tensor parallel) is not split either: ``NotImplementedError``.

Before/after (``Split("out", 2)`` on ``h_0_mlp_up_weight``, GPT ``h.0.mlp.up``)::

    w = get_attr[h.0.mlp.up.weight]  f32[256, 64]        w0 = get_attr[h.0.mlp.up.weight.split0]  f32[128, 64]
    b = get_attr[h.0.mlp.up.bias]    f32[256]       →    w1 = get_attr[h.0.mlp.up.weight.split1]  (b0, b1 alike)
    linear_4 = aten.linear(ln, w, b)                     linear_4_split0 = aten.linear(ln, w0, b0)
    gelu = aten.gelu(linear_4)                           linear_4_split1 = aten.linear(ln, w1, b1)
                                                         linear_4_cat = aten.cat([linear_4_split0, linear_4_split1], -1)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.placement_types import Replicate

from graphpass import meta
from graphpass.layout import Slice, Split, TensorLayout, placement_to_str
from graphpass.ops import is_linear, linear_operands
from graphpass.splittable import unsplittable_reason
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.plan import Plan

log = logging.getLogger(__name__)
_aten = torch.ops.aten

NAME = "split_operators"
def _bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each slice, ``torch.tensor_split``'s sizes (first ``size % parts`` get +1)."""
    base, extra = divmod(size, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _register_slices(
    gm: fx.GraphModule, param_node: fx.Node, dim: int, bounds: list[tuple[int, int]]
) -> list[fx.Node]:
    """Replace parameter ``param_node`` by one new parameter + ``get_attr`` per slice of ``dim``."""
    full = gm.get_parameter(param_node.target)
    module_path, _, leaf = param_node.target.rpartition(".")
    owner = gm.get_submodule(module_path)
    # The old attribute path becomes a holder of the slices (``up.weight.split0``): readable in
    # named_parameters, and the full tensor no longer hangs off the graph module.
    delattr(owner, leaf)
    holder = nn.Module()
    owner.add_module(leaf, holder)
    nodes = []
    for index, (start, stop) in enumerate(bounds):
        with torch.no_grad():
            value = full.detach().narrow(dim, start, stop - start).clone()
        holder.register_parameter(f"split{index}", nn.Parameter(value, requires_grad=full.requires_grad))
        with gm.graph.inserting_before(param_node):
            new = gm.graph.get_attr(f"{param_node.target}.split{index}")
        meta.copy_meta(param_node, new, exclude=(meta.VAL, meta.STATE_KEYS))
        new.meta[meta.STATE_KEYS] = ()
        new.meta[meta.CREATED_BY] = NAME
        new.meta[meta.LAYOUT] = TensorLayout.whole(full.shape).with_slice(
            Slice(dim, start, stop - start, index, len(bounds), param_node.name, param_node.target,
                  tuple(meta.get(param_node, meta.STATE_KEYS, ()))))
        nodes.append(new)
    return nodes


def _call(gm: fx.GraphModule, like: fx.Node, target: Any, args: tuple, name: str) -> fx.Node:
    node = gm.graph.create_node("call_function", target, args, {}, name=name)
    meta.copy_meta(like, node)
    node.meta[meta.CREATED_BY] = NAME
    return node


def _check_entry(
    gm: fx.GraphModule, plan: Plan, nodes: dict[str, fx.Node], name: str, spec: Split
) -> fx.Node:
    """The linear node ``Plan.split[name]`` names, after checking it can be cut as asked."""
    node = nodes.get(name)
    if node is None or not is_linear(node):
        what = "not in the captured graph" if node is None else f"a {node.op} {node.target}, not a linear"
        raise ValueError(
            f"Plan.split names {name!r}, which is {what}; operator splitting applies to "
            "aten.linear nodes (use their names from the captured graph)"
        )
    where = meta.get(node, meta.MODULE_PATH, "") or "<root>"
    why = unsplittable_reason(gm, node)
    if why is not None:
        raise ValueError(f"Plan.split cannot split linear {name!r} (module {where}): {why}; leave it out of Plan.split")
    weight = linear_operands(node)[1]
    placed = {axis: placement_to_str(p) for axis, p in plan.tensor(meta.plan_name(weight)).placements.items()
              if p != Replicate()}
    if placed:
        raise NotImplementedError(
            f"Plan.split[{name!r}]: the weight {weight.target!r} of linear {name!r} (module {where}) is "
            f"placed {placed}; splitting a tensor-parallel linear is not supported, leave it out of Plan.split"
        )
    shape = list(gm.get_parameter(weight.target).shape)
    size = shape[0 if spec.dim == "out" else 1]
    if spec.parts > size:
        features = "output" if spec.dim == "out" else "input"
        raise ValueError(
            f"Plan.split[{name!r}] asks for {spec.parts} slices of linear {name!r} (module {where}), "
            f"but its weight {weight.target!r} of shape {shape} has only {size} {features} features; "
            f"use parts <= {size}"
        )
    return node


def _split_one(gm: fx.GraphModule, node: fx.Node, spec: Split) -> None:
    x, weight, bias = linear_operands(node)
    parts, along = spec.parts, spec.dim
    dim = 0 if along == "out" else 1
    bounds = _bounds(gm.get_parameter(weight.target).shape[dim], parts)
    weights = _register_slices(gm, weight, dim, bounds)
    biases = _register_slices(gm, bias, 0, bounds) if bias is not None and along == "out" else None
    with gm.graph.inserting_before(node):
        if along == "out":
            outs = []
            for i, w_i in enumerate(weights):
                args = (x, w_i) if biases is None else (x, w_i, biases[i])
                outs.append(_call(gm, node, _aten.linear.default, args, f"{node.name}_split{i}"))
            result = _call(gm, node, _aten.cat.default, (outs, -1), f"{node.name}_cat")
        else:
            result = None
            for i, (w_i, (start, stop)) in enumerate(zip(weights, bounds)):
                x_i = _call(gm, node, _aten.slice.Tensor, (x, -1, start, stop), f"{node.name}_in{i}")
                y_i = _call(gm, node, _aten.linear.default, (x_i, w_i), f"{node.name}_split{i}")
                # Accumulate as we go, so each partial product dies right after it is added.
                result = y_i if result is None else _call(gm, node, _aten.add.Tensor, (result, y_i), f"{node.name}_sum{i}")
            if bias is not None:
                result = _call(gm, node, _aten.add.Tensor, (result, bias), f"{node.name}_bias")
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
    gm.graph.erase_node(weight)
    if biases is not None:
        gm.graph.erase_node(bias)


@graph_pass(NAME, requires=(), provides=("split_operators",))
def split_operators(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Split every linear named in ``plan.split`` into slices (see the module docstring).

    Raises:
        ValueError: ``plan.split`` names a node that is not a linear of the graph, a linear whose
            weight/bias is shared with other nodes, or more parts than the split dimension has.
        NotImplementedError: the linear's weight is placed other than ``Replicate()`` on some
            mesh axis (tensor parallel).
    """
    todo = {name: spec for name, spec in plan.splits(gm).items() if spec.parts > 1}
    if not todo:
        log.info("%s: Plan.split asks for no slices; nothing to do", NAME)
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    # Check every entry before touching the graph, so a bad plan leaves no half-split model.
    checked = [(_check_entry(gm, plan, nodes, name, spec), spec) for name, spec in todo.items()]
    for node, spec in checked:
        _split_one(gm, node, spec)
    gm.graph.lint()
    gm.recompile()
    log.info(
        "%s: split %d linears (%s)", NAME, len(todo),
        ", ".join(f"{n}: {s.dim} x{s.parts}" for n, s in todo.items()),
    )
    return gm


__all__ = ["split_operators"]
