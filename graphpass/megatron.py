"""Megatron-LM's tensor-parallel layout for a captured graph: which weights to shard, how.

Reads the graph only (an analysis, no rewriting). Within each repeated layer, a linear whose
output flows — through elementwise, view/transpose and attention ops — into another linear of
the same layer is *column* parallel (weight ``Shard(0)``: q/k/v, MLP up/gate), and the linear it
flows into is *row* parallel (weight ``Shard(1)``: attention output, MLP down). A token embedding
(indexed by a graph input) is vocabulary parallel (``Shard(0)``), and so is a linear that produces
the logits of a cross-entropy, which gives a vocabulary-sharded loss without gathering logits;
a vocabulary that ``tp`` does not divide (a classifier's 3 labels, GPT-2's 50257 tokens) stays
replicated instead, every rank computing whole logits. Everything else stays replicated.

A linear is any :class:`Projection`: ``aten.linear`` and Hugging Face's ``Conv1D``
(``addmm(bias, x, W)`` with ``W`` stored ``[in, out]``, so its column shard is ``Shard(1)`` and its
row shard ``Shard(0)``).

A column-parallel linear whose output is only cut into pieces along its features (a fused
q/k/v projection split as ``split(n_embd, dim=-1)`` or sliced, a fused gate/up ``chunk(2, -1)``;
seen through views that keep the features whole, as ``Conv1D``'s ``view(B, T, 3 * n_embd)``)
is a *fused projection*: its parts (the pieces' sizes) are sharded one by one, so each rank
computes its heads of q, k and v and the split stays local. When heads are interleaved instead
(``view(B, T, heads, 3 * head_dim)`` then ``chunk(3, -1)``), a plain row shard already holds
whole heads and no parts are needed.

Grouped-query attention with fewer key/value heads than ``tp`` (one kv head and tp 2): the k and
v projections stay *replicated*, as Megatron-LM and vLLM replicate kv heads: every rank computes
all kv heads (a small projection), and the pass narrows the repeated keys and values to the
rank's query heads where they meet sharded attention. A projection is treated so when its heads
do not divide by tp while a sibling projection feeding the same row-parallel linear (the query)
does; when no sibling divides, the pass's own error names the view and the sizes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from graphpass import meta
from graphpass.ops import COPIES, ELEMENTWISE, RESHAPES, is_in, packet as _packet

aten = torch.ops.aten

# Ops through which a column-parallel output stays sharded on its feature/head dims.
# (views and elementwise ops, and attention: per head)
_PASS_THROUGH = ELEMENTWISE | RESHAPES | {
    aten.transpose, aten.permute, aten.cat, aten.slice, aten.unsqueeze, aten.expand, aten.scaled_dot_product_attention,
    aten.unflatten, aten.flatten, aten.split, aten.chunk, aten.softmax, aten.matmul, aten.bmm, aten.squeeze,
    aten.select, aten.unbind, operator.getitem,
    aten.masked_fill, aten.where,  # causal masks written as scores.masked_fill(mask, -inf) or where(mask, scores, -inf)
}

_ANY_LAYER = object()  # flows_into's default: follow the value into every layer


@dataclass(frozen=True)
class Projection:
    """A linear projection by a held 2-D weight, whichever op computes it: ``aten.linear(x, W,
    b)`` with ``W`` of shape ``[out, in]`` (``out_dim`` 0), or ``aten.addmm(b, x, W)`` with ``W``
    of shape ``[in, out]`` (``out_dim`` 1: Hugging Face's ``Conv1D`` in GPT-2 and its kin).
    ``*_index`` are the positions of the input, weight and bias in the node's arguments."""

    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    out_dim: int
    x_index: int
    bias_index: int

    @property
    def column(self) -> str:
        """The weight's placement that shards the output features (column parallel)."""
        return f"Shard({self.out_dim})"

    @property
    def row(self) -> str:
        """The weight's placement that shards the input features (row parallel)."""
        return f"Shard({1 - self.out_dim})"


def projection(node: fx.Node) -> Projection | None:
    """``node`` as a :class:`Projection`, or None when it is not one (an ``addmm`` of two
    activations, or one that scales its terms)."""
    if node.op != "call_function":
        return None
    if node.target == aten.linear.default:
        x = node.args[0]
        weight = node.args[1] if len(node.args) > 1 else None
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        out_dim, x_index, bias_index = 0, 0, 2
    elif node.target == aten.addmm.default and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
        bias, x, weight = node.args[:3]
        out_dim, x_index, bias_index = 1, 1, 0
        if not (isinstance(bias, fx.Node) and bias.op == "get_attr" and _ndim(bias) == 1):
            return None
    else:
        return None
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and _ndim(weight) == 2 and isinstance(x, fx.Node)):
        return None
    bias = bias if isinstance(bias, fx.Node) and bias.op == "get_attr" else None
    return Projection(x, weight, bias, out_dim, x_index, bias_index)


def _downstream_linears(start: fx.Node, layer) -> list[fx.Node]:
    """Linears of ``layer`` reached from ``start`` through pass-through ops (not through norms,
    reductions or other linears)."""
    return flows_into(start, layer)[0]


def flows_into(start: fx.Node, layer: object = _ANY_LAYER, through: Callable[[fx.Node], bool] | None = None,
               ends: Callable[[fx.Node], object] | None = None) -> tuple[list[fx.Node], bool, list[fx.Node]]:
    """The linears (or nodes ``ends`` accepts) ``start``'s output reaches through ops ``through`` accepts (default: the
    pass-through ops, along which a column-parallel output stays sharded; not through norms,
    reductions or other linears), within ``layer`` when one is given; and whether any other op
    (a norm, a loss, the graph's output) reads the value on the way, where a sharded value must
    be made whole; and the ops passed through (which run on the shards)."""
    found, stack, seen, other, passed = [], list(start.users), set(), False, []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op != "call_function":
            other = True
        elif layer is not _ANY_LAYER and node.meta.get(meta.LAYER) != layer:
            continue
        elif (ends or projection)(node) is not None:
            found.append(node)
        elif (through(node) if through is not None else is_in(node, _PASS_THROUGH)):
            passed.append(node)
            stack.extend(node.users)
        else:
            other = True
    return found, other, passed


def _feeds_cross_entropy(node: fx.Node) -> bool:
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        if user.target == aten.cross_entropy_loss.default:
            return True
        if _packet(user) in RESHAPES | COPIES | {aten.flatten}:
            stack.extend(user.users)
    return False


_BIG = 2**62  # slice ends beyond this mean "to the end" (torch writes sys.maxsize)


def _ndim(node: fx.Node) -> int:
    val = node.meta.get(meta.VAL)
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _selected_apart(node: fx.Node, pos: int) -> bool:
    """Whether dim ``pos`` of ``node`` is, through moves of dims (unsqueeze, transpose, squeeze,
    permute, contiguous), only ever indexed apart (``select`` of it, ``unbind``)."""
    while True:
        users = list(node.users)
        if users and all(u.target in (aten.select.int, aten.unbind.int)
                         and (u.args[1] if len(u.args) > 1 else 0) % max(_ndim(node), 1) == pos for u in users):
            return True
        if len(users) != 1:
            return False
        (user,) = users
        packet, nd = _packet(user), _ndim(node)
        if packet is aten.unsqueeze:
            pos += 1 if user.args[1] % (nd + 1) <= pos else 0
        elif packet is aten.squeeze and user.target == aten.squeeze.dim:
            d = user.args[1] % nd
            if d == pos:
                return False
            pos -= 1 if d < pos else 0
        elif packet is aten.transpose:
            a, b = user.args[1] % nd, user.args[2] % nd
            pos = b if pos == a else a if pos == b else pos
        elif packet is aten.permute:
            pos = [d % nd for d in user.args[1]].index(pos)
        elif packet not in (aten.contiguous, aten.clone, aten.alias):  # these keep every dim
            return False
        node = user


def _piece(user: fx.Node, dim: int, size: int) -> list[tuple[int, int]] | None:
    """The ``[start, stop)`` ranges of features a slicing op cuts along ``dim``, or None when the
    op is not a slicing of that dim. ``unflatten(dim, (k, size / k))`` counts as k equal pieces
    when the new k dim is only indexed apart (``nn.MultiheadAttention``'s packed q, k, v), not
    when it is a heads view."""
    target = user.target
    args = list(user.args)
    if target == aten.unflatten.int:
        sizes = list(args[2])
        if args[1] % (dim + 1) != dim or len(sizes) != 2 or not _selected_apart(user, dim):
            return None
        k = sizes[0] if sizes[0] != -1 else size // sizes[1]
        return [(i * size // k, (i + 1) * size // k) for i in range(k)]
    if target == aten.slice.Tensor:
        d = args[1] if len(args) > 1 else 0
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        stop = args[3] if len(args) > 3 and args[3] is not None else size
        step = args[4] if len(args) > 4 else 1
        if d % (dim + 1) != dim or step != 1:
            return None
        start, stop = start + size if start < 0 else start, (size if stop >= _BIG else stop + size if stop < 0 else stop)
        return [(max(0, start), min(size, stop))]
    if target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        d = args[2] if len(args) > 2 else user.kwargs.get("dim", 0)
        if d % (dim + 1) != dim:
            return None
        if target == aten.split_with_sizes.default:
            sizes = list(args[1])
        elif target == aten.split.Tensor:
            sizes = [args[1]] * (size // args[1]) + ([size % args[1]] if size % args[1] else [])
        else:
            step = -(-size // args[1])
            sizes = [step] * (size // step) + ([size % step] if size % step else [])
        bounds, start = [], 0
        for n in sizes:
            bounds.append((start, start + n))
            start += n
        return bounds
    return None


def keeps_features(view: fx.Node) -> bool:
    """Whether ``view`` reshapes only the leading dims of its input, keeping the last (the
    features) whole: ``Conv1D``'s ``view(B, T, out)`` of its ``[B * T, out]`` product."""
    if view.op != "call_function" or _packet(view) not in RESHAPES:
        return False
    src, out = view.args[0].meta.get(meta.VAL), view.meta.get(meta.VAL)
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dim() >= 1 and out.dim() >= 1
            and src.shape[-1] == out.shape[-1])


def elementwise(node: fx.Node) -> bool:
    """Whether ``node`` acts on each element apart (so on each feature or channel apart)."""
    return is_in(node, ELEMENTWISE)


def feature_wise(node: fx.Node) -> bool:
    """Whether ``node`` keeps a value sharded on its features so: an elementwise op, or a view
    that keeps the features whole."""
    return elementwise(node) or keeps_features(node)


def _feature_users(node: fx.Node) -> list[tuple[fx.Node, int]]:
    """The users of ``node``'s output with the dim its features are at, seen through views that
    keep the features whole."""
    found = []
    for user in node.users:
        if keeps_features(user):
            found += _feature_users(user)
        else:
            found.append((user, _ndim(node) - 1))
    return found


def fused_parts(linear: fx.Node) -> tuple[int, ...] | None:
    """The part sizes of a fused projection (see the module docstring), or None: every user of
    the linear's output cuts it along the features into pieces that tile them, at least two."""
    val = linear.meta.get(meta.VAL)
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or not linear.users:
        return None
    size = val.shape[-1]
    pieces: set[tuple[int, int]] = set()
    for user, dim in _feature_users(linear):
        cut = _piece(user, dim, size)
        if cut is None:
            return None
        pieces.update(cut)
    ordered = sorted(pieces)
    if len(ordered) < 2 or ordered[0][0] != 0 or ordered[-1][1] != size:
        return None
    if any(a[1] != b[0] for a, b in zip(ordered, ordered[1:])):  # overlapping or leaving gaps
        return None
    return tuple(stop - start for start, stop in ordered)


_HEAD_VIEWS = RESHAPES | {aten.unflatten}


def heads(linear: fx.Node) -> int | None:
    """The head count a projection's output is viewed into (``view(B, T, heads, head_dim)``
    right after the linear, through dtype casts), or None when it is not."""
    val = linear.meta.get(meta.VAL)
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    features = val.shape[-1]
    stack = list(linear.users)
    while stack:
        user = stack.pop()
        packet = _packet(user)
        if packet in (aten.to, aten._to_copy, aten.contiguous, aten.alias):
            stack.extend(user.users)
            continue
        out = user.meta.get(meta.VAL)
        if packet in _HEAD_VIEWS and isinstance(out, torch.Tensor) and out.dim() == val.dim() + 1:
            if tuple(out.shape[:-2]) == tuple(val.shape[:-1]) and out.shape[-2] * out.shape[-1] == features:
                return int(out.shape[-2])
    return None


def megatron_layout(gm: fx.GraphModule, tp: int | None = None) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """``{get_attr node name: "Shard(0)" | "Shard(1)"}`` for the weights tensor parallelism
    shards, and the fused parts of column weights and biases (``{node name: part sizes}``,
    ``Plan.tp_parts``). With ``tp``, key/value projections with fewer heads than ``tp`` stay
    replicated (see the module docstring)."""
    out: dict[str, str] = {}
    parts: dict[str, tuple[int, ...]] = {}
    columns: dict[fx.Node, frozenset[fx.Node]] = {}  # column linear -> the row linears it feeds
    vocab: dict[str, tuple[fx.Node, str]] = {}  # vocabulary-parallel weight or bias -> (its node, the weight)
    for node in gm.graph.nodes:
        proj = projection(node)
        if proj is None:
            continue
        weight, bias = proj.weight.name, proj.bias.name if proj.bias is not None else None
        layer = node.meta.get(meta.LAYER)
        if layer is None:
            if _feeds_cross_entropy(node):
                out.setdefault(weight, proj.column)  # vocabulary-parallel logits
                vocab[weight] = (proj.weight, weight)
                if bias is not None:
                    out.setdefault(bias, "Shard(0)")
                    vocab[bias] = (proj.bias, weight)
            continue
        if weight in out:
            continue
        rows = _downstream_linears(node, layer)
        if not rows:
            continue
        out[weight] = proj.column
        if bias is not None:
            out[bias] = "Shard(0)"
        columns[node] = frozenset(rows)
        found = fused_parts(node)
        if found is not None:
            parts[weight] = found
            if bias is not None:
                parts[bias] = found
        for row in rows:
            row_proj = projection(row)
            out.setdefault(row_proj.weight.name, row_proj.row)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.embedding.default:
            weight, idx = node.args[0], node.args[1]
            if isinstance(weight, fx.Node) and weight.op == "get_attr" and isinstance(idx, fx.Node) and idx.op == "placeholder":
                out.setdefault(weight.name, "Shard(0)")  # token embedding: vocabulary parallel
                vocab[weight.name] = (weight, weight.name)
    if tp is not None and tp > 1:
        _replicate_kv_heads(columns, parts, out, tp)
        _replicate_indivisible_vocabularies(vocab, out, tp)
    # A weight shared by several linears (tied) must get one placement; column wins over row only
    # when every use is column-compatible, which setdefault above already ensured.
    return out, parts


def _replicate_indivisible_vocabularies(vocab: dict[str, tuple[fx.Node, str]], out: dict[str, str],
                                       tp: int) -> None:
    """Leave replicated a vocabulary (embedding rows, logits features) that ``tp`` does not
    divide: a classifier's 3 labels, GPT-2's 50257 tokens. Every rank then computes the whole
    logits and loss, as one process does; a logits bias goes with its weight, and a tied
    embedding and head are one tensor."""
    indivisible = set()
    for name, (node, weight) in vocab.items():
        val, placement = node.meta.get(meta.VAL), out.get(name)
        if placement is not None and isinstance(val, torch.Tensor) and val.shape[int(placement[6:-1])] % tp:
            indivisible.add(weight)
    for name, (_, weight) in vocab.items():
        if weight in indivisible:
            out.pop(name, None)


def _replicate_kv_heads(columns: dict[fx.Node, frozenset[fx.Node]], parts: dict[str, tuple[int, ...]],
                        out: dict[str, str], tp: int) -> None:
    """Leave the key/value projections with fewer heads than ``tp`` replicated (grouped-query
    attention): their heads do not divide by tp, a sibling's (the query's) do."""
    count = {node: heads(node) for node in columns if projection(node).weight.name not in parts}
    for node, h in count.items():
        if h is None or h % tp == 0:
            continue
        siblings = [other for other in count if other is not node and columns[other] & columns[node]]
        if any(count[other] is not None and count[other] % tp == 0 and count[other] > h for other in siblings):
            for param in (projection(node).weight, projection(node).bias):
                if param is not None:
                    out.pop(param.name, None)
