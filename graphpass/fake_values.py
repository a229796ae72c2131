"""Every node's fake value (``meta["val"]``): derived by running the graph on fake tensors, and
derived again after each pass that changes the program, with only what the change reaches run.

The runner (:mod:`graphpass.pass_manager`) re-derives the values after every pass that changed
the program, so a pass that breaks a shape is named. A full run costs as much as a capture's
trace (0.2-0.7 s for a small Llama or T5 on this machine, several times per compile), and most
passes change a few nodes: a tensor-parallel pass re-shapes a layer's weights and the values
up to its all-reduce, a gradient-sync pass adds nodes that compute nothing in forward. So each
graph keeps what its last run saw (:class:`_LastRun`: the fake mode, each node's signature and
value) and the next run re-runs a node only when it is new, its op or arguments changed, its
``meta["val"]`` is not the one the last run left, or one of its inputs now has a different value
(shape, dtype, strides, device, aliasing). A value compared equal stops the wave: downstream
nodes keep theirs. Placeholders and attributes are read again every time (a pass may swap a
weight for its shard), as are ``call_module`` nodes (their module may have changed inside).

A graph with an op that changes a tensor's metadata in place (``transpose_``, ``resize_``...;
not ``detach_``, which can run twice) is always run whole: the op running again on a value kept
from the last run would change it twice.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

#: where a graph keeps its last run (an attribute of the ``fx.Graph``: a pass that wraps the same
#: graph in a new module keeps it; a copied graph has new nodes and starts over)
_LAST_RUN = "_gp_fake_values_last_run"

#: in-place metadata changes that a second run on an unchanged (kept) input would apply twice;
#: ``detach_`` (export keeps it on frozen weights) sets ``requires_grad`` off, twice or once alike
_RESIZING = {"resize_", "resize_as_", "set_"}
_IDEMPOTENT = {"detach_"}


class _LastRun:
    """What the last propagation over one graph saw."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self.results: dict[fx.Node, Any] = {}  # the interpreter's value of each node
        self.signatures: dict[fx.Node, tuple] = {}
        self.vals: dict[fx.Node, Any] = {}  # the meta["val"] object the run left on the node


class FakeAttrProp(FakeTensorProp):
    """FakeTensorProp that also fakes parameters and buffers, so that in-place ops in the graph
    (BatchNorm's ``num_batches_tracked.add_``) never touch the real tensors; and that runs only
    what changed since ``last`` when given."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, last: _LastRun | None = None) -> None:
        super().__init__(gm, mode)
        self.last = last
        self.now = _LastRun(mode)
        self.changed: set[fx.Node] = set()
        self.ran = 0

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor) and not is_fake(value):
            value = self._mode.from_tensor(value)
        return value

    def run_node(self, n: fx.Node) -> Any:
        signature = _signature(n)
        last = self.last
        if (last is not None and n in last.results and n.op == "call_function"
                and _same(last.signatures[n], signature) and n.meta.get("val") is last.vals[n]
                and not any(a in self.changed for a in n.all_input_nodes)):
            result = last.results[n]
        else:
            result = super().run_node(n)
            self.ran += 1
            if last is None or n not in last.results or not _same_value(last.results[n], result):
                self.changed.add(n)
        self.now.results[n] = result
        self.now.signatures[n] = signature
        self.now.vals[n] = n.meta.get("val")
        return result


def propagate_fake(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> int:
    """Derive ``meta["val"]`` for every node of ``gm`` by running it on fake tensors; only what
    changed since the last call on ``gm`` runs again (module docstring).

    Inputs and attributes may be real, meta or fake tensors; nothing is allocated and no real
    tensor is modified.

    Returns:
        how many nodes ran.
    """
    last = getattr(gm.graph, _LAST_RUN, None)
    if last is not None and _resizes_in_place(gm):
        last = None
    mode = last.mode if last is not None else FakeTensorMode(allow_non_fake_inputs=True)
    setattr(gm.graph, _LAST_RUN, None)  # a run that raises leaves nothing to trust
    fake_inputs = [mode.from_tensor(t) if isinstance(t, torch.Tensor) and not is_fake(t) else t for t in inputs]
    prop = FakeAttrProp(gm, mode, last)
    prop.propagate_dont_convert_inputs(*fake_inputs)
    setattr(gm.graph, _LAST_RUN, prop.now)
    return prop.ran


def carry_over(copies: dict[fx.Node, fx.Node]) -> None:
    """Give a faithful copy of a graph (``copies``: each node of the source graph to its copy, in
    one new graph) the source's last run, so that its next propagation runs only what differs
    from the source (a reused capture's tensors, :func:`graphpass.capture.reusing_captures`). The
    copies' ``meta["val"]`` must equal their sources'."""
    if not copies:
        return
    source = next(iter(copies)).graph
    last = getattr(source, _LAST_RUN, None)
    if last is None:
        return
    now = _LastRun(last.mode)
    for node, new in copies.items():
        if node in last.results and node.meta.get("val") is last.vals[node]:
            now.results[new] = last.results[node]
            now.signatures[new] = _signature(new)
            now.vals[new] = new.meta.get("val")  # the copy's own (a list value is copied)
    setattr(next(iter(copies.values())).graph, _LAST_RUN, now)


def is_fake(t: Any) -> bool:
    return isinstance(t, FakeTensor)


def _resizes_in_place(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        name = target.__name__.split(".")[0]
        if name in _RESIZING or (torch.Tag.inplace_view in target.tags and name not in _IDEMPOTENT):
            return True
    return False


def _signature(n: fx.Node) -> tuple:
    return (n.op, n.target, n.args, n.kwargs)


def _same(a: Any, b: Any) -> bool:
    """Equal arguments: nodes, tensors and other objects by identity, containers by content,
    literals by value."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return a == b
    return False


def _same_value(a: Any, b: Any) -> bool:
    """Values that any op computes the same from: tensors with equal metadata and aliasing,
    containers by content, other values by equality. ``requires_grad`` is not compared: values
    are kept detached (``meta["val"]``) and no op's output shape depends on it (ZeRO-3's gather
    returns a tensor that does not require grad where the weight did; what follows is the same)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if (type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
                or a.layout != b.layout):
            return False
        if a.layout != torch.strided:
            return a is b
        return (a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
                and a._is_view() == b._is_view())
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if a is None or b is None:
        return a is b
    if isinstance(a, (int, float, bool, str)):
        return type(a) is type(b) and a == b
    return a is b
