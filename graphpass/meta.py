"""Every ``node.meta`` key graphpass reads or writes, declared once, with typed getters.

Passes and analyses never spell a key as a string literal: they import the constant from here and
read it through :func:`get`, which raises a clear error naming the node when a required key is
missing. :func:`copy_meta` is the one way a pass carries metadata from a replaced node to the node
that replaces it.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

#: FakeTensor (or tuple of them) describing the node's output; torch's own key.
VAL = "val"
#: Fully qualified module path that produced the node, e.g. ``"h.3.attn.q"``; ``""`` for the root.
MODULE_PATH = "gp.module_path"
#: Index of the repeated layer (``h.3`` → 3) the node belongs to, or None outside repeated layers.
LAYER = "gp.layer"
#: For a parameter/buffer ``get_attr`` node: the original ``state_dict`` keys it stands for
#: (a tuple: tied weights have several).
STATE_KEYS = "gp.state_keys"
#: For a ``get_attr`` node: ``"parameter"``, ``"buffer"``, or ``"module"`` (a submodule a pass
#: created, e.g. a recomputed layer).
ATTR_KIND = "gp.attr_kind"
#: The user source line that produced the node (last frame of the capture's stack trace).
SOURCE = "gp.source"
#: Name of the pass that created the node (absent on captured nodes).
CREATED_BY = "gp.created_by"
#: Placement of the node's output on each mesh axis, e.g. ``{"dp": "Shard(0)"}``.
PLACEMENT = "gp.placement"
#: For a ZeRO-sharded parameter's ``get_attr``: ``{"axis": "dp", "dim": 0, "shape": full shape,
#: "stage": 1|2|3}``; the attribute holds this rank's padded dim-0 shard.
SHARD = "gp.shard"
#: For a tensor-parallel parameter's ``get_attr``: ``{"axis": "tp", "dim": d, "shape": full
#: shape}``; the attribute holds this rank's chunk of dim ``d`` (before any ZeRO sharding, which
#: then shards that chunk over ``dp`` and records ``gp.shard`` with the chunk's shape).
TP_SHARD = "gp.tp_shard"
#: For a slice parameter's ``get_attr`` made by ``split_operators``: ``{"node": original get_attr
#: node name, "target": original attribute, "state_keys": its state_dict keys, "shape": its full
#: shape, "dim": tensor dim it was cut along, "index": i, "parts": k, "start": where slice i begins
#: along dim}``; the attribute holds slice i.
SPLIT = "gp.split"
#: For a parameter ``get_attr``: the mesh axis over which its gradient is a partial sum (a
#: replicated weight applied to sequence-sharded activations); insert_collectives sums it there.
GRAD_PARTIAL = "gp.grad_partial"
#: Pipeline stage index of the node.
STAGE = "gp.stage"
#: For a ``get_attr`` node that partition_stages added for a later stage's use of a parameter
#: or buffer: the name of the captured node it copies, under which the plan places it.
PLAN_NAME = "gp.plan_name"
#: For a stage graph's placeholders (and the values it returns): whether the value needs a
#: gradient (:func:`graphpass.grads.grad_requiring_nodes` of the whole graph), which the
#: pipeline engine needs to know of what it receives and sends.
REQUIRES_GRAD = "gp.requires_grad"
#: For collective nodes: the mesh axis they communicate over.
AXIS = "gp.axis"
#: For the graph's output node: which output is the loss the runtime differentiates.
ROLE = "gp.role"
#: True on a node whose value is not a tensor (the gradient-synchronisation handle): the pass
#: runner's verification then expects no ``meta["val"]`` on it.
OPAQUE = "gp.opaque"

#: For the ``get_attr`` of a loss's global count (``global_loss_mean``): the
#: :class:`graphpass.passes.global_loss_mean.LossCount` that counts one microbatch's targets; the
#: runtime fills the buffer before each step (:mod:`graphpass.runtime.loss_count`).
LOSS_COUNT = "gp.loss_count"

_MISSING = object()


def get(node: fx.Node, key: str, default: Any = _MISSING) -> Any:
    """Return ``node.meta[key]``; without a default, a missing key raises naming the node.

    Raises:
        KeyError: the key is absent and no default was given.
    """
    if key in node.meta:
        return node.meta[key]
    if default is not _MISSING:
        return default
    raise KeyError(
        f"node {node.name!r} ({node.op} {node.target}) has no meta[{key!r}]; "
        "it was created without copy_meta or before the analysis that sets it"
    )


def plan_name(node: fx.Node) -> str:
    """The name the plan knows ``node`` by: its own, or the captured node's it copies."""
    return node.meta.get(PLAN_NAME, node.name)


def copy_meta(src: fx.Node, dst: fx.Node, *, exclude: tuple[str, ...] = (VAL,)) -> None:
    """Copy provenance metadata (module path, layer, source, ...) from ``src`` to ``dst``.

    ``val`` is excluded by default because the replacement usually has a different shape; the
    pass recomputes it with :func:`graphpass.capture.propagate_fake`.
    """
    for key, value in src.meta.items():
        if key not in exclude and key not in dst.meta:
            dst.meta[key] = value
