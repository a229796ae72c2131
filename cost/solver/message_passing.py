"""Message passing on the pairwise part of the problem (the memory rows dropped).

:class:`_Messages` runs MPLP on the dual of the edge-marginal LP: a lower bound on any graph, and
costs reparametrised so that each node sees what its far neighbours prefer, from which
:func:`_dual_decode` reads an assignment. Large graphs take array steps: edges stacked in groups
that share no node (:class:`_StackedMessages`, :class:`_EdgeGroup`), a hub's edges in one step
(:class:`_Star`), and 1-opt moves of many nodes at once (:class:`_Sweeps`).
"""

from __future__ import annotations

import functools
import math
import time
from collections import defaultdict
from dataclasses import replace
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from graphpass.cost.solver.local_search import _forbidding, _greedy_local_search
from graphpass.cost.solver.reductions import _Reduced

# Edges from which message passing updates edges in stacked groups (`_StackedMessages`).
_STACKED_EDGES = 5_000


class _Messages:
    r"""Message passing on the pairwise part of the problem: a lower bound on any graph, with the
    memory rows dropped (a relaxation) and the edges' costs moved onto their nodes (MPLP's
    block-coordinate ascent on the dual of the edge-marginal LP relaxation); also the
    reparametrised costs, for :func:`_dual_decode`.

    For any messages :math:`m_{e \to n}`, with :math:`\theta'_n = c_n + \sum_{e \ni n} m_{e \to n}`
    and :math:`\theta'_e(s, t) = R_e(s, t) - m_{e \to u}(s) - m_{e \to v}(t)`, every assignment
    costs the same under :math:`\theta'` as under the original costs, so :math:`\sum_n \min
    \theta'_n + \sum_e \min \theta'_e` is a lower bound whatever the messages; each sweep sets
    every edge's two messages to the values that maximise it with the rest fixed. Forbidden pairs
    (inf) simply never attain a minimum. The messages persist between calls of :meth:`run`, so
    the Lagrangian's rounds, which change only the node costs, start from the last ones.
    """

    def __init__(self, red: _Reduced):
        self.live = red.live_nodes()
        self.edges = list(red.edges())
        self.to_u = [np.zeros(m.shape[0]) for _, _, m in self.edges]
        self.to_v = [np.zeros(m.shape[1]) for _, _, m in self.edges]
        self.stacked = _StackedMessages(red) if len(self.edges) >= _STACKED_EDGES else None

    def run(self, cost: Mapping[int, np.ndarray], deadline: float, max_sweeps: int = 50, until_stalled: bool = True
            ) -> tuple[float, dict[int, np.ndarray], dict[tuple[int, int], np.ndarray]]:
        """Sweeps with node costs ``cost`` until ``deadline``, ``max_sweeps`` or a stalled bound;
        returns the bound, :math:`\theta'_n` per live node and :math:`\theta'_e` per edge."""
        if self.stacked is not None:
            return self.stacked.run(cost, deadline, max_sweeps, until_stalled)
        edges, to_u, to_v = self.edges, self.to_u, self.to_v
        belief = {n: np.asarray(cost[n], dtype=float).copy() for n in self.live}  # theta'_n
        for (u, v, _), mu, mv in zip(edges, to_u, to_v):
            belief[u] += mu
            belief[v] += mv

        def bound() -> float:
            total = sum(float(b.min()) for b in belief.values())
            for (u, v, m), mu, mv in zip(edges, to_u, to_v):
                total += float((m - mu[:, None] - mv[None, :]).min())
            return total

        def result(value: float):
            pairs = {(u, v): m - mu[:, None] - mv[None, :] for (u, v, m), mu, mv in zip(edges, to_u, to_v)}
            return value, belief, pairs

        def update(i: int) -> None:
            u, v, m = edges[i]
            bu = belief[u] - to_u[i]  # the rest of u's belief, without this edge
            bv = belief[v] - to_v[i]
            new_u = 0.5 * ((m + bv[None, :]).min(axis=1) - bu)
            new_v = 0.5 * ((m + bu[:, None]).min(axis=0) - bv)
            belief[u], belief[v] = bu + new_u, bv + new_v
            to_u[i], to_v[i] = new_u, new_v

        return result(_ascend(bound, [functools.partial(update, i) for i in range(len(edges))], deadline, max_sweeps,
                              until_stalled))


#: Nodes with at least this many edges are stars in :class:`_StackedMessages`: their edges are
#: updated in one step each sweep (:class:`_Star`) instead of one colour group per edge.
_STAR_DEGREE = 16


class _StackedMessages:
    """:class:`_Messages`' sweeps with edges updated in stacked groups: edges of one shape that
    share no node (a greedy colouring per shape) update in one array step. The edges of a node
    with :data:`_STAR_DEGREE` edges or more (XLA graphs have nodes with over a thousand) would
    need as many colours, most of them groups of one or two edges; they are updated together
    instead (:class:`_Star`). The sweep visits the edges in another order than one at a time
    does; the bound stays valid."""

    def __init__(self, red: _Reduced):
        self.live = red.live_nodes()
        row = {n: i for i, n in enumerate(self.live)}
        self.width = max((len(red.cost[n]) for n in self.live), default=0)
        degree = {n: len(red.adj[n]) for n in self.live}
        used: dict[int, set[int]] = defaultdict(set)  # node -> colours of its edges so far
        members: dict[tuple[int, int, int], list[tuple[int, int, np.ndarray]]] = defaultdict(list)
        spokes: dict[int, list[tuple[int, int, np.ndarray]]] = defaultdict(list)  # hub -> its edges
        for u, v, m in red.edges():
            hub = max((u, v), key=lambda n: (degree[n], -n))
            if degree[hub] >= _STAR_DEGREE:
                spokes[hub].append((u, v, m))
                continue
            colour = 0
            while colour in used[u] or colour in used[v]:
                colour += 1
            used[u].add(colour)
            used[v].add(colour)
            members[(m.shape[0], m.shape[1], colour)].append((u, v, m))
        groups = [_EdgeGroup(np.array([row[u] for u, _, _ in group]), np.array([row[v] for _, v, _ in group]),
                             [(u, v) for u, v, _ in group], np.stack([m for _, _, m in group]))
                  for _, group in sorted(members.items(), key=lambda item: item[0][2])]
        self.stars = [_Star(row[hub], row, edges) for hub, edges in spokes.items()]
        self.groups = groups + [g for star in self.stars for g in star.groups]
        self.updates = [g.update for g in groups] + [star.update for star in self.stars]

    def run(self, cost: Mapping[int, np.ndarray], deadline: float, max_sweeps: int, until_stalled: bool
            ) -> tuple[float, dict[int, np.ndarray], dict[tuple[int, int], np.ndarray]]:
        belief = np.full((len(self.live), self.width), np.inf)  # theta'_n, one row per live node
        for i, n in enumerate(self.live):
            belief[i, :len(cost[n])] = cost[n]
        for g in self.groups:  # a star's groups repeat its hub: adds that accumulate
            ku, kv = g.matrices.shape[1:]
            np.add.at(belief, (g.u[:, None], np.arange(ku)), g.to_u)
            belief[g.v, :kv] += g.to_v

        def bound() -> float:
            total = float(belief.min(axis=1).sum())  # the padding is inf: never a minimum
            return total + sum(float(g.pairs().min(axis=(1, 2)).sum()) for g in self.groups)

        def result(value: float):
            beliefs = {n: belief[i, :len(cost[n])].copy() for i, n in enumerate(self.live)}
            pairs = {key: m for g in self.groups for key, m in g.items()}
            return value, beliefs, pairs

        return result(_ascend(bound, [functools.partial(update, belief) for update in self.updates], deadline,
                              max_sweeps, until_stalled))


class _Star:
    r"""The edges of one node (the hub) updated as :class:`_Messages` updates them one after
    another, in one array step. Each edge's update changes the hub's belief as
    :math:`b_k = (b_{k-1} + \gamma_k - m_k) / 2` (:math:`\gamma_k` the edge's min over the other
    end, which the earlier edges leave alone: the other ends are distinct; :math:`m_k` the
    edge's old message to the hub), a linear recurrence, so the beliefs the hub passes through
    are a triangular matrix product, taken in chunks of :data:`_STAR_CHUNK` (a weight of
    :math:`2^{-64}` is below double precision). The edges are grouped by the size of their other
    end, oriented hub first; ``flipped`` marks those stored the other way round in the problem."""

    def __init__(self, hub: int, row: Mapping[int, int], edges: Sequence[tuple[int, int, np.ndarray]]):
        self.hub = hub
        by_size: dict[int, list[tuple[int, int, np.ndarray]]] = defaultdict(list)
        for u, v, m in edges:
            by_size[m.shape[1] if row[u] == hub else m.shape[0]].append((u, v, m))
        self.groups = []
        for group in by_size.values():
            flipped = np.array([row[u] != hub for u, _, _ in group])
            others = np.array([row[v] if row[u] == hub else row[u] for u, v, _ in group])
            matrices = np.stack([m.T if f else m for (_, _, m), f in zip(group, flipped)])
            self.groups.append(_EdgeGroup(np.full(len(group), hub), others, [(u, v) for u, v, _ in group],
                                          matrices, flipped))
        self.size = self.groups[0].matrices.shape[1]
        k = np.arange(_STAR_CHUNK)
        self.weights = np.tril(0.5 ** (k[:, None] - k[None, :] + 1.0))  # of gamma - m in each b_k
        self.decay = 0.5 ** (k + 1.0)  # of the chunk's first belief in each b_k

    def update(self, belief: np.ndarray) -> None:
        kh = self.size
        rest = [belief[g.v, :g.matrices.shape[2]] - g.to_v for g in self.groups]  # the other ends without the edge
        gamma = np.concatenate([(g.matrices + bv[:, None, :]).min(axis=2) for g, bv in zip(self.groups, rest)])
        old = np.concatenate([g.to_u for g in self.groups])
        drive = gamma - old
        if not np.isfinite(drive).all():
            raise AssertionError("a hub strategy forbidden against every strategy of a neighbour survived pruning")
        before = np.empty_like(drive)  # the hub's belief before each edge's update
        b = belief[self.hub, :kh].copy()
        for start in range(0, len(drive), _STAR_CHUNK):
            chunk = drive[start: start + _STAR_CHUNK]
            n = len(chunk)
            after = self.decay[:n, None] * b[None, :] + self.weights[:n, :n] @ chunk
            before[start] = b
            before[start + 1: start + n] = after[:-1]
            b = after[-1]
        rest_hub = before - old  # the hub's belief without each edge, when its turn came
        to_hub = 0.5 * (gamma - rest_hub)
        at = 0
        for g, bv in zip(self.groups, rest):
            n = len(g.v)
            bu = rest_hub[at: at + n]
            g.to_u = to_hub[at: at + n]
            g.to_v = 0.5 * ((g.matrices + bu[:, :, None]).min(axis=1) - bv)
            belief[g.v, :g.matrices.shape[2]] = bv + g.to_v
            at += n
        belief[self.hub, :kh] = b


#: Edges per triangular product in :meth:`_Star.update`.
_STAR_CHUNK = 64


def _ascend(bound: Callable[[], float], updates: Sequence[Callable[[], None]], deadline: float,
            max_sweeps: int, until_stalled: bool = True) -> float:
    """Message passing's outer loop: sweeps of ``updates`` (each a block-coordinate step that
    never lowers ``bound()``) until ``deadline`` (checked between steps), ``max_sweeps`` or, with
    ``until_stalled``, a sweep that raises the bound by nothing; returns the best bound seen.
    Without ``until_stalled`` the bound is computed once, at the end (a sweep's worth of work
    on graphs with many small edge groups): the steps never lower it."""
    best = bound() if until_stalled else -math.inf
    for _ in range(max_sweeps):
        for step in updates:
            if time.perf_counter() >= deadline:
                return max(best, bound())
            step()
        if not until_stalled:
            continue
        value = bound()
        if value <= best + 1e-9 * abs(best):
            return max(best, value)
        best = value
    return best if until_stalled else bound()


class _EdgeGroup:
    """Edges of one shape that share no node, stacked: their MPLP updates are one array step."""

    def __init__(self, u: np.ndarray, v: np.ndarray, keys: list[tuple[int, int]], matrices: np.ndarray,
                 flipped: np.ndarray | None = None):
        self.u, self.v, self.keys, self.matrices = u, v, keys, matrices
        self.flipped = np.zeros(len(keys), dtype=bool) if flipped is None else flipped  # keys[i] is (v, u)
        self.to_u = np.zeros(matrices.shape[:2])  # messages into each edge's u, and into its v
        self.to_v = np.zeros((matrices.shape[0], matrices.shape[2]))

    def pairs(self) -> np.ndarray:
        return self.matrices - self.to_u[:, :, None] - self.to_v[:, None, :]

    def items(self) -> Iterable[tuple[tuple[int, int], np.ndarray]]:
        """Each edge's key and reparametrised costs, oriented as the key."""
        for key, m, f in zip(self.keys, self.pairs(), self.flipped):
            yield key, (m.T if f else m)

    def update(self, belief: np.ndarray) -> None:
        ku, kv = self.matrices.shape[1:]
        bu = belief[self.u, :ku] - self.to_u  # the rest of u's belief, without this edge
        bv = belief[self.v, :kv] - self.to_v
        new_u = 0.5 * ((self.matrices + bv[:, None, :]).min(axis=2) - bu)
        new_v = 0.5 * ((self.matrices + bu[:, :, None]).min(axis=1) - bv)
        belief[self.u, :ku] = bu + new_u
        belief[self.v, :kv] = bv + new_v
        self.to_u, self.to_v = new_u, new_v


class _Sweeps:
    """Best-improvement 1-opt moves on the pairwise part (no memory rows), many nodes at a time.

    The live nodes are coloured so that no two of a colour share an edge; all the nodes of one
    colour move at once, each to its best strategy given its neighbours, none of which moves
    with it, so every step is as exact as one node's. Edges are stacked by shape and strategies
    laid end to end (node ``i``'s at ``start[i]..start[i] + sizes[i]``), so a colour's step is a
    few array operations per edge shape instead of a Python loop over nodes and edges. A move
    is judged by the forbidden pairs it touches, then by cost, as in
    :func:`_greedy_local_search`. On IOPDDL R (10k reduced nodes, 24k edges, 4 colours) two
    1-opt descents take 0.1-0.2 s where the node-by-node passes took ~1 s.
    """

    def __init__(self, red: _Reduced):
        import networkx as nx

        self.live = live = red.live_nodes()
        row = {n: i for i, n in enumerate(live)}
        self.sizes = np.array([len(red.cost[n]) for n in live], dtype=np.int64)
        self.start = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        by_shape: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        graph = nx.Graph()
        graph.add_nodes_from(range(len(live)))
        for u, v, m in red.edges():
            graph.add_edge(row[u], row[v])
            by_shape[m.shape].append((u, v))
        colour_of = nx.greedy_color(graph, strategy="largest_first")
        colour = np.array([colour_of[i] for i in range(len(live))], dtype=np.int64)
        self.classes = [np.flatnonzero(colour == c) for c in range(int(colour.max(initial=-1)) + 1)]
        self.keys = list(by_shape.values())
        self.ends = [(np.array([row[u] for u, _ in keys]), np.array([row[v] for _, v in keys])) for keys in self.keys]
        self.own = self.stacked({(u, v): m for u, v, m in red.edges()})  # red's own edge costs
        # per colour: its nodes' strategies (flat positions), where each node's run begins among
        # them, and per shape the edges whose u, and whose v, has that colour
        self.flat = [np.concatenate([np.arange(self.start[i], self.start[i] + self.sizes[i]) for i in nodes])
                     if len(nodes) else np.zeros(0, dtype=np.int64) for nodes in self.classes]
        self.runs = [np.concatenate([[0], np.cumsum(self.sizes[nodes])[:-1]]).astype(np.int64) for nodes in self.classes]
        self.touch = [[(np.flatnonzero(colour[u] == c), np.flatnonzero(colour[v] == c)) for u, v in self.ends]
                      for c in range(len(self.classes))]

    def laid_out(self, cost: Mapping[int, np.ndarray]) -> np.ndarray:
        """Node costs end to end, in live-node order."""
        return np.concatenate([np.asarray(cost[n], dtype=float) for n in self.live]) if self.live else np.zeros(0)

    def stacked(self, matrices: Mapping[tuple[int, int], np.ndarray]) -> list[np.ndarray]:
        """Edge matrices ``matrices[(u, v)]`` stacked by shape, in this object's order."""
        return [np.stack([matrices[key] for key in keys]) for keys in self.keys]

    def _first_min(self, key: np.ndarray, runs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Per run of ``key`` (runs begin at ``runs``, ``sizes`` long), the index of its first minimum."""
        least = np.minimum.reduceat(key, runs)
        at = np.where(key <= np.repeat(least, sizes), np.arange(len(key)), len(key))
        return np.minimum.reduceat(at, runs) - runs

    def descend(self, cost: np.ndarray, matrices: Sequence[np.ndarray], choice: np.ndarray, deadline: float,
                max_sweeps: int = 20) -> np.ndarray:
        """1-opt from ``choice`` (a strategy per live node) on laid-out node ``cost`` and the edge
        ``matrices`` (as :meth:`stacked`), until a sweep moves nothing, ``max_sweeps`` or ``deadline``."""
        choice = choice.copy()
        total = np.zeros(len(cost))
        bad = np.zeros(len(cost))
        for _ in range(max_sweeps):
            moved = False
            for nodes, flat, runs, touch in zip(self.classes, self.flat, self.runs, self.touch):
                if time.perf_counter() > deadline:
                    return choice
                total[flat], bad[flat] = cost[flat], 0.0
                for (u, v), m, (on_u, on_v) in zip(self.ends, matrices, touch):
                    if len(on_u):
                        self._add(total, bad, self.start[u[on_u]], m[on_u, :, choice[v[on_u]]])
                    if len(on_v):
                        self._add(total, bad, self.start[v[on_v]], m[on_v, choice[u[on_v]], :])
                here_total, here_bad, sizes = total[flat], bad[flat], self.sizes[nodes]
                fewest = np.repeat(np.minimum.reduceat(here_bad, runs), sizes)
                pick = self._first_min(np.where(here_bad == fewest, here_total, np.inf), runs, sizes)
                now = runs + choice[nodes]
                new = runs + pick
                better = (here_bad[new] < here_bad[now]) | (
                    (here_bad[new] == here_bad[now])
                    & (here_total[new] + 1e-12 * np.abs(here_total[new]) < here_total[now]))
                if better.any():
                    choice[nodes[better]] = pick[better]
                    moved = True
            if not moved:
                break
        return choice

    @staticmethod
    def _add(total: np.ndarray, bad: np.ndarray, begins: np.ndarray, part: np.ndarray) -> None:
        """Add each row of ``part`` (a node's strategies against one chosen neighbour) at its
        node's strategies; forbidden pairs count in ``bad`` instead."""
        at = (begins[:, None] + np.arange(part.shape[1])).ravel()
        part = part.ravel()
        forbidden = np.isinf(part)
        np.add.at(total, at, np.where(forbidden, 0.0, part))
        if forbidden.any():
            np.add.at(bad, at, forbidden)


def _dual_decode(red: _Reduced, belief: Mapping[int, np.ndarray], pairs: Mapping[tuple[int, int], np.ndarray],
                 deadline: float, sweeps: _Sweeps | None = None, forbidding: set[tuple[int, int]] | None = None) -> dict[int, int]:
    """An assignment read off the reparametrised costs of :class:`_Messages`: the greedy pass and
    its 1-opt moves run on :math:`\theta'` (nodes most decided by their beliefs first), where the
    edges' costs already sit on the nodes, so a node's local choice sees what its far neighbours
    prefer; then 1-opt on ``red``'s own costs (memory repaired there when ``red`` has rows). On
    pairwise problems that are not series-parallel (IOPDDL's XLA graphs) it starts far better
    than the greedy pass alone. With ``sweeps`` (built on ``red``'s graph, whose edge costs
    it holds), for a ``red`` without memory rows, the 1-opt moves are :class:`_Sweeps`'.
    ``forbidding`` as for :func:`_greedy_local_search`."""
    live = red.live_nodes()
    forbidding = _forbidding(red) if forbidding is None else forbidding
    adj: list[dict[int, np.ndarray]] = [{} for _ in red.names]
    for (u, v), m in pairs.items():
        adj[u][v], adj[v][u] = m, m.T
    cost = list(red.cost)
    for n in live:
        cost[n] = belief[n]

    def margin(n: int) -> float:  # how much the best strategy beats the second
        b = np.sort(belief[n][np.isfinite(belief[n])])
        return float(b[1] - b[0]) if len(b) > 1 else math.inf

    order = sorted(live, key=margin, reverse=True)
    if sweeps is None:
        decoded = _greedy_local_search(replace(red, cost=cost, adj=adj), deadline=deadline, order=order,
                                       forbidding=forbidding)
        return _greedy_local_search(red, deadline=deadline, initial=decoded, forbidding=forbidding)
    # the greedy pass node by node (its order is what makes the decode good), its 1-opt moves by sweeps
    greedy = _greedy_local_search(replace(red, cost=cost, adj=adj), max_rounds=0, deadline=deadline, order=order,
                                  forbidding=forbidding)
    x = np.array([greedy[n] for n in sweeps.live])
    x = sweeps.descend(sweeps.laid_out(belief), sweeps.stacked(pairs), x, deadline)
    x = sweeps.descend(sweeps.laid_out(red.cost), sweeps.own, x, deadline)
    return {n: int(s) for n, s in zip(sweeps.live, x)}
