"""What routing does to expert parallelism's cost: how unevenly the routed rows fall on the ranks
of an ``ep`` group. Torch-free.

Data parallelism computes every rank's own routed rows against all experts, so skewed routing
costs it nothing: each rank multiplies ``k x tokens`` rows whichever experts they go to. Under
expert parallelism rank ``j`` multiplies the rows routed to *its* experts from the whole ``ep``
group, so the step waits for the rank whose experts are hottest. With ``loads[e]`` the share of
routed rows expert ``e`` receives (summing to 1) and the experts laid out contiguously (rank ``j``
holds ``j E/ep .. (j+1) E/ep - 1``, as ``expert_parallel`` shards them), the slowest rank's
expert work is ``imbalance = ep * max_j sum_{e on j} loads[e]`` times the balanced share (1 when
routing is balanced, ``ep`` when one rank's experts get every row). The cost model multiplies the
expert compute (the grouped products and what lies between them) and the rows that rank
receives by it.

``loads`` come from measured routing statistics (per-expert counts, e.g. what a ``DenseToSparse``
or top-k gate routed in a few steps) or from a skew model: :func:`zipf_loads` is Zipf's law over
the experts (``skew`` 0: balanced; about 1: the hottest expert gets ``E / H_E`` times its share,
the skew HetuMoE and FlexMoE report for real gates early in training).
"""

from __future__ import annotations

from typing import Sequence


def zipf_loads(num_experts: int, skew: float) -> tuple[float, ...]:
    """Expert ``e`` (0-based) receives a share proportional to ``1 / (e + 1) ** skew``; the hot
    experts first, which contiguous placement puts on the same rank (the case dynamic expert
    placement exists for).

    Raises:
        ValueError: ``num_experts < 1`` or a negative ``skew``.
    """
    if num_experts < 1 or skew < 0:
        raise ValueError(f"zipf_loads needs num_experts >= 1 and skew >= 0, got {num_experts} and {skew}")
    weights = [1.0 / (e + 1) ** skew for e in range(num_experts)]
    total = sum(weights)
    return tuple(w / total for w in weights)


def rank_loads(loads: Sequence[float], ep: int, owner: Sequence[int] | None = None) -> list[float]:
    """The share of the routed rows each of the ``ep`` ranks receives: its experts' loads, the
    experts laid out contiguously, or by ``owner`` (expert -> rank; the runtime's placement
    buffers say the opposite, slot -> expert)."""
    if len(loads) % ep:
        raise ValueError(f"{len(loads)} experts do not divide over ep={ep} ranks")
    local = len(loads) // ep
    owner = owner if owner is not None else [e // local for e in range(len(loads))]
    out = [0.0] * ep
    for expert, load in enumerate(loads):
        out[owner[expert]] += load
    total = sum(out)
    return [x / total for x in out] if total > 0 else [1.0 / ep] * ep


def imbalance(loads: Sequence[float] | None, ep: int, owner: Sequence[int] | None = None) -> float:
    """The slowest rank's expert work over the balanced share (see the module docstring); 1 for
    ``loads`` None (balanced routing assumed) or ``ep = 1``; ``owner``: expert -> rank."""
    if loads is None or ep == 1:
        return 1.0
    return ep * max(rank_loads(loads, ep, owner))


__all__ = ["zipf_loads", "rank_loads", "imbalance"]
