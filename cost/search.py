r"""The planner's search: meshes, pipeline stages and a per-block strategy ILP. Torch-free.

The unit of decision is a *block*: one repeated layer (``h.3``), or the segment before the first
layer (embeddings: ``"pre"``) or after the last one (final norm, head, loss: ``"post"``). The
graph side (:mod:`graphpass.planner`) measures every block once per tensor-parallel layout
``(tp, sequence_parallel, tp_layout)`` (:attr:`Layout.key`; ``tp_layout`` is Megatron's pattern or
one of the op-level solver's, :mod:`graphpass.planner.op_placement`): compute time per local batch, activations saved for backward,
parameter bytes per tp rank, and the tensor-parallel collectives the pass would emit
(:class:`BlockCost`). Everything below prices and searches with those numbers and the
:class:`~graphpass.cluster.Cluster`'s links.

Search, outermost first:

1. **Mesh** (:func:`meshes`): every ``pp x dp x tp = world`` with ``tp`` dividing the GPUs of one
   node (tensor parallelism never crosses a node), ``pp`` at most the number of blocks, a
   microbatch count ``m`` that divides the per-replica batch, and ``sequence_parallel`` on or off
   when ``tp > 1``. Mesh order is ``(pp, dp, tp)``, tp innermost, as in Megatron-LM.
2. **Stages** (:func:`partition`): contiguous blocks per stage by dynamic programming, minimising
   the slowest stage's compute, subject to a lower bound on each stage's memory (its blocks at
   their smallest choice, times the microbatches the stage keeps in flight under 1F1B).
3. **Per-block choices** (:func:`solve_stage`): ZeRO stage 0-3 inside ``dp``, OSDP operator
   splitting (ZeRO-3 only), activation recomputation (repeated layers only), by an ILP over
   *clusters* of identical blocks: integer ``n[c, o]`` counts how many blocks of cluster ``c``
   take option ``o``, so a 96-layer model is as small a problem as a 1-layer one.

   .. math::

       \min \sum_{c,o} n_{c,o} (m\,t_o + u_o) + E
       \quad\text{s.t.}\quad \sum_o n_{c,o} = |c|,\qquad
       E \ge \sum_{c,o} n_{c,o} (d_o - w_o),\ E \ge 0,

       \sum_{c,o} n_{c,o} (s_o - g_o + h_o + f\,a_o + b_o) \le M,\qquad
       \sum_{c,o} n_{c,o}\, s_o \le M,

       \sum_{c,o} n_{c,o} (s_o + f\,a_o) + r_{c,o}\, z_{c,o} \le M \ \ \forall c, o,
       \qquad n_{c,o} \le |c|\, z_{c,o},\ z \in \{0, 1\}

   with, per block and option: ``t`` the time of one microbatch (forward, backward, recomputed
   forward, tensor-parallel collectives, which sit on the critical path), ``u`` the optimizer
   step, ``d`` the data-parallel collectives of one step and ``w`` the compute they overlap with
   (``E`` is the exposed communication), ``s`` the model state kept all step, ``a`` the
   activations one microbatch keeps until its backward, ``f`` the microbatches in flight, and
   ``r`` the transient bytes alive only while the block runs (ZeRO-3's gathered weights and their
   full gradients, a recomputed layer's rematerialised activations and its backward's working
   set). ``z`` marks the options in use, so the peak includes the largest transient actually
   chosen, not the sum. The first two rows are the two ends of backward: at its start every
   activation is alive but the step's gradients do not exist yet (``g`` the gradients in ``s``;
   ``h`` those held from earlier microbatches when accumulating; ``b`` the loss's gradients, the
   post block's backward working set); at its end every gradient exists and the activations are
   freed. In between, backward frees a layer's activations as it makes its gradients, so the
   sum is largest at one of the ends. The transient rows keep both, conservatively.

Step time of a mesh with ``p`` stages of per-microbatch time ``t_s`` (1F1B / GPipe):
``sum_s t_s + (m - 1) max_s t_s + max_s (E_s + u_s)``; for ``p = 1`` that is ``m t + E + u``.
Interleaved 1F1B with ``v`` stages per rank (rank ``r`` runs ``T_r``, the sum of its stages'
times): ``m max_r T_r + (p - 1) max_c t_c + max_r (E_r + u_r)`` (Narayanan et al. 2021; it
assumes the microbatches fill whole rounds of ``p``); zero-bubble (ZB1P) the same with the
bubble term times ``ZERO_BUBBLE_SHARE`` (:func:`graphpass.cost.memory.zero_bubble_fraction`).
Every stage but the last also pays the send of its output and the return of its gradient. A
stage's microbatches in flight follow its schedule
(:func:`graphpass.cost.memory.in_flight_microbatches`; zero-bubble also keeps output gradients
for its deferred weight gradients, :func:`graphpass.cost.memory.deferred_weight_gradients`); the
search enumerates 1F1B pipelines, and prices GPipe, interleaved and zero-bubble ones for a given
Strategy.
The uniform strategies of the same mesh are priced by the same function and kept when one beats
the ILP's answer under the full step formula (possible for ``p > 1`` only, where the ILP's
per-stage objective is a proxy), so the search never returns a plan slower than a uniform one it
enumerates.

What runs where it is priced: every data-parallel movement and memory effect comes from the
transition table (:mod:`graphpass.transitions`), the one the emitter inserts from: ZeRO-1/2 keep
shards between steps and gather the full weights once per step (their state is ``P + P/dp``
weights), ZeRO-3 gathers in every forward and again in backward, gradients of dp and ZeRO-1
are reduced once per step (held back between microbatches), ZeRO-2/3's every microbatch.
Every collective is priced by :func:`graphpass.cost.collectives.
collective_time` on the group's real ranks (flat ring on the slowest link it spans, or
hierarchical for all-reduce when that is cheaper).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

import numpy as np

from graphpass.cluster import Cluster
from graphpass.mesh import Mesh, pipeline_rank
from graphpass.plan import Choice
from graphpass.transitions import FORWARD, PER_MICROBATCH, TABLE, Transition, transition
from graphpass.progress import Progress
from graphpass.units import format_bytes
from graphpass.cost.collectives import collective_time, sync_time
from graphpass.cost.experts import imbalance as expert_imbalance
from graphpass.cost.memory import ZERO_BUBBLE_SHARE, deferred_weight_gradients, in_flight_microbatches

log = logging.getLogger(__name__)

__all__ = [
    "BlockCost",
    "ep_all_to_all",
    "Choice",
    "Layout",
    "Costing",
    "Priced",
    "Candidate",
    "meshes",
    "partition",
    "price",
    "solve_stage",
    "search",
    "uniform_choices",
    "NoPlanError",
]

PRE, LAYER, POST = "pre", "layer", "post"
#: Microbatch counts tried besides multiples of the pipeline degree (gradient accumulation).
_MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)
#: Pipeline degrees beyond this are not enumerated (no published schedule uses more).
_MAX_PP = 64
#: Weight of hidden data-parallel communication in the ILP objective: breaks ties between choices
#: whose step time is equal (everything overlapped) in favour of the one that moves fewer bytes.
_TIE_BREAK = 1e-3
#: MILP backend of the stage ILP. SCIP, not HiGHS: HiGHS 1.12 prints a debug line to stdout from
#: inside its MIP solver (transformNewIntegerFeasibleSolution) that no option silences, and these
#: problems are a few dozen integer variables, where SCIP is as fast.
_STAGE_BACKEND = "SCIP"
#: Per-operator choices divide a block's operators (largest first) at most at this many sizes.
_MAX_CUTS = 3
#: How many of the fastest per-block candidates are solved again with per-operator options, and
#: the most seconds each may take.
_REFINED = 4
_REFINE_S = 10.0
#: Candidates within this relative step time of the fastest count as tied; the simplest mesh wins.
_TIE_REL = 1e-6


class NoPlanError(ValueError):
    """No mesh and choice fits the memory budget; says the smallest peak any candidate reaches."""


# --------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class OpParams:
    """The trainable parameters an operator of a block reads first (weight and bias of a
    linear, a norm's scale and shift): the unit of a per-operator ZeRO choice (OSDP).

    Attributes:
        op: the operator's node name.
        params: its parameters' node names.
        elements: their elements on one rank (after tensor-parallel sharding).
        param_bytes: their bytes.
        tensors: how many tensors.
        split_bytes: the weight bytes operator splitting would cut when the operator is a
            splittable linear, else 0.
    """

    op: str
    params: tuple[str, ...]
    elements: float
    param_bytes: float
    tensors: int
    split_bytes: float = 0.0


@dataclass(frozen=True)
class BlockCost:
    """One block under one tensor-parallel layout, per rank, measured at the reference batch.

    Attributes:
        name: ``"pre"``, ``"layer 3"``, ``"post"``.
        kind: ``"pre"``, ``"layer"`` or ``"post"``.
        signature: equal for identical blocks (same ops, shapes and parameters): they cluster.
        layer: repeated-layer index, None for pre/post.
        params: trainable elements this rank holds (after tensor-parallel sharding).
        tensors: trainable parameter tensors (what a foreach optimizer steps one by one).
        param_bytes: bytes of those parameters in their dtype.
        split_bytes: bytes of the linears operator splitting would cut (0: nothing to split).
        split_count: how many such linears.
        times: local batch size -> (forward_s, backward_s) of the block's compute.
        saved_bytes: activations saved for backward at the reference batch.
        input_bytes: the block's input activation at the reference batch (what recomputation keeps).
        output_bytes: the activation the block hands to the next (a pipeline send).
        tp_traffic: ``(phase, kind, bytes, blocking)`` of each tensor-parallel collective at the
            reference batch, phase ``"forward"`` or ``"backward"`` (``Movement.blocking``).
        tp_copies: ``(phase, bytes written)`` of each tensor-parallel op's local copies at the
            reference batch, every microbatch (``Transition.copies``).
        backward_bytes: the most the block's backward allocates beyond what was alive when
            backward reached it, at the reference batch. The last block's (the post block's:
            the loss's gradients, the logits' and the loss's own) meets every activation at the
            start of backward; a recomputed layer's comes on top of its rematerialised
            activations.
        backward_starts_here: the last block of the model, whose backward runs first.
        weight_grad_bytes: the output gradients of the block's ops that read a trainable
            parameter, at the reference batch: what a split backward keeps from the input
            gradient's pass to the weight gradient's (zero-bubble schedules).
        expert_params: the trainable elements of Mixture-of-Experts expert weights among
            ``params`` (what an ``ep`` axis shards); 0 for a block without experts.
        expert_param_bytes: their bytes.
        num_experts: experts per MoE layer of the block (``ep`` must divide it); 0 without.
        expert_times: local batch size -> (forward_s, backward_s) of the experts' part of
            ``times`` (the grouped products and what lies between them).
        exchanges: ``(table entry, S bytes at the reference batch)`` of each exchange expert
            parallelism would emit (``"ep token counts"``, ``"ep dispatch"``, ``"ep combine"``
            per MoE layer).
        ops: the block's dense (non-expert) trainable parameters by the operator that reads
            them first, largest first: what a per-operator choice (``Choice.large_ops``) divides.
    """

    name: str
    kind: str
    signature: str
    layer: int | None
    params: float
    param_bytes: float
    split_bytes: float
    split_count: int
    times: Mapping[int, tuple[float, float]]
    saved_bytes: float
    input_bytes: float
    output_bytes: float
    tp_traffic: tuple[tuple[str, str, float, bool], ...] = ()
    tp_copies: tuple[tuple[str, float], ...] = ()
    backward_bytes: float = 0.0
    tensors: int = 0
    backward_starts_here: bool = False
    weight_grad_bytes: float = 0.0
    expert_params: float = 0.0
    expert_param_bytes: float = 0.0
    num_experts: int = 0
    expert_times: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    exchanges: tuple[tuple[str, float], ...] = ()
    ops: tuple[OpParams, ...] = ()


@dataclass(frozen=True)
class Layout:
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
           ep: int = 1) -> "Layout":
        return cls(Mesh.of(pp=pp, dp=dp, tp=tp, ep=ep), microbatches, sequence_parallel)

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
        if self.microbatches > 1:
            text += f" m={self.microbatches}"
        if self.sequence_parallel:
            text += " sp"
        if self.tp_layout != "megatron":
            text += f" ({self.tp_layout})"
        if self.mesh.pp > 1 and self.schedule != "1f1b":
            text += f" {self.schedule}" + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
        return text


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
            few stages are busy, give it back (:func:`_shared_host_step`); the rest (shared DRAM
            and caches) stays.
        expert_loads: the share of routed rows each expert of a Mixture-of-Experts layer
            receives (measured or :func:`graphpass.cost.experts.zipf_loads`); None: balanced.
            Under ``ep`` the slowest rank's experts set the pace (:mod:`graphpass.cost.experts`).
        capacity_factor: the MoE layers' capacity factor (None: dropless): each expert computes
            at most ``cf / E`` of the routed rows.
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


@dataclass
class Candidate:
    """A priced mesh + stages + per-block choices."""

    layout: Layout
    stages: list[list[int]]
    choices: list[Choice]
    priced: list[Priced]
    stage_times_s: list[float]  # per pp rank: one microbatch through its stages
    stage_peaks_bytes: list[float]  # per pp rank
    step_time_s: float
    exposed_comm_s: float
    optimal: bool = True
    gap: float = 0.0
    how: str = "ilp"
    #: (label, step time, peak) of the uniform baselines priced on this mesh, for explain().
    uniform: list[tuple[str, float, float]] = field(default_factory=list)
    #: the slowest tail after the schedule: exposed data-parallel communication + optimizer step.
    tail_s: float = 0.0

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.stage_peaks_bytes)


# ------------------------------------------------------------------------------------- meshes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(cluster: Cluster, batch: int, tps: Iterable[int], num_blocks: int, num_experts: int = 0) -> list[Layout]:
    """Every mesh the search considers (see the module docstring); ``tps`` are the tp degrees the
    model's layout allows; with ``num_experts`` (a Mixture-of-Experts model), every ``ep``
    dividing both ``dp`` and the experts too."""
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
            for m in sorted(counts):
                for sp in ((False, True) if tp > 1 else (False,)):
                    for ep in eps:
                        out.append(Layout.of(pp, dp, tp, m, sp, ep))
    return out


def local_batch(layout: Layout, batch: int) -> int:
    """Samples in one microbatch on one rank."""
    return batch // (layout.mesh.dp * layout.microbatches)


# ------------------------------------------------------------------------------------ pricing


class _Collectives:
    """Memoised collective times for one mesh, on rank 0's groups (a pipeline neighbour pair for
    ``pp``)."""

    def __init__(self, cluster: Cluster, layout: Layout):
        self.cluster = cluster
        mesh = layout.mesh
        self.groups = {axis: mesh.group_ranks(axis) for axis in ("dp", "tp", "ep", "edp")}
        self.groups["pp"] = mesh.group_ranks("pp")[:2]
        self.memo: dict[tuple[str, str, float], float] = {}
        self.syncs: dict[str, float] = {}

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
            self.memo[key] = collective_time(kind, size, group, self.cluster)
        return self.memo[key] + (self.sync(axis) if blocking else 0.0)

    def sync(self, axis: str) -> float:
        """The synchronisation cost of one blocking collective over ``axis`` (``sync_time``)."""
        if axis not in self.syncs:
            self.syncs[axis] = sync_time(self._group(axis), self.cluster)
        return self.syncs[axis]

    def _group(self, axis: str) -> Sequence[int]:
        return self.groups[axis]


def transition_s(name: str, size: float, layout: Layout, costing: Costing, backward: bool = True) -> float:
    """Seconds of the transition-table entry ``name`` (`graphpass.transitions.TABLE`) on a full
    tensor of ``size`` bytes over its axis of ``layout``'s mesh: its collectives, each blocking
    one with the link's synchronisation, and its local copies read and written at the device's
    memory bandwidth, as :func:`price` prices a block's; ``backward=False`` leaves out the
    backward part (a value that needs no gradient)."""
    entry = TABLE[name]
    comms = _Collectives(costing.cluster, layout)
    n = layout.mesh[entry.axis] if entry.axis in layout.mesh else 1
    bandwidth = costing.cluster.device.memory_bandwidth_gbps * 1e9 * costing.cluster.device.memory_efficiency
    moved = sum(comms.time(entry.axis, m.kind, m.factor * size, m.blocking) for m in entry.collectives
                if backward or m.phase == FORWARD)
    copied = sum(2 * c.bytes(size, n) / bandwidth for c in entry.copies if backward or c.phase == FORWARD)
    return moved + copied


def _cuts(block: BlockCost) -> list[int]:
    """Where a per-operator choice may divide the block's operators (largest first): after each
    operator that is strictly larger than the next, so operators of one size share a stage (a
    layer's norms, its equal MLP matrices). At most ``_MAX_CUTS``: the options grow with them."""
    sizes = [o.param_bytes for o in block.ops]
    cuts = [k for k in range(1, len(sizes)) if sizes[k - 1] > sizes[k]]
    return cuts[:_MAX_CUTS]


def choices_for(block: BlockCost, layout: Layout, costing: Costing, per_operator: bool = True) -> list[Choice]:
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


def _moved_s(entry: Transition, weight_bytes: float, grad_bytes: float, m: int, comms: _Collectives,
             axis: str = "dp") -> float:
    """Time of a data-parallel table entry's movements in one step of ``m`` microbatches over
    ``axis`` (``dp``, or ``edp`` for experts): its all-gathers move the weights, its reductions
    the gradients."""
    total = 0.0
    for move in entry.collectives:
        size = (weight_bytes if move.kind == "all_gather" else grad_bytes) * move.factor
        total += (m if move.per == PER_MICROBATCH else 1) * comms.time(axis, move.kind, size, move.blocking)
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


def _param_terms(params: float, p_bytes: float, tensors: int, zero: int, n: int, axis: str, layout: Layout,
                 costing: Costing, comms: _Collectives, split: tuple[float, int, int] = (0.0, 0, 1),
                 divisor: int | None = None) -> _Params:
    """``params`` elements (``p_bytes``, ``tensors`` tensors) synchronised over ``n`` ranks of
    ``axis`` at ZeRO stage ``zero``; ``split``: (bytes, linears, parts) of OSDP slices."""
    m = layout.microbatches
    g_bytes = params * costing.grad_bytes_per_param
    o_bytes = params * costing.optimizer_bytes_per_param
    entry = transition("all_reduce_grads") if zero == 0 else transition("all_gather_params", stage=zero)
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
    if zero == 0:
        # Gradients travel in shared buckets: the latency is charged per bucket in compose().
        out.dp_comm = max(0.0, _moved_s(entry, p_bytes, g_bytes, m, comms, axis) - comms.latency(axis, "all_reduce"))
    elif zero < 3:
        out.dp_comm = _moved_s(entry, p_bytes, g_bytes, m, comms, axis)
    else:
        split_bytes, split_count, k = split
        rest = p_bytes - (split_bytes if k > 1 else 0.0)
        slices = split_count * k if k > 1 else 0
        # Each slice is its own gather group, so it also reduce-scatters its gradient alone.
        split_grads = g_bytes * split_bytes / p_bytes if slices and p_bytes else 0.0
        out.dp_comm = _moved_s(entry, rest, g_bytes - split_grads, m, comms, axis)
        if slices:
            out.dp_comm += slices * _moved_s(entry, split_bytes / slices, split_grads / slices, m, comms, axis)
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
    out.copied = _copied_bytes(entry, p_bytes, g_bytes, n, m) if synced else 0.0
    return out


def _exchange_s(block: BlockCost, layout: Layout, scale: float, slowest: float, comms: _Collectives,
                bandwidth: float) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch's expert exchanges (the ``ep`` entries of
    the table, blocking), their copies included; the slowest rank receives ``slowest`` times the
    balanced rows."""
    forward = backward = 0.0
    for name, size in block.exchanges:
        entry = TABLE[name]
        size = size * scale * (slowest if name != "ep token counts" else 1.0)
        for move in entry.collectives:
            moved = comms.time("ep", move.kind, move.factor * size, move.blocking)
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


def ep_all_to_all(blocks: Sequence[BlockCost], layout: Layout, costing: Costing) -> str:
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


def price(block: BlockCost, choice: Choice, layout: Layout, costing: Costing, comms: _Collectives) -> Priced:
    """The ILP terms of ``block`` taking ``choice`` on ``mesh`` (see the module docstring)."""
    b = local_batch(layout, costing.batch)
    scale = b / costing.batch
    forward_s, backward_s = block.times[b]
    dp, ep, m = layout.mesh.dp, layout.mesh.ep, layout.microbatches

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
    groups = [_param_terms(params, p_bytes, tensors, part_zero, dp, "dp", layout, costing, comms, split)
              for params, p_bytes, tensors, part_zero, split in parts]
    if expert:
        # Each rank holds 1/ep of the experts, synchronised (or ZeRO-sharded) over the dp/ep
        # ranks holding the same ones; a group of one rank has nothing to shard.
        edp = dp // ep
        groups.append(_param_terms(block.expert_params / ep, block.expert_param_bytes / ep, 0,
                                   zero if edp > 1 else 0, edp, "edp", layout, costing, comms))
    saved = block.saved_bytes * scale
    act = block.input_bytes * scale if choice.recompute else saved
    if expert and choice.recompute:  # the dispatched rows, an exchange's output, stay saved
        act += sum(size for name, size in block.exchanges if name == "ep dispatch") * scale
    transient = (saved + block.backward_bytes * scale if choice.recompute else 0.0) + sum(g.transient for g in groups)
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
                  costing.overlap * window, sum(g.state for g in groups), act, transient,
                  tp_forward * (2 if choice.recompute else 1) + tp_backward, grad_bytes=sum(g.grads for g in groups),
                  held_bytes=sum(g.held for g in groups), bucket_bytes=sum(g.bucket for g in groups),
                  start_bytes=block.backward_bytes * scale if block.backward_starts_here else 0.0)


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


# ------------------------------------------------------------------------------------- stages


def _stage_flight(layout: Layout, stage: int) -> float:
    if layout.mesh.pp == 1:
        return 1
    return in_flight_microbatches(layout.mesh.pp, layout.microbatches, stage, layout.schedule, layout.virtual_stages)


def partition(blocks: Sequence[BlockCost], layout: Layout, costing: Costing, comms: _Collectives,
              options: Sequence[Sequence[tuple[Choice, Priced]]]) -> list[list[int]] | None:
    """Contiguous stages minimising the slowest stage's fastest-choice time, each stage's memory
    lower bound within the budget; None when no split fits."""
    n, p = len(blocks), layout.num_stages
    if p == 1:
        return [list(range(n))]
    fastest = [min(pr.time_s for _, pr in opts) for opts in options]
    prefix = [0.0]
    for t in fastest:
        prefix.append(prefix[-1] + t)
    limit = costing.memory_limit_bytes
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[-1] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for s in range(1, p + 1):
        flight = _stage_flight(layout, s - 1)
        start_floor = [min(pr.start_peak_bytes(flight) for _, pr in opts) for opts in options]
        end_floor = [min(pr.end_peak_bytes() for _, pr in opts) for opts in options]
        base_floor = [min(pr.state_bytes + flight * pr.act_bytes for _, pr in opts) for opts in options]
        spike = [min(pr.transient_bytes for _, pr in opts) for opts in options]
        for j in range(s, n - (p - s) + 1):
            start = end = base = peak = 0.0
            for i in range(j - 1, s - 2, -1):  # stage s covers blocks i..j-1
                start += start_floor[i]
                end += end_floor[i]
                base += base_floor[i]
                peak = max(peak, spike[i])
                if max(start, end, base + peak if peak > 0 else 0.0) > limit:
                    break
                if best[s - 1][i] == inf:
                    continue
                value = max(best[s - 1][i], prefix[j] - prefix[i])
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    if best[p][n] == inf:
        return None
    stages, j = [], n
    for s in range(p, 0, -1):
        i = cut[s][j]
        stages.append(list(range(i, j)))
        j = i
    return stages[::-1]


def solve_stage(blocks: Sequence[BlockCost], indices: Sequence[int], options: Sequence[Sequence[tuple[Choice, Priced]]],
                layout: Layout, flight: int, costing: Costing, deadline: float) -> tuple[dict[int, int], bool, float] | None:
    """The clustered stage ILP; returns block index -> option index, optimality, gap (None: infeasible)."""
    from ortools.linear_solver import pywraplp

    clusters: dict[str, list[int]] = {}
    for i in indices:
        clusters.setdefault(blocks[i].signature + f"|{blocks[i].kind}", []).append(i)
    solver = pywraplp.Solver.CreateSolver(_STAGE_BACKEND)
    solver.SuppressOutput()
    inf = solver.infinity()
    m = layout.microbatches
    limit = costing.memory_limit_bytes
    mem_scale = 1.0 / max(limit, 1.0)
    counts, used = {}, {}
    objective = solver.Objective()
    exposed = solver.NumVar(0.0, inf, "exposed")
    objective.SetCoefficient(exposed, 1.0)
    comm_row = solver.Constraint(-inf, 0.0)
    comm_row.SetCoefficient(exposed, -1.0)
    start_row = solver.Constraint(-inf, 1.0)  # the start of backward: every activation alive
    # The end of backward: every gradient made, and the bucket being filled at its largest.
    spike = _bucket_spike(sum(max(pr.bucket_bytes for _, pr in options[i]) for i in indices), costing)
    end_row = solver.Constraint(-inf, 1.0 - spike * mem_scale)
    for key, members in clusters.items():
        rep = members[0]
        pick = solver.Constraint(len(members), len(members))
        for o, (_, pr) in enumerate(options[rep]):
            n = solver.IntVar(0, len(members), f"n[{key},{o}]")
            counts[key, o] = n
            pick.SetCoefficient(n, 1.0)
            # Ties (communication fully hidden) go to the option that communicates least.
            objective.SetCoefficient(n, m * pr.time_s + pr.optimizer_s + _TIE_BREAK * pr.dp_comm_s)
            comm_row.SetCoefficient(n, pr.dp_comm_s - pr.window_s)
            start_row.SetCoefficient(n, pr.start_peak_bytes(flight) * mem_scale)
            end_row.SetCoefficient(n, pr.end_peak_bytes() * mem_scale)
            if pr.transient_bytes > 0:
                used[key, o] = solver.BoolVar(f"z[{key},{o}]")
                link = solver.Constraint(-inf, 0.0)
                link.SetCoefficient(n, 1.0)
                link.SetCoefficient(used[key, o], -float(len(members)))
    for (key, o), z in used.items():
        row = solver.Constraint(-inf, 1.0)
        layer_transient = blocks[clusters[key][0]].kind == LAYER
        for (k2, o2), n in counts.items():
            pr = options[clusters[k2][0]][o2][1]
            # A layer's transient (in its backward) never meets the post block's activations:
            # backward frees them before it reaches any layer.
            act = 0.0 if layer_transient and blocks[clusters[k2][0]].kind == POST else pr.act_bytes
            row.SetCoefficient(n, (pr.state_bytes + flight * act) * mem_scale)
        row.SetCoefficient(z, options[clusters[key][0]][o][1].transient_bytes * mem_scale)
    objective.SetMinimization()
    if math.isfinite(deadline):
        solver.SetTimeLimit(max(1, int(1000 * max(0.05, deadline - time.perf_counter()))))
    status = solver.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None
    assignment: dict[int, int] = {}
    for key, members in clusters.items():
        queue = list(members)
        for o in range(len(options[members[0]])):
            for _ in range(int(round(counts[key, o].solution_value()))):
                assignment[queue.pop(0)] = o
    optimal = status == pywraplp.Solver.OPTIMAL
    value = objective.Value()
    gap = 0.0 if optimal else max(0.0, value - objective.BestBound()) / max(abs(value), 1e-12)
    return assignment, optimal, gap


# -------------------------------------------------------------------------------- composition


def _stage_peak(blocks: Sequence[BlockCost], indices: Sequence[int], priced: Sequence[Priced], flight: int,
                costing: Costing) -> float:
    """The largest of: the start of backward (every activation, no new gradient yet, the loss's
    gradients), the end of backward (every gradient, no activation), and each transient with
    the state and activations it may meet (a layer's transient comes after backward freed the
    post block's activations)."""
    start = sum(priced[i].start_peak_bytes(flight) for i in indices)
    end = sum(priced[i].end_peak_bytes() for i in indices) + _bucket_spike(sum(priced[i].bucket_bytes for i in indices), costing)
    base = sum(priced[i].state_bytes + flight * priced[i].act_bytes for i in indices)
    post = sum(flight * priced[i].act_bytes for i in indices if blocks[i].kind == POST)
    spikes = [priced[i].transient_bytes - (post if blocks[i].kind == LAYER else 0.0)
              for i in indices if priced[i].transient_bytes > 0]
    return max(start, end, base + max(spikes, default=-math.inf))


def compose(blocks: Sequence[BlockCost], layout: Layout, stages: list[list[int]], choices: list[Choice],
            priced: list[Priced], costing: Costing, comms: _Collectives, how: str,
            optimal: bool = True, gap: float = 0.0) -> Candidate:
    """Step time and per-stage peaks of a full assignment (the formula in the module docstring)."""
    b = local_batch(layout, costing.batch)
    scale = b / costing.batch
    chunk_times = []
    for s, indices in enumerate(stages):
        t = sum(priced[i].time_s for i in indices)
        if s + 1 < len(stages):  # activation forward, its gradient back
            t += 2 * comms.time("pp", "send_recv", blocks[indices[-1]].output_bytes * scale)
        chunk_times.append(t)
    # What each pp rank runs: one stage, or several under an interleaved schedule.
    ranks = [[s for s in range(len(stages)) if layout.rank_of(s) == r] for r in range(min(layout.mesh.pp, len(stages)))]
    stage_times, tails, peaks, exposed = [], [], [], []
    m = layout.microbatches
    for held in ranks:
        indices = [i for s in held for i in stages[s]]
        # The end of backward waits for every asynchronous data-parallel collective at once.
        comm = sum(priced[i].dp_comm_s - priced[i].window_s for i in indices) + _bucket_latency(
            blocks, indices, choices, layout, costing, comms) + comms.sync("dp")
        tails.append(max(0.0, comm) + sum(priced[i].optimizer_s for i in indices))
        exposed.append(max(0.0, comm))
        stage_times.append(sum(chunk_times[s] for s in held))
        peak = _stage_peak(blocks, indices, priced, _stage_flight(layout, held[0]), costing)
        if layout.schedule == "zero_bubble":  # weight gradients deferred past the input gradients
            split = [i for s in held if s > 0 for i in stages[s]]  # stage 0 runs whole backwards
            peak += deferred_weight_gradients(layout.mesh.pp, m, held[0], layout.virtual_stages) * scale * sum(
                blocks[i].weight_grad_bytes for i in split)
        peaks.append(peak)
    if layout.schedule == "zero_bubble":
        # ZB1P (Qi et al. 2024): deferred weight-gradient backwards fill all but the forwards'
        # share of the interleaved bubble.
        path = m * max(stage_times) + ZERO_BUBBLE_SHARE * (layout.mesh.pp - 1) * max(chunk_times)
    elif layout.virtual_stages > 1:
        # Interleaved 1F1B (Narayanan et al. 2021, section 2.2): the bubble shrinks to p - 1
        # chunk times, at the price of v times as many sends (in the chunk times above).
        path = m * max(stage_times) + (layout.mesh.pp - 1) * max(chunk_times)
    else:  # GPipe and 1F1B: the same bubble, (p - 1) stage times when the stages are equal
        path = sum(stage_times) + (m - 1) * max(stage_times)
    # Zero-bubble's deferred weight gradients keep the ramps' idle stages busy but for the
    # forwards' share.
    fill = 1.0 - ZERO_BUBBLE_SHARE if layout.schedule == "zero_bubble" else 0.0
    step = _shared_host_step(path, layout.mesh.pp, m * layout.virtual_stages, costing.host_contention,
                             costing.host_oversubscription, fill) + max(tails)
    return Candidate(layout, stages, list(choices), list(priced), stage_times, peaks, step, max(exposed), optimal, gap, how,
                     tail_s=max(tails))


def _shared_host_step(path: float, pp: int, units: int, contention: float, oversubscription: float,
                      fill: float = 0.0) -> float:
    """A pipeline's schedule time ``path`` (priced with stage times that hold the contention
    ``contention`` of every rank of a shared host computing at once) for the concurrency the
    schedule really has. Its ``units + pp - 1`` slots (``units`` microbatch chunks per rank:
    ``m``, or ``m * v`` interleaved) keep ``k = 1, 2, .., pp, .., 2, 1`` stages busy; a slot
    with ``k`` of ``pp`` stages busy has ``k / pp`` of the ranks' threads on the cores, so the
    cores' share of the contention (``oversubscription``, the threads over the cores with every
    rank busy) falls to ``max(1, oversubscription * k / pp)`` while the rest (shared DRAM and
    caches, ``contention / oversubscription``) stays. ``fill``: the share of a ramp's idle
    stages that other work keeps busy anyway (zero-bubble's deferred weight gradients), so
    ``k + fill (pp - k)`` count as busy. With ``contention`` 1 (GPUs share nothing) or no more
    threads than cores, that is ``path``.

    Measured on 4 CPU ranks over 2 cores (contention 2.2-2.3, oversubscription 2): pp 4 1F1B
    m 4 took 492-541 ms where ``path`` at full contention predicted 844 ms
    (bench/results/cpu-fidelity-pipeline.txt)."""
    oversubscription = min(max(1.0, oversubscription), max(1.0, contention))
    if oversubscription <= 1.0:
        return path
    slots = units + pp - 1
    busy = [min(j + 1, pp, units, slots - j) for j in range(slots)]
    return path * sum(max(1.0, oversubscription * (k + fill * (pp - k)) / pp) for k in busy) / (slots * oversubscription)


def _bucket_latency(blocks: Sequence[BlockCost], indices: Sequence[int], choices: Sequence[Choice], layout: Layout,
                    costing: Costing, comms: _Collectives) -> float:
    """One all-reduce latency per gradient bucket of the stage's pure data-parallel blocks (ZeRO
    stages reduce per parameter group: their latency is in each block's price)."""
    grads = sum(params * costing.grad_bytes_per_param for i in indices
                for params, _, _, zero, _ in _dense_parts(blocks[i], choices[i], False) if zero == 0)
    if grads <= 0 or layout.mesh.dp == 1:
        return 0.0
    return math.ceil(grads / costing.bucket_cap_bytes) * comms.latency("dp", "all_reduce")


def uniform_choices(blocks: Sequence[BlockCost], choice: Choice) -> list[Choice]:
    """``choice`` on every block, with recompute only where it applies (repeated layers) and
    split only where there is something to split."""
    return [
        replace(choice, recompute=choice.recompute and b.kind == LAYER,
                split=choice.split if b.split_count else 1)
        for b in blocks
    ]


class _Prices:
    """:func:`price` on one mesh, once per distinct block and choice: a model's identical layers
    (equal but for name and index) share their prices, so 96 layers are priced as one."""

    def __init__(self, layout: Layout, costing: Costing):
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


def evaluate(blocks: Sequence[BlockCost], layout: Layout, choices: list[Choice], costing: Costing,
             stages: list[list[int]] | None = None, prices: _Prices | None = None) -> Candidate | None:
    """Price one fixed assignment (a uniform baseline) on ``mesh``; stages by :func:`partition`
    unless given. None when no stage split exists at all."""
    prices = prices or _Prices(layout, costing)
    comms = prices.comms
    priced = [prices(b, c) for b, c in zip(blocks, choices)]
    if stages is None:
        stages = partition(blocks, layout, replace(costing, memory_limit_bytes=math.inf), comms,
                           [[(c, p)] for c, p in zip(choices, priced)])
        if stages is None:
            return None
    return compose(blocks, layout, stages, choices, priced, costing, comms, "fixed")


def _undominated(options: list[tuple[Choice, Priced]], m: int) -> list[tuple[Choice, Priced]]:
    """The options no other option beats or ties on every term the stage ILP and the stage
    split read (time, optimizer, communication and its overlap, each memory row; the first of
    equals stays): dropping them leaves every optimum in place and keeps the per-operator
    options' model small."""
    def terms(pr: Priced) -> tuple[float, ...]:
        return (m * pr.time_s + pr.optimizer_s, pr.dp_comm_s, pr.dp_comm_s - pr.window_s,
                pr.state_bytes - pr.grad_bytes + pr.held_bytes + pr.start_bytes, pr.act_bytes, pr.state_bytes,
                pr.transient_bytes, pr.bucket_bytes, pr.time_s)

    rows = np.array([terms(pr) for _, pr in options])
    # beats[j, i]: option j is no worse than option i on every term; equal rows: the first stays.
    beats = (rows[:, None, :] <= rows[None, :, :]).all(axis=2)
    equal = (rows[:, None, :] == rows[None, :, :]).all(axis=2)
    order = np.arange(len(options))
    beats &= ~equal | (order[:, None] < order[None, :])
    np.fill_diagonal(beats, False)
    return [options[i] for i in np.flatnonzero(~beats.any(axis=0))]


@dataclass
class _MeshOptions:
    """One mesh's priced options: what each block is offered, and the undominated ones."""

    prices: _Prices
    offered: list[list[Choice]]
    options: list[list[tuple[Choice, Priced]]]


def _mesh_options(blocks: Sequence[BlockCost], layout: Layout, costing: Costing, per_operator: bool) -> _MeshOptions:
    prices = _Prices(layout, costing)
    offered = [choices_for(b, layout, costing, per_operator) for b in blocks]
    kept: dict[str, list[tuple[Choice, Priced]]] = {}  # identical blocks keep the same options
    options = []
    for b, cs in zip(blocks, offered):
        key = prices.key(b)
        if key not in kept:
            kept[key] = _undominated([(c, prices(b, c)) for c in cs], layout.microbatches)
        options.append(kept[key])
    return _MeshOptions(prices, offered, options)


def step_floor(layout: Layout, options: Sequence[Sequence[tuple[Choice, Priced]]], costing: Costing) -> float:
    """A step time no assignment on ``layout`` beats (0 where none is derived): every block at its
    fastest option, spread perfectly over the stages. With ``T`` the sum of those per-microbatch
    times over ``p`` stages, the 1F1B/GPipe path ``sum_s t_s + (m - 1) max_s t_s`` is at least
    ``T + (m - 1) T / p``; the slowest rank's tail (exposed dp communication and optimizer) is
    at least the ranks' mean of the smallest of each."""
    if layout.virtual_stages != 1 or layout.schedule not in ("1f1b", "gpipe"):
        return 0.0
    p, m = layout.num_stages, layout.microbatches
    total = sum(min(pr.time_s for _, pr in opts) for opts in options)
    comm = sum(min(pr.dp_comm_s - pr.window_s for _, pr in opts) for opts in options)
    optimizer = sum(min(pr.optimizer_s for _, pr in opts) for opts in options)
    path = total + (m - 1) * total / p
    return (_shared_host_step(path, layout.mesh.pp, m, costing.host_contention, costing.host_oversubscription)
            + (max(0.0, comm) + optimizer) / p)


def solve_mesh(blocks: Sequence[BlockCost], layout: Layout, costing: Costing, deadline: float,
               baselines: Sequence[Choice] = (), per_operator: bool = True,
               prepared: _MeshOptions | None = None) -> tuple[Candidate | None, float]:
    """The best assignment on one mesh, and the smallest stage peak any assignment could reach
    (for the infeasibility report). ``per_operator=False`` offers whole-block choices only (the
    per-block plan)."""
    prepared = prepared or _mesh_options(blocks, layout, costing, per_operator)
    prices, offered, options = prepared.prices, prepared.offered, prepared.options
    comms = prices.comms
    smallest = _smallest_peak(layout, options)
    stages = partition(blocks, layout, costing, comms, options)
    if stages is None:
        return None, smallest
    choices: list[Choice] = [Choice()] * len(blocks)
    priced: list[Priced] = [options[i][0][1] for i in range(len(blocks))]
    optimal, gap = True, 0.0
    # Stages with the same blocks (by signature) and the same microbatches in flight have the
    # same answer: solve once, reuse by position.
    cache: dict[tuple, tuple[list[int], bool, float] | None] = {}
    for s, indices in enumerate(stages):
        flight = _stage_flight(layout, s)
        key = (tuple(blocks[i].signature + blocks[i].kind for i in indices), flight)
        if key not in cache:
            solved = solve_stage(blocks, indices, options, layout, flight, costing, deadline)
            cache[key] = None if solved is None else ([solved[0][i] for i in indices], solved[1], solved[2])
        if cache[key] is None:
            return None, smallest
        positions, stage_optimal, stage_gap = cache[key]
        optimal &= stage_optimal
        gap = max(gap, stage_gap)
        for i, o in zip(indices, positions):
            choices[i], priced[i] = options[i][o]
    best = compose(blocks, layout, stages, choices, priced, costing, comms, "ilp", optimal, gap)
    uniform_prices = []
    for base in baselines:  # a uniform assignment can win only through the pipeline max term
        uniform = uniform_choices(blocks, base)
        if any(c not in cs for c, cs in zip(uniform, offered)):
            continue
        cand = evaluate(blocks, layout, uniform, costing, stages, prices)
        if cand is None:
            continue
        uniform_prices.append((str(base), cand.step_time_s, cand.peak_memory_bytes))
        if cand.peak_memory_bytes <= costing.memory_limit_bytes and cand.step_time_s < best.step_time_s:
            cand.how = f"uniform {base}"
            best = cand
    best.uniform = uniform_prices
    return best, smallest


def _smallest_peak(layout: Layout, options: Sequence[Sequence[tuple[Choice, Priced]]]) -> float:
    """A lower bound of the peak on this mesh: every block at its smallest, spread over pp stages."""
    flight = _stage_flight(layout, 0)
    start = sum(min(pr.start_peak_bytes(flight) for _, pr in opts) for opts in options)
    end = sum(min(pr.end_peak_bytes() for _, pr in opts) for opts in options)
    base = sum(min(pr.state_bytes + flight * pr.act_bytes for _, pr in opts) for opts in options)
    spike = max((min(pr.transient_bytes for _, pr in opts) for opts in options), default=0.0)
    p = layout.mesh.pp
    return max(start / p, end / p, base / p + spike if spike > 0 else 0.0)


#: Uniform assignments compared against the ILP's answer on every mesh.
BASELINES = (Choice(0), Choice(0, recompute=True), Choice(3), Choice(3, recompute=True))


def _refine_per_operator(layouts: Mapping[tuple[int, bool, str], Sequence[BlockCost]], found: list[Candidate],
                         costing: Costing, deadline: float) -> list[Candidate]:
    """The ``_REFINED`` fastest per-block candidates solved again with per-operator options
    (:func:`choices_for`), each kept where that is faster under the full step formula: the
    per-block plan stays the baseline a refined one never loses to. Only the leaders are
    refined: per-operator options move a plan by a fraction of a layer's state, not across
    meshes, and their larger ILP costs up to seconds a mesh where the per-block one costs
    milliseconds."""
    found = sorted(found, key=lambda c: c.step_time_s)
    for k, cand in enumerate(found[:_REFINED]):
        if time.perf_counter() > deadline:
            break
        layout = cand.layout
        blocks = layouts[layout.key]
        refined, _ = solve_mesh(blocks, layout, costing, min(deadline, time.perf_counter() + _REFINE_S),
                                per_operator=True)
        if refined is not None and refined.step_time_s < cand.step_time_s * (1 - _TIE_REL):
            refined.uniform, refined.how = cand.uniform, f"{refined.how} per operator"
            log.info("per-operator choices on %s: %.4g s -> %.4g s", layout, cand.step_time_s, refined.step_time_s)
            found[k] = refined
    return found


def search(layouts: Mapping[tuple[int, bool, str], Sequence[BlockCost]], mesh_list: Sequence[Layout], costing: Costing,
           time_limit_s: float | None = None, per_operator: bool = True
           ) -> tuple[Candidate, list[Candidate], dict[str, float], int]:
    """Solve every mesh; returns the best candidate, all feasible ones solved (fastest first), the
    smallest peak per infeasible mesh, and how many meshes were not solved because their
    :func:`step_floor` was already slower than a plan found. ``per_operator=False``: whole-block
    choices only.

    Raises:
        NoPlanError: nothing fits ``costing.memory_limit_bytes``.
    """
    start = time.perf_counter()
    deadline = start + (time_limit_s if time_limit_s is not None else math.inf)
    found: list[Candidate] = []
    infeasible: dict[str, float] = {}
    # Meshes in the order of their step floor, so that a fast plan is found early and a mesh
    # whose floor is already slower than it is not solved at all (branch and bound over meshes).
    prepared = []
    for layout in mesh_list:
        blocks = layouts[layout.key]
        options = _mesh_options(blocks, layout, costing, per_operator=False)
        prepared.append((step_floor(layout, options.options, costing), layout, blocks, options))
    prepared.sort(key=lambda item: item[0])
    pruned = 0
    with Progress(len(prepared), "solving meshes") as bar:
        for i, (floor, layout, blocks, options) in enumerate(prepared, start=1):
            if time.perf_counter() > deadline and found:
                log.warning("planner time limit %.1f s reached after %d meshes; keeping the best so far", time_limit_s, len(found) + len(infeasible))
                break
            bar.step(f"solving mesh {i}/{len(prepared)} {layout}")
            if found and floor > min(c.step_time_s for c in found) * (1 + _TIE_REL):
                pruned += 1
                continue
            cand, smallest = solve_mesh(blocks, layout, costing, deadline, BASELINES, per_operator=False,
                                        prepared=options)
            if cand is None:
                infeasible[str(layout)] = smallest
            else:
                found.append(cand)
    if pruned:
        log.info("%d of %d meshes not solved: their step floor is slower than a plan found", pruned, len(prepared))
    if per_operator and found:
        found = _refine_per_operator(layouts, found, costing, deadline)
    if not found:
        least = min(infeasible.values(), default=math.nan)
        raise NoPlanError(
            f"no plan fits memory_budget={format_bytes(costing.memory_limit_bytes)} per device: the "
            f"smallest peak any of {len(infeasible)} meshes reaches is about {format_bytes(least)} "
            "(every block at its most memory-saving choice); raise memory_budget, add devices, or "
            "shrink the batch"
        )
    found.sort(key=lambda c: c.step_time_s)
    tied = [c for c in found if c.step_time_s <= found[0].step_time_s * (1 + _TIE_REL)]
    best = min(tied, key=lambda c: (c.layout.mesh.pp, c.layout.microbatches, c.layout.mesh.tp, c.layout.sequence_parallel,
                                    c.layout.tp_layout != "megatron", c.peak_memory_bytes))
    found.remove(best)
    return best, [best, *found], infeasible, pruned
