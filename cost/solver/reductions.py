"""The reductions of the package docstring ("Reductions"), and the reduced problem they leave.

:func:`_reduce` prunes forbidden strategies (:func:`_prune`, arc consistency), checks the memory
limit against what is left and writes the memory rows that can bind (:func:`_memory_rows`), then
drops dominated strategies (:func:`_drop_dominated`), folds chains and leaves (:func:`_eliminate`)
and merges determined nodes (:func:`_merge_determined`) until nothing changes. Every later phase
works on its :class:`_Reduced`; :func:`_usage` and :func:`_fits` measure an assignment's memory on
its rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from graphpass.cost.solver.problem import (
    _REL_TOL,
    ForbiddenError,
    InfeasibleError,
    Problem,
    _Arrays,
    _min_peak,
    _Steps,
    _steps,
    _validate,
)


@dataclass
class _Reduced:
    """The problem after reduction; nodes keep their original indices.

    ``adj[u][v]`` is the resharding matrix [strategy of u, strategy of v] (``adj[v][u]`` its
    transpose). Eliminated nodes (``alive`` False) are recovered from ``eliminated`` after the
    solve: (node, neighbours, table) where ``table[original strategies of the neighbours]`` is the
    node's best original strategy.

    Memory: ``rhs[j]`` is the room memory row ``j`` leaves above every node's smallest share, and
    ``pieces[n]`` lists ``(j1, j2, extra)``: node n holds ``extra[s]`` bytes more than its
    smallest share on rows ``j1..j2`` under strategy s (each ``extra`` has minimum 0). A node
    has one piece per live interval it carries: its own, and those of nodes merged into it.
    """

    names: list[str]
    keep: list[list[int]]  # original strategy index for each remaining strategy
    cost: list[np.ndarray]
    adj: list[dict[int, np.ndarray]]
    alive: list[bool]
    num_strategies: list[int]  # original counts, to size recovery tables
    eliminated: list[tuple[int, tuple[int, ...], np.ndarray]] = field(default_factory=list)
    rhs: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per memory row: limit - minima
    row_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pieces: list[list[tuple[int, int, np.ndarray]]] = field(default_factory=list)

    def set_edge(self, u: int, v: int, m: np.ndarray) -> None:
        if v in self.adj[u]:
            m = self.adj[u][v] + m
        self.adj[u][v], self.adj[v][u] = m, m.T

    def drop_edge(self, u: int, v: int) -> None:
        del self.adj[u][v], self.adj[v][u]

    def edges(self):
        for u, nbrs in enumerate(self.adj):
            for v, m in nbrs.items():
                if u < v:
                    yield u, v, m

    def live_nodes(self) -> list[int]:
        return [n for n, a in enumerate(self.alive) if a]

    def objective(self, choice: dict[int, int]) -> float:
        """Reduced objective of reduced strategy indices per live node (equals the original cost
        of the recovered assignment)."""
        total = sum(float(self.cost[n][s]) for n, s in choice.items())
        return total + sum(float(m[choice[u], choice[v]]) for u, v, m in self.edges())

    def lower_bound(self) -> float:
        """Every term at its own minimum: no assignment costs less."""
        return sum(float(self.cost[n].min()) for n in self.live_nodes()) + sum(
            float(m.min()) for _, _, m in self.edges()
        )

    def recover(self, choice: dict[int, int]) -> dict[str, int]:
        """Original strategy per node name from reduced strategies of the live nodes."""
        original = {n: self.keep[n][s] for n, s in choice.items()}
        for n, nbrs, table in reversed(self.eliminated):
            original[n] = int(table[tuple(original[v] for v in nbrs)])
        return {self.names[n]: s for n, s in sorted(original.items())}


#: Strategies compared at once by `_drop_dominated` (bounds its k x block x features work array).
_DOMINANCE_BLOCK_CELLS = 4_000_000


def _drop_dominated(red: _Reduced, n: int) -> bool:
    """Reduction 2: drop every strategy of ``n`` another one dominates (no worse in cost, memory
    and every resharding entry; among equal ones the lowest index stays). "t dominates s" is a
    strict partial order, so the strategies kept are exactly the undominated ones: every
    dominated strategy has an undominated dominator. Vectorised over blocks of strategies."""
    c = red.cost[n]
    nbrs = list(red.adj[n])
    rows = [red.adj[n][v] for v in nbrs]
    k = len(c)
    if k < 2:
        return False
    extras = [e[:, None] for _, _, e in red.pieces[n]]
    features = np.concatenate([c[:, None], *extras, *rows], axis=1)  # [k, D]
    dominated = np.zeros(k, dtype=bool)
    block = max(1, _DOMINANCE_BLOCK_CELLS // (k * features.shape[1]))
    index = np.arange(k)
    for lo in range(0, k, block):
        s = features[lo:lo + block]  # the strategies judged, [b, D]
        no_worse = (features[:, None, :] <= s[None, :, :]).all(axis=2)  # [t, s]
        equal = (features[:, None, :] == s[None, :, :]).all(axis=2)
        beats = no_worse & (~equal | (index[:, None] < index[None, lo:lo + block]))
        dominated[lo:lo + block] = beats.any(axis=0)
    if not dominated.any():
        return False
    _keep_strategies(red, n, np.flatnonzero(~dominated))
    return True


def _table(red: _Reduced, n: int, nbrs: tuple[int, ...], best: np.ndarray) -> np.ndarray:
    """Recovery table over the neighbours' original strategies from ``best`` over their reduced ones."""
    table = np.zeros(tuple(red.num_strategies[v] for v in nbrs), dtype=np.int64)
    index = np.ix_(*[red.keep[v] for v in nbrs]) if nbrs else ()
    table[index] = np.asarray(red.keep[n])[best]
    return table


def _eliminate(red: _Reduced, n: int) -> list[tuple[int, int | None]] | None:
    """Fold a node that no memory row sees and that has at most two neighbours into them (series
    and leaf reduction): exact, since its best strategy depends only on theirs. A node with one
    strategy left is folded whatever its degree. Returns what `_prune` must check then (None: not
    folded)."""
    nbrs = tuple(red.adj[n])
    c = red.cost[n]
    checks: list[tuple[int, int | None]] = [(v, _COST) for v in nbrs]
    if len(c) == 1:
        for v in nbrs:
            red.cost[v] = red.cost[v] + red.adj[n][v][0, :]
            red.drop_edge(n, v)
        red.eliminated.append((n, (), np.asarray(red.keep[n][0])))
    elif red.pieces[n] or len(nbrs) > 2:
        return None
    elif not nbrs:
        red.eliminated.append((n, (), np.asarray(red.keep[n][int(np.argmin(c))])))
    elif len(nbrs) == 1:
        (u,) = nbrs
        total = c[:, None] + red.adj[n][u]  # [s of n, a of u]
        red.cost[u] = red.cost[u] + total.min(axis=0)
        red.eliminated.append((n, nbrs, _table(red, n, nbrs, total.argmin(axis=0))))
        red.drop_edge(n, u)
    else:
        u, w = nbrs
        total = c[:, None, None] + red.adj[n][u][:, :, None] + red.adj[n][w][:, None, :]
        red.eliminated.append((n, nbrs, _table(red, n, nbrs, total.argmin(axis=0))))
        red.drop_edge(n, u)
        red.drop_edge(n, w)
        red.set_edge(u, w, total.min(axis=0))
        checks = [(u, w), (w, u)]
    red.alive[n] = False
    return checks


def _memory_rows(problem: Problem, red: _Reduced, mem: Sequence[np.ndarray], steps: _Steps) -> None:
    """Rows that can bind (sum of per-node maxima above the limit), and each node's piece on them
    (``mem``: the problem's memory per original strategy)."""
    red.pieces = [[] for _ in red.names]
    if problem.memory_limit_bytes is None or not problem.nodes:
        return
    now = [m[keep] for m, keep in zip(mem, red.keep)]
    limit = float(problem.memory_limit_bytes)
    base = steps.sums(np.array([float(m.min()) for m in now]))
    slack = steps.sums(np.array([float(m.max() - m.min()) for m in now]))
    binding = np.flatnonzero(base + slack > limit + _REL_TOL * abs(limit))
    red.rhs, red.row_steps = limit - base[binding], binding
    for n, m in enumerate(now):
        if m.max() <= m.min():
            continue
        j1 = int(np.searchsorted(binding, steps.lo[n]))
        j2 = int(np.searchsorted(binding, steps.hi[n], side="right")) - 1
        if j1 <= j2:
            red.pieces[n].append((j1, j2, m - m.min()))


def _normalise(red: _Reduced, n: int, start: int = 0) -> None:
    """Keep every piece of ``n`` (from ``start`` on) at minimum 0 (a raised minimum moves into its
    rows' ``rhs``) and drop the pieces left constant."""
    kept = red.pieces[n][:start]
    for j1, j2, e in red.pieces[n][start:]:
        low = float(e.min())
        if low > 0:
            red.rhs[j1: j2 + 1] -= low
            e = e - low
        if e.max() > 0:
            kept.append((j1, j2, e))
    red.pieces[n] = kept


def _unreduced(arrays: _Arrays) -> _Reduced:
    """The problem as given, with parallel and reversed edges merged (summed) and self-edges
    moved into their node's cost."""
    num = len(arrays.cost)
    cost = [c.copy() for c in arrays.cost]
    red = _Reduced(
        names=list(arrays.index),
        keep=[list(range(len(c))) for c in cost],
        cost=cost,
        adj=[{} for _ in range(num)],
        alive=[True] * num,
        num_strategies=[len(c) for c in cost],
        pieces=[[] for _ in range(num)],
    )
    for u, v, m in arrays.edges:
        if u == v:
            red.cost[u] = red.cost[u] + np.diag(m)
        else:
            red.set_edge(u, v, m.copy())
    return red


def _keep_strategies(red: _Reduced, n: int, keep: np.ndarray) -> None:
    """Leave node ``n`` only the strategies at positions ``keep`` (in its current list)."""
    red.keep[n] = [red.keep[n][s] for s in keep]
    red.cost[n] = red.cost[n][keep]
    red.pieces[n] = [(j1, j2, e[keep]) for j1, j2, e in red.pieces[n]]
    _normalise(red, n)
    for v, r in red.adj[n].items():
        red.adj[n][v] = r[keep, :]
        red.adj[v][n] = red.adj[n][v].T


def _forbidden_why(red: _Reduced, n: int) -> str:
    allowed = np.isfinite(red.cost[n])
    if not allowed.any():
        return "every strategy's cost is forbidden (>= forbidden_cost_s or inf)"
    for v, r in red.adj[n].items():
        if np.isinf(r[allowed]).all():
            return (f"each strategy its own costs allow is forbidden in combination with every "
                    f"allowed strategy of neighbour {red.names[v]!r}")
    near = ", ".join(repr(red.names[v]) for v in red.adj[n])
    return f"its own costs and its edges to {near} together forbid every strategy"


#: A check `_prune` makes: node n against its own costs (``_COST``), one edge (a neighbour), or all.
_COST, _ALL = -1, None


def _prune(red: _Reduced, checks: Iterable[tuple[int, int | None]]) -> None:
    """Drop forbidden strategies (``inf`` cost) and those with no allowed partner on some edge,
    propagating to the neighbours until nothing changes (arc consistency). ``checks``: (node,
    what) pairs, ``what`` a neighbour (that edge only), ``_COST`` or ``_ALL``; only what changed
    needs checking, so a node with thousands of edges is not rescanned for each one.

    Raises:
        ForbiddenError: a node is left with no strategy.
    """
    queue = list(checks)
    while queue:
        n, what = queue.pop()
        if not red.alive[n]:
            continue
        if what is _ALL:
            ok = np.isfinite(red.cost[n])
            for r in red.adj[n].values():
                ok &= ~np.isinf(r).all(axis=1)
        elif what == _COST:
            ok = np.isfinite(red.cost[n])
        elif what in red.adj[n]:
            ok = ~np.isinf(red.adj[n][what]).all(axis=1)
        else:
            continue
        if ok.all():
            continue
        if not ok.any():
            raise ForbiddenError(red.names[n], _forbidden_why(red, n))
        _keep_strategies(red, n, np.flatnonzero(ok))
        queue.extend((v, n) for v in red.adj[n])  # their strategies may have lost their partner


def _segment(red: _Reduced, n: int) -> None:
    """Rewrite ``n``'s pieces as disjoint ones (each row range with the sum of the pieces over it),
    so that checking each piece against its rows checks the node's whole share there."""
    pieces = red.pieces[n]
    if len(pieces) < 2:
        return
    events: dict[int, np.ndarray] = {}
    for j1, j2, e in pieces:
        events[j1] = events.get(j1, 0) + e
        events[j2 + 1] = events.get(j2 + 1, 0) - e
    out, running = [], np.zeros(len(red.cost[n]))
    cuts = sorted(events)
    for a, b in zip(cuts, cuts[1:]):
        running = running + events[a]
        if running.max() > 0:
            if out and out[-1][1] == a - 1 and np.array_equal(out[-1][2], running):
                out[-1] = (out[-1][0], b - 1, out[-1][2])
            else:
                out.append((a, b - 1, running.copy()))
    red.pieces[n] = out
    _normalise(red, n)


def _merge_determined(red: _Reduced, u: int) -> list[tuple[int, int | None]] | None:
    """Reduction 5: merge ``u`` into a neighbour ``v`` that determines it (every strategy of v
    allows exactly one of u: forbidden pairs leave no other choice), when that costs no model
    size: the two have as many strategies (a bijection, as aliasing edges in XLA's problems are)
    or u has no other neighbour. v takes u's cost and resharding at the strategy it implies,
    u's other edges (re-indexed by v's strategy) and u's memory pieces; u is recovered from v.
    Exact: it removes only assignments the forbidden pairs exclude anyway. Returns what `_prune`
    must check then (None: not merged)."""
    for v, r in red.adj[u].items():  # r: [strategy of u, strategy of v]
        allowed = np.isfinite(r)
        # The node with fewer edges moves into the other: a hub absorbs its aliases one by one
        # instead of being moved, with all its edges, into each of them in turn.
        if (allowed.sum(axis=0) == 1).all() and (
                len(red.adj[u]) == 1 or (r.shape[0] == r.shape[1] and len(red.adj[u]) <= len(red.adj[v]))):
            break
    else:
        return None
    implied = allowed.argmax(axis=0)  # u's strategy for each strategy of v
    red.cost[v] = red.cost[v] + red.cost[u][implied] + r[implied, np.arange(r.shape[1])]
    start = len(red.pieces[v])
    red.pieces[v] = red.pieces[v] + [(j1, j2, e[implied]) for j1, j2, e in red.pieces[u]]
    red.eliminated.append((u, (v,), _table(red, u, (v,), implied)))
    red.drop_edge(u, v)
    checks: list[tuple[int, int | None]] = [(v, _COST)]
    for w, m in list(red.adj[u].items()):
        red.drop_edge(u, w)
        red.set_edge(v, w, m[implied, :])
        checks += [(v, w), (w, v)]
    red.pieces[u] = []
    red.alive[u] = False
    _normalise(red, v, start)
    return checks


def _check_rows(red: _Reduced, limit: float | None) -> None:
    """Raise InfeasibleError when pruning raised some row's smallest share above the limit."""
    if limit is None or not len(red.rhs):
        return
    j = int(np.argmin(red.rhs))
    if red.rhs[j] < -_REL_TOL * abs(limit):
        raise InfeasibleError(limit, limit - float(red.rhs[j]), int(red.row_steps[j]))


def _reduce(problem: Problem, arrays: _Arrays | None = None, *, eliminate: bool = True,
            deadline: float = math.inf) -> _Reduced:
    """Forbidden strategies pruned, the memory limit checked against what is left, then
    reductions 2-5 of the package docstring repeated to a fixpoint or until ``deadline`` (every
    step leaves a valid reduced problem, so stopping early only leaves it bigger)."""
    arrays = _validate(problem) if arrays is None else arrays
    red = _unreduced(arrays)
    _prune(red, [(n, _ALL) for n in range(len(red.names))])
    steps = _steps(problem) if problem.nodes else None
    limit = None if problem.memory_limit_bytes is None else float(problem.memory_limit_bytes)
    if steps is not None and limit is not None:
        need, step = _min_peak(steps, red.cost, [m[keep] for m, keep in zip(arrays.mem, red.keep)])
        if need > limit + _REL_TOL * abs(limit):
            raise InfeasibleError(limit, need, step)
        _memory_rows(problem, red, arrays.mem, steps)
    else:
        red.pieces = [[] for _ in red.names]
    changed = True
    while changed and time.perf_counter() < deadline:
        changed = False
        for i, n in enumerate(red.live_nodes()):
            if i % 256 == 0 and time.perf_counter() >= deadline:
                break
            changed |= _drop_dominated(red, n)
        if eliminate:
            for i, n in enumerate(red.live_nodes()):
                if i % 256 == 0 and time.perf_counter() >= deadline:
                    break
                if red.alive[n]:
                    checks = _eliminate(red, n)
                    if checks is None:
                        checks = _merge_determined(red, n)
                    if checks is not None:
                        changed = True
                        _prune(red, checks)  # folding may forbid a neighbour's strategy
        _check_rows(red, limit)
    for n in red.live_nodes():
        _segment(red, n)
    return red


def _usage(red: _Reduced, choice: dict[int, int], nodes: Sequence[int]) -> np.ndarray:
    """Memory above the smallest shares per row of ``nodes`` at their ``choice``."""
    diff = np.zeros(len(red.rhs) + 1)
    for n in nodes:
        for j1, j2, extra in red.pieces[n]:
            diff[j1] += extra[choice[n]]
            diff[j2 + 1] -= extra[choice[n]]
    return np.cumsum(diff)[:-1]


def _fits(red: _Reduced, choice: dict[int, int], members: Sequence[int]) -> bool:
    room = red.rhs + _REL_TOL * np.abs(red.rhs) + 1e-9
    return bool(np.all(_usage(red, choice, members) <= room))
