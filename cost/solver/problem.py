"""The solver's torch-free input and output, and the checks that need no search.

:class:`Node`, :class:`Edge` and :class:`Problem` go in, :class:`Solution` comes out, and
:class:`InfeasibleError` or :class:`ForbiddenError` say why none could. :func:`evaluate` prices
an assignment; :func:`min_peak_memory` is the smallest peak any assignment reaches, in closed form
(the package docstring, "Infeasibility"). ``_validate`` checks a problem and gives its numbers as
arrays, ``_Steps`` the steps a memory peak can occur at: what the reductions start from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Relative slack on memory comparisons: a limit met up to rounding counts as met.
_REL_TOL = 1e-9


@dataclass(frozen=True)
class Node:
    """A decision: one entry per strategy. ``live`` = [first, last] step its memory is held."""

    name: str
    costs_s: Sequence[float]
    memory_bytes: Sequence[float]
    live: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Edge:
    """Resharding time ``cost_s[strategy of src][strategy of dst]``."""

    src: str
    dst: str
    cost_s: Sequence[Sequence[float]]


@dataclass(frozen=True)
class Problem:
    """Nodes, edges and one memory limit. A cost ``>= forbidden_cost_s`` (and any ``inf``) forbids
    its strategy or strategy pair: it is never chosen (:class:`ForbiddenError` when a node is left
    with no allowed strategy)."""

    nodes: Sequence[Node]
    edges: Sequence[Edge]
    memory_limit_bytes: float | None = None
    num_steps: int | None = None
    forbidden_cost_s: float = math.inf


@dataclass(frozen=True)
class Solution:
    choice: dict[str, int]
    cost_s: float
    peak_memory_bytes: float
    optimal: bool
    gap: float
    seconds: float
    solver: str
    lower_bound_s: float = -math.inf  # no assignment costs less (the gap is measured to it)


class InfeasibleError(ValueError):
    """No assignment meets ``memory_limit_bytes``; ``min_memory_bytes`` is the smallest peak."""

    def __init__(self, memory_limit_bytes: float, min_memory_bytes: float, step: int | None, *,
                 why: str | None = None):
        self.memory_limit_bytes = memory_limit_bytes
        self.min_memory_bytes = min_memory_bytes
        where = f" (at step {step})" if step is not None else ""
        why = why or (f"the smallest peak memory any assignment reaches is {min_memory_bytes:.6g} bytes{where}; "
                      "raise memory_limit_bytes to at least that, or add lower-memory strategies")
        super().__init__(f"no strategy assignment fits memory_limit_bytes={memory_limit_bytes:.6g}: {why}")


class ForbiddenError(ValueError):
    """Every strategy of ``node`` is forbidden, by its own costs or in combination with a neighbour."""

    def __init__(self, node: str, why: str):
        self.node = node
        super().__init__(f"Node {node!r}: no allowed strategy: {why}")


# --------------------------------------------------------------------------------------------
# Validation, evaluation, memory steps


@dataclass(frozen=True)
class _Arrays:
    """The problem's numbers as arrays, forbidden entries (``>= forbidden_cost_s``) set to ``inf``."""

    index: dict[str, int]
    cost: list[np.ndarray]
    mem: list[np.ndarray]
    edges: list[tuple[int, int, np.ndarray]]


def _forbid(values: np.ndarray, threshold: float) -> np.ndarray:
    return np.where(values >= threshold, np.inf, values) if np.isfinite(threshold) else values


def _validate(problem: Problem) -> _Arrays:
    index: dict[str, int] = {}
    threshold = float(problem.forbidden_cost_s)
    if math.isnan(threshold):
        raise ValueError("Problem.forbidden_cost_s must be a number (inf: only inf costs are forbidden)")
    costs, mems = [], []
    for i, node in enumerate(problem.nodes):
        if node.name in index:
            raise ValueError(f"Problem.nodes: duplicate node name {node.name!r}")
        index[node.name] = i
        k = len(node.costs_s)
        if k == 0:
            raise ValueError(f"Node {node.name!r}: costs_s is empty; give at least one strategy")
        if len(node.memory_bytes) != k:
            raise ValueError(
                f"Node {node.name!r}: memory_bytes has {len(node.memory_bytes)} entries, "
                f"costs_s has {k}; give one of each per strategy"
            )
        c, m = np.asarray(node.costs_s, dtype=float), np.asarray(node.memory_bytes, dtype=float)
        if np.isnan(c).any() or (c == -np.inf).any():
            raise ValueError(f"Node {node.name!r}: costs_s must be numbers (inf forbids a strategy)")
        if not np.isfinite(m).all():
            raise ValueError(f"Node {node.name!r}: memory_bytes must be finite")
        costs.append(_forbid(c, threshold))
        mems.append(m)
        first, last = node.live
        if not 0 <= first <= last:
            raise ValueError(f"Node {node.name!r}: live={node.live} must satisfy 0 <= first <= last")
        if problem.num_steps is not None and last >= problem.num_steps:
            raise ValueError(
                f"Node {node.name!r}: live={node.live} ends past num_steps={problem.num_steps}"
            )
    edges = []
    for edge in problem.edges:
        for end in (edge.src, edge.dst):
            if end not in index:
                raise ValueError(f"Edge {edge.src!r}->{edge.dst!r}: unknown node {end!r}")
        u, v = index[edge.src], index[edge.dst]
        rows, cols = len(costs[u]), len(costs[v])
        matrix = edge.cost_s
        if len(matrix) != rows or any(len(r) != cols for r in matrix):
            raise ValueError(
                f"Edge {edge.src!r}->{edge.dst!r}: cost_s must be {rows}x{cols} "
                f"([strategy of src][strategy of dst])"
            )
        m = np.asarray(matrix, dtype=float).reshape(rows, cols)
        if np.isnan(m).any() or (m == -np.inf).any():
            raise ValueError(f"Edge {edge.src!r}->{edge.dst!r}: cost_s must be numbers (inf forbids a pair)")
        edges.append((u, v, _forbid(m, threshold)))
    return _Arrays(index, costs, mems, edges)


@dataclass(frozen=True)
class _Steps:
    """The steps where a peak can occur, and the contiguous range of them each node is live at.

    Only interval starts need checking: if k is any step and k' the latest start of an interval live
    at k, every interval live at k is live at k'. Node n is live at the starts
    ``starts[lo[n] : hi[n] + 1]``, so per-step sums are a difference array and a cumulative sum:
    O(N log N) even when intervals nest (forward i to backward 2N-1-i), where listing each step's
    live set would be O(N^2).
    """

    starts: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def sums(self, values: np.ndarray) -> np.ndarray:
        """Per step, the sum of ``values[n]`` over the nodes live there."""
        diff = np.zeros(len(self.starts) + 1)
        np.add.at(diff, self.lo, values)
        np.add.at(diff, self.hi + 1, -values)
        return np.cumsum(diff)[:-1]


def _steps(problem: Problem) -> _Steps:
    first = np.array([n.live[0] for n in problem.nodes], dtype=np.int64)
    last = np.array([n.live[1] for n in problem.nodes], dtype=np.int64)
    starts = np.unique(first)
    return _Steps(starts, np.searchsorted(starts, first), np.searchsorted(starts, last, side="right") - 1)


def evaluate(problem: Problem, choice: dict[str, int]) -> tuple[float, float]:
    """(cost_s, peak_memory_bytes) of an assignment of strategy indices to node names."""
    by_name = {n.name: n for n in problem.nodes}
    cost = sum(float(by_name[name].costs_s[s]) for name, s in choice.items())
    cost += sum(float(e.cost_s[choice[e.src]][choice[e.dst]]) for e in problem.edges)
    if not problem.nodes:
        return cost, 0.0
    held = np.array([float(n.memory_bytes[choice[n.name]]) for n in problem.nodes])
    return cost, float(_steps(problem).sums(held).max())


def min_peak_memory(problem: Problem) -> tuple[float, int | None]:
    """Smallest peak memory any assignment reaches, and the step where it occurs (closed form:
    every node at its smallest allowed strategy; pairs forbidden on edges narrow it further, see
    :func:`solve`)."""
    if not problem.nodes:
        return 0.0, None
    arrays = _validate(problem)
    return _min_peak(_steps(problem), arrays.cost, arrays.mem)


def _min_peak(steps: _Steps, cost: Sequence[np.ndarray], mem: Sequence[np.ndarray]) -> tuple[float, int | None]:
    mins = [m[np.isfinite(c)].min() if np.isfinite(c).any() else m.min() for c, m in zip(cost, mem)]
    totals = steps.sums(np.array(mins, dtype=float))
    at = int(np.argmax(totals))
    return float(totals[at]), int(steps.starts[at])
