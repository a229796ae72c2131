"""The search over meshes: solve each mesh's stages and per-block choices, keep the fastest plan
that fits. Torch-free.

Meshes (:func:`~graphpass.cost.search.layouts.meshes`) are solved in the order of their
:func:`step_floor`, and one whose floor is already slower than a plan found is not solved. On
each (:func:`solve_mesh`), the stages come from
:func:`~graphpass.cost.search.stages.partition` and the choices from the stage ILP
(:func:`~graphpass.cost.search.stages.solve_stage`).
The uniform strategies of the same mesh are priced by the same function and kept when one beats
the ILP's answer under the full step formula (possible for ``p > 1`` only, where the ILP's
per-stage objective is a proxy), so the search never returns a plan slower than a uniform one it
enumerates. The fastest candidates are then solved again with per-operator choices
(:func:`_refine_per_operator`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from graphpass.plan import Choice
from graphpass.progress import Progress
from graphpass.units import format_bytes
from graphpass.cost.search.blocks import BlockCost
from graphpass.cost.search.layouts import Parallelism
from graphpass.cost.search.pricing import Costing, Priced, _Prices, choices_for
from graphpass.cost.search.stages import (
    HOST_MEMORY_SHARE,
    Candidate,
    _shared_host_step,
    _stage_flight,
    compose,
    evaluate,
    partition,
    solve_stage,
    stage_rooms,
    stage_speeds,
    uniform_choices,
)

log = logging.getLogger(__name__)

#: How many of the fastest per-block candidates are solved again with per-operator options, and
#: the most seconds each may take.
_REFINED = 4
_REFINE_S = 10.0
#: Candidates within this relative step time of the fastest count as tied; the simplest mesh wins.
_TIE_REL = 1e-6


class NoPlanError(ValueError):
    """No mesh and choice fits the memory budget; says the smallest peak any candidate reaches."""


def _undominated(options: list[tuple[Choice, Priced]], m: int) -> list[tuple[Choice, Priced]]:
    """The options no other option beats or ties on every term the stage ILP and the stage
    split read (time, optimizer, communication and its overlap, each memory row; the first of
    equals stays): dropping them leaves every optimum in place and keeps the per-operator
    options' model small."""
    def terms(pr: Priced) -> tuple[float, ...]:
        return (m * pr.time_s + pr.optimizer_s, pr.dp_comm_s, pr.dp_comm_s - pr.window_s,
                pr.state_bytes - pr.grad_bytes + pr.held_bytes + pr.start_bytes, pr.act_bytes, pr.state_bytes,
                pr.transient_bytes, pr.bucket_bytes, pr.time_s, pr.host_link_s, pr.host_link_s - pr.host_window_s,
                pr.host_bytes, pr.host_act_bytes, pr.disk_bytes)

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


def _mesh_options(blocks: Sequence[BlockCost], layout: Parallelism, costing: Costing, per_operator: bool) -> _MeshOptions:
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


def step_floor(layout: Parallelism, options: Sequence[Sequence[tuple[Choice, Priced]]], costing: Costing) -> float:
    """A step time no assignment on ``layout`` beats (0 where none is derived): every block at its
    fastest option, spread perfectly over the stages. With ``T`` the sum of those per-microbatch
    times over ``p`` stages, the 1F1B/GPipe path ``sum_s t_s + (m - 1) max_s t_s`` is at least
    ``T + (m - 1) T / p``; the slowest rank's tail (exposed dp communication and optimizer) is
    at least the ranks' mean of the smallest of each; sharded tables add their fastest point.
    Stages on faster devices (:func:`stage_speeds`, speeds ``v_s``): ``T / max v + (m - 1) T /
    sum v``, since ``sum_s t_s >= T / max v`` and ``max_s t_s >= T / sum v``."""
    if layout.virtual_stages != 1 or layout.schedule not in ("1f1b", "gpipe"):
        return 0.0
    p, m = layout.num_stages, layout.microbatches
    speeds = stage_speeds(costing.cluster, layout.mesh)
    total = sum(min(pr.time_s for _, pr in opts) for opts in options)
    comm = sum(min(pr.dp_comm_s - pr.window_s for _, pr in opts) for opts in options)
    optimizer = sum(min(pr.optimizer_s for _, pr in opts) for opts in options)
    path = total / max(speeds) + (m - 1) * total / sum(speeds)
    return (_shared_host_step(path, layout.mesh.pp, m, costing.host_contention, costing.host_oversubscription)
            + (max(0.0, comm) + optimizer) / p + min((t for t, _ in costing.tables), default=0.0))


def solve_mesh(blocks: Sequence[BlockCost], layout: Parallelism, costing: Costing, deadline: float,
               baselines: Sequence[Choice] = (), per_operator: bool = True,
               prepared: _MeshOptions | None = None) -> tuple[Candidate | None, float]:
    """The best assignment on one mesh, and the smallest stage peak any assignment could reach
    (for the infeasibility report). ``per_operator=False`` offers whole-block choices only (the
    per-block plan)."""
    prepared = prepared or _mesh_options(blocks, layout, costing, per_operator)
    prices, offered, options = prepared.prices, prepared.offered, prepared.options
    comms = prices.comms
    smallest = _smallest_peak(layout, options) + min((b for _, b in costing.tables), default=0.0)
    stages = partition(blocks, layout, costing, comms, options)
    if stages is None:
        return None, smallest
    choices: list[Choice] = [Choice()] * len(blocks)
    priced: list[Priced] = [options[i][0][1] for i in range(len(blocks))]
    optimal, gap, tables = True, 0.0, None
    # Stages with the same blocks (by signature) and the same microbatches in flight have the
    # same answer: solve once, reuse by position.
    cache: dict[tuple, tuple[list[int], bool, float, int | None] | None] = {}
    speeds, rooms = stage_speeds(costing.cluster, layout.mesh), stage_rooms(costing.cluster, layout.mesh)
    for s, indices in enumerate(stages):
        flight, speed, room = _stage_flight(layout, s), speeds[layout.rank_of(s)], rooms[layout.rank_of(s)]
        key = (tuple(blocks[i].signature + blocks[i].kind for i in indices), flight, speed, room)
        if key not in cache:
            own = costing if room == 1.0 else replace(costing, memory_limit_bytes=costing.memory_limit_bytes * room)
            solved = solve_stage(blocks, indices, options, layout, flight, own, deadline, speed)
            cache[key] = None if solved is None else ([solved[0][i] for i in indices], *solved[1:])
        if cache[key] is None:
            return None, smallest
        positions, stage_optimal, stage_gap, tables = cache[key]  # tables: one stage only
        optimal &= stage_optimal
        gap = max(gap, stage_gap)
        for i, o in zip(indices, positions):
            choices[i], priced[i] = options[i][o]
    best = compose(blocks, layout, stages, choices, priced, costing, comms, "ilp", optimal, gap, tables)
    uniform_prices = []
    for base in baselines:  # a uniform assignment can win only through the pipeline max term
        uniform = uniform_choices(blocks, base)
        if any(c not in cs for c, cs in zip(uniform, offered)):
            continue
        cand = evaluate(blocks, layout, uniform, costing, stages, prices)
        if cand is None:
            continue
        uniform_prices.append((str(base), cand.step_time_s, cand.peak_memory_bytes))
        if cand.fits(costing.memory_limit_bytes) and cand.step_time_s < best.step_time_s:
            cand.how = f"uniform {base}"
            best = cand
    best.uniform = uniform_prices
    return best, smallest


def _smallest_peak(layout: Parallelism, options: Sequence[Sequence[tuple[Choice, Priced]]]) -> float:
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


def search(layouts: Mapping[tuple[int, bool, str], Sequence[BlockCost]], mesh_list: Sequence[Parallelism], costing: Costing,
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
        host = costing.cluster.host
        limits = ""
        if costing.offload and host is not None:  # what offload keeps is bounded too
            limits = (f"; offload may fill {HOST_MEMORY_SHARE:.0%} of Cluster.host.memory_bytes="
                      f"{format_bytes(host.memory_bytes)} per device and its disk_bytes={format_bytes(host.disk_bytes)}: "
                      "give more with cluster.with_host(memory_bytes=, disk_bytes=, disk_gbps=)")
        raise NoPlanError(
            f"no plan fits memory_budget={format_bytes(costing.memory_limit_bytes)} per device: the "
            f"smallest peak any of {len(infeasible)} meshes reaches is about {format_bytes(least)} "
            "(every block at its most memory-saving choice); raise memory_budget, add devices, or "
            f"shrink the batch{limits}"
        )
    found.sort(key=lambda c: c.step_time_s)
    tied = [c for c in found if c.step_time_s <= found[0].step_time_s * (1 + _TIE_REL)]
    best = min(tied, key=lambda c: (c.layout.mesh.pp, c.layout.microbatches, c.layout.mesh.tp, c.layout.sequence_parallel,
                                    c.layout.tp_layout != "megatron", c.peak_memory_bytes))
    found.remove(best)
    return best, [best, *found], infeasible, pruned
