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

import math
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


def kept(loads: Sequence[float], capacity_factor: float | None) -> list[float]:
    """Each expert's share of the routed rows that it computes: ``min(load_e, cf / E)`` under a
    capacity factor (an expert keeps ``cf / E`` of the assignments), all of it dropless."""
    if capacity_factor is None:
        return list(loads)
    return [min(load, capacity_factor / len(loads)) for load in loads]


def dropped(loads: Sequence[float] | None, capacity_factor: float | None, num_experts: int = 1) -> float:
    """The share of assignments a capacity factor drops when expert ``e`` is routed ``loads[e]``
    of them (None: balanced over ``num_experts``). A lower bound: capacity applies per routing
    group (a sequence), whose own skew drops more than the average loads say."""
    loads = loads if loads is not None else [1.0 / num_experts] * num_experts
    return max(0.0, 1.0 - sum(kept(loads, capacity_factor)))


def choose_capacity(loads: Sequence[float] | None, candidates: Sequence[float | None], max_dropped: float,
                    num_experts: int) -> float | None:
    """The smallest capacity factor among ``candidates`` (None: dropless, the largest) whose
    predicted drops (:func:`dropped`) stay within ``max_dropped``: the least padding and the
    tightest bound on the slowest rank's work the budget allows.

    Raises:
        ValueError: no candidate drops little enough.
    """
    order = sorted(candidates, key=lambda cf: math.inf if cf is None else cf)
    for cf in order:
        if dropped(loads, cf, num_experts) <= max_dropped:
            return cf
    raise ValueError(f"no capacity factor among {list(candidates)} drops at most {max_dropped:.1%} of the "
                     "assignments under these expert loads; add larger ones (or None, dropless)")


def imbalance(loads: Sequence[float] | None, ep: int, owner: Sequence[int] | None = None,
              capacity_factor: float | None = None) -> float:
    """The slowest rank's expert work over the balanced dropless share (see the module
    docstring); 1 for ``loads`` None (balanced routing assumed) and no capacity, or ``ep = 1``
    without capacity; ``owner``: expert -> rank. Under a capacity factor each expert computes
    at most ``cf / E`` of the rows (the kept share, below 1 where assignments are dropped, even
    on one rank)."""
    if capacity_factor is None and (loads is None or ep == 1):
        return 1.0
    num = len(loads) if loads is not None else ep
    shares = kept(loads if loads is not None else [1.0 / num] * num, capacity_factor)
    local = num // ep
    ranks = [0.0] * ep
    for expert, share in enumerate(shares):
        ranks[(owner[expert] if owner is not None else expert // local)] += share
    return ep * max(ranks)


__all__ = ["zipf_loads", "rank_loads", "imbalance", "kept", "dropped", "choose_capacity"]
