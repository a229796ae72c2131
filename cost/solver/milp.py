"""The MILP of the package docstring, written once for both kinds of backend, and solved under a deadline.

:func:`_build` adds each constraint family to an :class:`~graphpass.cost.solver.ilp.Model`;
:func:`_builder` gives HiGHS the model in bytes scaled by :func:`_memory_unit` and CP-SAT the
one on integer coefficients from :func:`_scaled_for_cpsat`. :func:`_run` solves it through the
ILP front end (:func:`graphpass.cost.solver.ilp.solve`: the thread, the deadline, the silenced
stdout) and reads the chosen strategies back.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from graphpass.cost.solver import ilp
from graphpass.cost.solver.ilp import Model
from graphpass.cost.solver.reductions import _Reduced

# CP-SAT's integer scales (the package docstring, "Backends").
_CPSAT_COST_RESOLUTION = 1e9
_CPSAT_MEMORY_RESOLUTION = 1e12
# Memory rows are written out one by one while their total number of terms stays below this;
# beyond it (nested live intervals of a long graph) as a running sum, linear in the node count.
_DIRECT_ROW_TERMS = 200_000


def _add_one_strategy_per_node(b: Model, red: _Reduced) -> dict[int, list]:
    x = {}
    for n in red.live_nodes():
        xs = [b.bool_var(f"x[{red.names[n]},{s}]") for s in red.keep[n]]
        b.add_linear(xs, [1] * len(xs), 1, 1)
        x[n] = xs
    return x


def _edge_var(b: Model, name: str):
    # Integral anyway (see the package docstring): continuous, HiGHS branches on x alone;
    # CP-SAT has integers only, and booleans propagate better.
    return b.bool_var(name) if b.integral else b.num_var(0.0, math.inf, name)


def _usage_var(b: Model, name: str, ub: float):
    if b.integral:
        return b.int_var(0, int(ub), name)
    # No lower bound (the pieces are >= 0 anyway): HiGHS 1.12's presolve calls some models
    # infeasible when a running usage is fixed at [0, 0] (a full row), found on a 2-node one.
    return b.num_var(-math.inf, ub, name)


def _add_edge_marginals(b: Model, red: _Reduced, x: dict[int, list]) -> dict:
    """y per allowed pair of each edge (a forbidden pair has none: it is never chosen)."""
    y = {}
    for u, v, mat in red.edges():
        allowed = np.isfinite(mat)
        ys = [[_edge_var(b, f"y[{u},{v},{s},{t}]") if allowed[s, t] else None for t in range(mat.shape[1])]
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


def _add_memory_limit(b: Model, red: _Reduced, x: dict[int, list], unit: float) -> None:
    # Written relative to each node's smallest share: sum over pieces extra[s] x[n,s] <= rhs per
    # row, in units of ``unit`` bytes.
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
        usage = _usage_var(b, f"u[{j}]", min(top, max(0.0, float(red.rhs[j]) / unit)))
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


def _set_objective(b: Model, red: _Reduced, x: dict[int, list], y: dict) -> None:
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


def _build(b: Model, red: _Reduced, memory_unit: float = 1.0):
    x = _add_one_strategy_per_node(b, red)
    y = _add_edge_marginals(b, red, x)
    _add_memory_limit(b, red, x, memory_unit)
    _set_objective(b, red, x, y)
    return x, y


def _memory_unit(red: _Reduced) -> float:
    """Bytes per unit of the memory rows for a floating-point backend: the largest piece at 1e6.
    HiGHS drops coefficients <= 1e-9, which scaling each row to its largest coefficient made of a
    running sum's +-1 usage terms next to 1e10-byte pieces (then it "proved" feasible problems
    infeasible)."""
    return max([float(e.max()) for ps in red.pieces for _, _, e in ps] + [1e-300]) / 1e6


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


def _builder(red: _Reduced, warm: dict[int, int]) -> Callable[[Model], tuple[dict, dict]]:
    """The ILP front end's ``build`` for ``red``'s MILP on any backend: returns (x, y)."""

    def build(b: Model) -> tuple[dict, dict]:
        if b.integral:
            x, y = _build(b, _scaled_for_cpsat(red))
        else:
            x, y = _build(b, red, _memory_unit(red))
        if warm:
            for n, xs in x.items():
                for s, var in enumerate(xs):
                    b.hint(var, s == warm[n])
        return x, y

    return build


def _run(red: _Reduced, warm: dict[int, int], deadline: float, backend: str = ilp.HIGHS, *, warn: bool = True):
    """Solve ``red``'s MILP until ``deadline``: (choice or None, proven optimal, the optimum or a
    lower bound); ``(None, True, inf)`` when it is proven infeasible. ``warm`` (may be empty)
    hints the backends that take hints; ``warn``: log an overrun as a warning."""
    result, handles = ilp.solve(_builder(red, warm), backend, deadline, warn=warn)
    if result.status == ilp.INFEASIBLE:
        return None, True, math.inf  # proven: nothing fits
    if not result.found:
        return None, False, -math.inf
    x, _ = handles
    choice = {n: int(np.argmax([result.value(v) for v in xs])) for n, xs in x.items()}
    optimal = result.status == ilp.OPTIMAL
    if backend == ilp.CP_SAT:  # its bound is on the scaled integer objective: only "optimal" carries over exactly
        return choice, optimal, -math.inf
    return choice, optimal, (result.objective if optimal else result.bound)


def _model_size(red: _Reduced, nodes: Sequence[int] | None = None) -> int:
    """Variables of the MILP over ``nodes`` (all live ones by default): x per strategy, y per pair."""
    inside = set(red.live_nodes() if nodes is None else nodes)
    size = sum(len(red.cost[n]) for n in inside)
    return size + sum(int(np.isfinite(m).sum()) for u, v, m in red.edges() if u in inside and v in inside)
