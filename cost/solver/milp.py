"""The MILP of the package docstring, written once for two back-ends, and solved under a deadline.

:func:`_build` adds each constraint family through a :class:`_Backend`'s constructors;
:func:`_pywraplp_model` (HiGHS) and :func:`_cpsat_model` (CP-SAT, on integer coefficients from
:func:`_scaled_for_cpsat`) supply them. :func:`_run_highs` and :func:`_run_cpsat` build and solve
in a thread, the deadline enforced here (:func:`_in_thread`), stdout silenced while HiGHS runs
(:class:`_QuietStdout`). OR-Tools is imported inside the functions that use it: importing the
solver does not load it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from graphpass.cost.solver.reductions import _Reduced

log = logging.getLogger(__name__)

# CP-SAT's integer scales (the package docstring, "Backends").
_CPSAT_COST_RESOLUTION = 1e9
_CPSAT_MEMORY_RESOLUTION = 1e12
# Extra wall-clock allowed past a phase's deadline for model building and for HiGHS to notice it.
_DEADLINE_GRACE_S = 1.0
# Memory rows are written out one by one while their total number of terms stays below this;
# beyond it (nested live intervals of a long graph) as a running sum, linear in the node count.
_DIRECT_ROW_TERMS = 200_000


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
        edge_var=model.NewBoolVar,  # integral anyway (see the package docstring); booleans propagate better
        usage_var=lambda n, ub: model.NewIntVar(0, int(ub), n),
        add_linear=add_linear,
        minimize=minimize,
    )
    x, y = _build(backend, _scaled_for_cpsat(red))
    return model, x, y


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
