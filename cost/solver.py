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
L_{k'}`. Identical rows are emitted once; rows that cannot bind (sum of per-node maxima <= M) are
skipped; each row is written relative to the per-node minimum memory.

Infeasibility: the memory rows are the only constraints that can fail, and each :math:`x_n` enters
them only through :math:`m_{n,s} \ge` its own minimum. Minimising the peak
:math:`P \ge \sum_{L_k} m\,x\ \forall k` is therefore separable: the answer is
:math:`P^* = \max_k \sum_{n \in L_k} \min_s m_{n,s}` (every node at its smallest strategy), so it is
computed in closed form (:func:`min_peak_memory`) instead of by a second MILP. ``M < P^*`` raises
:class:`InfeasibleError` naming ``memory_limit_bytes`` and :math:`P^*`.

Reductions (:func:`_reduce`), each keeping the optimum value:

1. Parallel edges u->v (and v->u, transposed) are merged by summing matrices; a self-edge adds its
   diagonal to the node cost.
2. Strategy s of node n is dropped when another strategy t has :math:`c_t \le c_s`,
   :math:`m_t \le m_s` and, on every incident edge, a resharding row (column for incoming edges)
   elementwise <= that of s, ties broken by index. Swapping s for t in any assignment then never
   raises cost or the memory of any step. Repeated to a fixpoint since dropping strategies of a
   neighbour shrinks the rows that are compared.
3. An edge whose endpoint has one strategy left is folded into the other endpoint's costs.

Backends: ``"highs"`` (default) is HiGHS through ``pywraplp`` (checked to exist in OR-Tools 9.15);
``"cp-sat"`` builds the same model with integer coefficients: the objective is scaled so that its
largest coefficient becomes ``_CPSAT_COST_RESOLUTION`` (1e9) and rounded, which makes the CP-SAT
optimum optimal up to half a unit per term; memory is kept exact when all values are integral
(bytes usually are), otherwise scaled to 1e12 with coefficients rounded up and the limit rounded
down (conservative). A greedy + local-search :func:`heuristic` gives CP-SAT's warm start
(``AddHint``; HiGHS gets none: ``SetHint`` segfaults in Solve with HiGHS in OR-Tools 9.15) and
the fallback when a solver has no incumbent at the deadline. HiGHS can overrun its own time limit
(presolve), so the solve runs in a thread (pywraplp releases the GIL) and the planner's deadline
is enforced here: past it the solve is interrupted and the heuristic assignment returned with
``optimal=False`` and ``gap=inf``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

__all__ = [
    "Node",
    "Edge",
    "Problem",
    "Solution",
    "InfeasibleError",
    "solve",
    "heuristic",
    "evaluate",
    "min_peak_memory",
]

_CPSAT_COST_RESOLUTION = 1e9
_CPSAT_MEMORY_RESOLUTION = 1e12
# Extra wall-clock allowed past time_limit_s for model building and for HiGHS to notice its limit.
_DEADLINE_GRACE_S = 1.0
_REL_TOL = 1e-9


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
    nodes: Sequence[Node]
    edges: Sequence[Edge]
    memory_limit_bytes: float | None = None
    num_steps: int | None = None


@dataclass(frozen=True)
class Solution:
    choice: dict[str, int]
    cost_s: float
    peak_memory_bytes: float
    optimal: bool
    gap: float
    seconds: float
    solver: str


class InfeasibleError(ValueError):
    """No assignment meets ``memory_limit_bytes``; ``min_memory_bytes`` is the smallest peak."""

    def __init__(self, memory_limit_bytes: float, min_memory_bytes: float, step: int | None):
        self.memory_limit_bytes = memory_limit_bytes
        self.min_memory_bytes = min_memory_bytes
        where = f" (at step {step})" if step is not None else ""
        super().__init__(
            f"no strategy assignment fits memory_limit_bytes={memory_limit_bytes:.6g}: the smallest "
            f"peak memory any assignment reaches is {min_memory_bytes:.6g} bytes{where}; raise "
            f"memory_limit_bytes to at least that, or add lower-memory strategies"
        )


# --------------------------------------------------------------------------------------------
# Validation, evaluation, memory steps


def _validate(problem: Problem) -> dict[str, int]:
    index: dict[str, int] = {}
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
        if not all(math.isfinite(v) for v in (*node.costs_s, *node.memory_bytes)):
            raise ValueError(f"Node {node.name!r}: costs_s and memory_bytes must be finite")
        first, last = node.live
        if not 0 <= first <= last:
            raise ValueError(f"Node {node.name!r}: live={node.live} must satisfy 0 <= first <= last")
        if problem.num_steps is not None and last >= problem.num_steps:
            raise ValueError(
                f"Node {node.name!r}: live={node.live} ends past num_steps={problem.num_steps}"
            )
    for edge in problem.edges:
        for end in (edge.src, edge.dst):
            if end not in index:
                raise ValueError(f"Edge {edge.src!r}->{edge.dst!r}: unknown node {end!r}")
        rows, cols = len(problem.nodes[index[edge.src]].costs_s), len(
            problem.nodes[index[edge.dst]].costs_s
        )
        matrix = edge.cost_s
        if len(matrix) != rows or any(len(r) != cols for r in matrix):
            raise ValueError(
                f"Edge {edge.src!r}->{edge.dst!r}: cost_s must be {rows}x{cols} "
                f"([strategy of src][strategy of dst])"
            )
        if not all(math.isfinite(v) for r in matrix for v in r):
            raise ValueError(f"Edge {edge.src!r}->{edge.dst!r}: cost_s must be finite")
    return index


def _memory_steps(problem: Problem) -> list[tuple[int, list[int]]]:
    """(step, node indices live there) for each distinct live set at an interval start."""
    starts = sorted({node.live[0] for node in problem.nodes})
    seen: set[tuple[int, ...]] = set()
    steps = []
    for k in starts:
        live = tuple(i for i, n in enumerate(problem.nodes) if n.live[0] <= k <= n.live[1])
        if live not in seen:
            seen.add(live)
            steps.append((k, list(live)))
    return steps


def evaluate(problem: Problem, choice: dict[str, int]) -> tuple[float, float]:
    """(cost_s, peak_memory_bytes) of an assignment of strategy indices to node names."""
    by_name = {n.name: n for n in problem.nodes}
    cost = sum(float(by_name[name].costs_s[s]) for name, s in choice.items())
    cost += sum(float(e.cost_s[choice[e.src]][choice[e.dst]]) for e in problem.edges)
    peak = 0.0
    for _, live in _memory_steps(problem):
        nodes = [problem.nodes[i] for i in live]
        peak = max(peak, sum(float(n.memory_bytes[choice[n.name]]) for n in nodes))
    return cost, peak


def min_peak_memory(problem: Problem) -> tuple[float, int | None]:
    """Smallest peak memory any assignment reaches, and the step where it occurs (closed form)."""
    best, where = 0.0, None
    for k, live in _memory_steps(problem):
        total = sum(min(problem.nodes[i].memory_bytes) for i in live)
        if where is None or total > best:
            best, where = float(total), k
    return best, where


# --------------------------------------------------------------------------------------------
# Reductions


@dataclass
class _Reduced:
    names: list[str]
    keep: list[list[int]]  # original strategy index for each reduced strategy
    cost: list[np.ndarray]
    mem: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]  # (u, v) with u < v -> [s of u, t of v]
    memory_rows: list[tuple[list[int], float]] = field(default_factory=list)  # (nodes, rhs)


def _merge_edges(problem: Problem, index: dict[str, int], cost: list[np.ndarray]):
    edges: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        u, v = index[e.src], index[e.dst]
        m = np.asarray(e.cost_s, dtype=float)
        if u == v:
            cost[u] = cost[u] + np.diag(m)
            continue
        if u > v:
            u, v, m = v, u, m.T
        edges[(u, v)] = edges[(u, v)] + m if (u, v) in edges else m.copy()
    return edges


def _incident(edges: dict[tuple[int, int], np.ndarray], n: int) -> list[np.ndarray]:
    """Matrices with node n's strategies as rows."""
    out = []
    for (u, v), m in edges.items():
        if u == n:
            out.append(m)
        elif v == n:
            out.append(m.T)
    return out


def _drop_dominated(red: _Reduced, n: int) -> bool:
    c, m = red.cost[n], red.mem[n]
    rows = _incident(red.edges, n)
    k = len(c)
    dropped = []
    for s in range(k):
        for t in range(k):
            if t == s or t in dropped:
                continue
            no_worse = c[t] <= c[s] and m[t] <= m[s] and all(np.all(r[t] <= r[s]) for r in rows)
            if not no_worse:
                continue
            equal = c[t] == c[s] and m[t] == m[s] and all(np.array_equal(r[t], r[s]) for r in rows)
            if not equal or t < s:
                dropped.append(s)
                break
    if not dropped:
        return False
    keep = [s for s in range(k) if s not in dropped]
    red.keep[n] = [red.keep[n][s] for s in keep]
    red.cost[n], red.mem[n] = c[keep], m[keep]
    for (u, v), mat in list(red.edges.items()):
        if u == n:
            red.edges[(u, v)] = mat[keep, :]
        elif v == n:
            red.edges[(u, v)] = mat[:, keep]
    return True


def _fold_fixed_edges(red: _Reduced) -> None:
    for (u, v), mat in list(red.edges.items()):
        if len(red.cost[u]) == 1:
            red.cost[v] = red.cost[v] + mat[0, :]
        elif len(red.cost[v]) == 1:
            red.cost[u] = red.cost[u] + mat[:, 0]
        else:
            continue
        del red.edges[(u, v)]


def _reduce(problem: Problem, index: dict[str, int]) -> _Reduced:
    cost = [np.asarray(n.costs_s, dtype=float) for n in problem.nodes]
    mem = [np.asarray(n.memory_bytes, dtype=float) for n in problem.nodes]
    edges = _merge_edges(problem, index, cost)
    red = _Reduced(
        names=[n.name for n in problem.nodes],
        keep=[list(range(len(c))) for c in cost],
        cost=cost,
        mem=mem,
        edges=edges,
    )
    changed = True
    while changed:
        changed = False
        for n in range(len(red.names)):
            changed |= _drop_dominated(red, n)
        before = len(red.edges)
        _fold_fixed_edges(red)
        changed |= len(red.edges) != before
    if problem.memory_limit_bytes is not None:
        limit = float(problem.memory_limit_bytes)
        seen = set()
        for _, live in _memory_steps(problem):
            base = sum(float(red.mem[i].min()) for i in live)
            varying = tuple(i for i in live if red.mem[i].max() > red.mem[i].min())
            slack = sum(float(red.mem[i].max() - red.mem[i].min()) for i in varying)
            if not varying or base + slack <= limit or (varying, base) in seen:
                continue
            seen.add((varying, base))
            red.memory_rows.append((list(varying), limit - base))
    return red


# --------------------------------------------------------------------------------------------
# Model building (generic over the backend's variable and constraint constructors)


@dataclass
class _Backend:
    bool_var: Callable[[str], object]
    edge_var: Callable[[str], object]
    add_linear: Callable[[list, list, float, float], None]  # vars, coefs, lb, ub
    minimize: Callable[[list, list], None]


def _add_one_strategy_per_node(b: _Backend, red: _Reduced) -> list[list]:
    x = []
    for n, name in enumerate(red.names):
        xs = [b.bool_var(f"x[{name},{s}]") for s in red.keep[n]]
        b.add_linear(xs, [1] * len(xs), 1, 1)
        x.append(xs)
    return x


def _add_edge_marginals(b: _Backend, red: _Reduced, x: list[list]) -> dict:
    y = {}
    for (u, v), mat in red.edges.items():
        ys = [[b.edge_var(f"y[{u},{v},{s},{t}]") for t in range(mat.shape[1])] for s in range(mat.shape[0])]
        for s in range(mat.shape[0]):  # sum_t y[s,t] = x[u,s]
            b.add_linear([*ys[s], x[u][s]], [1] * mat.shape[1] + [-1], 0, 0)
        for t in range(mat.shape[1]):  # sum_s y[s,t] = x[v,t]
            b.add_linear([ys[s][t] for s in range(mat.shape[0])] + [x[v][t]], [1] * mat.shape[0] + [-1], 0, 0)
        y[(u, v)] = ys
    return y


def _add_memory_limit(b: _Backend, red: _Reduced, x: list[list]) -> None:
    # Written relative to each node's minimum, so the row is sum (m[n,s] - min m[n]) x <= rhs.
    for live, rhs in red.memory_rows:
        vars_, coefs = [], []
        for n in live:
            extra = red.mem[n] - red.mem[n].min()
            for s, var in enumerate(x[n]):
                if extra[s] > 0:
                    vars_.append(var)
                    coefs.append(extra[s])
        b.add_linear(vars_, coefs, -math.inf, rhs)


def _set_objective(b: _Backend, red: _Reduced, x: list[list], y: dict) -> None:
    vars_, coefs = [], []
    for n, xs in enumerate(x):
        vars_ += xs
        coefs += list(red.cost[n])
    for key, ys in y.items():
        mat = red.edges[key]
        for s, row in enumerate(ys):
            vars_ += row
            coefs += list(mat[s])
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
        # Rows are scaled to unit max coefficient: memory rows are in bytes (~1e9) otherwise.
        scale = max((abs(c) for c in coefs), default=1.0) or 1.0
        con = solver.Constraint(-inf if lb == -math.inf else lb / scale, ub / scale)
        for var, c in zip(vars_, coefs):
            con.SetCoefficient(var, float(c) / scale)

    def minimize(vars_, coefs):
        obj = solver.Objective()
        for var, c in zip(vars_, coefs):
            if c:
                obj.SetCoefficient(var, float(c))
        obj.SetMinimization()

    backend = _Backend(
        bool_var=lambda n: solver.BoolVar(n),
        edge_var=lambda n: solver.NumVar(0.0, inf, n),
        add_linear=add_linear,
        minimize=minimize,
    )
    x, y = _build(backend, red)
    return solver, x, y


def _scaled_for_cpsat(red: _Reduced) -> _Reduced:
    coefs = [abs(v) for c in red.cost for v in c] + [abs(v) for m in red.edges.values() for v in m.flat]
    cmax = max(coefs, default=0.0)
    cscale = _CPSAT_COST_RESOLUTION / cmax if cmax > 0 else 1.0
    mems = [abs(v) for m in red.mem for v in m]
    integral = all(float(v).is_integer() and v < 2**53 for v in mems)
    mmax = max(mems + [abs(r) for _, r in red.memory_rows], default=0.0)
    mscale = 1.0 if integral or mmax == 0 else _CPSAT_MEMORY_RESOLUTION / mmax
    return _Reduced(
        names=red.names,
        keep=red.keep,
        cost=[np.rint(c * cscale).astype(np.int64) for c in red.cost],
        # Deltas above each node's minimum are rounded up and the limit down: never over the limit.
        mem=[np.ceil((m - m.min()) * mscale).astype(np.int64) for m in red.mem],
        edges={k: np.rint(m * cscale).astype(np.int64) for k, m in red.edges.items()},
        memory_rows=[(live, math.floor(rhs * mscale + 1e-6)) for live, rhs in red.memory_rows],
    )


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
        add_linear=add_linear,
        minimize=minimize,
    )
    x, y = _build(backend, _scaled_for_cpsat(red))
    return model, x, y


# --------------------------------------------------------------------------------------------
# Heuristic


def _greedy_local_search(red: _Reduced, limit: float | None, max_rounds: int = 20) -> list[int]:
    """Reduced strategy index per node: greedy in node order, then first-improvement 1-opt moves."""
    num = len(red.names)
    rows_of = [[] for _ in range(num)]
    for r, (live, _) in enumerate(red.memory_rows):
        for n in live:
            rows_of[n].append(r)
    # usage[r] is the memory above every node's minimum, so "all at minimum" is always feasible.
    usage = np.zeros(len(red.memory_rows))
    rhs = np.array([r for _, r in red.memory_rows], dtype=float)
    extra = [m - m.min() for m in red.mem]
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(num)]
    for (u, v), m in red.edges.items():
        nbrs[u].append((v, m))
        nbrs[v].append((u, m.T))
    choice = [-1] * num

    def local_cost(n: int, s: int) -> float:
        total = red.cost[n][s]
        for other, m in nbrs[n]:
            if choice[other] >= 0:
                total += m[s, choice[other]]
        return float(total)

    def fits(n: int, s: int, current: int | None) -> bool:
        if not rows_of[n]:
            return True
        delta = extra[n][s] - (extra[n][current] if current is not None else 0.0)
        idx = rows_of[n]
        return bool(np.all(usage[idx] + delta <= rhs[idx] + _REL_TOL * np.abs(rhs[idx]) + 1e-9))

    def place(n: int, s: int, current: int | None) -> None:
        delta = extra[n][s] - (extra[n][current] if current is not None else 0.0)
        if rows_of[n]:
            usage[rows_of[n]] += delta
        choice[n] = s

    for n in range(num):
        fallback = int(np.argmin(red.mem[n]))
        options = [s for s in range(len(red.cost[n])) if fits(n, s, None)] or [fallback]
        place(n, min(options, key=lambda s: local_cost(n, s)), None)
    for _ in range(max_rounds):
        improved = False
        for n in range(num):
            cur = choice[n]
            here = local_cost(n, cur)
            for s in range(len(red.cost[n])):
                if s != cur and local_cost(n, s) < here - 1e-12 and fits(n, s, cur):
                    place(n, s, cur)
                    cur, here, improved = s, local_cost(n, s), True
        if not improved:
            break
    return choice


def heuristic(problem: Problem) -> Solution:
    """Greedy + local search; always memory-feasible when any assignment is, never proven optimal."""
    start = time.perf_counter()
    index = _validate(problem)
    _check_feasible(problem)
    red = _reduce(problem, index)
    choice = _greedy_local_search(red, problem.memory_limit_bytes)
    return _solution(problem, red, choice, optimal=False, gap=math.inf, start=start, solver="heuristic")


# --------------------------------------------------------------------------------------------
# Solve


def _check_feasible(problem: Problem) -> None:
    if problem.memory_limit_bytes is None:
        return
    need, step = min_peak_memory(problem)
    limit = float(problem.memory_limit_bytes)
    if need > limit + _REL_TOL * abs(limit):
        raise InfeasibleError(limit, need, step)


def _solution(problem, red, choice, *, optimal, gap, start, solver) -> Solution:
    assignment = {red.names[n]: red.keep[n][s] for n, s in enumerate(choice)}
    cost, peak = evaluate(problem, assignment)
    return Solution(
        choice=assignment,
        cost_s=cost,
        peak_memory_bytes=peak,
        optimal=optimal,
        gap=gap,
        seconds=time.perf_counter() - start,
        solver=solver,
    )


def _gap(value: float, bound: float) -> float:
    return max(0.0, value - bound) / max(abs(value), 1e-12)


def _run_highs(red: _Reduced, warm: list[int], time_limit_s: float, deadline: float):
    from ortools.linear_solver import pywraplp

    # No SetHint: with the HiGHS backend of OR-Tools 9.15 it segfaults inside Solve (checked on a
    # two-node model), so the warm start only serves CP-SAT and the deadline fallback here.
    solver, x, _ = _pywraplp_model(red)
    solver.SetTimeLimit(max(1, int(1000 * max(0.0, deadline - time.perf_counter()))))
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.setdefault("status", solver.Solve()), daemon=True)
    thread.start()
    thread.join(max(0.0, deadline + _DEADLINE_GRACE_S - time.perf_counter()))
    if thread.is_alive():
        log.warning("HiGHS overran the %.1f s deadline; interrupting and using the heuristic", time_limit_s)
        solver.InterruptSolve()
        thread.join(_DEADLINE_GRACE_S)
        return None, False, math.inf
    status = result["status"]
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None, False, math.inf
    choice = [int(np.argmax([v.solution_value() for v in xs])) for xs in x]
    value = solver.Objective().Value()
    optimal = status == pywraplp.Solver.OPTIMAL
    gap = 0.0 if optimal else _gap(value, solver.Objective().BestBound())
    return choice, optimal, gap


def _run_cpsat(red: _Reduced, warm: list[int], time_limit_s: float, deadline: float):
    from ortools.sat.python import cp_model

    model, x, _ = _cpsat_model(red)
    for n, xs in enumerate(x):
        for s, var in enumerate(xs):
            model.AddHint(var, s == warm[n])
    cp = cp_model.CpSolver()
    cp.parameters.max_time_in_seconds = max(0.01, deadline - time.perf_counter())
    # DESIGN.md: CP-SAT needs ~8 workers on 200-layer problems.
    cp.parameters.num_workers = max(1, min(8, os.cpu_count() or 1))
    status = cp.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, False, math.inf
    choice = [int(np.argmax([cp.Value(v) for v in xs])) for xs in x]
    optimal = status == cp_model.OPTIMAL
    gap = 0.0 if optimal else _gap(cp.ObjectiveValue(), cp.BestObjectiveBound())
    return choice, optimal, gap


def solve(problem: Problem, *, time_limit_s: float = 60.0, solver: str = "highs") -> Solution:
    """Cheapest strategy per node under the memory limit.

    Args:
        problem: the nodes, edges and memory limit.
        time_limit_s: wall-clock budget for the whole call (enforced here, not only by the solver).
        solver: ``"highs"`` (pywraplp) or ``"cp-sat"``.

    Returns:
        The best assignment found; ``optimal`` says whether it is proven, ``gap`` the relative gap
        to the solver's bound (``inf`` when the heuristic was returned at the deadline).

    Raises:
        InfeasibleError: the memory limit is below the smallest reachable peak.
        ValueError: malformed problem or unknown solver.
    """
    start = time.perf_counter()
    if solver not in ("highs", "cp-sat"):
        raise ValueError(f"solver={solver!r}: use 'highs' or 'cp-sat'")
    index = _validate(problem)
    _check_feasible(problem)
    red = _reduce(problem, index)
    deadline = start + time_limit_s
    warm = _greedy_local_search(red, problem.memory_limit_bytes)
    if all(len(c) == 1 for c in red.cost):
        return _solution(problem, red, warm, optimal=True, gap=0.0, start=start, solver=solver)
    run = _run_highs if solver == "highs" else _run_cpsat
    choice, optimal, gap = run(red, warm, time_limit_s, deadline)
    if choice is None:
        log.warning("%s found no incumbent within %.1f s; returning the heuristic", solver, time_limit_s)
        return _solution(problem, red, warm, optimal=False, gap=math.inf, start=start, solver="heuristic")
    sol = _solution(problem, red, choice, optimal=optimal, gap=gap, start=start, solver=solver)
    log.info(
        "solved %d nodes / %d edges with %s in %.2f s: cost %.6g s, peak %.6g B, optimal=%s",
        len(problem.nodes), len(problem.edges), solver, sol.seconds, sol.cost_s, sol.peak_memory_bytes, optimal,
    )
    return sol
