"""Op-level tensor-parallel placement: the linears the Megatron pattern leaves undecided, and
convolutions, get replicated, column or row parallel by the op-level solver
(`graphpass.cost.solver`).

Megatron's pattern (`graphpass.megatron`) shards the linears of a repeated layer in column/row
pairs and the logits' projection by vocabulary. A linear outside any repeated layer (an MLP
written as a list of linears, a classifier head), the third linear of a chain, and every
convolution stay replicated, and tensor parallelism then splits little of such a model. Here
each of them becomes a node of a :class:`~graphpass.cost.solver.Problem` (:func:`placeable`: a
projection, or a convolution with ``groups == 1``, channel parallel, its features on dim 1):

- strategies: *replicated*, *column* (weight sharded on its output features, when they divide
  by tp, and so do the heads its output is viewed into) and *row* (on its input features). A
  projection Megatron decided keeps its placement as its only strategy, and one whose weight is
  read by more than one op (tied) stays replicated. Where the pass refuses Megatron's layout at
  tp (a 4-class head, or 3 attention heads at tp=2: :func:`megatron_at`) it decides nothing and
  every projection is free, so tp can still shard, say, the MLPs and attention by rows;
- node cost: its forward and backward compute, divided by tp when sharded, and the ops after
  it that keep its shards on the same dim, on a column's shards. Which ops keep them is the
  tensor-parallel pass's own rules' answer (`graphpass.passes.tensor_parallel.keeps_shard`:
  elementwise ops, views keeping the dim, batch norm and pooling on channels, reductions over
  other dims), so the problem and the pass cannot disagree on it; plus the conversions its own placement forces: a row's partial sums all-reduced
  (``tp Partial -> Replicate``), a column's output gathered where another op (a layer norm, a
  loss, the graph output) reads it (``tp Shard -> Replicate``), and its input converted from a
  replicated source that is not a projection (``tp Replicate -> Shard`` into a row, ``tp
  Replicate into sharded compute`` into a column);
- edge cost, for a projection ``u`` whose output reaches projection ``v`` through ops that keep
  its shards (`graphpass.megatron.flows_into`): the conversion from ``u``'s output (replicated,
  sharded, or reduced partial sums) to what ``v`` reads (replicated; replicated into sharded
  compute; sharded), e.g. nothing for column into row, an all-gather for column into replicated;
- memory: the weight's (and a column bias's) parameter, gradient and optimizer bytes, divided
  by tp when sharded, held through the step.

Every conversion is the transition table's (`graphpass.transitions.redistribution`, where the
emitter looks it up too), priced by the caller's ``transition_s``. The problem approximates the
tensor-parallel pass (it prices one gather where several readers may each convert, and not the
replicated operands a residual add slices to meet a shard); the planner prices each layout it
returns exactly, by the pass's dry run, next to Megatron's, and keeps whichever plan is faster.

Two layouts come out: the fastest (no memory limit) and the leanest (the fastest of those at the
smallest parameter memory), each only when it differs from Megatron's and from the other.
:func:`placements_of` turns a choice per node into the plan's placements (a column convolution
shards the batch norms it feeds with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from graphpass import meta
from graphpass.cost.solver import Edge, Node, Problem, min_peak_memory, solve
from graphpass.grads import grad_requiring_nodes
from graphpass.ops import CONVOLUTIONS, packet
from graphpass.megatron import Projection, elementwise, flows_into, fused_parts, heads, megatron_layout, \
    projection
from graphpass.passes.tensor_parallel import TensorParallelError, keeps_shard, layout as tp_dry_run
from graphpass.plan import Strategy
from graphpass.plan_builder import plan_from_choices
from graphpass.transitions import redistribution

aten = torch.ops.aten
REPLICATED, COLUMN, ROW = "replicated", "column", "row"
#: Layout names: Megatron's pattern alone, and the solver's two (see the module docstring).
MEGATRON, OP_LEVEL, OP_LEVEL_LEAN = "megatron", "op-level", "op-level lean"
#: Seconds the solver may take per layout (the problems have one node per linear: tens to
#: hundreds, proven optimal by one MILP in well under a second on the models tried).
_SOLVE_S = 10.0


@dataclass(frozen=True)
class Prices:
    """What the problem costs its terms with, at one local batch.

    Attributes:
        compute_s: a node's forward plus backward seconds on one rank, unsharded.
        transition_s: seconds of the transition-table entry ``name`` on a full tensor of
            ``bytes`` over the tp group, and whether its backward part runs (the value needs
            a gradient).
        batch_scale: the local batch over the captured batch (activation sizes scale by it).
        state_bytes_per_element: parameter, gradient and optimizer bytes per weight element.
    """

    compute_s: Callable[[fx.Node], float]
    transition_s: Callable[[str, float, bool], float]
    batch_scale: float
    state_bytes_per_element: float


@dataclass(frozen=True)
class OpLayout:
    """A tensor-parallel layout: ``placements`` and ``parts`` as
    :func:`graphpass.megatron.megatron_layout` gives them, and ``chosen``: each projection the
    Megatron pattern left undecided, by node name, to ``"replicated"``, ``"column"`` or ``"row"``;
    ``paths`` their module paths; ``predicted_s`` the problem's objective."""

    name: str
    placements: dict[str, str]
    parts: dict[str, tuple[int, ...]]
    chosen: dict[str, str]
    paths: dict[str, str]
    predicted_s: float

    def describe(self, most: int = 12) -> str:
        """``fc1 column, fc2 row`` of the projections the solver sharded (by module path; the
        first ``most``, then how many more)."""
        sharded = [f"{self.paths.get(name, name)} {how}" for name, how in self.chosen.items() if how != REPLICATED]
        more = f", ... ({len(sharded) - most} more)" if len(sharded) > most else ""
        return (", ".join(sharded[:most]) + more) or "none sharded"


def _numel(node: fx.Node | None) -> int:
    val = node.meta.get(meta.VAL) if node is not None else None
    return val.numel() if isinstance(val, torch.Tensor) else 0




def placeable(node: fx.Node) -> Projection | None:
    """``node`` as an op whose weight tensor parallelism can shard: a projection
    (:func:`graphpass.megatron.projection`), or a convolution by a held weight ``[out, in,
    *kernel]`` with ``groups == 1`` (channel parallel: its column shards the output channels,
    dim 1 of its output); None otherwise."""
    proj = projection(node)
    if proj is not None or node.op != "call_function" or node.target not in CONVOLUTIONS:
        return proj
    weight = node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    groups = node.args[6] if len(node.args) > 6 else 1
    if groups != 1 or not (isinstance(weight, fx.Node) and weight.op == "get_attr") or not isinstance(node.args[0], fx.Node):
        return None
    bias = bias if isinstance(bias, fx.Node) and bias.op == "get_attr" else None
    return Projection(node.args[0], weight, bias, out_dim=0, x_index=0, bias_index=2)


def _carries(node: fx.Node) -> bool:
    """Whether the tensor-parallel pass keeps a value sharded on its features (its last dim: a
    column linear's output) or its channels (dim 1: a column convolution's) on the same dim
    through ``node``, as the pass's rule for the op says (:func:`~graphpass.passes.tensor_parallel.keeps_shard`):
    elementwise ops, views keeping that dim, batch norm and pooling on channels, a reduction over
    other dims."""
    source = next((a for a in node.all_input_nodes if a.op != "get_attr"), None)
    val = source.meta.get(meta.VAL) if source is not None else None
    out = node.meta.get(meta.VAL)
    if node.op != "call_function" or not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if val.dim() and out.dim() and keeps_shard(node, val.dim() - 1, source) == out.dim() - 1:
        return True
    return val.dim() >= 2 and out.dim() >= 2 and keeps_shard(node, 1, source) == 1


def _norms_after(conv: fx.Node) -> list[fx.Node]:
    """The batch norms whose input is ``conv``'s output, directly or through elementwise ops of
    one input each (they are channel-sharded with it: their weights and running statistics
    shard with its output channels)."""
    out, stack = [], [(user, conv) for user in conv.users]
    while stack:
        node, value = stack.pop()
        if node.op != "call_function":
            continue
        if packet(node) is aten.batch_norm and node.args[0] is value:
            out.append(node)
        elif elementwise(node) and [a for a in node.all_input_nodes if a.op != "get_attr"] == [value]:
            stack.extend((user, node) for user in node.users)
    return out


def _reads_replicated(proj: Projection) -> bool:
    """Whether anything but projections (a norm, a graph input: a replicated source) reaches
    ``proj``'s input through ops that keep shards (the projections among them are its edges)."""
    stack, seen = [proj.x], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if placeable(node) is None:
            if not _carries(node):
                return True
            stack.extend(a for a in node.all_input_nodes if a.op != "get_attr")
    return False


def _strategies(node: fx.Node, proj: Projection, decided: Mapping[str, str], shared: set[str], tp: int) -> list[str]:
    placed = decided.get(proj.weight.name)
    if placed is not None:
        return [COLUMN if placed == proj.column else ROW]
    if proj.weight.name in shared or meta.get(proj.weight, meta.ATTR_KIND, None) != "parameter":
        return [REPLICATED]
    shape = tuple(proj.weight.meta[meta.VAL].shape)
    out_features, in_features = shape[proj.out_dim], shape[1 - proj.out_dim]
    out = [REPLICATED]
    linear = projection(node) is not None  # a convolution's output has no fused parts or heads
    if out_features % tp == 0 and (not linear or fused_parts(node) is None and (heads(node) or tp) % tp == 0):
        out.append(COLUMN)
    if in_features % tp == 0:
        out.append(ROW)
    return out


# What a projection's output is under each strategy (a row's partial sums are all-reduced at
# once, by its own node cost), and what it reads: (placement, the placement its gradient comes
# back in: partial sums into a column's sharded compute).
_OUT = {REPLICATED: Replicate(), COLUMN: Shard(-1), ROW: Replicate()}
_READS = {REPLICATED: (Replicate(), None), COLUMN: (Replicate(), Partial()), ROW: (Shard(-1), None)}


def megatron_at(gm: fx.GraphModule, tp: int, applies: bool | None = None
                ) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """Megatron's layout (:func:`graphpass.megatron.megatron_layout`) where the tensor-parallel
    pass can apply it at ``tp``, else none. ``applies`` says whether it can (the planner knows it
    from its own dry run); None: dry-run the pass here. Where it cannot (a 4-class head or 4
    attention heads at tp=8), the pattern's decisions are dropped whole and the op-level problem
    places every projection."""
    if applies is None:
        applies = _megatron_applies(gm, tp)
    return megatron_layout(gm, tp) if applies else ({}, {})


def _megatron_applies(gm: fx.GraphModule, tp: int) -> bool:
    strategy = Strategy(tp=tp)
    try:
        tp_dry_run(gm, plan_from_choices(gm, strategy.mesh, strategy.choice, strategy=strategy))
    except TensorParallelError:
        return False
    return True


@dataclass(frozen=True)
class _Choices:
    """``gm``'s projections, each one's strategy names at ``tp``, and the Megatron layout
    (placements, parts) they start from (:func:`megatron_at`)."""

    projections: dict[fx.Node, Projection]
    strategies: dict[str, list[str]]
    decided: dict[str, str]
    parts: dict[str, tuple[int, ...]]


def _choices(gm: fx.GraphModule, tp: int, applies: bool | None) -> _Choices:
    decided, parts = megatron_at(gm, tp, applies)
    projections = {n: p for n in gm.graph.nodes if (p := placeable(n)) is not None}
    readers: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                readers[arg] = readers.get(arg, 0) + 1
    shared = {w.name for w, count in readers.items() if count > 1}
    return _Choices(projections, {n.name: _strategies(n, p, decided, shared, tp) for n, p in projections.items()},
                    decided, parts)


def build_problem(gm: fx.GraphModule, tp: int, prices: Prices, megatron_applies: bool | None = None
                  ) -> tuple[Problem, dict[str, list[str]], dict[str, str]]:
    """The op-level problem of ``gm``'s projections at ``tp`` (see the module docstring): the
    problem, each node's strategy names, and Megatron's placements it starts from
    (``megatron_applies``: as :func:`megatron_at` takes it)."""
    return _problem(gm, tp, prices, _choices(gm, tp, megatron_applies))


def _problem(gm: fx.GraphModule, tp: int, prices: Prices, choices: _Choices
             ) -> tuple[Problem, dict[str, list[str]], dict[str, str]]:
    projections, strategies = choices.projections, choices.strategies
    grads = grad_requiring_nodes(gm)
    scale = prices.batch_scale

    def convert(src: Placement, dst: tuple[Placement, Placement | None], value: fx.Node, grad: bool) -> float:
        """Seconds of the table's entries that take ``value`` from ``src`` to ``dst`` (a
        placement and its gradient's, as ``_READS`` gives them), at the local batch."""
        val = value.meta.get(meta.VAL)
        if not isinstance(val, torch.Tensor):
            return 0.0
        return sum(prices.transition_s(entry.name, entry.size_bytes(val.shape, val.dtype) * scale, grad)
                   for entry in redistribution("tp", src, *dst))

    nodes, edges = [], []
    for node, proj in projections.items():
        names = strategies[node.name]
        compute = prices.compute_s(node)
        grad = proj.x in grads
        consumers, whole, passed = flows_into(node, through=_carries, ends=placeable)
        # The elementwise ops after a column projection run on its shards too (a row's partial
        # sums are all-reduced before them).
        after = sum(prices.compute_s(n) for n in passed)
        replicated_source = _reads_replicated(proj)
        costs, memory = [], []
        for how in names:
            cost = compute / (tp if how != REPLICATED else 1) + after / (tp if how == COLUMN else 1)
            if how == ROW:
                cost += convert(Partial(), (Replicate(), None), node, True)
            if how == COLUMN and whole:
                cost += convert(Shard(-1), (Replicate(), None), node, node in grads)
            if replicated_source:
                cost += convert(Replicate(), _READS[how], proj.x, grad)
            elements = _numel(proj.weight) + (_numel(proj.bias) if how == COLUMN else 0)
            held = _numel(proj.weight) + _numel(proj.bias)
            memory.append(prices.state_bytes_per_element * (held - elements + elements / (tp if how != REPLICATED else 1)))
            costs.append(cost)
        nodes.append(Node(node.name, costs, memory))
        for user in consumers:
            if user not in projections:
                continue
            reads, user_grad = projections[user].x, projections[user].x in grads
            matrix = [[convert(_OUT[a], _READS[b], reads, user_grad) for b in strategies[user.name]] for a in names]
            if any(any(row) for row in matrix):
                edges.append(Edge(node.name, user.name, matrix))
    return Problem(nodes, edges), strategies, choices.decided


def placements_of(gm: fx.GraphModule, tp: int, chosen: Mapping[str, str], megatron_applies: bool | None = None
                  ) -> dict[str, str]:
    """Megatron's placements at ``tp`` with the projections in ``chosen`` (node name →
    ``"replicated"``, ``"column"`` or ``"row"``) placed so: a column projection's weight on its
    output features and its bias with it (a column convolution also the batch norms it feeds:
    weight, bias and running statistics on their channels), a row projection's weight on its
    input features (its bias is added after the reduction, replicated). ``megatron_applies``: as
    :func:`megatron_at` takes it.

    Raises:
        ValueError: a name that is not a projection or convolution (:func:`placeable`), or a
            placement other than those three.
    """
    return _placed(gm, megatron_at(gm, tp, megatron_applies)[0], chosen)


def _placed(gm: fx.GraphModule, decided: Mapping[str, str], chosen: Mapping[str, str]) -> dict[str, str]:
    placements = dict(decided)
    by_name = {n.name: n for n in gm.graph.nodes}
    for name, how in chosen.items():
        proj = placeable(by_name[name]) if name in by_name else None
        if proj is None:
            raise ValueError(f"node {name!r} is not a projection (aten.linear, addmm by a held weight) or a "
                             "convolution by a held weight")
        if how not in (REPLICATED, COLUMN, ROW):
            raise ValueError(f"node {name!r}: placement {how!r}; use {REPLICATED!r}, {COLUMN!r} or {ROW!r}")
        for param in (proj.weight, proj.bias):
            if param is not None:
                placements.pop(param.name, None)
        if how == COLUMN:
            placements[proj.weight.name] = proj.column
            if proj.bias is not None:
                placements[proj.bias.name] = "Shard(0)"
            if projection(by_name[name]) is None:
                for norm in _norms_after(by_name[name]):
                    placements.update((a.name, "Shard(0)") for a in norm.args[1:5] if isinstance(a, fx.Node))
        elif how == ROW:
            placements[proj.weight.name] = proj.row
    return placements


def op_layouts(gm: fx.GraphModule, tp: int, prices: Prices, megatron_applies: bool | None = None) -> list[OpLayout]:
    """The solver's layouts for ``gm`` at ``tp`` that differ from Megatron's (fastest first, then
    leanest; see the module docstring). Empty when no projection is left to decide.
    ``megatron_applies``: whether the tensor-parallel pass can apply Megatron's layout at ``tp``
    (None: dry-run it here, :func:`megatron_at`)."""
    choices = _choices(gm, tp, megatron_applies)
    if all(len(s) == 1 for s in choices.strategies.values()):
        return []
    problem, strategies, decided = _problem(gm, tp, prices, choices)
    by_name = {n.name: n for n in gm.graph.nodes}
    lean_bytes = min_peak_memory(problem)[0] * (1 + 1e-9)  # the smallest parameter memory, rounding aside
    out: list[OpLayout] = []
    for name, limit in ((OP_LEVEL, None), (OP_LEVEL_LEAN, lean_bytes)):
        solution = solve(Problem(problem.nodes, problem.edges, memory_limit_bytes=limit), time_limit_s=_SOLVE_S)
        chosen = {n: strategies[n][i] for n, i in solution.choice.items() if len(strategies[n]) > 1}
        placements = _placed(gm, decided, chosen)
        if placements == decided or any(placements == o.placements for o in out):
            continue
        paths = {k: by_name[k].meta.get(meta.MODULE_PATH) or k for k in chosen}
        out.append(OpLayout(name, placements, dict(choices.parts), chosen, paths, solution.cost_s))
    return out
