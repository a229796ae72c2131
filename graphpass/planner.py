"""``graphpass.plan``: choose how to parallelise a model on a cluster, from its captured graph.

The planner never runs the model: it captures it on fake tensors (meta-device models and inputs
work, so a 175B model on 1024 GPUs plans on a laptop), measures the graph, and searches.

1. **Measure the graph once** (:class:`GraphProfile`): split the nodes into *blocks* (the
   segment before the first repeated layer, each repeated layer, the segment after the last);
   per node, FLOPs and bytes (priced by the roofline, or profiled times when the cluster is this
   machine and a profile exists, :mod:`graphpass.cost.profiler`); activations autograd saves for
   backward, measured by running the graph on fake tensors under ``saved_tensors_hooks`` and
   counting each storage once, attributed to the node that produced it.
2. **Per tensor-parallel layout** ``(tp, sequence_parallel, tp_layout)``: Megatron's pattern, or
   the op-level solver's placement of the projections it leaves replicated
   (:mod:`graphpass.op_placement`, :meth:`Planner.op_layouts`); dry-run the ``tensor_parallel``
   pass (:func:`graphpass.passes.tensor_parallel.layout`) on a meta skeleton of the graph; every
   node whose input or output it shards runs 1/tp of its compute and saves 1/tp of its
   activations, parameters it shards hold 1/tp, and the collectives it emits are priced as they
   are (the transition table, ``graphpass.transitions``). A tp the model cannot take (heads, vocabulary
   not divisible) is skipped with its reason.
3. **Search** (:mod:`graphpass.cost.search`): meshes, pipeline stages by dynamic programming,
   per-block ZeRO stage / split / recompute by an OR-Tools ILP over clusters of identical blocks.
4. **Plan**: the winner becomes a :class:`~graphpass.plan.Plan` with predictions, a per-block
   breakdown and the reasons (runner-up meshes, what did not fit and why).

``strategy=gp.Strategy(...)`` prices that fixed uniform strategy with the same model instead of
searching (the baselines a user would otherwise pick).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor.placement_types import Partial, Shard
from torch.multiprocessing.reductions import StorageWeakRef

from graphpass import meta
from graphpass.capture import capture, propagate_fake
from graphpass.model_io import Batch, adapt
from graphpass.grads import grad_requiring_nodes
from graphpass.cluster import Cluster, DeviceSpec
from graphpass.cost import search as S
from graphpass.cost.compute import node_bytes, node_flops
from graphpass.passes.collectives import is_collective
from graphpass.passes.expert_parallel import ExpertRegion, expert_regions
from graphpass.passes.split_operators import default_split
from graphpass.passes.tensor_parallel import EmittedCollective, TensorParallelError, layout as tp_layout
from graphpass.ops import op_base
from graphpass.repeats import condense
from graphpass.plan import Choice, Plan, Strategy
from graphpass.transitions import transition
from graphpass.plan_builder import plan_from_choices, uniform_stages
from graphpass.op_placement import MEGATRON, OpLayout, Prices, op_layouts
from graphpass.runtime.tensor_parallel import ALONE

log = logging.getLogger(__name__)

__all__ = ["plan", "Planner", "parse_memory", "GraphProfile", "PlanningError"]

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
#: Default share of device memory the plan may use: the rest is for the CUDA context, the
#: caching allocator's fragmentation and communication buffers.
DEFAULT_MEMORY_FRACTION = 0.9
#: Tensor-parallel degrees tried (within one node).
_TP_DEGREES = (1, 2, 4, 8, 16)
#: A tensor-parallel layout is offered only when at least this share of the model's compute
#: (forward + backward time at tp=1) runs on shards. Below it, most work is repeated on every
#: tp rank: a ResNet under tp=2 shards only its classifier and runs every convolution twice.
#: Such a mesh can still be priced faster than dp where gradients are slow to all-reduce, but
#: it is one device's work on tp devices; dp, ZeRO or pipeline stages use them instead.
_MIN_TP_COMPUTE_SHARE = 0.5
#: Adam / AdamW keep two states per parameter (exp_avg, exp_avg_sq).
_ADAM_STATES = 2
_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class PlanningError(ValueError):
    """The inputs cannot be planned (a model without parameters, a bad budget or cluster)."""


def parse_memory(value: Any, name: str = "memory_budget") -> int:
    """Bytes from an int/float or a string such as ``"70GiB"``, ``"80 GB"``, ``"1.5e10"``.

    Raises:
        ValueError: naming ``name`` and the accepted forms.
    """
    if isinstance(value, bool):
        value = None
    if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
        return int(value)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([KMGT]i?B|B)?\s*", value, re.IGNORECASE)
        if match:
            number = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
            if number > 0:
                return int(number)
    raise ValueError(
        f"{name}={value!r} is not a memory size; give bytes as a positive number or a string like "
        "'70GiB', '80GB', '512MiB' or '7.5e10'"
    )


def resolve_cluster(cluster: Any) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        match = re.fullmatch(r"([\w.-]+?)(?::(\d+)x(\d+))?", cluster.strip())
        if match and match.group(2):
            return Cluster.preset(match.group(1), nodes=int(match.group(2)), gpus_per_node=int(match.group(3)))
        if ":" in cluster:
            raise ValueError(
                f"cluster={cluster!r}: write a preset as NAME or NAME:NODESxGPUS, e.g. 'h100-80g:16x8'"
            )
        return Cluster.preset(cluster.strip())
    raise TypeError(
        f"cluster must be a graphpass.Cluster or a preset name such as 'h100-80g' or 'h100-80g:4x8', "
        f"got {type(cluster).__name__}"
    )


# ------------------------------------------------------------------------------- graph profile


@dataclass
class _Block:
    name: str
    kind: str
    layer: int | None
    nodes: list[fx.Node]
    params: list[fx.Node]
    signature: str = ""
    input_bytes: float = 0.0
    output_bytes: float = 0.0


def _tensor_bytes(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.numel() * value.element_size())
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0.0


class _SavedTensors(fx.Interpreter):
    """Runs the graph on fake tensors and attributes every tensor autograd saves for backward to
    the node that produced its storage (each storage counted once)."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, flash_attention: bool):
        super().__init__(gm)
        self.mode = mode
        self.flash = flash_attention
        self.current: fx.Node | None = None
        self.producer: dict[StorageWeakRef, fx.Node] = {}
        self.saved: dict[StorageWeakRef, tuple[fx.Node, float]] = {}
        self.params: set[StorageWeakRef] = set()

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor):
            fake = self.mode.from_tensor(value)
            self.params.add(StorageWeakRef(fake.untyped_storage()))
            return fake
        return value

    def run_node(self, node: fx.Node) -> Any:
        self.current = node
        out = super().run_node(node)
        for t in _flat_tensors(out):
            self.producer.setdefault(StorageWeakRef(t.untyped_storage()), node)
        if self.flash and op_base(node) == "scaled_dot_product_attention" and isinstance(out, torch.Tensor):
            # Flash / memory-efficient attention saves q, k, v, the output and a float32
            # logsumexp per (batch, head, query); the fake run takes the math path, which would
            # also save the (s x s) probabilities.
            for t in [*(a for a in self.fetched_args(node)), out]:
                self._record(t, node)
            b_h_s = out.shape[:-1]
            self.saved[StorageWeakRef(torch.empty(0).untyped_storage())] = (node, 4.0 * math.prod(b_h_s))
        return out

    def fetched_args(self, node: fx.Node) -> list[torch.Tensor]:
        return [self.env[a] for a in node.args[:3] if isinstance(a, fx.Node) and isinstance(self.env.get(a), torch.Tensor)]

    def _record(self, t: torch.Tensor, owner: fx.Node) -> None:
        ref = StorageWeakRef(t.untyped_storage())
        if ref in self.params or ref in self.saved:
            return
        self.saved[ref] = (self.producer.get(ref, owner), float(t.untyped_storage().nbytes()))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        node = self.current
        if not (self.flash and node is not None and op_base(node) == "scaled_dot_product_attention"):
            self._record(t, node)
        return t


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def _saved_bytes_by_node(gm: fx.GraphModule, inputs: Sequence[torch.Tensor], flash_attention: bool) -> dict[str, float]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    interp = _SavedTensors(gm, mode, flash_attention)
    fake_inputs = [mode.from_tensor(t) for t in inputs]
    with mode, torch.autograd.graph.saved_tensors_hooks(interp.pack, lambda t: t):
        interp.run(*fake_inputs)
    out: dict[str, float] = defaultdict(float)
    for node, nbytes in interp.saved.values():
        if node is not None:
            out[node.name] += nbytes
    return dict(out)


class _BackwardWindows(_SavedTensors):
    """`_SavedTensors` that also keeps every saved tensor (for a probe's baseline) and hooks the
    gradient of every value one block hands to a later one, so that a memory probe can tell
    when backward leaves each block."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, owner: Mapping[fx.Node, int],
                 on_leave: Callable[[int], None]):
        super().__init__(gm, mode, flash_attention=False)
        # node -> the earliest later block that reads it: its gradient is complete once backward
        # has left that block (the last of its readers that backward reaches)
        self.crossing = {n: min(owner[u] for u in n.users if owner.get(u, -1) > owner[n])
                         for n in owner if any(owner.get(u, -1) > owner[n] for u in n.users)}
        self.on_leave = on_leave
        self.kept: list[torch.Tensor] = []

    def run_node(self, node: fx.Node) -> Any:
        out = super().run_node(node)
        if node in self.crossing:
            for t in _flat_tensors(out):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._left, self.crossing[node]))
        return out

    def _left(self, block: int, grad: torch.Tensor) -> None:
        self.on_leave(block)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.kept.append(t)
        return super().pack(t)


def _backward_bytes_by_block(gm: fx.GraphModule, inputs: Sequence[torch.Tensor],
                             blocks: Sequence[Sequence[fx.Node]]) -> list[float]:
    """Per block: the most bytes its backward allocates beyond what was alive when backward
    reached it (the gradients of its activations and of the ops inside it, net of the saved
    activations it frees on the way). For the post block that is the loss's working set (the
    logits' gradient and the loss's own), alive while every activation still is; for a
    recomputed layer it comes on top of its rematerialised activations.

    Simulated on fake tensors at the captured batch: forward, then backward under the memory
    probe, cut into windows where the gradient of a value that crosses into a block first
    appears (backward leaves the blocks in reverse order).
    """
    from graphpass.runtime.memory import MemoryProbe

    owner = {n: i for i, nodes in enumerate(blocks) for n in nodes}
    out = [0.0] * len(blocks)
    if not owner:
        return out
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    probe: MemoryProbe | None = None
    state = {"block": len(blocks) - 1, "entry": 0.0}

    def on_leave(block: int) -> None:
        # The first gradient flowing out of `block` (from a block after it) ends the windows of
        # every block from the current one down to `block`.
        if probe is None or block > state["block"]:
            return
        current = int(state["block"])
        out[current] = max(out[current], probe.peak_bytes - state["entry"])
        state["block"], state["entry"] = block - 1, float(probe.current_bytes)
        probe.reset_peak()

    interp = _BackwardWindows(gm, mode, owner, on_leave)
    fake_inputs = [mode.from_tensor(t) for t in inputs]
    with mode, torch.autograd.graph.saved_tensors_hooks(interp.pack, lambda t: t):
        result = interp.run(*fake_inputs)
    losses = [t for t in _flat_tensors(result) if t.requires_grad]
    if not losses:
        return out
    with mode:
        probe = MemoryProbe(baseline=interp.kept, fake=True)
        with probe:
            interp.kept.clear()  # the probe holds them weakly: backward frees them as it goes
            state["entry"] = float(probe.current_bytes)
            torch.autograd.backward(losses, [torch.ones_like(t) for t in losses])
            if state["block"] >= 0:
                out[state["block"]] = max(out[state["block"]], probe.peak_bytes - state["entry"])
    return [max(0.0, b) for b in out]


class GraphProfile:
    """A captured graph measured once: blocks, per-node work, saved activations, parameters.

    Args:
        gm: the captured graph (at ``batch`` samples).
        inputs: the example inputs it was captured with.
        batch: samples in ``inputs`` (dim 0).
        cluster: where it will run (decides flash-attention accounting and the roofline).
        measured: profiled ``(forward_s, backward_s)`` per node name, when available.
        remeasure: the model measured again at the local batch a layout runs (`_Remeasure`:
            the same nodes' times, and the programs the tensor-parallel pass emits), or None:
            times at other batches are then ``measured`` scaled linearly, and tensor-parallel
            compute the original nodes' times, each sharded node's split ``tp`` ways.
    """

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[torch.Tensor], batch: int, cluster: Cluster,
                 measured: Mapping[str, tuple[float, float]] | None = None,
                 remeasure: _Remeasure | None = None):
        self.gm, self.batch, self.cluster = gm, batch, cluster
        self.device: DeviceSpec = cluster.device
        self.measured = dict(measured or {})
        self._remeasure = remeasure
        self._measured_at: dict[int, dict[str, tuple[float, float]]] = {batch: self.measured}
        self._programs: dict[tuple[int, bool, str, int], ProgramTimes] = {}
        #: the op-level planner's tensor-parallel layouts, by (tp, name) (`Planner.op_layouts`)
        self.tp_layouts: dict[tuple[int, str], OpLayout] = {}
        self._dry_runs: dict[tuple[int, bool, str], Any] = {}
        self.param_nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and meta.get(n, meta.ATTR_KIND, None) == "parameter"]
        self.tensors = {n.name: self._attr(n.target) for n in self.param_nodes}
        trainable = [n for n in self.param_nodes if self.tensors[n.name].requires_grad]
        if not trainable:
            raise PlanningError(
                f"{type(gm).__name__} captured from the model has no trainable parameters; there is "
                "nothing to parallelise (check requires_grad, or that the model's weights are nn.Parameters)"
            )
        dtypes = {self.tensors[n.name].dtype for n in trainable}
        self.param_dtype = max(dtypes, key=lambda d: torch.finfo(d).bits if d.is_floating_point else 0)
        self.compute_dtype = _DTYPE_KEYS.get(self.param_dtype, "fp32")
        if self.compute_dtype not in self.device.peak_tflops:
            self.compute_dtype = next(iter(self.device.peak_tflops))
        self.blocks = self._blocks()
        self.owner = {n.name: b for b in self.blocks for n in (*b.nodes, *b.params)}
        grad_nodes = grad_requiring_nodes(gm)
        self.work: dict[str, tuple[float, float, float, float]] = {}
        for node in gm.graph.nodes:
            if node.op == "call_function":
                f, b = node_flops(node, grad_nodes)
                weights = sum(_tensor_bytes(a.meta.get(meta.VAL)) for a in node.all_input_nodes if a.op == "get_attr")
                has_backward = b > 0 or any(a in grad_nodes for a in node.all_input_nodes)
                self.work[node.name] = (f, b, node_bytes(node) - weights, weights if has_backward else -weights)
        #: the graph with the interior of each run of identical layers cut out, or None
        self.condensed = condense(gm, [b.nodes for b in self.blocks], [b.signature for b in self.blocks])
        self.saved, working = self._simulate(inputs)
        self.backward_bytes = dict(zip((b.name for b in self.blocks), working))
        self.split_linears = set(default_split(gm, 2))
        # Mixture-of-Experts layers (what an ep axis would shard), by block; a model whose
        # grouped products expert parallelism cannot shard is planned without ep.
        try:
            regions = expert_regions(gm)
        except NotImplementedError as exc:
            log.info("planning without expert parallelism: %s", exc)
            regions = []
        self.experts: dict[str, list[ExpertRegion]] = defaultdict(list)
        for region in regions:
            self.experts[self.owner[region.products[0].name].name].append(region)
        self.expert_weights = {w.name for region in regions for w in region.weights}
        # ep must divide every layer's experts; expert_loads need one count for all layers
        self.num_experts = math.gcd(*(r.num_experts for r in regions)) if regions else 0
        self.uniform_experts = len({r.num_experts for r in regions}) <= 1

    def _graph_to_run(self) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node], dict[int, int]]:
        """The graph the fake-tensor runs and the tensor-parallel dry runs work on, each original
        node's node in it (itself, or its stand-in's), and each cut block's stand-in block: the
        condensed graph (`graphpass.repeats`), or the whole one where nothing is cut."""
        if self.condensed is None:
            return self.gm, {n: n for n in self.gm.graph.nodes}, {}
        return self.condensed.gm, self.condensed.node, self.condensed.stand_in

    def _simulate(self, inputs: Sequence[torch.Tensor]) -> tuple[dict[str, float], list[float]]:
        """The fake-tensor runs: bytes saved for backward per node, and each block's backward
        working set. A cut layer takes the figures of the layer standing in for it."""
        gm, node, stand_in = self._graph_to_run()
        kept = [i for i in range(len(self.blocks)) if i not in stand_in]
        blocks = [[node[n] for n in self.blocks[i].nodes] for i in kept]
        saved = _saved_bytes_by_node(gm, inputs, flash_attention=self.cluster.device.kind == "cuda")
        try:
            working = dict(zip(kept, _backward_bytes_by_block(gm, inputs, blocks)))
        except Exception as exc:  # noqa: BLE001 - an estimate must not stop planning; said loudly
            log.warning("the backward could not be simulated on fake tensors (%s: %s); predicted peaks "
                        "leave out backward's working sets (the loss's gradients)", type(exc).__name__, exc)
            working = {}
        by_node = {n.name: saved[c.name] for n, c in node.items() if c.name in saved}
        return by_node, [working.get(stand_in.get(i, i), 0.0) for i in range(len(self.blocks))]

    def _attr(self, target: str) -> torch.Tensor:
        path, _, name = target.rpartition(".")
        return getattr(self.gm.get_submodule(path), name)

    # ---- blocks

    def _blocks(self) -> list[_Block]:
        nodes = list(self.gm.graph.nodes)
        layered = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.meta.get(meta.LAYER) is not None]
        first, last = (layered[0], layered[-1]) if layered else (len(nodes), len(nodes))
        pre = _Block("pre", S.PRE, None, [], [])
        post = _Block("post", S.POST, None, [], [])
        layers: dict[int, _Block] = {}
        owner: dict[fx.Node, _Block] = {}
        current = pre
        for i, node in enumerate(nodes):
            if node.op != "call_function":
                continue
            layer = node.meta.get(meta.LAYER)
            if layer is not None:
                current = layers.setdefault(layer, _Block(f"layer {layer}", S.LAYER, layer, [], []))
            elif i > last:
                current = post
            elif i < first:
                current = pre
            current.nodes.append(node)
            owner[node] = current
        for param in self.param_nodes:
            users = [u for u in param.users if u in owner]
            (owner[users[0]] if users else pre).params.append(param)
        blocks = [b for b in (pre, *(layers[k] for k in sorted(layers)), post) if b.nodes or b.params]
        for block in blocks:
            members = set(block.nodes)
            inputs = {a for n in block.nodes for a in n.all_input_nodes if a not in members and a.op != "get_attr"}
            outputs = {n for n in block.nodes if any(u not in members and u.op != "output" for u in n.users)}
            block.input_bytes = sum(_tensor_bytes(a.meta.get(meta.VAL)) for a in inputs if _is_float_node(a))
            block.output_bytes = sum(_tensor_bytes(n.meta.get(meta.VAL)) for n in outputs if _is_float_node(n))
            block.signature = self._signature(block)
        return blocks

    def _signature(self, block: _Block) -> str:
        if block.kind != S.LAYER:
            return block.kind
        parts = [f"{op_base(n)}:{tuple(getattr(n.meta.get(meta.VAL), 'shape', ()))}" for n in block.nodes]
        parts += [f"p{tuple(self.tensors[p.name].shape)}" for p in block.params]
        return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]

    # ---- per layout

    def _check_tp_shares_compute(self, tp: int, runs_sharded) -> None:
        """Raise TensorParallelError when the layout shards too little of the compute to be
        tensor parallelism (see ``_MIN_TP_COMPUTE_SHARE``)."""
        total = sharded = 0.0
        for block in self.blocks:
            for node in block.nodes:
                seconds = sum(self._time(node.name, self.batch, 1))
                total += seconds
                sharded += seconds if runs_sharded(node) else 0.0
        if total > 0 and sharded < _MIN_TP_COMPUTE_SHARE * total:
            raise TensorParallelError(
                f"tp={tp} would shard only {sharded / total:.0%} of the compute (the layer pattern tensor "
                f"parallelism splits, linears feeding linears, covers little of this model); the rest "
                f"would run again on each of the {tp} tp ranks"
            )

    def _measured_for(self, batch: int) -> Mapping[str, tuple[float, float]]:
        if batch not in self._measured_at:
            self._measured_at[batch] = self._remeasure.times(batch) if self._remeasure else {}
        return self._measured_at[batch]

    def _program_times(self, tp: int, sequence_parallel: bool, name: str, batch: int) -> ProgramTimes:
        key = (tp, sequence_parallel, name, batch)
        if key not in self._programs:
            self._programs[key] = (self._remeasure.program(tp, sequence_parallel, batch, self.tp_layouts.get((tp, name)))
                                   if self._remeasure else ProgramTimes())
        return self._programs[key]

    def _time(self, name: str, batch: int, divide: float) -> tuple[float, float]:
        """(forward_s, backward_s) of one node at ``batch`` samples, its compute split ``divide``
        ways: measured at that batch where it was, else the captured batch's time scaled."""
        at_batch = self._measured_for(batch)
        if name in at_batch:
            f, b = at_batch[name]
            return f / divide, b / divide
        scale = batch / self.batch
        if name in self.measured:
            f, b = self.measured[name]
            return f * scale / divide, b * scale / divide
        flops_f, flops_b, act_bytes, weights = self.work[name]
        has_backward = weights >= 0
        weights = abs(weights) / divide
        peak = self.device.peak_tflops[self.compute_dtype] * 1e12 * self.device.compute_efficiency
        bandwidth = self.device.memory_bandwidth_gbps * 1e9 * self.device.memory_efficiency
        moved = act_bytes * scale / divide + weights
        forward = max(flops_f * scale / divide / peak, moved / bandwidth)
        backward = max(flops_b * scale / divide / peak, 2 * moved / bandwidth) if has_backward else 0.0
        return forward, backward

    def _tp_layout(self, tp: int, sequence_parallel: bool, name: str) -> tuple[dict[str, Any], list[EmittedCollective]]:
        """The tensor-parallel pass's dry run at ``tp`` (`passes.tensor_parallel.layout`) of the
        layout ``name`` (Megatron's, or one of ``tp_layouts``): each node's placement and the
        collectives it emits. The nodes of a cut layer take the placements and collectives of
        the layer standing in for it (each dry run once: the refusal too).

        Raises:
            TensorParallelError: the pass cannot apply the layout at ``tp``.
        """
        key = (tp, sequence_parallel, name)
        if key not in self._dry_runs:
            try:
                self._dry_runs[key] = self._dry_run(tp, sequence_parallel, name)
            except TensorParallelError as exc:
                self._dry_runs[key] = exc
        found = self._dry_runs[key]
        if isinstance(found, TensorParallelError):
            raise found
        return found

    def megatron_applies(self, tp: int) -> bool:
        """Whether the tensor-parallel pass can apply Megatron's layout at ``tp``."""
        try:
            self._tp_layout(tp, False, MEGATRON)
        except TensorParallelError:
            return False
        return True

    def _dry_run(self, tp: int, sequence_parallel: bool, name: str) -> tuple[dict[str, Any], list[EmittedCollective]]:
        gm, node, _ = self._graph_to_run()
        lay = tp_layout(gm, _tp_plan(gm, tp, sequence_parallel, self.tp_layouts.get((tp, name))))
        standing: dict[str, list[fx.Node]] = defaultdict(list)
        for n, c in node.items():
            standing[c.name].append(n)
        placements = {n.name: lay.placements[c.name] for n, c in node.items() if c.name in lay.placements}
        emitted = [c if n.name == c.anchor else replace(c, anchor=n.name, layer=n.meta.get(meta.LAYER, c.layer))
                   for c in lay.collectives for n in standing.get(c.anchor, ())]
        emitted += [c for c in lay.collectives if c.anchor not in standing]
        return placements, emitted

    def block_costs(self, tp: int, sequence_parallel: bool, batches: Sequence[int],
                    name: str = MEGATRON) -> list[S.BlockCost]:
        """The blocks under tensor-parallel layout ``(tp, sequence_parallel, name)``, with compute
        times at every local batch in ``batches``.

        Raises:
            TensorParallelError: the model cannot take this tp.
        """
        placements: Mapping[str, Any] = {}
        traffic: dict[str, list[tuple[str, str, float, bool]]] = defaultdict(list)
        copies: dict[str, list[tuple[str, float]]] = defaultdict(list)
        gathered: set[str] = set()
        if tp > 1:
            placements, emitted = self._tp_layout(tp, sequence_parallel, name)
            # A sharded value that the pass all-gathers for replicated consumers is saved by them
            # whole, as gathered; sequence parallelism's gathers into column linears are
            # re-gathered in backward instead (the runtime keeps the shard, as Megatron does).
            gathered = {c.anchor for c in emitted if c.op == "tp_all_gather" and c.grad != "reduce_scatter"}
            for c in emitted:
                block = self.owner.get(c.anchor, self.blocks[0])
                entry = transition(c.op, grad=c.grad)
                for move in entry.collectives:
                    traffic[block.name].append((move.phase, move.kind, float(move.factor * c.nbytes), move.blocking))
                copies[block.name] += [(phase, size) for phase, size, _ in entry.copied(float(c.nbytes), tp)]

        def placed(node: fx.Node, kinds: tuple[type, ...]) -> bool:
            p = placements.get(node.name)
            return isinstance(p, kinds) or (isinstance(p, list) and any(isinstance(q, kinds) for q in p))

        def runs_sharded(node: fx.Node) -> bool:
            """Computes on local shards: a sharded or partial output, or a sharded input (a partial
            input reaches the node through the all-reduce the pass inserts, so it is whole)."""
            return tp > 1 and (placed(node, (Shard, Partial)) or any(placed(a, (Shard,)) for a in node.all_input_nodes))

        def tp_share(param: fx.Node) -> int:
            """How many ways tensor parallelism shards ``param`` (1: replicated)."""
            return tp if isinstance(placements.get(param.name), Shard) else 1

        if tp > 1:
            self._check_tp_shares_compute(tp, runs_sharded)
        # Measured where the emitted program could be timed (its nodes at their local shapes, the
        # ops the pass adds charged to the block of the original node they come from); else, or
        # for a node the program does not keep, the original node's time split tp ways if sharded.
        programs = {b: self._program_times(tp, sequence_parallel, name, b) if tp > 1 else ProgramTimes() for b in batches}
        added = {b: defaultdict(lambda: (0.0, 0.0)) for b in batches}
        for b, program in programs.items():
            for anchor, (f, bw) in program.added.items():
                name = self.owner.get(anchor, self.blocks[0]).name
                added[b][name] = (added[b][name][0] + f, added[b][name][1] + bw)
        out = []
        for block in self.blocks:
            times = {}
            split_nodes = {n.name: (tp if runs_sharded(n) else 1) for n in block.nodes}
            for b in batches:
                fwd, bwd = added[b][block.name]
                for node in block.nodes:
                    own = programs[b].own.get(node.name)
                    f, bw = own if own is not None else self._time(node.name, b, split_nodes[node.name])
                    fwd += f
                    bwd += bw
                times[b] = (fwd, bwd)
            def saved_share(n: fx.Node) -> float:
                """What ``n`` saves on one rank: sharded with its output, or, for a reduction
                to a scalar over sharded inputs (the vocab-parallel loss), with those inputs."""
                sharded = (placed(n, (Shard,)) and n.name not in gathered) or (runs_sharded(n) and _is_scalar(n))
                return self.saved.get(n.name, 0.0) / (tp if tp > 1 and sharded else 1)

            saved = sum(saved_share(n) for n in block.nodes)
            if block.kind == S.PRE:  # inputs saved by the first ops (token ids)
                saved += sum(v for k, v in self.saved.items() if k not in self.work)
            params = param_bytes = split_bytes = expert_params = expert_bytes = 0.0
            split_count = tensors = 0
            for p in block.params:
                tensor = self.tensors[p.name]
                if not tensor.requires_grad:
                    continue
                tensors += 1
                params += tensor.numel() / tp_share(p)
                param_bytes += tensor.numel() * tensor.element_size() / tp_share(p)
                if p.name in self.expert_weights:
                    expert_params += tensor.numel() / tp_share(p)
                    expert_bytes += tensor.numel() * tensor.element_size() / tp_share(p)
            # The experts' compute (the share the slowest ep rank does more of) and exchanges.
            regions = self.experts.get(block.name, [])
            expert_nodes = [n for r in regions for n in r.nodes]
            expert_times = {}
            for b in batches:
                own = [programs[b].own.get(n.name) or self._time(n.name, b, split_nodes[n.name]) for n in expert_nodes]
                expert_times[b] = (sum(f for f, _ in own), sum(bw for _, bw in own))
            exchanges = tuple(
                (name, float(size)) for r in regions for name, size in (
                    ("ep token counts", 8.0 * r.num_experts), ("ep dispatch", _tensor_bytes(r.rows.meta[meta.VAL])),
                    ("ep combine", _tensor_bytes(r.out.meta[meta.VAL]))))
            for node in block.nodes:
                if node.name in self.split_linears:
                    split_bytes += self._split_weight_bytes(node)
                    split_count += 1
            ops = self._op_params(block, tp_share)
            # A weight gradient's other operand: the output gradient of each op reading a trainable
            # parameter (as big as the op's local output).
            trainable = {p.name for p in block.params if self.tensors[p.name].requires_grad}
            weight_grad = sum(
                _tensor_bytes(n.meta[meta.VAL]) / (tp if tp > 1 and placed(n, (Shard,)) else 1)
                for n in block.nodes if isinstance(n.meta.get(meta.VAL), torch.Tensor)
                and any(a.name in trainable for a in n.all_input_nodes))
            scale_io = 1 / tp if sequence_parallel and tp > 1 else 1.0
            # A backward's working set is the size of the activations it differentiates: sharded
            # as what they save is under this layout (the post block: its loss, whose input is
            # the logits; the vocab-parallel loss shards it by tp).
            losses = [n for n in block.nodes if _is_scalar(n) and self.saved.get(n.name)] if block is self.blocks[-1] else []
            differentiated = losses or block.nodes
            whole = sum(self.saved.get(n.name, 0.0) for n in differentiated)
            share = sum(saved_share(n) for n in differentiated)
            working = self.backward_bytes.get(block.name, 0.0) * (share / whole if whole > 0 else 1.0)
            out.append(S.BlockCost(
                name=block.name, kind=block.kind, signature=block.signature, layer=block.layer,
                params=params, param_bytes=param_bytes, split_bytes=split_bytes, split_count=split_count,
                times=times, saved_bytes=saved, input_bytes=block.input_bytes * scale_io,
                output_bytes=block.output_bytes * scale_io, tp_traffic=tuple(traffic.get(block.name, ())),
                tp_copies=tuple(copies.get(block.name, ())),
                backward_bytes=working, tensors=tensors, backward_starts_here=block is self.blocks[-1],
                weight_grad_bytes=weight_grad, expert_params=expert_params, expert_param_bytes=expert_bytes,
                num_experts=min((r.num_experts for r in regions), default=0), expert_times=expert_times,
                exchanges=exchanges, ops=ops,
            ))
        return out

    def _op_params(self, block: _Block, share: Callable[[fx.Node], int]) -> tuple[S.OpParams, ...]:
        """The block's dense trainable parameters grouped by the operator that reads each first
        (on one rank: ``share(p)`` ways tensor parallelism shards ``p``), largest first; a
        parameter no operator of the block reads is a group of its own."""
        members = set(block.nodes)
        groups: dict[fx.Node, list[fx.Node]] = {}
        for p in block.params:
            if not self.tensors[p.name].requires_grad or p.name in self.expert_weights:
                continue
            users = [u for u in p.users if u in members]
            groups.setdefault(users[0] if users else p, []).append(p)
        out = []
        for op, params in groups.items():
            elements = size = 0.0
            for p in params:
                tensor = self.tensors[p.name]
                elements += tensor.numel() / share(p)
                size += tensor.numel() * tensor.element_size() / share(p)
            split = self._split_weight_bytes(op) if op.name in self.split_linears else 0.0
            out.append(S.OpParams(op.name, tuple(p.name for p in params), elements, size, len(params), split))
        return tuple(sorted(out, key=lambda o: (-o.param_bytes, o.op)))

    def _split_weight_bytes(self, linear: fx.Node) -> float:
        """The bytes of the weight operator splitting cuts in ``linear`` (a splittable linear)."""
        weight = linear.args[1]
        return _tensor_bytes(self.tensors[weight.name]) if weight.name in self.tensors else 0.0


def _model_capacity(model: nn.Module) -> float | None:
    """The capacity factor the model's graphpass.nn.MoE layers share (None: dropless, or no
    such layer, or layers that differ: priced as dropless, an upper bound)."""
    from graphpass.nn.moe import MoE

    factors = {m.capacity_factor for m in model.modules() if isinstance(m, MoE) and getattr(m.gate, "token_choice", True)}
    return factors.pop() if len(factors) == 1 else None


def _capacity(model: nn.Module, profile: "GraphProfile", loads: tuple[float, ...] | None,
              candidates: Sequence[float | None] | None, max_dropped: float) -> tuple[float | str | None, str]:
    """``(Plan.capacity_factor, reason)``: ``"model"`` unless ``candidates`` ask the planner to
    choose (cost/experts.choose_capacity)."""
    from graphpass.cost.experts import choose_capacity, dropped
    from graphpass.nn.moe import MoE

    if candidates is None:
        return "model", ""
    if not isinstance(max_dropped, (int, float)) or isinstance(max_dropped, bool) or not 0 <= max_dropped < 1:
        raise ValueError(f"max_dropped must be a share in [0, 1), got {max_dropped!r}")
    candidates = list(candidates)
    if not candidates or any(cf is not None and not (isinstance(cf, (int, float)) and cf > 0) for cf in candidates):
        raise ValueError(f"capacity_factors must be positive numbers or None (dropless), got {candidates!r}")
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers or not profile.num_experts:
        raise ValueError(f"capacity_factors applies to graphpass.nn.MoE layers, and {type(model).__name__} has none")
    if any(not getattr(m.gate, "token_choice", True) for m in layers):
        raise ValueError("capacity_factors cannot be chosen for expert-choice gates (they have their own capacity)")
    chosen = choose_capacity(loads, candidates, max_dropped, profile.num_experts)
    share = dropped(loads, chosen, profile.num_experts)
    return chosen, (f"capacity factor {'dropless' if chosen is None else f'{chosen:g}'}: the smallest of "
                    f"{['dropless' if c is None else c for c in candidates]} whose predicted drops ({share:.1%} of "
                    f"the assignments, at least: capacity is per sequence) stay within max_dropped {max_dropped:.1%}")


def _check_loads(loads: Sequence[float] | None, profile: "GraphProfile") -> tuple[float, ...] | None:
    """``expert_loads`` as the cost model takes them: one non-negative share per expert of the
    model's layers, normalised."""
    if loads is None:
        return None
    loads = tuple(float(x) for x in loads)
    num_experts = profile.num_experts
    if not num_experts:
        raise ValueError("expert_loads is given, but the model has no Mixture-of-Experts layer the planner recognises")
    if not profile.uniform_experts:
        raise ValueError("expert_loads gives one share per expert, but the model's MoE layers have different numbers "
                         "of experts; plan without expert_loads")
    if len(loads) != num_experts or any(x < 0 for x in loads) or not sum(loads) > 0:
        raise ValueError(f"expert_loads must be {num_experts} non-negative shares (one per expert of a layer), "
                         f"not all zero; got {len(loads)} values")
    return tuple(x / sum(loads) for x in loads)


def _is_scalar(node: fx.Node) -> bool:
    val = node.meta.get(meta.VAL)
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _is_float_node(node: fx.Node) -> bool:
    val = node.meta.get(meta.VAL)
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _tp_plan(gm: fx.GraphModule, tp: int, sequence_parallel: bool, op_layout: OpLayout | None = None) -> Plan:
    strategy = Strategy(dp=1, tp=tp, sequence_parallel=sequence_parallel)
    return plan_from_choices(gm, strategy.mesh, strategy.choice, sequence_parallel=sequence_parallel, strategy=strategy,
                             tp_layout=(op_layout.placements, op_layout.parts) if op_layout is not None else None)


# ------------------------------------------------------------------------------------- search


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


def _check_together(cluster: Cluster, measure_ops: bool) -> None:
    """``measure_together`` needs ``measure_ops`` and a running job of the cluster's ranks on this
    machine: every rank must build the Planner (the timings are collectives)."""
    if not measure_ops:
        raise ValueError("Planner(measure_together=True) times the measured ops on every rank; pass measure_ops=True too")
    if not cluster.name.startswith("local"):
        raise ValueError(f"Planner(measure_together=True) measures this machine, but the cluster is {cluster.name!r}; "
                         "pass Cluster.local()")
    running = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if running != cluster.world_size:
        raise ValueError(
            f"Planner(measure_together=True) runs on every rank of a running job of the cluster's "
            f"{cluster.world_size} ranks, but " + ("no process group is initialised" if running is None
                                                   else f"the running group has {running}")
            + "; call it on every rank under torchrun or graphpass.launch, or drop measure_together")


def _costing(profile: GraphProfile, cluster: Cluster, batch: int, budget: float, optimizer_states: int,
             measure: bool = False, together: bool = False) -> S.Costing:
    param_bytes = torch.finfo(profile.param_dtype).bits // 8
    # fp32 training: gradients in fp32, optimizer states in fp32 (the weights are their own master
    # copy). 16-bit weights: mixed precision, gradients in 16 bits, an fp32 master copy plus fp32
    # states (ZeRO's K = 12 for Adam).
    master = 4 if param_bytes < 4 else 0
    per_element, per_tensor = None, 0.0
    if measure and cluster.name.startswith("local"):
        from graphpass.cost import profiler

        shapes = [profile.tensors[n.name].shape for n in profile.param_nodes if profile.tensors[n.name].requires_grad]
        contention = _contention(cluster, memory_bound=True, together=together)
        per_element, per_tensor = (
            t * contention
            for t in profiler.optimizer_step_times(shapes, profile.param_dtype, optimizer_states, cluster.device.kind,
                                                   together=together))
    return S.Costing(
        cluster=cluster,
        batch=batch,
        memory_limit_bytes=float(budget),
        grad_bytes_per_param=float(param_bytes),
        optimizer_bytes_per_param=float(master + 4 * optimizer_states),
        # NCCL runs on its own streams and hides behind compute; gloo on CPU ranks competes with
        # compute for the same cores, so nothing is assumed hidden there.
        overlap=1.0 if cluster.device.kind == "cuda" else 0.0,
        optimizer_s_per_param=per_element,
        optimizer_s_per_tensor=per_tensor,
        # The profile's probe, even where the op times were measured together: they hold the
        # host's contention without saying how much of them it is.
        host_contention=_contention(cluster),
        host_oversubscription=_oversubscription(cluster),
    )


class Planner:
    """One model on one cluster, measured once; :meth:`auto` searches, :meth:`price` prices a
    uniform strategy. ``graphpass.plan`` is ``Planner(...).auto()`` or ``.price(strategy)``;
    benchmarks that price many strategies of one model keep the Planner.

    Args: as :func:`plan`, plus ``measure_ops``: on a local cluster, time every op of the graph
    that the profiler's cache lacks on this machine (:func:`graphpass.cost.profiler.node_times`)
    instead of pricing it by the roofline; and ``measure_together`` (with ``measure_ops``): every
    rank of a running job of the cluster's world size builds this Planner at once, with the same
    arguments, and the whole graph at each local batch and the optimizer step are timed on all
    ranks together (:func:`graphpass.cost.profiler.together_median_s`), so the ranks' contention
    for the host is measured on the model's own work instead of taken from the profile's probes
    (`DeviceSpec.contention`); ops are timed alone by rank 0 and shared, so every rank gets the
    same plan.
    """

    def __init__(
        self,
        model: nn.Module,
        cluster: Cluster | str,
        example_inputs: Sequence[torch.Tensor],
        memory_budget: int | float | str | None = None,
        *,
        optimizer_states: int = _ADAM_STATES,
        measure_ops: bool = False,
        measure_together: bool = False,
        expert_loads: Sequence[float] | None = None,
        capacity_factors: Sequence[float | None] | None = None,
        max_dropped: float = 0.0,
        loss_fn: Callable | None = None,
    ):
        start = time.perf_counter()
        self.cluster = resolve_cluster(cluster)
        if measure_together:
            _check_together(self.cluster, measure_ops)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        batch = Batch.of(example_inputs)
        inputs, model = batch.tensors, adapt(model, batch, loss_fn)
        if not inputs or inputs[0].dim() == 0:
            raise ValueError("example_inputs[0] must have a batch dimension (dim 0)")
        self.budget = (
            parse_memory(memory_budget) if memory_budget is not None
            else int(self.cluster.device.memory_bytes * DEFAULT_MEMORY_FRACTION)
        )
        if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
            raise ValueError(f"optimizer_states must be an int >= 0, got {optimizer_states!r}")
        if not any(p.requires_grad for p in model.parameters()):
            raise PlanningError(
                f"{type(model).__name__} has no trainable parameters (model.parameters() is empty or "
                "frozen); there is nothing to parallelise"
            )
        self.batch = int(inputs[0].shape[0])
        captured = capture(model, inputs)
        times, factor = _op_times(captured.gm, self.cluster, measure_ops, inputs, measure_together)
        remeasure = (_Remeasure(model, inputs, captured.gm, self.cluster, factor, measure_together)
                     if measure_ops else None)
        self.profile = GraphProfile(captured.gm, inputs, self.batch, self.cluster, times, remeasure)
        loads = _check_loads(expert_loads, self.profile)
        self.capacity_factor, self._capacity_reason = _capacity(model, self.profile, loads, capacity_factors,
                                                                max_dropped)
        # the capacity priced: the plan's choice, else the model's own (where it has one)
        capacity = _model_capacity(model) if self.capacity_factor == "model" else self.capacity_factor
        self.costing = replace(_costing(self.profile, self.cluster, self.batch, self.budget, optimizer_states,
                                        measure_ops, measure_together),
                               expert_loads=loads, capacity_factor=capacity)
        self._layouts: dict[tuple[int, bool, str], list[S.BlockCost]] = {}
        self._batches: dict[tuple[int, bool, str], set[int]] = defaultdict(set)
        self._rejected: dict[int, str] = {}  # tp degrees Megatron's layout cannot take, and why
        self._rejected_op: dict[tuple[int, bool, str], str] = {}  # op-level layouts the pass refused
        self._op_layouts: dict[int, list[OpLayout]] = {}
        self.measure_s = time.perf_counter() - start

    def blocks(self, layout: S.Layout) -> list[S.BlockCost] | None:
        """Block costs for ``layout``'s tensor parallelism (None when the model cannot take its tp)."""
        return self._ensure([layout]).get(layout.key)

    def _ensure(self, layouts: Sequence[S.Layout]) -> dict[tuple[int, bool, str], list[S.BlockCost]]:
        wanted: dict[tuple[int, bool, str], set[int]] = defaultdict(set)
        for layout in layouts:
            wanted[layout.key].add(S.local_batch(layout, self.batch))
        for key, batches in wanted.items():
            tp, sequence_parallel, name = key
            refused = tp in self._rejected if name == MEGATRON else key in self._rejected_op
            if refused or (key in self._layouts and batches <= self._batches[key]):
                continue
            self._batches[key] |= batches
            try:
                self._layouts[key] = self.profile.block_costs(tp, sequence_parallel, sorted(self._batches[key]), name)
            except TensorParallelError as exc:
                if name == MEGATRON:
                    self._rejected[tp] = str(exc)
                else:
                    self._rejected_op[key] = str(exc)
                    log.info("tp=%d %s layout not planned: %s", tp, name, exc)
        return self._layouts

    def op_layouts(self, tp: int) -> list[OpLayout]:
        """The op-level planner's tensor-parallel layouts at ``tp`` (`graphpass.op_placement`):
        the projections Megatron's pattern leaves replicated placed by the op-level solver, its
        terms priced at the local batch of a ``tp`` x dp mesh by the transition table and this
        Planner's costing. Each is registered with the profile under its name, for the mesh
        search to price exactly (``Layout.tp_layout``)."""
        if tp not in self._op_layouts:
            world = self.cluster.world_size
            mesh = S.Layout.of(1, world // tp, tp)
            scale = tp / world  # the local batch of that mesh over the captured one
            element = self.profile.tensors[self.profile.param_nodes[0].name].element_size() if self.profile.param_nodes else 4
            prices = Prices(
                compute_s=lambda node: sum(self.profile._time(node.name, self.batch, 1)) * scale,
                transition_s=lambda name, size, grad: S.transition_s(name, size, mesh, self.costing, grad),
                batch_scale=scale,
                state_bytes_per_element=element + self.costing.grad_bytes_per_param + self.costing.optimizer_bytes_per_param,
            )
            found = op_layouts(self.profile.gm, tp, prices, self.profile.megatron_applies(tp))
            self.profile.tp_layouts.update(((tp, lay.name), lay) for lay in found)
            self._op_layouts[tp] = found
        return self._op_layouts[tp]

    def _with_budget(self, memory_budget: int | float | str | None) -> tuple[int, S.Costing]:
        if memory_budget is None:
            return self.budget, self.costing
        budget = parse_memory(memory_budget)
        return budget, replace(self.costing, memory_limit_bytes=float(budget))

    def price(self, strategy: Strategy, memory_budget: int | float | str | None = None, *,
              choices: Sequence[Choice] | None = None) -> Plan:
        """The plan of a uniform ``strategy``, priced; a reason line says when it does not fit
        ``memory_budget`` (default: the Planner's). ``choices``: one :class:`Choice` per block
        (``Planner.profile.blocks``, in order) instead of the strategy's for all of them, e.g.
        per-operator ones (``Choice(3, large_ops=2, rest_zero=1)``)."""
        start = time.perf_counter()
        budget, costing = self._with_budget(memory_budget)
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a graphpass.Strategy, got {type(strategy).__name__}")
        strategy.check(self.cluster.world_size)
        layout = S.Layout(strategy.mesh, strategy.microbatches, strategy.sequence_parallel, strategy.schedule,
                          strategy.virtual_stages)
        if self.batch % (strategy.dp * strategy.microbatches):
            raise ValueError(
                f"the global batch of {self.batch} samples does not split into dp={strategy.dp} x "
                f"microbatches={strategy.microbatches}; choose degrees dividing it"
            )
        blocks = self.blocks(layout)
        if blocks is None:
            raise ValueError(self._rejected[strategy.tp])
        given = choices is not None
        if choices is None:
            choices = S.uniform_choices(blocks, strategy.choice)
        elif len(choices) != len(blocks) or not all(isinstance(c, Choice) for c in choices):
            raise ValueError(f"choices must be one graphpass.plan.Choice per block ({len(blocks)}: "
                             f"{', '.join(b.name for b in blocks)}), got {len(choices)} entries")
        cand = S.evaluate(blocks, layout, list(choices), costing,
                          self._even_stages(strategy) if layout.num_stages > 1 else None)
        if cand is None:
            raise ValueError(
                f"Strategy pp={strategy.pp} needs at least {strategy.pp} blocks; the model has {len(self.profile.blocks)}"
            )
        reasons = [f"{'per-block choices' if given else 'uniform strategy'} priced as given: {strategy}"]
        if cand.peak_memory_bytes > budget:
            reasons.append(
                f"does NOT fit: predicted peak {cand.peak_memory_bytes / 2**30:.2f} GiB > budget "
                f"{budget / 2**30:.2f} GiB"
            )
        return _to_plan(self.profile, blocks, cand, costing, strategy, reasons, start,
                        (self.capacity_factor, self._capacity_reason))

    def _even_stages(self, strategy: Strategy) -> list[list[int]]:
        """The blocks of each stage of the cut ``compile`` makes for a uniform Strategy (the
        layers split evenly, :func:`~graphpass.plan_builder.uniform_stages`)."""
        starts = uniform_stages(self.profile.gm, strategy.pp, strategy)
        stages = len(starts)
        first = [next(i for i, b in enumerate(self.profile.blocks) if any(n.name == start for n in b.nodes))
                 for start in starts[1:]]
        bounds = [0, *first, len(self.profile.blocks)]
        return [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]

    def auto(self, time_limit_s: float | None = None, memory_budget: int | float | str | None = None,
             per_operator: bool = True) -> Plan:
        """Search every mesh and per-block choice; the fastest plan that fits ``memory_budget``
        (default: the Planner's). With ``per_operator`` (the default) a block may also shard its
        largest operators' parameters at a higher ZeRO stage than the rest (OSDP,
        :attr:`graphpass.plan.Choice.large_ops`), and tensor parallelism may shard the
        projections Megatron's pattern leaves replicated, as the op-level solver places them
        (:meth:`op_layouts`); ``False`` gives the per-block plan, a subset of the same options.

        Raises:
            graphpass.cost.search.NoPlanError: nothing fits the budget.
        """
        if time_limit_s is not None and not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0):
            raise ValueError(f"time_limit_s must be a positive number of seconds or None, got {time_limit_s!r}")
        start = time.perf_counter()
        mesh_list = S.meshes(self.cluster, self.batch, _TP_DEGREES, len(self.profile.blocks), self.profile.num_experts)
        if not mesh_list:
            raise ValueError(
                f"no mesh of {self.cluster.world_size} devices divides the global batch of {self.batch} "
                "samples (dp must divide it); use a batch that is a multiple of the data-parallel degree"
            )
        # The op-level planner's tp layouts beside Megatron's, without sequence parallelism (its
        # norms on sequence shards are Megatron's pattern); per-operator choices, so the
        # per-block plan leaves them out.
        if per_operator:
            mesh_list += [replace(m, tp_layout=lay.name) for m in mesh_list if m.mesh.tp > 1 and not m.sequence_parallel
                          for lay in self.op_layouts(m.mesh.tp)]
        layouts = self._ensure(mesh_list)
        usable = [m for m in mesh_list if m.key in layouts]
        _, costing = self._with_budget(memory_budget)
        best, found, infeasible, pruned = S.search(layouts, usable, costing, time_limit_s, per_operator)
        alternatives = _alternatives(best, found, infeasible)
        reasons = _reasons(best, found, alternatives, len(infeasible), self._rejected, costing, len(usable),
                           self.measure_s, pruned)
        return _to_plan(self.profile, layouts[best.layout.key], best, costing,
                        None, reasons, start - self.measure_s, (self.capacity_factor, self._capacity_reason),
                        alternatives)


def plan(
    model: nn.Module,
    cluster: Cluster | str,
    example_inputs: Sequence[torch.Tensor],
    strategy: str | Strategy = "auto",
    memory_budget: int | float | str | None = None,
    time_limit_s: float | None = None,
    *,
    optimizer_states: int = _ADAM_STATES,
    expert_loads: Sequence[float] | None = None,
    capacity_factors: Sequence[float | None] | None = None,
    max_dropped: float = 0.0,
    loss_fn: Callable | None = None,
) -> Plan:
    """Choose (``strategy="auto"``) or price (``strategy=Strategy(...)``) a parallel plan.

    Args:
        model: the single-device model; meta-device parameters are fine (nothing is allocated).
        cluster: a :class:`Cluster`, or a preset name (``"h100-80g"``, ``"a100-80g:16x8"`` for
            16 nodes of 8).
        example_inputs: one *global* batch (meta tensors are fine); dim 0 is the batch.
        strategy: ``"auto"`` to search, or a uniform :class:`Strategy` to price.
        memory_budget: per-device bytes (or ``"70GiB"``); default 90% of the device's memory.
        time_limit_s: stop searching after this long and keep the best plan found.
        optimizer_states: fp32 states per parameter (2 for Adam/AdamW, 1 for SGD with momentum).
        expert_loads: for a Mixture-of-Experts model, the share of routed tokens each expert of
            a layer receives (measured counts, or ``graphpass.cost.experts.zipf_loads(E, skew)``);
            default balanced. Under expert parallelism the rank with the hottest experts sets
            the pace (``docs/moe.md``).
        capacity_factors: let the planner choose the capacity factor of the model's
            ``graphpass.nn.MoE`` layers among these (None: dropless): the smallest whose
            predicted drops under ``expert_loads`` stay within ``max_dropped`` (a share of the
            assignments). It changes what the model computes, so it is chosen only when asked;
            ``compile`` applies ``Plan.capacity_factor`` to the layers.
        max_dropped: the drop budget for ``capacity_factors`` (default 0: no drops predicted).
        loss_fn: as for :func:`graphpass.compile` (``example_inputs`` may be a dict there too).

    Returns:
        a :class:`Plan` with ``predicted_step_time_s``, ``predicted_peak_memory_bytes``, a
        per-block ``breakdown`` and ``reasons``.

    Raises:
        ValueError: unknown preset, unparsable budget, a batch no mesh divides, a bad strategy.
        NotImplementedError: a Strategy field graphpass does not run yet (a zero-bubble schedule).
        PlanningError: a model without trainable parameters.
        graphpass.cost.search.NoPlanError: nothing fits the budget (the message gives the
            smallest peak any plan reaches).
    """
    if not isinstance(strategy, Strategy) and strategy != "auto":
        raise ValueError(f"strategy must be 'auto' or a graphpass.Strategy, got {strategy!r}")
    planner = Planner(model, cluster, example_inputs, memory_budget,
                      optimizer_states=optimizer_states, expert_loads=expert_loads,
                      capacity_factors=capacity_factors, max_dropped=max_dropped, loss_fn=loss_fn)
    return planner.price(strategy) if isinstance(strategy, Strategy) else planner.auto(time_limit_s)


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


def _reasons(best: S.Candidate, found: list[S.Candidate], alternatives: Sequence[Mapping[str, Any]],
             infeasible: int, rejected: Mapping[int, str], costing: S.Costing, tried: int,
             measure_s: float, pruned: int = 0) -> list[str]:
    lines = [
        f"searched {tried} meshes (pp x dp x tp x microbatches x sequence-parallel"
        + (" x ep" if any(c.layout.mesh.ep > 1 for c in found) else "") + ") under a "
        f"{costing.memory_limit_bytes / 2**30:.2f} GiB per-device budget; {len(found)} fit"
        + (f"; {pruned} not solved, their step floor (fastest choices, no bubble beyond the "
           "schedule's) already slower than a plan found" if pruned else ""),
        f"chosen {best.layout}: predicted step {best.step_time_s * 1e3:.2f} ms, peak "
        f"{best.peak_memory_bytes / 2**30:.2f} GiB ({best.how}"
        + ("" if best.optimal else f", gap {best.gap:.1%}") + ")",
    ]
    if best.uniform:
        # Why not the textbook strategy on the same mesh (e.g. ZeRO-2 over pure data parallel:
        # the same traffic, and each rank steps the optimizer on 1/dp of the parameters).
        lines.append(
            "same mesh, uniform: "
            + "; ".join(
                f"{label} {t * 1e3:.2f} ms ({t / best.step_time_s:.2f}x), peak {peak / 2**30:.2f} GiB"
                + ("" if peak <= costing.memory_limit_bytes else " (over budget)")
                for label, t, peak in best.uniform
            )
        )
    for alt in alternatives:
        if alt["step_time_s"] is not None:
            lines.append(f"runner-up {alt['layout']}: {alt['step_time_s'] * 1e3:.2f} ms "
                         f"({alt['step_time_s'] / best.step_time_s:.2f}x), peak {alt['peak_bytes'] / 2**30:.2f} GiB")
    if infeasible:
        lines.append(f"{infeasible} meshes cannot fit the budget, e.g. " + ", ".join(
            f"{alt['layout']} needs >= {alt['peak_bytes'] / 2**30:.2f} GiB"
            for alt in alternatives if alt["step_time_s"] is None))
    for tp, why in sorted(rejected.items()):
        lines.append(f"tp={tp} with Megatron's layout not possible: {why}")
    if best.exposed_comm_s > 0:
        lines.append(f"data-parallel communication not hidden behind compute: {best.exposed_comm_s * 1e3:.2f} ms per step")
    lines.append(f"measuring the graph took {measure_s:.1f} s")
    return lines


def _alternatives(best: S.Candidate, found: list[S.Candidate], infeasible: Mapping[str, float]) -> list[dict]:
    """The runner-up meshes (the next three by step time) and the closest ones that do not fit,
    each with why it lost (``Plan.alternatives``)."""
    out = [{"layout": str(c.layout), "step_time_s": c.step_time_s, "peak_bytes": int(c.peak_memory_bytes),
            "why": f"{c.step_time_s / best.step_time_s:.2f}x slower"} for c in found[1:4]]
    out += [{"layout": mesh, "step_time_s": None, "peak_bytes": int(need), "why": "does not fit the budget"}
            for mesh, need in sorted(infeasible.items(), key=lambda kv: kv[1])[:2]]
    return out


def _to_plan(profile: GraphProfile, blocks: Sequence[S.BlockCost], cand: S.Candidate, costing: S.Costing,
             strategy: Strategy | None, reasons: list[str], start: float,
             capacity: tuple[float | str | None, str] = ("model", ""), alternatives: Sequence[dict] = ()) -> Plan:
    capacity_factor, capacity_reason = capacity
    layout = cand.layout
    mesh = layout.mesh
    choices = {}
    for gblock, block, choice in zip(profile.blocks, blocks, cand.choices):
        choices.update((n.name, choice) for n in (*gblock.nodes, *gblock.params))
        for op in block.ops[choice.large_ops:] if choice.mixed else ():  # the rest's stage, unsplit
            choices.update((name, choice.rest()) for name in (op.op, *op.params))
    # Stage s starts at its first block's first op (the first stage at the graph's start).
    stages = ("*", *(profile.blocks[stage[0]].nodes[0].name for stage in cand.stages[1:]))
    breakdown = []
    for s, indices in enumerate(cand.stages):
        for i in indices:
            pr, block = cand.priced[i], blocks[i]
            breakdown.append({
                "block": block.name, "stage": s, "choice": str(cand.choices[i]),
                "time_s": pr.time_s * layout.microbatches, "tp_comm_s": pr.tp_comm_s * layout.microbatches,
                "dp_comm_s": pr.dp_comm_s, "state_bytes": pr.state_bytes, "activation_bytes": pr.act_bytes,
                "transient_bytes": pr.transient_bytes, "grad_bytes": pr.grad_bytes, "held_bytes": pr.held_bytes,
                "loss_backward_bytes": pr.start_bytes,
            })
    reasons = list(reasons) + ([capacity_reason] if capacity_reason else [])
    reasons.append(f"planned in {time.perf_counter() - start:.1f} s")
    # The step on the slowest pp rank: its microbatches' compute and tp collectives, then the
    # tail (exposed dp communication, optimizer); the rest of the step is the pipeline bubble.
    m, slowest = layout.microbatches, max(range(len(cand.stage_times_s)), key=lambda r: cand.stage_times_s[r])
    work = m * cand.stage_times_s[slowest]
    tp = sum(cand.priced[i].tp_comm_s for s, indices in enumerate(cand.stages)
             if layout.rank_of(s) == slowest for i in indices) * m
    bubble = max(0.0, cand.step_time_s - work - cand.tail_s)
    tp = min(tp, work)
    time_split = {"compute": max(0.0, cand.step_time_s - tp - cand.tail_s - bubble), "tp_comm": tp,
                  "dp_comm_exposed": cand.exposed_comm_s, "optimizer": max(0.0, cand.tail_s - cand.exposed_comm_s),
                  "bubble": bubble}
    op_layout = profile.tp_layouts.get((mesh.tp, layout.tp_layout))
    if op_layout is not None:
        reasons.insert(1, f"tensor-parallel layout: {op_layout.name} (the op-level solver placed the projections "
                          f"Megatron's pattern leaves replicated: {op_layout.describe()})")
    base = plan_from_choices(profile.gm, mesh, choices, sequence_parallel=layout.sequence_parallel,
                             microbatches=layout.microbatches, strategy=strategy, reasons=reasons,
                             tp_layout=(op_layout.placements, op_layout.parts) if op_layout is not None else None)
    return replace(
        base,
        stages=stages,
        predicted_step_time_s=cand.step_time_s,
        predicted_peak_memory_bytes=int(cand.peak_memory_bytes),
        predicted_stage_peaks_bytes=tuple(int(p) for p in cand.stage_peaks_bytes),
        schedule=layout.schedule,
        ep_all_to_all=S.ep_all_to_all(blocks, layout, costing),
        capacity_factor=capacity_factor,
        breakdown=tuple(breakdown),
        time_split_s=time_split,
        memory_budget_bytes=int(costing.memory_limit_bytes),
        devices_per_node=costing.cluster.devices_per_node,
        alternatives=tuple(alternatives),
    )
