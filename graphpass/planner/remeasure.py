"""Profiled op times, taken as ranks take them in a step (`_op_times`), and the model measured
again at the local batch each layout runs (`_Remeasure`): its graph captured at that batch, and
the rank program the tensor-parallel pass emits there timed op by op (:class:`ProgramTimes`).

Only for a cluster that is this machine; presets are priced by the roofline
(`graphpass.planner.measure.GraphProfile`). On CPU, op times measured by one process are
scaled by the contention of the ranks sharing the host (`_contended`, `_contention`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from graphpass.capture import capture
from graphpass.fake_values import propagate_fake
from graphpass.grads import grad_requiring_nodes
from graphpass.cluster import Cluster
from graphpass.cost.compute import node_bytes, node_flops
from graphpass.passes.collectives import is_collective
from graphpass.passes.tensor_parallel import layout as tp_layout
from graphpass.plan import Plan, Strategy
from graphpass.plan_builder import plan_from_choices
from graphpass.planner.op_placement import OpLayout
from graphpass.runtime.tensor_parallel import ALONE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProgramTimes:
    """Profiled times of a tensor-parallel rank program (`_Remeasure.program`), scaled as the
    original graph's op times are (`_op_times`): ``own`` per original node the program keeps (at its
    local shapes), ``added`` per original node for the ops the pass added after it (a row
    linear's bias add after its all-reduce). Collectives are left out: the transition table
    prices them. Empty where the program could not be timed."""

    own: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    added: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)


class _Remeasure:
    """The model measured again at other batches (the local batch a layout runs): its graph
    captured at each batch once, and the whole-graph factor of each batch measured once, shared
    by the op times (`times`) and the tensor-parallel programs (`program`).

    Op times are not linear in the batch (fixed costs per op, cache effects), so the planner
    times each op at the batch it runs instead of scaling the captured batch's times.
    """

    def __init__(self, model: nn.Module, inputs: Sequence[torch.Tensor], gm: fx.GraphModule, cluster: Cluster,
                 factor: float, together: bool = False):
        self.model, self.inputs, self.gm, self.cluster, self.together = model, inputs, gm, cluster, together
        self.full = int(inputs[0].shape[0])
        self._graphs: dict[int, tuple[fx.GraphModule, list[torch.Tensor]] | None] = {}
        self._times: dict[int, dict[str, tuple[float, float]]] = {}
        self._factors: dict[int, float] = {self.full: factor}  # ``gm``'s, measured by the planner

    def graph(self, batch: int) -> tuple[fx.GraphModule, list[torch.Tensor]] | None:
        """The graph captured at ``batch`` samples (the first ``batch`` rows of every input whose
        dim 0 is the batch) and those inputs; None (logged) when capture fails or gives another
        graph (node names must match the captured batch's)."""
        if batch not in self._graphs:
            sliced = [t[:batch] if t.dim() and t.shape[0] == self.full else t for t in self.inputs]
            try:
                other = self.gm if batch == self.full else capture(self.model, sliced).gm
            except Exception as exc:  # noqa: BLE001 - the linear scaling stands in; said here
                log.info("op times at batch %d: capture failed (%s); scaling the batch-%d times", batch, exc, self.full)
                other = None
            ops = [(n.name, n.target) for n in self.gm.graph.nodes if n.op == "call_function"]
            if other is not None and ops != [(n.name, n.target) for n in other.graph.nodes if n.op == "call_function"]:
                log.info("op times at batch %d: the graph differs from the batch-%d one; scaling its times",
                         batch, self.full)
                other = None
            self._graphs[batch] = None if other is None else (other, sliced)
        return self._graphs[batch]

    def _measure(self, batch: int, gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> None:
        """`_op_times` of the graph at ``batch``, once: its times and its whole-graph factor."""
        if batch not in self._times:
            self._times[batch], self._factors[batch] = _op_times(gm, self.cluster, True, inputs, self.together)

    def _factor(self, batch: int, gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> float:
        if batch not in self._factors:
            self._measure(batch, gm, inputs)
        return self._factors[batch]

    def times(self, batch: int) -> dict[str, tuple[float, float]]:
        """`_op_times` at ``batch``, keyed by the captured graph's node names (``{}`` where
        `graph` is None)."""
        found = self.graph(batch)
        if found is None:
            return {}
        self._measure(batch, *found)
        return self._times[batch]

    def program(self, tp: int, sequence_parallel: bool, batch: int, op_layout: OpLayout | None = None) -> ProgramTimes:
        """`ProgramTimes` of the program the tensor-parallel pass emits at ``batch`` samples: the
        pass dry-run on the graph of that batch (`tp_layout`), its fake values re-derived at the
        local shapes, its non-collective ops timed on this machine
        (`graphpass.cost.profiler.node_times`) and scaled by the program's own whole-run factor
        (`_timed_whole`; the original graph's at that batch where the program cannot run).
        Empty (logged) where it cannot be done.

        The program's own factor matters: its ops are smaller than the original's, and small
        ops timed alone gain more from warm caches than large ones (on this machine a tp=2
        program's ops summed to 42% of the whole graph's, not 50%, while the program ran in
        about half the graph's time)."""
        found = self.graph(batch) if self.cluster.name.startswith("local") else None
        if found is None:
            return ProgramTimes()

        other, sliced = found
        try:
            program = tp_layout(other, _tp_plan(other, tp, sequence_parallel, op_layout)).program
            _materialize(program, other)
            propagate_fake(program, sliced)
        except Exception as exc:  # noqa: BLE001 - the per-node split stands in; said here
            log.info("tp=%d program at batch %d not timed (%s: %s); its compute is the original ops split tp ways",
                     tp, batch, type(exc).__name__, exc)
            return ProgramTimes()
        raw, factor = self._timed_whole(program, sliced, tp, batch)
        times = _contended(program, self.cluster, raw,
                           self._factor(batch, other, sliced) if factor is None else factor, self.together)
        original = {n.name for n in other.graph.nodes}
        own, added = {}, defaultdict(lambda: (0.0, 0.0))
        for node in program.graph.nodes:
            if node.name not in times:
                continue
            f, b = times[node.name]
            if node.name in original:
                own[node.name] = (f, b)
                continue
            anchor = node
            while anchor.name not in original and anchor.all_input_nodes:
                anchor = anchor.all_input_nodes[0]
            added[anchor.name] = (added[anchor.name][0] + f, added[anchor.name][1] + b)
        return ProgramTimes(own, dict(added))


    def _timed_whole(self, program: fx.GraphModule, inputs: Sequence[torch.Tensor], tp: int,
                     batch: int) -> tuple[dict[str, tuple[float, float]], float | None]:
        """The rank program's non-collective op times (`graphpass.cost.profiler.node_times`) and
        its own `isolation_factor`: the program run whole (on every rank at once when
        ``together``) with each collective swapped for its one-rank stand-in
        (`graphpass.runtime.tensor_parallel.ALONE`: its local work, no traffic), over the sum of
        its ops timed alone, stand-ins included, so that their copies fall on both sides. The
        factor is None (logged) where some op has no time; every rank decides alike, as they
        share times."""
        from graphpass.cost import profiler

        graph = fx.Graph()
        graph.output(graph.graph_copy(program.graph, {}))
        stand_ins = set()
        for node in graph.nodes:
            if is_collective(node):
                node.target = ALONE[node.target]
                stand_ins.add(node.name)
        rehearsal = fx.GraphModule(program, graph)
        times = profiler.node_times(rehearsal, self.cluster.device, measure=True, together=self.together)
        own = {name: t for name, t in times.items() if name not in stand_ins}
        untimed = [n.name for n in graph.nodes if n.op == "call_function" and n.name not in times]
        if untimed:
            log.info("tp=%d program at batch %d not timed whole (%s have no time); scaled as the original graph",
                     tp, batch, ", ".join(untimed[:5]))
            return own, None
        return own, profiler.isolation_factor(rehearsal, inputs, times, together=self.together)


def _tp_plan(gm: fx.GraphModule, tp: int, sequence_parallel: bool, op_layout: OpLayout | None = None) -> Plan:
    """The plan the tensor-parallel pass is dry-run with: ``tp`` ways alone (dp=1), the
    projections placed by ``op_layout``, else by Megatron's pattern."""
    strategy = Strategy(dp=1, tp=tp, sequence_parallel=sequence_parallel)
    return plan_from_choices(gm, strategy.mesh, strategy.choice, sequence_parallel=sequence_parallel, strategy=strategy,
                             tp_layout=(op_layout.placements, op_layout.parts) if op_layout is not None else None)


def _materialize(gm: fx.GraphModule, like: fx.GraphModule) -> None:
    """Give a meta skeleton's parameters and buffers real storage on ``like``'s device: the
    values of ``like``'s tensor of the same name, cut to the skeleton's (sharded) shape, or
    zeros. Fake propagation then sees the device the graph asserts, and the program runs on
    values of the model's ranges (index buffers stay in range); the values are for timing only."""
    sources = {**dict(like.named_parameters()), **dict(like.named_buffers())}
    device = next(iter(sources.values())).device if sources else torch.device("cpu")

    def real(name: str, t: torch.Tensor) -> torch.Tensor:
        src = sources.get(name)
        if src is None or src.dim() != t.dim() or any(a > b for a, b in zip(t.shape, src.shape)):
            return torch.zeros_like(t, device=device)
        return src.detach()[tuple(slice(0, n) for n in t.shape)].clone()

    prefix = {id(m): f"{n}." if n else "" for n, m in gm.named_modules()}
    for module in gm.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[name] = nn.Parameter(real(prefix[id(module)] + name, p), p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = real(prefix[id(module)] + name, b)


def _op_times(gm: fx.GraphModule, cluster: Cluster, measure: bool,
              inputs: Sequence[torch.Tensor], together: bool = False) -> tuple[dict[str, tuple[float, float]], float]:
    """Profiled node times when the cluster is this machine (presets are priced by the roofline),
    as ranks take them in a step, and the whole-graph factor that went into them.

    ``measure`` runs the ops the cache lacks (:func:`graphpass.cost.profiler.node_times`) and then
    the whole graph once, to scale the isolated op times to what they take in sequence
    (:func:`graphpass.cost.profiler.isolation_factor`); the profiler logs loudly whatever it
    cannot supply. On CPU, op times are measured by one process while ``world_size`` ranks share
    the host: each op also takes the contention of its kind (`_contended`), unless ``together``
    timed the whole graph on every rank at once (`Planner`'s ``measure_together``).
    """
    if not cluster.name.startswith("local"):
        return {}, 1.0
    from graphpass.cost import profiler

    times = profiler.node_times(gm, cluster.device, measure=measure, together=together)
    factor = (profiler.isolation_factor(gm, inputs, times, together=together)
              if measure and profiler.is_this_machine(cluster.device) else 1.0)
    return _contended(gm, cluster, times, factor, together), factor


def _contended(gm: fx.GraphModule, cluster: Cluster, times: Mapping[str, tuple[float, float]],
               factor: float, together: bool = False) -> dict[str, tuple[float, float]]:
    """``times`` scaled by ``factor`` and by the ranks' contention for the host (`_contention`):
    an op whose bytes take longer than its FLOPs on this device (the roofline's memory-bound
    side: norms, elementwise ops, copies) the memory-bound figure, as DRAM is what CPU ranks
    share most; the others the compute figure (GPUs share nothing: both are 1 there). A
    ``factor`` measured ``together`` holds the contention already."""
    compute, memory = _contention(cluster, together=together), _contention(cluster, memory_bound=True, together=together)
    device = cluster.device
    peak = max(device.peak_tflops.values()) * 1e12 * device.compute_efficiency
    bandwidth = device.memory_bandwidth_gbps * 1e9 * device.memory_efficiency
    grad_nodes = grad_requiring_nodes(gm)
    out = {}
    for node in gm.graph.nodes:
        if node.name not in times:
            continue
        f, b = times[node.name]
        bound = memory if node_bytes(node) / bandwidth > node_flops(node, grad_nodes)[0] / peak else compute
        out[node.name] = (f * factor * bound, b * factor * bound)
    return out


# ---------------------------------------------------------------------------------- contention


def _contention(cluster: Cluster, memory_bound: bool = False, together: bool = False) -> float:
    """How many times slower one rank's compute runs than one process alone measured it: on CPU,
    the profile's measured `DeviceSpec.contention` (ranks share cores, caches and DRAM; for
    ``memory_bound`` work such as an optimizer step, ``memory_contention``), else the core
    oversubscription alone (ranks x threads per rank, as ``graphpass.launch`` sets them, over
    the cores). 1 for times measured ``together`` (on every rank at once: they hold it)."""
    if together:
        return 1.0
    if cluster.device.kind != "cpu":
        return 1.0
    measured = cluster.device.memory_contention if memory_bound else None
    measured = measured if measured is not None else cluster.device.contention
    return measured if measured is not None else _oversubscription(cluster)


def _oversubscription(cluster: Cluster) -> float:
    """How many times the threads of a CPU host's ranks (``devices_per_node`` of them, each
    ``graphpass.launch``'s share of the cores, at least 1) outnumber this host's cores, at least
    1; 1 off CPU."""
    if cluster.device.kind != "cpu":
        return 1.0
    cores = os.cpu_count() or 1
    ranks = cluster.devices_per_node
    return max(1.0, ranks * max(1, cores // ranks) / cores)
