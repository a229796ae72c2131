"""Dynamic expert placement (FlexMoE): move hot experts between the ranks of each ``ep`` group
so that the slowest rank's expert work falls; the numerics do not change.

A compiled program with experts sharded over ``ep`` keeps, per Mixture-of-Experts layer, two
buffers (``expert_parallel``): ``ep_placement_i``, the expert each slot holds (rank ``j`` of the
group holds slots ``j E/ep ..``; in order at compile), which the exchange ops route by, and
``ep_load_i``, the rows routed to each expert since the last decision, which the count exchange
tallies. :class:`ExpertPlacement` reads the tallies every ``every`` steps and, where its cost
model says the move pays for itself, writes a new placement and moves each moved expert's
weights, gradients and optimizer state (every tensor of the optimizer's state shaped like the
weight) to its new slot. A token still meets the same expert weights and its rows come back in
the same order, so losses, gradients and ``full_state_dict()`` are those of the unmoved program
(checkpoints are written by expert, whatever the placement).

**When and where (the policy).** The tallies are summed over ``dp`` (every rank's routed rows:
the same counts on every rank, so every rank decides the same). The new placement is the
longest-processing-time greedy over the experts, hottest first, each to the rank of its ``ep``
group with the least load that still has a free slot (ties to the rank already holding it).
Its cost model, per layer::

    gain = (max_j L_j - max_j L'_j) * R * c * every        (the slowest rank's compute saved)
    cost = M * (b_w + b_o) * P / B                          (the experts' tensors moved)

with ``L_j`` / ``L'_j`` the share of the routed rows rank ``j``'s experts got (now / after),
``R`` the routed rows of one step on the group, ``c`` the seconds one routed row costs one
expert (forward and backward: ``6 x`` its weights' elements in FLOPs at the device's rate),
``every`` the steps until the next decision, ``M`` the experts' weight elements of the layer,
``b_w`` / ``b_o`` the bytes per element of the weights (and their gradients) and optimizer state,
``P = (ep - 1) / ep`` the share an all-gather moves, and ``B`` the link's bandwidth. The move is
made when ``gain > cost``. Moving is an all-gather of the layer's expert tensors over ``ep``
(simple and exact; a point-to-point move of only the moved experts would cost less, and the
cost model prices the all-gather that runs). FasterMoE's shadowing (replicating a hot expert
on every rank) is the anchor to beat; replication is not built: a slot holds one expert.

Not supported yet: experts ZeRO-sharded over ``edp`` (their local tensors are shards of the
slots), pipelined programs; both raise ``NotImplementedError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from graphpass import meta
from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime.expert_parallel import LOAD_PREFIX, PLACEMENT_PREFIX
from graphpass.runtime.zero import _all_gather_flat


@dataclass
class Move:
    """One layer's decision: loads before and after (each rank's share of the rows), the
    predicted gain and cost in seconds, and whether it moved."""

    layer: int
    before: list[float]
    after: list[float]
    gain_s: float
    cost_s: float
    moved: bool


def greedy_placement(loads: list[float], ep: int, current: list[int]) -> list[int]:
    """The expert in each slot after the longest-processing-time greedy (see the module
    docstring); ``current`` (the expert in each slot now) where the greedy does not lower the
    slowest rank's share."""
    num = len(loads)
    local = num // ep
    owner_now = {expert: slot // local for slot, expert in enumerate(current)}
    rank_load, slots = [0.0] * ep, [[] for _ in range(ep)]
    for expert in sorted(range(num), key=lambda e: (-loads[e], e)):
        free = [j for j in range(ep) if len(slots[j]) < local]
        least = min(rank_load[j] for j in free)
        ties = [j for j in free if rank_load[j] == least]
        j = owner_now[expert] if owner_now[expert] in ties else ties[0]
        rank_load[j] += loads[expert]
        slots[j].append(expert)
    # Within a rank keep an expert in the slot it already has where it can (less to move).
    out = []
    for j in range(ep):
        mine = current[j * local:(j + 1) * local]
        staying = [e if e in slots[j] else None for e in mine]
        arriving = iter(sorted(e for e in slots[j] if e not in mine))
        out += [e if e is not None else next(arriving) for e in staying]
    # no better than now: stay (a move costs bytes and gains nothing)
    return out if max(rank_shares(loads, out, ep)) < max(rank_shares(loads, current, ep)) else list(current)


def rank_shares(loads: list[float], placement: list[int], ep: int) -> list[float]:
    """Each rank's share of the rows, experts placed by ``placement`` (expert in each slot)."""
    local = len(placement) // ep
    total = sum(loads) or 1.0
    return [sum(loads[e] for e in placement[j * local:(j + 1) * local]) / total for j in range(ep)]


class ExpertPlacement:
    """Moves experts between the ranks of each ``ep`` group every ``every`` steps (see the
    module docstring for the policy and its cost model).

    Args:
        dmodel: a compiled ``DistributedModule`` with experts sharded over ``ep``.
        optimizer: its optimizer (its state moves with the experts); None moves weights only.
        every: steps between decisions (call :meth:`step` after each optimizer step).
        flops_per_s: the device's achieved rate for expert compute (default: the local
            cluster's device, peak times efficiency, in the weights' dtype).
        link_bytes_per_s: the ep group's link bandwidth (default: the local cluster's
            intra-node link).
        force: move whenever the greedy placement lowers the slowest rank's share, whatever
            the cost model says (tests, and measuring the cost model itself).

    Raises:
        ValueError: a program without experts sharded over ``ep``.
        NotImplementedError: experts ZeRO-sharded over ``edp``, or a pipelined program.
    """

    def __init__(self, dmodel, optimizer=None, every: int = 100, *, flops_per_s: float | None = None,
                 link_bytes_per_s: float | None = None, force: bool = False):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"ExpertPlacement.every must be a positive int, got {every!r}")
        self.dmodel, self.optimizer, self.every, self.force = dmodel, optimizer, every, force
        self.steps, self.history = 0, []
        self.mesh: mesh_lib.ProcessMesh = dmodel._mesh
        self.ep = self.mesh.axis_size("ep") if "ep" in self.mesh.axes else 1
        if dmodel.plan.mesh.pp > 1:
            raise NotImplementedError("ExpertPlacement on a pipelined program is not implemented yet; use pp=1")
        self.layers = self._layers(dmodel.graph_module)
        if self.ep == 1 or not self.layers:
            raise ValueError("ExpertPlacement needs a program whose experts are sharded over ep "
                             "(compile with graphpass.Strategy(dp=..., ep=k), k > 1)")
        self.flops_per_s, self.link_bytes_per_s = self._rates(flops_per_s, link_bytes_per_s)

    @staticmethod
    def _layers(gm: fx.GraphModule) -> list[tuple[str, str, list[str]]]:
        """(placement buffer, load buffer, expert weight targets) of each sharded layer."""
        weights: dict[str, list[str]] = {}
        for node in gm.graph.nodes:
            layout = meta.layout(node) if node.op == "get_attr" else None
            if layout is not None and layout.experts is not None:
                if layout.zero:
                    raise NotImplementedError(
                        f"ExpertPlacement with experts ZeRO-sharded over edp ({node.target!r}) is not implemented "
                        "yet; use zero=0 for the experts (or ep = dp)")
                weights.setdefault(layout.experts, [])
                if node.target not in weights[layout.experts]:
                    weights[layout.experts].append(node.target)
        layer = lambda name: int(name[len(PLACEMENT_PREFIX):])  # noqa: E731
        return [(name, LOAD_PREFIX + name[len(PLACEMENT_PREFIX):], targets)
                for name, targets in sorted(weights.items(), key=lambda item: layer(item[0]))]

    def _rates(self, flops_per_s: float | None, link_bytes_per_s: float | None) -> tuple[float, float]:
        """The cost model's rates, rank 0's on every rank (hosts may hold different profiles;
        ranks that priced alike and decided apart would wait in different collectives)."""
        from graphpass.cluster import Cluster

        if flops_per_s is None or link_bytes_per_s is None:
            cluster = Cluster.local()
            dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self._attr(self.layers[0][2][0]).dtype, "fp32")
            peak = cluster.device.peak_tflops.get(dtype) or max(cluster.device.peak_tflops.values())
            flops_per_s = flops_per_s or peak * 1e12 * cluster.device.compute_efficiency
            # the ep group's slowest link: between nodes where it spans them
            link = cluster.inter_node if self.mesh.two_level("ep") is not None else cluster.intra_node
            link_bytes_per_s = link_bytes_per_s or link.bandwidth_gbps * 1e9
        rates = [float(flops_per_s), float(link_bytes_per_s)]
        if dist.is_initialized():
            dist.broadcast_object_list(rates, src=0)
        return rates[0], rates[1]

    def _attr(self, target: str) -> torch.Tensor:
        return self.dmodel._attr(target)

    def step(self) -> list[Move]:
        """Count one step; every ``every`` steps, decide (and maybe move). A collective over all
        ranks on those steps: call it on every rank."""
        self.steps += 1
        return self.rebalance() if self.steps % self.every == 0 else []

    @torch.no_grad()
    def rebalance(self) -> list[Move]:
        """Decide now for every layer from the tallies since the last decision; the decisions."""
        moves = []
        for i, (placement_name, load_name, targets) in enumerate(self.layers):
            placement, load = self._attr(placement_name), self._attr(load_name)
            tally = load.clone()
            group = self.mesh.group("dp")
            if group is not None:
                dist.all_reduce(tally, group=group)
            load.zero_()
            loads, current = tally.tolist(), placement.tolist()
            new = greedy_placement(loads, self.ep, current)
            before, after = rank_shares(loads, current, self.ep), rank_shares(loads, new, self.ep)
            gain, cost = self._priced(targets, loads, before, after, current, new)
            moved = new != current and max(after) < max(before) and (self.force or gain > cost)
            if moved:
                self._move(targets, current, new)
                placement.copy_(torch.tensor(new, dtype=placement.dtype))
            moves.append(Move(i, before, after, gain, cost, moved))
        self.history += moves
        return moves

    def _priced(self, targets, loads, before, after, current, new) -> tuple[float, float]:
        """(gain, cost) in seconds of moving from ``current`` to ``new`` (module docstring)."""
        weights = [self._attr(t) for t in targets]
        local = len(current) // self.ep
        per_expert = sum(w.numel() for w in weights) / local  # elements of one expert's weights
        rows = sum(loads) / max(self.every, 1) / (self.mesh.axis_size("dp") // self.ep)  # one step, one ep group
        gain = (max(before) - max(after)) * rows * 6 * per_expert / self.flops_per_s * self.every
        element = weights[0].element_size()
        state = sum(v.element_size() for w in weights for v in self._states(w)) / max(len(weights), 1)
        moved = per_expert * len(current) * (2 * element + state) * (self.ep - 1) / self.ep
        return gain, moved / self.link_bytes_per_s

    def _states(self, weight: torch.Tensor) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        state = self.optimizer.state.get(weight, {})
        return [v for v in state.values() if isinstance(v, torch.Tensor) and v.shape == weight.shape]

    def _move(self, targets: list[str], current: list[int], new: list[int]) -> None:
        """Every tensor of the layer's experts from the old slots to the new, in place."""
        group, rank = self.mesh.group("ep"), self.mesh.axis_rank("ep")
        local = len(current) // self.ep
        slot_of = torch.tensor(current).argsort()  # expert -> old slot
        mine = torch.tensor(new[rank * local:(rank + 1) * local])
        for target in targets:
            weight = self._attr(target)
            tensors = [weight.data] + ([weight.grad] if weight.grad is not None else []) + self._states(weight)
            # every rank of the group must move as many tensors (one all-gather each)
            counts = torch.tensor([len(tensors), -len(tensors)], device=weight.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
            if counts[0] != -counts[1]:
                raise RuntimeError(
                    f"ExpertPlacement: the ranks of an ep group hold different tensors of {target!r} (a gradient or "
                    f"optimizer state on some ranks only: {int(-counts[1])} to {int(counts[0])}); rebalance after "
                    "optimizer.step() and zero_grad() on every rank")
            for tensor in tensors:
                gathered = tensor.new_empty((self.ep * local, *tensor.shape[1:]))
                _all_gather_flat(gathered, tensor.contiguous(), group=group)
                tensor.copy_(gathered[slot_of[mine].to(gathered.device)])


__all__ = ["ExpertPlacement", "Move", "greedy_placement", "rank_shares"]
