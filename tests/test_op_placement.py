"""Op-level tensor-parallel placement (graphpass/planner/op_placement.py): the problem it builds
from the graph, the layouts the solver picks, the planner keeping them only where they are
faster, and their numerics on 2 and 4 gloo ranks against one process.

Numerics tolerances as in test_tensor_parallel.py: tensor parallelism changes only the order of
fp32 additions (a row projection's all-reduce sums partial matmuls, a gather into a column
projection reduce-scatters its partial input gradient), ~1e-7 relative; over 3 SGD-momentum
steps rtol 1e-5 / atol 1e-6 catches any real error (a missing conversion doubles or drops a
gradient, a wrong shard offset moves rows).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graphpass as gp
from graphpass import meta
from graphpass.capture import capture
from graphpass.cost.solver import evaluate
from graphpass.megatron import projection
from graphpass.planner.op_placement import COLUMN, OP_LEVEL, OP_LEVEL_LEAN, REPLICATED, ROW, Prices, build_problem, \
    megatron_at, op_layouts, placeable, placements_of
from graphpass.ops import op_name
from graphpass.pass_manager import PassContext, run_passes
from graphpass.passes import PIPELINE
from graphpass.passes.collectives import is_collective
from graphpass.plan_builder import plan_from_choices
from graphpass.planner import Planner

import zoo

RTOL, ATOL = 1e-5, 1e-6
#: Distinct per-byte prices per transition-table entry, so each term says which conversion it is.
_PER_BYTE = {"tp Partial -> Replicate": 1.0, "tp Shard -> Replicate": 2.0,
             "tp Shard -> Replicate into column linears": 20.0, "tp Replicate -> Shard": 5.0,
             "tp Replicate into sharded compute": 7.0}


def _mlp_graph():
    return capture(zoo.build("mlp"), zoo.batches("mlp", 1, 8)[0]).gm


def _by_path(gm) -> dict[str, str]:
    """Projection and convolution node names by module path (``layers.0`` → ``linear``)."""
    return {n.meta[meta.MODULE_PATH]: n.name for n in gm.graph.nodes if placeable(n) is not None}


def _prices(compute: float = 1.0, per_byte: float = 1e-6) -> Prices:
    # A backward part is priced at half the forward: a value without a gradient pays 2/3. Other
    # ops than projections compute a quarter of what a projection does.
    return Prices(compute_s=lambda node: compute if projection(node) is not None else compute / 4,
                  transition_s=lambda name, size, grad: _PER_BYTE[name] * per_byte * size * (1.0 if grad else 2 / 3),
                  batch_scale=0.5, state_bytes_per_element=16.0)


def test_problem_prices_every_conversion_between_projections_from_the_transition_table():
    gm = _mlp_graph()
    problem, strategies, decided = build_problem(gm, 2, _prices())
    names = _by_path(gm)
    assert decided == {}  # Megatron's pattern shards nothing of a layer-per-linear MLP
    # The output projection has one output feature: tp=2 cannot shard it by columns.
    assert strategies[names["out"]] == [REPLICATED, ROW]
    assert all(strategies[names[f"layers.{i}"]] == [REPLICATED, COLUMN, ROW] for i in range(3))
    edges = {(e.src, e.dst): e.cost_s for e in problem.edges}
    assert set(edges) == {(names["layers.0"], names["layers.1"]), (names["layers.1"], names["layers.2"]),
                          (names["layers.2"], names["out"])}
    # Between two hidden layers a [8, 64] fp32 activation at half the batch (2048 / 2 bytes) that
    # needs a gradient. Rows: the producer replicated, column, row (its partial sums already
    # all-reduced, so replicated); columns: what the consumer reads.
    size = 1e-6 * 8 * 64 * 4 * 0.5
    expected = [[0.0, 7 * size, 5 * size],   # replicated into replicated / column (Megatron f) / row (scatter)
                [2 * size, 20 * size, 0.0],  # a column's shard gathered; into a column, reduce-scattered back; a row reads it
                [0.0, 7 * size, 5 * size]]
    torch.testing.assert_close(torch.tensor(edges[(names["layers.0"], names["layers.1"])]), torch.tensor(expected))
    by_node = {n.name: n for n in problem.nodes}
    first = by_node[names["layers.0"]]
    # The first layer reads the data (no gradient: the conversions' backward parts are left out),
    # [8, 16] at half the batch; a row projection's [8, 64] partial sums are all-reduced. The
    # tanh after it (0.25) runs on a column projection's shards.
    data = 1e-6 * 8 * 16 * 4 * 0.5 * 2 / 3
    torch.testing.assert_close(torch.tensor(first.costs_s),
                               torch.tensor([1.25, 0.5 + 0.125 + 7 * data, 0.5 + 0.25 + 1 * size + 5 * data]))
    # Weight [64, 16] and bias [64]: a column shards both, a row the weight only.
    assert list(first.memory_bytes) == [16.0 * (1024 + 64), 16.0 * (1024 + 64) / 2, 16.0 * (512 + 64)]
    # Its output reaches only the next projection (through tanh): nothing else needs it whole,
    # while the last hidden layer's column shard is read only by `out`, but `out` may be a row.
    assert len(by_node[names["out"]].costs_s) == 2


def test_solver_pairs_columns_with_rows_where_that_is_the_cheapest_assignment():
    gm = _mlp_graph()
    prices = _prices(compute=1.0, per_byte=1e-4)
    problem, strategies, _ = build_problem(gm, 2, prices)
    # Brute force over every assignment: the solver's layout is the optimum, and here it is
    # Megatron's pairs written across layers (column into row: no conversion at all).
    order = [n.name for n in problem.nodes]
    best = min(itertools.product(*(range(len(strategies[n])) for n in order)),
               key=lambda c: evaluate(problem, dict(zip(order, c)))[0])
    fastest, *_ = op_layouts(gm, 2, prices)
    assert fastest.name == OP_LEVEL
    assert fastest.chosen == {n: strategies[n][i] for n, i in zip(order, best)}
    names = _by_path(gm)
    assert [fastest.chosen[names[p]] for p in ("layers.0", "layers.1", "layers.2", "out")] == [COLUMN, ROW, COLUMN, ROW]
    assert "layers.0 column, layers.1 row" in fastest.describe()


def test_solver_keeps_projections_replicated_where_conversions_cost_more_than_the_compute_saved():
    gm = _mlp_graph()
    layouts = op_layouts(gm, 2, _prices(compute=1e-9, per_byte=1.0))
    # The fastest is all replicated (Megatron's own, so not returned); the leanest shards every
    # weight it can, whatever the conversions cost.
    assert [lay.name for lay in layouts] == [OP_LEVEL_LEAN]
    assert all(how != REPLICATED for how in layouts[0].chosen.values())


def test_gpt_leaves_the_op_level_planner_nothing_to_decide():
    gm = capture(zoo.build("gpt"), zoo.batches("gpt", 1, 8)[0]).gm
    _, strategies, _ = build_problem(gm, 2, _prices())
    assert strategies and all(len(s) == 1 for s in strategies.values())
    assert op_layouts(gm, 2, _prices()) == []


def test_where_megatrons_layout_is_refused_every_projection_is_placed():
    gm = capture(zoo.build("gpt_3heads"), zoo.batches("gpt_3heads", 1, 8)[0]).gm
    assert megatron_at(gm, 2) == ({}, {})  # three attention heads cannot be split two ways
    fastest = op_layouts(gm, 2, _prices(compute=1.0, per_byte=1e-7))[0]
    by_path = {fastest.paths[n]: how for n, how in fastest.chosen.items()}
    # Compute dominates: every projection is sharded, the MLP's first by columns; attention's
    # q, k and v anything but their heads (not by columns).
    assert all(how != REPLICATED for how in by_path.values()) and len(by_path) == 12
    assert by_path["h.0.mlp.up"] == COLUMN and by_path["h.1.mlp.up"] == COLUMN
    assert all(by_path[f"h.{i}.attn.{p}"] == ROW for i in (0, 1) for p in ("q", "k", "v"))
    assert "lm_head" not in by_path  # tied to the token embedding: replicated, not a choice


def test_channel_parallel_convolutions_emit_megatrons_program():
    data = zoo.batches("convnet", 1, 8)[0]
    gm = capture(zoo.build("convnet"), data).gm
    names = _by_path(gm)
    placements = placements_of(gm, 2, {names[p]: how for p, how in SPECS["convolutions"].items()})
    # A column convolution shards the batch norm it feeds, weights and running statistics.
    assert {k: placements[k] for k in ("conv1_weight", "conv1_bias", "conv2_weight", "bn_weight", "bn_running_var")} == {
        "conv1_weight": "Shard(0)", "conv1_bias": "Shard(0)", "conv2_weight": "Shard(1)", "bn_weight": "Shard(0)",
        "bn_running_var": "Shard(0)"}
    strategy = gp.Strategy(tp=2)
    plan = plan_from_choices(gm, strategy.mesh, strategy.choice, strategy=strategy, tp_layout=(placements, {}))
    out, _ = run_passes(gm, plan, PassContext(0, 2, data), PIPELINE)
    # conv1 column -> conv2 row: no conversion, then its partial sums all-reduced before the
    # bias; conv3 column reads the pooled replicated value (f: its gradient all-reduced); its
    # batch norm, pooling and flatten stay on channel shards into fc1 row: one all-reduce.
    assert [op_name(n) for n in out.graph.nodes if is_collective(n)] == ["tp_all_reduce", "tp_copy", "tp_all_reduce"]
    conv2 = next(n for n in out.graph.nodes if n.meta.get(meta.MODULE_PATH) == "conv2" and "conv2d" in str(n.target))
    assert conv2.args[2] is None  # the bias is added after the all-reduce
    assert tuple(out.get_parameter("conv1.weight").shape) == (8, 3, 3, 3)
    assert tuple(out.get_buffer("bn.running_mean").shape) == (16,)


def test_placements_of_rejects_what_is_not_a_projection():
    gm = _mlp_graph()
    with pytest.raises(ValueError, match="'tanh' is not a projection"):
        placements_of(gm, 2, {"tanh": COLUMN})
    with pytest.raises(ValueError, match="placement 'diagonal'"):
        placements_of(gm, 2, {_by_path(gm)["layers.0"]: "diagonal"})


class _WideMLP(nn.Module):
    """Linears written as a list, not as repeated layers Megatron's pattern pairs."""

    def __init__(self, width: int = 8192, depth: int = 4, inputs: int = 1024, classes: int = 1000):
        super().__init__()
        dims = [inputs] + [width] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.cross_entropy(self.out(x), y)


def test_planner_takes_the_op_level_layout_only_where_it_is_faster():
    with torch.device("meta"):
        model = _WideMLP()
    inputs = (torch.empty(512, 1024, device="meta"), torch.empty(512, dtype=torch.long, device="meta"))
    planner = Planner(model, gp.Cluster.preset("a100-80g", nodes=1, gpus_per_node=8), inputs)
    auto = planner.auto()
    per_block = planner.auto(per_operator=False)
    # Megatron's pattern shards only the logits here (4% of the compute), so tp is refused for
    # it and the per-block plan has none; the op-level layout pairs the hidden linears and the
    # search keeps it (by how much is bench/plan_quality.py's figure, not this test's).
    assert auto.mesh.tp > 1 and per_block.mesh.tp == 1
    assert any("tensor-parallel layout: op-level" in r for r in auto.report.reasons)
    assert any("tp=8 with Megatron's layout not possible" in r for r in auto.report.reasons)
    sharded = {name for name, p in auto.placements.items() if "tp" in p}
    assert {"layers_0_weight", "layers_1_weight", "layers_2_weight", "layers_3_weight"} <= sharded
    # The plan round-trips: a saved plan replays the op-level placements without solving.
    assert gp.Plan.from_json(auto.to_json()).placements == auto.placements


# ---------------------------------------------------------------------------- numerics

#: Layouts covering every conversion the problem prices (module path → placement): column into
#: row; a row's all-reduced output into a column; the data scattered into a row; a column's
#: shard gathered into a column (reduce-scattered back in backward) and into a replicated one.
SPECS = {
    "pairs": {"layers.0": COLUMN, "layers.1": ROW, "layers.2": COLUMN, "out": ROW},
    "gathers": {"layers.0": ROW, "layers.1": COLUMN, "layers.2": COLUMN, "out": REPLICATED},
    "scatters": {"layers.0": REPLICATED, "layers.1": ROW, "layers.2": REPLICATED, "out": ROW},
    # Channel parallel convolutions: a column's batch norm and ReLU on its channel shards, read by
    # a row convolution (bias after the reduction), by max pooling, by a column after a gather;
    # the pooled channel shards read by a row linear.
    "convolutions": {"conv1": COLUMN, "conv2": ROW, "conv3": COLUMN, "fc1": ROW, "fc2": REPLICATED},
    # ResNet: residual adds of channel shards, a strided 1x1 shortcut, rows reading them.
    "residuals": {"stem.0": COLUMN, "layers.0.conv1": ROW, "layers.0.conv2": COLUMN, "layers.1.conv1": ROW,
                  "layers.1.shortcut.0": ROW, "layers.1.conv2": REPLICATED, "layers.2.conv1": COLUMN,
                  "layers.2.conv2": ROW, "layers.2.shortcut.0": COLUMN, "fc": ROW},
}
#: A GPT with 3 attention heads, which Megatron's layout cannot split 2 or 4 ways, and a ResNet
#: take the layouts the solver picks for them when compute dominates ("solver").
#: "solver" is the solver's layout of the model when compute dominates.
CASES = {2: [("mlp", "pairs", {}), ("mlp", "gathers", {}), ("mlp", "scatters", {}), ("gpt_3heads", "solver", {}),
             ("convnet", "convolutions", {}), ("resnet", "residuals", {}), ("resnet", "solver", {})],
         4: [("mlp", "pairs", {}), ("mlp", "gathers", {}), ("mlp", "scatters", {}),
             ("mlp", "gathers", {"dp": 2, "tp": 2, "zero": 2}), ("gpt_3heads", "solver", {}),
             ("convnet", "convolutions", {}), ("resnet", "residuals", {}), ("resnet", "solver", {})]}
# (No CNN with dp > 1 here: batch norm then normalises each rank's batch, as DDP without SyncBN
# does, which one process does not; the dp x tp mesh is the MLP's.)


def _train(name: str, spec: str, kwargs: dict, steps: int = 3, batch: int = 8):
    world = dist.get_world_size()
    strategy = gp.Strategy(**{"tp": world, **kwargs})
    data = zoo.batches(name, steps, batch)
    gm = capture(zoo.build(name), data[0]).gm
    if spec == "solver":
        placements = op_layouts(gm, strategy.tp, _prices(compute=1.0, per_byte=1e-7))[0].placements
    else:
        names = _by_path(gm)
        placements = placements_of(gm, strategy.tp, {names[path]: how for path, how in SPECS[spec].items()})
    plan = plan_from_choices(gm, strategy.mesh, strategy.choice, strategy=strategy, tp_layout=(placements, {}))
    dmodel = zoo.compile(zoo.build(name), data[0], plan)
    return zoo.train_compiled(dmodel, data), dmodel.full_state_dict()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_op_level_layouts_match_one_process(rank_pool, world_size):
    pool = rank_pool(world_size)
    refs: dict[str, tuple] = {}
    for name, spec, kwargs in CASES[world_size]:
        if name not in refs:
            refs[name] = zoo.train_reference(name, steps=3, batch=8)[:2]
        results = pool.run(_train, name, spec, kwargs, timeout_s=300)
        for rank, (losses, state) in enumerate(results):
            zoo.assert_matches_reference(f"{name} {spec} {kwargs} on {world_size} rank {rank}", losses, state,
                                         *refs[name], rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ plan, then compile the plan

_WIDE = dict(inputs=256, width=2048, depth=4, classes=64)


def _wide_mlp_data(steps: int = 3, batch: int = 16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, _WIDE["inputs"], generator=g), torch.randint(0, _WIDE["classes"], (batch,), generator=g))
            for _ in range(steps)]


def _wide_mlp():
    from configs import MLPConfig, build

    torch.manual_seed(0)
    return build(MLPConfig(**_WIDE))


def _plan_then_compile():
    data = _wide_mlp_data()
    # Planned for two A100s by the cost model (no timing: the preset's figures), saved, replayed.
    plan = gp.Plan.from_json(gp.plan(_wide_mlp(), "a100-80g:1x2", data[0]).to_json())
    dmodel = gp.compile(_wide_mlp(), gp.Cluster.local(), example_inputs=data[0], strategy=plan)
    return plan.report.reasons, zoo.train_compiled(dmodel, data), dmodel.full_state_dict()


@pytest.mark.timeout(300)
def test_a_plan_with_an_op_level_layout_compiles_and_matches_one_process(rank_pool):
    """A 2048-wide MLP on two A100s: the planner shards its linears by the op-level layout
    (Megatron's pattern would shard only the head); the saved plan runs on 2 gloo ranks."""
    from graphpass.testing import train_reference

    ref = train_reference(_wide_mlp, _wide_mlp_data(), "sgd-momentum", 0.05)
    for rank, (reasons, losses, state) in enumerate(rank_pool(2).run(_plan_then_compile, timeout_s=240)):
        assert any(r.startswith("tensor-parallel layout: op-level") for r in reasons), reasons
        zoo.assert_matches_reference(f"planned wide MLP rank {rank}", losses, state, ref.losses, ref.state,
                                     rtol=RTOL, atol=ATOL)

