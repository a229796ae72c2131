"""The planner's search: meshes, pipeline stages and a per-block strategy ILP. Torch-free.

One module per step, each importing only those before it:

- :mod:`~graphpass.cost.search.blocks`: the unit of decision, a block, and what the graph side
  measures of it (:class:`BlockCost`).
- :mod:`~graphpass.cost.search.layouts`: the candidate meshes (:class:`Parallelism`, :func:`meshes`).
- :mod:`~graphpass.cost.search.pricing`: one block under one choice on one mesh, priced from the
  transition table and the cluster's links (:func:`price`).
- :mod:`~graphpass.cost.search.stages`: pipeline stages by dynamic programming, the clustered
  stage ILP over per-block choices, and the step time of an assignment (:func:`evaluate`).
- :mod:`~graphpass.cost.search.driver`: every mesh solved, fastest first (:func:`search`).
"""

from graphpass.cost.search.blocks import LAYER, POST, PRE, BlockCost, OpParams
from graphpass.cost.search.layouts import Parallelism, local_batch, meshes
from graphpass.cost.search.pricing import Costing, choices_for, ep_all_to_all, price, transition_s
from graphpass.cost.search.stages import Candidate, evaluate, solve_stage, stage_rooms, stage_speeds, uniform_choices
from graphpass.cost.search.driver import NoPlanError, search, solve_mesh, step_floor

__all__ = [
    "BlockCost",
    "Candidate",
    "Costing",
    "LAYER",
    "Parallelism",
    "NoPlanError",
    "OpParams",
    "POST",
    "PRE",
    "choices_for",
    "ep_all_to_all",
    "evaluate",
    "local_batch",
    "meshes",
    "price",
    "search",
    "solve_mesh",
    "solve_stage",
    "stage_rooms",
    "stage_speeds",
    "step_floor",
    "transition_s",
    "uniform_choices",
]
