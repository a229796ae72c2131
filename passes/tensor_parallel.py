"""tensor_parallel: shard parameters over the ``tp`` axis and propagate placements through the
graph, inserting Megatron's collectives where placements change.

Contract: parameters whose ``plan.placements[name]["tp"]`` is ``Shard(d)`` are replaced by this
rank's chunk of dim ``d`` (``gp.tp_shard`` records it; shard_parameters, which runs next, may
then ZeRO-shard that chunk over ``dp``). Every other tensor starts ``Replicate()``
(inputs, buffers, constants). Nodes are then visited in order; a rule per op (below) says which
input placements it accepts and what its output placement is, rewrites shape arguments to local
sizes, and asks the collective emitter for a redistribution where an input does not fit. The
result is Megatron-LM's program: column-parallel linears (``Shard(0)`` weights) take replicated
input through ``tp_copy`` (f), row-parallel linears (``Shard(1)``) produce partial sums reduced by
``tp_all_reduce`` (g) right before the bias and the residual add; vocabulary-sharded embeddings
mask out-of-range ids and produce partial sums; vocabulary-sharded logits go straight into
``vocab_parallel_cross_entropy``. With ``plan.sequence_parallel``, a partial sum joining the
residual stream is reduce-scattered along the sequence (dim 1) instead, norms and dropout run on
sequence shards, and column linears all-gather their input (whose backward reduce-scatters).

Rules cover linear, embedding, cross-entropy, attention, layer norm, convolutions (channel
parallel: ``Shard(0)`` weights column, ``Shard(1)`` row), batch norm and pooling on channel
shards, elementwise and
broadcasting binary ops, views/reshapes/transposes/permutes/(un)squeeze/expand/flatten,
reductions, slicing, cat/split and getitem. An op without a rule gets replicated inputs and a
replicated output, with one warning naming the op. Replicated parameters that meet sharded
activations (norm weights under sequence parallelism) get ``gp.grad_partial = "tp"``, and
``insert_collectives`` sums their gradients over ``tp``.

Before/after (tp=2, an MLP)::

    up = aten.linear(x, up_w, up_b)   [B,T,256]    x_f = tp_copy(x, 'tp', 2)
    act = aten.gelu(up)                       →    up = aten.linear(x_f, up_w, up_b)       [B,T,128]
    down = aten.linear(act, down_w, down_b)        down = aten.linear(aten.gelu(up), down_w)  (partial)
    out = aten.add(x, down)                        red = tp_all_reduce(down, 'tp', 2); out = x + (red + down_b)
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from graphpass import meta
from graphpass.ops import packet as _packet
from graphpass.megatron import Projection, keeps_features, projection
from graphpass.pass_manager import PassContext, graph_pass
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


#: Ops through which a parameter's gradient flows back whole to it (pieces and views of it).
_PARAM_VIEWS = {operator.getitem, aten.split, aten.split_with_sizes, aten.chunk, aten.t, aten.transpose, aten.view,
                aten.reshape, aten._unsafe_view, aten.to, aten._to_copy, aten.alias, aten.detach, aten.slice,
                aten.unflatten, aten.flatten, aten.contiguous}


class TensorParallelError(ValueError):
    """A model/plan combination tensor parallelism cannot shard (names module and sizes)."""


class _Walker:
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

    def redistribute(self, value: fx.Node, dst: Placement, user: fx.Node, grad: str = "slice") -> fx.Node:
        """``value`` converted to ``dst`` (cached per value, target and the user's pipeline stage:
        a conversion read by several stages would be a collective spanning them), inserted before
        ``user``."""
        src = self.placement(value)
        if src == dst:
            return value
        if isinstance(src, MergedShard):
            value, src = self.unmerge(value, user, grad), R
            if src == dst:
                return value
        key = (value, str(dst), grad, user.meta.get(meta.STAGE))
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
        meta.copy_meta(value, node, exclude=(meta.VAL, meta.STATE_KEYS, meta.ATTR_KIND, meta.SHARD, meta.TP_SHARD,
                                             meta.PLACEMENT))
        node.meta[meta.CREATED_BY] = NAME
        self.place[node] = placement
        self.gshape[node] = tuple(global_shape)
        self.inherit_grad(value, node)
        return node

    def unmerge(self, value: fx.Node, user: fx.Node, grad: str = "slice") -> fx.Node:
        """A ``MergedShard`` value gathered whole: split the merged dim into (outer, inner) — a
        plain ``Shard`` of the inner factor —, all-gather that (its backward as ``grad`` says), and
        merge back."""
        key = (value, "unmerge", grad)
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
            node = collectives.emit_tp_copy(self.gm, value, AXIS, self.size, before=user, created_by=NAME)
            self.place[node] = R
            self.gshape[node] = self.gshape.get(value, ())
            self.cache[key] = node
        return self.cache[key]

    def mark_partial_grad(self, param: Any) -> None:
        """The parameter behind ``param`` (itself, or a piece or view of it: ``nn.
        MultiheadAttention`` splits ``in_proj_weight`` into q and kv weights in the graph) gets
        a gradient that is partial over tp."""
        while (isinstance(param, fx.Node) and param.op == "call_function" and param.args
               and isinstance(param.args[0], fx.Node) and _packet(param) in _PARAM_VIEWS):
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
            for key in (meta.TP_SHARD, meta.PLACEMENT):
                node.meta[key] = first.meta[key]
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
        parts = tuple(self.plan.tp_parts.get(meta.plan_name(node), ()))
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
        node.meta[meta.TP_SHARD] = {"axis": AXIS, "dim": dim, "shape": list(full.shape)}
        if parts:
            node.meta[meta.TP_SHARD]["parts"] = list(parts)
        node.meta[meta.PLACEMENT] = {**node.meta.get(meta.PLACEMENT, {}), AXIS: f"Shard({dim})"}
        return Shard(dim)

    def visit(self, node: fx.Node) -> Any:
        target = node.target
        rule = RULES.get(target)
        if rule is None and isinstance(target, torch._ops.OpOverload):
            rule = RULES.get(target.overloadpacket)
        tensor_args = [a for a in node.all_input_nodes if a in self.place]
        if any(isinstance(self.place.get(a), PartsShard) for a in tensor_args) and rule not in (_slice, _view):
            raise TensorParallelError(
                f"internal: the fused projection output reaches {self.where(node)} ({node.target}), "
                "which does not cut it into its parts"
            )
        if rule not in _CARRY_MERGED and any(isinstance(self.place.get(a), MergedShard) for a in tensor_args):
            self.gather_merged(node)
        if target is operator.getitem:
            # Before the all-replicated shortcut: placement() reads a multi-output node's list
            # of placements as Replicate, but its items may be sharded (chunks of head-sharded qkv).
            return self.getitem(node)
        if rule is None:
            return _no_rule(self, node)
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


RULES: dict[Any, Callable[[_Walker, fx.Node], Any]] = {}


def _no_rule(w: _Walker, node: fx.Node) -> Placement:
    """An op without a rule: replicated inputs, a replicated output (warned once per op)."""
    if all(w.placement(a) == R for a in node.all_input_nodes if a in w.place):
        return R
    w.warn_once(node)
    return w.to_replicate_all(node)


def rule(*targets: Any):
    """Register a placement rule for the given aten ops (overloads or packets)."""

    def wrap(fn):
        for t in targets:
            RULES[t] = fn
        return fn

    return wrap


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else dim


# ---------------------------------------------------------------------- rules: compute


@rule(aten.linear.default, aten.addmm.default)
def _linear(w: _Walker, node: fx.Node) -> Any:
    """A projection (``aten.linear``, or ``Conv1D``'s ``addmm`` with its ``[in, out]`` weight:
    :func:`graphpass.megatron.projection`): column parallel when the weight is sharded on its
    output features, row parallel when sharded on its input features."""
    proj = projection(node)
    if proj is None:  # an addmm of activations: no layout, replicated as ops without a rule
        w.gather_merged(node)
        return _no_rule(w, node)
    x, weight, bias, xi, bi = proj.x, proj.weight, proj.bias, proj.x_index, proj.bias_index
    wp, xp = w.placement(weight), w.placement(x)
    last = w.ndim(x) - 1
    if wp == Shard(proj.out_dim):  # the weight's output features: column parallel
        if isinstance(xp, (Shard, MergedShard)):  # sequence parallel: gathered, reduce-scattered back
            new_x = w.redistribute(x, R, node, grad="reduce_scatter")
        else:
            new_x = w.copy_for_sharded_use(w.redistribute(x, R, node), node)
        w.set_arg(node, xi, new_x)
        if bias is not None and w.placement(bias) == R:
            w.set_arg(node, bi, w.redistribute(bias, Shard(0), node))
        parts = w.parts.get(weight)
        if parts is not None:
            if bias is not None and w.parts.get(bias) != parts:
                raise TensorParallelError(f"{w.where(node)}: the fused weight's bias is not sharded by the same parts")
            return PartsShard(last, parts)
        return Shard(last)
    if wp == Shard(1 - proj.out_dim):  # its input features, row parallel: partial sums
        w.set_arg(node, xi, w.redistribute(x, Shard(last), node))
        if bias is not None:
            _bias_after_reduction(w, node, proj)
        return P
    # Replicated weight: sharding of the batch/sequence dims passes through.
    if isinstance(xp, (Shard, MergedShard)) and xp.dim == last:
        w.set_arg(node, xi, w.redistribute(x, R, node))
        xp = R
    if xp == P and bias is not None:
        w.set_arg(node, xi, w.redistribute(x, R, node))
        xp = R
    if xp != R:
        w.mark_partial_grad(weight)
        if bias is not None:
            w.mark_partial_grad(bias)
    return xp


def _bias_after_reduction(w: _Walker, node: fx.Node, proj: Projection) -> None:
    """A row-parallel projection computes partial sums without its bias; the bias is added to
    their sum. ``Conv1D``'s ``addmm`` becomes ``mm``, and its bias is added after the view back
    to ``[B, T, out]`` that follows it, so that under sequence parallelism the partial sums are
    reduce-scattered along the sequence there."""
    anchor = node
    if node.target == aten.addmm.default:
        node.target = aten.mm.default
        node.args = (node.args[proj.x_index], proj.weight)
        users = list(node.users)
        if len(users) == 1 and keeps_features(users[0]) and w.ndim(users[0]) > w.ndim(node):
            anchor = users[0]  # [B, T, out], batch first as Conv1D's models are
    else:
        node.args = tuple(node.args[:2])
    node.kwargs = {}
    with w.graph.inserting_after(anchor):
        add = w.graph.call_function(aten.add.Tensor, (anchor, proj.bias))
    meta.copy_meta(anchor, add)
    add.meta[meta.VAL] = anchor.meta.get(meta.VAL)
    anchor.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
    w.gshape[add] = w.gshape.get(anchor, ())
    w.inherit_grad(anchor, add)
    if anchor is node:
        w.place[node] = P
        w.place[add] = _binary(w, add)
    else:  # placed when the walk reaches it, right after the view
        w.after.setdefault(anchor, []).append(add)


@rule(aten.embedding.default)
def _embedding(w: _Walker, node: fx.Node) -> Placement:
    weight, idx = node.args[0], node.args[1]
    wp = w.placement(weight)
    if wp == Shard(0):  # vocabulary parallel: look up local rows, zero the others
        idx = w.redistribute(idx, R, node)
        rows = w.gshape[weight][0] // w.size
        start, stop = w.rank * rows, (w.rank + 1) * rows
        g = w.graph

        def local_op(target, *args):
            new = g.call_function(target, args)
            meta.copy_meta(node, new)
            new.meta[meta.CREATED_BY] = NAME
            w.place[new] = R
            return new

        with g.inserting_before(node):
            below = local_op(aten.lt.Scalar, idx, start)
            above = local_op(aten.ge.Scalar, idx, stop)
            outside = local_op(aten.logical_or.default, below, above)
            shifted = local_op(aten.sub.Tensor, idx, start)
            local_idx = local_op(aten.where.ScalarSelf, outside, 0, shifted)  # outside ? 0 : idx - start
        w.set_arg(node, 1, local_idx)
        padding = node.args[2] if len(node.args) > 2 else -1
        if padding is not None and padding >= 0:  # padding_idx is a global row: local or none
            w.set_arg(node, 2, padding - start if start <= padding < stop else -1)
        with g.inserting_before(node.next):  # in order, right after the lookup
            inside = local_op(aten.logical_not.default, outside)
            keep = local_op(aten.unsqueeze.default, inside, -1)
            masked = local_op(aten.mul.Tensor, node, keep)
        node.replace_all_uses_with(masked, delete_user_cb=lambda u: u is not masked)
        w.gshape[masked] = w.gshape.get(node, ())
        w.inherit_grad(node, masked)
        w.place[node] = P
        w.place[masked] = P
        return P
    if wp == Shard(1):
        return Shard(w.ndim(node) - 1)
    ip = w.placement(idx)
    if ip != R:
        w.mark_partial_grad(weight)
    return ip


@rule(aten.cross_entropy_loss.default)
def _cross_entropy(w: _Walker, node: fx.Node) -> Placement:
    logits, target = node.args[0], node.args[1]
    args = list(node.args) + [None] * (6 - len(node.args))
    weight, reduction, ignore_index, smoothing = args[2], args[3], args[4], args[5]
    reduction = 1 if reduction is None else reduction
    ignore_index = -100 if ignore_index is None else ignore_index
    lp = w.placement(logits)
    vocab_dim = w.ndim(logits) - 1
    if lp == Shard(vocab_dim) and w.ndim(logits) == 2 and weight is None and reduction in (1, 2) and not smoothing:
        target = w.redistribute(target, R, node)
        rows = w.gshape[logits][1] // w.size
        with w.graph.inserting_before(node):
            new = collectives.emit_vocab_parallel_cross_entropy(
                w.gm, logits, target, AXIS, w.size, w.rank * rows, ignore_index, created_by=NAME,
                reduction="mean" if reduction == 1 else "sum",  # a sum: global_loss_mean's
            )
        meta.copy_meta(node, new)
        node.replace_all_uses_with(new)
        w.graph.erase_node(node)
        w.place[new] = R
        return R
    return w.to_replicate_all(node)


@rule(aten.scaled_dot_product_attention.default)
def _attention(w: _Walker, node: fx.Node) -> Placement:
    q, k, v = node.args[:3]
    places = [w.placement(t) for t in (q, k, v)]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if places[0] == Shard(1) and _same_heads(w, node):
        # Replicated keys/values (kv heads fewer than tp, repeated to the query's heads): keep
        # this rank's heads, a local slice whose backward all-gathers the gradient.
        for i in (1, 2):
            if places[i] == R:
                w.set_arg(node, i, w.redistribute(node.args[i], Shard(1), node))
        places = [w.placement(t) for t in node.args[:3]]
    if all(p == Shard(1) for p in places):  # heads split across ranks
        if isinstance(mask, fx.Node) and len(w.gshape.get(mask, ())) == 4 and w.gshape[mask][1] != 1:
            local_mask = w.redistribute(mask, Shard(1), node)  # a per-head mask: keep our heads
            if len(node.args) > 3:
                w.set_arg(node, 3, local_mask)
            else:
                node.update_kwarg("attn_mask", local_mask)
        return Shard(1)
    return w.to_replicate_all(node)


def _same_heads(w: _Walker, node: fx.Node) -> bool:
    """Whether an attention's q, k and v have the same global head count (dim 1): not grouped
    attention that maps several query heads onto one kv head inside the op."""
    shapes = [w.gshape.get(t, ()) for t in node.args[:3] if isinstance(t, fx.Node)]
    return len(shapes) == 3 and all(len(s) == 4 for s in shapes) and len({s[1] for s in shapes}) == 1


def _matmul_out(w: _Walker, node: fx.Node, a: fx.Node, b: fx.Node) -> Any:
    """Placement of ``a @ b`` (both at least 2-D, batch dims broadcast) from its operands', or
    None when they do not combine locally: the same batch dim sharded on both (the heads of
    eager attention), rows of ``a`` or columns of ``b`` sharded with the other operand
    replicated (or broadcast along that batch dim), or the contracted dim sharded on both (a
    partial sum)."""
    na, nb, out = w.ndim(a), w.ndim(b), w.ndim(node)
    pa, pb = w.placement(a), w.placement(b)
    if pa == P or pb == P:
        return None

    def broadcast_in(x: fx.Node, out_dim: int) -> bool:
        """Whether ``x`` broadcasts along output batch dim ``out_dim`` (absent, or of size 1)."""
        dim = out_dim - (out - w.ndim(x))
        return dim < 0 or w.gshape[x][dim] == 1

    if isinstance(pa, Shard) and isinstance(pb, Shard):
        da, db = pa.dim + out - na, pb.dim + out - nb
        if pa.dim < na - 2 and pb.dim < nb - 2 and da == db:
            return Shard(da)
        if pa.dim == na - 1 and pb.dim == nb - 2:
            return P
        return None
    if isinstance(pa, Shard):
        da = pa.dim + out - na
        return Shard(da) if pa.dim == na - 2 or (pa.dim < na - 2 and broadcast_in(b, da)) else None
    if isinstance(pb, Shard):
        db = pb.dim + out - nb
        return Shard(db) if pb.dim == nb - 1 or (pb.dim < nb - 2 and broadcast_in(a, db)) else None
    return R


def _narrow_batch_operand(w: _Walker, node: fx.Node, a: fx.Node, b: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """When one operand is sharded on a batch dim (heads) and the other is replicated with that
    dim whole (keys or values replicated for kv heads fewer than tp, repeated to every head): the
    replicated one narrowed to this rank's slice of the dim, a local slice."""
    out = w.ndim(node)
    for sharded, other, first in ((a, b, True), (b, a, False)):
        ps, po = w.placement(sharded), w.placement(other)
        ns, no = w.ndim(sharded), w.ndim(other)
        if not (isinstance(ps, Shard) and ps.dim < ns - 2 and po == R):
            continue
        dim = ps.dim + out - ns  # the output batch dim
        odim = dim - (out - no)
        if odim < 0 or w.gshape[other][odim] != w.gshape[sharded][ps.dim]:
            continue
        narrowed = w.redistribute(other, Shard(odim), node)
        return (sharded, narrowed) if first else (narrowed, sharded)
    return None


@rule(aten.matmul.default, aten.bmm.default)
def _matmul(w: _Walker, node: fx.Node) -> Placement:
    a, b = node.args[0], node.args[1]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or w.ndim(a) < 2 or w.ndim(b) < 2:
        return w.to_replicate_all(node)
    placed = _matmul_out(w, node, a, b)
    if placed is None:
        narrowed = _narrow_batch_operand(w, node, a, b)
        placed = _matmul_out(w, node, *narrowed) if narrowed else None
        if placed is None:
            return w.to_replicate_all(node)
        for i, operand in enumerate(narrowed):
            w.set_arg(node, i, operand)
        a, b = narrowed
    if placed not in (R, P):
        for i, operand in enumerate((a, b)):
            if w.placement(operand) != R:
                continue
            # A replicated operand meeting sharded compute has a partial gradient.
            if operand.op == "get_attr":
                w.mark_partial_grad(operand)
            else:
                w.set_arg(node, i, w.copy_for_sharded_use(operand, node))
    return placed


@rule(aten.layer_norm.default)
def _layer_norm(w: _Walker, node: fx.Node) -> Placement:
    x, normalized = node.args[0], node.args[1]
    xp = w.placement(x)
    if isinstance(xp, Shard) and xp.dim < w.ndim(x) - len(normalized):
        for param in node.args[2:4]:
            w.mark_partial_grad(param)
        return xp
    w.set_arg(node, 0, w.redistribute(x, R, node))
    return R


_CONVOLUTIONS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)


@rule(*_CONVOLUTIONS)
def _conv(w: _Walker, node: fx.Node) -> Placement:
    """A convolution by a held weight ``[out, in, *kernel]`` (``groups == 1``), channel parallel:
    *column* when the weight is sharded on its output channels (dim 0): a replicated input (its
    gradient partial, Megatron's f), an output sharded on its channels (dim 1), the bias with it;
    *row* when sharded on its input channels (dim 1): the input sharded on its channels, partial
    sums, the bias added after their reduction. A replicated weight gathers a sharded input."""
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    groups = node.args[6] if len(node.args) > 6 else 1
    wp = w.placement(weight)
    if groups != 1 and isinstance(wp, Shard):
        raise TensorParallelError(f"{w.where(node)}: a grouped convolution (groups={groups}) cannot be "
                                  "channel parallel; leave its weight replicated")
    if wp == Shard(0):
        w.set_arg(node, 0, w.copy_for_sharded_use(w.redistribute(x, R, node), node))
        if isinstance(bias, fx.Node) and w.placement(bias) == R:
            w.set_arg(node, 2, w.redistribute(bias, Shard(0), node))
        return Shard(1)
    if wp == Shard(1):
        w.set_arg(node, 0, w.redistribute(x, Shard(1), node))
        if isinstance(bias, fx.Node):
            _conv_bias_after_reduction(w, node, bias)
        return P
    if w.placement(x) != R:
        w.set_arg(node, 0, w.redistribute(x, R, node))
    return R


def _conv_bias_after_reduction(w: _Walker, node: fx.Node, bias: fx.Node) -> None:
    """A row-parallel convolution computes partial sums without its bias; the bias, viewed as
    ``[out, 1, ...]``, is added to their sum."""
    w.set_arg(node, 2, None)
    spatial = w.ndim(node) - 2
    with w.graph.inserting_after(node):
        shaped = w.graph.call_function(aten.reshape.default, (bias, [-1] + [1] * spatial))
    with w.graph.inserting_after(shaped):
        add = w.graph.call_function(aten.add.Tensor, (node, shaped))
    meta.copy_meta(bias, shaped, exclude=(meta.VAL, meta.STATE_KEYS, meta.ATTR_KIND, meta.SHARD, meta.TP_SHARD,
                                          meta.PLACEMENT))
    shaped.meta[meta.VAL] = bias.meta[meta.VAL].reshape([-1] + [1] * spatial)
    meta.copy_meta(node, add)
    add.meta[meta.VAL] = node.meta.get(meta.VAL)
    node.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
    w.gshape[shaped] = (w.gshape[bias][0], *[1] * spatial)
    w.gshape[add] = w.gshape.get(node, ())
    w.place[shaped] = R
    w.inherit_grad(node, add)
    w.place[node] = P
    w.place[add] = _binary(w, add)


@rule(aten.batch_norm.default)
def _batch_norm(w: _Walker, node: fx.Node) -> Placement:
    """Batch norm normalises each channel (dim 1) apart: with its weight, bias and running
    statistics sharded on their channels (dim 0), its input is sharded on its channels and stays
    so (each rank updates its channels' statistics); otherwise the input is gathered."""
    x = node.args[0]
    params = [a for a in node.args[1:5] if isinstance(a, fx.Node)]
    placed = [w.placement(a) for a in params]
    if params and all(p == Shard(0) for p in placed):
        w.set_arg(node, 0, w.redistribute(x, Shard(1), node))
        return Shard(1)
    if any(isinstance(p, Shard) for p in placed):
        raise TensorParallelError(f"{w.where(node)}: batch norm needs its weight, bias and running statistics "
                                  "sharded together on their channels (Shard(0)), or none of them")
    w.set_arg(node, 0, w.redistribute(x, R, node))
    return R


@rule(aten.max_pool1d, aten.max_pool2d, aten.max_pool3d, aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d,
      aten.adaptive_avg_pool1d, aten.adaptive_avg_pool2d, aten.adaptive_avg_pool3d)
def _pool(w: _Walker, node: fx.Node) -> Placement:
    """Pooling works on each channel (dim 1) apart: a channel-sharded input stays so."""
    x = node.args[0]
    xp = w.placement(x)
    if xp == R or xp == Shard(1):
        return xp
    w.set_arg(node, 0, w.redistribute(x, R, node))
    return R


# ---------------------------------------------------------------------- rules: elementwise

_LINEAR_UNARY = {aten.neg, aten.clone, aten.contiguous, aten.alias, aten.detach, aten.to, aten._to_copy,
                 aten.lift_fresh_copy, aten.type_as}


@rule(aten.gelu, aten.relu, aten.silu, aten.tanh, aten.sigmoid, aten.exp, aten.log, aten.cos, aten.sin,
      aten.rsqrt, aten.sqrt, aten.pow.Tensor_Scalar, aten.dropout, aten.neg, aten.clone, aten.contiguous,
      aten.alias, aten.detach, aten.to, aten._to_copy, aten.lift_fresh_copy, aten.abs, aten.reciprocal,
      aten.logical_not, aten.bitwise_not, aten.erf, aten.softmax.int, aten.log_softmax.int, aten.type_as,
      aten.square)
def _unary(w: _Walker, node: fx.Node) -> Placement:
    x = node.args[0]
    xp = w.placement(x)
    packet = _packet(node)
    if xp == P and packet not in _LINEAR_UNARY:
        # Sequence parallel: materialise partial sums as sequence shards (reduce-scatter).
        dst = Shard(1) if w.sp and w.ndim(x) >= 3 else R
        w.set_arg(node, 0, w.redistribute(x, dst, node))
        return dst
    if packet in (aten.softmax, aten.log_softmax) and isinstance(xp, Shard) and xp.dim == _norm_dim(node.args[1], w.ndim(x)):
        w.set_arg(node, 0, w.redistribute(x, R, node))
        return R
    return xp


def _binary(w: _Walker, node: fx.Node) -> Placement:
    out_nd = len(w.gshape.get(node, ()))
    operands = [(i, a) for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a in w.place]
    if not operands:
        return R
    packet = node.target.overloadpacket if isinstance(node.target, torch._ops.OpOverload) else None
    additive = packet in (aten.add, aten.sub)
    places = {i: w.placement(a) for i, a in operands}
    partial = [i for i, p in places.items() if p == P]
    if partial:
        others = [i for i in places if i not in partial]
        if additive and not others:
            return P
        if (packet in (aten.mul, aten.div) and len(partial) == 1 and (packet is aten.mul or partial[0] == 0)
                and all(places[i] == R and node.args[i] not in w.needs_grad for i in others)):
            return P  # (sum x_r) * c = sum (x_r * c) for a constant c (an embedding's scale): stay partial
        # A partial sum meets another value: reduce it (to the other's shard if it has one).
        target = R
        sharded = [places[i] for i in others if isinstance(places[i], Shard)]
        if sharded:
            target = _to_out(sharded[0], w.ndim(node.args[others[0]]), out_nd)
        elif additive and w.sp and out_nd >= 3:
            target = Shard(1)  # sequence parallel: reduce-scatter along the sequence
        for i in partial:
            arg = node.args[i]
            dst = _to_in(target, w.ndim(arg), out_nd) if isinstance(target, Shard) else R
            w.set_arg(node, i, w.redistribute(arg, dst, node))
            places[i] = dst
    shards = {_to_out(p, w.ndim(node.args[i]), out_nd) for i, p in places.items() if isinstance(p, Shard)}
    if not shards:
        return R
    if len(shards) > 1:
        for i, _ in operands:
            w.set_arg(node, i, w.redistribute(node.args[i], R, node))
        return R
    (out_shard,) = shards
    for i, arg in operands:
        if isinstance(places[i], Shard):
            continue
        nd = w.ndim(arg)
        in_dim = out_shard.dim - (out_nd - nd)
        if in_dim >= 0 and w.gshape[arg][in_dim] != 1:
            w.set_arg(node, i, w.redistribute(arg, Shard(in_dim), node))  # local chunk, no traffic
        elif arg.op == "get_attr":
            w.mark_partial_grad(arg)  # broadcast against shards: each rank has part of its grad
        else:
            w.set_arg(node, i, w.copy_for_sharded_use(arg, node))
    return out_shard


def _to_out(p: Shard, in_nd: int, out_nd: int) -> Shard:
    return Shard(p.dim + (out_nd - in_nd))


def _to_in(p: Shard, in_nd: int, out_nd: int) -> Shard:
    return Shard(p.dim - (out_nd - in_nd))


for _op in (aten.add, aten.sub, aten.mul, aten.div, aten.where, aten.eq, aten.ne, aten.lt, aten.le, aten.gt,
            aten.ge, aten.logical_and, aten.logical_or, aten.maximum, aten.minimum, aten.masked_fill, aten.rsub):
    RULES[_op] = _binary


# ---------------------------------------------------------------------- rules: shapes


def _out_dim_at(out_shape: Sequence[int], prefix: int, size: int = 1) -> int | None:
    """The output dim of a view that starts right after ``prefix`` elements' worth of leading
    dims (the product of the output dims before it is ``prefix``) and holds the input dim of
    ``size`` elements: past size-1 dims when ``size > 1`` (a batch of one, an inserted dim, leave
    the product where it was); None when no dim starts there."""
    acc, o = 1, 0
    while o < len(out_shape) and acc < prefix:
        acc *= out_shape[o]
        o += 1
    while size > 1 and o < len(out_shape) and out_shape[o] == 1:
        o += 1
    return o if acc == prefix and o < len(out_shape) else None


def _view_map(in_shape: Sequence[int], out_shape: Sequence[int], dim: int) -> tuple[int, str] | None:
    """Where input dim ``dim`` lands in a view: (output dim, "split"|"merge"|"same") when it is the
    leading factor of its group, else None (the shard cannot stay local)."""
    o = _out_dim_at(out_shape, math.prod(in_shape[:dim]), in_shape[dim])
    if o is None:
        return None
    if out_shape[o] == in_shape[dim]:
        return o, "same"
    if out_shape[o] < in_shape[dim] and in_shape[dim] % out_shape[o] == 0:
        return o, "split"
    if out_shape[o] > in_shape[dim] and out_shape[o] % in_shape[dim] == 0:
        return o, "merge"
    return None


@rule(aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.flatten, aten.unflatten)
def _view(w: _Walker, node: fx.Node) -> Placement:
    x = node.args[0]
    xp = w.placement(x)
    packet = node.target.overloadpacket
    if isinstance(xp, PartsShard):
        return _view_parts(w, node, xp)
    if isinstance(xp, MergedShard):
        return _view_merged(w, node, xp)
    if not isinstance(xp, Shard):
        return xp
    in_shape, out_shape = w.gshape[x], w.gshape[node]
    merged = _merge_map(in_shape, out_shape, xp.dim, w.size) if packet in _SIZED_VIEWS else None
    if merged is not None:
        _local_sizes(w, node, merged[0])
        w.merged_from[node] = x
        return MergedShard(*merged)
    if packet is aten.expand:
        sizes = list(node.args[1])
        offset = len(sizes) - len(in_shape)
        if sizes[xp.dim + offset] != -1:
            sizes[xp.dim + offset] //= w.size
            w.set_arg(node, 1, sizes)
        return Shard(xp.dim + offset)
    found = _view_map(in_shape, out_shape, xp.dim)
    if found is None or out_shape[found[0]] % w.size:
        if found is not None:
            raise TensorParallelError(
                f"tensor parallel tp={w.size} cannot split {w.where(node)}: its view {list(in_shape)} -> "
                f"{list(out_shape)} makes the sharded size {out_shape[found[0]]}, not divisible by {w.size} "
                "(e.g. the number of attention heads); choose tp dividing it"
            )
        log.warning("%s: %s reshapes a sharded dim non-locally; gathering it", NAME, w.where(node))
        w.set_arg(node, 0, w.redistribute(x, R, node))
        return R
    out_dim, _ = found
    if packet in (aten.view, aten.reshape, aten._unsafe_view):
        sizes = list(node.args[1])
        if sizes[out_dim] != -1:
            sizes[out_dim] //= w.size
            w.set_arg(node, 1, sizes)
    elif packet is aten.unflatten:
        dim, sizes = _norm_dim(node.args[1], len(in_shape)), list(node.args[2])
        if out_dim >= dim and out_dim < dim + len(sizes) and sizes[out_dim - dim] != -1:
            sizes[out_dim - dim] //= w.size
            w.set_arg(node, 2, sizes)
    return Shard(out_dim)


def _moved(p: Any, dim: int) -> Any:
    """``p`` (a Shard or MergedShard) on dim ``dim`` instead."""
    return MergedShard(dim, p.outer) if isinstance(p, MergedShard) else Shard(dim)


_SIZED_VIEWS = (aten.view, aten.reshape, aten._unsafe_view)


def _local_sizes(w: _Walker, node: fx.Node, dim: int) -> None:
    """Divide a view's size argument at output dim ``dim`` by tp (``-1`` stays)."""
    sizes = list(node.args[1])
    if sizes[dim] != -1:
        sizes[dim] //= w.size
        w.set_arg(node, 1, sizes)


def _merge_map(in_shape: Sequence[int], out_shape: Sequence[int], dim: int, size: int) -> tuple[int, int] | None:
    """A view that merges whole input dims ``k..dim-1`` (``k < dim``) with the leading factor of
    sharded input dim ``dim`` (a multiple of tp: the heads) into one output dim: (that output
    dim, the merged outer size); None when the view is not such a merge."""
    for k in range(dim - 1, -1, -1):
        o = _out_dim_at(out_shape, math.prod(in_shape[:k]), in_shape[k])
        if o is None:
            continue
        outer = math.prod(in_shape[k:dim])
        if outer > 1 and out_shape[o] % outer == 0:
            lead = out_shape[o] // outer
            if lead > 1 and in_shape[dim] % lead == 0 and lead % size == 0:
                return o, outer
    return None


def _view_merged(w: _Walker, node: fx.Node, xp: MergedShard) -> Placement:
    """A view of a ``MergedShard``: one that splits the outer factor off again leaves the inner
    one a plain ``Shard``; one that keeps the merged dim whole keeps the placement; any other
    gathers first."""
    x = node.args[0]
    in_shape, out_shape = w.gshape[x], w.gshape[node]
    if node.target.overloadpacket in _SIZED_VIEWS:
        o = _out_dim_at(out_shape, math.prod(in_shape[:xp.dim]), in_shape[xp.dim])
        if o is not None:
            if out_shape[o] == in_shape[xp.dim]:
                _local_sizes(w, node, o)
                if x in w.merged_from:  # still a view of the same plain shard
                    w.merged_from[node] = w.merged_from[x]
                return MergedShard(o, xp.outer)
            acc, j = 1, o
            while j < len(out_shape) and acc < xp.outer:
                acc *= out_shape[j]
                j += 1
            inner = in_shape[xp.dim] // xp.outer
            if acc == xp.outer and j < len(out_shape) and out_shape[j] % w.size == 0 and inner % out_shape[j] == 0:
                _local_sizes(w, node, j)
                return Shard(j)
    w.set_arg(node, 0, w.redistribute(x, R, node))
    return _view(w, node)


def _view_parts(w: _Walker, node: fx.Node, xp: PartsShard) -> Placement:
    """A view of a fused projection's output. One that keeps the features whole (``Conv1D``'s
    ``view(B, T, 3 * E)``) keeps the parts, at local size. One of equal parts unflattened into
    (parts, part size) — ``nn.MultiheadAttention``'s ``unflatten(-1, (3, E))`` — shards the part
    size (every part holds this rank's chunk), so the result is a plain ``Shard`` of the new last
    dim."""
    x = node.args[0]
    if keeps_features(node) and xp.dim == w.ndim(x) - 1:
        _local_sizes(w, node, w.ndim(node) - 1)
        return PartsShard(w.ndim(node) - 1, xp.parts)
    k, part = len(xp.parts), xp.parts[0]
    if node.target.overloadpacket is aten.unflatten and len(set(xp.parts)) == 1:
        dim, sizes = _norm_dim(node.args[1], w.ndim(x)), list(node.args[2])
        if dim == xp.dim and len(sizes) == 2 and sizes[0] in (k, -1) and sizes[1] in (part, -1):
            w.set_arg(node, 2, [k, part // w.size])
            return Shard(dim + 1)
    raise TensorParallelError(
        f"internal: the fused projection output reaches {w.where(node)} ({node.target}), which does not "
        "cut it into its parts"
    )


@rule(aten.transpose.int)
def _transpose(w: _Walker, node: fx.Node) -> Placement:
    xp = w.placement(node.args[0])
    if not isinstance(xp, (Shard, MergedShard)):
        return xp
    nd = w.ndim(node.args[0])
    a, b = _norm_dim(node.args[1], nd), _norm_dim(node.args[2], nd)
    return _moved(xp, b if xp.dim == a else a if xp.dim == b else xp.dim)


@rule(aten.t.default)
def _t(w: _Walker, node: fx.Node) -> Placement:
    xp = w.placement(node.args[0])
    return Shard(1 - xp.dim) if isinstance(xp, Shard) and w.ndim(node.args[0]) == 2 else xp


@rule(aten.permute.default)
def _permute(w: _Walker, node: fx.Node) -> Placement:
    xp = w.placement(node.args[0])
    if not isinstance(xp, (Shard, MergedShard)):
        return xp
    dims = [_norm_dim(d, w.ndim(node.args[0])) for d in node.args[1]]
    return _moved(xp, dims.index(xp.dim))


#: Rules that carry a ``MergedShard`` input (every other op gathers it first).
_CARRY_MERGED = (_view, _transpose, _permute, _linear)


@rule(aten.unsqueeze.default)
def _unsqueeze(w: _Walker, node: fx.Node) -> Placement:
    xp = w.placement(node.args[0])
    if not isinstance(xp, Shard):
        return xp
    dim = _norm_dim(node.args[1], w.ndim(node))
    return Shard(xp.dim + 1 if xp.dim >= dim else xp.dim)


@rule(aten.squeeze.dim, aten.select.int)
def _drop_dim(w: _Walker, node: fx.Node) -> Placement:
    x = node.args[0]
    xp = w.placement(x)
    if not isinstance(xp, Shard):
        return xp
    dim = _norm_dim(node.args[1], w.ndim(x))
    if xp.dim == dim:
        w.set_arg(node, 0, w.redistribute(x, R, node))
        return R
    if node.target is aten.squeeze.dim and w.gshape[x][dim] != 1:
        return xp
    return Shard(xp.dim - 1 if xp.dim > dim else xp.dim)


def _slice_dim(node: fx.Node) -> int:
    """The dim a slicing op cuts: slice/narrow take it second, split/chunk third (default 0)."""
    if node.target in (aten.slice.Tensor, aten.narrow.default):
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)


@rule(aten.slice.Tensor, aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def _slice(w: _Walker, node: fx.Node) -> Any:
    x = node.args[0]
    xp = w.place.get(x, R)
    if isinstance(xp, PartsShard):
        return _cut_parts(w, node, xp)
    xp = w.placement(x)
    if isinstance(xp, Shard) and _norm_dim(_slice_dim(node), w.ndim(x)) == xp.dim:
        w.set_arg(node, 0, w.redistribute(x, R, node))  # cutting the sharded dim needs all of it
        xp = R
    if node.target in (aten.slice.Tensor, aten.narrow.default):
        return xp
    pieces = len(node.meta.get(meta.VAL) or ())
    return [xp] * pieces


def _cut_parts(w: _Walker, node: fx.Node, xp: PartsShard) -> Any:
    """A fused projection's output cut into its parts: the same cut at local sizes (every part
    is ``size`` times smaller), each piece sharded like an unfused projection's output."""
    local = [n // w.size for n in xp.parts]
    starts = [sum(xp.parts[:i]) for i in range(len(xp.parts))]
    if node.target in (aten.slice.Tensor, aten.narrow.default):
        if node.target is aten.narrow.default:
            raise TensorParallelError(f"{w.where(node)}: narrow of a fused projection is not supported")
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        index = starts.index(start + (sum(xp.parts) if start < 0 else 0))
        args = list(node.args) + [None] * (4 - len(node.args))
        args[2], args[3] = sum(local[:index]), sum(local[: index + 1])
        node.args = tuple(args[:4]) + tuple(node.args[4:])
        return Shard(xp.dim)
    if node.target is aten.split.Tensor:
        w.set_arg(node, 1, node.args[1] // w.size)
    elif node.target is aten.split_with_sizes.default:
        w.set_arg(node, 1, [n // w.size for n in node.args[1]])
    # chunk(k) of equal parts cuts the local tensor into its local parts as it is
    return [Shard(xp.dim)] * len(xp.parts)


@rule(aten.cat.default)
def _cat(w: _Walker, node: fx.Node) -> Placement:
    tensors = list(node.args[0])
    # cat skips legacy empty 1-D tensors (an empty KV cache), so they constrain nothing.
    real = [t for t in tensors if w.gshape.get(t) != (0,)]
    nd = w.ndim(real[0]) if real else 1
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    places = {w.placement(t) for t in real}
    if len(places) == 1:
        (p,) = places
        if p == R or p == P or (isinstance(p, Shard) and p.dim != dim):
            return p
    w.set_arg(node, 0, [w.redistribute(t, R, node) if t in real else t for t in tensors])
    return R


@rule(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.sum.default, aten.mean.default)
def _reduce(w: _Walker, node: fx.Node) -> Placement:
    x = node.args[0]
    xp = w.placement(x)
    nd = w.ndim(x)
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(nd))
    dims = [_norm_dim(d, nd) for d in dims]
    keepdim = bool(node.args[2]) if len(node.args) > 2 else False
    packet = node.target.overloadpacket
    if xp == P:
        if packet is aten.amax:
            w.set_arg(node, 0, w.redistribute(x, R, node))
            return R
        return P
    if not isinstance(xp, Shard):
        return xp
    if xp.dim in dims:
        w.set_arg(node, 0, w.redistribute(x, R, node))
        return R
    return Shard(xp.dim if keepdim else xp.dim - sum(1 for d in dims if d < xp.dim))


@rule(aten._assert_tensor_metadata.default)
def _assert_metadata(w: _Walker, node: fx.Node) -> Placement:
    return R  # checks dtype/device/layout only, which sharding keeps


@graph_pass(NAME, requires=(), provides=("tensor_parallel",))
def tensor_parallel(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Shard ``tp`` parameters and rewrite the graph to local, Megatron-style compute."""
    size = plan.mesh.get(AXIS, 1)
    if size == 1:
        log.info("%s: no tp axis of size > 1; nothing to do", NAME)
        return gm
    walker = _Walker(gm, plan, size, plan.mesh.coordinate(ctx.rank, AXIS))
    walker.run()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


# ---------------------------------------------------------------------------------- dry run


class _Skeleton(fx.GraphModule):
    """A GraphModule that never generates its Python code: a dry run rewrites its graph but
    never calls it (whoever runs the program copies the graph into a module of its own), and
    generating the code of a 96-layer graph at every tp a planner prices costs seconds."""

    def recompile(self) -> Any:
        return None


def _skeleton(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose parameters and buffers are meta tensors of the same shapes.

    The tensor-parallel walk rewrites the graph and swaps attributes for their shards; on the
    skeleton that costs no memory and leaves ``gm`` untouched. Its code is not generated: copy
    its graph into a module of your own to run it.
    """
    root = nn.Module()
    for node in gm.graph.find_nodes(op="get_attr"):
        module_path, _, attr = node.target.rpartition(".")
        value = getattr(gm.get_submodule(module_path), attr)
        owner = root
        for part in module_path.split(".") if module_path else ():
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if isinstance(value, nn.Module):
            owner.add_module(attr, value)
        elif isinstance(value, nn.Parameter):
            owner.register_parameter(attr, nn.Parameter(_meta_like(value), value.requires_grad))
        elif isinstance(value, torch.Tensor):
            owner.register_buffer(attr, _meta_like(value))
        else:
            setattr(owner, attr, value)
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    output = graph.output(out)
    output.meta.update(gm.graph.find_nodes(op="output")[0].meta)
    return _Skeleton(root, graph)


def _meta_like(value: torch.Tensor) -> torch.Tensor:
    # not empty_like: on an nn.Parameter that dispatches through __torch_function__, ~0.4 ms a call
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


@dataclass(frozen=True)
class EmittedCollective:
    """One collective the pass would insert: runtime op name, full (global) shape and dtype of the
    tensor it moves, the repeated layer it sits in (None outside layers), and its backward kind."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layer: int | None
    grad: str = "slice"
    #: the captured node whose value it moves (through other inserted nodes), for attribution
    anchor: str = ""

    @property
    def nbytes(self) -> int:
        if self.op == "vocab_parallel_cross_entropy":  # moves one float32 per token (max, then sums)
            return 4 * self.shape[0] if self.shape else 4
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """What the pass would do for a plan: each original node's ``tp`` placement, the emitted
    collectives, in graph order, and the program itself (rank 0's rewritten graph on a meta
    skeleton: sharded parameters, the pass's added ops and collectives; its fake values are
    not yet re-derived; None for tp 1)."""

    placements: dict[str, Any]
    collectives: tuple[EmittedCollective, ...]
    program: fx.GraphModule | None = None


def _dtype_of(node: fx.Node) -> torch.dtype:
    stack, seen = [node], set()
    while stack:
        n = stack.pop(0)
        if n in seen:
            continue
        seen.add(n)
        val = n.meta.get(meta.VAL)
        if isinstance(val, torch.Tensor):
            return val.dtype
        stack.extend(n.all_input_nodes)
    return torch.float32


def layout(gm: fx.GraphModule, plan: Plan) -> Layout:
    """Dry-run this pass for ``plan`` (as rank 0) on a meta skeleton, leaving ``gm`` untouched.

    The planner prices tensor parallelism from the result, so it prices exactly the collectives
    the real pass emits.

    Raises:
        TensorParallelError: the plan cannot be applied (a sharded size not divisible by tp).
    """
    size = plan.mesh.get(AXIS, 1)
    if size == 1:
        return Layout({n.name: R for n in gm.graph.nodes}, ())
    skeleton = _skeleton(gm)
    walker = _Walker(skeleton, plan, size, 0)
    walker.run()
    emitted = []
    for node in skeleton.graph.nodes:
        if node.meta.get(meta.CREATED_BY) != NAME or not collectives.is_collective(node):
            continue
        source = node.args[0]
        shape = walker.gshape.get(source, ())
        anchor = source
        while anchor.meta.get(meta.CREATED_BY) == NAME and anchor.all_input_nodes:
            anchor = anchor.all_input_nodes[0]
        emitted.append(EmittedCollective(
            node.target.__name__, tuple(shape), _dtype_of(source), node.meta.get(meta.LAYER),
            node.kwargs.get("grad", "slice"), anchor.name,
        ))
    placements = {n.name: Shard(p.dim) if isinstance(p, (PartsShard, MergedShard)) else p
                  for n, p in walker.place.items() if n.meta.get(meta.CREATED_BY) != NAME}
    return Layout(placements, tuple(emitted), skeleton)
