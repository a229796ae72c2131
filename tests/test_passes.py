"""Pass runner, dumps and the data-parallel collective sequence (one process, no communication).

Passes never communicate, so the graphs a 2-rank job would run are built and checked here in a
single process by handing the pipeline a dp=2 plan.
"""

from __future__ import annotations

import ast
import re
import pathlib

import pytest
import torch
import torch.fx as fx

import graphpass as gp
from graphpass import meta
from graphpass.plan_builder import plan_from_strategy
from graphpass.capture import capture
from graphpass.dump import Dumper
from graphpass.pass_manager import PassContext, PassError, graph_pass, run_passes
from graphpass.ops import op_name
from graphpass.passes import PIPELINE, split_operators
from graphpass.passes.collectives import is_collective
from graphpass.runtime import collectives as ops

import zoo

REPO = pathlib.Path(__file__).resolve().parent.parent


def _dp_graph(name: str = "gpt", dp: int = 2, bucket_cap_bytes: int | None = None, model=None, batch=None):
    model = model if model is not None else zoo.build(name)
    batch = batch if batch is not None else zoo.batches(name, 1, 4)[0]
    gm = capture(model, batch).gm
    plan = plan_from_strategy(gm, gp.Strategy(dp=dp), ["test"])
    if bucket_cap_bytes is not None:
        plan = gp.Plan.from_dict({**plan.to_dict(), "bucket_cap_bytes": bucket_cap_bytes})
    ctx = PassContext(rank=0, world_size=dp, example_inputs=batch)
    return run_passes(gm, plan, ctx, PIPELINE)


def _collective_sequence(gm: fx.GraphModule) -> list[str]:
    out = []
    for node in gm.graph.nodes:
        if is_collective(node):
            if node.target is ops.all_reduce_grads:
                params = [p.target for p in node.args[1:]]
                out.append(f"all_reduce_grads[{node.kwargs['bucket']}]({', '.join(params)})")
            else:
                out.append(f"{op_name(node)}{tuple(a for a in node.args if not isinstance(a, fx.Node))}")
    return out


def test_dp_graph_collective_sequence_is_pinned():
    gm, records = _dp_graph("gpt")
    assert _collective_sequence(gm) == [
        "grad_sync_begin('dp',)",
        # One bucket (the model is 0.2 MB), parameters in the order backward produces them.
        "all_reduce_grads[0](ln_f.weight, ln_f.bias, "
        "h.1.mlp.down.weight, h.1.mlp.down.bias, h.1.mlp.up.weight, h.1.mlp.up.bias, "
        "h.1.ln_2.weight, h.1.ln_2.bias, h.1.attn.proj.weight, h.1.attn.proj.bias, "
        "h.1.attn.v.weight, h.1.attn.v.bias, h.1.attn.k.weight, h.1.attn.k.bias, "
        "h.1.attn.q.weight, h.1.attn.q.bias, h.1.ln_1.weight, h.1.ln_1.bias, "
        "h.0.mlp.down.weight, h.0.mlp.down.bias, h.0.mlp.up.weight, h.0.mlp.up.bias, "
        "h.0.ln_2.weight, h.0.ln_2.bias, h.0.attn.proj.weight, h.0.attn.proj.bias, "
        "h.0.attn.v.weight, h.0.attn.v.bias, h.0.attn.k.weight, h.0.attn.k.bias, "
        "h.0.attn.q.weight, h.0.attn.q.bias, h.0.ln_1.weight, h.0.ln_1.bias, "
        "wpe.weight, wte.weight)",
        "all_reduce('dp',)",
    ]
    output = gm.graph.find_nodes(op="output")[0]
    assert meta.get(output, meta.ROLE) == {"loss": 0, "loss_report": 1}
    by_name = {r.name: r for r in records}
    assert [r.name for r in records] == [p.pass_name for p in PIPELINE]
    assert by_name["insert_collectives"].op_deltas["all_reduce_grads"] == 1
    assert by_name["shard_parameters"].op_deltas == {}  # no ZeRO in a plain dp plan


def test_every_parameter_use_goes_through_its_bucket():
    gm, _ = _dp_graph("gpt", bucket_cap_bytes=1)  # one parameter per bucket
    for node in gm.graph.nodes:
        if node.op == "get_attr" and meta.get(node, meta.ATTR_KIND) == "parameter":
            assert [u.target for u in node.users] == [ops.all_reduce_grads], node.name
    buckets = [n for n in gm.graph.nodes if n.target is ops.all_reduce_grads]
    assert len(buckets) == len(list(zoo.build("gpt").parameters()))
    # Each bucket sits before the first use of its parameter (and after the sync begin).
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    begin = next(n for n in gm.graph.nodes if n.target is ops.grad_sync_begin)
    for bucket in buckets:
        assert order[begin] < order[bucket]
        first_use = min(order[u] for item in bucket.users for u in item.users)
        assert order[bucket] < first_use


def test_hundreds_of_parameters_do_not_mean_hundreds_of_all_reduces():
    model = zoo.MLP(width=32, depth=200)  # 402 parameter tensors, 0.85 MB
    batch = (torch.randn(4, 16), torch.randn(4))
    gm, _ = _dp_graph(model=model, batch=batch, bucket_cap_bytes=256 * 1024)
    buckets = [n for n in gm.graph.nodes if n.target is ops.all_reduce_grads]
    params = sum(len(b.args) - 1 for b in buckets)
    assert params == len(list(model.parameters())) == 402
    assert 3 <= len(buckets) <= 5  # 0.85 MB in 256 KiB buckets


def test_single_rank_plan_inserts_nothing():
    gm, records = _dp_graph("gpt", dp=1)
    assert _collective_sequence(gm) == []
    assert all(r.op_deltas == {} for r in records)


def test_only_the_emitter_creates_collective_nodes():
    """Graph-building code references the runtime's collective ops only in passes/collectives.py,
    and runtime/ (which implements them) never builds graph nodes."""
    names = {fn.__name__ for fn in ops.COLLECTIVE_OPS}
    emitter = REPO / "passes" / "collectives.py"
    offenders = []
    for folder in ("graphpass", "passes", "cost"):
        for path in (REPO / folder).rglob("*.py"):
            if path == emitter:
                continue
            tree = ast.parse(path.read_text())
            # Names this file binds to the runtime's op modules (``from graphpass.runtime import
            # collectives as ops``); attribute access through anything else (dist.all_reduce, a
            # profiler's own .all_reduce field) is not an op reference.
            op_modules = {"graphpass.runtime.collectives", "graphpass.runtime.tensor_parallel", "graphpass.runtime.zero"}
            aliases = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "graphpass.runtime":
                    aliases |= {a.asname or a.name for a in node.names if f"graphpass.runtime.{a.name}" in op_modules}
                if isinstance(node, ast.Import):
                    aliases |= {a.asname or a.name for a in node.names if a.name in op_modules}
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)
                        and node.value.id in aliases):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
                if isinstance(node, ast.ImportFrom) and any(a.name in names for a in node.names):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} import")
    for path in (REPO / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("call_function", "create_node"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
    assert offenders == []


def test_dumps_written_for_every_pass(tmp_path):
    model = zoo.build("gpt")
    batch = zoo.batches("gpt", 1, 4)[0]
    gm = capture(model, batch).gm
    plan = plan_from_strategy(gm, gp.Strategy(dp=2), ["test"])
    dumper = Dumper(tmp_path, rank=0)
    dumper.graph(0, "capture", gm, "after 00 capture")
    gm, records = run_passes(gm, plan, PassContext(0, 2, batch), PIPELINE, on_record=dumper.record)
    dumper.finish(plan, "export", 0.1, records)
    files = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    assert files == ["00_capture.py"] + [f"{i:02d}_{p.pass_name}.py" for i, p in enumerate(PIPELINE, 1)]
    index = [p.pass_name for p in PIPELINE].index("insert_collectives") + 1
    text = (tmp_path / "rank0" / f"{index:02d}_insert_collectives.py").read_text()
    header = text.splitlines()[0]
    assert re.match(rf"# after {index:02d} insert_collectives \([\d.]+ ms\) \| nodes (\d+)→(\d+) \| ", header)
    assert "all_reduce_grads +1" in header and "grad_sync_begin +1" in header
    assert "created_by=insert_collectives" in text and "h.0.attn.q" in text
    assert gp.Plan.from_json((tmp_path / "plan.json").read_text()) == plan
    assert "mesh: dp=2" in (tmp_path / "plan.txt").read_text()
    assert "insert_collectives" in (tmp_path / "summary.txt").read_text()


def test_disabled_pass_is_skipped_loudly(monkeypatch, caplog):
    monkeypatch.setenv("GRAPHPASS_DISABLE_PASSES", "insert_collectives")
    gm, records = _dp_graph("gpt")
    skipped = [r.name for r in records if r.skipped]
    assert skipped == ["insert_collectives"] and _collective_sequence(gm) == []
    assert "disabled by GRAPHPASS_DISABLE_PASSES" in caplog.text


@graph_pass("breaks_graph", provides=("broken",))
def _breaks_graph(gm, plan, ctx):
    node = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    node.args = (node.args[0], node.args[0]) + tuple(node.args[2:])  # weight := activation
    return gm


@graph_pass("needs_sharding", requires=("sharded_parameters",))
def _needs_sharding(gm, plan, ctx):
    return gm


def _gpt_dp2():
    """A captured GPT, its batch and a dp=2 plan, for running passes by hand."""
    batch = zoo.batches("gpt", 1, 4)[0]
    gm = capture(zoo.build("gpt"), batch).gm
    return gm, batch, plan_from_strategy(gm, gp.Strategy(dp=2), [])


def test_pass_failure_names_the_pass_and_those_before_it():
    gm, batch, plan = _gpt_dp2()
    ran = ", ".join(p.pass_name for p in PIPELINE)
    with pytest.raises(PassError, match=f"pass breaks_graph failed after {ran}: "):
        run_passes(gm, plan, PassContext(0, 2, batch), PIPELINE + (_breaks_graph,))
    with pytest.raises(PassError, match=r"pass needs_sharding requires \['sharded_parameters'\]"):
        run_passes(gm, plan, PassContext(0, 2, batch), (_needs_sharding,))


@graph_pass("shrinks_a_weight")
def _shrinks_a_weight(gm, plan, ctx):
    """Changes no node, only a tensor the graph holds: the program is not the one verified."""
    node = next(n for n in gm.graph.nodes if n.op == "get_attr" and "c_attn.weight" in n.target)
    owner, _, leaf = node.target.rpartition(".")
    weight = getattr(gm.get_submodule(owner), leaf)
    setattr(gm.get_submodule(owner), leaf, torch.nn.Parameter(weight.detach()[:, :7].clone()))
    return gm


@graph_pass("does_nothing")
def _does_nothing(gm, plan, ctx):
    return gm


def test_a_pass_that_changes_nothing_keeps_its_values_and_one_that_changes_a_tensor_is_verified():
    gm, batch, plan = _gpt_dp2()
    vals = {}
    run_passes(gm, plan, PassContext(0, 2, batch), (split_operators, _does_nothing),
               on_record=lambda i, record, g: vals.setdefault(i, [n.meta.get(meta.VAL) for n in g.graph.nodes]))
    # The same value objects: the unchanged program was not propagated again.
    assert len(vals[2]) == len(vals[1]) and all(a is b for a, b in zip(vals[1], vals[2]))
    gm, batch, plan = _gpt_dp2()
    with pytest.raises(PassError, match="pass shrinks_a_weight failed after split_operators"):
        run_passes(gm, plan, PassContext(0, 2, batch), (split_operators, _shrinks_a_weight))


def test_compile_single_process_matches_eager_and_records_history(tmp_path):
    model = zoo.build("gpt")
    batch = zoo.batches("gpt", 1, 4)[0]
    expected = model(*batch).item()
    dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=batch, dump_dir=tmp_path)
    assert isinstance(dmodel.graph_module, fx.GraphModule)
    assert dmodel.plan.mesh == {"dp": 1}
    assert [r.name for r in dmodel.history] == [p.pass_name for p in PIPELINE]
    assert dmodel.train_step(*batch).item() == pytest.approx(expected, rel=1e-6)
    assert all(p.grad is not None for p in dmodel.parameters())
    assert [k for k, _ in dmodel.named_parameters()][:2] == ["wte.weight", "wpe.weight"]
    assert list(dmodel.full_state_dict()) == list(model.state_dict())
    assert (tmp_path / "rank0" / "00_capture.py").exists() and (tmp_path / "plan.json").exists()


def test_compile_rejects_a_cluster_of_another_size():
    with pytest.raises(ValueError, match="cluster describes 8 devices but this process group has 1"):
        gp.compile(zoo.build("mlp"), gp.Cluster.preset("a100-80g"), example_inputs=zoo.batches("mlp", 1)[0])


def test_compile_rejects_bad_strategy_type():
    with pytest.raises(TypeError, match="strategy must be 'auto', a graphpass.Strategy or a graphpass.Plan, got int"):
        gp.compile(zoo.build("mlp"), example_inputs=zoo.batches("mlp", 1)[0], strategy=4)
