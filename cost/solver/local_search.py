"""Local search on a reduced problem: the moves that improve an answer in hand.

:func:`_greedy_local_search` is the greedy pass with 1-opt moves, the first answer of every solve
(and :func:`~graphpass.cost.solver.driver.heuristic` on its own). :class:`_PairMoves` moves both
ends of an edge at once and kicks an answer out of its local minimum, keeping it within memory
(:func:`_pair_descent` runs its descent alone).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from typing import Iterable, Sequence

import numpy as np

from graphpass.cost.solver.problem import _REL_TOL
from graphpass.cost.solver.reductions import _Reduced, _usage

#: Nodes holding memory on an overflowing row that a repair after a kick considers moving.
_REPAIR_SAMPLE = 32
#: Pair-by-segment cells a memory check of a pair move compares at once.
_PAIR_CELLS = 1_000_000
#: A forbidden pair, for a repair weighing a move's cost per byte freed (above any real one).
_FORBIDDEN_PER_BYTE = 1e30
#: Edges a kick sets to random cheap pairs. IOPDDL R, 20 s from the descended answer: 8 and 32
#: came to 1.25x the best known. Drawing among all pairs (an earlier version), 2 came to 1.45x in
#: 40 s, and 64 or 128 kept nothing after their first 10 s.
_KICK_EDGES = 8
#: Kicks between recomputing the tracked sums (they drift), and between redrawing edges' terms.
_REFRESH_KICKS = 200
_TERMS_KICKS = 16


def _greedy_local_search(red: _Reduced, max_rounds: int = 20, deadline: float = math.inf,
                         initial: dict[int, int] | None = None, order: Sequence[int] | None = None,
                         forbidding: set[tuple[int, int]] | None = None) -> dict[int, int]:
    """Reduced strategy per live node: greedy in ``order`` (default: node order) or ``initial``,
    then best-improvement 1-opt moves in that order until a sweep improves nothing,
    ``max_rounds`` sweeps or ``deadline``.

    A move is judged first by the forbidden pairs it touches, then by how far it overflows a
    memory row, then by cost, so what the greedy pass could not avoid is repaired before anything
    else. Memory is tracked per row relative to every node's smallest share; a node carrying
    several pieces (nodes merged into it) may have no strategy at its smallest share on all of
    them, so unlike a plain problem the greedy pass can overflow, and the caller checks.
    ``forbidding``: the edges ``(u, v)``, ``u < v``, with a forbidden pair, where the caller knows
    them (found here otherwise)."""
    live = red.live_nodes() if order is None else list(order)
    usage = np.zeros(len(red.rhs)) if initial is None else _usage(red, initial, live)
    rhs = red.rhs + _REL_TOL * np.abs(red.rhs) + 1e-9
    choice: dict[int, int] = {} if initial is None else dict(initial)
    # the edges with a forbidden pair somewhere: only their columns need checking
    if forbidding is None:
        forbidding = _forbidding(red)

    def local(n: int) -> tuple[np.ndarray, np.ndarray]:
        """(forbidden pairs, cost) of each strategy of n against its neighbours chosen so far."""
        cost = red.cost[n].copy()
        bad = np.zeros(len(cost), dtype=np.int64)
        for other, m in red.adj[n].items():
            s = choice.get(other)
            if s is None:
                continue
            col = m[:, s]
            if (min(n, other), max(n, other)) in forbidding:
                inf = np.isinf(col)
                bad += inf
                col = np.where(inf, 0.0, col)
            cost += col
        return bad, cost

    def over(n: int, current: int | None) -> np.ndarray:
        """Bytes by which each strategy of n would overflow its fullest row, n's own current
        share taken out (0: it fits; its pieces are disjoint: ``_segment``)."""
        worst = np.zeros(len(red.cost[n]))
        for j1, j2, extra in red.pieces[n]:
            held = extra[current] if current is not None else 0.0
            head = float((rhs[j1: j2 + 1] - usage[j1: j2 + 1]).min()) + held
            worst = np.maximum(worst, extra - head)
        return worst

    def best(n: int, current: int | None) -> int:
        """By forbidden pairs, then memory overflow (none where anything fits), then cost."""
        bad, cost = local(n)
        overflow = over(n, current)
        key = np.lexsort((cost, overflow, bad))
        pick = int(key[0])
        if current is not None and (bad[current], overflow[current], cost[current]) <= (
                bad[pick], overflow[pick], cost[pick] + 1e-12 * abs(cost[pick])):
            return current
        return pick

    def place(n: int, s: int, current: int | None) -> None:
        for j1, j2, extra in red.pieces[n]:
            usage[j1: j2 + 1] += extra[s] - (extra[current] if current is not None else 0.0)
        choice[n] = s

    for n in live if initial is None else ():
        place(n, best(n, None), None)
    for _ in range(max_rounds):
        improved = False
        for i, n in enumerate(live):
            if i % 64 == 0 and time.perf_counter() > deadline:
                return choice
            cur = choice[n]
            s = best(n, cur)
            if s != cur:
                place(n, s, cur)
                improved = True
        if not improved:
            break
    return choice


def _forbidding(red: _Reduced) -> set[tuple[int, int]]:
    """The edges ``(u, v)``, ``u < v``, with a forbidden pair (inf) somewhere."""
    return {(u, v) for u, v, m in red.edges() if np.isinf(m).any()}


class _PairMoves:
    """Moves of both ends of an edge at once (2-opt) on a fitting assignment, memory checked
    exactly, with each node's cost against its neighbours' current strategies kept up to date
    (forbidden, infinite, terms counted apart) and the objective tracked move by move.

    A 1-opt move cannot leave a pair that only pays off together: two nodes agreeing on a layout
    each pays for alone. Under a tight limit, memory makes that the usual case: on IOPDDL R (every
    row 10-240x over at the unconstrained optimum) a descent by these moves takes the greedy answer
    from 2.58x the best known to 1.81x in 5 s, where 1-opt moves and the windows got 2.43x.

    :meth:`descend` makes the best fitting pair move of each edge, most expensive edges first,
    until nothing improves. :meth:`search` then kicks the answer out of its local minimum (a few
    expensive edges set to random cheap pairs, overflowing rows repaired at the least cost per byte)
    and descends again from the nodes it moved; a kick that does not pay off is undone."""

    def __init__(self, red: _Reduced, choice: dict[int, int]):
        self.red = red
        self.live = red.live_nodes()
        self.choice = dict(choice)
        self.edges = list(red.edges())
        forbidding = _forbidding(red)
        self.finite = {(u, v): (np.where(np.isinf(m), 0.0, m), np.isinf(m))
                       for u, v, m in self.edges if (u, v) in forbidding}
        # the pieces as arrays, to find the nodes holding memory on a row
        held = [(n, j1, j2) for n in self.live for j1, j2, _ in red.pieces[n]]
        self.piece_node = np.array([h[0] for h in held], dtype=np.int64)
        self.piece_lo = np.array([h[1] for h in held], dtype=np.int64)
        self.piece_hi = np.array([h[2] for h in held], dtype=np.int64)
        # per node with memory: its pieces' first rows, ends (exclusive) and extras, sorted
        self.held: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for n in self.live:
            pieces = sorted(red.pieces[n], key=lambda piece: piece[0])
            if pieces:
                self.held[n] = (np.array([j1 for j1, _, _ in pieces]), np.array([j2 + 1 for _, j2, _ in pieces]),
                                np.array([e for _, _, e in pieces]))
        self.undo: list[tuple[int, int]] | None = None  # (node, strategy before) while a kick is on trial
        self.kicks = self.kept = 0
        self.term: np.ndarray | None = None  # the edges' terms, to draw kicks from (refreshed now and then)
        self.refresh()

    def refresh(self) -> None:
        """Recompute the room, the local costs and the objective from the choice (moves update
        them by differences, which drift in floating point)."""
        red, choice = self.red, self.choice
        self.room = red.rhs + _REL_TOL * np.abs(red.rhs) + 1e-9 - _usage(red, choice, self.live)
        self.local = {n: red.cost[n].copy() for n in self.live}
        self.bad = {n: np.zeros(len(red.cost[n]), dtype=np.int64) for n in self.live}
        for n in self.live:
            for w in red.adj[n]:
                m, inf = self.split(n, w)
                self.local[n] += m[:, choice[w]]
                if inf is not None:
                    self.bad[n] += inf[:, choice[w]]
        terms = [float(red.cost[n][choice[n]]) for n in self.live] + [
            float(m[choice[u], choice[v]]) for u, v, m in self.edges]
        self.forbidden = sum(math.isinf(t) for t in terms)
        self.value = sum(t for t in terms if not math.isinf(t))

    def fits(self) -> bool:
        return bool(np.all(self.room >= 0))

    def split(self, u: int, v: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The u-by-v matrix of edge (u, v) with forbidden terms as 0, and where they are."""
        if u < v:
            return self.finite.get((u, v), (self.red.adj[u][v], None))
        m, bad = self.finite.get((v, u), (self.red.adj[v][u], None))
        return m.T, (None if bad is None else bad.T)

    def move(self, n: int, s: int) -> None:
        red, old = self.red, self.choice[n]
        if s == old:
            return
        if self.undo is not None:
            self.undo.append((n, old))
        self.value += float(self.local[n][s] - self.local[n][old])
        self.forbidden += int(self.bad[n][s] - self.bad[n][old])
        for j1, j2, extra in red.pieces[n]:
            self.room[j1: j2 + 1] -= extra[s] - extra[old]
        for w in red.adj[n]:
            m, inf = self.split(w, n)
            self.local[w] += m[:, s] - m[:, old]
            if inf is not None:
                self.bad[w] += inf[:, s].astype(np.int64) - inf[:, old]
        self.choice[n] = s

    def _pair_fits(self, u: int, v: int) -> np.ndarray:
        """Which pairs (a, b) keep every row within the room: u's and v's pieces cut the rows
        into segments, and on each the pair's change must fit the room left."""
        ok = np.ones((len(self.red.cost[u]), len(self.red.cost[v])), dtype=bool)
        if u not in self.held and v not in self.held:
            return ok
        # Nodes of one piece each (most) cut the rows into at most three segments, checked one by
        # one: on IOPDDL R the descent takes 4.5 s this way, 6.7 s by the general path below.
        if len(self.red.pieces[u]) <= 1 and len(self.red.pieces[v]) <= 1:
            du = [(j1, j2, e - e[self.choice[u]]) for j1, j2, e in self.red.pieces[u]]
            dv = [(j1, j2, e - e[self.choice[v]]) for j1, j2, e in self.red.pieces[v]]
            for lo, hi in itertools.pairwise(sorted({j for j1, j2, _ in du + dv for j in (j1, j2 + 1)})):
                a = next((d for j1, j2, d in du if j1 <= lo <= j2), None)
                b = next((d for j1, j2, d in dv if j1 <= lo <= j2), None)
                if a is not None or b is not None:
                    ok &= (0.0 if a is None else a[:, None]) + (0.0 if b is None else b[None, :]) <= self.room[lo:hi].min()
            return ok
        cuts = np.unique(np.concatenate([self.held[n][k] for n in (u, v) if n in self.held for k in (0, 1)]))
        starts = cuts[:-1]
        head = np.minimum.reduceat(self.room[:cuts[-1]], starts)
        du, dv = self._deltas(u, starts), self._deltas(v, starts)
        step = max(1, _PAIR_CELLS // ok.size)
        for i in range(0, len(starts), step):
            ok &= ((du[i:i + step, :, None] + dv[i:i + step, None, :]) <= head[i:i + step, None, None]).all(0)
        return ok

    def _deltas(self, n: int, starts: np.ndarray) -> np.ndarray:
        """Per segment starting at ``starts``, n's memory change on it for each strategy."""
        if n not in self.held:
            return np.zeros((len(starts), len(self.red.cost[n])))
        lo, hi, extra = self.held[n]
        piece = np.searchsorted(lo, starts, side="right") - 1
        inside = (piece >= 0) & (hi[np.maximum(piece, 0)] > starts)
        now = extra[:, self.choice[n]]
        return np.where(inside[:, None], extra[np.maximum(piece, 0)] - now[np.maximum(piece, 0), None], 0.0)

    def improve(self, u: int, v: int) -> bool:
        """Make edge (u, v)'s best fitting pair move, by forbidden pairs then cost; True if
        it improves."""
        cu, cv = self.choice[u], self.choice[v]
        m, inf = self.split(u, v)
        total = (self.local[u] - m[:, cv])[:, None] + (self.local[v] - m[cu, :])[None, :] + m
        worse = self.bad[u][:, None] + self.bad[v][None, :]
        if inf is not None:
            worse = worse + inf - inf[:, cv][:, None] - inf[cu, :][None, :]
        ok = self._pair_fits(u, v)
        ok[cu, cv] = True
        fewest = worse[ok].min()
        key = np.where(ok & (worse == fewest), total, np.inf)
        a, b = np.unravel_index(int(np.argmin(key)), key.shape)
        if (fewest, key[a, b]) >= (worse[cu, cv], total[cu, cv] - 1e-12 * abs(total[cu, cv])):
            return False
        self.move(u, int(a))
        self.move(v, int(b))
        return True

    def descend(self, deadline: float, stop: threading.Event | None = None,
                around: Iterable[int] | None = None) -> bool:
        """Pair moves until none improves or ``deadline``: sweeps over every edge, most
        expensive first, or (``around``) a work list of the edges at those nodes, growing to the
        edges of every node that moves. False if stopped by the deadline."""
        red, choice = self.red, self.choice
        if around is not None:
            work = list(dict.fromkeys((min(n, w), max(n, w)) for n in around for w in red.adj[n]))
            for u, v in work:  # grows while it is walked
                if _stopped(deadline, stop):
                    return False
                before = (choice[u], choice[v])
                if self.improve(u, v):  # a node that moved: its other edges again
                    work.extend((min(n, w), max(n, w)) for n, s in zip((u, v), before) if choice[n] != s
                                for w in red.adj[n] if w not in (u, v))
            return True
        while True:
            improved = False
            for k in np.argsort(-self._terms(), kind="stable"):
                if _stopped(deadline, stop):
                    return False
                improved |= self.improve(self.edges[k][0], self.edges[k][1])
            if not improved:
                return True

    def _terms(self) -> np.ndarray:
        """Each edge's term with its two nodes' (forbidden ones at ten times the largest other)."""
        red, choice = self.red, self.choice
        term = np.array([m[choice[u], choice[v]] + red.cost[u][choice[u]] + red.cost[v][choice[v]]
                         for u, v, m in self.edges])
        inf = np.isinf(term)
        if inf.any():
            term[inf] = 10 * float(term[~inf].max(initial=1.0))
        return term

    def kick(self, rng: np.random.Generator, count: int) -> list[int]:
        """Set ``count`` edges, drawn in proportion to their terms, to pairs that fit memory drawn in
        inverse proportion to the pair's own cost (its nodes' and the edge's); returns the nodes
        moved."""
        red = self.red
        if self.kicks % _TERMS_KICKS == 1 or self.term is None:
            self.term = self._terms()
        term = self.term
        if not len(term) or term.sum() <= 0:
            return []
        moved = []
        for k in rng.choice(len(term), size=min(count, len(term)), replace=False, p=term / term.sum()):
            u, v, m = self.edges[k]
            own = red.cost[u][:, None] + m + red.cost[v][None, :]
            allowed = np.isfinite(own)
            if not allowed.any():
                continue
            weight = np.zeros(own.shape)
            weight[allowed] = 1.0 / (1.0 + own[allowed] - own[allowed].min())
            # only pairs that fit: drawing among all and repairing after, IOPDDL T made 217 kicks
            # in 20 s (42 kept, 9.26e11), this way 1,721 (89 kept, 9.10e11); R 5.20e11 in 40 s,
            # this way 4.66e11 in 20
            weight = np.where(self._pair_fits(u, v), weight, 0.0).ravel()
            if weight.sum() <= 0:
                continue
            a, b = np.unravel_index(int(rng.choice(len(weight), p=weight / weight.sum())), own.shape)
            for n, s in ((u, int(a)), (v, int(b))):
                if self.choice[n] != s:
                    self.move(n, s)
                    moved.append(n)
        return moved

    def repair(self, rng: np.random.Generator, deadline: float) -> list[int] | None:
        """Bring every row back within the room: on the fullest row, of a sample of the nodes
        holding memory there, the move with the least cost per byte it frees. Returns the nodes
        moved, or None if the rows still overflow after as many moves as there are nodes."""
        moved = []
        for i in range(len(self.live) + 1):
            j = int(np.argmin(self.room))
            if self.room[j] >= 0:
                return moved
            if i % 16 == 0 and time.perf_counter() >= deadline:
                return None
            holders = self.piece_node[(self.piece_lo <= j) & (self.piece_hi >= j)]
            if len(holders) > _REPAIR_SAMPLE:
                holders = rng.choice(holders, size=_REPAIR_SAMPLE, replace=False)
            best = (math.inf, -1, -1)
            for n in holders:
                n, s = int(n), self.choice[int(n)]
                lo, _, extras = self.held[n]
                extra = extras[int(np.searchsorted(lo, j, side="right")) - 1]
                freed = extra[s] - extra
                dearer = (self.local[n] - self.local[n][s]) + _FORBIDDEN_PER_BYTE * (self.bad[n] - self.bad[n][s])
                per_byte = np.full(len(freed), np.inf)
                frees = freed > 0
                per_byte[frees] = dearer[frees] / freed[frees]
                t = int(np.argmin(per_byte))
                if per_byte[t] < best[0]:
                    best = (float(per_byte[t]), n, t)
            if best[1] < 0:
                return None
            self.move(best[1], best[2])
            moved.append(best[1])
        return None

    def search(self, deadline: float, stop: threading.Event | None = None, seed: int = 0,
               max_kicks: int | None = None) -> None:
        """Kicks and descents around them until ``deadline`` (or ``max_kicks`` more kicks),
        keeping what pays off."""
        rng = np.random.default_rng(seed)
        last = math.inf if max_kicks is None else self.kicks + max_kicks
        while not _stopped(deadline, stop) and self.kicks < last:
            self.kicks += 1
            if self.kicks % _REFRESH_KICKS == 0:
                self.refresh()
            best = (self.forbidden, self.value)
            self.undo = []
            moved = self.kick(rng, _KICK_EDGES)
            repaired = self.repair(rng, deadline)
            if repaired is not None:
                self.descend(deadline, stop, around=moved + repaired)
            undo, self.undo = self.undo, None
            if repaired is None or not self.fits() or (self.forbidden, self.value) >= (
                    best[0], best[1] - 1e-12 * abs(best[1])):
                for n, s in reversed(undo):
                    self.move(n, s)
            else:
                self.kept += 1


def _stopped(deadline: float, stop: threading.Event | None) -> bool:
    """Whether ``deadline`` has passed or ``stop`` is set."""
    return time.perf_counter() >= deadline or (stop is not None and stop.is_set())


def _pair_descent(red: _Reduced, choice: dict[int, int], deadline: float,
                  stop: threading.Event | None = None) -> dict[int, int]:
    """``choice`` improved by pair moves (:class:`_PairMoves`) where it fits memory."""
    moves = _PairMoves(red, choice)
    if not moves.fits():
        return dict(choice)  # the moves keep an answer within memory; this one is not
    moves.descend(deadline, stop)
    return moves.choice
