"""The tensor-parallel walk: one visit of the graph in order, a placement per node, and the
registry of per-op rules (:data:`RULES`, filled by the rule modules of this package).

The walker shards the parameters the plan places on ``tp`` (each a ``gp.layout`` of one
``Shard(d)``), starts every other tensor ``Replicate()``, and for each node runs its op's rule,
which says which input placements the op accepts, what its output placement is, rewrites shape
arguments to local sizes and asks :mod:`graphpass.passes.collectives` for a redistribution where
an input does not fit. An op without a rule gets replicated inputs and a replicated output.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from graphpass import meta
from graphpass.layout import TensorLayout
from graphpass.ops import PARAM_VIEWS, packet as _packet
from graphpass.passes import collectives
from graphpass.plan import Plan

log = logging.getLogger(__name__)

NAME = "tensor_parallel"
AXIS = "tp"
aten = torch.ops.aten
R = Replicate()
P = Partial()


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get(meta.VAL) if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _nodes_needing_grad(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on a trainable parameter (captured fake values do not record
    ``requires_grad``, so it is derived from the dataflow)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" and meta.get(node, meta.ATTR_KIND, None) == "parameter":
            module_path, _, name = node.target.rpartition(".")
            if getattr(gm.get_submodule(module_path), name).requires_grad:
                out.add(node)
        elif node.op == "call_function" and any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


@dataclass(frozen=True)
class PartsShard:
    """The output of a fused projection: dim ``dim`` is the concatenation of parts of sizes
    ``parts``, each sharded over tp on its own (rank r holds chunk r of every part, in order).
    Only the slicing ops that cut it into its parts read it (each piece is then ``Shard(dim)``);
    ``graphpass.megatron`` fuses only projections whose every user is such a cut."""

    dim: int
    parts: tuple[int, ...]


@dataclass(frozen=True)
class MergedShard:
    """Dim ``dim`` merges a whole outer factor of size ``outer`` with an inner factor sharded over
    tp (``nn.MultiheadAttention``'s ``view(T, B * heads, head_dim)`` of head-sharded features:
    rank r holds, for every one of the ``outer`` batch rows, its heads). DTensor calls this a
    strided shard. Views that split the outer factor off again make it a plain ``Shard``;
    transposes and elementwise ops carry it; any other op first gathers it."""

    dim: int
    outer: int


class TensorParallelError(ValueError):
    """A model/plan combination tensor parallelism cannot shard (names module and sizes)."""


class Walker:
    """Visits the graph once, assigning placements and rewriting nodes (one instance per pass)."""

    def __init__(self, gm: fx.GraphModule, plan: Plan, size: int, rank: int):
        self.gm, self.graph, self.plan = gm, gm.graph, plan
        self.size, self.rank = size, rank
        self.sp = plan.sequence_parallel
        self.place: dict[fx.Node, Any] = {}  # Placement, or a list of them for tuple outputs
        self.gshape: dict[fx.Node, tuple[int, ...]] = {}  # global shapes (captured meta)
        self.cache: dict[tuple, fx.Node] = {}
        self.warned: set[str] = set()
        self.needs_grad = _nodes_needing_grad(gm)
        self.parts: dict[fx.Node, tuple[int, ...]] = {}  # fused weights/biases -> part sizes
        self.merged_from: dict[fx.Node, fx.Node] = {}  # a view making a MergedShard -> its Shard input
        self.after: dict[fx.Node, list[fx.Node]] = {}  # nodes a rule added, to visit after the node
        self.sharded: dict[str, fx.Node] = {}  # attribute target -> the get_attr node that sharded it
        for node in self.graph.nodes:
            shape = _shape(node)
            if shape is not None:
                self.gshape[node] = shape

    # ------------------------------------------------------------------ helpers

    def where(self, node: fx.Node) -> str:
        path = node.meta.get(meta.MODULE_PATH) or "<root>"
        return f"node {node.name!r} (module {path})"

    def placement(self, value: Any) -> Placement:
        if isinstance(value, fx.Node):
            p = self.place.get(value, R)
            return R if isinstance(p, list) else p
        return R

    def ndim(self, node: fx.Node) -> int:
        return len(self.gshape.get(node, ()))

    def redistribute(self, value: fx.Node, dst: Placement, user: fx.Node, grad: Placement | None = None) -> fx.Node:
        """``value`` converted to ``dst`` (cached per value, target and the user's pipeline stage:
        a conversion read by several stages would be a collective spanning them), inserted before
        ``user``; ``grad``: as :func:`graphpass.transitions.redistribution` takes it)."""
        src = self.placement(value)
        if src == dst:
            return value
        if isinstance(src, MergedShard):
            value, src = self.unmerge(value, user, grad), R
            if src == dst:
                return value
        key = (value, str(dst), str(grad), user.meta.get(meta.STAGE))
        if key in self.cache:
            return self.cache[key]
        node = collectives.emit_tp_redistribute(
            self.gm, value, src, dst, AXIS, self.size, before=user, grad=grad, created_by=NAME
        )
        self.place[node] = dst
        self.gshape[node] = self.gshape.get(value, ())
        self.inherit_grad(value, node)
        self.cache[key] = node
        return node

    def inherit_grad(self, value: fx.Node, node: fx.Node) -> None:
        """A node the pass made from ``value`` needs a gradient when ``value`` does (so a
        replicated all-reduced partial feeding sharded compute still gets Megatron's f)."""
        if value in self.needs_grad:
            self.needs_grad.add(node)

    def local_view(self, value: fx.Node, global_shape: Sequence[int], placement: Any, user: fx.Node) -> fx.Node:
        """``value`` reshaped to ``global_shape`` (at its local sizes under ``placement``),
        inserted before ``user``."""
        local = list(global_shape)
        if isinstance(placement, (Shard, MergedShard)):
            local[placement.dim] //= self.size
        with self.graph.inserting_before(user):
            node = self.graph.call_function(aten.reshape.default, (value, local))  # value may be strided
        meta.copy_meta(value, node, exclude=meta.TENSOR_KEYS)
        node.meta[meta.CREATED_BY] = NAME
        self.place[node] = placement
        self.gshape[node] = tuple(global_shape)
        self.inherit_grad(value, node)
        return node

    def unmerge(self, value: fx.Node, user: fx.Node, grad: Placement | None = None) -> fx.Node:
        """A ``MergedShard`` value gathered whole: split the merged dim into (outer, inner) — a
        plain ``Shard`` of the inner factor —, all-gather that (its backward as ``grad`` says), and
        merge back."""
        key = (value, "unmerge", str(grad))
        if key not in self.cache and value in self.merged_from:
            # Made by a view of a plain shard: gather that (once for all its views) and view it.
            whole = self.redistribute(self.merged_from[value], R, user, grad)
            self.cache[key] = self.local_view(whole, self.gshape[value], R, user)
        if key not in self.cache:
            mp, shape = self.place[value], self.gshape[value]
            split = (*shape[:mp.dim], mp.outer, shape[mp.dim] // mp.outer, *shape[mp.dim + 1:])
            inner = self.local_view(value, split, Shard(mp.dim + 1), user)
            gathered = self.redistribute(inner, R, user, grad)
            self.cache[key] = self.local_view(gathered, shape, R, user)
        return self.cache[key]

    def copy_for_sharded_use(self, value: fx.Node, user: fx.Node) -> fx.Node:
        """A replicated activation feeding sharded compute: its gradient is partial (Megatron f)."""
        if value not in self.needs_grad or value.op == "get_attr":
            return value
        key = (value, "copy")
        if key not in self.cache:
            node = collectives.emit_tp_redistribute(self.gm, value, R, R, AXIS, self.size, before=user, grad=P,
                                                    created_by=NAME)
            self.place[node] = R
            self.gshape[node] = self.gshape.get(value, ())
            self.cache[key] = node
        return self.cache[key]

    def mark_partial_grad(self, param: Any) -> None:
        """The parameter behind ``param`` (itself, or a piece or view of it: ``nn.
        MultiheadAttention`` splits ``in_proj_weight`` into q and kv weights in the graph) gets
        a gradient that is partial over tp."""
        while (isinstance(param, fx.Node) and param.op == "call_function" and param.args
               and isinstance(param.args[0], fx.Node) and _packet(param) in PARAM_VIEWS):
            param = param.args[0]
        if isinstance(param, fx.Node) and param.op == "get_attr" and meta.get(param, meta.ATTR_KIND) == "parameter":
            param.meta[meta.GRAD_PARTIAL] = AXIS

    def set_arg(self, node: fx.Node, index: int, value: Any) -> None:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)

    def warn_once(self, node: fx.Node) -> None:
        name = str(node.target)
        if name not in self.warned:
            self.warned.add(name)
            log.warning(
                "%s: no tensor-parallel rule for %s (first at %s); its inputs are replicated",
                NAME, name, self.where(node),
            )

    def to_replicate_all(self, node: fx.Node) -> Placement:
        for i, arg in enumerate(node.args):
            if isinstance(arg, fx.Node) and arg in self.place:
                self.set_arg(node, i, self.redistribute(arg, R, node))
            elif isinstance(arg, (list, tuple)) and any(isinstance(a, fx.Node) for a in arg):
                self.set_arg(node, i, type(arg)(
                    self.redistribute(a, R, node) if isinstance(a, fx.Node) and a in self.place else a for a in arg
                ))
        for key, arg in list(node.kwargs.items()):
            if isinstance(arg, fx.Node) and arg in self.place:
                node.update_kwarg(key, self.redistribute(arg, R, node))
        return R

    # ------------------------------------------------------------------ walk

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "placeholder":
                self.place[node] = R
            elif node.op == "get_attr":
                self.place[node] = self.shard_attribute(node)
            elif node.op == "call_function":
                if node.meta.get(meta.CREATED_BY) == NAME:
                    continue
                self.place[node] = self.visit(node)
                for added in self.after.pop(node, ()):
                    self.inherit_grad(node, added)
                    self.place[added] = self.visit(added)
            elif node.op == "output":
                loss = node.args[0][meta.get(node, meta.ROLE)["loss"]]
                if self.placement(loss) != R:
                    fixed = self.redistribute(loss, R, node)
                    node.args = (tuple(fixed if v is loss else v for v in node.args[0]),)

    def shard_attribute(self, node: fx.Node) -> Placement:
        if meta.get(node, meta.ATTR_KIND, None) == "module":
            return R
        placement = self.plan.placement(meta.plan_name(node), AXIS)
        if not isinstance(placement, Shard):
            return R
        first = self.sharded.get(node.target)
        if first is not None:  # another pipeline stage's node of a parameter sharded already
            node.meta[meta.LAYOUT] = first.meta[meta.LAYOUT]
            if first in self.parts:
                self.parts[node] = self.parts[first]
            return self.place[first]
        self.sharded[node.target] = node
        module_path, _, attr = node.target.rpartition(".")
        owner = self.gm.get_submodule(module_path)
        full = getattr(owner, attr)
        dim = placement.dim % full.dim()
        if full.shape[dim] % self.size:
            raise TensorParallelError(
                f"tensor parallel tp={self.size} does not divide dim {dim} (size {full.shape[dim]}) of "
                f"{node.target!r} (module {module_path}, shape {tuple(full.shape)}); choose tp dividing "
                f"{full.shape[dim]} or leave this parameter replicated"
            )
        parts = self.plan.tensor(meta.plan_name(node)).parts
        if parts:
            if sum(parts) != full.shape[dim] or any(n % self.size for n in parts):
                raise TensorParallelError(
                    f"tensor parallel tp={self.size}: the fused parts {list(parts)} of {node.target!r} (module "
                    f"{module_path}, dim {dim} of size {full.shape[dim]}) must add up to it and each divide by "
                    f"{self.size}; choose tp dividing every part"
                )
            # Rank r holds chunk r of every part, in order: its local q, k and v heads.
            pieces = full.detach().split(list(parts), dim=dim)
            local = torch.cat([piece.chunk(self.size, dim=dim)[self.rank] for piece in pieces], dim=dim)
            self.parts[node] = parts
        else:
            local = full.detach().chunk(self.size, dim=dim)[self.rank].clone()
        if isinstance(full, nn.Parameter):
            local = nn.Parameter(local, requires_grad=full.requires_grad)
            setattr(owner, attr, local)
        else:
            owner.register_buffer(attr, local)
        node.meta[meta.LAYOUT] = TensorLayout.whole(full.shape).with_shard(AXIS, dim, self.size, parts)
        return Shard(dim)

    def visit(self, node: fx.Node) -> Any:
        target = node.target
        rule = rule_of(target)
        tensor_args = [a for a in node.all_input_nodes if a in self.place]
        if any(isinstance(self.place.get(a), PartsShard) for a in tensor_args) and PartsShard not in CARRIES.get(rule, ()):
            raise TensorParallelError(
                f"internal: the fused projection output reaches {self.where(node)} ({node.target}), "
                "which does not cut it into its parts"
            )
        if MergedShard not in CARRIES.get(rule, ()) and any(isinstance(self.place.get(a), MergedShard) for a in tensor_args):
            self.gather_merged(node)
        if target is operator.getitem:
            # Before the all-replicated shortcut: placement() reads a multi-output node's list
            # of placements as Replicate, but its items may be sharded (chunks of head-sharded qkv).
            return self.getitem(node)
        if rule is None:
            return no_rule(self, node)
        return rule(self, node)

    def gather_merged(self, node: fx.Node) -> None:
        """Every ``MergedShard`` input of ``node`` replaced by its gathered whole."""
        def fix(arg: Any) -> Any:
            if isinstance(arg, fx.Node) and isinstance(self.place.get(arg), MergedShard):
                return self.redistribute(arg, R, node)
            if isinstance(arg, (list, tuple)):
                return type(arg)(fix(a) for a in arg)
            return arg
        node.args = tuple(fix(a) for a in node.args)
        node.kwargs = {k: fix(v) for k, v in node.kwargs.items()}

    def getitem(self, node: fx.Node) -> Placement:
        source, index = node.args
        place = self.place.get(source, R)
        return place[index] if isinstance(place, list) else place


#: The placement rule of each op (overload or packet), registered by :func:`rule` in the rule
#: modules of this package (by op family, as DTensor groups its op strategies).
RULES: dict[Any, Callable[[Walker, fx.Node], Any]] = {}
#: The placements other than Shard/Replicate/Partial a rule reads as they are (every other rule
#: first gathers a ``MergedShard`` input, and no other rule may read a ``PartsShard``).
CARRIES: dict[Callable, tuple[type, ...]] = {}
#: For each rule that can keep a shard: ``keeps(node, source, dim)``, the dim of ``node``'s output
#: that its input ``source`` sharded on ``dim`` leaves sharded, with no collective, or None where
#: the rule makes it whole (what :func:`keeps_shard` answers for the op-level problem, without
#: running the rule; the rules themselves map dims with the same functions).
KEEPS: dict[Callable, Callable[[fx.Node, fx.Node, int], int | None]] = {}


def rule_of(target: Any) -> Callable | None:
    """The rule registered for an op (its overload, else its packet), None for ops without one."""
    rule = RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        rule = RULES.get(target.overloadpacket)
    return rule


def keeps_shard(node: fx.Node, dim: int, source: fx.Node | None = None) -> int | None:
    """The dim of ``node``'s output that stays sharded when its input ``source`` (default: its
    first) is sharded on ``dim`` and its other operands are whatever the rule makes them locally
    (a bias sliced to the shard), as the pass's rule for the op decides; None where the rule
    gathers the value, or the op has no rule. Reads the fake values' shapes (``meta["val"]``)."""
    keeps = KEEPS.get(rule_of(node.target)) if node.op == "call_function" else None
    if source is None:
        source = next((a for a in node.all_input_nodes if a.op != "get_attr"), None)
    if keeps is None or source is None or shape_of(source) is None or shape_of(node) is None:
        return None
    return keeps(node, source, norm_dim(dim, len(shape_of(source))))


def shape_of(node: fx.Node) -> tuple[int, ...] | None:
    """A node's (full, captured) shape from its fake value; None for a value that is no tensor."""
    val = node.meta.get(meta.VAL)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def no_rule(w: Walker, node: fx.Node) -> Placement:
    """An op without a rule: replicated inputs, a replicated output (warned once per op)."""
    if all(w.placement(a) == R for a in node.all_input_nodes if a in w.place):
        return R
    w.warn_once(node)
    return w.to_replicate_all(node)


def rule(*targets: Any, carries: tuple[type, ...] = (),
         keeps: Callable[[fx.Node, fx.Node, int], int | None] | None = None):
    """Register a placement rule for the given aten ops (overloads or packets); ``carries``: the
    special placements (:class:`MergedShard`, :class:`PartsShard`) it reads as they are;
    ``keeps``: where it leaves a sharded input's dim (:data:`KEEPS`)."""

    def wrap(fn):
        for t in targets:
            RULES[t] = fn
        if carries:
            CARRIES[fn] = carries
        if keeps is not None:
            KEEPS[fn] = keeps
        return fn

    return wrap


def norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else dim
