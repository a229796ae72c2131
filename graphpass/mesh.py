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

Expert parallelism adds an ``ep`` axis that lies *inside* ``dp`` rather than beside it (the
experts are sharded over groups of ``ep`` consecutive data-parallel ranks while the batch stays
split over all of ``dp``): ``{"dp": 4, "ep": 2}`` is 4 ranks, not 8. A rank's ``ep`` coordinate
is its ``dp`` coordinate modulo ``ep``; the derived axis ``edp`` (expert data parallel,
Megatron-Core's word) is the rest, ``dp // ep`` ranks holding the same experts, over which the
expert weights' gradients are reduced (without ``ep``, all of ``dp``). ``edp`` is not a key of
the mapping; :meth:`Mesh.size`, :meth:`Mesh.coordinate` and :meth:`Mesh.group_ranks` know it.
An ``"ep": 1`` entry is dropped (it shards nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Iterator

#: Axis order of every mesh graphpass builds (Megatron-LM's): pipeline outermost, tensor innermost.
ORDER = ("pp", "dp", "ep", "tp")
#: The axis inside ``dp`` that shards experts, and the derived axis of ranks holding the same
#: experts (see the module docstring).
EP, EDP = "ep", "edp"


class Mesh(Mapping):
    """Ordered named axes and their sizes; immutable and hashable.

    Args:
        axes: ``{axis: size}`` in layout order (outermost first); sizes are positive ints. An
            ``"ep"`` entry is the expert-parallel factor of ``"dp"`` (see the module docstring):
            it must divide ``dp`` and counts no ranks of its own.
    """

    __slots__ = ("_axes",)

    def __init__(self, axes: Mapping[str, int] | Iterator[tuple[str, int]]):
        # ep = 1 shards nothing: the mesh without it (its dp is one axis, not two)
        items = tuple((a, n) for a, n in dict(axes).items() if not (a == EP and n == 1))
        for axis, size in items:
            if not isinstance(axis, str) or not axis or "," in axis:
                raise ValueError(f"mesh axis names must be non-empty strings without ',', got {axis!r}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh[{axis!r}] must be a positive int, got {size!r}")
            if axis == EDP:
                raise ValueError(f"mesh axis name {EDP!r} is reserved (the ranks holding the same experts); "
                                 f"give 'ep' inside 'dp' instead")
        sizes = dict(items)
        if EP in sizes:
            if "dp" not in sizes or sizes["dp"] % sizes[EP]:
                raise ValueError(f"mesh['ep'] = {sizes[EP]} shards experts inside the data-parallel axis, so it must "
                                 f"divide mesh['dp'] (got {sizes.get('dp')}); choose ep dividing dp")
            names = [a for a, _ in items]
            if names.index(EP) != names.index("dp") + 1:
                raise ValueError(f"mesh['ep'] must come right after 'dp' (it is dp's inner factor), got axes {names}")
        object.__setattr__(self, "_axes", items)

    @classmethod
    def of(cls, pp: int = 1, dp: int = 1, tp: int = 1, ep: int = 1) -> "Mesh":
        """The ``pp x dp x tp`` mesh in :data:`ORDER`; ``dp`` is always an axis (the batch is split
        on it), ``pp``, ``tp`` and ``ep`` (inside ``dp``) only when larger than 1."""
        sizes = {"pp": pp, "dp": dp, "ep": ep, "tp": tp}
        return cls({a: n for a, n in sizes.items() if a == "dp" or n > 1})

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
        ep = f" (ep={self[EP]})" if EP in self else ""
        return " x ".join(f"{a}={n}" + (ep if a == "dp" else "") for a, n in self._axes if a != EP)

    def __reduce__(self):
        return (Mesh, (dict(self._axes),))

    # -------------------------------------------------------------------- sizes

    @property
    def world_size(self) -> int:
        """Product of the axis sizes (``ep`` lies inside ``dp`` and adds none)."""
        return math.prod(n for a, n in self._axes if a != EP)

    def size(self, axis: str) -> int:
        """Ranks along ``axis``: one axis, or several joined by commas (``"dp,tp"``: their
        product); 1 for an axis the mesh does not have. ``edp`` is ``dp // ep``."""
        return math.prod(self._size(name) for name in axis.split(","))

    def _size(self, name: str) -> int:
        if name == EDP:  # without ep, every dp rank holds the same (unsharded) experts
            return self.get("dp", 1) // self.get(EP, 1)
        return self.get(name, 1)

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

    # -------------------------------------------------------------------- layout

    def coordinate(self, rank: int, axis: str) -> int:
        """``rank``'s position along ``axis`` (row-major, the last axis innermost; ``ep`` the
        inner factor of ``dp``, ``edp`` the outer)."""
        if axis in (EP, EDP) and EP in self:
            dp = self.coordinate(rank, "dp")
            return dp % self[EP] if axis == EP else dp // self[EP]
        if axis == EDP:
            return self.coordinate(rank, "dp")
        if axis not in self:
            raise KeyError(f"mesh axis {axis!r} is not in the mesh {dict(self)}")
        coord = rank
        for name, size in reversed(self._axes):
            if name == EP:
                continue
            if name == axis:
                return coord % size
            coord //= size
        raise AssertionError("unreachable")

    def group_ranks(self, axis: str, rank: int = 0) -> list[int]:
        """The global ranks of ``rank``'s group along ``axis`` (in coordinate order); ``[rank]``
        for an axis the mesh does not have (``edp`` only with ``ep``)."""
        if axis in (EP, EDP) and EP in self:
            dp = self.group_ranks("dp", rank)
            ep, mine = self[EP], self.coordinate(rank, "dp")
            return dp[mine - mine % ep:][:ep] if axis == EP else dp[mine % ep::ep]
        if axis == EDP:
            return self.group_ranks("dp", rank)
        if axis not in self:
            return [rank]
        live = [(name, n) for name, n in self._axes if name != EP]
        names = [name for name, _ in live]
        stride = math.prod(n for _, n in live[names.index(axis) + 1:])
        base = rank - self.coordinate(rank, axis) * stride
        return [base + i * stride for i in range(self[axis])]


def pipeline_rank(stage: int, pp: int) -> int:
    """The ``pp`` rank that runs pipeline stage ``stage``: rank ``r`` runs stages ``r, r + pp,
    ...`` (one stage per rank unless the schedule interleaves; torch's ``PipelineStage`` and
    interleaved schedules map stages the same way)."""
    return stage % pp
