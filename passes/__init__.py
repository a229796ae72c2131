"""Graph passes: each takes (GraphModule, Plan, PassContext) and returns a GraphModule.

A pass never measures, solves or communicates. :data:`PIPELINE` is the order
:func:`graphpass.compile` runs them in.
"""

from graphpass.plan import Plan
from graphpass.passes.expert_parallel import expert_parallel
from graphpass.passes.global_loss_mean import global_loss_mean
from graphpass.passes.insert_collectives import insert_collectives
from graphpass.passes.offload import offload
from graphpass.passes.partition_stages import partition_stages
from graphpass.passes.recompute import recompute
from graphpass.passes.shard_embeddings import shard_embeddings
from graphpass.passes.shard_parameters import shard_parameters
from graphpass.passes.split_operators import split_operators
from graphpass.passes.tensor_parallel import tensor_parallel

#: The passes ``graphpass.compile`` runs, in order (a pipelined plan runs `passes_for`'s).
#: global_loss_mean comes first: it makes a mean loss a sum over this piece of the batch divided by
#: the step's count, which tensor_parallel then computes vocabulary-parallel. split_operators next: its slices are the
#: parameters that shard_parameters then shards and gathers one by one. tensor_parallel runs
#: before shard_parameters (DESIGN.md lists them the other way round): it must see parameters
#: as direct get_attr inputs of their ops, and ZeRO then shards each rank's tp chunk over dp,
#: which is how ZeRO inside dp composes with tp on a 2-D mesh. expert_parallel shards the
#: experts over ep after tensor_parallel (the dense parts' tp layout is settled) and before
#: shard_parameters (ZeRO then shards each rank's experts over edp). shard_embeddings cuts the
#: embedding tables the plan shards over dp and routes their lookups; their gradients are sparse,
#: so neither ZeRO nor the gradient all-reduce takes them. insert_collectives adds the
#: data-parallel gradient sync last, over whatever parameters remain replicated. offload runs
#: after recompute: its fetches sit between each parameter and all of its uses, collectives and
#: checkpointed layers included, and its host-saved scopes wrap layers that are not recomputed.
PIPELINE = (global_loss_mean, split_operators, tensor_parallel, expert_parallel, shard_embeddings, shard_parameters,
            insert_collectives, recompute, offload)


def passes_for(plan: Plan) -> tuple:
    """The passes that compile ``plan``: :data:`PIPELINE`, after partition_stages when the plan
    has pipeline stages (it gives a parameter that several stages read one node per stage, so
    the passes after it group and synchronise each stage's use on its own; compile cuts the
    stages once every pass has run)."""
    return (partition_stages, *PIPELINE) if len(plan.stages) > 1 else PIPELINE


__all__ = ["PIPELINE", "expert_parallel", "global_loss_mean", "insert_collectives", "offload", "partition_stages", "passes_for", "recompute", "shard_embeddings", "shard_parameters", "split_operators", "tensor_parallel"]
