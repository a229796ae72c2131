"""An op-level strategy problem shaped like a transformer's, built by hand for `cost/solver/`.

The solver is torch-free: it takes nodes (one cost and one memory figure per strategy, and the
steps their memory is held), edges (a resharding cost per pair of strategies) and a memory limit.
This file builds one the size of a real op-level graph (tens of thousands of nodes), for the
solver's scale test (``tests/test_solver.py``) and ``bench/solver_scale.py``.

Shape: ``num_layers`` layers of ten ops (``LAYER``) in a chain, each layer's two residual adds
joined to the add before them, as in a pre-norm transformer. Each op has ``num_strategies``
strategies: strategy s shards its activation ``SHARDS[s]`` ways. Sharding saves memory and costs
time (communication and smaller kernels), so the fastest plan is the biggest and the memory limit
decides. Each op's activation is held from its forward step i to its backward step 2N-1-i, so the
live intervals nest as in training. Resharding between different strategies of neighbours costs
time in proportion to the activation; the same strategy costs nothing.

    from op_problem import transformer_op_problem
    problem = transformer_op_problem(num_layers=2000)   # 20,000 nodes
    solution = graphpass.cost.solver.solve(problem, time_limit_s=60)
"""

from __future__ import annotations

import random

from graphpass.cost.solver import Edge, Node, Problem, evaluate, min_peak_memory

LAYER = ("ln_1", "qkv", "attention", "proj", "add_1", "ln_2", "fc", "gelu", "fc_proj", "add_2")
_MATMULS = {"qkv", "attention", "fc", "fc_proj"}
_WEIGHTED = {"qkv", "proj", "fc", "fc_proj"}
SHARDS = (1, 2, 4, 8, 2, 4)  # activation shards of each strategy
_COMM = (0.0, 1.0, 2.0, 4.0, 0.5, 1.5)  # relative communication of each strategy


def transformer_op_problem(num_layers: int, num_strategies: int = 6, seed: int = 0,
                           limit_fraction: float = 0.5) -> Problem:
    """``num_layers * 10`` nodes; the memory limit sits ``limit_fraction`` of the way from the
    smallest reachable peak to the peak of the fastest (unsharded) plan."""
    if not 1 <= num_strategies <= len(SHARDS):
        raise ValueError(f"num_strategies must be in 1..{len(SHARDS)}, got {num_strategies}")
    rng = random.Random(seed)
    k = num_strategies
    total = num_layers * len(LAYER)
    nodes: list[Node] = []
    edges: list[Edge] = []

    def reshard(size: float) -> list[list[float]]:
        return [[0.0 if a == b else size * (1 + abs(a - b)) for b in range(k)] for a in range(k)]

    for layer in range(num_layers):
        first = len(nodes)
        for op in LAYER:
            step = len(nodes)
            activation = rng.uniform(0.5, 2.0) * 1e8
            work = rng.uniform(0.5, 2.0) * (4.0 if op in _MATMULS else 0.2)
            cost = [work * (1 + 0.05 * s) + _COMM[s] * rng.uniform(0.2, 0.6) for s in range(k)]
            memory = [activation / SHARDS[s] + (1e7 * s if op in _WEIGHTED else 0.0) for s in range(k)]
            nodes.append(Node(f"h{layer}.{op}", cost, memory, live=(step, 2 * total - 1 - step)))
            if step:
                edges.append(Edge(nodes[-2].name, nodes[-1].name, reshard(0.05 * activation / 1e8)))
        if layer:  # the residual stream: the previous layer's output feeds this layer's first add
            edges.append(Edge(nodes[first - 1].name, nodes[first + 4].name, reshard(0.05)))
        edges.append(Edge(nodes[first + 4].name, nodes[first + 9].name, reshard(0.05)))
    unlimited = Problem(nodes, edges)
    smallest, _ = min_peak_memory(unlimited)
    fastest = evaluate(unlimited, {n.name: 0 for n in nodes})[1]
    return Problem(nodes, edges, memory_limit_bytes=smallest + limit_fraction * (fastest - smallest),
                   num_steps=2 * total)
