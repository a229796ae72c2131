"""Solver scale: op-level strategy problems of 1,000 to 50,000 nodes under a memory limit.

What is measured: for each size, ``examples/op_problem.py``'s transformer-shaped problem (10 ops
per layer, 6 strategies per op, nested live intervals, the memory limit halfway between the
smallest reachable peak and the fastest plan's) solved by ``graphpass.cost.solver.solve`` with
``--time-limit`` seconds (default 60), against the reference a user would otherwise have:

* **greedy**: greedy + 1-opt local search (``solver.heuristic``), the usual fast answer;
* **milp**: one HiGHS MILP over the whole reduced problem, given the same time (``--milp-upto``
  nodes and below; above that it is the solver's own large-problem path that is measured, and the
  plain MILP is run once at the smallest such size to show it finds nothing in time).

Columns: ``vars`` is the MILP's variable count after reduction; ``path`` is how ``solve`` answered
(``highs``: the whole MILP; ``highs windows``: Lagrangian bound + exact windows); ``cost`` is the
objective (seconds of the synthetic model); ``vs greedy`` the ratio to greedy (below 1 is better);
``gap`` the proven distance to the lower bound; ``peak/limit`` must be <= 1.

    python bench/solver_scale.py
    python bench/solver_scale.py --sizes 1000 10000 --time-limit 30
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from op_problem import LAYER, transformer_op_problem  # noqa: E402  (examples/ is not a package)

from graphpass.cost import solver as S  # noqa: E402
from graphpass.cost.solver import driver, milp, reductions  # noqa: E402


def whole_milp(problem: S.Problem, time_limit_s: float) -> S.Solution:
    """``solve`` forced down its one-MILP path (the reduced problem in one HiGHS model, however big)."""
    saved = driver._FULL_MODEL_SIZE
    driver._FULL_MODEL_SIZE = float("inf")
    try:
        return S.solve(problem, time_limit_s=time_limit_s)
    finally:
        driver._FULL_MODEL_SIZE = saved


def _plain_milp(problem: S.Problem, time_limit_s: float) -> str:
    """What one whole-problem MILP reaches in the time, for comparison."""
    sol = whole_milp(problem, time_limit_s)
    return "no incumbent" if sol.solver == "heuristic" else f"cost {sol.cost_s:.6g}, gap {sol.gap:.2%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 10000, 20000, 50000])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--milp-upto", type=int, default=10000,
                        help="also run one plain whole-problem MILP at the first size >= this")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    print(f"{'nodes':>7} {'edges':>7} {'vars':>9} {'path':>14} {'seconds':>8} {'cost':>10} "
          f"{'greedy':>10} {'vs greedy':>9} {'gap':>7} {'peak/limit':>10}")
    plain_done = False
    for size in args.sizes:
        problem = transformer_op_problem(num_layers=max(1, size // len(LAYER)))
        red = reductions._reduce(problem)
        greedy = S.heuristic(problem)
        start = time.perf_counter()
        sol = S.solve(problem, time_limit_s=args.time_limit)
        seconds = time.perf_counter() - start
        print(f"{len(problem.nodes):>7} {len(problem.edges):>7} {milp._model_size(red):>9} {sol.solver:>14} "
              f"{seconds:>8.1f} {sol.cost_s:>10.6g} {greedy.cost_s:>10.6g} {sol.cost_s / greedy.cost_s:>9.3f} "
              f"{sol.gap:>7.2%} {sol.peak_memory_bytes / problem.memory_limit_bytes:>10.4f}", flush=True)
        if not plain_done and size >= args.milp_upto:
            plain_done = True
            print(f"        plain whole-problem MILP at {len(problem.nodes)} nodes, {args.time_limit:.0f} s: "
                  f"{_plain_milp(problem, args.time_limit)}", flush=True)
    print(f"RESULT solver_scale: sizes {args.sizes}, time limit {args.time_limit:.0f} s")


if __name__ == "__main__":
    main()
