"""The meshes the search tries: the :class:`Parallelism` of a candidate (``pp x dp x tp`` mesh,
microbatches, sequence parallelism, pipeline schedule) and their enumeration. Torch-free.

:func:`meshes` enumerates every ``pp x dp x tp = world`` with ``tp`` dividing the GPUs of one node
(tensor parallelism never crosses a node), ``pp`` at most the number of blocks, a microbatch count
``m`` that divides the per-replica batch, and ``sequence_parallel`` on or off when ``tp > 1``.
Mesh order is ``(pp, dp, tp)``, tp innermost, as in Megatron-LM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from graphpass.cluster import Cluster
from graphpass.mesh import Mesh, pipeline_rank

#: Microbatch counts tried besides multiples of the pipeline degree (gradient accumulation).
_MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)
#: Pipeline degrees beyond this are not enumerated (no published schedule uses more).
_MAX_PP = 64


@dataclass(frozen=True)
class Parallelism:
    """What the search decides for the whole model: the ``pp x dp x tp`` mesh (``ep`` inside
    ``dp`` for Mixture-of-Experts models), the microbatches of a step, and sequence parallelism
    on ``tp``."""

    mesh: Mesh
    microbatches: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    #: Which projections tensor parallelism shards: Megatron's pattern, or a layout of the
    #: op-level solver (`graphpass.planner.op_placement`).
    tp_layout: str = "megatron"

    @property
    def key(self) -> tuple[int, bool, str]:
        """What the blocks' costs depend on besides the batch: ``(tp, sequence_parallel,
        tp_layout)``."""
        return self.mesh.tp, self.sequence_parallel, self.tp_layout

    @classmethod
    def of(cls, pp: int, dp: int, tp: int, microbatches: int = 1, sequence_parallel: bool = False,
           ep: int = 1, dp_shard: int | None = None) -> "Parallelism":
        return cls(Mesh.of(pp=pp, dp=dp, tp=tp, ep=ep, dp_shard=dp_shard), microbatches, sequence_parallel)

    @property
    def num_stages(self) -> int:
        """Pipeline stages: ``pp`` ranks times the stages each runs (interleaved schedules)."""
        return self.mesh.pp * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The ``pp`` rank that runs ``stage`` (:func:`graphpass.mesh.pipeline_rank`)."""
        return pipeline_rank(stage, self.mesh.pp)

    def __str__(self) -> str:
        text = f"pp={self.mesh.pp} dp={self.mesh.dp} tp={self.mesh.tp}"
        if self.mesh.ep > 1:
            text += f" ep={self.mesh.ep}"
        if "dp_shard" in self.mesh:
            text += f" dp_shard={self.mesh.dp_shard}"
        if self.microbatches > 1:
            text += f" m={self.microbatches}"
        if self.sequence_parallel:
            text += " sp"
        if self.tp_layout != "megatron":
            text += f" ({self.tp_layout})"
        if self.mesh.pp > 1 and self.schedule != "1f1b":
            text += f" {self.schedule}" + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
        return text


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(cluster: Cluster, batch: int, tps: Iterable[int], num_blocks: int, num_experts: int = 0) -> list[Parallelism]:
    """Every mesh the search considers (see the module docstring); ``tps`` are the tp degrees the
    model's layout allows; with ``num_experts`` (a Mixture-of-Experts model), every ``ep``
    dividing both ``dp`` and the experts too. Where the data-parallel groups span nodes, each
    mesh also comes as HSDP (:func:`hsdp_shard`): ZeRO inside a node, replicated across nodes."""
    world = cluster.world_size
    out = []
    for tp in sorted(set(tps)):
        if world % tp or cluster.devices_per_node % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > min(num_blocks, _MAX_PP):
                continue
            dp = world // (tp * pp)
            if batch % dp:
                continue
            per_replica = batch // dp
            counts = {m for m in _MICROBATCHES if per_replica % m == 0}
            counts |= {k * pp for k in (1, 2, 4) if per_replica % (k * pp) == 0}
            if pp > 1:  # pipelines run 1F1B: at least as many microbatches as stages
                counts = {m for m in counts if m >= pp}
            eps = [e for e in _divisors(dp) if num_experts and num_experts % e == 0] or [1]
            shards = {ep: hsdp_shard(cluster, Mesh.of(pp=pp, dp=dp, tp=tp, ep=ep)) for ep in eps}
            for m in sorted(counts):
                for sp in ((False, True) if tp > 1 else (False,)):
                    for ep in eps:
                        out.append(Parallelism.of(pp, dp, tp, m, sp, ep))
                        if shards[ep] is not None:
                            out.append(Parallelism.of(pp, dp, tp, m, sp, ep, dp_shard=shards[ep]))
    return out


def hsdp_shard(cluster: Cluster, mesh: Mesh) -> int | None:
    """The ``dp_shard`` the search offers on ``mesh``: the largest whose groups each lie inside
    one node (ZeRO's gathers and reduce-scatters on the intra-node link, only the replicas'
    all-reduce between nodes), when the mesh's ``dp`` groups span nodes; else None (HSDP would
    only trade memory for nothing)."""
    if mesh.dp == 1 or not cluster.crosses_nodes(mesh, "dp"):
        return None
    return cluster.node_aligned_shard(mesh)


def local_batch(layout: Parallelism, batch: int) -> int:
    """Samples in one microbatch on one rank."""
    return batch // (layout.mesh.dp * layout.microbatches)
