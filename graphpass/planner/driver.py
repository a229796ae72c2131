"""The planner's driver: :class:`Planner` (one model on one cluster, measured once; ``auto``
searches, ``price`` prices a uniform strategy) and :func:`plan`, with the checks of their
arguments (`parse_memory`, `resolve_cluster`, ``expert_loads`` and ``capacity_factors``) and
the costing the search prices with (`_costing`: gradient and optimizer bytes, the optimizer
step's measured times, the host's contention).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from graphpass import batching
from graphpass.capture import capture
from graphpass.model_io import Batch, adapt
from graphpass.cluster import Cluster
from graphpass.cost import search as S
from graphpass.cost.collectives import collective_time
from graphpass.cost.search import tables as T
from graphpass.cost.search.tables import TableChoices
from graphpass.passes.tensor_parallel import TensorParallelError
from graphpass.compression import GradCompression
from graphpass.diloco import DiLoCo
from graphpass.plan import Choice, Plan, Strategy
from graphpass.tables import SparseOptimizer, TableSharding, cached_rows
from graphpass.plan_builder import uniform_stages
from graphpass.planner.op_placement import MEGATRON, OpLayout, Prices, op_layouts
from graphpass.planner.measure import GraphProfile, PlanningError
from graphpass.planner.remeasure import _contention, _op_times, _oversubscription, _Remeasure
from graphpass.planner.report import _alternatives, _reasons, _to_plan

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
#: Default share of device memory the plan may use: the rest is for the CUDA context, the
#: caching allocator's fragmentation and communication buffers.
DEFAULT_MEMORY_FRACTION = 0.9
#: Tensor-parallel degrees tried (within one node).
_TP_DEGREES = (1, 2, 4, 8, 16)
#: Adam / AdamW keep two states per parameter (exp_avg, exp_avg_sq).
_ADAM_STATES = 2


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
    if isinstance(cluster, str) and ("@" in cluster or "+" in cluster):
        from graphpass import sites

        return sites.parse(cluster, resolve_cluster)
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
        f"cluster must be a graphpass.Cluster, a preset name such as 'h100-80g' or 'h100-80g:4x8', or joined "
        f"sites such as 'h100-80g:4x8+a100-80g:4x8@wan-10g', "
        f"got {type(cluster).__name__}"
    )


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


#: what ``allow_inexact_sync`` searches: DiLoCo's sync intervals and PowerSGD's ranks, each
#: family's settings priced and the most faithful (the most frequent sync, the largest rank)
#: taken whose step is at most ``SYNC_SLACK`` slower than the family's cheapest setting's
SYNC_INTERVALS = (4, 8, 16, 32, 64, 128, 256)
POWERSGD_RANKS = (32, 16, 8, 4, 2, 1)
SYNC_SLACK = 0.10


#: at most this many of the tables' choices (from fastest to smallest, evenly spaced) are offered
#: to the stage ILP, which takes one of them beside the dense part's choices
_TABLE_POINTS = 256


def _sample_tensors(sample: Any, example: Batch, field: str) -> tuple[torch.Tensor, ...]:
    """A sample batch's tensors in the example batch's order (a tuple, or a dict with its keys)."""
    tensors = Batch.of(sample, what=field)
    if tensors.keys != example.keys or len(tensors.tensors) != len(example.tensors):
        raise ValueError(f"{field}: each sample batch is given as the example batch is (its keys "
                         f"{list(example.keys) if example.keys else len(example.tensors)}), got "
                         f"{list(tensors.keys) if tensors.keys else len(tensors.tensors)}")
    return tensors.tensors


def _spread(points: Sequence[Any], count: int) -> list[Any]:
    """At most ``count`` of ``points``, evenly spaced, the first and the last among them."""
    if len(points) <= count:
        return list(points)
    return [points[round(i * (len(points) - 1) / (count - 1))] for i in range(count)]


def _table_costs(gm, batch: int, samples: Sequence[Sequence[torch.Tensor]]) -> list[T.TableCost]:
    """Each embedding table of ``gm`` as the search prices it: shape, element size, the ids and
    pooled rows its lookups read per sample of the example batch, and the profile of its ids in
    the sample batches (how often each distinct id is read; none where the ids are not real
    tensors)."""
    from graphpass import meta
    from graphpass.lookups import IdCheck
    from graphpass.tables import lookup_args, tables

    read: dict[str, list[torch.Tensor]] = {}
    check = IdCheck(gm)
    for k, sample in enumerate(samples):
        if any(t.is_meta for t in sample):
            continue
        try:
            found = check.ids(sample)
        except (RuntimeError, IndexError) as exc:
            raise ValueError(f"id_samples[{k}]: the model's lookups' ids cannot be computed from this batch "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); give sample batches shaped "
                             "like example_inputs") from exc
        for key, ids in found.items():
            read.setdefault(key, []).append(ids)
    profiles = {key: tuple(torch.sort(torch.unique(torch.cat(ids), return_counts=True)[1], descending=True).values.tolist())
                for key, ids in read.items()}
    out = []
    for node, lookups in tables(gm).items():
        if meta.get(node, meta.ATTR_KIND, None) != "parameter":
            continue
        value = node.meta[meta.VAL]
        ids = bags = 0.0
        for lookup in lookups:
            args = lookup_args(lookup)
            n_ids = args["ids"].meta[meta.VAL].numel()
            ids += n_ids
            if args["mode"] == "none":
                bags += n_ids
            elif args["offsets"] is None:
                bags += args["ids"].meta[meta.VAL].shape[0]
            else:
                bags += args["offsets"].meta[meta.VAL].shape[-1] - (1 if args["include_last_offset"] else 0)
        key = (meta.get(node, meta.STATE_KEYS, ()) or (node.target,))[0]
        out.append(T.TableCost(node.name, int(value.shape[0]), int(value.shape[1]), value.element_size(),
                               ids / batch, bags / batch, profiles.get(key, ())))
    return out


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
        offload: bool | None = None,
        batch_dims: Mapping[Any, Any] | None = None,
        embedding_optimizer: SparseOptimizer | None = None,
        staleness: int = 0,
        id_samples: Sequence[Any] | None = None,
    ):
        start = time.perf_counter()
        self.cluster = resolve_cluster(cluster)
        if measure_together:
            _check_together(self.cluster, measure_ops)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        batch = Batch.of(example_inputs)
        inputs, model = batch.tensors, adapt(model, batch, loss_fn)
        # a model on the meta device is planned on meta inputs; real ones still give the tables'
        # id profile (a sample batch's ids, for a model too large to build)
        samples = [inputs] if id_samples is None else [_sample_tensors(b, batch, "id_samples") for b in id_samples]
        if any(p.is_meta for p in model.parameters()):
            inputs = tuple(t.to("meta") for t in inputs)
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
        batches = batching.resolve(model, inputs, batch.keys, batch_dims)
        self.batch = batching.samples(inputs, batches)
        captured = capture(model, inputs)
        batching.annotate(captured.gm, batches)
        times, factor = _op_times(captured.gm, self.cluster, measure_ops, inputs, measure_together)
        remeasure = (_Remeasure(model, inputs, captured.gm, self.cluster, factor, measure_together)
                     if measure_ops else None)
        self.profile = GraphProfile(captured.gm, inputs, self.batch, self.cluster, times, remeasure)
        self.embedding_optimizer = embedding_optimizer
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness must be an int >= 0 (steps a cached embedding row may lag; 0 is exact), "
                             f"got {staleness!r}")
        if staleness and embedding_optimizer is None:
            raise ValueError(f"staleness={staleness} lets the planner cache embedding rows that lag, but no "
                             "embedding_optimizer is given, so no table is sharded; pass embedding_optimizer too")
        self.staleness = staleness
        self.tables = _table_costs(captured.gm, self.batch, samples) if embedding_optimizer is not None else []
        if embedding_optimizer is not None and not self.tables:
            raise ValueError("embedding_optimizer updates sharded embedding tables, but this model has none (a weight "
                             "read only by embedding lookups); leave it out")
        self.profile.sparse_tables = frozenset(t.name for t in self.tables)
        loads = _check_loads(expert_loads, self.profile)
        self.capacity_factor, self._capacity_reason = _capacity(model, self.profile, loads, capacity_factors,
                                                                max_dropped)
        # the capacity priced: the plan's choice, else the model's own (where it has one)
        capacity = _model_capacity(model) if self.capacity_factor == "model" else self.capacity_factor
        self.costing = replace(_costing(self.profile, self.cluster, self.batch, self.budget, optimizer_states,
                                        measure_ops, measure_together),
                               expert_loads=loads, capacity_factor=capacity, offload=bool(offload))
        # None: offload is searched when nothing fits on the devices alone (the tiers multiply
        # each block's choices, and the stage ILPs take SCIP several times longer)
        self._offload_when_needed = offload is None and self.cluster.host is not None
        self._layouts: dict[tuple[int, bool, str], list[S.BlockCost]] = {}
        self._batches: dict[tuple[int, bool, str], set[int]] = defaultdict(set)
        self._rejected: dict[int, str] = {}  # tp degrees Megatron's layout cannot take, and why
        self._rejected_op: dict[tuple[int, bool, str], str] = {}  # op-level layouts the pass refused
        self._op_layouts: dict[int, list[OpLayout]] = {}
        self.measure_s = time.perf_counter() - start

    def blocks(self, layout: S.Parallelism) -> list[S.BlockCost] | None:
        """Block costs for ``layout``'s tensor parallelism (None when the model cannot take its tp)."""
        return self._ensure([layout]).get(layout.key)

    def _ensure(self, layouts: Sequence[S.Parallelism]) -> dict[tuple[int, bool, str], list[S.BlockCost]]:
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
        """The op-level planner's tensor-parallel layouts at ``tp`` (`graphpass.planner.op_placement`):
        the projections Megatron's pattern leaves replicated placed by the op-level solver, its
        terms priced at the local batch of a ``tp`` x dp mesh by the transition table and this
        Planner's costing. Each is registered with the profile under its name, for the mesh
        search to price exactly (``Parallelism.tp_layout``)."""
        if tp not in self._op_layouts:
            world = self.cluster.world_size
            mesh = S.Parallelism.of(1, world // tp, tp)
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
        layout = S.Parallelism(strategy.mesh, strategy.microbatches, strategy.sequence_parallel, strategy.schedule,
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
        if strategy.grad_compression is not None or strategy.diloco is not None:  # priced as they run; the
            # search never offers them (inexact)
            costing = replace(costing, grad_compression=strategy.grad_compression, diloco=strategy.diloco)
        tables = None
        if self.tables and strategy.embeddings:
            tables = self._strategy_tables(strategy)
            costing = replace(costing, tables=((tables.time_s, tables.bytes),))
        cand = S.evaluate(blocks, layout, list(choices), costing,
                          self._even_stages(strategy) if layout.num_stages > 1 else None)
        if cand is None:
            raise ValueError(
                f"Strategy pp={strategy.pp} needs at least {strategy.pp} blocks; the model has {len(self.profile.blocks)}"
            )
        reasons = [f"{'per-block choices' if given else 'uniform strategy'} priced as given: {strategy}"]
        if not cand.fits(budget):
            reasons.append(
                f"does NOT fit: predicted peak {cand.peak_memory_bytes / 2**30:.2f} GiB > budget "
                f"{budget / 2**30:.2f} GiB"
            )
        return _to_plan(self.profile, blocks, cand, costing, strategy, reasons, start,
                        (self.capacity_factor, self._capacity_reason), tables=self._table_plan(tables))

    def _table_pricing(self):
        """``(n, state per element, state per row, time_of)`` the tables are priced with."""
        n = self.cluster.world_size
        ranks = list(range(n))

        def time_of(collective: str, size: float) -> float:
            return collective_time(collective, size, ranks, self.cluster) if n > 1 and size > 0 else 0.0

        kind = self.embedding_optimizer.kind
        return n, {"adagrad": 1, "lazy_adam": 2}.get(kind, 0), 1 if kind == "rowwise_adagrad" else 0, time_of

    def _strategy_tables(self, strategy: Strategy) -> TableChoices:
        """A Strategy's tables, priced as it shards them (its kind, cache and staleness)."""
        n, per_element, per_row, time_of = self._table_pricing()
        chosen = []
        for t in self.tables:
            share = (strategy.embedding_cache,) if strategy.embedding_cache else ()
            opts = T.options(t, n, self.batch / n, per_element, per_row, time_of, strategy.staleness, share,
                             self._group(strategy))
            cache = cached_rows(strategy.embedding_cache, t.rows)
            # without an id profile a cache is not priced: the table as its kind alone
            chosen.append(next((o for o in opts if o.kind == strategy.embeddings and o.cache == cache),
                               next(o for o in opts if o.kind == strategy.embeddings)))
        owners, fullest = T.owners(self.tables, {t.name: o for t, o in zip(self.tables, chosen)}, n,
                                   self._group(strategy))
        return T.TableChoices({t.name: (o.kind, owners.get(t.name, 0), o.cache) for t, o in zip(self.tables, chosen)},
                              fullest, sum(o.time_s for o in chosen),
                              (f"every table {strategy.embeddings} (the Strategy's)",))

    def _group(self, strategy: Strategy | None = None) -> int:
        """The ranks a table-row-wise table is cut over: a node's (of all dp where the nodes hold
        more, as the plan builder makes a Strategy's)."""
        n, per_node = self.cluster.world_size, self.cluster.devices_per_node
        if strategy is not None and strategy.embeddings == "table_row_wise":
            return min(per_node, n)
        return per_node

    def _table_frontier(self, costing: S.Costing) -> list[TableChoices]:
        """The tables' choices that fit the budget, fastest first (:func:`graphpass.cost.search.tables.frontier`).

        Raises:
            graphpass.cost.search.NoPlanError: the tables fit no sharding.
        """
        n, per_element, per_row, time_of = self._table_pricing()
        path = T.frontier(self.tables, n, self.batch / n, per_element, per_row, time_of, self.staleness,
                          self.cluster.devices_per_node)
        fits = [c for c in path if c.bytes <= costing.memory_limit_bytes]
        if not fits:
            raise S.NoPlanError(f"the embedding tables need {path[-1].bytes / 2**30:.2f} GiB a rank even sharded over "
                                f"all {n} devices, more than the budget ({costing.memory_limit_bytes / 2**30:.2f} "
                                "GiB); use more devices, a larger budget, or a sparse optimizer with less state (sgd)")
        return fits

    def _table_plan(self, tables: TableChoices | None):
        """The plan's tables: each table's TableSharding by node name, and the sparse optimizer."""
        if tables is None:
            return None
        group = self._group()
        return ({name: TableSharding(kind, owner, cache, self.staleness if cache else 0,
                                     min(group, self.cluster.world_size) if kind == "table_row_wise" else 0)
                 for name, (kind, owner, cache) in tables.kinds.items()}, self.embedding_optimizer, tables)

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
             per_operator: bool = True, allow_inexact_sync: bool = False) -> Plan:
        """Search every mesh and per-block choice; the fastest plan that fits ``memory_budget``
        (default: the Planner's). With ``per_operator`` (the default) a block may also shard its
        largest operators' parameters at a higher ZeRO stage than the rest (OSDP,
        :attr:`graphpass.plan.Choice.large_ops`), and tensor parallelism may shard the
        projections Megatron's pattern leaves replicated, as the op-level solver places them
        (:meth:`op_layouts`); ``False`` gives the per-block plan, a subset of the same options.
        ``allow_inexact_sync``: the data-parallel plans that do not train as one process does
        (:meth:`_sync_families`: PowerSGD by rank, int8, DiLoCo by sync interval, and DiLoCo
        with each site one worker) are priced too, each family at its most faithful setting
        within ``SYNC_SLACK`` of its cheapest, and the fastest taken where it beats the exact
        plan; ``explain()`` says so (never without it).

        Raises:
            graphpass.cost.search.NoPlanError: nothing fits the budget.
        """
        exact = self._auto(time_limit_s, memory_budget, per_operator)
        return self._inexact(exact, memory_budget) if allow_inexact_sync else exact

    def _inexact(self, exact: Plan, memory_budget: int | float | str | None) -> Plan:
        """The fastest of ``exact`` and each inexact sync family's setting (:meth:`_sync_families`,
        ``SYNC_SLACK``) on data parallelism over every device that fits."""
        budget, _ = self._with_budget(memory_budget)
        world = self.cluster.world_size
        picks, notes = [], []
        for family, settings in self._sync_families():
            priced = []
            for label, fields in settings:
                try:
                    candidate = self.price(Strategy(dp=world, **fields), memory_budget)
                except (ValueError, NotImplementedError) as exc:
                    log.info("allow_inexact_sync: %s not priced: %s", label, exc)
                    continue
                if candidate.report.predicted_peak_memory_bytes <= budget:
                    priced.append((candidate.report.predicted_step_time_s, label, candidate))
            if not priced:
                continue
            cheapest = min(s for s, _, _ in priced)
            pick = next(p for p in priced if p[0] <= cheapest * (1 + SYNC_SLACK))  # settings: most faithful first
            picks.append(pick)
            if len(priced) > 1:
                least = min(priced, key=lambda p: p[0])
                notes.append(f"{pick[1]}" + (" (its family's cheapest)" if least is pick else
                                             f" (cheapest: {least[1]}, {least[0] * 1e3:.1f} ms)"))
        exact_s = exact.report.predicted_step_time_s
        tried = ", ".join(f"{label} {s * 1e3:.1f} ms" for s, label, _ in sorted(picks, key=lambda x: x[0]))
        how = (f"; each family at its most faithful setting within {SYNC_SLACK:.0%} of its cheapest: {'; '.join(notes)}"
               if notes else "")
        if not picks or min(picks, key=lambda x: x[0])[0] >= exact_s:
            line = (f"allow_inexact_sync: no inexact synchronisation beats the exact plan's {exact_s * 1e3:.1f} ms "
                    f"a step ({tried or 'none fits'}){how}")
            return replace(exact, report=replace(exact.report, reasons=exact.report.reasons + (line,)))
        step_s, label, chosen = min(picks, key=lambda x: x[0])
        line = (f"allow_inexact_sync: {label} taken, {step_s * 1e3:.1f} ms a step predicted against the exact plan's "
                f"{exact_s * 1e3:.1f} ms ({dict(exact.mesh)}); it does NOT train as one process does (tried: {tried})"
                f"{how}")
        return replace(chosen, report=replace(chosen.report, reasons=(line,) + chosen.report.reasons))

    def _sync_families(self) -> list[tuple[str, list[tuple[str, dict]]]]:
        """The inexact synchronisations ``allow_inexact_sync`` prices, by family, each family's
        settings most faithful first: PowerSGD by rank, int8, DiLoCo by sync interval over every
        rank, and where the cluster joins sites of equal size (more than one rank each) DiLoCo
        with each site one worker (HSDP: ZeRO-1 or -3 inside it, synchronous over its links)
        and int8 on HSDP's hop across the sites (ZeRO-2 or -3 inside each, exact there)."""
        families = [
            ("PowerSGD", [(f"PowerSGD rank {r}", {"grad_compression": GradCompression("powersgd", rank=r)})
                          for r in POWERSGD_RANKS]),
            ("int8", [("int8 with error feedback", {"grad_compression": GradCompression("int8")})]),
            ("DiLoCo", [(f"DiLoCo every {h} steps", {"diloco": DiLoCo(h)}) for h in SYNC_INTERVALS]),
        ]
        sizes = {s.world_size for s in self.cluster.sites}
        if len(sizes) == 1 and (size := sizes.pop()) > 1:
            families += [(f"DiLoCo across the sites, ZeRO-{z} inside", [
                (f"DiLoCo every {h} steps across the sites, ZeRO-{z} inside each",
                 {"diloco": DiLoCo(h), "dp_shard": size, "zero": z}) for h in SYNC_INTERVALS]) for z in (1, 3)]
            families += [(f"int8 across the sites, ZeRO-{z} inside", [
                (f"int8 with error feedback across the sites, ZeRO-{z} inside each (HSDP)",
                 {"grad_compression": GradCompression("int8"), "dp_shard": size, "zero": z})]) for z in (2, 3)]
        return families

    def _auto(self, time_limit_s: float | None, memory_budget: int | float | str | None,
              per_operator: bool) -> Plan:
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
        tables = None
        if self.tables:  # sharded tables run on a mesh of dp alone (shard_embeddings)
            mesh_list = [m for m in mesh_list if m.mesh.dp == self.cluster.world_size]
        layouts = self._ensure(mesh_list)
        usable = [m for m in mesh_list if m.key in layouts]
        _, costing = self._with_budget(memory_budget)

        def search(costing: S.Costing, meshes=usable):
            try:
                return (*S.search(layouts, meshes, costing, time_limit_s, per_operator), costing, [])
            except S.NoPlanError:
                if not self._offload_when_needed:
                    raise
                costing = replace(costing, offload=True)
                return (*S.search(layouts, meshes, costing, time_limit_s, per_operator), costing,
                        ["no plan fits on the devices alone: offload searched (Planner(offload=True) searches it "
                         "always, in the same solve)"])

        points = []
        if self.tables:  # the tables' trade of time for memory, one point of it taken in the stage ILP
            points = _spread(self._table_frontier(costing), _TABLE_POINTS)
            costing = replace(costing, tables=tuple((p.time_s, p.bytes) for p in points))
        best, found, infeasible, pruned, costing, searched = search(costing)
        shares = None
        speeds = self._site_speeds()
        flat = [m for m in usable if m.mesh.pp == 1 and m.mesh.ep == 1]
        if speeds is not None and flat and not self.tables:
            # unlike sites: dp shares in proportion to the devices' speeds, searched on the meshes
            # without pipeline stages (the shares' meshes), beside the even plan
            total = sum(speeds)
            uneven = replace(costing, share_compute=len(speeds) * min(speeds) / total,
                             share_activations=len(speeds) * max(speeds) / total)
            try:
                alt = search(uneven, flat)
            except S.NoPlanError:
                alt = None
            shares = self._speed_shares(alt[0].layout, speeds) if alt is not None else None
            if shares is None or alt[0].step_time_s >= best.step_time_s:
                shares = None  # the even plan (its stages sized by speed where pp crosses) stays
            else:
                even_s = best.step_time_s
                best, found, infeasible, pruned, costing, searched = alt
                searched = searched + [
                    f"per-site work: data-parallel shares in proportion to the devices' speeds ({_speeds_text(self.cluster)}"
                    f"), {'/'.join(map(str, shares))} samples a dp rank; {best.step_time_s * 1e3:.1f} ms a step against "
                    f"{even_s * 1e3:.1f} ms for the best plan with even shares (priced on the slowest device)"]
        if best.tables is not None:
            tables = points[best.tables]
            searched = searched + [
                f"memory split between the embedding tables and the dense part: {tables.bytes / 2**30:.3f} GiB a rank "
                f"to the tables, point {best.tables + 1} of {len(points)} along the tables' trade of time for memory "
                "(fastest first), taken in the same ILP as the dense part's choices"]
        alternatives = _alternatives(best, found, infeasible)
        reasons = searched + _reasons(best, found, alternatives, len(infeasible), self._rejected, costing, len(usable),
                                      self.measure_s, pruned)
        out = _to_plan(self.profile, layouts[best.layout.key], best, costing,
                       None, reasons, start - self.measure_s, (self.capacity_factor, self._capacity_reason),
                       alternatives, tables=self._table_plan(tables))
        return replace(out, dp_shares=shares) if shares is not None else out

    def _site_speeds(self) -> list[float] | None:
        """Each rank's device speed (relative to the slowest), where the cluster joins sites of
        unlike devices; None otherwise."""
        sites = self.cluster.sites
        if not sites or len({s.device for s in sites}) == 1:
            return None
        return [self.cluster.relative_speed(r) for r in range(self.cluster.world_size)]

    def _speed_shares(self, layout: S.Parallelism, speeds: Sequence[float]) -> tuple[int, ...] | None:
        """The samples each dp rank of ``layout``'s mesh takes: the global batch in proportion to
        its ranks' speed (a dp rank's tp group lies in one node, so in one site); None where a
        share would be empty or not split into the layout's microbatches."""
        mesh = layout.mesh
        weights = [0.0] * mesh.dp
        for rank in range(mesh.world_size):
            weights[mesh.coordinate(rank, "dp")] = speeds[rank]
        try:
            counts = batching.share_counts(self.batch, weights)
        except ValueError:
            return None
        return counts if all(c % layout.microbatches == 0 for c in counts) else None


def _speeds_text(cluster: Cluster) -> str:
    return ", ".join(f"{s.device.name} {s.device.speed_tflops:g} TFLOP/s"
                     for s in cluster.sites)


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
    offload: bool | None = None,
    batch_dims: Mapping[Any, Any] | None = None,
    embedding_optimizer: SparseOptimizer | None = None,
    staleness: int = 0,
    id_samples: Sequence[Any] | None = None,
    allow_inexact_sync: bool = False,
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
        offload: ``True``: the search puts blocks' optimizer state, gradients, parameters (a
            streamed window) and saved activations in host memory, or optimizer state on disk,
            where the cluster has a host side (``Cluster.host``; every preset has one), priced
            with the host link and its overlap with compute, in the same solve as the rest;
            ``None`` (default): only when no plan fits on the devices alone (searching it takes
            several times longer); ``False``: the devices alone.
        batch_dims: as for :func:`graphpass.compile`: the batch dim of inputs whose samples are
            not along dim 0, ``None`` for an input read whole, ``graphpass.Jagged(offsets=...)``
            for a jagged one (:mod:`graphpass.batching`; inferred where embedding lookups show it).
        embedding_optimizer: the :class:`graphpass.SparseOptimizer` of the model's embedding
            tables: given, the search shards every table over all devices, each the kind
            (data-parallel, table-, row- or column-wise) of the tables' trade of time for memory
            (:mod:`graphpass.cost.search.tables`), the dense part on a mesh of dp alone with what
            is left: the stage ILP takes one point of that trade beside the dense part's choices
            (one solve); ``explain()`` gives each table's choice. A ``strategy`` with ``embeddings``
            brings its own. Where the example batch's ids are real tensors, their profile (how
            often each id is read) prices HET's cache for each table too (1%, 5% or 20% of its
            rows; ``graphpass.runtime.row_cache``).
        staleness: with ``embedding_optimizer``, how many steps a cached row may lag when read
            and its gradient when pushed (HET's bounded staleness): the planner prices caches at
            this staleness and plans a table's cache only at it. 0 (default) is exact: a cache
            then serves only the exact pull-style lookup; more trades exactness for fewer bytes,
            and only the user chooses it.
        id_samples: batches (given as ``example_inputs`` is) whose ids make the tables' id
            profile; default the example batch. More batches see more of the rare ids, so the
            predicted hit shares come closer (one batch's profile gives an upper bound).
        allow_inexact_sync: with ``strategy="auto"``, also price synchronisations that do not
            train as one process does (PowerSGD by rank, int8 with error feedback, DiLoCo by sync
            interval, over every device or with each site one worker: :meth:`Planner.auto`) and
            take the fastest where it beats the exact plan, saying so in ``explain()``. Default
            False: only exact plans.

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
                      capacity_factors=capacity_factors, max_dropped=max_dropped, loss_fn=loss_fn, offload=offload,
                      batch_dims=batch_dims, embedding_optimizer=embedding_optimizer or (
                          strategy.embedding_optimizer if isinstance(strategy, Strategy) else None),
                      staleness=staleness, id_samples=id_samples)
    if allow_inexact_sync and isinstance(strategy, Strategy):
        raise ValueError("plan(allow_inexact_sync=True) lets strategy='auto' choose an inexact synchronisation; a "
                         "Strategy names its own (grad_compression=, diloco=)")
    return (planner.price(strategy) if isinstance(strategy, Strategy)
            else planner.auto(time_limit_s, allow_inexact_sync=allow_inexact_sync))
