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

import torch.fx as fx

from graphpass import meta
from graphpass.layout import TensorLayout
from graphpass.pass_manager import PassContext, graph_pass
from graphpass.passes.recompute import layer_regions
from graphpass.plan import Plan
from graphpass.runtime.offload import fetch_param, saved_on_device, saved_to_host

log = logging.getLogger(__name__)

NAME = "offload"

# fx drops a call without users as dead code unless it is marked as having side effects
fx.node.has_side_effect(saved_to_host)
fx.node.has_side_effect(saved_on_device)


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
    count, order = 0, {}
    attrs = {meta.plan_name(n) for n in gm.graph.nodes if n.op == "get_attr"}
    for name, tensor in plan.tensors.items():
        if tensor.tiers.offloaded and name not in attrs:
            raise ValueError(
                f"Plan.tensors[{name!r}].tiers puts {tensor.tiers} off the device, but {name!r} is not a parameter of "
                "this graph (an input, the loss, or a name the graph lacks): only trainable parameters have a "
                "master copy, gradient and optimizer state to offload; drop its tiers")
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
        users = list(node.users)
        # right before the first use, so that the layers before it compute while it arrives
        order = {n: i for i, n in enumerate(gm.graph.nodes)} if not count else order
        first = min(users, key=order.__getitem__) if users else node.next
        with gm.graph.inserting_before(first):
            fetch = gm.graph.call_function(fetch_param, (node,))
        meta.copy_meta(node, fetch, exclude=meta.TENSOR_KEYS)
        fetch.meta[meta.CREATED_BY] = NAME
        if users:
            fetch.meta.setdefault(meta.STAGE, users[0].meta.get(meta.STAGE))
        for user in users:
            user.replace_input_with(node, fetch)
        count += 1
    return count


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
