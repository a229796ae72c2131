"""Graph passes: each takes (GraphModule, Plan, PassContext) and returns a GraphModule.

A pass never measures, solves or communicates. :data:`PIPELINE` is the order
:func:`graphpass.compile` runs them in.
"""

from graphpass.passes.insert_collectives import insert_collectives

#: The passes ``graphpass.compile`` runs, in order. Later capabilities (split_operators,
#: shard_parameters, tensor_parallel, recompute, offload, partition_stages) slot in around
#: insert_collectives as they land.
PIPELINE = (insert_collectives,)

__all__ = ["PIPELINE", "insert_collectives"]
