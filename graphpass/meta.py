"""Every ``node.meta`` key graphpass reads or writes, declared once, with typed getters.

Passes and analyses never spell a key as a string literal: they import the constant from here and
read it through :func:`get`, which raises a clear error naming the node when a required key is
missing. :func:`copy_meta` is the one way a pass carries metadata from a replaced node to the node
that replaces it.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from graphpass.layout import Slice, TensorLayout

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
#: Placement of a collective's output on the axis it communicates over, e.g. ``{"dp": "Replicate()"}``
#: (a parameter's or buffer's placements are in its :data:`LAYOUT`).
PLACEMENT = "gp.placement"
#: For a sharded parameter's or buffer's ``get_attr``: its :class:`graphpass.layout.TensorLayout`,
#: where the attribute's tensor sits in the full tensor (tensor-parallel chunk, expert shard,
#: operator-split slice, ZeRO shard, in the one order the layout composes them). Absent: whole.
LAYOUT = "gp.layout"
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
#: For collective nodes: the name of the transition-table entry they carry out
#: (:data:`graphpass.transitions.TABLE`), by which the planner prices what a program emits.
TRANSITION = "gp.transition"
#: For the graph's output node: which output is the loss the runtime differentiates.
ROLE = "gp.role"
#: True on a node whose value is not a tensor (the gradient-synchronisation handle): the pass
#: runner's verification then expects no ``meta["val"]`` on it.
OPAQUE = "gp.opaque"

#: For an input (``placeholder``): how it splits along the batch
#: (:class:`graphpass.batching.InputBatch`: its batch dim, or the offsets it is jagged by, as a
#: position among the graph's inputs), set by ``graphpass.compile`` and the planner before a plan
#: is made from the graph. Absent: dim 0.
BATCH = "gp.batch"

#: For the ``get_attr`` of a loss's global count (``global_loss_mean``): the
#: :class:`graphpass.passes.global_loss_mean.LossCount` that counts one microbatch's targets; the
#: runtime fills the buffer before each step (:mod:`graphpass.runtime.loss_count`).
LOSS_COUNT = "gp.loss_count"

#: The keys that describe one tensor of a ``get_attr`` (its value, what it stands for and how it
#: is laid out), never copied to a node made from it (:func:`copy_meta`'s ``exclude``).
TENSOR_KEYS = (VAL, STATE_KEYS, ATTR_KIND, LAYOUT, PLACEMENT)

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


def layout(node: fx.Node) -> TensorLayout | None:
    """The :class:`~graphpass.layout.TensorLayout` of a sharded ``get_attr`` node; None when the
    node's tensor is whole on every rank."""
    return node.meta.get(LAYOUT)


def slice_of(node: fx.Node) -> Slice | None:
    """The operator-split slice a ``get_attr`` node holds (None: not a slice)."""
    layout = node.meta.get(LAYOUT)
    return None if layout is None else layout.slice


def plan_name(node: fx.Node) -> str:
    """The name the plan knows ``node`` by: its own, or the captured node's it copies."""
    return node.meta.get(PLAN_NAME, node.name)


def copy_meta(src: fx.Node, dst: fx.Node, *, exclude: tuple[str, ...] = (VAL,)) -> None:
    """Copy provenance metadata (module path, layer, source, ...) from ``src`` to ``dst``.

    ``val`` is excluded by default because the replacement usually has a different shape; the
    pass recomputes it with :func:`graphpass.fake_values.propagate_fake`.
    """
    for key, value in src.meta.items():
        if key not in exclude and key not in dst.meta:
            dst.meta[key] = value
