"""Time of one collective on a `Cluster`: the alpha-beta link model and the ring/tree formulas.

Every link level (inside a node, between nodes) is priced by the alpha-beta model: a message of
``b`` bytes costs ``alpha + b / B``, with ``alpha`` the per-message latency (``LinkSpec.latency_s``)
and ``B`` what one GPU sends in one direction (``LinkSpec.bandwidth_gbps``, GB/s). A collective
over ``n`` ranks is a sequence of such steps; with ``S`` the size of the tensor (defined per
collective below):

=====================  =====================================  ==========================  ===============
collective             time                                   bytes each rank sends       ``S`` is
=====================  =====================================  ==========================  ===============
all-reduce, ring       ``2(n-1) alpha + 2(n-1)/n * S / B``    ``2(n-1)/n * S``            full tensor
all-reduce, tree       ``2 ceil(log2 n) alpha + 2 S / B``     ``2 S`` (interior nodes)    full tensor
all-gather, ring       ``(n-1) alpha + (n-1)/n * S / B``      ``(n-1)/n * S``             gathered output
reduce-scatter, ring   ``(n-1) alpha + (n-1)/n * S / B``      ``(n-1)/n * S``             full input
all-to-all (pairwise)  ``(n-1) alpha + (n-1)/n * S / B``      ``(n-1)/n * S``             one rank's send buffer
send/recv              ``alpha + S / B``                      ``S``                       the message
=====================  =====================================  ==========================  ===============

and ``n == 1`` costs nothing. Sources: R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 19(1), 2005 (ring all-gather and
reduce-scatter, ring all-reduce = reduce-scatter + all-gather, binary-tree latency); the NCCL
documentation and nccl-tests' "bus bandwidth" notes (``busbw = algbw * 2(n-1)/n`` for all-reduce,
``(n-1)/n`` for all-gather, reduce-scatter and all-to-all), which are the same volumes.

The tree formula is the pipelined (double) binary tree NCCL uses for all-reduce: a reduce up the
tree and a broadcast down, each ``ceil(log2 n)`` hops deep; with pipelining, the bandwidth term is
the whole tensor once up and once down (``2 S / B``), independent of ``n``. It beats the ring only
where latency dominates (small messages, many ranks), never on bandwidth.

**Which link.** Ranks are laid out node-major (rank ``r`` lives on node
``r // devices_per_node``). A group inside one node runs at the intra-node link. A group that spans
nodes is priced, flat, at the inter-node link: a ring over several nodes crosses the node boundary,
and every step waits for its slowest hop, which is the per-GPU inter-node link (one NIC per GPU, as
in a DGX, so each GPU's ring edge gets the whole link). See `link_for_group`. On sites joined by
a wide-area link (:mod:`graphpass.sites`), a group inside one site runs on that site's links; a
group that spans sites takes the wide-area link as its inter-node level, whose bandwidth is the
sites' aggregate: the ``c = world_size / n`` groups of a mesh axis cross it at once, each ring
once each way, so each gets ``B / c`` (the hierarchical form's ``k`` rings per group ``B / ck``).

**Hierarchical all-reduce.** A group of ``k`` ranks on each of ``m`` nodes (``k > 1``, ``m > 1``)
can instead reduce-scatter inside each node, all-reduce its ``S / k`` slice with the matching
rank of every other node, and all-gather inside the node::

    t = RS_intra(S, k) + AR_inter(S / k, m) + AG_intra(S, k)

Only ``S / k`` crosses the slow link, and ``m`` rings run side by side, one per local rank, each on
its own NIC. ``collective_time(..., algorithm="auto")`` takes the cheaper of this and the flat ring.

**Blocking collectives.** A collective the step waits for where it is issued (a tensor-parallel
all-reduce, ZeRO-3's backward re-gather) is a synchronisation point: ranks reach it from
compute at slightly different times, and the collective's threads wake from idle. That costs
more than the same collective run back to back, where the formulas above are fitted; the
difference, measured by `graphpass.cost.profiler.profile`, is ``LinkSpec.sync_s`` and
`sync_time` charges it once per blocking collective. Which collectives block is the transition
table's (``Movement.blocking``).

**Graph ops.** What each op the emitter inserts communicates (kind, bytes, forward or backward,
per microbatch or per step) is not written here: it is the transition table,
`graphpass.transitions`, which the emitter emits from and the planner prices with these
formulas.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

from graphpass.cluster import Cluster, LinkSpec

__all__ = [
    "ALGORITHMS",
    "KINDS",
    "Link",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "collective_time",
    "hierarchical_all_reduce_time",
    "hierarchical_all_to_all_time",
    "link_for_group",
    "reduce_scatter_time",
    "ring_volume_bytes",
    "send_recv_time",
    "sync_time",
]

logger = logging.getLogger(__name__)

#: Collective kinds the model prices.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
#: Values of ``algorithm`` accepted by `collective_time`.
ALGORITHMS = ("auto", "ring", "tree", "hierarchical")


@dataclass(frozen=True)
class Link:
    """One link level in SI units: the beta and alpha of the alpha-beta model.

    Attributes:
        bandwidth_bytes_per_s: What one GPU sends in one direction, bytes per second.
        latency_s: Per-message latency, seconds.
    """

    bandwidth_bytes_per_s: float
    latency_s: float
    #: measured slowdown of each collective kind against the ring formula (``LinkSpec.kind_factors``)
    kind_factors: tuple[tuple[str, float], ...] = ()
    #: extra time of a blocking collective issued from inside compute (``LinkSpec.sync_s``)
    sync_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or not math.isfinite(self.bandwidth_bytes_per_s):
            raise ValueError(f"Link.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if not self.latency_s >= 0 or not math.isfinite(self.latency_s):
            raise ValueError(f"Link.latency_s must be >= 0, got {self.latency_s!r}")

    @classmethod
    def from_spec(cls, spec: LinkSpec) -> Link:
        """Converts a `LinkSpec` (GB/s = 1e9 bytes/s) to a `Link`."""
        return cls(bandwidth_bytes_per_s=spec.bandwidth_gbps * 1e9, latency_s=spec.latency_s,
                   kind_factors=tuple(sorted(spec.kind_factors.items())), sync_s=spec.sync_s)

    def factor(self, kind: str) -> float:
        """The measured multiplier for ``kind`` (1 when not measured)."""
        return dict(self.kind_factors).get(kind, 1.0)


# --------------------------------------------------------------------------- checks


def _check_size(size_bytes: float) -> float:
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, (int, float)) or not size_bytes >= 0:
        raise ValueError(f"size_bytes must be a number >= 0, got {size_bytes!r}")
    return float(size_bytes)


def _check_num_ranks(num_ranks: int) -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks <= 0:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {list(KINDS)}")


def _nodes_of(cluster: Cluster, group_ranks: Sequence[int]) -> dict[int, int]:
    """Node index -> number of group ranks on it; checks the ranks."""
    ranks = list(group_ranks)
    if not ranks:
        raise ValueError("group_ranks must name at least one rank")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"group_ranks has repeated ranks: {ranks}")
    counts: dict[int, int] = {}
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < cluster.world_size:
            raise ValueError(
                f"group_ranks: rank {r!r} is not in 0..{cluster.world_size - 1} "
                f"(cluster of {cluster.world_size} ranks)"
            )
        node = r // cluster.devices_per_node
        counts[node] = counts.get(node, 0) + 1
    return counts


# --------------------------------------------------------------------------- link choice


def _levels(cluster: Cluster, group_ranks: Sequence[int], streams: int = 1,
            concurrent_groups: int | None = None) -> tuple[Link, Link]:
    """The intra- and inter-node links of a group: the cluster's own; for joined sites
    (:mod:`graphpass.sites`) the links of the group's site, and where the group spans sites,
    the wide-area link as its inter-node level. That link's bandwidth is the sites' aggregate,
    shared by every ring crossing it at once: ``concurrent_groups`` groups (default
    ``world_size / len(group)``: a mesh axis's groups run together), each with ``streams`` rings
    across (1 for a flat ring; ``k`` for the hierarchical form's per-local-rank rings), one
    crossing each way per ring."""
    if not cluster.sites:
        return Link.from_spec(cluster.intra_node), Link.from_spec(cluster.inter_node)
    involved = [cluster.sites[i] for i in sorted({cluster.site_of(r) for r in group_ranks})]
    intra = Link.from_spec(min((site.intra_node for site in involved), key=lambda link: link.bandwidth_gbps))
    if len(involved) == 1:
        return intra, Link.from_spec(involved[0].inter_node)
    groups = cluster.world_size // len(group_ranks) if concurrent_groups is None else concurrent_groups
    shared = max(1, groups) * streams
    wan = cluster.wan
    return intra, Link(wan.bandwidth_gbps * 1e9 / shared, wan.latency_s, tuple(sorted(wan.kind_factors.items())),
                       wan.sync_s)


def link_for_group(cluster: Cluster, group_ranks: Sequence[int], concurrent_groups: int | None = None) -> Link:
    """The link a flat ring over ``group_ranks`` runs at.

    Ranks are node-major: rank ``r`` is on node ``r // cluster.devices_per_node``. A group inside
    one node gets ``cluster.intra_node``; a group that spans nodes gets ``cluster.inter_node``,
    because every ring step waits for its slowest hop and some hop crosses nodes on the per-GPU
    inter-node link. On joined sites, a group inside one site gets that site's links, and one
    that spans sites the wide-area link, shared with the axis's other groups (:func:`_levels`).

    Raises:
        ValueError: An empty group, a repeated rank, or a rank outside the cluster.
    """
    nodes = _nodes_of(cluster, group_ranks)
    intra, inter = _levels(cluster, group_ranks, concurrent_groups=concurrent_groups)
    return intra if len(nodes) == 1 else inter


# --------------------------------------------------------------------------- formulas


def ring_volume_bytes(kind: str, size_bytes: float, num_ranks: int) -> float:
    """Bytes each rank sends in the ring (pairwise for all-to-all) form of ``kind``.

    ``all_reduce``: ``2(n-1)/n * S``; ``all_gather``, ``reduce_scatter``, ``all_to_all``:
    ``(n-1)/n * S``; ``send_recv``: ``S``; 0 when ``n == 1``. ``S`` as in the module table.
    """
    _check_kind(kind)
    size = _check_size(size_bytes)
    _check_num_ranks(num_ranks)
    if num_ranks == 1:
        return 0.0
    if kind == "send_recv":
        return size
    fraction = (num_ranks - 1) / num_ranks
    return (2 if kind == "all_reduce" else 1) * fraction * size


def _ring_steps(kind: str, num_ranks: int) -> int:
    if num_ranks == 1:
        return 0
    if kind == "send_recv":
        return 1
    return (2 if kind == "all_reduce" else 1) * (num_ranks - 1)


def _ring_time(kind: str, size_bytes: float, num_ranks: int, link: Link) -> float:
    volume = ring_volume_bytes(kind, size_bytes, num_ranks)
    return link.factor(kind) * (_ring_steps(kind, num_ranks) * link.latency_s + volume / link.bandwidth_bytes_per_s)


def all_reduce_time(size_bytes: float, num_ranks: int, link: Link, algorithm: str = "ring") -> float:
    """All-reduce of an ``S``-byte tensor over ``n`` ranks on one link level.

    ``"ring"``: ``2(n-1) alpha + 2(n-1)/n * S / B``. ``"tree"``: ``2 ceil(log2 n) alpha + 2 S / B``
    (pipelined binary tree: reduce up, broadcast down).
    """
    if algorithm == "ring":
        return _ring_time("all_reduce", size_bytes, num_ranks, link)
    if algorithm == "tree":
        size = _check_size(size_bytes)
        _check_num_ranks(num_ranks)
        if num_ranks == 1:
            return 0.0
        depth = math.ceil(math.log2(num_ranks))
        return 2 * depth * link.latency_s + 2 * size / link.bandwidth_bytes_per_s
    raise ValueError(f"all_reduce_time: algorithm must be 'ring' or 'tree', got {algorithm!r}")


def all_gather_time(size_bytes: float, num_ranks: int, link: Link) -> float:
    """Ring all-gather producing an ``S``-byte output: ``(n-1) alpha + (n-1)/n * S / B``."""
    return _ring_time("all_gather", size_bytes, num_ranks, link)


def reduce_scatter_time(size_bytes: float, num_ranks: int, link: Link) -> float:
    """Ring reduce-scatter of an ``S``-byte input: ``(n-1) alpha + (n-1)/n * S / B``."""
    return _ring_time("reduce_scatter", size_bytes, num_ranks, link)


def all_to_all_time(size_bytes: float, num_ranks: int, link: Link) -> float:
    """Pairwise all-to-all, ``S`` = one rank's whole send buffer: ``(n-1) alpha + (n-1)/n * S / B``.

    Each rank keeps ``S / n`` and sends ``S / n`` to each of the ``n - 1`` others, one exchange
    per step.
    """
    return _ring_time("all_to_all", size_bytes, num_ranks, link)


def send_recv_time(size_bytes: float, link: Link) -> float:
    """One point-to-point message: ``alpha + S / B``."""
    size = _check_size(size_bytes)
    return link.latency_s + size / link.bandwidth_bytes_per_s


def hierarchical_all_reduce_time(
    size_bytes: float, ranks_per_node: int, num_nodes: int, intra: Link, inter: Link
) -> float:
    """Reduce-scatter in each node, all-reduce ``S / k`` across nodes, all-gather in each node.

    ``RS(S, k, intra) + AR_ring(S / k, m, inter) + AG(S, k, intra)`` with ``k = ranks_per_node``
    and ``m = num_nodes``; the ``k`` cross-node all-reduces run in parallel, one per local rank.
    """
    _check_num_ranks(ranks_per_node)
    _check_num_ranks(num_nodes)
    size = _check_size(size_bytes)
    return (
        reduce_scatter_time(size, ranks_per_node, intra)
        + all_reduce_time(size / ranks_per_node, num_nodes, inter)
        + all_gather_time(size, ranks_per_node, intra)
    )


def hierarchical_all_to_all_time(
    size_bytes: float, ranks_per_node: int, num_nodes: int, intra: Link, inter: Link
) -> float:
    """Two-level all-to-all (Tutel's 2DH, HetuMoE's hierarchical exchange): an all-to-all inside
    each node groups every rank's buffer by destination node, then the ``k`` ranks of a node each
    exchange with their peers of the same local index on the other nodes, one aggregated message
    per node instead of one per remote rank; the arrival is re-laid out locally (a copy).

    ``A2A(S, k, intra) + A2A(S, m, inter)`` with ``k = ranks_per_node`` and ``m = num_nodes``:
    ``(k-1) + (m-1)`` latencies instead of the flat ``m k - 1`` ones on the inter-node link, for
    ``(k-1)/k S`` more bytes on the intra-node link. It wins where latency dominates (small
    per-destination messages: many experts, few tokens, many nodes).
    """
    _check_num_ranks(ranks_per_node)
    _check_num_ranks(num_nodes)
    size = _check_size(size_bytes)
    return all_to_all_time(size, ranks_per_node, intra) + all_to_all_time(size, num_nodes, inter)


def sync_time(group_ranks: Sequence[int], cluster: Cluster) -> float:
    """Extra seconds of one blocking collective over ``group_ranks`` (issued from inside compute,
    waited for right there): the group's link's measured ``sync_s``; 0 for one rank."""
    link = link_for_group(cluster, group_ranks)
    return 0.0 if len(group_ranks) == 1 else link.sync_s


def collective_time(
    kind: str,
    size_bytes: float,
    group_ranks: Sequence[int],
    cluster: Cluster,
    algorithm: str = "auto",
    concurrent_groups: int | None = None,
) -> float:
    """Seconds for one ``kind`` collective of ``size_bytes`` over ``group_ranks`` of ``cluster``.

    Args:
        kind: One of `KINDS`. For ``"send_recv"``, ``group_ranks`` is the ``(src, dst)`` pair.
        size_bytes: ``S`` as in the module table (full tensor, gathered output, full input,
            one rank's send buffer, or the message).
        group_ranks: Global ranks of the process group, node-major.
        cluster: Where the group runs.
        algorithm: ``"ring"`` (flat ring, or pairwise exchange, on `link_for_group`), ``"tree"``
            (all-reduce only), ``"hierarchical"`` (all-reduce and all-to-all over whole nodes),
            or ``"auto"``: for an all-reduce, the cheapest of the flat ring, the tree (NCCL
            clusters only, as NCCL's tuner chooses) and, over ``k > 1`` ranks on each of several
            nodes, the hierarchical form (NCCL clusters only: gloo's all-reduce is flat); for an all-to-all, the cheaper of the flat exchange and
            (there too) the hierarchical one; otherwise the flat ring.
        concurrent_groups: How many groups like this one run the collective at once (they share
            a wide-area link between sites); default ``world_size / len(group_ranks)``.

    Raises:
        ValueError: Unknown kind or algorithm, a bad group, or an algorithm that does not apply.
    """
    _check_kind(kind)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {list(ALGORITHMS)}")
    nodes = _nodes_of(cluster, group_ranks)
    num_ranks = len(group_ranks)
    link = link_for_group(cluster, group_ranks, concurrent_groups)
    if kind == "send_recv":
        if num_ranks not in (1, 2):
            raise ValueError(f"send_recv: group_ranks must be (src, dst), got {list(group_ranks)}")
        return 0.0 if num_ranks == 1 else send_recv_time(size_bytes, link)
    two_level = kind in ("all_reduce", "all_to_all")
    if algorithm == "tree" and kind != "all_reduce" or algorithm == "hierarchical" and not two_level:
        raise ValueError(f"algorithm {algorithm!r} applies to "
                         f"{'all_reduce' if algorithm == 'tree' else 'all_reduce and all_to_all'} only, not {kind!r}")
    if not two_level:
        return _ring_time(kind, size_bytes, num_ranks, link)

    flat = _ring_time(kind, size_bytes, num_ranks, link)
    if algorithm == "ring":
        return flat
    if algorithm == "tree":
        return all_reduce_time(size_bytes, num_ranks, link, algorithm="tree")
    if cluster.backend == "nccl" and kind == "all_reduce":
        # NCCL's tuner picks the double binary tree where latency dominates (small messages,
        # many ranks); gloo's all-reduce is a ring, and profiled gloo links are fitted to it.
        flat = min(flat, all_reduce_time(size_bytes, num_ranks, link, algorithm="tree"))
    # Hierarchical needs the same number of ranks on every node it touches, more than one node
    # and more than one rank per node (otherwise it is the flat form).
    per_node = set(nodes.values())
    applies = len(nodes) > 1 and len(per_node) == 1 and per_node.pop() > 1
    if algorithm == "hierarchical":
        if not applies:
            raise ValueError(
                f"hierarchical {kind} needs the same number (> 1) of ranks on each of several "
                f"nodes; group_ranks {list(group_ranks)} has ranks per node {dict(sorted(nodes.items()))}"
            )
    elif not applies or (kind == "all_reduce" and cluster.backend == "gloo"):
        # gloo's all-reduce knows no topology (a ring over the group, or bcube): on a gloo
        # cluster the two-level form is what graphpass would have to run itself, so "auto"
        # prices the flat one the runtime calls (emulated sites run on gloo)
        return flat
    two_levels = hierarchical_all_reduce_time if kind == "all_reduce" else hierarchical_all_to_all_time
    per_node = num_ranks // len(nodes)
    hierarchical = two_levels(size_bytes, per_node, len(nodes),
                              *_levels(cluster, group_ranks, per_node, concurrent_groups))
    return hierarchical if algorithm == "hierarchical" else min(flat, hierarchical)
