"""Pricing: one block under one :class:`~graphpass.plan.Choice` on one mesh, as the terms of the
stage ILP (:class:`Priced`, :mod:`graphpass.cost.search.stages`). Torch-free.

The options (:func:`choices_for`) are a ZeRO stage 0-3 inside ``dp``, OSDP operator splitting
(ZeRO-3 only) and activation recomputation (repeated layers only) for the whole block, and
per-operator choices that give a block's largest operators a higher ZeRO stage than the rest.

What runs where it is priced: every data-parallel movement and memory effect comes from the
transition table (:mod:`graphpass.transitions`), the one the emitter inserts from: ZeRO-1/2 keep
shards between steps and gather the full weights once per step (their state is ``P + P/dp``
weights), ZeRO-3 gathers in every forward and again in backward, gradients of dp and ZeRO-1
are reduced once per step (held back between microbatches), ZeRO-2/3's every microbatch.
Every collective is priced by :func:`graphpass.cost.collectives.collective_time` on the group's
real ranks (flat ring on the slowest link it spans, or hierarchical for all-reduce when that is
cheaper).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from graphpass.cluster import Cluster
from graphpass.compression import GradCompression, across_replicas, bucket_parts, replica_parts
from graphpass.diloco import DiLoCo
from graphpass.layout import Tiers
from graphpass.plan import Choice
from graphpass.transitions import FORWARD, PER_MICROBATCH, TABLE, Transition, transition
from graphpass.cost.collectives import collective_time, link_for_group, sync_time
from graphpass.cost.experts import imbalance as expert_imbalance
from graphpass.cost.search.blocks import LAYER, BlockCost
from graphpass.cost.search.layouts import Parallelism, local_batch

#: Per-operator choices divide a block's operators (largest first) at most at this many sizes.
_MAX_CUTS = 3


@dataclass(frozen=True)
class Costing:
    """Everything pricing needs besides the blocks.

    Attributes:
        cluster: devices and links.
        batch: global batch (samples) of the reference measurement.
        memory_limit_bytes: per-device budget.
        grad_bytes_per_param: gradient bytes per parameter element.
        optimizer_bytes_per_param: optimizer-state bytes per element (Adam fp32: 8; mixed
            precision with an fp32 master copy: 12).
        overlap: fraction of data-parallel communication that hides behind compute when there is
            compute to hide behind (1 on GPUs with separate copy/NCCL streams; on CPU gloo shares
            the cores with compute, so less).
        optimizer_s_per_param: measured optimizer-step seconds per parameter element on this
            machine (None: priced as memory traffic, ``2p + g + 2o`` bytes at the bandwidth).
        optimizer_s_per_tensor: measured seconds per parameter tensor of the same step (the
            per-tensor work of a foreach optimizer; ZeRO shards keep one tensor per parameter).
        bucket_cap_bytes: gradient all-reduce bucket size of pure data parallelism
            (``Plan.bucket_cap_bytes``): one collective's latency per bucket, not per block.
        host_contention: how many times longer the block times are than one rank alone would
            take, because they were measured or scaled for every rank of a shared host (CPU
            ranks sharing cores and DRAM) computing at once; 1 where ranks share nothing (GPUs).
        host_oversubscription: the part of ``host_contention`` that is ranks' threads outnumbering
            the host's cores (``ranks x threads / cores``, at least 1): a pipeline's ramps, where
            few stages are busy, give it back
            (:func:`~graphpass.cost.search.stages._shared_host_step`); the rest (shared DRAM and
            caches) stays.
        expert_loads: the share of routed rows each expert of a Mixture-of-Experts layer
            receives (measured or :func:`graphpass.cost.experts.zipf_loads`); None: balanced.
            Under ``ep`` the slowest rank's experts set the pace (:mod:`graphpass.cost.experts`).
        capacity_factor: the MoE layers' capacity factor (None: dropless): each expert computes
            at most ``cf / E`` of the routed rows.
        offload: offer offload (where the cluster has a host side, ``Cluster.host``): parts of a
            block's parameters in host memory or on disk, its activations in host memory.
        offload_overlap: the share of the device <-> host copies' time that hides behind the
            step's compute (1: copies on their own stream / DMA engines, as on a GPU).
        tables: the embedding tables' trade of time for memory, ``(seconds a step, bytes on the
            fullest rank)`` per point (:func:`graphpass.cost.search.tables.frontier`): the stage
            ILP takes exactly one point beside the blocks' choices, its seconds in the step and
            its bytes in every memory row (one solve for the dense part and the tables). Empty:
            no sharded tables. Only on meshes of one stage (sharded tables run on dp alone).
        grad_compression: plain data parallelism's gradient buckets go compressed
            (:mod:`graphpass.compression`): priced by their entries' movements and copies.
        share_compute, share_activations: uneven data-parallel shares in proportion to unlike
            devices' speeds (``Plan.dp_shares``): every rank computes as long as the slowest
            device would on ``share_compute`` times its even share (``world s_min / sum s``),
            and the fastest holds ``share_activations`` times an even share's activations
            (``world s_max / sum s``, priced on every rank against the smallest memory); 1: even.
        diloco: the data-parallel ranks are DiLoCo workers (:mod:`graphpass.diloco`): no
            gradient buckets; the outer step's all-reduce of the parameters' deltas (the bucket
            entry's movement on the parameters' bytes) once every ``inner_steps`` steps, and the
            shared start and its momentum held beside the parameters.
    """

    cluster: Cluster
    batch: int
    memory_limit_bytes: float
    grad_bytes_per_param: float
    optimizer_bytes_per_param: float
    overlap: float = 1.0
    optimizer_s_per_param: float | None = None
    optimizer_s_per_tensor: float = 0.0
    bucket_cap_bytes: float = 25 * 2**20  # DDP's default, as Plan's
    host_contention: float = 1.0
    host_oversubscription: float = 1.0
    expert_loads: tuple[float, ...] | None = None
    capacity_factor: float | None = None
    offload: bool = True
    offload_overlap: float = 1.0
    tables: tuple[tuple[float, float], ...] = ()
    grad_compression: GradCompression | None = None
    diloco: DiLoCo | None = None
    share_compute: float = 1.0
    share_activations: float = 1.0


@dataclass(frozen=True)
class Priced:
    """One block under one choice on one mesh: the terms of the stage ILP."""

    time_s: float  # one microbatch: compute + recompute + tensor-parallel collectives
    optimizer_s: float  # one optimizer step over this block's (shard of) state
    dp_comm_s: float  # data-parallel collectives of one step
    window_s: float  # compute that dp communication can overlap with
    state_bytes: float  # parameters, gradients, optimizer state and gathered ZeRO-1/2 weights
    act_bytes: float  # activations one microbatch keeps until its backward
    transient_bytes: float  # alive only while this block runs
    tp_comm_s: float = 0.0  # part of time_s spent in tensor-parallel collectives
    grad_bytes: float = 0.0  # the gradients in state_bytes: they exist only once backward made them
    held_bytes: float = 0.0  # gradients held from the step's earlier microbatches (accumulation)
    start_bytes: float = 0.0  # the loss's backward working set, on top of every activation
    bucket_bytes: float = 0.0  # gradients bucketed for data-parallel reduction (a second copy while filled)
    host_bytes: float = 0.0  # host memory kept all step (offload: masters, optimizer state, gradients)
    host_act_bytes: float = 0.0  # host memory of one microbatch's saved activations (offloaded)
    disk_bytes: float = 0.0  # disk kept by the disk tier (masters, gradients, optimizer state)
    host_link_s: float = 0.0  # device <-> host copies of one step (offload), overlappable
    host_window_s: float = 0.0  # compute those copies overlap with

    def start_peak_bytes(self, flight: int) -> float:
        """At the start of backward: state without this step's new gradients (those held from
        earlier microbatches stay), every activation in flight, the loss's gradients."""
        return self.state_bytes - self.grad_bytes + self.held_bytes + flight * self.act_bytes + self.start_bytes

    def end_peak_bytes(self) -> float:
        """At the end of backward: the whole state, gradients included; activations freed (plus
        one bucket being filled: `_bucket_spike`)."""
        return self.state_bytes


def _bucket_spike(bucketed: float, costing: Costing) -> float:
    """The end of backward's extra copy: the gradient bucket being filled, at most a bucket."""
    return min(costing.bucket_cap_bytes, bucketed)


class _Collectives:
    """Memoised collective times for one mesh, on rank 0's groups (a pipeline neighbour pair for
    ``pp``); on joined sites, each axis's slowest group (and pair), since groups inside
    different sites, or across them, run on different links."""

    def __init__(self, cluster: Cluster, layout: Parallelism):
        self.cluster = cluster
        self.mesh = mesh = layout.mesh
        self.groups = {}
        for axis in ("dp", "tp", "ep", "edp"):
            self._group(axis)
        if cluster.sites:
            pairs = [g[i:i + 2] for g in _groups(mesh, "pp") for i in range(len(g) - 1)]
            self.groups["pp"] = _slowest_group(cluster, pairs) if pairs else mesh.group_ranks("pp")[:2]
        else:
            self.groups["pp"] = mesh.group_ranks("pp")[:2]
        self.memo: dict[tuple[str, str, float], float] = {}
        self.syncs: dict[str, float] = {}
        # the pipeline's neighbour pairs at one stage boundary send at once: one per other rank
        self.concurrent = {"pp": mesh.world_size // max(mesh.pp, 1)}

    def latency(self, axis: str, kind: str) -> float:
        """The size-independent part of one collective (its time for one byte)."""
        return self.time(axis, kind, 1.0)

    def time(self, axis: str, kind: str, size: float, blocking: bool = False) -> float:
        """One ``kind`` collective of ``size`` bytes over ``axis``; a ``blocking`` one (the step
        waits for it where it runs) also pays the link's synchronisation cost."""
        group = self._group(axis)
        if len(group) == 1 or size <= 0:
            return 0.0
        key = (axis, kind, size)
        if key not in self.memo:
            self.memo[key] = collective_time(kind, size, group, self.cluster,
                                             concurrent_groups=self.concurrent.get(axis))
        return self.memo[key] + (self.sync(axis) if blocking else 0.0)

    def sync(self, axis: str) -> float:
        """The synchronisation cost of one blocking collective over ``axis`` (``sync_time``)."""
        if axis not in self.syncs:
            self.syncs[axis] = sync_time(self._group(axis), self.cluster)
        return self.syncs[axis]

    def _group(self, axis: str) -> Sequence[int]:
        if axis not in self.groups:  # HSDP's dp_shard / dp_replicate, joint "a,b" groups
            mesh = self.mesh
            self.groups[axis] = (_slowest_group(self.cluster, _groups(mesh, axis)) if self.cluster.sites
                                 else mesh.group_ranks(axis))
        return self.groups[axis]


def _groups(mesh, axis: str) -> list[list[int]]:
    """Every group of ``axis``, once each."""
    seen: set[int] = set()
    out = []
    for rank in range(mesh.world_size):
        if rank not in seen:
            group = list(mesh.group_ranks(axis, rank))
            seen.update(group)
            out.append(group)
    return out


def _slowest_group(cluster: Cluster, groups: Sequence[Sequence[int]]) -> list[int]:
    """The group whose ring runs on the slowest link (least bandwidth, then most latency)."""
    def speed(group: Sequence[int]) -> tuple[float, float]:
        link = link_for_group(cluster, group)
        return link.bandwidth_bytes_per_s, -link.latency_s
    return list(min(groups, key=speed))


def transition_s(name: str, size: float, layout: Parallelism, costing: Costing, backward: bool = True) -> float:
    """Seconds of the transition-table entry ``name`` (`graphpass.transitions.TABLE`) on a full
    tensor of ``size`` bytes over its axis of ``layout``'s mesh: its collectives, each blocking
    one with the link's synchronisation, and its local copies read and written at the device's
    memory bandwidth, as :func:`price` prices a block's; ``backward=False`` leaves out the
    backward part (a value that needs no gradient)."""
    entry = TABLE[name]
    comms = _Collectives(costing.cluster, layout)
    n = layout.mesh[entry.axis] if entry.axis in layout.mesh else 1
    bandwidth = costing.cluster.device.memory_bandwidth_gbps * 1e9 * costing.cluster.device.memory_efficiency
    moved = sum(comms.time(entry.axis, m.kind, moved, m.blocking) for m, moved in entry.movements(size, n, backward=backward))
    copied = sum(2 * c.bytes(size, n) / bandwidth for c in entry.copies if backward or c.phase == FORWARD)
    return moved + copied


def _cuts(block: BlockCost) -> list[int]:
    """Where a per-operator choice may divide the block's operators (largest first): after each
    operator that is strictly larger than the next, so operators of one size share a stage (a
    layer's norms, its equal MLP matrices). At most ``_MAX_CUTS``: the options grow with them."""
    sizes = [o.param_bytes for o in block.ops]
    cuts = [k for k in range(1, len(sizes)) if sizes[k - 1] > sizes[k]]
    return cuts[:_MAX_CUTS]


def choices_for(block: BlockCost, layout: Parallelism, costing: Costing, per_operator: bool = True) -> list[Choice]:
    """The options the ILP may pick for ``block`` on ``mesh``: a ZeRO stage, split and recompute
    for the whole block, and with ``per_operator`` also (OSDP) a higher stage for its largest
    operators' parameters than for the rest (:attr:`Choice.large_ops`)."""
    zeros = (0, 1, 2, 3) if layout.mesh.dp > 1 else (0,)
    recomputes = (False, True) if block.kind == LAYER else (False,)

    def splits(zero: int, split_count: int) -> list[int]:
        # Split with tp: not in the runtime.
        return [1, 2, 4] if zero == 3 and layout.mesh.tp == 1 and split_count else [1]

    out = []
    for zero in zeros:
        for split in splits(zero, block.split_count):
            for recompute in recomputes:
                out.append(Choice(zero, split, recompute))
    out += _offload_choices(block, out, costing)
    if not per_operator or block.expert_params > 0:  # experts keep one stage with their block
        return out
    for k in _cuts(block):
        large_splits = sum(1 for o in block.ops[:k] if o.split_bytes)
        for zero in zeros:
            for rest_zero in (z for z in zeros if z < zero):
                for split in splits(zero, large_splits):
                    for recompute in recomputes:
                        out.append(Choice(zero, split, recompute, large_ops=k, rest_zero=rest_zero))
    return out


def _host_of(costing: Costing):
    host = costing.cluster.host
    if host is None:
        raise ValueError(f"pricing offload needs the cluster's host side (host memory, its link, disk), and cluster "
                         f"{costing.cluster.name or costing.cluster.explain()!r} has none: give one with "
                         "cluster.with_host(memory_bytes=, link_gbps=, memory_bandwidth_gbps=) (presets have theirs)")
    return host


#: Where offload may put a block's parameters' parts (the planner's options; ``Tiers`` allows more).
OFFLOAD_TIERS = (Tiers(gradient="host", optimizer="host"), Tiers("host", "host", "host"))
DISK_TIERS = (Tiers(gradient="host", optimizer="disk"), Tiers("host", "host", "disk"))


def _offload_choices(block: BlockCost, whole: Sequence[Choice], costing: Costing) -> list[Choice]:
    """The whole-block choices ``whole`` (unsplit) with their parameters' parts off the device
    and, for a layer not recomputed, its saved activations on the host: offered where the
    cluster has a host side (:class:`graphpass.cluster.HostSpec`; a disk too for the disk tier)."""
    host = costing.cluster.host
    if host is None or not costing.offload or block.params <= 0:
        return []
    tiers = OFFLOAD_TIERS + (DISK_TIERS if host.disk_bytes else ())
    out = []
    for choice in whole:
        if choice.split > 1:
            continue
        out += [replace(choice, tiers=t) for t in tiers]
        if block.kind == LAYER and not choice.recompute:
            out += [replace(choice, tiers=t, saved_tier="host") for t in (Tiers(), *tiers)]
    return out


def _moved_s(entry: Transition, weight_bytes: float, grad_bytes: float, m: int, comms: _Collectives,
             axis: str = "dp", reduce_axis: str | None = None, across: bool = True) -> float:
    """Time of a data-parallel table entry's movements in one step of ``m`` microbatches over
    ``axis`` (``dp``, HSDP's ``dp_shard``, or ``edp`` for experts): its all-gathers move the
    weights, its reductions the gradients (over ``reduce_axis`` when given: ZeRO-1 under HSDP
    all-reduces over all of dp); where the mesh has replicas of the shards (HSDP), the entry's
    movements across them too, on this rank's shard (not ``across``: DiLoCo's workers, each a
    shard group)."""
    total = 0.0
    replicate = comms.mesh.replicate_axis(axis) if across else None
    n = comms.mesh.size(axis)
    for move in entry.moves(replicas=replicate is not None):
        size = move.size(weight_bytes if move.kind == "all_gather" else grad_bytes, n)
        over = replicate if move.across else (axis if move.kind == "all_gather" else reduce_axis or axis)
        total += (m if move.per == PER_MICROBATCH else 1) * comms.time(over, move.kind, size, move.blocking)
    return total


def _copied_bytes(entry: Transition, weight_bytes: float, grad_bytes: float, n: int, m: int) -> float:
    """Bytes read plus written by a data-parallel table entry's local copies (``Transition.copies``)
    on ``n`` ranks in one step of ``m`` microbatches: forward's copy the weights, backward's
    the gradients."""
    total = 0.0
    for copy in entry.copies:
        size = weight_bytes if copy.phase == FORWARD else grad_bytes
        total += (m if copy.per == PER_MICROBATCH else 1) * 2 * copy.bytes(size, n)
    return total


@dataclass
class _Params:
    """One group of a block's parameters under its ZeRO stage: what it keeps and moves."""

    state: float = 0.0
    grads: float = 0.0
    held: float = 0.0
    bucket: float = 0.0
    dp_comm: float = 0.0
    transient: float = 0.0
    optimizer_s: float = 0.0
    copied: float = 0.0  # bytes its collectives' local copies read and write in a step
    host: float = 0.0  # host memory its offloaded parts keep
    disk: float = 0.0  # disk its disk tier keeps
    link_s: float = 0.0  # device <-> host copies of one step


def _param_terms(params: float, p_bytes: float, tensors: int, zero: int, n: int, axis: str, layout: Parallelism,
                 costing: Costing, comms: _Collectives, split: tuple[float, int, int] = (0.0, 0, 1),
                 divisor: int | None = None, tiers: Tiers = Tiers(), shapes: Sequence[tuple[int, ...]] = ()) -> _Params:
    """``params`` elements (``p_bytes``, ``tensors`` tensors) synchronised over ``n`` ranks of
    ``axis`` at ZeRO stage ``zero``; ``split``: (bytes, linears, parts) of OSDP slices;
    ``shapes``: the parameters' shapes, which a compressed bucket's bytes follow
    (``costing.grad_compression``; without them, priced as one vector: sent whole)."""
    m = layout.microbatches
    g_bytes = params * costing.grad_bytes_per_param
    o_bytes = params * costing.optimizer_bytes_per_param
    plain_dp = zero == 0 and axis == "dp" and n > 1  # what compression and DiLoCo change
    compression = costing.grad_compression if plain_dp else None
    if zero:
        entry = transition("all_gather_params", stage=zero)
    elif compression is not None:
        entry = TABLE[f"dp gradient bucket {compression.kind}"]
    else:
        entry = transition("all_reduce_grads")
    parts = (bucket_parts(compression, shapes or [(max(1, round(params)),)], n, round(costing.grad_bytes_per_param))
             if compression is not None else None)
    out = _Params()
    # State kept all step: the weights (ZeRO: this rank's shard), gradients (full-size below
    # stage 2), optimizer state, and what the table keeps alive through the step: ZeRO-1/2's
    # gathered weights, data parallelism's gradient buckets (their buffers stay between steps).
    out.grads = g_bytes / n if zero >= 2 else g_bytes
    weights = (p_bytes / n if zero else p_bytes) + (entry.step * p_bytes if zero else 0.0)
    out.state = weights + out.grads + (o_bytes / n if zero >= 1 else o_bytes)
    # Gradients that meet the activations: the resident buckets' buffers, and those accumulated
    # over the step's microbatches (buckets hold full ones below ZeRO-2, stages 2/3 sum shards)
    # from the second microbatch on. Expert gradients pass through a bucket even where their
    # group is one rank (ep = dp): it divides them by dp.
    synced = n > 1 or axis == "edp"
    bucketed = zero == 0 and synced
    out.held = max(entry.step * out.grads if bucketed else 0.0, out.grads if m > 1 else 0.0)
    # A bucket is filled from autograd's gradients, which live until it is: once more its size.
    out.bucket = entry.transient * out.grads if bucketed else 0.0
    outer_s = 0.0
    # DiLoCo's workers as HSDP's shard groups: ZeRO inside each, no hop across the replicas but
    # the outer step's, on this rank's shard (its start and momentum kept beside it)
    replicate = layout.mesh.replicate_axis(axis) if zero else None
    workers = costing.diloco is not None and replicate is not None
    # int8 on HSDP's hop across the replicas (the table's "zero replicas int8"), in place of it
    hop = TABLE["zero replicas int8"] if replicate and across_replicas(costing.grad_compression, zero) else None
    across = not workers and hop is None  # the entry's own all-reduce across the replicas
    if hop is not None:
        r = layout.mesh.size(replicate)
        hop_parts = replica_parts(max(1, round(params / n)), r, round(costing.grad_bytes_per_param))
        out.state += hop_parts["padded"] + hop_parts["server"]  # the two errors, kept between steps
        out.dp_comm += m * sum(comms.time(replicate, move.kind, size, move.blocking)
                               for move, size in hop.movements(hop_parts, n, replicas=True))
    if workers:
        out.state += 2 * p_bytes / n
        outer_s = comms.time(replicate, "all_reduce", p_bytes / n, blocking=True) / costing.diloco.inner_steps
    if plain_dp and costing.diloco is not None:
        out.bucket = 0.0  # no buckets: each worker keeps its own gradients (accumulated over microbatches)
        out.held = out.grads if m > 1 else 0.0
        out.state += 2 * p_bytes  # the outer step's shared start and its momentum
        # the outer all-reduce, blocking between two steps (no backward to hide behind): in the
        # tail with the optimizer, once every inner_steps steps
        outer_s = _moved_s(entry, p_bytes, p_bytes, 1, comms, axis) / costing.diloco.inner_steps
    elif parts is not None:  # a compressed bucket: its movements on the parts of its S
        out.dp_comm = max(0.0, sum(comms.time(axis, move.kind, size, move.blocking) for move, size in
                                   entry.movements(parts, n)) - comms.latency(axis, "all_reduce"))
    elif zero == 0:
        # Gradients travel in shared buckets: the latency is charged per bucket in compose().
        out.dp_comm = max(0.0, _moved_s(entry, p_bytes, g_bytes, m, comms, axis) - comms.latency(axis, "all_reduce"))
    elif zero < 3:
        # ZeRO-1 under HSDP all-reduces over the shard group and its replicas at once
        joint = f"{axis},{replicate}" if zero == 1 and replicate and not workers else None
        out.dp_comm += _moved_s(entry, p_bytes, g_bytes, m, comms, axis, joint, across=across)
    else:
        split_bytes, split_count, k = split
        rest = p_bytes - (split_bytes if k > 1 else 0.0)
        slices = split_count * k if k > 1 else 0
        # Each slice is its own gather group, so it also reduce-scatters its gradient alone.
        split_grads = g_bytes * split_bytes / p_bytes if slices and p_bytes else 0.0
        out.dp_comm += _moved_s(entry, rest, g_bytes - split_grads, m, comms, axis, across=across)
        if slices:
            out.dp_comm += slices * _moved_s(entry, split_bytes / slices, split_grads / slices, m, comms, axis,
                                             across=across)
        largest = rest + (split_bytes / slices if slices else 0.0)
        out.transient = entry.transient * largest * (1.0 if p_bytes else 0.0)
    # Optimizer step on this rank's share: measured per element, else its memory traffic (reads
    # and writes weights and state, reads gradients).
    share = 1 / n if zero >= 1 else 1.0
    bandwidth = costing.cluster.device.memory_bandwidth_gbps * 1e9 * costing.cluster.device.memory_efficiency
    if costing.optimizer_s_per_param is not None:
        out.optimizer_s = share * params * costing.optimizer_s_per_param + tensors * costing.optimizer_s_per_tensor
    else:
        out.optimizer_s = share * (2 * p_bytes + g_bytes + 2 * o_bytes) / bandwidth
    out.optimizer_s += outer_s
    if parts is not None:
        out.copied = sum(2 * nbytes * (m if per == PER_MICROBATCH else 1) for _, nbytes, per in entry.copied(parts, n))
    else:
        out.copied = _copied_bytes(entry, p_bytes, g_bytes, n, m) if synced else 0.0
    if hop is not None:
        out.copied += sum(2 * nbytes * (m if per == PER_MICROBATCH else 1) for _, nbytes, per in hop.copied(hop_parts, n))
    if tiers.offloaded:
        _offload_terms(out, tiers, p_bytes / n if zero else p_bytes, o_bytes / n if zero >= 1 else o_bytes,
                       share * g_bytes, zero, m, costing)
    return out


def _offload_terms(out: _Params, tiers: Tiers, stored: float, state: float, grads: float, zero: int, m: int,
                   costing: Costing) -> None:
    """``out``'s terms with its parts where ``tiers`` puts them (:mod:`graphpass.runtime.offload`):
    ``stored`` the bytes of the tensor the optimizer steps (this rank's shard), ``state`` its
    optimizer state, ``grads`` its gradient's bytes there.

    The optimizer off the device: its state (and the master, a copy of the stored tensor) leave
    the device for the host or the disk; it steps there, streaming ``2 stored + grads + 2 state``
    bytes through host memory or the disk; the updated tensor goes up once a step. Gradients on
    the host go down as they land (per microbatch where ZeRO-2/3 reduce every one), off the
    device's state; on the device they go down once after backward, on the step's path.
    Parameters on the host leave the device but for the one being used and the one brought in
    ahead, and come up twice a microbatch (forward, and backward's reload), not once a step (from
    the disk, at its speed, where the master is in a file)."""
    host = _host_of(costing)
    link = host.link_gbps * 1e9
    disk = tiers.optimizer == "disk"
    if disk and not host.disk_bytes:
        raise ValueError(f"optimizer state on disk (offload_to='disk') needs a disk, and cluster "
                         f"{costing.cluster.name or costing.cluster.explain()!r} has Cluster.host.disk_bytes=0: give "
                         "one with cluster.with_host(disk_bytes=, disk_gbps=), or offload_to='host'")
    bandwidth = (host.disk_gbps if disk else host.memory_bandwidth_gbps) * 1e9
    out.state -= state
    kept = stored + state + out.grads  # master, state, and the gradient it steps with
    if disk:
        out.disk += kept
    else:
        out.host += kept
    out.optimizer_s = (2 * stored + grads + 2 * state) / bandwidth
    if tiers.gradient == "host":
        out.link_s += (m if zero >= 2 else 1) * out.grads / link
        out.state -= out.grads
        out.grads = 0.0
        out.held = 0.0
    else:
        out.optimizer_s += out.grads / link
    if tiers.parameter == "host":  # streamed from the master, in a file on the disk tier
        out.state -= stored
        out.transient += 2 * stored
        out.link_s += 2 * m * stored / (min(link, bandwidth) if disk else link)
    else:
        out.link_s += stored / link


def _exchange_s(block: BlockCost, layout: Parallelism, scale: float, slowest: float, comms: _Collectives,
                bandwidth: float) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch's expert exchanges (the ``ep`` entries of
    the table, blocking), their copies included; the slowest rank receives ``slowest`` times the
    balanced rows."""
    forward = backward = 0.0
    for name, size in block.exchanges:
        entry = TABLE[name]
        size = size * scale * (slowest if name != "ep token counts" else 1.0)
        for move, moved in entry.movements(size, layout.mesh.ep):
            moved = comms.time("ep", move.kind, moved, move.blocking)
            if move.phase == FORWARD:
                forward += moved
            else:
                backward += moved
        for phase, copied, _ in entry.copied(size, layout.mesh.ep):
            if phase == FORWARD:
                forward += 2 * copied / bandwidth
            else:
                backward += 2 * copied / bandwidth
    return forward, backward


def ep_all_to_all(blocks: Sequence[BlockCost], layout: Parallelism, costing: Costing) -> str:
    """How the runtime should run the experts' exchanges on ``layout`` (``Plan.ep_all_to_all``):
    ``"hierarchical"`` where the link model prices the two-level all-to-all below the flat one
    for the largest exchange of one microbatch (the pricing above takes the cheaper already),
    else ``"flat"``."""
    group = layout.mesh.group_ranks("ep")
    sizes = [size for b in blocks for name, size in b.exchanges if name == "ep dispatch"]
    if layout.mesh.ep == 1 or not sizes:
        return "flat"
    size = max(sizes) * local_batch(layout, costing.batch) / costing.batch
    flat = collective_time("all_to_all", size, group, costing.cluster, algorithm="ring")
    return "hierarchical" if collective_time("all_to_all", size, group, costing.cluster) < flat else "flat"


def price(block: BlockCost, choice: Choice, layout: Parallelism, costing: Costing, comms: _Collectives) -> Priced:
    """The ILP terms of ``block`` taking ``choice`` on ``mesh`` (:mod:`graphpass.cost.search.stages`)."""
    b = local_batch(layout, costing.batch)
    scale = b / costing.batch * costing.share_activations  # what the largest share keeps and sends
    forward_s, backward_s = (t * costing.share_compute for t in block.times[b])
    ep, m = layout.mesh.ep, layout.microbatches

    bandwidth = costing.cluster.device.memory_bandwidth_gbps * 1e9 * costing.cluster.device.memory_efficiency
    # Tensor-parallel collectives, and their local copies (read and written) as compute.
    tp_forward = tp_backward = 0.0
    for phase, kind, size, blocking in block.tp_traffic:
        moved = comms.time("tp", kind, size * scale, blocking)
        if phase == FORWARD:
            tp_forward += moved
        else:
            tp_backward += moved
    for phase, size in block.tp_copies:
        copied = 2 * size * scale / bandwidth
        if phase == FORWARD:
            forward_s += copied
        else:
            backward_s += copied
    expert = ep > 1 and block.expert_params > 0
    exchange_forward = exchange_backward = 0.0
    if block.expert_params > 0 and (expert or costing.capacity_factor is not None):
        # Experts sharded over ep: the slowest rank's experts compute (and receive) the most
        # rows; a capacity bounds what each expert computes; the exchanges move the rows there
        # and back, blocking (cost/experts.py).
        slowest = expert_imbalance(costing.expert_loads, ep, capacity_factor=costing.capacity_factor)
        expert_forward, expert_backward = block.expert_times[b]
        forward_s += (slowest - 1.0) * expert_forward
        backward_s += (slowest - 1.0) * expert_backward
        if expert:
            exchange_forward, exchange_backward = _exchange_s(block, layout, scale, slowest, comms, bandwidth)
    # A recomputed layer runs its compute again, not its exchanges (collectives stay outside
    # the recomputed regions, their outputs saved).
    recompute_s = (forward_s + tp_forward) if choice.recompute else 0.0
    forward_s += exchange_forward
    backward_s += exchange_backward
    time_s = forward_s + backward_s + tp_forward + tp_backward + recompute_s

    zero = choice.zero
    parts = _dense_parts(block, choice, expert)
    mesh = layout.mesh
    # ZeRO shards over its axis (all of dp, or HSDP's dp_shard); plain data parallelism over dp
    groups = [_param_terms(params, p_bytes, tensors, part_zero, mesh.size(axis), axis, layout, costing, comms, split,
                           tiers=choice.tiers, shapes=() if choice.mixed else block.param_shapes)
              for params, p_bytes, tensors, part_zero, split in parts
              for axis in [mesh.zero_axis() if part_zero else "dp"]]
    if expert:
        # Each rank holds 1/ep of the experts, synchronised (or ZeRO-sharded) over the dp/ep
        # ranks holding the same ones (inside a dp_shard group under HSDP); a group of one rank
        # has nothing to shard.
        axis = mesh.zero_axis(expert=True)
        sharded = zero and mesh.size(axis) > 1
        groups.append(_param_terms(block.expert_params / ep, block.expert_param_bytes / ep, 0,
                                   zero if sharded else 0, mesh.size(axis if sharded else "edp"),
                                   axis if sharded else "edp", layout, costing, comms))
    saved = block.saved_bytes * scale
    act = block.input_bytes * scale if choice.recompute else saved
    if expert and choice.recompute:  # the dispatched rows, an exchange's output, stay saved
        act += sum(size for name, size in block.exchanges if name == "ep dispatch") * scale
    transient = (saved + block.backward_bytes * scale if choice.recompute else 0.0) + sum(g.transient for g in groups)
    host_act = link_s = 0.0
    if choice.saved_tier == "host":
        # Saved on the host after their forward use, back a layer ahead of their backward: the
        # device holds the layer being copied and the one reloaded.
        host_act, act = act, 0.0
        transient += 2 * host_act
        link_s += 2 * m * host_act / (_host_of(costing).link_gbps * 1e9)
    # The compute a stage's collectives overlap with: backward for gradient all-reduces (dp,
    # ZeRO-1's once per step), every forward and backward for ZeRO-2/3's per-microbatch
    # movements. Operators of one block at different stages share it by parameter bytes.
    def window_of(z: int) -> float:
        return backward_s if z <= 1 else m * (forward_s + backward_s)

    total = sum(p_bytes for _, p_bytes, _, _, _ in parts)
    window = (sum(p_bytes * window_of(z) for _, p_bytes, _, z, _ in parts) / total
              if choice.mixed and total > 0 else window_of(zero))
    # The data-parallel collectives' local copies, per microbatch.
    time_s += sum(g.copied for g in groups) / bandwidth / m
    return Priced(time_s, sum(g.optimizer_s for g in groups), sum(g.dp_comm for g in groups),
                  costing.overlap * window, sum(g.state for g in groups) + block.frozen_bytes, act, transient,
                  tp_forward * (2 if choice.recompute else 1) + tp_backward, grad_bytes=sum(g.grads for g in groups),
                  held_bytes=sum(g.held for g in groups), bucket_bytes=sum(g.bucket for g in groups),
                  start_bytes=block.backward_bytes * scale if block.backward_starts_here else 0.0,
                  host_bytes=sum(g.host for g in groups), host_act_bytes=host_act, disk_bytes=sum(g.disk for g in groups),
                  host_link_s=link_s + sum(g.link_s for g in groups),
                  host_window_s=costing.offload_overlap * m * (forward_s + backward_s))


def _dense_parts(block: BlockCost, choice: Choice, expert: bool) -> list[tuple[float, float, int, int, tuple[float, int, int]]]:
    """``(elements, bytes, tensors, zero, split)`` of each part of the block's dense parameters
    that ``choice`` synchronises as one: all of them, or under a per-operator choice its
    ``large_ops`` largest operators' (at ``zero``, with the split) and the rest's (at
    ``rest_zero``). The runtime gathers a layer's parameters by stage, so each part is one
    group (``passes.shard_parameters``)."""
    params = block.params - (block.expert_params if expert else 0.0)
    p_bytes = block.param_bytes - (block.expert_param_bytes if expert else 0.0)
    if not choice.mixed:
        return [(params, p_bytes, block.tensors, choice.zero, (block.split_bytes, block.split_count, choice.split))]
    large = block.ops[:choice.large_ops]
    elements, large_bytes = sum(o.elements for o in large), sum(o.param_bytes for o in large)
    tensors = sum(o.tensors for o in large)
    split = (sum(o.split_bytes for o in large), sum(1 for o in large if o.split_bytes), choice.split)
    return [(elements, large_bytes, tensors, choice.zero, split),
            (params - elements, p_bytes - large_bytes, block.tensors - tensors, choice.rest_zero, (0.0, 0, 1))]


class _Prices:
    """:func:`price` on one mesh, once per distinct block and choice: a model's identical layers
    (equal but for name and index) share their prices, so 96 layers are priced as one."""

    def __init__(self, layout: Parallelism, costing: Costing):
        self.layout, self.costing = layout, costing
        self.comms = _Collectives(costing.cluster, layout)
        self._keys: dict[int, str] = {}
        self._cache: dict[tuple[str, Choice], Priced] = {}

    def key(self, block: BlockCost) -> str:
        """Equal for blocks equal but for their name, layer index and node names."""
        key = self._keys.get(id(block))
        if key is None:
            ops = tuple((o.elements, o.param_bytes, o.tensors, o.split_bytes) for o in block.ops)
            key = self._keys[id(block)] = repr(replace(block, name="", layer=None, ops=ops))
        return key

    def __call__(self, block: BlockCost, choice: Choice) -> Priced:
        key = self.key(block)
        if (key, choice) not in self._cache:
            self._cache[key, choice] = price(block, choice, self.layout, self.costing, self.comms)
        return self._cache[key, choice]
