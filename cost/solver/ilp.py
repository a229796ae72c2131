"""The one front end of the planner's integer programs: a model written once against
:class:`Model`, solved by HiGHS, SCIP (both through ``pywraplp``) or CP-SAT under a deadline.

A caller writes its model in a ``build(model)`` callback (boolean, integer and continuous
variables, linear rows, a linear objective to minimise, hints) and returns the variables it
wants back; :func:`solve` does the rest: it creates the backend's model with its parameters
(no output; CP-SAT's workers), builds and solves in a thread so that the deadline holds even
where a backend overruns its own time limit (:func:`_in_thread`; HiGHS's presolve does),
interrupts a solve past it, silences stdout while HiGHS runs (:class:`_QuietStdout`), and
returns a :class:`Result` that reads the answer back. Its users: the op-level MILP
(``milp._run``) and the clustered stage ILP (:func:`graphpass.cost.search.stages.solve_stage`).
OR-Tools is imported inside the backends: importing the solver does not load it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

log = logging.getLogger(__name__)

#: Backends, as ``pywraplp.Solver.CreateSolver`` (case-insensitive) and ``solve(solver=...)`` name them.
HIGHS, SCIP, CP_SAT = "highs", "scip", "cp-sat"
_NAMES = {HIGHS: "HiGHS", SCIP: "SCIP", CP_SAT: "CP-SAT"}

#: Outcomes of :func:`solve`. ``UNKNOWN``: no answer and no proof (time ran out, or it overran).
OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN = "optimal", "feasible", "infeasible", "unknown"

# Extra wall-clock allowed past a deadline for model building and for a backend to notice it.
_DEADLINE_GRACE_S = 1.0

T = TypeVar("T")


class Model(ABC):
    """What a ``build`` callback writes its model with; :func:`solve` creates it.

    ``integral``: the backend takes integer variables and coefficients only (CP-SAT); a
    builder that serves both kinds asks it where its formulation differs.
    """

    integral = False

    @abstractmethod
    def bool_var(self, name: str) -> object: ...

    @abstractmethod
    def int_var(self, lb: int, ub: int, name: str) -> object: ...

    @abstractmethod
    def num_var(self, lb: float, ub: float, name: str) -> object:
        """A continuous variable in [lb, ub]; either bound may be infinite."""

    @abstractmethod
    def add_linear(self, vars_: Sequence, coefs: Sequence[float], lb: float, ub: float) -> None:
        """The row ``lb <= sum coefs * vars_ <= ub`` (``lb`` may be ``-inf``); a variable may repeat."""

    @abstractmethod
    def minimize(self, vars_: Sequence, coefs: Sequence[float]) -> None: ...

    @abstractmethod
    def hint(self, var: object, value: int) -> None:
        """A warm-start value; backends that cannot take one drop it."""

    # What solve() runs, in its thread, and reads back after.
    prints = False  # writes to stdout while solving whatever its options say

    @abstractmethod
    def _set_time_limit(self, seconds: float) -> None: ...

    @abstractmethod
    def _solve(self) -> str: ...

    @abstractmethod
    def _interrupt(self) -> None: ...

    @abstractmethod
    def _value(self, var: object) -> float: ...

    @abstractmethod
    def _objective_and_bound(self) -> tuple[float, float]: ...


class _LinearSolverModel(Model):
    """``pywraplp``: HiGHS or SCIP."""

    def __init__(self, backend: str) -> None:
        from ortools.linear_solver import pywraplp

        self._pywraplp = pywraplp
        self._solver = pywraplp.Solver.CreateSolver(backend)
        if self._solver is None:
            raise RuntimeError(f"OR-Tools has no {_NAMES[backend]} backend in this build")
        self._solver.SuppressOutput()
        if backend == HIGHS:
            self._solver.SetSolverSpecificParametersAsString("output_flag=false\n")  # else HiGHS prints a banner
            self.prints = True  # see _QuietStdout
        self._inf = self._solver.infinity()

    def _bounds(self, lb: float, ub: float) -> tuple[float, float]:
        return max(lb, -self._inf), min(ub, self._inf)

    def bool_var(self, name):
        return self._solver.BoolVar(name)

    def int_var(self, lb, ub, name):
        return self._solver.IntVar(*self._bounds(lb, ub), name)

    def num_var(self, lb, ub, name):
        return self._solver.NumVar(*self._bounds(lb, ub), name)

    def add_linear(self, vars_, coefs, lb, ub):
        summed: dict = {}  # a variable may come twice (a running sum): SetCoefficient overwrites
        for var, c in zip(vars_, coefs):
            summed[var] = summed.get(var, 0.0) + float(c)
        con = self._solver.Constraint(*self._bounds(lb, ub))
        for var, c in summed.items():
            con.SetCoefficient(var, c)

    def minimize(self, vars_, coefs):
        obj = self._solver.Objective()
        for var, c in zip(vars_, coefs):
            if c:
                obj.SetCoefficient(var, float(c))
        obj.SetMinimization()

    def hint(self, var, value):
        # Dropped: SetHint with the HiGHS backend of OR-Tools 9.15 segfaults inside Solve
        # (checked on a two-node model).
        pass

    def _set_time_limit(self, seconds):
        self._solver.SetTimeLimit(max(1, int(1000 * seconds)))  # milliseconds

    def _solve(self):
        status = self._solver.Solve()
        s = self._pywraplp.Solver
        return {s.OPTIMAL: OPTIMAL, s.FEASIBLE: FEASIBLE, s.INFEASIBLE: INFEASIBLE}.get(status, UNKNOWN)

    def _interrupt(self):
        self._solver.InterruptSolve()

    def _value(self, var):
        return var.solution_value()

    def _objective_and_bound(self):
        obj = self._solver.Objective()
        return obj.Value(), obj.BestBound()


class _CpSatModel(Model):
    """CP-SAT: integer variables and coefficients (a float coefficient is truncated)."""

    integral = True

    def __init__(self) -> None:
        from ortools.sat.python import cp_model

        self._cp_model = cp_model
        self._model = cp_model.CpModel()
        self._solver = cp_model.CpSolver()
        # DESIGN.md: CP-SAT needs ~8 workers on 200-layer problems.
        self._solver.parameters.num_workers = max(1, min(8, os.cpu_count() or 1))

    def _sum(self, vars_, coefs):
        return self._cp_model.LinearExpr.WeightedSum(list(vars_), [int(c) for c in coefs])

    def bool_var(self, name):
        return self._model.NewBoolVar(name)

    def int_var(self, lb, ub, name):
        return self._model.NewIntVar(int(lb), int(ub), name)

    def num_var(self, lb, ub, name):
        raise TypeError("CP-SAT has no continuous variables: use int_var (Model.integral is True)")

    def add_linear(self, vars_, coefs, lb, ub):
        lo = self._cp_model.INT_MIN if lb == -math.inf else int(lb)
        hi = self._cp_model.INT_MAX if ub == math.inf else int(ub)
        self._model.AddLinearConstraint(self._sum(vars_, coefs), lo, hi)

    def minimize(self, vars_, coefs):
        self._model.Minimize(self._sum(vars_, coefs))

    def hint(self, var, value):
        self._model.AddHint(var, value)

    def _set_time_limit(self, seconds):
        self._solver.parameters.max_time_in_seconds = max(0.01, seconds)

    def _solve(self):
        status = self._solver.Solve(self._model)
        cp = self._cp_model
        return {cp.OPTIMAL: OPTIMAL, cp.FEASIBLE: FEASIBLE, cp.INFEASIBLE: INFEASIBLE}.get(status, UNKNOWN)

    def _interrupt(self):
        self._solver.StopSearch()

    def _value(self, var):
        return self._solver.Value(var)

    def _objective_and_bound(self):
        return self._solver.ObjectiveValue(), self._solver.BestObjectiveBound()


def _new_model(backend: str) -> Model:
    if backend == CP_SAT:
        return _CpSatModel()
    if backend in (HIGHS, SCIP):
        return _LinearSolverModel(backend)
    raise ValueError(f"backend={backend!r}: use {HIGHS!r}, {SCIP!r} or {CP_SAT!r}")


@dataclass
class Result:
    """What :func:`solve` found. ``objective`` and ``bound`` (the backend's best bound on the
    optimum) are in the model's units; both are nan without an answer."""

    status: str
    objective: float = math.nan
    bound: float = math.nan
    _model: Model | None = field(default=None, repr=False)

    @property
    def found(self) -> bool:
        return self.status in (OPTIMAL, FEASIBLE)

    def value(self, var: object) -> float:
        """``var``'s value in the answer (only when :attr:`found`)."""
        assert self.found and self._model is not None, "no answer to read"
        return self._model._value(var)


def solve(build: Callable[[Model], T], backend: str, deadline: float, *, warn: bool = True) -> tuple[Result, T | None]:
    """Build the model with ``build`` and solve it with ``backend`` until ``deadline``.

    Args:
        build: writes the model; what it returns comes back (the variables to read).
        backend: :data:`HIGHS`, :data:`SCIP` or :data:`CP_SAT`.
        deadline: a ``time.perf_counter()`` moment (may be ``inf``); the backend's time limit is
            what is left of it once the model is built, and a solve still running a grace past
            it is interrupted and abandoned (status :data:`UNKNOWN`).
        warn: log an overrun as a warning (else at debug level: a cut-short window is expected).

    Returns:
        The :class:`Result` and ``build``'s return value (None when the solve was abandoned).
    """
    model = _new_model(backend)
    quiet = _QuietStdout() if model.prints else None
    # Abandoning and starting the solve exclude each other: a thread abandoned while it was still
    # building its model must not silence stdout (and solve to its own limit) afterwards, or the
    # caller's next lines are lost (seen: an IOPDDL row printed after the windows went missing).
    lock = threading.Lock()
    state = {"abandoned": False, "started": False}

    def work(result: dict) -> None:
        handles = build(model)
        if math.isfinite(deadline):
            model._set_time_limit(deadline - time.perf_counter())
        with lock:
            if state["abandoned"]:
                return
            state["started"] = True
            if quiet:
                quiet.begin()
        try:
            result["status"] = model._solve()
        finally:
            if quiet:
                quiet.end()
        result["handles"] = handles

    def abandon() -> None:
        with lock:
            state["abandoned"] = True
            if state["started"]:
                model._interrupt()
            if quiet:
                quiet.end()

    result = _in_thread(work, deadline, abandon)
    if result is None:
        # A window cut short by the overall deadline is expected; a whole problem's is news.
        log.log(logging.WARNING if warn else logging.DEBUG, "%s overran its deadline; interrupted", _NAMES[backend])
        return Result(UNKNOWN), None
    status = result["status"]
    if status not in (OPTIMAL, FEASIBLE):
        return Result(status), result["handles"]
    return Result(status, *model._objective_and_bound(), model), result["handles"]


def _in_thread(work: Callable[[dict], None], deadline: float, on_overrun: Callable[[], None]) -> dict | None:
    """Run ``work(result)`` in a thread until ``deadline`` (+ grace); None when it overran.

    Model building for tens of thousands of nodes can itself take seconds, so it runs in the
    thread too; pywraplp and CP-SAT release the GIL while solving.
    """
    result: dict = {}

    def run() -> None:
        try:
            work(result)
        except BaseException as exc:  # raised again in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(max(0.0, deadline + _DEADLINE_GRACE_S - time.perf_counter()) if math.isfinite(deadline) else None)
    if thread.is_alive():
        on_overrun()
        thread.join(_DEADLINE_GRACE_S)
        return None
    if "error" in result:
        raise result["error"]
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
