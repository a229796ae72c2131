"""A tensor's layout: what the plan says of a tensor, and where a rank's tensor sits in the full one.

A plan holds one :class:`TensorPlan` per input, parameter, buffer and the loss
(``Plan.tensors``): its placement on each mesh axis, ZeRO stage, fused parts, operator
:class:`Split` and memory tier; and one :class:`ActivationPlan` per repeated layer's saved
activations (``Plan.activations``: recomputed or saved, and where). The passes turn a
parameter's entry into the cuts below.

Every parameter and buffer a pass shards carries one :class:`TensorLayout` in
``node.meta[gp.layout]`` (:data:`graphpass.meta.LAYOUT`). It says, in torch's words
(``torch.distributed.tensor``'s ``Shard`` / ``Replicate``), how the full tensor of the original
``state_dict`` entry is cut on each mesh axis, plus what DTensor has no word for:

- the fused parts of a tensor-parallel shard (q, k and v of one projection: each part is chunked
  on its own, so rank r holds chunk r of each);
- an operator split's slice (OSDP): every rank holds slice ``index`` of ``parts`` along ``dim``
  as a parameter of its own;
- the ZeRO stage of a data-parallel ``Shard(0)``: the stored tensor (what the optimizer steps, so
  its state too) is always the shard; stages 1 and 2 gather the compute copy once per step and
  stage 3 around each use; stage 1 all-reduces the gradient, stages 2 and 3 reduce-scatter it
  (:mod:`graphpass.runtime.zero`);
- the buffer naming the expert each slot holds, for experts that dynamic placement moves;
- where the parameter's parts live between uses (:class:`Tiers`: its compute copy, gradient and
  optimizer state on the device, in host memory or on disk: offload).

The cuts compose from the full tensor inwards in one order, the order of :meth:`TensorLayout.cuts`:
the slice, then the tensor- or expert-parallel ``Shard(d)``, then ZeRO's ``Shard(0)`` of what is
left: rows ``[r*c, (r+1)*c)`` with ``c = ceil(rows / N)``, the last shards padded with zero rows
(FSDP2's layout; the same rows as DTensor's ``Shard(0)``, stored padded). Everything that composes
shards reads that order from here: :mod:`graphpass.runtime.layout` (a rank's pieces and the
gathers of ``full_state_dict``), the collectives pass (which shape a ZeRO gather rebuilds) and
checkpoints.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from graphpass.tables import TableSharding

#: The memory tiers a stored tensor can live in: the accelerator's memory, the host's (pinned
#: on a GPU) and files on disk.
TIERS = ("device", "host", "disk")
#: The tiers of each part of a parameter (:class:`Tiers`): the compute copy and the gradient
#: stream through host memory; the master copy and optimizer state may also live on disk.
PART_TIERS = {"parameter": ("device", "host"), "gradient": ("device", "host"), "optimizer": TIERS}
#: The tiers a layer's saved activations may live in.
ACTIVATION_TIERS = ("device", "host")


@dataclass(frozen=True)
class Tiers:
    """Where the parts of one parameter live (offload; the memory-tier part of its layout).

    Attributes:
        parameter: the compute copy. ``"device"``: resident for the whole run; ``"host"``: it
            streams in ahead of each use (a window of layers, ``Plan.offload_window``) and is
            dropped after, forward and backward (STRONGHOLD).
        gradient: ``"device"``: gradients accumulate on the device over the step's
            microbatches and go down to the host once, after the step's last backward;
            ``"host"``: each backward's gradient goes down as it lands, and accumulates there.
        optimizer: the master copy and the optimizer state, and so where the optimizer steps:
            ``"device"``, ``"host"`` (ZeRO-Offload) or ``"disk"`` (pages in files).

    The host (or disk) keeps the master copy whenever a part is off the device, so a
    parameter or gradient off the device needs the optimizer off it too.
    """

    parameter: str = "device"
    gradient: str = "device"
    optimizer: str = "device"

    def __post_init__(self) -> None:
        for part, allowed in PART_TIERS.items():
            value = getattr(self, part)
            if value not in allowed:
                extra = (" (disk holds the master copy and optimizer state: Tiers(optimizer='disk'))"
                         if value == "disk" else "")
                raise ValueError(f"Tiers.{part} must be one of {allowed}, got {value!r}{extra}")
        if self.optimizer == "device":
            for part in ("parameter", "gradient"):
                if getattr(self, part) != "device":
                    raise ValueError(
                        f"Tiers.{part}={getattr(self, part)!r} needs the optimizer off the device too: the host keeps "
                        f"the master copy the optimizer steps, and the {part} streams from or to it; use "
                        f"Tiers({part}={getattr(self, part)!r}, optimizer='host')")

    @property
    def offloaded(self) -> bool:
        """Whether any part lives off the device."""
        return self != Tiers()

    def to_json(self) -> dict[str, str]:
        """The parts off the device (an empty dict for a tensor on the device)."""
        return {part: getattr(self, part) for part in PART_TIERS if getattr(self, part) != "device"}

    @classmethod
    def from_json(cls, data: Any) -> "Tiers":
        """From :meth:`to_json`'s dict, or ``"device"`` (a plan written before offload)."""
        if data == "device":
            return cls()
        if not isinstance(data, Mapping) or set(data) - set(PART_TIERS):
            raise ValueError(f"tiers must map some of {tuple(PART_TIERS)} to a tier, got {data!r}")
        return cls(**data)

    def __str__(self) -> str:
        return ", ".join(f"{part} on {tier}" for part, tier in self.to_json().items()) or "on device"


@dataclass(frozen=True)
class Slice:
    """Slice ``index`` of ``parts`` of an operator split (OSDP) along ``dim``: rows
    ``[start, start + size)`` of the full tensor, cut from the ``get_attr`` node ``source``
    (attribute ``target``) that stood for the original ``state_keys``."""

    dim: int
    start: int
    size: int
    index: int
    parts: int
    source: str
    target: str
    state_keys: tuple[str, ...]


@dataclass(frozen=True)
class Cut:
    """One step of a layout, as :meth:`TensorLayout.cuts` yields them: ``placement`` on ``axis``
    (``size`` ranks) applied to a tensor of shape ``shape``; ``parts`` for fused parts, ``zero``
    the ZeRO stage of a padded data-parallel shard (0 otherwise)."""

    axis: str
    placement: Shard
    size: int
    shape: tuple[int, ...]
    parts: tuple[int, ...] = ()
    zero: int = 0
    rows: bool = False

    @property
    def dim(self) -> int:
        return self.placement.dim

    @property
    def padded(self) -> bool:
        """Whether the cut takes padded dim-0 rows (ZeRO's, or a row-wise embedding table's)
        rather than chunks."""
        return bool(self.zero) or self.rows

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape of each rank's piece: chunked (per part), or padded rows."""
        out = list(self.shape)
        if self.padded:
            out[0] = shard_rows(self.shape[0], self.size)
        else:
            out[self.dim] = sum(n // self.size for n in (self.parts or (self.shape[self.dim],)))
        return tuple(out)


def shard_rows(rows: int, num_shards: int) -> int:
    """Rows of each ZeRO shard: ``ceil(rows / num_shards)`` (at least 1)."""
    return max(1, math.ceil(rows / num_shards))


@dataclass(frozen=True)
class TensorLayout:
    """Where a rank's stored tensor sits in the full tensor of shape ``shape``.

    ``placements`` holds the axes the tensor is sharded on, ``(axis, Shard(d))`` in the order the
    cuts apply (every other axis: ``Replicate()``); ``sizes`` the ranks on each of those axes.
    With ``zero`` > 0 the last placement is ZeRO's ``Shard(0)``; with ``rows`` it is a row-wise
    embedding table's padded ``Shard(0)`` (the same rows, without ZeRO's gathers). ``owner``:
    ``(axis, rank)`` when only that rank of the axis holds the tensor (a table-wise embedding
    table; the others hold no rows of it); with ``rows`` too, the padded rows are cut among the
    ``size`` ranks of the axis from ``rank`` on and the others hold none (a table-row-wise table). Build one with :meth:`whole` and the ``with_*``
    methods (passes add their cut to what earlier passes made).
    """

    shape: tuple[int, ...]
    placements: tuple[tuple[str, Placement], ...] = ()
    sizes: tuple[tuple[str, int], ...] = ()
    parts: tuple[int, ...] = ()
    zero: int = 0
    slice: Slice | None = None
    experts: str | None = None
    tiers: Tiers = Tiers()
    rows: bool = False
    owner: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if self.rows and (self.zero or not self.placements or self.placements[-1][1] != Shard(0)):
            raise ValueError(f"TensorLayout: padded table rows need their Shard(0) as the last cut and no ZeRO, "
                             f"got {self.placements} with zero={self.zero}")
        if len(self.placements) != len(self.sizes) or any(a != b for (a, _), (b, _) in zip(self.placements, self.sizes)):
            raise ValueError(f"TensorLayout: placements {self.placements} and sizes {self.sizes} name different axes")
        for axis, placement in self.placements:
            if not isinstance(placement, Shard):
                raise ValueError(f"TensorLayout: a stored tensor is Shard(d) or Replicate() on each axis; "
                                 f"got {placement} on {axis!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"TensorLayout.zero must be 0-3, got {self.zero!r}")
        if self.zero and (not self.placements or self.placements[-1][1] != Shard(0)):
            raise ValueError(f"TensorLayout: ZeRO stage {self.zero} needs its Shard(0) as the last cut, "
                             f"got {self.placements}")
        if not isinstance(self.tiers, Tiers):
            raise ValueError(f"TensorLayout.tiers must be a Tiers, got {self.tiers!r}")

    @classmethod
    def whole(cls, shape) -> "TensorLayout":
        """The layout of a tensor every rank holds whole."""
        return cls(tuple(shape))

    # ------------------------------------------------------------------ reading

    def placement(self, axis: str) -> Placement:
        """The placement on ``axis``: ``Shard(d)`` or ``Replicate()``."""
        return dict(self.placements).get(axis, Replicate())

    def axis_size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    @property
    def zero_axis(self) -> str | None:
        """The axis ZeRO shards the tensor on (None without ZeRO)."""
        return self.placements[-1][0] if self.zero else None

    @property
    def sharded(self) -> bool:
        """Whether the rank holds less than the whole tensor."""
        return bool(self.placements) or self.slice is not None or self.owner is not None

    def cuts(self) -> Iterator[Cut]:
        """The placements in the order they apply from the full tensor (after the slice) inwards,
        each with the shape of the tensor it cuts. The one place that order is written."""
        shape = self.sliced_shape
        for i, ((axis, placement), (_, size)) in enumerate(zip(self.placements, self.sizes)):
            last = i == len(self.placements) - 1
            zero = self.zero if last else 0
            cut = Cut(axis, placement, size, shape, () if zero else self.parts, zero, rows=self.rows and last)
            yield cut
            shape = cut.out_shape

    @property
    def sliced_shape(self) -> tuple[int, ...]:
        """The shape of the slice (the full shape without a split)."""
        if self.slice is None:
            return self.shape
        out = list(self.shape)
        out[self.slice.dim] = self.slice.size
        return tuple(out)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor the rank stores."""
        shape = self.sliced_shape
        for cut in self.cuts():
            shape = cut.out_shape
        return shape

    def shape_on(self, axis: str) -> tuple[int, ...]:
        """The shape of the tensor the cut on ``axis`` takes chunks of (what gathering over
        ``axis`` rebuilds)."""
        for cut in self.cuts():
            if cut.axis == axis:
                return cut.shape
        raise KeyError(f"{self} is not sharded on {axis!r}")

    # ------------------------------------------------------------------ building

    def with_shard(self, axis: str, dim: int, size: int, parts=()) -> "TensorLayout":
        """This layout, then a chunk of ``dim`` over ``size`` ranks on ``axis`` (of each fused part)."""
        if self.zero:
            raise ValueError(f"{self}: a Shard({dim}) on {axis!r} cannot follow ZeRO's shard (ZeRO shards last)")
        if parts and self.parts:
            raise ValueError(f"{self}: fused parts on two axes")
        return replace(self, placements=(*self.placements, (axis, Shard(dim))), sizes=(*self.sizes, (axis, size)),
                       parts=tuple(int(n) for n in parts) or self.parts)

    def with_zero(self, axis: str, size: int, stage: int) -> "TensorLayout":
        """This layout, then ZeRO-``stage``'s padded ``Shard(0)`` over ``size`` ranks on ``axis``."""
        if self.zero:
            raise ValueError(f"{self}: already ZeRO-sharded")
        return replace(self, placements=(*self.placements, (axis, Shard(0))), sizes=(*self.sizes, (axis, size)),
                       zero=stage)

    def with_rows(self, axis: str, size: int) -> "TensorLayout":
        """This layout, then a row-wise embedding table's padded ``Shard(0)`` over ``size``
        ranks on ``axis`` (ZeRO's rows, stored without its gathers)."""
        if self.zero or self.rows:
            raise ValueError(f"{self}: already cut into padded rows")
        return replace(self, placements=(*self.placements, (axis, Shard(0))), sizes=(*self.sizes, (axis, size)),
                       rows=True)

    def with_owner(self, axis: str, rank: int) -> "TensorLayout":
        """This layout, held by rank ``rank`` of ``axis`` alone (a table-wise embedding table),
        or after :meth:`with_rows` on ``axis``, by the ranks from ``rank`` on (table-row-wise)."""
        return replace(self, owner=(axis, int(rank)))

    def with_slice(self, slice_: Slice) -> "TensorLayout":
        """This (whole) layout's slice ``slice_``."""
        if self.sharded:
            raise ValueError(f"{self}: only a whole tensor is split into slices")
        return replace(self, slice=slice_)

    def with_experts(self, buffer: str) -> "TensorLayout":
        """This layout with its slots' experts named by ``buffer`` (dynamic expert placement)."""
        return replace(self, experts=buffer)

    def with_tiers(self, tiers: Tiers) -> "TensorLayout":
        """This layout with its parts in ``tiers`` (offload)."""
        return replace(self, tiers=tiers)

    # ------------------------------------------------------------------ text

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict; placements as torch's strings (``"Shard(0)"``)."""
        out: dict[str, Any] = {"shape": list(self.shape),
                               "placements": {a: placement_to_str(p) for a, p in self.placements},
                               "sizes": dict(self.sizes)}
        if self.parts:
            out["parts"] = list(self.parts)
        if self.zero:
            out["zero"] = self.zero
        if self.slice is not None:
            out["slice"] = {**self.slice.__dict__, "state_keys": list(self.slice.state_keys)}
        if self.experts is not None:
            out["experts"] = self.experts
        if self.tiers.offloaded:
            out["tiers"] = self.tiers.to_json()
        if self.rows:
            out["rows"] = True
        if self.owner is not None:
            out["owner"] = list(self.owner)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TensorLayout":
        slice_ = data.get("slice")
        owner = data.get("owner")
        return cls(
            tuple(data["shape"]),
            tuple((a, parse_shard(p, a)) for a, p in data.get("placements", {}).items()),
            tuple(data.get("sizes", {}).items()),
            tuple(data.get("parts", ())),
            data.get("zero", 0),
            None if slice_ is None else Slice(**{**slice_, "state_keys": tuple(slice_["state_keys"])}),
            data.get("experts"),
            Tiers.from_json(data.get("tiers", "device")),
            bool(data.get("rows", False)),
            None if owner is None else (owner[0], int(owner[1])),
        )

    def __str__(self) -> str:
        cuts = []
        for cut in self.cuts():
            text = f"{cut.axis}={placement_to_str(cut.placement)}/{cut.size}"
            if cut.parts:
                text += f" parts {list(cut.parts)}"
            if cut.zero:
                text += f" zero-{cut.zero}"
            if cut.rows:
                text += " padded rows"
            cuts.append(text)
        if self.owner is not None and self.rows:
            axis, first = self.owner
            cuts.append(f"held by {axis} ranks {first}..{first + self.axis_size(axis) - 1}")
        elif self.owner is not None:
            cuts.append(f"held by {self.owner[0]} rank {self.owner[1]}")
        if self.slice is not None:
            cuts.insert(0, f"slice {self.slice.index}/{self.slice.parts} of dim {self.slice.dim}")
        if self.experts is not None:
            cuts.append(f"experts by {self.experts}")
        if self.tiers.offloaded:
            cuts.append(str(self.tiers))
        return f"TensorLayout({list(self.shape)}{', ' if cuts else ''}{', '.join(cuts)})"


# ---------------------------------------------------------------------- what the plan says


@dataclass(frozen=True)
class Split:
    """An operator split (OSDP) of the linear a weight feeds: ``parts`` slices along its
    ``"out"`` (output features: the weight's rows, and the bias with them) or ``"in"`` (input
    features: the weight's columns) dim, each slice a parameter of its own."""

    dim: str
    parts: int

    def to_json(self) -> dict[str, Any]:
        return {"dim": self.dim, "parts": self.parts}


@dataclass(frozen=True)
class Jagged:
    """An input whose samples are bags of different lengths (the ids of a multi-hot feature):
    a share of the samples ``[lo, hi)`` holds the entries ``[offsets[lo], offsets[hi])`` along
    the input's last dim, where ``offsets`` is another input (its last dim holds one entry per
    sample: where the sample's bag starts, as ``nn.EmbeddingBag`` takes them).

    Attributes:
        offsets: the offsets input: its name in a plan; in ``graphpass.compile(batch_dims=)``
            the batch's key, or position for a tuple batch.
        include_last_offset: the offsets hold one more entry, the end of the last bag.
    """

    offsets: str | int
    include_last_offset: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"offsets": self.offsets, "include_last_offset": self.include_last_offset}


@dataclass(frozen=True)
class TensorPlan:
    """What a plan says of one tensor (an input, a parameter or buffer, the loss): the one value
    ``Plan.tensors`` holds per tensor, from which the passes make each rank's
    :class:`TensorLayout`.

    Attributes:
        placements: a torch placement per mesh axis (an axis not named: ``Replicate()``).
        zero: the ZeRO stage (1, 2, 3) of a parameter inside ``dp`` (0: plain data parallel);
            its optimizer state is sharded from stage 1, its gradient from stage 2, the
            parameter itself between uses at stage 3.
        parts: for a weight (or bias) column-parallel on ``tp`` whose projection makes several
            outputs at once (q, k and v): the sizes of its parts along the sharded dim, each
            sharded on its own.
        split: the operator split of the linear this weight feeds (OSDP), or None.
        tiers: where a parameter's compute copy, gradient and optimizer state live
            (:class:`Tiers`; every other tensor stays on the device).
        jagged: for an input whose batch ``Shard`` is cut at another input's offsets (the
            ids of a multi-hot feature), that input (:class:`Jagged`).
        table: for an embedding table, how the plan shards it over ``dp``
            (:class:`graphpass.tables.TableSharding`; its gradient is then sparse). Its
            placement on ``dp`` says the same in torch's words where torch has them: row-wise
            ``Shard(0)``, column-wise ``Shard(1)``, data-parallel and table-wise
            ``Replicate()``.
    """

    placements: Mapping[str, Placement] = field(default_factory=dict)
    zero: int = 0
    parts: tuple[int, ...] = ()
    split: Split | None = None
    tiers: Tiers = Tiers()
    jagged: Jagged | None = None
    table: TableSharding | None = None

    def placement(self, axis: str) -> Placement:
        """The placement on ``axis`` (``Replicate()`` where none is named)."""
        return self.placements.get(axis, Replicate())

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict, defaults left out; placements as torch's strings."""
        out: dict[str, Any] = {}
        if self.placements:
            out["placements"] = {a: placement_to_str(p) for a, p in self.placements.items()}
        if self.zero:
            out["zero"] = self.zero
        if self.parts:
            out["parts"] = list(self.parts)
        if self.split is not None:
            out["split"] = self.split.to_json()
        if self.tiers.offloaded:
            out["tiers"] = self.tiers.to_json()
        if self.jagged is not None:
            out["jagged"] = self.jagged.to_json()
        if self.table is not None:
            out["table"] = self.table.to_json()
        return out


@dataclass(frozen=True)
class ActivationPlan:
    """What a plan says of one repeated layer's saved activations (the tensors its forward keeps
    for backward), the one value ``Plan.activations`` holds per layer.

    Attributes:
        recompute: recomputed in backward from the layer's input instead of saved (activation
            checkpointing).
        tier: the memory tier they are saved in (:data:`ACTIVATION_TIERS`): ``"host"`` copies
            each saved tensor to host memory when autograd saves it and back ahead of its
            backward use.
    """

    recompute: bool = False
    tier: str = "device"

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict, defaults left out."""
        out: dict[str, Any] = {}
        if self.recompute:
            out["recompute"] = True
        if self.tier != "device":
            out["tier"] = self.tier
        return out


def placement_from_str(text: str) -> Placement:
    """Parse ``"Shard(0)"``, ``"Replicate()"`` or ``"Partial()"`` (also ``"Partial(avg)"``)."""
    text = text.strip()
    if text == "Replicate()":
        return Replicate()
    match = re.fullmatch(r"Shard\((?:dim=)?(-?\d+)\)", text)
    if match:
        return Shard(int(match.group(1)))
    match = re.fullmatch(r"Partial\((\w*)\)", text)
    if match:
        return Partial(match.group(1) or "sum")
    raise ValueError(f"unknown placement {text!r}; expected Shard(dim), Replicate() or Partial()")


def placement_to_str(placement: Placement) -> str:
    """The JSON spelling of a torch placement."""
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    if isinstance(placement, Partial):
        op = placement.reduce_op
        return "Partial()" if op == "sum" else f"Partial({op})"
    raise TypeError(f"unsupported placement {placement!r}")


def parse_shard(text: str, axis: str = "?") -> Shard:
    """``"Shard(1)"`` -> ``Shard(1)``, refusing any other placement (a stored tensor is whole or cut)."""
    placement = placement_from_str(text)
    if not isinstance(placement, Shard):
        raise ValueError(f"a stored tensor's placement on {axis!r} must read Shard(d), got {text!r}")
    return placement


__all__ = ["ACTIVATION_TIERS", "ActivationPlan", "Cut", "PART_TIERS", "Slice", "Split", "TensorLayout", "TensorPlan", "TIERS", "Tiers", "parse_shard", "placement_from_str", "placement_to_str",
           "shard_rows"]
