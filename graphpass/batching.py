"""How a step's inputs split along the batch: each input's batch dim, and the jagged ones.

Every rank of a data-parallel program (and every microbatch) takes an equal share of the
global batch's samples. Most inputs hold one slice per sample along dim 0 (token ids
``[batch, seq]``, images, labels), and cutting them is a ``narrow``. Two kinds do not:

- an input whose samples lie along another dim, e.g. a recommendation model's ids given
  table-major, ``[tables, batch]``, read as ``ids[t]`` per table;
- a *jagged* input: the ids of multi-hot features, where each sample's bag has its own length
  and an ``offsets`` input says where each bag starts (``nn.EmbeddingBag(ids, offsets)``,
  the reference DLRM's ``lS_i`` / ``lS_o``). A share of the samples ``[lo, hi)`` holds the ids
  ``[offsets[lo], offsets[hi])``, and its offsets are rebased to start at 0.

:class:`InputBatch` says this of one input. :func:`infer` finds it by running the model once on
fake tensors and following each input into the lookups it feeds (``embedding``'s indices,
``embedding_bag``'s indices, offsets and per-sample weights), through views, dtype casts and
pointwise ops; it runs only when the inputs' dim 0 sizes disagree (when they agree, dim 0 is
the batch, as it always was). A user declares what inference cannot see with
``graphpass.compile(..., batch_dims=...)``. The plan records the result on each input's
:class:`~graphpass.layout.TensorPlan` (``Shard(dim)`` on the batch axes, and
:class:`~graphpass.layout.Jagged`), and :func:`cut` is the one place that cuts a batch: for
capture, for each rank's share and for each microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import torch.fx as fx
from torch.distributed.tensor.placement_types import Replicate, Shard

from graphpass import meta
from graphpass.layout import Jagged, TensorPlan, placement_to_str


@dataclass(frozen=True)
class InputBatch:
    """How one input splits along the batch.

    Attributes:
        dim: the dim holding the samples (``None``: not split; every rank and microbatch reads
            it whole, like a shared mask).
        offsets: for a jagged input, the index of the input holding its bags' offsets along
            ``dim`` (then ``dim`` is the input's last dim, and the offsets' last dim is their
            batch dim).
        include_last_offset: the offsets hold one more entry, the end of the last bag
            (``nn.EmbeddingBag(include_last_offset=True)``).
        is_offsets: this input holds offsets of some jagged input (a share is rebased to 0).
    """

    dim: int | None = 0
    offsets: int | None = None
    include_last_offset: bool = False
    is_offsets: bool = False


def plain(count: int) -> list[InputBatch]:
    """``count`` inputs, each split along dim 0 (what graphpass assumes without evidence)."""
    return [InputBatch() for _ in range(count)]


def num_samples(value: torch.Tensor, batch: InputBatch) -> int | None:
    """How many samples ``value`` holds (``None`` for an input that is not split or jagged:
    its length counts ids, not samples)."""
    if batch.dim is None or batch.offsets is not None:
        return None
    if value.dim() <= batch.dim:
        return 0
    return value.shape[batch.dim] - (1 if batch.is_offsets and batch.include_last_offset else 0)


def check_divisible(inputs: Sequence[torch.Tensor], batches: Sequence[InputBatch], names: Sequence[str],
                    ways: int, why: str) -> None:
    """Raise unless every split input's samples divide ``ways`` ways.

    Raises:
        ValueError: naming the input, its sample count, ``why`` (the mesh axes or microbatches)
            and what to change.
    """
    if ways == 1:
        return
    for value, batch, name in zip(inputs, batches, names):
        count = num_samples(value, batch)
        if count is None or (count > 0 and count % ways == 0):
            continue
        if value.dim() == 0:
            size = "a 0-dim tensor"
        elif batch.dim == 0 and not batch.is_offsets:
            size = f"batch size {count}"
        else:
            size = f"{count} samples along dim {batch.dim}" + (
                " (offsets, the last one ending the last bag)" if batch.is_offsets and batch.include_last_offset else "")
        raise ValueError(f"input {name!r} has {size}, which does not divide by {why} = {ways}; make the global "
                         f"batch a multiple of {ways}")


def check_offsets(inputs: Sequence[torch.Tensor], batches: Sequence[InputBatch], names: Sequence[str]) -> None:
    """Raise unless every jagged input's offsets fit it as ``nn.EmbeddingBag`` needs: each row
    starting at 0, non-decreasing, none past the ids' length.

    Raises:
        ValueError: naming the offsets, the ids and the first entry at fault.
    """
    for i, batch in enumerate(batches):
        if batch.offsets is None or inputs[batch.offsets].numel() == 0:
            continue
        offsets, name, by = inputs[batch.offsets], names[i], names[batch.offsets]
        total = inputs[i].shape[-1]
        falls = torch.zeros_like(offsets, dtype=torch.bool)
        falls[..., 1:] = offsets[..., 1:] < offsets[..., :-1]
        problems = [(offsets[..., :1] != 0, "a row's first offset is not 0 (the first bag starts at 0)"),
                    (falls, "an offset is smaller than the one before it"),
                    (offsets > total, f"an offset is past the {total} ids")]
        for bad, why in problems:
            if bool(bad.any()):
                at = [int(j) for j in bad.nonzero()[0]]
                raise ValueError(f"input {by!r} does not fit {name!r}: {why} (at {at}); offsets must start at 0, "
                                 f"never decrease and stay within the ids")


def share_counts(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """``total`` samples cut into shares in proportion to ``weights`` (largest remainders: the
    counts sum to ``total``, each within one of its exact share).

    Raises:
        ValueError: a share that would get no sample.
    """
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[:total - sum(counts)]:
        counts[i] += 1
    if min(counts) < 1:
        raise ValueError(f"the batch's {total} samples in shares of {tuple(weights)} leave a share empty "
                         f"({tuple(counts)}); use a larger global batch or less uneven shares")
    return tuple(counts)


def cut(inputs: Sequence[torch.Tensor], batches: Sequence[InputBatch], ways: int, index: int,
        names: Sequence[str] | None = None, counts: Sequence[int] | None = None) -> tuple[torch.Tensor, ...]:
    """Share ``index`` of ``ways`` equal shares of the samples of ``inputs`` (a global batch, a
    rank's share or a microbatch), or of shares of ``counts`` samples each (uneven shares:
    ``Plan.dp_shares``): plain inputs narrowed along their batch dim, jagged ones cut at their
    offsets, offsets rebased to 0, inputs that are not split whole.

    Raises:
        ValueError: samples that do not divide (or do not add up to ``counts``), offsets that
            do not fit their ids, or a table-major jagged input whose rows' shares differ in
            length (naming the input).
    """
    if ways == 1:
        return tuple(inputs)
    names = list(names) if names is not None else [f"input {i}" for i in range(len(inputs))]
    if counts is None:
        check_divisible(inputs, batches, names, ways, "the shares")
    else:
        for value, batch, name in zip(inputs, batches, names):
            count = num_samples(value, batch)
            if count is not None and count != sum(counts):
                raise ValueError(f"input {name!r} has {count} samples, but Plan.dp_shares={tuple(counts)} cuts "
                                 f"{sum(counts)}; give the batch the plan was made for")
    out = list(inputs)
    for i, (value, batch) in enumerate(zip(inputs, batches)):
        if batch.dim is None:
            continue
        if batch.offsets is not None:
            offsets = inputs[batch.offsets]
            out[i] = _cut_jagged(value, offsets, batches[batch.offsets], ways, index, names[i], names[batch.offsets],
                                 counts)
            continue
        count = num_samples(value, batch)
        lo, size = _span(count, ways, index, counts)
        if batch.is_offsets:
            share = value.narrow(batch.dim, lo, size + (1 if batch.include_last_offset else 0))
            out[i] = share - share.narrow(batch.dim, 0, 1)
        else:
            out[i] = value.narrow(batch.dim, lo, size)
    return tuple(out)


def _span(count: int, ways: int, index: int, counts: Sequence[int] | None) -> tuple[int, int]:
    """``(first sample, samples)`` of share ``index``: equal shares, or ``counts``'."""
    if counts is None:
        return index * (count // ways), count // ways
    return sum(counts[:index]), counts[index]


def _cut_jagged(values: torch.Tensor, offsets: torch.Tensor, batch: InputBatch, ways: int, index: int,
                name: str, offsets_name: str, counts: Sequence[int] | None = None) -> torch.Tensor:
    """The ids of samples ``[lo, hi)`` of share ``index``: per row of ``values`` (its leading
    dims, matched by the offsets'), ``[offsets[lo], offsets[hi])``."""
    lo, size = _span(num_samples(offsets, batch), ways, index, counts)
    hi = lo + size
    if offsets.shape[:-1] != values.shape[:-1]:
        raise ValueError(f"input {name!r} (shape {tuple(values.shape)}) is jagged by {offsets_name!r} (shape "
                         f"{tuple(offsets.shape)}): their leading dims must match, one row of offsets per row of ids")
    total = values.shape[-1]
    starts = offsets[..., lo].reshape(-1).tolist()
    ends = (offsets[..., hi].reshape(-1).tolist() if hi < offsets.shape[-1] else [total] * len(starts))
    rows = values.reshape(-1, total)
    lengths = {end - start for start, end in zip(starts, ends)}
    for start, end in zip(starts, ends):
        if not 0 <= start <= end <= total:
            raise ValueError(f"input {offsets_name!r} does not fit {name!r}: a bag runs from {start} to {end}, "
                             f"outside its {total} ids (offsets must be non-decreasing and at most the ids' length)")
    if len(lengths) > 1:
        raise ValueError(f"input {name!r} is jagged by {offsets_name!r} row by row, and this share's samples hold "
                         f"{sorted(lengths)} ids in different rows: a table-major ids tensor cannot hold them; pass "
                         "one ids tensor and one offsets tensor per table")
    pieces = [row[start:end] for row, start in zip(rows, starts)]
    if values.dim() == 1:
        return pieces[0]
    return torch.stack(pieces).reshape(*values.shape[:-1], -1)


# ---------------------------------------------------------------------- finding the batch


def needs_inference(inputs: Sequence[torch.Tensor]) -> bool:
    """Whether dim 0 may not be every input's batch: the inputs' dim 0 sizes disagree."""
    return len({t.shape[0] if t.dim() else None for t in inputs}) > 1


@dataclass
class _Origin:
    """Where a tensor of the run came from: input ``index``, each of its dims the input's dim
    (or None), and whether its values are the input's (views and casts) or computed from them
    elementwise."""

    index: int
    dims: tuple[int | None, ...]
    exact: bool


_COPIES = {"alias", "detach", "clone", "_to_copy", "contiguous", "lift_fresh", "lift_fresh_copy", "_unsafe_view",
           "view", "reshape", "_reshape_alias", "expand", "squeeze", "unsqueeze", "select", "slice", "transpose",
           "t", "permute", "flatten", "view_as"}
_PIECES = {"unbind", "split", "split_with_sizes", "unsafe_split", "chunk", "tensor_split"}
_COPIES |= _PIECES
_BAGS = {"_embedding_bag", "_embedding_bag_forward_only", "embedding_bag"}


class _Lookups(TorchDispatchMode):
    """Follows the inputs through one fake run and records what each embedding lookup reads."""

    def __init__(self, inputs: Sequence[torch.Tensor]):
        super().__init__()
        self._origins: dict[int, tuple[torch.Tensor, _Origin]] = {
            id(t): (t, _Origin(i, tuple(range(t.dim())), True)) for i, t in enumerate(inputs)}
        self.batch_dims: dict[int, set[int]] = {}
        self.jagged: dict[int, set[tuple[int, int, bool]]] = {}  # values -> {(offsets, offsets dim, last)}

    def origin(self, value: Any) -> _Origin | None:
        entry = self._origins.get(id(value)) if isinstance(value, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is value else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "embedding":
            self._lookup(args[1])
        elif name in _BAGS:
            self._bag(*args[1:3], args[6] if len(args) > 6 else kwargs.get("per_sample_weights"),
                      bool(args[7]) if len(args) > 7 else bool(kwargs.get("include_last_offset", False)))
        if isinstance(out, torch.Tensor):
            self._follow(func, name, args, out)
        elif isinstance(out, (tuple, list)) and name in _PIECES:
            for piece in out:
                self._follow(func, name, args, piece)
        return out

    def _follow(self, func, name: str, args: Sequence[Any], out: torch.Tensor) -> None:
        sources = [(a, self.origin(a)) for a in args if self.origin(a) is not None]
        if len(sources) != 1 or not isinstance(out, torch.Tensor):
            return
        source, origin = sources[0]
        dims = _dims_through(name, args, source, out, origin.dims)
        if dims is None and torch.Tag.pointwise in func.tags and out.shape == source.shape:
            dims, exact = origin.dims, False
        else:
            exact = origin.exact and name in _COPIES
        if dims is not None:
            self._origins[id(out)] = (out, _Origin(origin.index, dims, exact))

    def _lookup(self, indices: Any) -> None:
        origin = self.origin(indices)
        if origin is not None and origin.dims and origin.dims[0] is not None:
            self.batch_dims.setdefault(origin.index, set()).add(origin.dims[0])

    def _bag(self, indices: Any, offsets: Any, weights: Any, include_last: bool) -> None:
        ids, at = self.origin(indices), self.origin(offsets)
        if ids is None or not ids.dims or ids.dims[0] is None:
            return
        if at is None or not at.exact or not at.dims or at.dims[0] is None:
            if offsets is None or self.origin(offsets) is None:  # fixed-size bags, [batch, hots] flattened
                self.batch_dims.setdefault(ids.index, set()).add(ids.dims[0])
            return
        for values in (ids, self.origin(weights)):
            if values is not None and values.dims and values.dims[0] is not None:
                self.jagged.setdefault(values.index, set()).add((at.index, at.dims[0], include_last))
                self.batch_dims.setdefault(values.index, set()).add(values.dims[0])
        self.batch_dims.setdefault(at.index, set()).add(at.dims[0])


def _dims_through(name: str, args: Sequence[Any], source: torch.Tensor, out: torch.Tensor,
                  dims: tuple[int | None, ...]) -> tuple[int | None, ...] | None:
    """The input dims of ``out``'s dims for the view and copy ops, or None for other ops."""
    if name in ("alias", "detach", "clone", "_to_copy", "contiguous", "lift_fresh", "lift_fresh_copy", "slice",
                "view_as", "expand") and out.dim() == source.dim():
        return dims
    if name in _PIECES:
        if out.dim() == source.dim():
            return dims
        name = "select"  # unbind: each piece is a select
    if name == "select":
        d = (args[1] if len(args) > 1 else 0) % source.dim()
        return dims[:d] + dims[d + 1:]
    if name == "unsqueeze":
        d = args[1] % out.dim()
        return dims[:d] + (None,) + dims[d:]
    if name in ("transpose", "t"):
        a, b = (0, 1) if name == "t" else (args[1] % source.dim(), args[2] % source.dim())
        moved = list(dims)
        moved[a], moved[b] = moved[b], moved[a]
        return tuple(moved)
    if name == "permute":
        return tuple(dims[d % source.dim()] for d in args[1])
    if name in ("view", "_unsafe_view", "reshape", "_reshape_alias", "squeeze", "flatten"):
        return _reshaped(tuple(source.shape), tuple(out.shape), dims)
    return None


def _reshaped(before: tuple[int, ...], after: tuple[int, ...], dims: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """A reshape's dims: where a run of dims becomes another run of the same size, the new run's
    first dim is the old run's first (a batch cut along it stays a cut of whole samples)."""
    out: list[int | None] = []
    i = j = 0
    while i < len(before) or j < len(after):
        a0, b0 = i, j
        na = before[i] if i < len(before) else 1
        nb = after[j] if j < len(after) else 1
        i, j = min(i + 1, len(before)), min(j + 1, len(after))
        while na != nb:
            if na < nb and i < len(before):
                na *= before[i]
                i += 1
            elif j < len(after):
                nb *= after[j]
                j += 1
            else:
                break
        if b0 < len(after):
            out.append(dims[a0] if a0 < len(before) else None)
            out.extend([None] * (j - b0 - 1))
    return tuple(out[:len(after)])


def infer(model: nn.Module, inputs: Sequence[torch.Tensor]) -> list[InputBatch]:
    """Each input's :class:`InputBatch`, from one run of ``model`` on fake copies of ``inputs``
    (the global batch): the dims that embedding lookups read as samples, and which inputs are
    jagged by which offsets. An input without evidence, or with evidence that disagrees, keeps
    dim 0."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [mode.from_tensor(t).to(device) if t.device != device and device.type == "meta" else mode.from_tensor(t)
                 for t in inputs]
    recorder = _Lookups(fakes)
    with mode, recorder, torch.no_grad():
        model(*fakes)
    out = plain(len(inputs))
    for index, found in recorder.batch_dims.items():
        if len(found) == 1:
            out[index] = InputBatch(dim=found.pop())
    offsets_of: dict[int, bool] = {}
    for index, relations in recorder.jagged.items():
        if len(relations) != 1:
            continue
        at, at_dim, last = next(iter(relations))
        if inputs[index].dim() - 1 != out[index].dim or inputs[at].dim() - 1 != at_dim or index == at:
            continue  # a jagged cut runs along both tensors' last dims
        out[index] = InputBatch(dim=out[index].dim, offsets=at, include_last_offset=last)
        offsets_of[at] = offsets_of.get(at, last) and last
    for at, last in offsets_of.items():
        out[at] = InputBatch(dim=inputs[at].dim() - 1, include_last_offset=last, is_offsets=True)
    return out


def resolve(model: nn.Module, inputs: Sequence[torch.Tensor], keys: Sequence[str] | None,
            declared: Mapping[Any, Any] | None) -> list[InputBatch]:
    """Each input's :class:`InputBatch`: what ``declared`` says (``compile(batch_dims=...)``,
    keyed by the batch's keys or positions: a dim, ``None`` for an input read whole, or a
    :class:`~graphpass.layout.Jagged`), else inferred (:func:`infer`), else dim 0.

    Raises:
        ValueError/TypeError: a declaration naming no input, a dim out of range, offsets that
            are not an input.
    """
    positions = {key: i for i, key in enumerate(keys)} if keys is not None else {}
    declared = dict(declared or {})

    def position(key: Any, field: str) -> int:
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(inputs) and keys is None:
            return key
        if key in positions:
            return positions[key]
        known = list(keys) if keys is not None else list(range(len(inputs)))
        raise ValueError(f"{field}: {key!r} is not an input; the inputs are {known}")

    wanted: dict[int, Any] = {}
    for key, value in declared.items():
        wanted[position(key, f"batch_dims[{key!r}]")] = value
    guess = needs_inference(inputs) and len(wanted) < len(inputs)
    out = infer(model, inputs) if guess else plain(len(inputs))
    for index, value in sorted(wanted.items(), key=lambda item: isinstance(item[1], Jagged)):
        field = f"batch_dims[{(keys[index] if keys is not None else index)!r}]"
        t = inputs[index]
        if value is None:
            out[index] = InputBatch(dim=None)
        elif isinstance(value, Jagged):
            at = position(value.offsets, f"{field}.offsets")
            if at == index or t.dim() == 0 or inputs[at].dim() == 0:
                raise ValueError(f"{field}: a jagged input and its offsets are two tensors of at least one dim")
            out[index] = InputBatch(dim=t.dim() - 1, offsets=at, include_last_offset=value.include_last_offset)
            out[at] = InputBatch(dim=inputs[at].dim() - 1, include_last_offset=value.include_last_offset,
                                 is_offsets=True)
        elif isinstance(value, int) and not isinstance(value, bool):
            if not -t.dim() <= value < t.dim():
                raise ValueError(f"{field}: dim {value} of a {t.dim()}-D input; use 0..{t.dim() - 1}")
            out[index] = InputBatch(dim=value % t.dim())
        else:
            raise TypeError(f"{field} must be a dim (int), None (not split) or graphpass.Jagged(offsets=...), "
                            f"got {value!r}")
    return out


def declaration(batches: Sequence[InputBatch]) -> dict[int, Any]:
    """``batches`` as a positional ``batch_dims`` declaration (what :func:`resolve` turns back
    into the same list without running the model)."""
    out: dict[int, Any] = {}
    for i, batch in enumerate(batches):
        out[i] = Jagged(batch.offsets, batch.include_last_offset) if batch.offsets is not None else batch.dim
    return out


def samples(inputs: Sequence[torch.Tensor], batches: Sequence[InputBatch]) -> int:
    """The global batch's sample count: the first count an input gives (1 when none does)."""
    for value, batch in zip(inputs, batches):
        count = num_samples(value, batch)
        if count:
            return count
    return 1



# ---------------------------------------------------------------------- in the graph and the plan


def annotate(gm: fx.GraphModule, batches: Sequence[InputBatch]) -> None:
    """Record each input's :class:`InputBatch` on its placeholder (``gp.batch``)."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(batches):
        raise AssertionError(f"{len(batches)} inputs' batching for a graph of {len(inputs)} inputs")
    for node, batch in zip(inputs, batches):
        node.meta[meta.BATCH] = batch


def input_plan(node: fx.Node, inputs: Sequence[str]) -> TensorPlan:
    """An input's plan entry: ``Shard(d)`` on ``dp`` along its batch dim (``gp.batch``; dim 0
    where compile recorded nothing), ``Replicate()`` for an input every rank reads whole, and the
    offsets (by input name) a jagged input is cut at."""
    batch = node.meta.get(meta.BATCH, InputBatch())
    if batch.dim is None:
        return TensorPlan({"dp": Replicate()})
    jagged = Jagged(inputs[batch.offsets], batch.include_last_offset) if batch.offsets is not None else None
    return TensorPlan({"dp": Shard(batch.dim)}, jagged=jagged)


def describe(node: fx.Node) -> str:
    """How input ``node`` splits, in words, for errors: "holds its samples along dim 1"."""
    batch = node.meta.get(meta.BATCH, InputBatch())
    if batch.dim is None:
        return "is read whole by every rank (batch_dims=None)"
    if batch.offsets is not None:
        offsets = [n.name for n in node.graph.nodes if n.op == "placeholder"][batch.offsets]
        return f"is jagged along its last dim (dim {batch.dim}), cut at the offsets in {offsets!r}"
    return f"holds its samples along dim {batch.dim}" + (" (offsets of a jagged input)" if batch.is_offsets else "")


def of_plan(plan, input_names: Sequence[str]) -> list[InputBatch]:
    """Each input's :class:`InputBatch` as ``plan`` places it: the dim of its ``Shard`` on a
    batch axis (``None`` where it is replicated on every axis), and its
    :class:`~graphpass.layout.Jagged`."""
    position = {name: i for i, name in enumerate(input_names)}
    out = []
    for name in input_names:
        entry = plan.tensor(name)
        dims = {p.dim for p in entry.placements.values() if isinstance(p, Shard)}
        dim = dims.pop() if len(dims) == 1 else (0 if dims else None)
        jagged = entry.jagged
        offsets = position.get(jagged.offsets) if jagged is not None else None
        out.append(InputBatch(dim=dim, offsets=offsets,
                              include_last_offset=bool(jagged and jagged.include_last_offset)))
    for batch in list(out):
        if batch.offsets is not None:
            held = out[batch.offsets]
            out[batch.offsets] = InputBatch(dim=held.dim, include_last_offset=batch.include_last_offset,
                                            is_offsets=True)
    return out


def problems(plan, inputs: list[fx.Node]) -> list[str]:
    """Inputs split the way compile captures them: along their batch dim over ``dp`` when the
    batch is split (``dp * microbatches > 1``; capture takes one microbatch of a rank's share of
    every input, :mod:`graphpass.batching`), jagged ones at their offsets, replicated on the
    other axes."""
    out = []
    for node in inputs:
        for axis, p in plan.tensor(node.name).placements.items():
            text = placement_to_str(p)
            if axis != "dp" and p != Replicate():
                out.append(
                    f"Plan.placements[{node.name!r}][{axis!r}]: {text} on input {node.name!r}; graphpass splits inputs "
                    f"only along their batch dim over dp, and every {axis} rank reads its dp share whole: use "
                    "Replicate()")
    dp, k = plan.mesh.dp, plan.microbatches
    on_dp = {n.name: plan.placement(n.name, "dp") for n in inputs}
    wanted = {n.name: input_plan(n, [i.name for i in inputs]) for n in inputs}
    if dp * k == 1:
        out += [f"Plan.placements[{name!r}]['dp']: {placement_to_str(p)} on an input; inputs are split along "
                     f"their batch dim ({placement_to_str(wanted[name].placement('dp'))}) or not at all (Replicate())"
                     for name, p in on_dp.items() if p not in (wanted[name].placement("dp"), Replicate())]
        return out
    why = "the batch is split " + " and ".join(
        ([f"over dp={dp}"] if dp > 1 else []) + ([f"into Plan.microbatches={k}"] if k > 1 else []))
    axis = "" if "dp" in plan.mesh else " (and give Plan.mesh a 'dp' axis, of size 1 if need be)"
    for node in inputs:
        p, want = on_dp[node.name], wanted[node.name]
        given = (f"Plan.placements[{node.name!r}] has no 'dp' entry, so input {node.name!r} is Replicate()"
                 if "dp" not in plan.placements.get(node.name, {})
                 else f"Plan.placements[{node.name!r}]['dp']: {placement_to_str(p)} on input {node.name!r}")
        if p != want.placement("dp"):
            out.append(
                f"{given}, but {why}: compile captures every input at its share of the batch, and "
                f"{node.name!r} {describe(node)}; use {node.name!r}: "
                f"{{'dp': '{placement_to_str(want.placement('dp'))}'}}{axis}")
        elif plan.tensor(node.name).jagged != want.jagged:
            out.append(
                f"Plan.tensors[{node.name!r}].jagged: {plan.tensor(node.name).jagged}, but {node.name!r} "
                f"{describe(node)}; use jagged={want.jagged}")
    return out
