"""The device mesh: ordered, named axes and how ranks lie on them.

One type from the plan to the process groups: a :class:`~graphpass.plan.Plan` holds a
:class:`Mesh`, a :class:`~graphpass.plan.Strategy` and the planner's search make one
(:meth:`Mesh.of`), passes read this rank's coordinate from it, the cost model the ranks of a
group (to price a collective on the links that group spans), and
:class:`graphpass.runtime.mesh.ProcessMesh` builds torch's ``DeviceMesh`` from it. Ranks are laid
out row-major as ``DeviceMesh`` does: the last axis is innermost (``tp`` in ``pp x dp x tp``, so a
tensor-parallel group is consecutive ranks, inside one node).

A mesh reads as a mapping ``{axis: size}`` (``mesh["dp"]``, ``dict(mesh)``, ``mesh.items()``),
which is also its JSON form.

Two factors of ``dp`` lie *inside* it rather than beside it and count no ranks of their own:

- ``ep`` (expert parallelism): the experts are sharded over groups of ``ep`` consecutive
  data-parallel ranks while the batch stays split over all of ``dp``: ``{"dp": 4, "ep": 2}`` is 4
  ranks, not 8. The derived axis ``edp`` (expert data parallel, Megatron-Core's word) is the
  rest, ``dp // ep`` ranks holding the same experts, over which the expert weights' gradients are
  reduced (without ``ep``, all of ``dp``).
- ``dp_shard`` (hierarchical data parallelism, HSDP; FSDP2's 2-D mesh, torchtitan's
  ``data_parallel_shard_degree``): ZeRO shards inside groups of ``dp_shard`` consecutive
  data-parallel ranks (a node, preferably) and the derived axis ``dp_replicate``, ``dp //
  dp_shard`` groups, holds replicas of those shards. Without it ``dp_shard`` is all of ``dp`` and
  ``dp_replicate`` one rank. With both, ``ep`` divides ``dp_shard`` and expert weights are
  ZeRO-sharded over ``edp_shard``, the ranks of one ``dp_shard`` group that hold the same experts.

Ranks lie on *atoms*, the dimensions of torch's ``DeviceMesh``: ``dp`` is
``dp_replicate x edp_shard x ep`` (outermost first), and every named axis is a run of atoms
(:data:`DP_ATOMS`): ``dp_shard = edp_shard x ep``, ``edp = dp_replicate x edp_shard``. Derived
axes are not keys of the mapping; :meth:`Mesh.size`, :meth:`Mesh.coordinate` and
:meth:`Mesh.group_ranks` know them. An ``"ep": 1`` entry and a ``dp_shard`` equal to ``dp`` are
dropped (they shard nothing new).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Iterator

#: Axis order of every mesh graphpass builds (Megatron-LM's): pipeline outermost, tensor innermost;
#: ``dp_shard`` and ``ep`` are factors of ``dp`` (see the module docstring).
ORDER = ("pp", "dp", "dp_shard", "ep", "tp")
#: The factors of ``dp`` given as keys, and the axes derived from them (see the module docstring).
EP, EDP = "ep", "edp"
DP_SHARD, DP_REPLICATE, EDP_SHARD = "dp_shard", "dp_replicate", "edp_shard"
#: The atoms of ``dp`` (outermost first) and the run of them each dp-family axis spans.
DP_ATOMS = {
    "dp": (DP_REPLICATE, EDP_SHARD, EP),
    EP: (EP,),
    EDP: (DP_REPLICATE, EDP_SHARD),
    DP_SHARD: (EDP_SHARD, EP),
    DP_REPLICATE: (DP_REPLICATE,),
    EDP_SHARD: (EDP_SHARD,),
}
_DERIVED = (EDP, DP_REPLICATE, EDP_SHARD)


class Mesh(Mapping):
    """Ordered named axes and their sizes; immutable and hashable.

    Args:
        axes: ``{axis: size}`` in layout order (outermost first); sizes are positive ints. A
            ``"dp_shard"`` or ``"ep"`` entry is a factor of ``"dp"`` (see the module docstring): it
            divides ``dp``, comes right after it and counts no ranks of its own.
    """

    __slots__ = ("_axes", "_atoms")

    def __init__(self, axes: Mapping[str, int] | Iterator[tuple[str, int]]):
        given = dict(axes)
        # ep = 1 and dp_shard = dp shard nothing: the mesh without them
        items = tuple((a, n) for a, n in given.items()
                      if not (a == EP and n == 1) and not (a == DP_SHARD and n == given.get("dp")))
        for axis, size in items:
            if not isinstance(axis, str) or not axis or "," in axis:
                raise ValueError(f"mesh axis names must be non-empty strings without ',', got {axis!r}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh[{axis!r}] must be a positive int, got {size!r}")
            if axis in _DERIVED:
                raise ValueError(f"mesh axis name {axis!r} is reserved (derived from 'dp', 'dp_shard' and 'ep'); "
                                 f"give 'dp_shard' or 'ep' inside 'dp' instead")
        sizes = dict(items)
        names = [a for a, _ in items]
        for inner in (DP_SHARD, EP):
            if inner not in sizes:
                continue
            what = "shards ZeRO state" if inner == DP_SHARD else "shards experts"
            if "dp" not in sizes or sizes["dp"] % sizes[inner]:
                raise ValueError(f"mesh[{inner!r}] = {sizes[inner]} {what} inside the data-parallel axis, so it must "
                                 f"divide mesh['dp'] (got {sizes.get('dp')}); choose {inner} dividing dp")
            before = [a for a in ("dp", DP_SHARD) if a in sizes and a != inner]
            if names.index(inner) != names.index(before[-1]) + 1:
                raise ValueError(f"mesh[{inner!r}] must come right after {before[-1]!r} (it is a factor of dp), "
                                 f"got axes {names}")
        if DP_SHARD in sizes and EP in sizes and sizes[DP_SHARD] % sizes[EP]:
            raise ValueError(f"mesh['ep'] = {sizes[EP]} must divide mesh['dp_shard'] = {sizes[DP_SHARD]}: the experts "
                             f"are sharded inside each group of dp_shard ranks; choose ep dividing dp_shard")
        object.__setattr__(self, "_axes", items)
        object.__setattr__(self, "_atoms", self._atoms_of_mesh(sizes))

    @staticmethod
    def _atoms_of_mesh(sizes: dict[str, int]) -> tuple[tuple[str, int], ...]:
        atoms = []
        for axis, size in sizes.items():
            if axis == "dp":
                shard, ep = sizes.get(DP_SHARD, size), sizes.get(EP, 1)
                atoms += [(DP_REPLICATE, size // shard), (EDP_SHARD, shard // ep), (EP, ep)]
            elif axis not in (DP_SHARD, EP):
                atoms.append((axis, size))
        return tuple(atoms)

    @classmethod
    def of(cls, pp: int = 1, dp: int = 1, tp: int = 1, ep: int = 1, dp_shard: int | None = None) -> "Mesh":
        """The ``pp x dp x tp`` mesh in :data:`ORDER`; ``dp`` is always an axis (the batch is split
        on it), ``pp``, ``tp``, ``dp_shard`` and ``ep`` (inside ``dp``) only when they cut it."""
        sizes = {"pp": pp, "dp": dp, DP_SHARD: dp if dp_shard is None else dp_shard, EP: ep, "tp": tp}
        return cls({a: n for a, n in sizes.items() if a in ("dp", DP_SHARD) or n > 1})

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a Mesh is immutable")

    # -------------------------------------------------------------------- mapping protocol

    def __getitem__(self, axis: str) -> int:
        for name, size in self._axes:
            if name == axis:
                return size
        raise KeyError(axis)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._axes)

    def __len__(self) -> int:
        return len(self._axes)

    def __hash__(self) -> int:
        return hash(self._axes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mesh):
            return self._axes == other._axes
        if isinstance(other, Mapping):
            return tuple(dict(other).items()) == self._axes
        return NotImplemented

    def __repr__(self) -> str:
        return f"Mesh({dict(self._axes)})"

    def __str__(self) -> str:
        inner = ", ".join(f"{a}={self[a]}" for a in (DP_SHARD, EP) if a in self)
        return " x ".join(f"{a}={n}" + (f" ({inner})" if a == "dp" and inner else "")
                          for a, n in self._axes if a not in (DP_SHARD, EP))

    def __reduce__(self):
        return (Mesh, (dict(self._axes),))

    # -------------------------------------------------------------------- sizes

    @property
    def world_size(self) -> int:
        """Product of the axis sizes (``dp_shard`` and ``ep`` lie inside ``dp`` and add none)."""
        return math.prod(n for _, n in self._atoms)

    @property
    def atoms(self) -> tuple[tuple[str, int], ...]:
        """The rank-counting dimensions ``(name, size)``, outermost first, ``dp`` as its three
        factors (size 1 where a factor is absent): the dimensions of torch's ``DeviceMesh``."""
        return self._atoms

    def atoms_of(self, axis: str) -> tuple[str, ...]:
        """The atoms ``axis`` spans (one axis or several joined by commas), in mesh order; ``()``
        for an axis the mesh does not have."""
        spans: set[str] = set()
        for name in axis.split(","):
            if name in DP_ATOMS:
                spans.update(DP_ATOMS[name] if "dp" in self else ())
            elif name in self:
                spans.add(name)
        return tuple(a for a, _ in self._atoms if a in spans)

    def size(self, axis: str) -> int:
        """Ranks along ``axis``: one axis, or several joined by commas (``"dp,tp"``: their
        product); 1 for an axis the mesh does not have. ``edp`` is ``dp // ep``, ``dp_shard``
        all of ``dp`` without HSDP."""
        atoms = dict(self._atoms)
        return math.prod(atoms[a] for a in self.atoms_of(axis))

    def within(self, axis: str, outer: str) -> bool:
        """Whether every rank of an ``axis`` group shares its ``outer`` group (``dp_shard`` within ``dp``)."""
        return set(self.atoms_of(axis)) <= set(self.atoms_of(outer))

    @property
    def ep(self) -> int:
        return self.size(EP)

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def dp(self) -> int:
        return self.size("dp")

    @property
    def tp(self) -> int:
        return self.size("tp")

    @property
    def dp_shard(self) -> int:
        return self.size(DP_SHARD)

    def with_dp_shard(self, shard: int) -> "Mesh":
        """This mesh with ZeRO sharded inside groups of ``shard`` dp ranks (HSDP)."""
        items = [(a, n) for a, n in self._axes if a != DP_SHARD]
        at = [a for a, _ in items].index("dp") + 1
        return Mesh(items[:at] + [(DP_SHARD, shard)] + items[at:])

    def zero_axis(self, expert: bool = False) -> str:
        """The axis ZeRO shards a parameter over: ``dp_shard`` (all of ``dp`` without HSDP); for
        an expert weight sharded over ``ep``, the ranks of that group holding the same experts."""
        if expert:
            return EDP_SHARD if DP_SHARD in self else EDP
        return DP_SHARD if DP_SHARD in self else "dp"

    def replicate_axis(self, zero_axis: str) -> str | None:
        """The axis over which shards on ``zero_axis`` are replicas (HSDP's ``dp_replicate``),
        whose gradients are all-reduced after the reduce-scatter; None when there is none."""
        if zero_axis in (DP_SHARD, EDP_SHARD) and self.size(DP_REPLICATE) > 1:
            return DP_REPLICATE
        return None

    # -------------------------------------------------------------------- layout

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for name, size in reversed(self._atoms):
            strides[name] = stride
            stride *= size
        return strides

    def coordinate(self, rank: int, axis: str) -> int:
        """``rank``'s position along ``axis`` (row-major over the atoms, the last innermost: ``ep``
        the inner factor of ``dp``, ``edp`` the outer)."""
        if axis not in self and not (axis in DP_ATOMS and "dp" in self):
            raise KeyError(f"mesh axis {axis!r} is not in the mesh {dict(self)}")
        atoms, strides = dict(self._atoms), self._strides()
        coord = 0
        for atom in self.atoms_of(axis):
            coord = coord * atoms[atom] + rank // strides[atom] % atoms[atom]
        return coord

    def group_ranks(self, axis: str, rank: int = 0) -> list[int]:
        """The global ranks of ``rank``'s group along ``axis`` (in coordinate order); ``[rank]``
        for an axis the mesh does not have."""
        atoms, strides = dict(self._atoms), self._strides()
        group = [rank - sum(rank // strides[a] % atoms[a] * strides[a] for a in self.atoms_of(axis))]
        for atom in self.atoms_of(axis):
            group = [base + i * strides[atom] for base in group for i in range(atoms[atom])]
        return group


def pipeline_rank(stage: int, pp: int) -> int:
    """The ``pp`` rank that runs pipeline stage ``stage``: rank ``r`` runs stages ``r, r + pp,
    ...`` (one stage per rank unless the schedule interleaves; torch's ``PipelineStage`` and
    interleaved schedules map stages the same way)."""
    return stage % pp
