r"""Generic strategy-assignment ILP: pick one strategy per node, pay node and resharding costs,
stay under a memory limit. Torch-free: the planner turns a graph into a :class:`Problem`.

Formulation
-----------
Sets: nodes :math:`n \in N`, strategies :math:`s \in S_n`, edges :math:`e = (u, v) \in E` with
resharding matrix :math:`R_e[s, t]`, time steps :math:`k`, and :math:`L_k = \{n : first_n \le k \le
last_n\}` the nodes whose memory is held at step :math:`k`.

Variables: :math:`x_{n,s} \in \{0, 1\}` (node n uses strategy s); :math:`y_{e,s,t} \ge 0` continuous
(edge e sees strategy pair (s, t)).

.. math::

    \min\ \sum_n \sum_s c_{n,s}\, x_{n,s} + \sum_e \sum_{s,t} R_e[s,t]\, y_{e,s,t}
        \qquad \text{-> } \_set\_objective

    \sum_s x_{n,s} = 1 \quad \forall n
        \qquad \text{-> } \_add\_one\_strategy\_per\_node

    \sum_t y_{e,s,t} = x_{u,s}\ \ \forall e, s; \qquad \sum_s y_{e,s,t} = x_{v,t}\ \ \forall e, t
        \qquad \text{-> } \_add\_edge\_marginals

    \sum_{n \in L_k} \sum_s m_{n,s}\, x_{n,s} \le M \quad \forall k
        \qquad \text{-> } \_add\_memory\_limit

Why y may stay continuous (the "marginal" or "transportation" linearisation): once x is binary,
node u picks a single a and v a single b, so the row sums of :math:`y_e` are the unit vector
:math:`e_a` and its column sums :math:`e_b`. With :math:`y \ge 0`, every row other than a and every
column other than b must be all zero, so the only entry left, :math:`y_{e,a,b}`, equals 1: y is
integral without being declared so and the MILP branches on x alone. Its LP relaxation is also
much tighter than the textbook :math:`y \ge x_{u,s} + x_{v,t} - 1` (DESIGN.md: 5-10x faster).

Memory steps: only steps where some interval starts need a row: if k is any step and k' the latest
start of an interval live at k, every interval live at k is live at k', so :math:`L_k \subseteq
L_{k'}`. Rows that cannot bind (sum of per-node maxima <= M) are skipped; each row is written
relative to the per-node minimum memory. While the rows' total size stays small they are written
out; when intervals nest (forward i to backward 2N-1-i, a quadratic total) each row becomes a
running sum :math:`U_j = U_{j-1} + \sum_{n \text{ enters at } j} E_n - \sum_{n \text{ left
after } j-1} E_n \le rhs_j` with :math:`E_n = \sum_s (m_{n,s} - \min m_n) x_{n,s}`: the same
LP, linear in size -> ``_add_memory_limit``.

Infeasibility: the memory rows are the only constraints that can fail, and each :math:`x_n` enters
them only through :math:`m_{n,s} \ge` its own minimum. Minimising the peak
:math:`P \ge \sum_{L_k} m\,x\ \forall k` is therefore separable: the answer is
:math:`P^* = \max_k \sum_{n \in L_k} \min_s m_{n,s}` (every node at its smallest strategy), so it is
computed in closed form (:func:`min_peak_memory`) instead of by a second MILP. ``M < P^*`` raises
:class:`InfeasibleError` naming ``memory_limit_bytes`` and :math:`P^*`.

Reductions (:func:`_reduce`), each keeping the optimum value, repeated to a fixpoint:

1. Parallel edges u->v (and v->u, transposed) are merged by summing matrices; a self-edge adds its
   diagonal to the node cost.
2. Strategy s of node n is dropped when another strategy t has :math:`c_t \le c_s`,
   :math:`m_t \le m_s` and, on every incident edge, a resharding row (column for incoming edges)
   elementwise <= that of s, ties broken by index. Swapping s for t in any assignment then never
   raises cost or the memory of any step.
3. A node with one strategy left is folded into its neighbours' costs.
4. Chains and leaves collapse (:func:`_eliminate`): a node that no binding memory row sees and
   that has at most two neighbours u, w is replaced by the edge
   :math:`R'_{u,w}[a,b] = \min_s R_{u,n}[a,s] + c_n[s] + R_{n,w}[s,b]` (a leaf folds into its
   neighbour's cost), and its best strategy is read back from the argmin table after the solve.
   Series-parallel graphs without a binding limit reduce to nothing: exact, no MILP.

Every problem gets two starting answers: greedy with 1-opt moves, and one decoded from message
passing (:class:`_Messages`, MPLP on the edge-marginal LP's dual). Message passing moves the
edges' costs onto the nodes, so a greedy pass on the reparametrised costs sees what distant
neighbours prefer (:func:`_dual_decode`). Its dual value is a lower bound on any graph.

Large problems (over ``_FULL_MODEL_SIZE`` variables after reduction, e.g. 10,000 op nodes; a plain
MILP of that size finds no incumbent in 60 s here):

- a Lagrangian relaxation of the memory rows (:func:`_lagrangian`): for multipliers
  :math:`\lambda \ge 0` the minimum of :math:`\sum c\,x + \sum_j \lambda_j (U_j - rhs_j)` is a
  lower bound. Without memory rows, reduction 4 solves the inner problem exactly on
  series-parallel graphs. Elsewhere message passing bounds it and decodes a minimiser (on large
  graphs in array steps: edges of one shape that share no node together, a high-degree node's
  edges together (:class:`_Star`), and 1-opt moves of non-adjacent nodes together
  (:class:`_Sweeps`)). Subgradient steps raise the bound; the best multipliers, scaled until their minimiser fits,
  give a feasible plan that prices memory as the dual does;
- that plan or the best start, whichever is cheaper, improved by 1-opt moves, by pair moves
  (:class:`_PairMoves`: both ends of an edge at once, to the best pair that fits memory) and
  by kicks (a few expensive edges set to random cheap pairs, the rows they overflow repaired
  at the least cost per byte, pair moves around them; undone unless they pay off), then by
  large neighbourhood search (:func:`_large_neighbourhoods`). Windows are breadth-first graph
  neighbourhoods, re-solved exactly by HiGHS with the rest fixed, two at a time where they
  share no node or edge. Their rows are merged where the same window nodes are live, so a
  window of W nodes has at most 2W rows.

The gap reported is to the Lagrangian bound (bench/solver_scale.py: 10,000 nodes x 6 strategies
within 0.13% in 60 s, 20,000 within 0.26%, 50,000 within 1.4%, where greedy + local search
alone is 22% above).

Below that size the whole MILP runs in its own thread. If it has not finished after
``_WINDOWS_AFTER`` of the time, the windows improve the heuristic's answer on the other core
meanwhile (:func:`_whole_and_windows`). Some reduced instances of 10k-50k nodes stay under the
size cutoff, and HiGHS finds no incumbent for them in 60 s (IOPDDL D and Q). There the windows'
answer is the one returned.

Backends: ``"highs"`` (default) is HiGHS through ``pywraplp`` (checked to exist in OR-Tools 9.15);
``"cp-sat"`` builds the same model with integer coefficients: the objective is scaled so that its
largest coefficient becomes ``_CPSAT_COST_RESOLUTION`` (1e9) and rounded, which makes the CP-SAT
optimum optimal up to half a unit per term; memory is kept exact when all values are integral
(bytes usually are), otherwise scaled to 1e12 with coefficients rounded up and the limit rounded
down (conservative). A greedy + local-search :func:`heuristic` gives CP-SAT's warm start
(``AddHint``; HiGHS gets none: ``SetHint`` segfaults in Solve with HiGHS in OR-Tools 9.15). It also
competes with the solver's answer: the cheaper one is returned, with its gap to the best bound
known (the solver's, else every term at its own minimum). HiGHS can overrun its own time limit
(presolve), so model building and solving run in a thread (pywraplp releases the GIL) and the
deadline is enforced here: past it the solve is interrupted and the heuristic returned.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

__all__ = [
    "Node",
    "Edge",
    "Problem",
    "Solution",
    "InfeasibleError",
    "ForbiddenError",
    "solve",
    "heuristic",
    "evaluate",
    "min_peak_memory",
]

_CPSAT_COST_RESOLUTION = 1e9
_CPSAT_MEMORY_RESOLUTION = 1e12
# Extra wall-clock allowed past a phase's deadline for model building and for HiGHS to notice it.
_DEADLINE_GRACE_S = 1.0
# What solve() keeps of time_limit_s for finishing: the smaller of the two.
_FINISH_S, _FINISH_SHARE = 2.5, 0.05
_REL_TOL = 1e-9
# Memory rows are written out one by one while their total number of terms stays below this;
# beyond it (nested live intervals of a long graph) as a running sum, linear in the node count.
_DIRECT_ROW_TERMS = 200_000
# Whole-problem MILPs above this many variables are not attempted: HiGHS found no incumbent in 60 s
# for 10,000 nodes x 6 strategies (~500k variables) and proves ~50k-variable ones in seconds. They
# are improved window by window instead (_large_neighbourhoods), each window about this big and
# given at most _LNS_WINDOW_S.
_FULL_MODEL_SIZE = 150_000
_LNS_MODEL_SIZE = 40_000
_LNS_WINDOW_S = 10.0
# Windows solved at once (HiGHS releases the GIL while solving): two, where there are two cores.
_LNS_THREADS = max(1, min(2, os.cpu_count() or 1))
# Share of the time limit the reductions may use (they stop there, leaving a bigger problem).
_REDUCE_SHARE = 0.25
# Share of the time left for the message-passing bound on graphs the Lagrangian cannot bound.
_DUAL_SHARE = 0.1
# Message-passing sweeps per Lagrangian round on graphs elimination cannot solve (the messages
# carry over from round to round).
_INNER_SWEEPS = 5
# Edges from which message passing updates edges in stacked groups (`_StackedMessages`).
_STACKED_EDGES = 5_000
# Share of the time left for the Lagrangian bound (and the assignment it prices) on the windows
# path, where the kicks (`_PairMoves.search`) and the windows get the rest. Before the kicks it
# was 0.85: its priced assignment gained more from rounds than the windows did from time (0.7
# rather than 0.4: IOPDDL K 2.03 -> 1.76 of the best known, T 1.80 -> 1.54; 0.85 rather than
# 0.7: U 1.22 -> 1.09, N 1.57 -> 1.43). The kicks gain more still on some: single runs of
# R, T, U, N at 0.85 / 0.5 / 0.25 gave 1.41 / 1.28 / 1.27, 1.31 / 1.34 / 1.34, 1.02 / 1.08 /
# 1.09 and 1.28 / 1.20 / 1.22. Beside a whole MILP no kicks run and it keeps 0.85: the windows
# there cover the problem in a few, and the price search walks from its multipliers (IOPDDL D,
# Q).
_LAGRANGIAN_SHARE = 0.5
_LAGRANGIAN_ALONE_SHARE = 0.85
#: Rounds after which a Lagrangian whose multipliers have not raised the bound above its
#: every-price-zero value stops (IOPDDL R: none did in 30 rounds; its time goes to the kicks).
_LAGRANGIAN_PATIENCE = 8
#: Share of the time left that each descent by pair moves (`_pair_descent`) may take.
_PAIR_SHARE = 0.25
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
#: Share of the time left after the price search that the kicks take from the windows.
_KICK_SHARE = 0.8
#: Of the time left after it, the share the price search (`_price_search`) takes from the windows.
_PRICE_SHARE = 0.5
# Where the whole MILP runs, the windows start beside it once this share of the time left has
# passed without it finishing (the 816-node IOPDDL instances are proven in 3-5 s of 60).
_WINDOWS_AFTER = 0.15


@dataclass(frozen=True)
class Node:
    """A decision: one entry per strategy. ``live`` = [first, last] step its memory is held."""

    name: str
    costs_s: Sequence[float]
    memory_bytes: Sequence[float]
    live: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Edge:
    """Resharding time ``cost_s[strategy of src][strategy of dst]``."""

    src: str
    dst: str
    cost_s: Sequence[Sequence[float]]


@dataclass(frozen=True)
class Problem:
    """Nodes, edges and one memory limit. A cost ``>= forbidden_cost_s`` (and any ``inf``) forbids
    its strategy or strategy pair: it is never chosen (:class:`ForbiddenError` when a node is left
    with no allowed strategy)."""

    nodes: Sequence[Node]
    edges: Sequence[Edge]
    memory_limit_bytes: float | None = None
    num_steps: int | None = None
    forbidden_cost_s: float = math.inf


@dataclass(frozen=True)
class Solution:
    choice: dict[str, int]
    cost_s: float
    peak_memory_bytes: float
    optimal: bool
    gap: float
    seconds: float
    solver: str
    lower_bound_s: float = -math.inf  # no assignment costs less (the gap is measured to it)


class InfeasibleError(ValueError):
    """No assignment meets ``memory_limit_bytes``; ``min_memory_bytes`` is the smallest peak."""

    def __init__(self, memory_limit_bytes: float, min_memory_bytes: float, step: int | None, *,
                 why: str | None = None):
        self.memory_limit_bytes = memory_limit_bytes
        self.min_memory_bytes = min_memory_bytes
        where = f" (at step {step})" if step is not None else ""
        why = why or (f"the smallest peak memory any assignment reaches is {min_memory_bytes:.6g} bytes{where}; "
                      "raise memory_limit_bytes to at least that, or add lower-memory strategies")
        super().__init__(f"no strategy assignment fits memory_limit_bytes={memory_limit_bytes:.6g}: {why}")


class ForbiddenError(ValueError):
    """Every strategy of ``node`` is forbidden, by its own costs or in combination with a neighbour."""

    def __init__(self, node: str, why: str):
        self.node = node
        super().__init__(f"Node {node!r}: no allowed strategy: {why}")


# --------------------------------------------------------------------------------------------
# Validation, evaluation, memory steps


@dataclass(frozen=True)
class _Arrays:
    """The problem's numbers as arrays, forbidden entries (``>= forbidden_cost_s``) set to ``inf``."""

    index: dict[str, int]
    cost: list[np.ndarray]
    mem: list[np.ndarray]
    edges: list[tuple[int, int, np.ndarray]]


def _forbid(values: np.ndarray, threshold: float) -> np.ndarray:
    return np.where(values >= threshold, np.inf, values) if np.isfinite(threshold) else values


def _validate(problem: Problem) -> _Arrays:
    index: dict[str, int] = {}
    threshold = float(problem.forbidden_cost_s)
    if math.isnan(threshold):
        raise ValueError("Problem.forbidden_cost_s must be a number (inf: only inf costs are forbidden)")
    costs, mems = [], []
    for i, node in enumerate(problem.nodes):
        if node.name in index:
            raise ValueError(f"Problem.nodes: duplicate node name {node.name!r}")
        index[node.name] = i
        k = len(node.costs_s)
        if k == 0:
            raise ValueError(f"Node {node.name!r}: costs_s is empty; give at least one strategy")
        if len(node.memory_bytes) != k:
            raise ValueError(
                f"Node {node.name!r}: memory_bytes has {len(node.memory_bytes)} entries, "
                f"costs_s has {k}; give one of each per strategy"
            )
        c, m = np.asarray(node.costs_s, dtype=float), np.asarray(node.memory_bytes, dtype=float)
        if np.isnan(c).any() or (c == -np.inf).any():
            raise ValueError(f"Node {node.name!r}: costs_s must be numbers (inf forbids a strategy)")
        if not np.isfinite(m).all():
            raise ValueError(f"Node {node.name!r}: memory_bytes must be finite")
        costs.append(_forbid(c, threshold))
        mems.append(m)
        first, last = node.live
        if not 0 <= first <= last:
            raise ValueError(f"Node {node.name!r}: live={node.live} must satisfy 0 <= first <= last")
        if problem.num_steps is not None and last >= problem.num_steps:
            raise ValueError(
                f"Node {node.name!r}: live={node.live} ends past num_steps={problem.num_steps}"
            )
    edges = []
    for edge in problem.edges:
        for end in (edge.src, edge.dst):
            if end not in index:
                raise ValueError(f"Edge {edge.src!r}->{edge.dst!r}: unknown node {end!r}")
        u, v = index[edge.src], index[edge.dst]
        rows, cols = len(costs[u]), len(costs[v])
        matrix = edge.cost_s
        if len(matrix) != rows or any(len(r) != cols for r in matrix):
            raise ValueError(
                f"Edge {edge.src!r}->{edge.dst!r}: cost_s must be {rows}x{cols} "
                f"([strategy of src][strategy of dst])"
            )
        m = np.asarray(matrix, dtype=float).reshape(rows, cols)
        if np.isnan(m).any() or (m == -np.inf).any():
            raise ValueError(f"Edge {edge.src!r}->{edge.dst!r}: cost_s must be numbers (inf forbids a pair)")
        edges.append((u, v, _forbid(m, threshold)))
    return _Arrays(index, costs, mems, edges)


@dataclass(frozen=True)
class _Steps:
    """The steps where a peak can occur, and the contiguous range of them each node is live at.

    Only interval starts need checking: if k is any step and k' the latest start of an interval live
    at k, every interval live at k is live at k'. Node n is live at the starts
    ``starts[lo[n] : hi[n] + 1]``, so per-step sums are a difference array and a cumulative sum:
    O(N log N) even when intervals nest (forward i to backward 2N-1-i), where listing each step's
    live set would be O(N^2).
    """

    starts: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def sums(self, values: np.ndarray) -> np.ndarray:
        """Per step, the sum of ``values[n]`` over the nodes live there."""
        diff = np.zeros(len(self.starts) + 1)
        np.add.at(diff, self.lo, values)
        np.add.at(diff, self.hi + 1, -values)
        return np.cumsum(diff)[:-1]


def _steps(problem: Problem) -> _Steps:
    first = np.array([n.live[0] for n in problem.nodes], dtype=np.int64)
    last = np.array([n.live[1] for n in problem.nodes], dtype=np.int64)
    starts = np.unique(first)
    return _Steps(starts, np.searchsorted(starts, first), np.searchsorted(starts, last, side="right") - 1)


def evaluate(problem: Problem, choice: dict[str, int]) -> tuple[float, float]:
    """(cost_s, peak_memory_bytes) of an assignment of strategy indices to node names."""
    by_name = {n.name: n for n in problem.nodes}
    cost = sum(float(by_name[name].costs_s[s]) for name, s in choice.items())
    cost += sum(float(e.cost_s[choice[e.src]][choice[e.dst]]) for e in problem.edges)
    if not problem.nodes:
        return cost, 0.0
    held = np.array([float(n.memory_bytes[choice[n.name]]) for n in problem.nodes])
    return cost, float(_steps(problem).sums(held).max())


def min_peak_memory(problem: Problem) -> tuple[float, int | None]:
    """Smallest peak memory any assignment reaches, and the step where it occurs (closed form:
    every node at its smallest allowed strategy; pairs forbidden on edges narrow it further, see
    :func:`solve`)."""
    if not problem.nodes:
        return 0.0, None
    arrays = _validate(problem)
    return _min_peak(_steps(problem), arrays.cost, arrays.mem)


def _min_peak(steps: _Steps, cost: Sequence[np.ndarray], mem: Sequence[np.ndarray]) -> tuple[float, int | None]:
    mins = [m[np.isfinite(c)].min() if np.isfinite(c).any() else m.min() for c, m in zip(cost, mem)]
    totals = steps.sums(np.array(mins, dtype=float))
    at = int(np.argmax(totals))
    return float(totals[at]), int(steps.starts[at])


# --------------------------------------------------------------------------------------------
# Reductions


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
    reductions 2-5 of the module docstring repeated to a fixpoint or until ``deadline`` (every
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


# --------------------------------------------------------------------------------------------
# Model building (generic over the backend's variable and constraint constructors)


@dataclass
class _Backend:
    bool_var: Callable[[str], object]
    edge_var: Callable[[str], object]
    usage_var: Callable[[str, float], object]  # continuous in [0, ub]
    add_linear: Callable[[list, list, float, float], None]  # vars, coefs, lb, ub
    minimize: Callable[[list, list], None]
    memory_unit: float = 1.0  # bytes per unit of the memory rows' coefficients


def _add_one_strategy_per_node(b: _Backend, red: _Reduced) -> dict[int, list]:
    x = {}
    for n in red.live_nodes():
        xs = [b.bool_var(f"x[{red.names[n]},{s}]") for s in red.keep[n]]
        b.add_linear(xs, [1] * len(xs), 1, 1)
        x[n] = xs
    return x


def _add_edge_marginals(b: _Backend, red: _Reduced, x: dict[int, list]) -> dict:
    """y per allowed pair of each edge (a forbidden pair has none: it is never chosen)."""
    y = {}
    for u, v, mat in red.edges():
        allowed = np.isfinite(mat)
        ys = [[b.edge_var(f"y[{u},{v},{s},{t}]") if allowed[s, t] else None for t in range(mat.shape[1])]
              for s in range(mat.shape[0])]
        for s in range(mat.shape[0]):  # sum_t y[s,t] = x[u,s]
            row = [var for var in ys[s] if var is not None]
            b.add_linear([*row, x[u][s]], [1] * len(row) + [-1], 0, 0)
        for t in range(mat.shape[1]):  # sum_s y[s,t] = x[v,t]
            col = [ys[s][t] for s in range(mat.shape[0]) if ys[s][t] is not None]
            b.add_linear([*col, x[v][t]], [1] * len(col) + [-1], 0, 0)
        y[(u, v)] = ys
    return y


def _extra_terms(x: dict[int, list], n: int, extra: np.ndarray, sign: float = 1.0) -> tuple[list, list]:
    pairs = [(var, sign * e) for var, e in zip(x[n], extra.tolist()) if e > 0]
    return [v for v, _ in pairs], [c for _, c in pairs]


def _add_memory_limit(b: _Backend, red: _Reduced, x: dict[int, list]) -> None:
    # Written relative to each node's smallest share: sum over pieces extra[s] x[n,s] <= rhs per
    # row, in units of b.memory_unit bytes.
    unit = b.memory_unit
    members = [(n, (j1, j2, extra / unit)) for n in red.live_nodes() for j1, j2, extra in red.pieces[n]]
    if not members:
        return
    terms = sum(j2 - j1 + 1 for _, (j1, j2, _) in members)
    if terms <= _DIRECT_ROW_TERMS:
        rows: dict[int, tuple[list, list]] = {}
        for n, (j1, j2, extra) in members:
            vars_, coefs = _extra_terms(x, n, extra)
            for j in range(j1, j2 + 1):
                row = rows.setdefault(j, ([], []))
                row[0].extend(vars_)
                row[1].extend(coefs)
        for j, (vars_, coefs) in sorted(rows.items()):
            b.add_linear(vars_, coefs, -math.inf, float(red.rhs[j]) / unit)
        return
    # Nested intervals make the rows quadratic in size; a running usage U_j keeps them linear:
    # U_j = U_{j-1} + (extra of pieces whose rows start at j) - (extra of those that ended at j-1).
    enter: dict[int, list] = {}
    leave: dict[int, list] = {}
    for n, (j1, j2, extra) in members:
        enter.setdefault(j1, []).append((n, extra))
        leave.setdefault(j2 + 1, []).append((n, extra))
    top = sum(float(extra.max()) for _, (_, _, extra) in members)
    previous = None
    for j in range(len(red.rhs)):
        usage = b.usage_var(f"u[{j}]", min(top, max(0.0, float(red.rhs[j]) / unit)))
        vars_, coefs = [usage], [-1.0]
        if previous is not None:
            vars_.append(previous)
            coefs.append(1.0)
        for sign, moving in ((1.0, enter.get(j, ())), (-1.0, leave.get(j, ()))):
            for n, extra in moving:
                v, c = _extra_terms(x, n, extra, sign)
                vars_ += v
                coefs += c
        b.add_linear(vars_, coefs, 0, 0)
        previous = usage


def _set_objective(b: _Backend, red: _Reduced, x: dict[int, list], y: dict) -> None:
    vars_, coefs = [], []
    for n, xs in x.items():
        vars_ += xs
        coefs += list(red.cost[n])
    for key, ys in y.items():
        mat = red.adj[key[0]][key[1]]
        for s, row in enumerate(ys):
            for t, var in enumerate(row):
                if var is not None:
                    vars_.append(var)
                    coefs.append(mat[s, t])
    b.minimize(vars_, coefs)


def _build(b: _Backend, red: _Reduced):
    x = _add_one_strategy_per_node(b, red)
    y = _add_edge_marginals(b, red, x)
    _add_memory_limit(b, red, x)
    _set_objective(b, red, x, y)
    return x, y


def _pywraplp_model(red: _Reduced, name: str = "HIGHS"):
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver(name)
    if solver is None:
        raise RuntimeError(f"OR-Tools has no {name} backend in this build")
    solver.SuppressOutput()
    solver.SetSolverSpecificParametersAsString("output_flag=false\n")  # else HiGHS prints a banner
    inf = solver.infinity()

    def add_linear(vars_, coefs, lb, ub):
        summed: dict = {}  # a variable may come twice in a running sum: SetCoefficient overwrites
        for var, c in zip(vars_, coefs):
            summed[var] = summed.get(var, 0.0) + float(c)
        con = solver.Constraint(-inf if lb == -math.inf else lb, ub)
        for var, c in summed.items():
            con.SetCoefficient(var, c)

    def minimize(vars_, coefs):
        obj = solver.Objective()
        for var, c in zip(vars_, coefs):
            if c:
                obj.SetCoefficient(var, float(c))
        obj.SetMinimization()

    backend = _Backend(
        bool_var=lambda n: solver.BoolVar(n),
        edge_var=lambda n: solver.NumVar(0.0, inf, n),
        # No lower bound (the pieces are >= 0 anyway): HiGHS 1.12's presolve calls some models
        # infeasible when a running usage is fixed at [0, 0] (a full row), found on a 2-node one.
        usage_var=lambda n, ub: solver.NumVar(-inf, ub, n),
        add_linear=add_linear,
        minimize=minimize,
        # Memory in units that put the largest piece at 1e6: HiGHS drops coefficients <= 1e-9,
        # which scaling each row to its largest coefficient made of a running sum's +-1 usage
        # terms next to 1e10-byte pieces (then it "proved" feasible problems infeasible).
        memory_unit=max([float(e.max()) for ps in red.pieces for _, _, e in ps] + [1e-300]) / 1e6,
    )
    x, y = _build(backend, red)
    return solver, x, y


def _scaled_for_cpsat(red: _Reduced) -> _Reduced:
    live = red.live_nodes()
    coefs = [abs(v) for n in live for v in red.cost[n]] + [
        abs(v) for _, _, m in red.edges() for v in m.flat if math.isfinite(v)]
    cmax = max(coefs, default=0.0)
    cscale = _CPSAT_COST_RESOLUTION / cmax if cmax > 0 else 1.0
    mems = [abs(v) for n in live for _, _, e in red.pieces[n] for v in e]
    integral = all(float(v).is_integer() and v < 2**53 for v in mems)
    mmax = max(mems + [abs(r) for r in red.rhs], default=0.0)
    mscale = 1.0 if integral or mmax == 0 else _CPSAT_MEMORY_RESOLUTION / mmax
    scaled = _Reduced(
        names=red.names,
        keep=red.keep,
        cost=[np.rint(c * cscale).astype(np.int64) for c in red.cost],
        adj=[{} for _ in red.names],
        alive=red.alive,
        num_strategies=red.num_strategies,
        rhs=np.floor(red.rhs * mscale + 1e-6),
        row_steps=red.row_steps,
        # Pieces (above each node's smallest share) are rounded up and the limit down: never over it.
        pieces=[[(j1, j2, np.ceil(e * mscale).astype(np.int64)) for j1, j2, e in ps] for ps in red.pieces],
    )
    for u, v, m in red.edges():  # forbidden pairs stay inf: the model gives them no variable
        scaled.set_edge(u, v, np.where(np.isfinite(m), np.rint(m * cscale), np.inf))
    return scaled


def _cpsat_model(red: _Reduced):
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()

    def add_linear(vars_, coefs, lb, ub):
        expr = cp_model.LinearExpr.WeightedSum(vars_, [int(c) for c in coefs])
        lo = cp_model.INT_MIN if lb == -math.inf else int(lb)
        model.AddLinearConstraint(expr, lo, int(ub))

    def minimize(vars_, coefs):
        model.Minimize(cp_model.LinearExpr.WeightedSum(vars_, [int(c) for c in coefs]))

    backend = _Backend(
        bool_var=model.NewBoolVar,
        edge_var=model.NewBoolVar,  # integral anyway (see module docstring); booleans propagate better
        usage_var=lambda n, ub: model.NewIntVar(0, int(ub), n),
        add_linear=add_linear,
        minimize=minimize,
    )
    x, y = _build(backend, _scaled_for_cpsat(red))
    return model, x, y


# --------------------------------------------------------------------------------------------
# Heuristic


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
        red, moved = self.red, []
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


def heuristic(problem: Problem) -> Solution:
    """Greedy + local search; always memory-feasible when any assignment is, never proven optimal."""
    start = time.perf_counter()
    red = _reduce(problem)
    choice = _greedy_local_search(red)
    return _solution(problem, red, choice, bound=-math.inf, start=start, solver="heuristic")


# --------------------------------------------------------------------------------------------
# Solve


def _solution(problem, red, choice, *, bound, start, solver, optimal=False) -> Solution:
    for u, v, m in red.edges():
        if np.isinf(m[choice[u], choice[v]]):
            raise ForbiddenError(
                red.names[u], f"every assignment {solver} found in the time given pairs it with a "
                f"forbidden strategy of {red.names[v]!r}; give more time or check the forbidden costs")
    assignment = red.recover(choice)
    cost, peak = evaluate(problem, assignment)
    limit = problem.memory_limit_bytes
    if limit is not None and peak > limit + _REL_TOL * abs(limit) + 1e-9:
        smallest, _ = min_peak_memory(problem)
        raise InfeasibleError(limit, smallest, None, why=(
            f"none found in the time given (the best peaks at {peak:.6g} bytes; each node alone allows "
            f"{smallest:.6g}, but strategies forbidden together can raise that); give more time or memory"))
    return Solution(
        choice=assignment,
        cost_s=cost,
        peak_memory_bytes=peak,
        optimal=optimal,
        gap=0.0 if optimal else _gap(cost, bound),
        seconds=time.perf_counter() - start,
        solver=solver,
        lower_bound_s=cost if optimal else bound,
    )


def _gap(value: float, bound: float) -> float:
    return max(0.0, value - bound) / max(abs(value), 1e-12)


def _in_thread(work: Callable[[dict], None], deadline: float, on_overrun: Callable[[], None]) -> dict | None:
    """Run ``work(result)`` in a thread until ``deadline`` (+ grace); None when it overran.

    Model building for tens of thousands of nodes can itself take seconds, so it runs in the
    thread too; pywraplp and CP-SAT release the GIL while solving.
    """
    result: dict = {}
    thread = threading.Thread(target=work, args=(result,), daemon=True)
    thread.start()
    thread.join(max(0.0, deadline + _DEADLINE_GRACE_S - time.perf_counter()))
    if thread.is_alive():
        on_overrun()
        thread.join(_DEADLINE_GRACE_S)
        return None
    return result


class _QuietStdout:
    """File descriptor 1 to /dev/null while HiGHS solves: HiGHS 1.12's MIP solver prints a debug
    line ("HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();") that
    output_flag=false does not silence, and it would land in the user's output.

    Solves nest by count (the first silences, the last restores). ``end`` is idempotent, so the
    caller can give stdout back itself when it abandons an overrunning solve thread, instead of
    losing its own output until that thread notices the interrupt.
    """

    _lock = threading.Lock()
    _depth = 0
    _saved: int | None = None

    def __init__(self) -> None:
        self._open = False

    def begin(self) -> None:
        cls = type(self)
        with cls._lock:
            if cls._depth == 0:
                sys.stdout.flush()
                try:
                    cls._saved = os.dup(1)
                except OSError:  # no fd 1 (embedded interpreter): nothing to protect
                    cls._saved = None
                if cls._saved is not None:
                    with open(os.devnull, "wb") as null:
                        os.dup2(null.fileno(), 1)
            cls._depth += 1
            self._open = True

    def end(self) -> None:
        cls = type(self)
        with cls._lock:
            if not self._open:
                return
            self._open = False
            cls._depth -= 1
            if cls._depth == 0 and cls._saved is not None:
                os.dup2(cls._saved, 1)
                os.close(cls._saved)
                cls._saved = None


def _run_highs(red: _Reduced, warm: dict[int, int], deadline: float, *, warn: bool = True):
    from ortools.linear_solver import pywraplp

    # No SetHint: with the HiGHS backend of OR-Tools 9.15 it segfaults inside Solve (checked on a
    # two-node model), so the heuristic competes with HiGHS's answer instead of seeding it.
    state: dict = {}
    quiet = _QuietStdout()
    # Abandoning and starting the solve exclude each other: a thread abandoned while it was still
    # building its model must not silence stdout (and solve to its own limit) afterwards, or the
    # caller's next lines are lost (seen: an IOPDDL row printed after the windows went missing).
    lock = threading.Lock()

    def work(result: dict) -> None:
        solver, x, _ = _pywraplp_model(red)
        solver.SetTimeLimit(max(1, int(1000 * (deadline - time.perf_counter()))))
        with lock:
            if state.get("abandoned"):
                return
            state["solver"] = solver
            quiet.begin()
        try:
            result["status"] = solver.Solve()
        finally:
            quiet.end()
        result["x"] = x

    def abandon() -> None:
        with lock:
            state["abandoned"] = True
            if "solver" in state:
                state["solver"].InterruptSolve()
            quiet.end()

    result = _in_thread(work, deadline, abandon)
    if result is None:
        # A window cut short by the overall deadline is expected; a whole problem's is news.
        log.log(logging.WARNING if warn else logging.DEBUG, "HiGHS overran its deadline; interrupted")
        return None, False, -math.inf
    solver, status = state["solver"], result["status"]
    bound = solver.Objective().BestBound() if status == pywraplp.Solver.FEASIBLE else -math.inf
    if status == pywraplp.Solver.INFEASIBLE:
        return None, True, math.inf  # proven: nothing fits
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None, False, -math.inf
    choice = {n: int(np.argmax([v.solution_value() for v in xs])) for n, xs in result["x"].items()}
    optimal = status == pywraplp.Solver.OPTIMAL
    return choice, optimal, (solver.Objective().Value() if optimal else bound)


def _run_cpsat(red: _Reduced, warm: dict[int, int], deadline: float):
    from ortools.sat.python import cp_model

    cp = cp_model.CpSolver()

    def work(result: dict) -> None:
        model, x, _ = _cpsat_model(red)
        for n, xs in x.items():
            for s, var in enumerate(xs):
                model.AddHint(var, s == warm[n])
        cp.parameters.max_time_in_seconds = max(0.01, deadline - time.perf_counter())
        # DESIGN.md: CP-SAT needs ~8 workers on 200-layer problems.
        cp.parameters.num_workers = max(1, min(8, os.cpu_count() or 1))
        result["status"] = cp.Solve(model)
        result["x"] = x

    result = _in_thread(work, deadline, cp.StopSearch)
    if result is not None and result["status"] == cp_model.INFEASIBLE:
        return None, True, math.inf  # proven: nothing fits
    if result is None or result["status"] not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, False, -math.inf
    choice = {n: int(np.argmax([cp.Value(v) for v in xs])) for n, xs in result["x"].items()}
    # CP-SAT's bound is on the scaled integer objective: only "optimal" carries over exactly.
    optimal = result["status"] == cp_model.OPTIMAL
    return choice, optimal, -math.inf


def _model_size(red: _Reduced, nodes: Sequence[int] | None = None) -> int:
    """Variables of the MILP over ``nodes`` (all live ones by default): x per strategy, y per pair."""
    inside = set(red.live_nodes() if nodes is None else nodes)
    size = sum(len(red.cost[n]) for n in inside)
    return size + sum(int(np.isfinite(m).sum()) for u, v, m in red.edges() if u in inside and v in inside)


def _usage(red: _Reduced, choice: dict[int, int], nodes: Sequence[int]) -> np.ndarray:
    """Memory above the smallest shares per row of ``nodes`` at their ``choice``."""
    diff = np.zeros(len(red.rhs) + 1)
    for n in nodes:
        for j1, j2, extra in red.pieces[n]:
            diff[j1] += extra[choice[n]]
            diff[j2 + 1] -= extra[choice[n]]
    return np.cumsum(diff)[:-1]


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
                future = pool.submit(_run_highs, sub, {}, until, warn=False)
                flight.append((nodes, sub, future, reach))
            for done in flight:
                improved |= take(*done[:3])
            if not improved:
                break
    return choice


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


def _fits(red: _Reduced, choice: dict[int, int], members: Sequence[int]) -> bool:
    room = red.rhs + _REL_TOL * np.abs(red.rhs) + 1e-9
    return bool(np.all(_usage(red, choice, members) <= room))


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
        if len(self.edges) < _STACKED_EDGES:
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
    live, members = priced.live, priced.members
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


def _better(red: _Reduced, a: dict[int, int], b: dict[int, int], live: Sequence[int]) -> dict[int, int]:
    """The one of two answers that fits memory, else the cheaper (``a`` on ties)."""
    fit_a, fit_b = _fits(red, a, live), _fits(red, b, live)
    if fit_a != fit_b:
        return a if fit_a else b
    return b if red.objective(b) < red.objective(a) else a


def _priced_and_windows(red: _Reduced, warm: dict[int, int], deadline: float, windows_until: float,
                        stop: threading.Event | None = None, threads: int = _LNS_THREADS,
                        pairs: bool = True) -> tuple[float, dict[int, int]]:
    """What a problem too big for one MILP gets, and the core beside a whole MILP: the
    Lagrangian (its bound, and its priced answer polished by 1-opt), the price search from its
    multipliers, then the windows until ``windows_until``, each improving ``warm``; all stop
    when ``stop`` is set. With ``pairs`` (problems too big for one MILP), pair moves polish the
    start and the priced answer, and kicks (:class:`_PairMoves`) take most of the time the
    price search leaves. Returns the Lagrangian's bound and the best answer (one that fits
    where any of them does)."""
    live = red.live_nodes()

    def share(fraction: float) -> float:
        now = time.perf_counter()
        return now + fraction * max(0.0, deadline - now)

    if pairs:
        warm = _pair_descent(red, warm, share(_PAIR_SHARE), stop=stop)
    prices = _MemoryPriced(red)
    bound, priced, lam = _lagrangian(red, red.objective(warm), share(
        _LAGRANGIAN_SHARE if pairs else _LAGRANGIAN_ALONE_SHARE), priced=prices, stop=stop)
    if priced is not None:
        priced = _greedy_local_search(red, deadline=share(0.1), initial=priced)
        if pairs:
            priced = _pair_descent(red, priced, share(_PAIR_SHARE), stop=stop)
        warm = _better(red, warm, priced, live)
    if lam.any():
        warm = _price_search(red, prices, lam, warm, share(_PRICE_SHARE), stop=stop)
    moves = _PairMoves(red, warm) if pairs else None
    if moves is not None and moves.fits():
        moves.descend(share(_PAIR_SHARE), stop)
        moves.search(share(_KICK_SHARE), stop)
        warm = moves.choice
    polished = _large_neighbourhoods(red, warm, windows_until, stop=stop, threads=threads)
    return bound, _better(red, warm, polished, live)


def _whole_and_windows(red: _Reduced, warm: dict[int, int], deadline: float, windows_from: float):
    """The whole MILP in its thread until ``deadline``; if it has not finished by
    ``windows_from``, the other core improves ``warm`` meanwhile as the windows path does (the
    Lagrangian's priced answer, the price search, the windows), stopping when the MILP ends.
    HiGHS may find no incumbent at all on tens of thousands of nodes (IOPDDL D and Q: none in
    60 s), and then that answer is what is returned (D 1.08 -> 1.00, Q 1.19 -> 1.00 of the best
    known with the Lagrangian; the windows alone got no further). Returns the MILP's
    ``(choice, optimal, bound)``, the bound raised to the Lagrangian's, and the improved answer."""
    done = threading.Event()
    result: dict = {}

    def whole() -> None:
        try:
            # Interrupting an overrunning HiGHS takes up to two graces: stop it early by that.
            result["out"] = _run_highs(red, warm, deadline - 2 * _DEADLINE_GRACE_S)
        finally:
            done.set()

    thread = threading.Thread(target=whole, daemon=True)
    thread.start()
    lagrangian = -math.inf
    if not done.wait(max(0.0, windows_from - time.perf_counter())):
        # The MILP holds one core: the rest of the work takes the other.
        lagrangian, warm = _priced_and_windows(red, warm, deadline, deadline - min(1.0, 0.02 * (
            deadline - time.perf_counter())), stop=done, threads=max(1, _LNS_THREADS - 1), pairs=False)
    thread.join(max(0.0, deadline + 2 * _DEADLINE_GRACE_S - time.perf_counter()))
    choice, optimal, bound = result.get("out", (None, False, -math.inf))
    return choice, optimal, max(bound, lagrangian), warm


def solve(problem: Problem, *, time_limit_s: float = 60.0, solver: str = "highs") -> Solution:
    """Cheapest strategy per node under the memory limit.

    Args:
        problem: the nodes, edges and memory limit.
        time_limit_s: wall-clock budget for the whole call (enforced here, not only by the solver).
        solver: ``"highs"`` (pywraplp) or ``"cp-sat"``.

    Returns:
        The best feasible assignment found: the solver's or the heuristic's, whichever is cheaper.
        ``optimal`` says whether it is proven; ``gap`` is its relative distance to the best lower
        bound known (the solver's, else every term at its own minimum).

    Raises:
        InfeasibleError: the memory limit is below the smallest reachable peak.
        ValueError: malformed problem or unknown solver.
    """
    start = time.perf_counter()
    if solver not in ("highs", "cp-sat"):
        raise ValueError(f"solver={solver!r}: use 'highs' or 'cp-sat'")
    arrays = _validate(problem)
    # The phases aim at a deadline short of the limit: interrupting HiGHS, the windows in flight
    # and recovering the answer take the rest (IOPDDL Q ended 2.0 s past the limit without it).
    deadline = start + time_limit_s - min(_FINISH_S, _FINISH_SHARE * time_limit_s)
    red = _reduce(problem, arrays, deadline=start + _REDUCE_SHARE * time_limit_s)
    live = red.live_nodes()

    def share(fraction: float) -> float:
        """The moment ``fraction`` of the time still left from now has passed."""
        now = time.perf_counter()
        return now + fraction * max(0.0, deadline - now)

    # The heuristic may use a tenth of what is left: it is the fallback and the plan to beat.
    warm = _greedy_local_search(red, deadline=share(0.1))
    if not live:  # everything folded exactly: the recovery is the optimum
        return _solution(problem, red, warm, optimal=True, bound=math.nan, start=start, solver="reduction")
    # A second start, decoded from message passing's reparametrised costs; its bound is kept.
    dual, belief, pairs = _Messages(red).run({n: red.cost[n] for n in live}, share(_DUAL_SHARE))
    warm = _better(red, warm, _dual_decode(red, belief, pairs, share(0.1)), live)
    if _model_size(red) > _FULL_MODEL_SIZE:
        # Too big for one MILP in time: the Lagrangian, the price search and the windows improve
        # the heuristic. Its gap is to the lower bound, as no solver bound covers the whole
        # problem. The windows stop a little early: recovering and checking the answer takes time
        # too. They are HiGHS MILPs whichever backend was asked for (CP-SAT needs a hint per node,
        # and a window is small enough for HiGHS to prove).
        bound, choice = _priced_and_windows(red, warm, deadline, deadline - min(1.0, 0.02 * time_limit_s))
        bound = max(bound, dual)
        sol = _solution(problem, red, choice, bound=bound, start=start, solver="highs windows")
        log.info("solved %d nodes (%d after reduction) by windows in %.2f s: cost %.6g s (%.6g s from "
                 "the greedy pass and message passing), lower bound %.6g s, gap %.3g",
                 len(problem.nodes), len(live), sol.seconds, sol.cost_s, red.objective(warm), bound, sol.gap)
        return sol
    run = _run_highs if solver == "highs" else _run_cpsat
    if solver == "highs":
        choice, optimal, bound, warm = _whole_and_windows(red, warm, deadline, share(_WINDOWS_AFTER))
    else:
        choice, optimal, bound = run(red, warm, deadline)
    # The heuristic's answer competes only where it fits (merged nodes can leave it overflowing).
    warm_cost = red.objective(warm) if _fits(red, warm, live) else math.inf
    if choice is None and bound == math.inf:
        if warm_cost < math.inf:  # a solver's "infeasible" that an answer in hand refutes
            log.warning("%s reported the problem infeasible, but the heuristic's answer fits; returning it", solver)
            optimal, bound = False, -math.inf
        elif problem.memory_limit_bytes is not None:
            smallest, _ = min_peak_memory(problem)
            raise InfeasibleError(float(problem.memory_limit_bytes), smallest, None, why=(
                f"the MILP proves it: strategies forbidden together raise the smallest peak above the "
                f"{smallest:.6g} bytes each node alone allows; raise memory_limit_bytes or allow more pairs"))
    found = red.objective(choice) if choice is not None else math.inf
    bound = max(bound, red.lower_bound(), dual)
    if choice is None or warm_cost < found - 1e-12 * abs(found):
        if choice is None:
            log.warning("%s found no incumbent within %.1f s; returning the heuristic", solver, time_limit_s)
        optimal = optimal and warm_cost <= bound
        choice, found, solver = warm, warm_cost, "heuristic"
    sol = _solution(problem, red, choice, optimal=optimal, bound=bound, start=start, solver=solver)
    log.info(
        "solved %d nodes / %d edges (%d / %d after reduction) with %s in %.2f s: cost %.6g s, "
        "peak %.6g B, optimal=%s, gap %.3g",
        len(problem.nodes), len(problem.edges), len(live), sum(1 for _ in red.edges()), solver,
        sol.seconds, sol.cost_s, sol.peak_memory_bytes, optimal, sol.gap,
    )
    return sol
