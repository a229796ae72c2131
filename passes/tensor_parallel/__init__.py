"""tensor_parallel: shard parameters over the ``tp`` axis and propagate placements through the
graph, inserting Megatron's collectives where placements change.

Contract: parameters whose ``plan.placement(name, "tp")`` is ``Shard(d)`` are replaced by this
rank's chunk of dim ``d`` (its ``gp.layout`` records it; shard_parameters, which runs next, may
then ZeRO-shard that chunk over ``dp``). Every other tensor starts ``Replicate()``
(inputs, buffers, constants). Nodes are then visited in order; a rule per op (below) says which
input placements it accepts and what its output placement is, rewrites shape arguments to local
sizes, and asks the collective emitter for a redistribution where an input does not fit. The
result is Megatron-LM's program: column-parallel linears (``Shard(0)`` weights) take replicated
input through ``tp_copy`` (f), row-parallel linears (``Shard(1)``) produce partial sums reduced by
``tp_all_reduce`` (g) right before the bias and the residual add; vocabulary-sharded embeddings
mask out-of-range ids and produce partial sums; vocabulary-sharded logits go straight into
``vocab_parallel_cross_entropy``. With ``plan.sequence_parallel``, a partial sum joining the
residual stream is reduce-scattered along the sequence (dim 1) instead, norms and dropout run on
sequence shards, and column linears all-gather their input (whose backward reduce-scatters).

The walk and the rule registry are in ``walker.py``; the rules, by op family as DTensor groups
its op strategies: ``compute_rules.py`` (linear, embedding, cross-entropy, attention, matmul,
layer norm, convolutions (channel parallel: ``Shard(0)`` weights column, ``Shard(1)`` row), batch
norm and pooling on channel shards), ``pointwise_rules.py`` (elementwise and broadcasting binary
ops), ``view_rules.py`` (views/reshapes/transposes/permutes/(un)squeeze/expand/flatten,
reductions, slicing, cat/split); ``dry_run.py`` runs the walk on a meta skeleton for the
planner. An op without a rule gets replicated inputs and a replicated output, with one warning
naming the op. Replicated parameters that meet sharded
activations (norm weights under sequence parallelism) get ``gp.grad_partial = "tp"``, and
``insert_collectives`` sums their gradients over ``tp``.

Before/after (tp=2, an MLP)::

    up = aten.linear(x, up_w, up_b)   [B,T,256]    x_f = tp_copy(x, 'tp', 2)
    act = aten.gelu(up)                       →    up = aten.linear(x_f, up_w, up_b)       [B,T,128]
    down = aten.linear(act, down_w, down_b)        down = aten.linear(aten.gelu(up), down_w)  (partial)
    out = aten.add(x, down)                        red = tp_all_reduce(down, 'tp', 2); out = x + (red + down_b)
"""

from __future__ import annotations

import torch.fx as fx

from graphpass.pass_manager import PassContext, graph_pass
from graphpass.plan import Plan
from graphpass.passes.tensor_parallel import compute_rules, pointwise_rules, view_rules  # noqa: F401 (they register the rules)
from graphpass.passes.tensor_parallel.dry_run import EmittedCollective, DryRun, layout
from graphpass.passes.tensor_parallel.walker import (
    AXIS, NAME, RULES, MergedShard, PartsShard, TensorParallelError, Walker, keeps_shard, log,
)


@graph_pass(NAME, requires=(), provides=("tensor_parallel",))
def tensor_parallel(gm: fx.GraphModule, plan: Plan, ctx: PassContext) -> fx.GraphModule:
    """Shard ``tp`` parameters and rewrite the graph to local, Megatron-style compute."""
    size = plan.mesh.get(AXIS, 1)
    if size == 1:
        log.info("%s: no tp axis of size > 1; nothing to do", NAME)
        return gm
    walker = Walker(gm, plan, size, plan.mesh.coordinate(ctx.rank, AXIS))
    walker.run()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


__all__ = ["EmittedCollective", "DryRun", "MergedShard", "PartsShard", "RULES", "TensorParallelError", "keeps_shard",
           "layout", "tensor_parallel"]
