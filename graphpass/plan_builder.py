"""The plan that choices imply for a captured graph.

A :class:`~graphpass.plan.Strategy` makes one :class:`~graphpass.plan.Choice` for every block;
the planner picks one per block. Both become a :class:`~graphpass.plan.Plan` here, by one rule
for what a choice means on the graph's nodes, so ``compile(strategy=gp.Strategy(...))``, the
planner's plans and the tests' plans mean the same thing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from graphpass import meta
from graphpass.batching import input_plan
from graphpass.layout import ActivationPlan, TensorPlan, Tiers, placement_from_str
from graphpass.megatron import megatron_layout
from graphpass.experts import expert_weights
from graphpass.mesh import Mesh
from graphpass.ops import linear_operands
from graphpass.plan import Choice, Plan, Strategy
from graphpass.plan_report import PlanReport
from graphpass.splittable import default_split
from graphpass.stages import stage_starts
from graphpass.tables import PLACEMENT_DIM, SparseOptimizer, TableSharding, balance_owners, cached_rows, tables


def plan_from_strategy(gm: fx.GraphModule, strategy: Strategy, reasons: Sequence[str], *,
                       node_size: int | None = None) -> Plan:
    """The plan a uniform strategy implies: :func:`plan_from_choices` with
    :attr:`Strategy.choice` for every node (``node_size``: the cluster's devices per node, the
    groups ``Strategy(embeddings="table_row_wise")`` cuts tables over; None: all of dp)."""
    return plan_from_choices(gm, strategy.mesh, strategy.choice, sequence_parallel=strategy.sequence_parallel,
                             microbatches=strategy.microbatches, strategy=strategy, reasons=reasons,
                             offload_window=strategy.offload_window or 1, node_size=node_size)


def plan_from_choices(gm: fx.GraphModule, mesh: Mesh, choices: Choice | Mapping[str, Choice], *,
                      sequence_parallel: bool = False, microbatches: int = 1, strategy: Strategy | None = None,
                      reasons: Sequence[str] = (), offload_window: int = 1,
                      tp_layout: tuple[Mapping[str, str], Mapping[str, tuple[int, ...]]] | None = None,
                      table_plan: tuple[Mapping[str, TableSharding], SparseOptimizer] | None = None,
                      node_size: int | None = None) -> Plan:
    """The plan of ``choices`` (one for every node, or node name → choice; unlisted nodes take
    ``Choice()``) on ``mesh``.

    Data parallel: every input is ``Shard(d)`` on ``dp`` along its batch dim (the batch is split;
    :func:`graphpass.batching.input_plan`), every parameter
    and buffer ``Replicate()``, and the loss ``Partial(avg)`` (a per-rank mean). With ``tp``,
    ``tp_layout`` (``(placements, parts)`` of the weights tensor parallelism shards, as the op-level
    planner's :class:`graphpass.planner.op_placement.OpLayout` holds them), by default the Megatron layout
    (:func:`graphpass.megatron.megatron_layout`). A parameter node's ``zero=k``
    gives it ZeRO stage k when it is trainable and not a scalar (ZeRO shards along dim 0); a
    layer recomputes when its nodes choose ``recompute``; ``split=k`` on a linear splits it k ways
    along its output features when its weight is untied and has at least k rows
    (``split_operators.default_split``). A trainable parameter's parts live in its node's
    ``Choice.tiers``, and a layer whose nodes choose ``saved_tier="host"`` saves its activations
    in host memory (offload). With ``ep`` in the mesh, every Mixture-of-Experts layer's
    expert weights are ``Shard(0)`` on ``ep`` (``expert_parallel.expert_weights``). Embedding
    tables are sharded as ``strategy.embeddings`` says, or as ``table_plan`` (the planner's choice per
    table, by node name, and the sparse optimizer) does.

    Raises:
        ValueError: an ``ep`` axis for a graph without Mixture-of-Experts layers.
    """
    choice_of = (lambda name: choices) if isinstance(choices, Choice) else (lambda name: choices.get(name, Choice()))
    tp_placements: dict[str, str] = {}
    tp_parts: dict[str, tuple[int, ...]] = {}
    if mesh.tp > 1:
        tp_placements, tp_parts = (dict(tp_layout[0]), dict(tp_layout[1])) if tp_layout else megatron_layout(gm, mesh.tp)
    experts: set[str] = set()
    if mesh.ep > 1:
        experts = set(expert_weights(gm))
        if not experts:
            raise ValueError(f"mesh ep={mesh.ep} shards experts, but the captured graph has no Mixture-of-Experts layer "
                             "(no grouped expert product: graphpass.nn.MoE, Hugging Face's grouped_mm experts); "
                             "use ep=1")
    tensors: dict[str, TensorPlan] = {}
    sharded_tables = table_shardings(gm, strategy, mesh.dp, node_size) if strategy is not None and strategy.embeddings \
        else {}
    optimizer = strategy.embedding_optimizer if strategy is not None else None
    if table_plan is not None:  # the planner's per-table choices
        by_name, optimizer = table_plan
        sharded_tables = {node: by_name[node.name] for node in gm.graph.nodes if node.name in by_name}
    if strategy is not None and strategy.embeddings and not sharded_tables:
        raise ValueError(f"Strategy.embeddings={strategy.embeddings!r} shards embedding tables, but this model has none "
                         "(a weight read only by embedding lookups; one tied to an LM head is a dense weight); use "
                         "embeddings=None")
    nodes = {node.name: node for node in gm.graph.nodes}
    inputs = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
    layers: set[int] = set()
    saved_on_host: set[int] = set()
    split_nodes: dict[int, set[str]] = {}
    for node in gm.graph.nodes:
        choice = choice_of(node.name)
        layer = node.meta.get(meta.LAYER)
        if node.op == "call_function":
            if layer is not None and choice.recompute:
                layers.add(layer)
            if layer is not None and choice.saved_tier != "device":
                saved_on_host.add(layer)
            if choice.split > 1:
                split_nodes.setdefault(choice.split, set()).add(node.name)
        if node.op == "placeholder":
            tensors[node.name] = input_plan(node, inputs)
        elif node.op == "get_attr":
            placements: dict[str, Placement] = {"dp": Replicate()}
            if node.name in tp_placements:
                placements["tp"] = placement_from_str(tp_placements[node.name])
            if node.name in experts:
                placements["ep"] = Shard(0)
            zero, tiers = 0, Tiers()
            if meta.get(node, meta.ATTR_KIND) == "parameter":
                tensor = gm.get_parameter(node.target)
                if tensor.requires_grad:
                    tiers = choice.tiers
                    if choice.zero and tensor.dim() > 0:
                        zero = choice.zero
            if node in sharded_tables:
                tensors[node.name] = TensorPlan(_table_placement(sharded_tables[node]), table=sharded_tables[node])
                continue
            tensors[node.name] = TensorPlan(placements, zero, tuple(tp_parts.get(node.name, ())), tiers=tiers)
    # an operator split is its weight's (the linear reads it alone: default_split checks)
    for parts, names in split_nodes.items():
        for linear, spec in default_split(gm, parts).items():
            if linear in names:
                weight = linear_operands(nodes[linear])[1].name
                tensors[weight] = replace(tensors[weight], split=spec)
    output = gm.graph.find_nodes(op="output")[0]
    loss = output.args[0][meta.get(output, meta.ROLE)["loss"]]
    tensors[loss.name] = TensorPlan({"dp": Partial("avg")})
    return Plan(
        mesh=mesh,
        tensors=tensors,
        stages=uniform_stages(gm, mesh.pp, strategy),
        schedule=strategy.schedule if strategy is not None else "1f1b",
        strategy=strategy,
        activations={layer: ActivationPlan(recompute=layer in layers, tier="host" if layer in saved_on_host else "device")
                     for layer in sorted(layers | saved_on_host)},
        offload_window=offload_window,
        embedding_optimizer=optimizer if sharded_tables else None,
        grad_compression=strategy.grad_compression if strategy is not None else None,
        diloco=strategy.diloco if strategy is not None else None,
        sequence_parallel=sequence_parallel,
        microbatches=microbatches,
        report=PlanReport(reasons=tuple(reasons)),
    )


def table_shardings(gm: fx.GraphModule, strategy: Strategy, dp: int, node_size: int | None = None
                    ) -> dict[fx.Node, TableSharding]:
    """Every embedding table of ``gm`` (:func:`graphpass.tables.tables`) sharded as
    ``strategy.embeddings`` over ``dp`` ranks, with ``strategy.embedding_cache`` of its rows
    cached at ``strategy.staleness``; table-wise tables go to the ranks largest first, each to
    the rank that holds the fewest elements so far (TorchRec's greedy balance by size), and
    table-row-wise tables so to the groups of ``node_size`` ranks (None: one group of all)."""
    kind = strategy.embeddings
    found = [node for node in tables(gm) if meta.get(node, meta.ATTR_KIND) == "parameter"]
    group = 0
    if kind == "table_row_wise":
        group = min(node_size or dp, dp)
        if dp % group:
            raise ValueError(f"Strategy(embeddings='table_row_wise') cuts each table over a node's {group} ranks, "
                             f"which do not divide dp={dp}; use a dp that is a multiple of the devices per node")
    sizes = {node.name: meta.get(node, meta.VAL).numel() for node in found}
    owners = balance_owners(sizes, dp)[0] if kind == "table_wise" else \
        {name: g * group for name, g in balance_owners(sizes, dp // group)[0].items()} if group else {}
    return {node: TableSharding(kind, owners.get(node.name, 0),
                                cached_rows(strategy.embedding_cache, meta.get(node, meta.VAL).shape[0]),
                                strategy.staleness, group)
            for node in found}


def _table_placement(sharding: TableSharding) -> dict[str, Placement]:
    dim = PLACEMENT_DIM[sharding.kind]
    return {"dp": Replicate() if dim is None else Shard(dim)}


def uniform_stages(gm: fx.GraphModule, pp: int, strategy: Strategy | None) -> tuple[str, ...]:
    """``Plan.stages`` of a uniform strategy: the layers cut evenly into ``pp`` stages times the
    strategy's virtual stages (:func:`~graphpass.passes.partition_stages.stage_starts`)."""
    if strategy is None:
        return stage_starts(gm, pp, field="Plan.mesh['pp']")
    if strategy.virtual_stages == 1:
        return stage_starts(gm, pp, field="Strategy.pp")
    return stage_starts(gm, pp * strategy.virtual_stages, field="Strategy.pp x Strategy.virtual_stages")
