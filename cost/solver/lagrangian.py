"""The Lagrangian relaxation of the memory rows (the package docstring, "Large problems").

:class:`_MemoryPriced` prices memory into the node costs and minimises what is left: exactly by
elimination on series-parallel graphs (:func:`_unconstrained_min`), else by message passing.
:func:`_lagrangian` raises a lower bound by subgradient steps on the prices and finds a fitting
answer that buys memory as the dual does; :func:`_price_search` walks the prices from there for
cheaper fitting answers.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from typing import Mapping

import numpy as np

from graphpass.cost.solver import message_passing
from graphpass.cost.solver.local_search import _forbidding, _greedy_local_search, _stopped
from graphpass.cost.solver.message_passing import _dual_decode, _Messages, _Sweeps
from graphpass.cost.solver.problem import _REL_TOL
from graphpass.cost.solver.reductions import _eliminate, _fits, _Reduced, _usage

# Message-passing sweeps per Lagrangian round on graphs elimination cannot solve (the messages
# carry over from round to round).
_INNER_SWEEPS = 5
#: Rounds after which a Lagrangian whose multipliers have not raised the bound above its
#: every-price-zero value stops (IOPDDL R: none did in 30 rounds; its time goes to the kicks).
_LAGRANGIAN_PATIENCE = 8


def _unconstrained_min(red: _Reduced, cost: dict[int, np.ndarray]) -> dict[int, int] | None:
    """Exact minimiser of ``cost`` plus the edges, with no memory limit, by eliminating nodes of
    degree <= 2 (strategies in ``red``'s reduced indices); None when the graph does not reduce
    to nothing (not series-parallel)."""
    live = red.live_nodes()
    work = _Reduced(
        names=red.names, keep=[list(range(len(c))) for c in red.cost], cost=list(red.cost),
        adj=[{} for _ in red.names], alive=list(red.alive),
        num_strategies=[len(c) for c in red.cost], pieces=[[] for _ in red.names],
    )
    for n in live:
        work.cost[n] = cost[n]
        for v, m in red.adj[n].items():
            work.adj[n][v] = m
    pending = set(live)
    while pending:
        progress = [n for n in sorted(pending) if _eliminate(work, n) is not None]
        if not progress:
            return None
        pending.difference_update(progress)
    original: dict[int, int] = {}
    for n, nbrs, table in reversed(work.eliminated):
        original[n] = int(table[tuple(original[v] for v in nbrs)])
    return original


class _MemoryPriced:
    """The problem with its memory rows priced into the node costs instead of enforced: for
    multipliers lambda_j >= 0 per row, node n's cost becomes c_n + Lambda_n extra_n, with
    Lambda_n the sum of the multipliers of the rows n holds memory on. Its minimum, less
    sum_j lambda_j rhs_j, is the Lagrangian L(lambda), a lower bound on the optimum; its
    minimiser is what memory at those prices buys.

    The minimum has no memory rows, so elimination solves it exactly on series-parallel graphs
    (transformer graphs with their residuals are). Otherwise message passing bounds it from
    below (:class:`_Messages`, warm-started from call to call; still a valid bound) and a
    near-minimiser is decoded from it (:func:`_dual_decode`).
    """

    def __init__(self, red: _Reduced):
        self.red = red
        self.live = red.live_nodes()
        self.members = [n for n in self.live if red.pieces[n]]
        self.edges = list(red.edges())
        self.messages = _Messages(red)
        # large graphs decode by sweeps of many nodes at once (built on the first decode)
        self.sweeps: _Sweeps | None = None
        self.forbidding = _forbidding(red)  # the edges with a forbidden pair, for every decode
        self.series_parallel = True
        self.calls, self.seconds = 0, 0.0  # of `minimise`, for callers sizing their rounds

    def minimise(self, lam: np.ndarray, deadline: float) -> tuple[float, dict[int, int]] | None:
        """(L(lam), the minimiser), or None at ``deadline`` inside message passing."""
        began = time.perf_counter()
        try:
            return self._minimise(lam, deadline)
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - began

    def _minimise(self, lam: np.ndarray, deadline: float) -> tuple[float, dict[int, int]] | None:
        red, live = self.red, self.live
        prefix = np.concatenate([[0.0], np.cumsum(lam)])
        cost = {n: red.cost[n] for n in live}
        for n in self.members:
            cost[n] = red.cost[n] + sum((prefix[j2 + 1] - prefix[j1]) * e for j1, j2, e in red.pieces[n])
        x = _unconstrained_min(red, cost) if self.series_parallel else None
        if x is None:
            self.series_parallel = False
            value, belief, pairs = self.messages.run(cost, deadline, max_sweeps=_INNER_SWEEPS, until_stalled=False)
            if time.perf_counter() >= deadline:
                return None
            priced = replace(red, cost=[cost.get(n, c) for n, c in enumerate(red.cost)], rhs=np.zeros(0),
                             pieces=[[] for _ in red.names])  # no memory rows: their price is in the costs
            return value - float(lam @ red.rhs), self._decode(priced, belief, pairs, deadline)
        value = sum(float(cost[n][x[n]]) for n in live) + sum(float(m[x[u], x[v]]) for u, v, m in self.edges)
        return value - float(lam @ red.rhs), x

    def _decode(self, priced: _Reduced, belief: Mapping[int, np.ndarray],
                pairs: Mapping[tuple[int, int], np.ndarray], deadline: float) -> dict[int, int]:
        """:func:`_dual_decode` of the priced problem; on graphs of :data:`_STACKED_EDGES` edges
        and more its 1-opt moves are :class:`_Sweeps` (built on the first call)."""
        # read from its module, so that one setting decides both this and `_Messages`' stacking
        if len(self.edges) < message_passing._STACKED_EDGES:
            return _dual_decode(priced, belief, pairs, deadline, forbidding=self.forbidding)
        if self.sweeps is None:
            self.sweeps = _Sweeps(self.red)
        return _dual_decode(priced, belief, pairs, deadline, self.sweeps, self.forbidding)


def _lagrangian(red: _Reduced, upper: float, deadline: float, max_rounds: int = 200,
                priced: _MemoryPriced | None = None, stop: threading.Event | None = None
                ) -> tuple[float, dict[int, int] | None, np.ndarray]:
    """A lower bound on the optimum by Lagrangian relaxation of the memory rows, the cheapest
    memory-feasible assignment met on the way (None if none), and the multipliers of the bound.

    Subgradient steps on L(lambda) (:class:`_MemoryPriced`; Polyak's rule towards ``upper``)
    raise the bound. The best multipliers, scaled up until their minimiser fits, give a feasible
    assignment that prices memory as the dual does.
    """
    floor = red.lower_bound()
    priced = priced or _MemoryPriced(red)
    members = priced.members
    feasible: tuple[float, dict[int, int] | None] = (math.inf, None)

    def inner(lam: np.ndarray) -> tuple[float, dict[int, int]] | None:
        return priced.minimise(lam, deadline)

    def consider(x: dict[int, int]) -> bool:
        nonlocal feasible
        if not _fits(red, x, members):
            return False
        value = red.objective(x)
        if value < feasible[0]:
            feasible = (value, x)
        return True

    lam = np.zeros(len(red.rhs))
    best, best_lam, theta, stale = floor, lam, 1.0, 0
    best_x: dict[int, int] | None = None
    # The rounds leave a fifth of the time for pricing memory above the dual and repairing.
    rounds_until = time.perf_counter() + 0.8 * max(0.0, deadline - time.perf_counter())
    for rounds in range(max_rounds):
        if _stopped(rounds_until, stop):
            break
        if rounds == _LAGRANGIAN_PATIENCE and not best_lam.any():
            break  # no multipliers have raised the bound: its time goes to the answer's search
        found = inner(lam)
        if found is None:  # the deadline, inside message passing
            break
        value, x = found
        consider(x)
        if value > best + 1e-12 * abs(best):
            best, best_lam, best_x, stale = value, lam, x, 0
        else:
            stale += 1
            if stale >= 5:
                theta, stale = theta / 2, 0
        g = _usage(red, x, members) - red.rhs
        g[(lam <= 0) & (g < 0)] = 0.0  # a multiplier at zero cannot move down
        norm = float(g @ g)
        if norm == 0.0 or upper - value <= 1e-9 * abs(upper) or theta < 1e-4:
            break
        lam = np.maximum(0.0, lam + theta * (upper - value) / norm * g)
    if feasible[1] is None and best_x is not None:
        # No minimiser fitted: the one at the best multipliers, its overflow repaired by 1-opt
        # moves on the true costs (they fix overflowing rows first).
        consider(_greedy_local_search(red, deadline=deadline, initial=best_x))
    # Price memory a little above the dual until the minimiser fits (doubling, then bisection).
    if best_lam.any() and (feasible[1] is None or feasible[0] > best * (1 + 1e-6)):
        lo, hi = 1.0, None
        for _ in range(24):
            if _stopped(deadline, stop):
                break
            scale = 2 * lo if hi is None else (lo + hi) / 2
            found = inner(best_lam * scale)
            if found is None:
                break
            if consider(found[1]):
                hi = scale
            else:
                lo = scale
            if hi is not None and hi - lo < 1e-3:
                break
    return best, feasible[1], best_lam


#: The price search's steps: a row's multiplier times _PRICE_UP where the minimiser overflows
#: it, times _PRICE_DOWN where it leaves room. On IOPDDL V (60 s) 1.1 / 0.97 came to 1.04x the
#: best known answer, 1.2 / 0.95 and 1.05 / 0.98 to 1.11x, 2 / 0.8 found nothing.
_PRICE_UP, _PRICE_DOWN = 1.1, 0.97


#: Steps the price search must have time for after its first (20 moves a price up to 6.7x);
#: where a step is slower (IOPDDL U: ~3 s over 35k nodes), the time goes back to the windows.
_PRICE_MIN_STEPS = 20


def _price_search(red: _Reduced, priced: _MemoryPriced, lam: np.ndarray, incumbent: dict[int, int],
                  deadline: float, max_steps: int | None = None, stop: threading.Event | None = None
                  ) -> dict[int, int]:
    """The cheapest fitting assignment met on a walk over memory prices, or ``incumbent``.

    From the Lagrangian's multipliers, each step minimises the priced problem
    (:class:`_MemoryPriced`) and improves the minimiser by 1-opt moves on the true costs (which
    repair overflowing rows first). Then the prices move: up on the rows the minimiser overflows
    (a row without a price gets a tenth of the mean one), down on those it leaves room on. The
    subgradient steps that found the multipliers aim at the bound, where minimisers sit on the
    edge of fitting at no thought for cost; this walk stays near those prices and looks for
    cheap assignments that fit, memory bought where it is cheapest. On small problems with big
    strategy sets (IOPDDL V: 243 nodes after reduction, edge tables up to 128 x 128) it does
    several steps a second and beats exact windows, which cover a handful of nodes at a time."""
    live, members = priced.live, priced.members
    best = incumbent
    best_value = red.objective(incumbent) if _fits(red, incumbent, live) else math.inf
    rhs = red.rhs + _REL_TOL * np.abs(red.rhs) + 1e-9
    lam = np.array(lam, dtype=float)
    # the price at which all the rows' room costs what the incumbent does: for a start from none
    unit = max(abs(red.objective(incumbent)), 1.0) / max(float(np.abs(red.rhs).sum()), 1.0)
    first, steps = True, 0
    if priced.calls and deadline - time.perf_counter() < _PRICE_MIN_STEPS * priced.seconds / priced.calls:
        return incumbent  # too few steps fit: the windows get the time
    while not _stopped(deadline, stop) and (max_steps is None or steps < max_steps):
        began, steps = time.perf_counter(), steps + 1
        found = priced.minimise(lam, deadline)
        if found is None:
            break
        x = found[1]
        usage = _usage(red, x, members)
        repaired = _greedy_local_search(red, deadline=deadline, initial=x)
        if _fits(red, repaired, live) and red.objective(repaired) < best_value:
            best, best_value = repaired, red.objective(repaired)
        over = usage > rhs
        if over.any():
            positive = lam[lam > 0]
            lam[over] = np.maximum(lam[over] * _PRICE_UP, 0.1 * float(positive.mean()) if len(positive) else unit)
        else:
            lam[usage < 0.99 * rhs] *= _PRICE_DOWN
        step = time.perf_counter() - began
        if first and (deadline - time.perf_counter()) < _PRICE_MIN_STEPS * step:
            break  # too few steps left to move the prices far: the windows get the time
        first = False
    return best
