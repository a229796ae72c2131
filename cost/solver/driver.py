"""The driver: :func:`solve` runs the phases in order under one deadline, :func:`heuristic` the
greedy pass alone.

:func:`solve` validates and reduces the problem, takes two starting answers (the greedy pass and
message passing's), then either solves the whole MILP with windows improving the start beside it
(:func:`_whole_and_windows`), or, past ``_FULL_MODEL_SIZE`` variables, runs the Lagrangian, the
price search, pair moves and kicks, then windows (:func:`_priced_and_windows`). It returns the
cheapest answer that fits, checked against the original problem (:func:`_solution`), with its gap
to the best lower bound known. Each phase's share of the time is set here.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Sequence

import numpy as np

from graphpass.cost.solver.ilp import _DEADLINE_GRACE_S
from graphpass.cost.solver.lagrangian import _lagrangian, _MemoryPriced, _price_search
from graphpass.cost.solver.local_search import _greedy_local_search, _pair_descent, _PairMoves
from graphpass.cost.solver.message_passing import _dual_decode, _Messages
from graphpass.cost.solver.milp import _model_size, _run
from graphpass.cost.solver.problem import (
    _REL_TOL,
    ForbiddenError,
    InfeasibleError,
    Problem,
    Solution,
    _validate,
    evaluate,
    min_peak_memory,
)
from graphpass.cost.solver.reductions import _fits, _reduce, _Reduced
from graphpass.cost.solver.windows import _LNS_THREADS, _large_neighbourhoods

log = logging.getLogger(__name__)

# What solve() keeps of time_limit_s for finishing: the smaller of the two.
_FINISH_S, _FINISH_SHARE = 2.5, 0.05
# Whole-problem MILPs above this many variables are not attempted: HiGHS found no incumbent in 60 s
# for 10,000 nodes x 6 strategies (~500k variables) and proves ~50k-variable ones in seconds. They
# are improved window by window instead (`windows._large_neighbourhoods`).
_FULL_MODEL_SIZE = 150_000
# Share of the time limit the reductions may use (they stop there, leaving a bigger problem).
_REDUCE_SHARE = 0.25
# Share of the time left for the message-passing bound on graphs the Lagrangian cannot bound.
_DUAL_SHARE = 0.1
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
#: Share of the time left that each descent by pair moves (`_pair_descent`) may take.
_PAIR_SHARE = 0.25
#: Share of the time left after the price search that the kicks take from the windows.
_KICK_SHARE = 0.8
#: Of the time left after it, the share the price search (`_price_search`) takes from the windows.
_PRICE_SHARE = 0.5
# Where the whole MILP runs, the windows start beside it once this share of the time left has
# passed without it finishing (the 816-node IOPDDL instances are proven in 3-5 s of 60).
_WINDOWS_AFTER = 0.15


def heuristic(problem: Problem) -> Solution:
    """Greedy + local search; always memory-feasible when any assignment is, never proven optimal."""
    start = time.perf_counter()
    red = _reduce(problem)
    choice = _greedy_local_search(red)
    return _solution(problem, red, choice, bound=-math.inf, start=start, solver="heuristic")


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
            result["out"] = _run(red, warm, deadline - 2 * _DEADLINE_GRACE_S)
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
    if solver == "highs":
        choice, optimal, bound, warm = _whole_and_windows(red, warm, deadline, share(_WINDOWS_AFTER))
    else:
        choice, optimal, bound = _run(red, warm, deadline, solver)
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
