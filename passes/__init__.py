"""Graph passes: each takes (GraphModule, Plan, PassContext) and returns a GraphModule.

A pass never measures, solves or communicates. :data:`PIPELINE` is the order
:func:`graphpass.compile` runs them in.
"""

from graphpass.passes.insert_collectives import insert_collectives
from graphpass.passes.partition_stages import partition_stages
from graphpass.passes.recompute import recompute
from graphpass.passes.shard_parameters import shard_parameters
from graphpass.passes.split_operators import split_operators
from graphpass.passes.tensor_parallel import tensor_parallel

#: The passes ``graphpass.compile`` runs, in order. partition_stages comes first: it gives a
#: parameter that several pipeline stages read one node per stage, so the passes after it group
#: and synchronise each stage's use on its own; compile cuts the stages once every pass has run.
#: Later capabilities (offload) slot in as they land. split_operators comes next: its slices are the
#: parameters that shard_parameters then shards and gathers one by one. tensor_parallel runs
#: before shard_parameters (DESIGN.md lists them the other way round): it must see parameters
#: as direct get_attr inputs of their ops, and ZeRO then shards each rank's tp chunk over dp,
#: which is how ZeRO inside dp composes with tp on a 2-D mesh. insert_collectives adds the
#: data-parallel gradient sync last, over whatever parameters remain replicated.
PIPELINE = (partition_stages, split_operators, tensor_parallel, shard_parameters, insert_collectives, recompute)

__all__ = ["PIPELINE", "insert_collectives", "partition_stages", "recompute", "shard_parameters", "split_operators", "tensor_parallel"]
