"""``graphpass.plan``: choose how to parallelise a model on a cluster, from its captured graph.

The planner never runs the model: it captures it on fake tensors (meta-device models and inputs
work, so a 175B model on 1024 GPUs plans on a laptop), measures the graph, and searches.

1. **Measure the graph once** (:class:`GraphProfile`, ``measure.py``): split the nodes into
   *blocks* (the segment before the first repeated layer, each repeated layer, the segment after
   the last); per node, FLOPs and bytes (priced by the roofline, or profiled times when the
   cluster is this machine and a profile exists, :mod:`graphpass.cost.profiler`,
   ``remeasure.py``); activations autograd saves for backward, measured by running the graph on
   fake tensors under ``saved_tensors_hooks`` and counting each storage once, attributed to the
   node that produced it.
2. **Per tensor-parallel layout** ``(tp, sequence_parallel, tp_layout)``: Megatron's pattern, or
   the op-level solver's placement of the projections it leaves replicated
   (:mod:`graphpass.planner.op_placement`, :meth:`Planner.op_layouts`); dry-run the
   ``tensor_parallel`` pass (:func:`graphpass.passes.tensor_parallel.layout`) on a meta skeleton
   of the graph; every node whose input or output it shards runs 1/tp of its compute and saves
   1/tp of its activations, parameters it shards hold 1/tp, and the collectives it emits are
   priced as they are (the transition table, ``graphpass.transitions``). A tp the model cannot
   take (heads, vocabulary not divisible) is skipped with its reason.
3. **Search** (:mod:`graphpass.cost.search`): meshes, pipeline stages by dynamic programming,
   per-block ZeRO stage / split / recompute by an OR-Tools ILP over clusters of identical blocks.
4. **Plan** (``report.py``): the winner becomes a :class:`~graphpass.plan.Plan` with
   predictions, a per-block breakdown and the reasons (runner-up meshes, what did not fit and
   why).

``strategy=gp.Strategy(...)`` prices that fixed uniform strategy with the same model instead of
searching (the baselines a user would otherwise pick).

Modules:

* ``driver.py``: :class:`Planner` and :func:`plan`, their arguments' checks and the costing.
* ``measure.py``: :class:`GraphProfile`, the graph measured once, and its blocks' costs per
  tensor-parallel layout.
* ``remeasure.py``: profiled op times at each local batch, of the graph and of the programs the
  tensor-parallel pass emits, and the contention of ranks sharing a CPU host.
* ``op_placement.py``: the op-level placement of the projections Megatron's pattern leaves.
* ``report.py``: the winner as a :class:`~graphpass.plan.Plan`, with its reasons.
"""

from graphpass.planner.driver import DEFAULT_MEMORY_FRACTION, Planner, parse_memory, plan, resolve_cluster
from graphpass.planner.measure import GraphProfile, PlanningError

__all__ = ["plan", "Planner", "parse_memory", "GraphProfile", "PlanningError", "resolve_cluster",
           "DEFAULT_MEMORY_FRACTION"]
