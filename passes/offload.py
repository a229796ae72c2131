"""offload: the transfers of host-resident parameters and activations, as graph nodes.

Contract:

- Every ``get_attr`` of a parameter whose plan entry puts parts off the device
  (``Plan.tensors[name].tiers``, :class:`graphpass.layout.Tiers`) gets the tiers in its
  ``gp.layout`` (the runtime keeps its master copy in host memory from them) and one
  ``fetch_param`` node right after it, through which every use reads the parameter: it waits for
  the upload of the updated compute copy, which the runtime starts after the optimizer step, so
  the step's first layers compute while later layers' weights are still arriving.
- Every repeated layer whose activations the plan saves on the host
  (``Plan.activations[i].tier == "host"``) runs between a ``saved_to_host(i)`` node, before the
  layer's first node, and a ``saved_on_device`` node after its last: what autograd saves in
  between goes to host memory and comes back one layer ahead of its backward
  (:mod:`graphpass.runtime.offload`).
- A tier on anything but a trainable parameter, or a host-saved layer the graph does not have,
  is a ``ValueError`` naming it. Nothing off the device: a logged no-op.

Before/after (the zoo GPT's first block, optimizer and activations on the host)::

    ln_1_w = get_attr[h.0.ln_1.weight]            ln_1_w = get_attr[h.0.ln_1.weight]
    layer_norm = aten.layer_norm(x, [64], ln_1_w) ln_1_w_1 = fetch_param(ln_1_w)
    ...                                       →   saved_to_host = saved_to_host(0)
    add_2 = aten.add(add_1, dropout_1)            layer_norm = aten.layer_norm(x, [64], ln_1_w_1)
                                                  ...; add_2 = ...; saved_on_device(saved_to_host)
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch.fx as fx

from graphpass import meta
from graphpass.layout import TensorLayout
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.passes.recompute import layer_regions
from graphpass.plan import Plan
from graphpass.passes.collectives import is_bucket
from graphpass.runtime.offload import fetch_param, prefetch_params, release_params, saved_on_device, saved_to_host

log = logging.getLogger(__name__)

NAME = "offload"

# fx drops a call without users as dead code unless it is marked as having side effects
for _op in (prefetch_params, release_params, saved_to_host, saved_on_device):
    fx.node.has_side_effect(_op)


@graph_pass(NAME, requires=(), provides=("offload",))
def offload(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Insert the fetches of host-resident parameters and the host-saved layers' scopes.

    Raises:
        ValueError: a tier on a tensor that is not a trainable parameter, or a host-saved
            layer the graph lacks.
    """
    fetched = _fetch_parameters(gm, plan)
    saved = [layer for layer, entry in sorted(plan.activations.items()) if entry.tier == "host"]
    if saved:
        _save_on_host(gm, saved)
    if not fetched and not saved:
        log.info("%s: nothing lives off the device; nothing to do", NAME)
        return gm
    log.info("%s: %d parameters with parts on the host, %d layers saving activations there", NAME, fetched, len(saved))
    gm.recompile()
    return gm


def _fetch_parameters(gm: fx.GraphModule, plan: Plan) -> int:
    attrs = {meta.plan_name(n) for n in gm.graph.nodes if n.op == "get_attr"}
    for name, tensor in plan.tensors.items():
        if tensor.tiers.offloaded and name not in attrs:
            raise ValueError(
                f"Plan.tensors[{name!r}].tiers puts {tensor.tiers} off the device, but {name!r} is not a parameter of "
                "this graph (an input, the loss, or a name the graph lacks): only trainable parameters have a "
                "master copy, gradient and optimizer state to offload; drop its tiers")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    streamed: list[tuple[fx.Node, list[fx.Node]]] = []  # (parameter, the fetches its data uses read)
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        tiers = plan.tensor(meta.plan_name(node)).tiers
        if not tiers.offloaded:
            continue
        kind = meta.get(node, meta.ATTR_KIND, None)
        value = meta.get(node, meta.VAL, None)
        if kind != "parameter" or value is None or not _attr(gm, node.target).requires_grad:
            raise ValueError(
                f"Plan.tensors[{meta.plan_name(node)!r}].tiers puts {tiers} off the device, but {node.target!r} is "
                f"{'a ' + kind if kind else 'not a parameter'}{'' if kind != 'parameter' else ' that is not trainable'}: "
                "only trainable parameters have a master copy, gradient and optimizer state to offload; drop its tiers")
        layout = meta.layout(node) or TensorLayout.whole(value.shape)
        node.meta[meta.LAYOUT] = layout.with_tiers(tiers)
        fetches = [_insert_fetch(gm, value_node, users, order) for value_node, users in _data_reads(node)]
        if tiers.parameter == "host":
            streamed.append((node, fetches))
        count += 1
    if streamed:
        _stream(gm, streamed, plan.offload_window)
    return count


def _data_reads(param: fx.Node) -> list[tuple[fx.Node, list[fx.Node]]]:
    """``(value, its users)`` for each value through which ``param``'s data is read: the
    parameter itself, and the view that a gradient-synchronisation bucket hands out for it (the
    bucket makes views only, so a streamed parameter need not be resident there)."""
    direct = [u for u in param.users if not is_bucket(u)]
    out = [(param, direct)] if direct else []
    for bucket in (u for u in param.users if is_bucket(u)):
        index = list(bucket.args).index(param) - 1  # all_reduce_grads(sync, *params)
        for item in bucket.users:
            if item.target is operator.getitem and item.args[1] == index and item.users:
                out.append((item, list(item.users)))
    return out


def _insert_fetch(gm: fx.GraphModule, value: fx.Node, users: list[fx.Node], order: dict[fx.Node, int]) -> fx.Node:
    """A ``fetch_param(value)`` right before the first of ``users``, which read it instead: the
    layers before it compute while it arrives."""
    first = min(users, key=lambda u: order.get(u, len(order)))
    with gm.graph.inserting_before(first):
        fetch = gm.graph.call_function(fetch_param, (value,))
    meta.copy_meta(value, fetch, exclude=meta.TENSOR_KEYS)
    fetch.meta[meta.CREATED_BY] = NAME
    fetch.meta[meta.STAGE] = first.meta.get(meta.STAGE, value.meta.get(meta.STAGE))
    for user in users:
        user.replace_input_with(value, fetch)
    return fetch


def _stream(gm: fx.GraphModule, streamed: list[tuple[fx.Node, list[fx.Node]]], window: int) -> None:
    """The STRONGHOLD window: the streamed parameters grouped in units (a repeated layer's, or
    one parameter outside the layers) in the order they are first read; unit ``u`` is brought in
    (``prefetch_params``) when unit ``u - window`` starts, and each parameter is released
    (``release_params``) after its last read."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    units: dict[Any, list[fx.Node]] = {}
    first_read: dict[Any, fx.Node] = {}
    for param, fetches in streamed:
        if not fetches:
            continue
        layer = param.meta.get(meta.LAYER)
        fetch = min(fetches, key=order.__getitem__)
        # a window never reaches into another pipeline stage: the stage that reads the parameter
        # (a weight tied to a later stage has a node of its own there, whose meta keeps the first's)
        stage = fetch.meta.get(meta.STAGE, param.meta.get(meta.STAGE))
        key = (stage, "layer", layer) if layer is not None else (stage, "param", param.name)
        units.setdefault(key, []).append(param)
        if key not in first_read or order[fetch] < order[first_read[key]]:
            first_read[key] = fetch
        last = max((u for f in fetches for u in f.users), key=order.__getitem__)
        with gm.graph.inserting_after(last):
            release = gm.graph.call_function(release_params, (param,))
        meta.copy_meta(last, release, exclude=meta.TENSOR_KEYS)
        release.meta.update({meta.CREATED_BY: NAME, meta.OPAQUE: True})
    by_stage: dict[Any, list[Any]] = {}
    for key in sorted(units, key=lambda k: order[first_read[k]]):
        by_stage.setdefault(key[0], []).append(key)
    for ordered in by_stage.values():
        for u, key in enumerate(ordered):
            _prefetch(gm, units[key], first_read[ordered[max(0, u - window)]], order)


def _prefetch(gm: fx.GraphModule, params: list[fx.Node], anchor: fx.Node, order: dict[fx.Node, float]) -> None:
    """A ``prefetch_params(*params)`` right before ``anchor``."""
    for param in params:  # a get_attr has no inputs: moving it earlier is always valid
        if order[param] > order[anchor]:
            anchor.prepend(param)
            order[param] = order[anchor] - 0.5
    with gm.graph.inserting_before(anchor):
        prefetch = gm.graph.call_function(prefetch_params, tuple(params))
    meta.copy_meta(anchor, prefetch, exclude=meta.TENSOR_KEYS)
    prefetch.meta.update({meta.CREATED_BY: NAME, meta.OPAQUE: True})


def _attr(gm: fx.GraphModule, target: str):
    module_path, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(module_path), name)


def _save_on_host(gm: fx.GraphModule, layers: list[int]) -> None:
    regions = layer_regions(gm)
    missing = [layer for layer in layers if layer not in regions]
    if missing:
        have = f"its repeated layers are {sorted(regions)}" if regions else "it has no repeated layers"
        raise ValueError(f"Plan.activations[{missing[0]}] saves layer {missing[0]}'s activations on the host, but this "
                         f"graph has no such layer ({have}); drop the entry or make the plan for this model")
    for layer in layers:
        region = regions[layer]
        first, last = region[0], region[-1]
        with gm.graph.inserting_before(first):
            begin = gm.graph.call_function(saved_to_host, (layer,))
        with gm.graph.inserting_after(last):
            end = gm.graph.call_function(saved_on_device, (begin,))
        for node in (begin, end):
            meta.copy_meta(first, node, exclude=meta.TENSOR_KEYS)
            node.meta.update({meta.CREATED_BY: NAME, meta.OPAQUE: True})


__all__ = ["offload"]
