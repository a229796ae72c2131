"""Large neighbourhood search: windows of the graph re-solved exactly with the rest fixed.

:func:`_ball` grows a window breadth-first from a seed to about ``_LNS_MODEL_SIZE`` variables,
:func:`_window` cuts its sub-problem (edges to fixed nodes become costs, the rows keep the room the
fixed nodes leave), and :func:`_large_neighbourhoods` solves windows by HiGHS, two at a time where
they share no node or edge, keeping each answer that is cheaper and fits.
"""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np

from graphpass.cost.solver.ilp import _DEADLINE_GRACE_S
from graphpass.cost.solver.local_search import _stopped
from graphpass.cost.solver.milp import _run
from graphpass.cost.solver.problem import _REL_TOL, ForbiddenError
from graphpass.cost.solver.reductions import _ALL, _fits, _prune, _Reduced, _usage

# Problems too big for one MILP (`driver._FULL_MODEL_SIZE`) are improved window by window, each
# window about _LNS_MODEL_SIZE variables and given at most _LNS_WINDOW_S.
_LNS_MODEL_SIZE = 40_000
_LNS_WINDOW_S = 10.0
# Windows solved at once (HiGHS releases the GIL while solving): two, where there are two cores.
_LNS_THREADS = max(1, min(2, os.cpu_count() or 1))


def _window(red: _Reduced, nodes: list[int], choice: dict[int, int],
            usage: np.ndarray) -> _Reduced | None:
    """The sub-problem of ``nodes`` with every other live node fixed at ``choice`` (``usage``: the
    rows' memory above the smallest shares at ``choice``, all live nodes); None when the fixed
    nodes leave some window node no allowed strategy.

    Edges to fixed nodes become node costs, and strategies they forbid are pruned (``keep`` maps
    the window's strategies to the parent's); rows keep the room the fixed nodes leave. Rows are
    merged where the same window pieces lie (only the tightest matters), so a window of W
    pieces has at most 2W rows however long the graph.
    """
    inside = {n: i for i, n in enumerate(nodes)}
    sub = _Reduced(
        names=[red.names[n] for n in nodes],
        keep=[list(range(len(red.cost[n]))) for n in nodes],
        cost=[red.cost[n].copy() for n in nodes],
        adj=[{} for _ in nodes],
        alive=[True] * len(nodes),
        num_strategies=[len(red.cost[n]) for n in nodes],
        pieces=[[] for _ in nodes],
    )
    for i, n in enumerate(nodes):
        for v, m in red.adj[n].items():
            if v in inside:
                if i < inside[v]:
                    sub.set_edge(i, inside[v], m)
            else:
                sub.cost[i] = sub.cost[i] + m[:, choice[v]]
    ends = {j for n in nodes for j1, j2, _ in red.pieces[n] for j in (j1, j2 + 1)}
    if ends:
        room = red.rhs - usage + _usage(red, choice, nodes)
        cuts = sorted(ends | {0, len(room)})
        at = {j: c for c, j in enumerate(cuts)}
        sub.rhs = np.minimum.reduceat(room, cuts[:-1]) if len(room) else np.zeros(0)
        sub.pieces = [[(at[j1], at[j2 + 1] - 1, e) for j1, j2, e in red.pieces[n]] for n in nodes]
    try:
        _prune(sub, [(i, _ALL) for i in range(len(nodes))])  # a raised smallest share moves into sub.rhs
    except ForbiddenError:
        return None
    return sub


def _ball(red: _Reduced, seed: int, budget: int, pairs: dict[tuple[int, int], int]) -> list[int]:
    """Nodes around ``seed`` in breadth-first order while the window's model (a variable per
    strategy and per allowed pair inside it; ``pairs`` counts them per edge) stays within
    ``budget``."""
    nodes, seen = [seed], {seed}
    size = len(red.cost[seed])
    for n in nodes:
        for v in red.adj[n]:
            if v in seen:
                continue
            add = len(red.cost[v]) + sum(pairs[min(v, w), max(v, w)] for w in red.adj[v] if w in seen)
            if size + add <= budget:
                seen.add(v)
                nodes.append(v)
                size += add
    return sorted(nodes)


def _large_neighbourhoods(red: _Reduced, choice: dict[int, int], deadline: float,
                          stop: threading.Event | None = None, threads: int = _LNS_THREADS) -> dict[int, int]:
    """Improve ``choice`` by re-solving windows exactly with the rest fixed (large neighbourhood
    search). A window is the graph neighbourhood of a seed, grown breadth-first to about
    ``_LNS_MODEL_SIZE`` variables, so a node and the neighbours its strategy constrains move
    together. Seeds are first the ends of forbidden pairs, then every node not yet in a window of
    the sweep; sweeps repeat until one improves nothing or the deadline. A window's answer is
    taken when it costs less than the window's current assignment (a forbidden pair inside it
    counts as infinitely expensive) and the memory rows still fit, so the answer only gets
    cheaper and stays within memory.

    ``threads`` windows are solved at once (HiGHS releases the GIL): windows in flight
    share no node and no edge, so their costs add up; their memory is checked on the rows as
    they are when each answer is taken."""
    from concurrent.futures import ThreadPoolExecutor

    live = red.live_nodes()
    pairs = {(u, v): int(np.isfinite(m).sum()) for u, v, m in red.edges()}
    choice = dict(choice)
    usage = _usage(red, choice, live)
    room = red.rhs + _REL_TOL * np.abs(red.rhs) + 1e-9

    def take(nodes: list[int], sub: _Reduced, future) -> bool:
        """Apply a solved window's answer where it is cheaper and fits; True if applied."""
        nonlocal usage
        local, _, _ = future.result()
        if local is None:
            return False
        now = {i: sub.keep[i].index(choice[n]) if choice[n] in sub.keep[i] else None for i, n in enumerate(nodes)}
        # Forbidden pairs or overflowing rows make the current assignment worth replacing.
        before = math.inf if None in now.values() or not _fits(sub, now, range(len(nodes))) else sub.objective(now)
        after = sub.objective(local)
        if not after < before - 1e-12 * abs(after):
            return False
        proposed = dict(choice)
        proposed.update({n: sub.keep[i][local[i]] for i, n in enumerate(nodes)})
        moved = usage - _usage(red, choice, nodes) + _usage(red, proposed, nodes)
        if not np.all(moved <= room) and np.all(usage <= room):
            return False  # another window took the room this one counted on
        choice.update((n, proposed[n]) for n in nodes)
        usage = moved
        return True

    with ThreadPoolExecutor(max_workers=threads) as pool:
        while not _stopped(deadline, stop):
            improved = False
            conflicts = sorted({n for u, v, m in red.edges() if np.isinf(m[choice[u], choice[v]]) for n in (u, v)})
            covered: set[int] = set()
            flight: list[tuple[list[int], _Reduced, object, set[int]]] = []  # nodes, sub, future, reach
            for seed in conflicts + live:
                if _stopped(deadline, stop):
                    break
                if seed in covered:
                    continue
                nodes = _ball(red, seed, _LNS_MODEL_SIZE, pairs)
                reach = set(nodes).union(*(red.adj[n].keys() for n in nodes))
                # Wait for the windows this one would share a node or an edge with (or for a
                # free thread) before building it.
                inside = set(nodes)
                while flight and (len(flight) >= threads or any(inside & f[3] for f in flight)):
                    done = flight.pop(0)
                    improved |= take(*done[:3])
                covered.update(nodes)
                sub = _window(red, nodes, choice, usage)
                if sub is None:
                    continue
                # An overrunning window is interrupted up to two graces after its deadline.
                until = min(deadline - 2 * _DEADLINE_GRACE_S, time.perf_counter() + _LNS_WINDOW_S)
                future = pool.submit(_run, sub, {}, until, warn=False)
                flight.append((nodes, sub, future, reach))
            for done in flight:
                improved |= take(*done[:3])
            if not improved:
                break
    return choice
