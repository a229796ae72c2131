"""Tensor-parallel rules of the ops that move dims around (DTensor's view ops): views and reshapes
(dims split and merged, fused parts, strided ``MergedShard``), transposes and permutes,
(un)squeeze, slicing and split, cat, reductions.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Shard

from graphpass import meta
from graphpass.megatron import keeps_features
from graphpass.ops import RESHAPES
from graphpass.passes.tensor_parallel.walker import (
    NAME, P, R, aten, log, MergedShard, norm_dim, PartsShard, rule, shape_of, TensorParallelError, Walker,
)


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


def _keeps_view(node: fx.Node, source: fx.Node, dim: int) -> int | None:
    """Where a plain shard lands through a view: ``expand`` keeps it on its aligned dim; a
    reshape on the output dim its input dim leads (:func:`_view_map`), unless it merges with dims
    before it (a strided ``MergedShard``, not a plain shard)."""
    in_shape, out_shape = shape_of(source), shape_of(node)
    if node.target.overloadpacket is aten.expand:
        return dim + len(out_shape) - len(in_shape)
    if node.target.overloadpacket in RESHAPES and _merge_map(in_shape, out_shape, dim, 1) is not None:
        return None
    found = _view_map(in_shape, out_shape, dim)
    return found[0] if found is not None else None


@rule(*RESHAPES, aten.expand, aten.flatten, aten.unflatten,
      carries=(MergedShard, PartsShard), keeps=_keeps_view)
def _view(w: Walker, node: fx.Node) -> Placement:
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
    merged = _merge_map(in_shape, out_shape, xp.dim, w.size) if packet in RESHAPES else None
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
    if packet in RESHAPES:
        sizes = list(node.args[1])
        if sizes[out_dim] != -1:
            sizes[out_dim] //= w.size
            w.set_arg(node, 1, sizes)
    elif packet is aten.unflatten:
        dim, sizes = norm_dim(node.args[1], len(in_shape)), list(node.args[2])
        if out_dim >= dim and out_dim < dim + len(sizes) and sizes[out_dim - dim] != -1:
            sizes[out_dim - dim] //= w.size
            w.set_arg(node, 2, sizes)
    return Shard(out_dim)


def _moved(p: Any, dim: int) -> Any:
    """``p`` (a Shard or MergedShard) on dim ``dim`` instead."""
    return MergedShard(dim, p.outer) if isinstance(p, MergedShard) else Shard(dim)




def _local_sizes(w: Walker, node: fx.Node, dim: int) -> None:
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


def _view_merged(w: Walker, node: fx.Node, xp: MergedShard) -> Placement:
    """A view of a ``MergedShard``: one that splits the outer factor off again leaves the inner
    one a plain ``Shard``; one that keeps the merged dim whole keeps the placement; any other
    gathers first."""
    x = node.args[0]
    in_shape, out_shape = w.gshape[x], w.gshape[node]
    if node.target.overloadpacket in RESHAPES:
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


def _view_parts(w: Walker, node: fx.Node, xp: PartsShard) -> Placement:
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
        dim, sizes = norm_dim(node.args[1], w.ndim(x)), list(node.args[2])
        if dim == xp.dim and len(sizes) == 2 and sizes[0] in (k, -1) and sizes[1] in (part, -1):
            w.set_arg(node, 2, [k, part // w.size])
            return Shard(dim + 1)
    raise TensorParallelError(
        f"internal: the fused projection output reaches {w.where(node)} ({node.target}), which does not "
        "cut it into its parts"
    )


@rule(aten.transpose.int, carries=(MergedShard,))
def _transpose(w: Walker, node: fx.Node) -> Placement:
    xp = w.placement(node.args[0])
    if not isinstance(xp, (Shard, MergedShard)):
        return xp
    nd = w.ndim(node.args[0])
    a, b = norm_dim(node.args[1], nd), norm_dim(node.args[2], nd)
    return _moved(xp, b if xp.dim == a else a if xp.dim == b else xp.dim)


@rule(aten.t.default)
def _t(w: Walker, node: fx.Node) -> Placement:
    xp = w.placement(node.args[0])
    return Shard(1 - xp.dim) if isinstance(xp, Shard) and w.ndim(node.args[0]) == 2 else xp


@rule(aten.permute.default, carries=(MergedShard,))
def _permute(w: Walker, node: fx.Node) -> Placement:
    xp = w.placement(node.args[0])
    if not isinstance(xp, (Shard, MergedShard)):
        return xp
    dims = [norm_dim(d, w.ndim(node.args[0])) for d in node.args[1]]
    return _moved(xp, dims.index(xp.dim))


@rule(aten.unsqueeze.default)
def _unsqueeze(w: Walker, node: fx.Node) -> Placement:
    xp = w.placement(node.args[0])
    if not isinstance(xp, Shard):
        return xp
    dim = norm_dim(node.args[1], w.ndim(node))
    return Shard(xp.dim + 1 if xp.dim >= dim else xp.dim)


@rule(aten.squeeze.dim, aten.select.int)
def _drop_dim(w: Walker, node: fx.Node) -> Placement:
    x = node.args[0]
    xp = w.placement(x)
    if not isinstance(xp, Shard):
        return xp
    dim = norm_dim(node.args[1], w.ndim(x))
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


@rule(aten.slice.Tensor, aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
      carries=(PartsShard,))
def _slice(w: Walker, node: fx.Node) -> Any:
    x = node.args[0]
    xp = w.place.get(x, R)
    if isinstance(xp, PartsShard):
        return _cut_parts(w, node, xp)
    xp = w.placement(x)
    if isinstance(xp, Shard) and norm_dim(_slice_dim(node), w.ndim(x)) == xp.dim:
        w.set_arg(node, 0, w.redistribute(x, R, node))  # cutting the sharded dim needs all of it
        xp = R
    if node.target in (aten.slice.Tensor, aten.narrow.default):
        return xp
    pieces = len(node.meta.get(meta.VAL) or ())
    return [xp] * pieces


def _cut_parts(w: Walker, node: fx.Node, xp: PartsShard) -> Any:
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
def _cat(w: Walker, node: fx.Node) -> Placement:
    tensors = list(node.args[0])
    # cat skips legacy empty 1-D tensors (an empty KV cache), so they constrain nothing.
    real = [t for t in tensors if w.gshape.get(t) != (0,)]
    nd = w.ndim(real[0]) if real else 1
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    places = {w.placement(t) for t in real}
    if len(places) == 1:
        (p,) = places
        if p == R or p == P or (isinstance(p, Shard) and p.dim != dim):
            return p
    w.set_arg(node, 0, [w.redistribute(t, R, node) if t in real else t for t in tensors])
    return R


def _reduced(node: fx.Node, dim: int, nd: int) -> int | None:
    """Where a reduction over some dims leaves a shard on ``dim`` of its ``nd``-D input: None
    when it reduces that dim."""
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(nd))
    dims = [norm_dim(d, nd) for d in dims]
    keepdim = bool(node.args[2]) if len(node.args) > 2 else False
    if dim in dims:
        return None
    return dim if keepdim else dim - sum(1 for d in dims if d < dim)


@rule(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.sum.default, aten.mean.default,
      keeps=lambda node, source, dim: _reduced(node, dim, len(shape_of(source))))
def _reduce(w: Walker, node: fx.Node) -> Placement:
    x = node.args[0]
    xp = w.placement(x)
    packet = node.target.overloadpacket
    if xp == P:
        if packet is aten.amax:
            w.set_arg(node, 0, w.redistribute(x, R, node))
            return R
        return P
    if not isinstance(xp, Shard):
        return xp
    dim = _reduced(node, xp.dim, w.ndim(x))
    if dim is None:
        w.set_arg(node, 0, w.redistribute(x, R, node))
        return R
    return Shard(dim)


@rule(aten._assert_tensor_metadata.default)
def _assert_metadata(w: Walker, node: fx.Node) -> Placement:
    return R  # checks dtype/device/layout only, which sharding keeps
