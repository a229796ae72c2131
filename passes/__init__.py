"""Graph passes: each takes (GraphModule, Plan, PassContext) and returns a GraphModule.

A pass never measures, solves or communicates. :data:`PIPELINE` is the order
:func:`graphpass.compile` runs them in.
"""

from graphpass.passes.insert_collectives import insert_collectives
from graphpass.passes.recompute import recompute
from graphpass.passes.shard_parameters import shard_parameters

#: The passes ``graphpass.compile`` runs, in order. Later capabilities (split_operators,
#: tensor_parallel, offload, partition_stages) slot in as they land.
PIPELINE = (shard_parameters, insert_collectives, recompute)

__all__ = ["PIPELINE", "insert_collectives", "recompute", "shard_parameters"]
