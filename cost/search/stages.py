r"""Pipeline stages and the per-block strategy ILP of one mesh, and the step time of an
assignment. Torch-free.

**Stages** (:func:`partition`): contiguous blocks per stage by dynamic programming, minimising
the slowest stage's compute, subject to a lower bound on each stage's memory (its blocks at
their smallest choice, times the microbatches the stage keeps in flight under 1F1B).

**Per-block choices** (:func:`solve_stage`): ZeRO stage 0-3 inside ``dp``, OSDP operator
splitting (ZeRO-3 only), activation recomputation (repeated layers only), by an ILP over
*clusters* of identical blocks: integer ``n[c, o]`` counts how many blocks of cluster ``c``
take option ``o``, so a 96-layer model is as small a problem as a 1-layer one. It is built
and solved through the planner's one ILP front end (:mod:`graphpass.cost.solver.ilp`, which
also serves the op-level MILP), on SCIP (``_STAGE_BACKEND`` says why).

.. math::

    \min \sum_{c,o} n_{c,o} (m\,t_o + u_o) + E
    \quad\text{s.t.}\quad \sum_o n_{c,o} = |c|,\qquad
    E \ge \sum_{c,o} n_{c,o} (d_o - w_o),\ E \ge 0,

    \sum_{c,o} n_{c,o} (s_o - g_o + h_o + f\,a_o + b_o) \le M,\qquad
    \sum_{c,o} n_{c,o}\, s_o \le M,

    \sum_{c,o} n_{c,o} (s_o + f\,a_o) + r_{c,o}\, z_{c,o} \le M \ \ \forall c, o,
    \qquad n_{c,o} \le |c|\, z_{c,o},\ z \in \{0, 1\}

with, per block and option (:class:`~graphpass.cost.search.pricing.Priced`): ``t`` the time of
one microbatch (forward, backward, recomputed forward, tensor-parallel collectives, which sit on
the critical path), ``u`` the optimizer step, ``d`` the data-parallel collectives of one step
and ``w`` the compute they overlap with (``E`` is the exposed communication), ``s`` the model
state kept all step, ``a`` the activations one microbatch keeps until its backward, ``f`` the
microbatches in flight, and ``r`` the transient bytes alive only while the block runs (ZeRO-3's
gathered weights and their full gradients, a recomputed layer's rematerialised activations and
its backward's working set). ``z`` marks the options in use, so the peak includes the largest
transient actually chosen, not the sum. The first two rows are the two ends of backward: at its
start every activation is alive but the step's gradients do not exist yet (``g`` the gradients
in ``s``; ``h`` those held from earlier microbatches when accumulating; ``b`` the loss's
gradients, the post block's backward working set); at its end every gradient exists and the
activations are freed. In between, backward frees a layer's activations as it makes its
gradients, so the sum is largest at one of the ends. The transient rows keep both,
conservatively.

With sharded embedding tables (``Costing.tables``: points ``k`` of their trade of time for
memory, :mod:`graphpass.cost.search.tables`, each ``T_k`` seconds a step and ``B_k`` bytes on the
fullest rank), booleans ``y_k`` with ``sum_k y_k = 1`` pick one point in the same solve: the
objective gains ``sum_k T_k y_k`` and every memory row ``sum_k B_k y_k`` (the tables are state
held all step), so the ILP weighs a table's faster kind against the dense part's memory.

**Step time** (:func:`compose`) of a mesh with ``p`` stages of per-microbatch time ``t_s``
(1F1B / GPipe): ``sum_s t_s + (m - 1) max_s t_s + max_s (E_s + u_s)``; for ``p = 1`` that is
``m t + E + u``. Interleaved 1F1B with ``v`` stages per rank (rank ``r`` runs ``T_r``, the sum
of its stages' times): ``m max_r T_r + (p - 1) max_c t_c + max_r (E_r + u_r)`` (Narayanan et al.
2021; it assumes the microbatches fill whole rounds of ``p``); zero-bubble (ZB1P) the same with
the bubble term times ``ZERO_BUBBLE_SHARE`` (:func:`graphpass.cost.memory.zero_bubble_fraction`).
On joined sites of unlike devices (:mod:`graphpass.sites`) the blocks are priced on the slowest
device, and a stage's compute runs :func:`stage_speeds` times faster on its pp rank's devices:
the split and each stage's ILP weigh ``t / speed``, so a pipeline across an H100 site and an
A100 site gives the H100 stages more layers; and a stage's memory rows hold against the budget
times its devices' memory over the smallest's (:func:`stage_rooms`). Every stage but the last also pays the send of its output and the return of its gradient. A
stage's microbatches in flight follow its schedule
(:func:`graphpass.cost.memory.in_flight_microbatches`; zero-bubble also keeps output gradients
for its deferred weight gradients, :func:`graphpass.cost.memory.deferred_weight_gradients`); the
search enumerates 1F1B pipelines, and prices GPipe, interleaved and zero-bubble ones for a given
Strategy.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

from graphpass.cluster import Cluster
from graphpass.diloco import step_axis
from graphpass.mesh import Mesh
from graphpass.plan import Choice
from graphpass.transitions import TABLE
from graphpass.cost.memory import ZERO_BUBBLE_SHARE, deferred_weight_gradients, in_flight_microbatches
from graphpass.cost.search.blocks import LAYER, POST, BlockCost
from graphpass.cost.search.layouts import Parallelism, local_batch
from graphpass.cost.search.pricing import Costing, Priced, _bucket_spike, _Collectives, _dense_parts, _Prices
from graphpass.cost.solver import ilp

#: The share of each device's host memory (``HostSpec.memory_bytes``) offload may fill: the rest
#: is the training script's, the data loader's and pinned staging buffers'.
HOST_MEMORY_SHARE = 0.9
#: Weight of hidden data-parallel communication in the ILP objective: breaks ties between choices
#: whose step time is equal (everything overlapped) in favour of the one that moves fewer bytes.
_TIE_BREAK = 1e-3
#: Backend of the stage ILP. SCIP, not HiGHS: the front end silences the debug line HiGHS 1.12
#: prints to stdout (``ilp._QuietStdout``), but HiGHS settles these near-tied ILPs differently:
#: on bench/plan_speed.py's 31 stage ILPs it returned another assignment in 8, objectives 3e-5
#: below to 4e-5 above SCIP's (its answers within the MIP gap, or its row tolerances, differ),
#: so it would change plans for a 20% faster solve (0.9 s against 1.1 s over the 31).
_STAGE_BACKEND = ilp.SCIP
#: A stage ILP with offload choices (tiers per block, the host's memory a knapsack beside the
#: device's) may take SCIP minutes to *prove* optimal on a large mesh (llama-70b on 512 H100s:
#: over 15 minutes for one stage); its best assignment is kept after this long (the gap is
#: reported with the plan), unless the caller's deadline comes first.
OFFLOAD_STAGE_LIMIT_S = 20.0


@dataclass
class Candidate:
    """A priced mesh + stages + per-block choices."""

    layout: Parallelism
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
    #: the point of ``Costing.tables`` taken (its seconds in ``step_time_s``, its bytes in the
    #: peaks); None without sharded tables.
    tables: int | None = None

    #: per pp rank: its device's memory against the budget's device (:func:`stage_rooms`).
    stage_rooms: tuple[float, ...] = ()

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.stage_peaks_bytes)

    def fits(self, limit_bytes: float) -> bool:
        """Every pp rank's peak within ``limit_bytes`` (the smallest device's budget) times its
        device's room."""
        rooms = self.stage_rooms or (1.0,) * len(self.stage_peaks_bytes)
        return all(peak <= limit_bytes * room for peak, room in zip(self.stage_peaks_bytes, rooms))


@functools.lru_cache(maxsize=256)
def _pp_rank_devices(cluster: Cluster, mesh: Mesh) -> tuple[tuple[float, float], ...]:
    """Each pp rank's (speed, memory) against ``cluster.device``, the device blocks are priced
    on (the slowest site's, the smallest memory of any): the least among the ranks at that
    pipeline coordinate, since its dp and tp peers wait for one another and hold the same."""
    if mesh.pp == 1 or not cluster.sites:
        return ((1.0, 1.0),) * mesh.pp
    speeds, rooms = [math.inf] * mesh.pp, [math.inf] * mesh.pp
    for rank in range(mesh.world_size):
        r = mesh.coordinate(rank, "pp")
        speeds[r] = min(speeds[r], cluster.relative_speed(rank))
        rooms[r] = min(rooms[r], cluster.device_of(rank).memory_bytes / cluster.device.memory_bytes)
    return tuple(zip(speeds, rooms))


def stage_speeds(cluster: Cluster, mesh: Mesh) -> tuple[float, ...]:
    """How many times faster each pp rank computes than the device blocks are priced on: all
    1.0 unless the pp axis crosses sites of unlike devices."""
    return tuple(speed for speed, _ in _pp_rank_devices(cluster, mesh))


def stage_rooms(cluster: Cluster, mesh: Mesh) -> tuple[float, ...]:
    """How many times the priced device's memory each pp rank has: its share of the budget
    (``Costing.memory_limit_bytes`` is the smallest device's); all 1.0 on like devices."""
    return tuple(room for _, room in _pp_rank_devices(cluster, mesh))


def _stage_flight(layout: Parallelism, stage: int) -> float:
    if layout.mesh.pp == 1:
        return 1
    return in_flight_microbatches(layout.mesh.pp, layout.microbatches, stage, layout.schedule, layout.virtual_stages)


def partition(blocks: Sequence[BlockCost], layout: Parallelism, costing: Costing, comms: _Collectives,
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
    speeds, rooms = stage_speeds(costing.cluster, layout.mesh), stage_rooms(costing.cluster, layout.mesh)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[-1] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for s in range(1, p + 1):
        flight = _stage_flight(layout, s - 1)
        speed, limit = speeds[layout.rank_of(s - 1)], costing.memory_limit_bytes * rooms[layout.rank_of(s - 1)]
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
                value = max(best[s - 1][i], (prefix[j] - prefix[i]) / speed)
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
                layout: Parallelism, flight: int, costing: Costing, deadline: float, speed: float = 1.0
                ) -> tuple[dict[int, int], bool, float, int | None] | None:
    """The clustered stage ILP on devices ``speed`` times as fast as the blocks were priced on
    (:func:`stage_speeds`); returns block index -> option index, optimality, gap and the point
    of ``costing.tables`` taken (None: no tables); None: infeasible."""
    points = costing.tables
    assert not points or layout.num_stages == 1, "sharded tables are planned on meshes of one stage"
    clusters: dict[str, list[int]] = {}
    for i in indices:
        clusters.setdefault(blocks[i].signature + f"|{blocks[i].kind}", []).append(i)
    # The end of backward: every gradient made, and the bucket being filled at its largest.
    spike = _bucket_spike(sum(max(pr.bucket_bytes for _, pr in options[i]) for i in indices), costing)

    def build(model: ilp.Model) -> dict:
        m = layout.microbatches / speed  # each microbatch's compute, on this stage's devices
        mem_scale = 1.0 / max(costing.memory_limit_bytes, 1.0)
        exposed = model.num_var(0.0, math.inf, "exposed")
        counts, used = {}, {}
        for key, members in clusters.items():
            for o, (_, pr) in enumerate(options[members[0]]):
                counts[key, o] = model.int_var(0, len(members), f"n[{key},{o}]")
                if pr.transient_bytes > 0:
                    used[key, o] = model.bool_var(f"z[{key},{o}]")
        priced = {(key, o): options[clusters[key][0]][o][1] for key, o in counts}
        ns, prs = list(counts.values()), list(priced.values())
        ys = [model.bool_var(f"y[{k}]") for k in range(len(points))]  # the tables' point
        if ys:
            model.add_linear(ys, [1.0] * len(ys), 1.0, 1.0)
        table_s = [t for t, _ in points]
        table_mem = [b * mem_scale for _, b in points]
        # Ties (communication fully hidden) go to the option that communicates least.
        model.minimize([exposed, *ns, *ys], [1.0] + [m * p.time_s + p.optimizer_s + _TIE_BREAK * (p.dp_comm_s + p.host_link_s)
                                                     for p in prs] + table_s)
        model.add_linear([exposed, *ns], [-1.0] + [p.dp_comm_s - p.window_s / speed for p in prs], -math.inf, 0.0)
        host = costing.cluster.host
        if any(p.host_link_s or p.host_bytes or p.host_act_bytes or p.disk_bytes for p in prs):
            # Offload: the copies to and from host memory hide behind compute, on a link of their
            # own; what they keep must fit the host's memory and the disk.
            exposed_host = model.num_var(0.0, math.inf, "exposed_host")
            model.minimize([exposed, exposed_host, *ns, *ys], [1.0, 1.0] + [
                m * p.time_s + p.optimizer_s + _TIE_BREAK * (p.dp_comm_s + p.host_link_s) for p in prs] + table_s)
            model.add_linear([exposed_host, *ns], [-1.0] + [p.host_link_s - p.host_window_s / speed for p in prs], -math.inf, 0.0)
            host_scale = 1.0 / host.memory_bytes
            model.add_linear(ns, [(p.host_bytes + flight * p.host_act_bytes) * host_scale for p in prs], -math.inf,
                             HOST_MEMORY_SHARE)
            if any(p.disk_bytes for p in prs):
                model.add_linear(ns, [p.disk_bytes / max(host.disk_bytes, 1) for p in prs], -math.inf, 1.0)
        # The start of backward (every activation alive) and its end.
        model.add_linear([*ns, *ys], [p.start_peak_bytes(flight) * mem_scale for p in prs] + table_mem, -math.inf, 1.0)
        model.add_linear([*ns, *ys], [p.end_peak_bytes() * mem_scale for p in prs] + table_mem, -math.inf,
                         1.0 - spike * mem_scale)
        for key, members in clusters.items():
            picks = [counts[key, o] for o in range(len(options[members[0]]))]
            model.add_linear(picks, [1.0] * len(picks), len(members), len(members))
            for o, count in enumerate(picks):
                if (key, o) in used:
                    model.add_linear([count, used[key, o]], [1.0, -float(len(members))], -math.inf, 0.0)
        for (key, o), z in used.items():
            layer_transient = blocks[clusters[key][0]].kind == LAYER
            coefs = []
            for (k2, _), p in priced.items():
                # A layer's transient (in its backward) never meets the post block's activations:
                # backward frees them before it reaches any layer.
                act = 0.0 if layer_transient and blocks[clusters[k2][0]].kind == POST else p.act_bytes
                coefs.append((p.state_bytes + flight * act) * mem_scale)
            model.add_linear([*ns, *ys, z], [*coefs, *table_mem, priced[key, o].transient_bytes * mem_scale],
                             -math.inf, 1.0)
        return counts, ys

    if any(pr.host_link_s or pr.host_bytes or pr.host_act_bytes or pr.disk_bytes
           for i in indices for _, pr in options[i]):
        deadline = min(deadline, time.perf_counter() + OFFLOAD_STAGE_LIMIT_S)
    # At least 50 ms, even past the deadline: a stage without an answer loses its mesh.
    result, handles = ilp.solve(build, _STAGE_BACKEND, max(deadline, time.perf_counter() + 0.05))
    if not result.found:
        return None
    counts, ys = handles
    assignment: dict[int, int] = {}
    for key, members in clusters.items():
        queue = list(members)
        for o in range(len(options[members[0]])):
            for _ in range(int(round(result.value(counts[key, o])))):
                assignment[queue.pop(0)] = o
    optimal = result.status == ilp.OPTIMAL
    gap = 0.0 if optimal else max(0.0, result.objective - result.bound) / max(abs(result.objective), 1e-12)
    point = max(range(len(ys)), key=lambda k: result.value(ys[k])) if ys else None
    return assignment, optimal, gap, point


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


def compose(blocks: Sequence[BlockCost], layout: Parallelism, stages: list[list[int]], choices: list[Choice],
            priced: list[Priced], costing: Costing, comms: _Collectives, how: str,
            optimal: bool = True, gap: float = 0.0, tables: int | None = None) -> Candidate:
    """Step time and per-stage peaks of a full assignment (the formula in the module docstring),
    with point ``tables`` of ``costing.tables`` (its exchanges in the step, its bytes on the one
    stage) where given."""
    b = local_batch(layout, costing.batch)
    scale = b / costing.batch
    speeds = stage_speeds(costing.cluster, layout.mesh)
    chunk_times = []
    for s, indices in enumerate(stages):
        t = sum(priced[i].time_s for i in indices) / speeds[layout.rank_of(s)]
        if s + 1 < len(stages):  # activation forward, its gradient back
            t += 2 * comms.time("pp", "send_recv", blocks[indices[-1]].output_bytes * scale)
        chunk_times.append(t)
    # What each pp rank runs: one stage, or several under an interleaved schedule.
    ranks = [[s for s in range(len(stages)) if layout.rank_of(s) == r] for r in range(min(layout.mesh.pp, len(stages)))]
    stage_times, tails, peaks, exposed = [], [], [], []
    m = layout.microbatches
    for r, held in enumerate(ranks):
        indices = [i for s in held for i in stages[s]]
        # The end of backward waits for every asynchronous data-parallel collective at once.
        comm = sum(priced[i].dp_comm_s - priced[i].window_s / speeds[r] for i in indices) + _bucket_latency(
            blocks, indices, choices, layout, costing, comms) + _loss_report(layout, costing, comms)
        # Offload's copies to and from host memory, on their own link, hide behind the compute.
        host = max(0.0, sum(priced[i].host_link_s - priced[i].host_window_s / speeds[r] for i in indices))
        tails.append(max(0.0, comm) + host + sum(priced[i].optimizer_s for i in indices))
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
    if tables is not None:
        table_s, table_bytes = costing.tables[tables]
        step += table_s
        peaks = [p + table_bytes for p in peaks]
    return Candidate(layout, stages, list(choices), list(priced), stage_times, peaks, step, max(exposed), optimal, gap, how,
                     tail_s=max(tails), tables=tables, stage_rooms=stage_rooms(costing.cluster, layout.mesh))


def _loss_report(layout: Parallelism, costing: Costing, comms: _Collectives) -> float:
    """The step's all-reduce of the reported loss (the table's "dp reported loss": launched after
    forward, waited for at the step's end, so backward may hide it) and its synchronisation: over
    dp, or a DiLoCo worker's ranks (none where a worker is one rank); and under a pipeline its
    broadcast from the last stage. Across a slow link its latency alone can be a step's worth (a
    ring of 4 over 20 ms: 120 ms)."""
    # a pipeline's last stage then broadcasts it over pp (runtime/pipeline.py), blocking: priced
    # as a tree of ceil(log2 pp) hops on the pipeline's slowest neighbour link
    pp = layout.mesh.pp
    broadcast = comms.time("pp", "send_recv", 4.0, blocking=True) * math.ceil(math.log2(pp)) if pp > 1 else 0.0
    axis = step_axis(layout.mesh, costing.diloco)
    if axis is None:
        return broadcast
    n = layout.mesh.size(axis)
    return broadcast + comms.sync(axis) + sum(comms.time(axis, move.kind, size, move.blocking)
                                              for move, size in TABLE["dp reported loss"].movements(4.0, n))


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


def _bucket_latency(blocks: Sequence[BlockCost], indices: Sequence[int], choices: Sequence[Choice], layout: Parallelism,
                    costing: Costing, comms: _Collectives) -> float:
    """One all-reduce latency per gradient bucket of the stage's pure data-parallel blocks (ZeRO
    stages reduce per parameter group: their latency is in each block's price)."""
    grads = sum(params * costing.grad_bytes_per_param for i in indices
                for params, _, _, zero, _ in _dense_parts(blocks[i], choices[i], False) if zero == 0)
    if grads <= 0 or layout.mesh.dp == 1 or costing.diloco is not None:  # DiLoCo: no buckets
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


def evaluate(blocks: Sequence[BlockCost], layout: Parallelism, choices: list[Choice], costing: Costing,
             stages: list[list[int]] | None = None, prices: _Prices | None = None) -> Candidate | None:
    """Price one fixed assignment (a uniform baseline) on ``mesh``; stages by :func:`partition`
    unless given. None when no stage split exists at all. With ``costing.tables``, the tables
    take the fastest point that fits beside the assignment (the smallest where none does)."""
    prices = prices or _Prices(layout, costing)
    comms = prices.comms
    priced = [prices(b, c) for b, c in zip(blocks, choices)]
    if stages is None:
        stages = partition(blocks, layout, replace(costing, memory_limit_bytes=math.inf), comms,
                           [[(c, p)] for c, p in zip(choices, priced)])
        if stages is None:
            return None
    dense = compose(blocks, layout, stages, choices, priced, costing, comms, "fixed")
    if not costing.tables:
        return dense
    room = costing.memory_limit_bytes - dense.peak_memory_bytes
    fits = [k for k, (_, b) in enumerate(costing.tables) if b <= room]
    point = (min(fits, key=lambda k: costing.tables[k][0]) if fits
             else min(range(len(costing.tables)), key=lambda k: costing.tables[k][1]))
    return compose(blocks, layout, stages, choices, priced, costing, comms, "fixed", tables=point)
