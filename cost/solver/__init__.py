r"""Generic strategy-assignment ILP: pick one strategy per node, pay node and resharding costs,
stay under a memory limit. Torch-free: the planner turns a graph into a :class:`Problem`.

Modules, one phase each (``graphpass.cost.solver.<module>``):

- ``problem``: the data types (:class:`Node`, :class:`Edge`, :class:`Problem`,
  :class:`Solution`, the two errors), validation, :func:`evaluate` and :func:`min_peak_memory`.
- ``reductions``: the reduced problem every later phase works on (``_Reduced``) and the
  reductions that produce it (``_reduce``).
- ``ilp``: the one front end of every integer program the planner solves, this MILP and the
  clustered stage ILP (``graphpass.cost.search.stages.solve_stage``) alike: a model written once
  against ``ilp.Model``, built and solved by HiGHS, SCIP or CP-SAT in a thread under a deadline
  (``ilp.solve``), stdout silenced while HiGHS runs, the answer read back (``ilp.Result``).
- ``milp``: the model below, written once for both kinds of backend (``_builder``), and solved
  through ``ilp`` (``_run``).
- ``local_search``: the greedy pass with 1-opt moves (``_greedy_local_search``), pair moves and
  kicks (``_PairMoves``).
- ``message_passing``: the MPLP bound and the answer decoded from it (``_Messages``,
  ``_dual_decode``).
- ``lagrangian``: the memory rows priced into the costs (``_MemoryPriced``, ``_lagrangian``,
  ``_price_search``).
- ``windows``: large neighbourhood search, windows re-solved exactly (``_large_neighbourhoods``).
- ``driver``: :func:`solve` and :func:`heuristic`, which run the phases in order under one
  deadline.

Formulation
-----------
Sets: nodes :math:`n \in N`, strategies :math:`s \in S_n`, edges :math:`e = (u, v) \in E` with
resharding matrix :math:`R_e[s, t]`, time steps :math:`k`, and :math:`L_k = \{n : first_n \le k \le
last_n\}` the nodes whose memory is held at step :math:`k`.

Variables: :math:`x_{n,s} \in \{0, 1\}` (node n uses strategy s); :math:`y_{e,s,t} \ge 0` continuous
(edge e sees strategy pair (s, t)).

.. math::

    \min\ \sum_n \sum_s c_{n,s}\, x_{n,s} + \sum_e \sum_{s,t} R_e[s,t]\, y_{e,s,t}
        \qquad \text{-> milp.} \_set\_objective

    \sum_s x_{n,s} = 1 \quad \forall n
        \qquad \text{-> milp.} \_add\_one\_strategy\_per\_node

    \sum_t y_{e,s,t} = x_{u,s}\ \ \forall e, s; \qquad \sum_s y_{e,s,t} = x_{v,t}\ \ \forall e, t
        \qquad \text{-> milp.} \_add\_edge\_marginals

    \sum_{n \in L_k} \sum_s m_{n,s}\, x_{n,s} \le M \quad \forall k
        \qquad \text{-> milp.} \_add\_memory\_limit

Why y may stay continuous (the "marginal" or "transportation" linearisation): once x is binary,
node u picks a single a and v a single b, so the row sums of :math:`y_e` are the unit vector
:math:`e_a` and its column sums :math:`e_b`. With :math:`y \ge 0`, every row other than a and every
column other than b must be all zero, so the only entry left, :math:`y_{e,a,b}`, equals 1: y is
integral without being declared so and the MILP branches on x alone. Its LP relaxation is also
much tighter than the textbook :math:`y \ge x_{u,s} + x_{v,t} - 1` (DESIGN.md: 5-10x faster).

Memory steps: only steps where some interval starts need a row: if k is any step and k' the latest
start of an interval live at k, every interval live at k is live at k', so :math:`L_k \subseteq
L_{k'}` (``problem._Steps``). Rows that cannot bind (sum of per-node maxima <= M) are skipped;
each row is written relative to the per-node minimum memory (``reductions._memory_rows``). While
the rows' total size stays small they are written out; when intervals nest (forward i to
backward 2N-1-i, a quadratic total) each row becomes a running sum :math:`U_j = U_{j-1} +
\sum_{n \text{ enters at } j} E_n - \sum_{n \text{ left after } j-1} E_n \le rhs_j` with
:math:`E_n = \sum_s (m_{n,s} - \min m_n) x_{n,s}`: the same LP, linear in size ->
``milp._add_memory_limit``.

Infeasibility: the memory rows are the only constraints that can fail, and each :math:`x_n` enters
them only through :math:`m_{n,s} \ge` its own minimum. Minimising the peak
:math:`P \ge \sum_{L_k} m\,x\ \forall k` is therefore separable: the answer is
:math:`P^* = \max_k \sum_{n \in L_k} \min_s m_{n,s}` (every node at its smallest strategy), so it is
computed in closed form (:func:`min_peak_memory`, ``problem.py``) instead of by a second MILP.
``M < P^*`` raises :class:`InfeasibleError` naming ``memory_limit_bytes`` and :math:`P^*`.

Reductions (``reductions._reduce``), each keeping the optimum value, repeated to a fixpoint:

1. Parallel edges u->v (and v->u, transposed) are merged by summing matrices; a self-edge adds its
   diagonal to the node cost (``reductions._unreduced``).
2. Strategy s of node n is dropped when another strategy t has :math:`c_t \le c_s`,
   :math:`m_t \le m_s` and, on every incident edge, a resharding row (column for incoming edges)
   elementwise <= that of s, ties broken by index. Swapping s for t in any assignment then never
   raises cost or the memory of any step (``reductions._drop_dominated``).
3. A node with one strategy left is folded into its neighbours' costs.
4. Chains and leaves collapse (``reductions._eliminate``): a node that no binding memory row sees
   and that has at most two neighbours u, w is replaced by the edge
   :math:`R'_{u,w}[a,b] = \min_s R_{u,n}[a,s] + c_n[s] + R_{n,w}[s,b]` (a leaf folds into its
   neighbour's cost), and its best strategy is read back from the argmin table after the solve.
   Series-parallel graphs without a binding limit reduce to nothing: exact, no MILP.
5. A node that a neighbour determines (forbidden pairs leave it one strategy per strategy of the
   neighbour, as XLA's aliasing edges do) is merged into that neighbour, where that costs no
   model size (``reductions._merge_determined``).

Forbidden strategies and pairs are pruned before and during the reductions by arc consistency
(``reductions._prune``), which raises :class:`ForbiddenError` when a node has none left.

Every problem gets two starting answers: greedy with 1-opt moves
(``local_search._greedy_local_search``), and one decoded from message passing
(``message_passing._Messages``, MPLP on the edge-marginal LP's dual). Message passing moves the
edges' costs onto the nodes, so a greedy pass on the reparametrised costs sees what distant
neighbours prefer (``message_passing._dual_decode``). Its dual value is a lower bound on any graph.

Large problems (over ``driver._FULL_MODEL_SIZE`` variables after reduction, e.g. 10,000 op nodes; a
plain MILP of that size finds no incumbent in 60 s here; ``driver._priced_and_windows``):

- a Lagrangian relaxation of the memory rows (``lagrangian._lagrangian``): for multipliers
  :math:`\lambda \ge 0` the minimum of :math:`\sum c\,x + \sum_j \lambda_j (U_j - rhs_j)` is a
  lower bound. Without memory rows, reduction 4 solves the inner problem exactly on
  series-parallel graphs (``lagrangian._unconstrained_min``). Elsewhere message passing bounds it
  and decodes a minimiser (on large graphs in array steps: edges of one shape that share no node
  together, a high-degree node's edges together (``message_passing._Star``), and 1-opt moves of
  non-adjacent nodes together (``message_passing._Sweeps``)). Subgradient steps raise the bound;
  the best multipliers, scaled until their minimiser fits, give a feasible plan that prices
  memory as the dual does; a walk over memory prices from them looks for cheaper fitting plans
  (``lagrangian._price_search``);
- that plan or the best start, whichever is cheaper, improved by 1-opt moves, by pair moves
  (``local_search._PairMoves``: both ends of an edge at once, to the best pair that fits memory)
  and by kicks (a few expensive edges set to random cheap pairs, the rows they overflow repaired
  at the least cost per byte, pair moves around them; undone unless they pay off), then by
  large neighbourhood search (``windows._large_neighbourhoods``). Windows are breadth-first graph
  neighbourhoods, re-solved exactly by HiGHS with the rest fixed, two at a time where they
  share no node or edge. Their rows are merged where the same window nodes are live, so a
  window of W nodes has at most 2W rows (``windows._window``).

The gap reported is to the Lagrangian bound (bench/solver_scale.py: 10,000 nodes x 6 strategies
within 0.13% in 60 s, 20,000 within 0.26%, 50,000 within 1.4%, where greedy + local search
alone is 22% above).

Below that size the whole MILP runs in its own thread. If it has not finished after
``driver._WINDOWS_AFTER`` of the time, the windows improve the heuristic's answer on the other
core meanwhile (``driver._whole_and_windows``). Some reduced instances of 10k-50k nodes stay
under the size cutoff, and HiGHS finds no incumbent for them in 60 s (IOPDDL D and Q). There the
windows' answer is the one returned.

Backends: ``"highs"`` (default) is HiGHS through ``pywraplp`` (checked to exist in OR-Tools 9.15;
``ilp._LinearSolverModel``, memory in the units of ``milp._memory_unit``); ``"cp-sat"`` builds the
same model with integer coefficients (``ilp._CpSatModel``, ``milp._scaled_for_cpsat``): the
objective is scaled so that its largest coefficient becomes ``milp._CPSAT_COST_RESOLUTION``
(1e9) and rounded, which makes the CP-SAT optimum optimal up to half a unit per term; memory
is kept exact when all values are integral (bytes usually are), otherwise scaled to 1e12 with
coefficients rounded up and the limit rounded down (conservative).
A greedy + local-search :func:`heuristic` gives CP-SAT's warm start (``AddHint``; HiGHS gets
none: ``SetHint`` segfaults in Solve with HiGHS in OR-Tools 9.15). It also competes with the
solver's answer: the cheaper one is returned, with its gap to the best bound known (the
solver's, else every term at its own minimum). HiGHS can overrun its own time limit (presolve),
so model building and solving run in a thread (pywraplp releases the GIL) and the deadline is
enforced by the front end (``ilp._in_thread``): past it the solve is interrupted and the heuristic
returned.
"""

from __future__ import annotations

from graphpass.cost.solver.driver import heuristic, solve
from graphpass.cost.solver.problem import (
    Edge,
    ForbiddenError,
    InfeasibleError,
    Node,
    Problem,
    Solution,
    evaluate,
    min_peak_memory,
)

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
