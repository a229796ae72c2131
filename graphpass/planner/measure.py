"""The graph measured once (:class:`GraphProfile`): blocks, per-node work and times, the
activations autograd saves, and each block's cost under a tensor-parallel layout.

- **Blocks**: the segment before the first repeated layer, each repeated layer, the segment
  after the last (``_Block``), with their parameters and the bytes crossing their borders.
- **Work and times**: per node, FLOPs and bytes (priced by the roofline), or profiled
  ``(forward_s, backward_s)`` where the cluster is this machine (`graphpass.planner.remeasure`).
- **Memory**: the bytes autograd saves for backward, measured by running the graph on fake
  tensors under ``saved_tensors_hooks`` and counting each storage once, attributed to the node
  that produced it (`_saved_bytes_by_node`); each block's backward working set, from a memory
  probe over backward on fake tensors (`_backward_bytes_by_block`). A run of identical layers
  is measured on its condensed graph (`graphpass.repeats`).
- **Per tensor-parallel layout** (:meth:`GraphProfile.block_costs`): the ``tensor_parallel``
  pass dry-run on the graph; every node whose input or output it shards runs 1/tp of its
  compute and saves 1/tp of its activations, parameters it shards hold 1/tp, and the
  collectives it emits are priced by the transition table (``graphpass.transitions``). This
  part reads nearly every figure above, so it stays a method of the profile.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor.placement_types import Partial, Shard
from torch.multiprocessing.reductions import StorageWeakRef

from graphpass import meta
from graphpass.tables import LOOKUPS
from graphpass.grads import grad_requiring_nodes
from graphpass.cluster import Cluster, DeviceSpec
from graphpass.cost import search as S
from graphpass.cost.compute import node_bytes, node_flops
from graphpass.experts import ExpertRegion, expert_regions
from graphpass.splittable import default_split
from graphpass.passes.tensor_parallel import EmittedCollective, TensorParallelError, layout as tp_layout
from graphpass.ops import op_base
from graphpass.repeats import condense
from graphpass.transitions import TABLE
from graphpass.planner.op_placement import MEGATRON, OpLayout
from graphpass.planner.remeasure import ProgramTimes, _Remeasure, _tp_plan

log = logging.getLogger(__name__)

#: A tensor-parallel layout is offered only when at least this share of the model's compute
#: (forward + backward time at tp=1) runs on shards. Below it, most work is repeated on every
#: tp rank: a ResNet under tp=2 shards only its classifier and runs every convolution twice.
#: Such a mesh can still be priced faster than dp where gradients are slow to all-reduce, but
#: it is one device's work on tp devices; dp, ZeRO or pipeline stages use them instead.
_MIN_TP_COMPUTE_SHARE = 0.5
_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

#: the bag lookups (nn.EmbeddingBag): they read their ids' rows, never the whole table
_BAG_LOOKUPS = LOOKUPS - {torch.ops.aten.embedding.default}


class PlanningError(ValueError):
    """The inputs cannot be planned (a model without parameters, a bad budget or cluster)."""


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
        #: embedding tables the plan shards with sparse gradients (cost.search.tables prices them,
        #: not the blocks' dense parameters); set by the Planner before any block is priced
        self.sparse_tables: frozenset[str] = frozenset()
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
        #: per op: forward and backward FLOPs, bytes that scale with the batch, bytes of the
        #: weights it reads whole (a bag lookup reads only its ids' rows: they scale with the
        #: batch, in its node bytes; a plain embedding is still priced as reading its table, as
        #: the plans the offload tests pin were made with), and whether it has a backward
        self.work: dict[str, tuple[float, float, float, float, bool]] = {}
        for node in gm.graph.nodes:
            if node.op == "call_function":
                f, b = node_flops(node, grad_nodes)
                weights = 0.0 if node.target in _BAG_LOOKUPS else sum(
                    _tensor_bytes(a.meta.get(meta.VAL)) for a in node.all_input_nodes if a.op == "get_attr")
                has_backward = b > 0 or any(a in grad_nodes for a in node.all_input_nodes)
                self.work[node.name] = (f, b, node_bytes(node) - weights, weights, has_backward)
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
        flops_f, flops_b, act_bytes, weights, has_backward = self.work[name]
        weights = weights / divide
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
            gathered = {c.anchor for c in emitted if c.transition == "tp Shard -> Replicate"}
            for c in emitted:
                block = self.owner.get(c.anchor, self.blocks[0])
                entry, size = TABLE[c.transition], c.size_bytes
                traffic[block.name] += [(move.phase, move.kind, moved, move.blocking)
                                        for move, moved in entry.movements(size, tp)]
                copies[block.name] += [(phase, copied) for phase, copied, _ in entry.copied(size, tp)]

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
        held_buffers: set[str] = set()  # a buffer several blocks read is held once, by the first
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
            shapes = []
            # frozen parameters and the buffers the block reads first: held, never synchronised
            buffers = {a.target: a for n in block.nodes for a in n.all_input_nodes
                       if a.op == "get_attr" and meta.get(a, meta.ATTR_KIND, None) == "buffer"
                       and a.target not in held_buffers}
            held_buffers.update(buffers)
            frozen = sum(_tensor_bytes(b.meta.get(meta.VAL)) for b in buffers.values())
            for p in block.params:
                tensor = self.tensors[p.name]
                if not tensor.requires_grad and p.name not in self.sparse_tables:
                    frozen += tensor.numel() * tensor.element_size() / tp_share(p)
                if not tensor.requires_grad or p.name in self.sparse_tables:
                    continue
                tensors += 1
                if p.name not in self.expert_weights:
                    shapes.append(tuple(int(s) for s in tensor.shape))
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
            # S of each exchange: the count per expert (int64), the rows sent, the rows sent back
            exchanges = tuple(
                (name, TABLE[name].size_bytes(shape, dtype)) for r in regions for name, (shape, dtype) in (
                    ("ep token counts", ((r.num_experts,), torch.int64)),
                    ("ep dispatch", (r.rows.meta[meta.VAL].shape, r.rows.meta[meta.VAL].dtype)),
                    ("ep combine", (r.out.meta[meta.VAL].shape, r.out.meta[meta.VAL].dtype))))
            for node in block.nodes:
                if node.name in self.split_linears:
                    split_bytes += self._split_weight_bytes(node)
                    split_count += 1
            ops = self._op_params(block, tp_share)
            # A weight gradient's other operand: the output gradient of each op reading a trainable
            # parameter (as big as the op's local output).
            trainable = {p.name for p in block.params if self.tensors[p.name].requires_grad
                         and p.name not in self.sparse_tables}
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
                exchanges=exchanges, ops=ops, param_shapes=tuple(shapes), frozen_bytes=frozen,
            ))
        return out

    def _op_params(self, block: _Block, share: Callable[[fx.Node], int]) -> tuple[S.OpParams, ...]:
        """The block's dense trainable parameters grouped by the operator that reads each first
        (on one rank: ``share(p)`` ways tensor parallelism shards ``p``), largest first; a
        parameter no operator of the block reads is a group of its own."""
        members = set(block.nodes)
        groups: dict[fx.Node, list[fx.Node]] = {}
        for p in block.params:
            if not self.tensors[p.name].requires_grad or p.name in self.expert_weights or p.name in self.sparse_tables:
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


def _is_scalar(node: fx.Node) -> bool:
    val = node.meta.get(meta.VAL)
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _is_float_node(node: fx.Node) -> bool:
    val = node.meta.get(meta.VAL)
    return isinstance(val, torch.Tensor) and val.is_floating_point()
