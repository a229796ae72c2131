"""IOPDDL: graphpass's op-level strategy solver on the ASPLOS 2025 contest's XLA auto-sharding problems.

What is measured: for each instance in ``--dir`` (``asplos-2025-iopddl-*.json`` or ``.json.gz``),
``graphpass.cost.solver.solve`` with ``--time-limit`` seconds (default 60) on the exact conversion
of the instance, and the answer checked by this file's own evaluator, written from the contest's
rules (``iopddl.cc``'s ``Evaluate``), not by the solver's own accounting:

* cost = the chosen strategies' node costs + each edge's cost at the chosen pair;
* usage: at every time t, the summed usage of the nodes whose interval ``[start, end)`` holds t
  must not exceed ``usage_limit``.

The conversion onto ``cost/solver/``'s ``Problem`` is exact: interval ``[s, e)`` -> live ``(s,
e - 1)``; an empty interval (``s == e``) holds no memory (its usages become 0); an edge's flat cost
list is its ``[strategies of u][strategies of v]`` matrix, row-major. Costs at or above
``--forbidden`` (default 1e17; the instances price a forbidden combination 1e18) are counted in
the answer: any such term makes it unusable.

Where to get the instances (nothing is fetched at run time): ``git clone
https://github.com/google/iopddl`` and point ``--dir`` at its ``benchmarks/`` (A-D, G, K-N, P-V
are in the public repository; the others are larger than its file limit). The best known costs
are not published there; ``iopddl_best_known.json`` beside this file holds, per instance, the
cheapest valid answer (no forbidden term) in the contest's final results table (the 20 teams'
and XLA's), and the table prints each answer's ratio to it (``--best-known FILE`` for others).

    python bench/iopddl.py --dir ~/iopddl/benchmarks --only B G --time-limit 60
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import pathlib
import sys
import time

from graphpass.cost import solver as S

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from solver_scale import whole_milp  # noqa: E402  (bench/ is not a package)

FORBIDDEN = 1e17


def read_instance(path: pathlib.Path) -> dict:
    """The instance's ``problem`` object (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["problem"]


def to_problem(raw: dict, forbidden: float = FORBIDDEN) -> S.Problem:
    """The exact ``cost/solver/`` form of an IOPDDL instance (module docstring); costs at or
    above ``forbidden`` are the solver's forbidden ones."""
    nodes = raw["nodes"]
    out_nodes = []
    for i, ((start, end), costs, usages) in enumerate(zip(nodes["intervals"], nodes["costs"], nodes["usages"])):
        if end > start:
            out_nodes.append(S.Node(str(i), [float(c) for c in costs], [float(u) for u in usages], (start, end - 1)))
        else:  # an empty interval holds no memory
            out_nodes.append(S.Node(str(i), [float(c) for c in costs], [0.0] * len(costs), (start, start)))
    edges = []
    for (u, v), flat in zip(raw["edges"]["nodes"], raw["edges"]["costs"]):
        cols = len(nodes["costs"][v])
        edges.append(S.Edge(str(u), str(v), [[float(c) for c in flat[r * cols:(r + 1) * cols]]
                                             for r in range(len(nodes["costs"][u]))]))
    steps = max((end for _, end in nodes["intervals"]), default=0)
    return S.Problem(out_nodes, edges, raw.get("usage_limit"), num_steps=max(1, steps), forbidden_cost_s=forbidden)


def evaluate(raw: dict, choice: list[int], forbidden: float = FORBIDDEN) -> tuple[float, bool, int]:
    """(cost, within the usage limit, forbidden terms) of ``choice`` by the contest's rules."""
    nodes = raw["nodes"]
    cost, bad = 0.0, 0
    horizon = max((end for _, end in nodes["intervals"]), default=0)
    usage = [0.0] * (horizon + 1)
    for i, s in enumerate(choice):
        term = nodes["costs"][i][s]
        cost += term
        bad += term >= forbidden
        start, end = nodes["intervals"][i]
        for t in range(start, end):
            usage[t] += nodes["usages"][i][s]
    for (u, v), flat in zip(raw["edges"]["nodes"], raw["edges"]["costs"]):
        term = flat[choice[u] * len(nodes["costs"][v]) + choice[v]]
        cost += term
        bad += term >= forbidden
    limit = raw.get("usage_limit")
    fits = limit is None or max(usage, default=0.0) <= limit
    return cost, fits, bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="directory of asplos-2025-iopddl-*.json[.gz] instances")
    p.add_argument("--only", nargs="*", default=None, help="instance letters, e.g. B G")
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--forbidden", type=float, default=FORBIDDEN)
    p.add_argument("--best-known", default=str(pathlib.Path(__file__).with_name("iopddl_best_known.json")),
                   help="JSON file: instance name -> best known cost")
    p.add_argument("--whole-milp", action="store_true",
                   help="also solve each instance as one HiGHS MILP (the reference where it finishes)")
    args = p.parse_args(argv)
    paths = sorted(pathlib.Path(args.dir).glob("asplos-2025-iopddl-*.json*"))
    if args.only:
        paths = [q for q in paths if q.name.split(".")[0].rsplit("-", 1)[1] in args.only]
    if not paths:
        print(f"no asplos-2025-iopddl-*.json[.gz] instances in {args.dir}", file=sys.stderr)
        return 2
    best = json.loads(pathlib.Path(args.best_known).read_text()) if args.best_known else {}
    print(f"time limit {args.time_limit:g} s per instance; cost by this file's evaluator; forbidden = terms >= "
          f"{args.forbidden:g}")
    print(f"{'instance':26s} {'nodes':>6s} {'edges':>6s} {'wall s':>7s} {'cost':>12s} {'bound':>12s} "
          f"{'fits':>5s} {'forbid':>6s} {'path':>14s} {'/best':>7s}")
    ratios = []  # cost / best known of the answers that fit with no forbidden term
    for path in paths:
        raw = read_instance(path)
        name = raw.get("name", path.name.split(".")[0])
        problem = to_problem(raw, args.forbidden)
        start = time.perf_counter()
        try:
            sol = S.solve(problem, time_limit_s=args.time_limit)
        except (S.InfeasibleError, ValueError) as exc:
            print(f"{name:26s} failed: {exc}")
            continue
        wall = time.perf_counter() - start
        choice = [sol.choice[str(i)] for i in range(len(problem.nodes))]
        cost, fits, bad = evaluate(raw, choice, args.forbidden)
        bound = sol.lower_bound_s
        ratio = f"{cost / best[name]:7.3f}" if name in best else "      -"
        if name in best:
            ratios.append(cost / best[name] if fits and not bad else math.inf)
        print(f"{name:26s} {len(problem.nodes):6d} {len(problem.edges):6d} {wall:7.1f} {cost:12.6g} {bound:12.6g} "
              f"{str(fits):>5s} {bad:6d} {sol.solver:>14s} {ratio}", flush=True)
        if args.whole_milp:
            start = time.perf_counter()
            ref = whole_milp(problem, args.time_limit)
            wall = time.perf_counter() - start
            cost_ref, fits_ref, bad_ref = evaluate(raw, [ref.choice[str(i)] for i in range(len(problem.nodes))],
                                                   args.forbidden)
            print(f"{'  one whole MILP':26s} {'':6s} {'':6s} {wall:7.1f} {cost_ref:12.6g} "
                  f"{ref.lower_bound_s:12.6g} {str(fits_ref):>5s} "
                  f"{bad_ref:6d} {ref.solver:>14s} {cost / cost_ref:7.3f}x", flush=True)
    if ratios:  # an answer that does not fit or has a forbidden term counts as infinitely far
        print(f"geometric mean of /best over {len(ratios)}: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
