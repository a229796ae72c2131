"""The process mesh a compiled program runs on: named axes → process groups.

Graphs name mesh axes (``axis="dp"``) rather than hold process groups, so the dumped code stays
readable and a plan can be replayed on another launch. :class:`ProcessMesh` builds torch's
``DeviceMesh`` for the plan's axes; :func:`active` makes it the mesh the collective ops resolve
axes against while a compiled module runs.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
from datetime import timedelta
from typing import Iterator, Mapping

import torch.distributed as dist

from graphpass.mesh import DP_ATOMS, EP, Mesh

_RELEASE_AT_EXIT: list[bool] = []


def release_at_exit() -> None:
    """Have this process free its distributed state at exit while the interpreter is still
    whole (registered once; called by every path that runs a program over a process group).

    Gloo work and process groups freed during interpreter finalization abort the process
    ("terminate called without an active exception", SIGABRT): a gloo thread that touches a
    Python object then is killed inside C++ code that cannot unwind. Under torchrun that failed
    jobs at exit after they had trained correctly: 2 of 16 runs with ``destroy_process_group()``
    alone at the end of the script (cycles still held gloo work), none of 32 with the cycles
    collected, and once more in CI with only the collection (the groups were still freed during
    finalization). Both, in that order, are done here."""
    if not _RELEASE_AT_EXIT:
        _RELEASE_AT_EXIT.append(True)
        atexit.register(_release)


def _release() -> None:
    """Collect the reference cycles of compiled programs (they hold gloo work), then, on a normal
    exit, destroy the process groups, which joins gloo's threads. After an uncaught exception
    (``sys.last_value`` is set) the groups are left alone: a thread blocked in a collective with
    a failed peer would hold the exit until the collective timeout, and torchrun stops the
    other ranks anyway."""
    gc.collect()
    if dist.is_initialized() and not hasattr(sys, "last_value"):
        dist.destroy_process_group()


class ProcessMesh:
    """A :class:`~graphpass.mesh.Mesh` over the default process group (or a single process).

    Args:
        mesh: the plan's mesh (or an ordered ``{axis: size}``); the product must equal the
            world size.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
        node_size: ranks per node (global ranks ``0..k-1`` on the first node, ...): with it,
            an ``ep`` group spanning nodes also gets its two-level groups (:meth:`two_level`).
    """

    def __init__(self, mesh: Mesh | Mapping[str, int], device_type: str = "cpu", node_size: int | None = None):
        self.mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
        self.axes = dict(self.mesh)
        self.size = size = self.mesh.world_size
        world = dist.get_world_size() if dist.is_initialized() else 1
        if size != world:
            raise ValueError(
                f"mesh {self.axes} needs {size} ranks but the process group has {world}"
            )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # torch's mesh has one dimension per rank-counting atom of more than one rank (dp is its
        # factors dp_replicate x edp_shard x ep; an axis such as "dp_shard" is a run of them).
        self._dims = {a: n for a, n in self.mesh.atoms if n > 1}
        self._device_mesh = None
        if size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            release_at_exit()
            self._device_mesh = init_device_mesh(
                device_type, tuple(self._dims.values()), mesh_dim_names=tuple(self._dims)
            )

        # Groups over several dimensions at once ("dp,tp": a gradient that is averaged over dp
        # and summed over tp in one all-reduce; "dp" itself under ep). Creating a group is
        # collective, so every rank builds the same ones here, in the same order.
        self._joint: dict[tuple[str, ...], dist.ProcessGroup] = {}
        live = list(self._dims)
        if self._device_mesh is not None and len(live) > 1:
            from itertools import combinations

            for k in range(2, len(live) + 1):
                for combo in combinations(live, k):
                    self._joint[combo] = self._device_mesh[combo]._flatten().get_group()

        # Two-level all-to-all over ep (Tutel's 2DH): per ep group, its ranks on each node, and
        # its ranks with the same index on every node. Created by every rank in one order.
        self._two_level: tuple | None = None
        if node_size and self.mesh.ep > 1 and size > 1:
            self._two_level = self._build_two_level(node_size)

    def _build_two_level(self, node_size: int) -> tuple | None:
        groups = sorted({tuple(self.mesh.group_ranks(EP, r)) for r in range(self.size)})
        layout = []
        for members in groups:
            nodes = [r // node_size for r in members]
            k = nodes.count(nodes[0])
            blocks = [nodes[a:a + k] for a in range(0, len(members), k)]
            if len(members) % k or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
                raise ValueError(f"the ep group {list(members)} does not lie as an equal number of consecutive ranks "
                                 f"on each node of {node_size}; a two-level all-to-all needs that")
            layout.append((members, k))
        if all(k == len(members) for members, k in layout):
            return None  # every ep group inside one node: the flat exchange is the two-level one
        mine = None
        for members, k in layout:
            intra = [dist.new_group(list(members[a:a + k])) for a in range(0, len(members), k)]
            inter = [dist.new_group(list(members[i::k])) for i in range(k)]
            if self.rank in members:
                g = members.index(self.rank)
                mine = (intra[g // k], inter[g % k], k, len(members) // k)
        return mine

    def two_level(self, axis: str) -> tuple | None:
        """``(intra-node group, inter-node group, ranks per node k, nodes m)`` of this rank's
        ``ep`` group when the mesh was built with ``node_size`` and the group spans nodes; else
        None."""
        return self._two_level if axis == EP else None

    def set_timeout(self, timeout_s: float) -> None:
        """Make ``timeout_s`` the collective timeout of the default group and of every group of
        this mesh: a collective waiting for a dead or stuck peer raises after it."""
        if not dist.is_initialized():
            return
        from torch.distributed.distributed_c10d import _set_pg_timeout  # torch's own, since 2.3

        groups: list[dist.ProcessGroup | None] = [None]  # the default group
        if self._device_mesh is not None:
            groups += [self._device_mesh.get_group(a) for a in self._dims]
        if self._two_level is not None:
            groups += [self._two_level[0], self._two_level[1]]
        for group in groups + list(self._joint.values()):
            _set_pg_timeout(timedelta(seconds=timeout_s), group)

    def _live_dims(self, axis: str) -> list[str]:
        """The live dimensions of torch's mesh that ``axis`` (comma-joined axes allowed) spans,
        in the mesh's order."""
        for name in axis.split(","):
            if name not in self.axes and not (name in DP_ATOMS and "dp" in self.axes):
                raise KeyError(f"mesh axis {name!r} is not in the mesh {self.axes}")
        return [d for d in self.mesh.atoms_of(axis) if d in self._dims]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of ``axis`` — one axis, or several joined by commas (``"dp,tp"``);
        None when it spans a single rank."""
        live = self._live_dims(axis)
        if not live or self._device_mesh is None:
            return None
        if len(live) == 1:
            return self._device_mesh.get_group(live[0])
        return self._joint[tuple(live)]

    def axis_size(self, axis: str) -> int:
        """Number of ranks along ``axis`` (product over comma-joined axes)."""
        self._live_dims(axis)
        return self.mesh.size(axis)

    def axis_rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (the same row-major layout ``DeviceMesh`` uses)."""
        return self.mesh.coordinate(self.rank, axis)


_ACTIVE: list[ProcessMesh] = []


@contextlib.contextmanager
def active(mesh: ProcessMesh) -> Iterator[ProcessMesh]:
    """Make ``mesh`` the one collective ops resolve axis names against."""
    _ACTIVE.append(mesh)
    try:
        yield mesh
    finally:
        _ACTIVE.pop()


def current() -> ProcessMesh:
    """The active mesh; raises when a collective runs outside a compiled module."""
    if not _ACTIVE:
        raise RuntimeError(
            "a graphpass collective ran outside a compiled module: call the graph through "
            "DistributedModule (train_step / forward), which activates its process mesh"
        )
    return _ACTIVE[-1]
