"""Fake values re-derived after each pass run only what the pass changed, and end where a full
run from scratch ends (graphpass.fake_values; one process, no communication)."""

from __future__ import annotations

import pytest
import torch

import graphpass as gp
import zoo
from graphpass import meta
from graphpass.capture import capture, reusing_captures
from graphpass.fake_values import propagate_fake
from graphpass.pass_manager import PassContext, run_passes
from graphpass.passes import PIPELINE
from graphpass.plan_builder import plan_from_strategy


def _described(value):
    """Everything a fake value says about a tensor, as comparable data."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device.type, value.stride(), value.storage_offset(),
                value._is_view())
    if isinstance(value, (tuple, list)):
        return tuple(_described(v) for v in value)
    return value


def _values(gm):
    return {n.name: _described(n.meta.get(meta.VAL)) for n in gm.graph.nodes}


def _from_scratch(gm, inputs):
    """The values a full run derives: the graph's memory of its last run dropped first."""
    setattr(gm.graph, "_gp_fake_values_last_run", None)
    ran = propagate_fake(gm, inputs)
    assert ran == len(gm.graph.nodes)
    return _values(gm)


CASES = [
    ("hf_llama", {"tp": 2, "sequence_parallel": True}),
    ("hf_llama", {"dp": 2, "zero": 3}),
    ("hf_t5", {"tp": 2}),
    ("hf_mixtral", {"dp": 2, "ep": 2}),
    ("gpt_deep", {"dp": 2, "zero": 3, "split": 2}),
    ("resnet", {"dp": 2, "zero": 2}),
]


@pytest.mark.parametrize("name, strategy", CASES, ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in s.items())}"
                                                        for n, s in CASES])
def test_values_after_every_pass_equal_a_run_from_scratch(name, strategy):
    model, batch = zoo.build(name), zoo.batches(name, 1, 4)[0]
    gm = capture(model, batch).gm
    plan = plan_from_strategy(gm, gp.Strategy(**strategy), ["test"])
    graphs = []
    out, _ = run_passes(gm, plan, PassContext(0, 2, batch), PIPELINE,
                        on_record=lambda i, record, g: graphs.append((record.name, _values(g))))
    final = _values(out)
    assert final == _from_scratch(out, batch)
    assert any(values != graphs[0][1] for _, values in graphs[1:]), "the passes changed no value"


@pytest.mark.parametrize("reused", [False, True])
def test_only_what_a_change_reaches_runs_again(reused):
    model, batch = zoo.build("gpt"), zoo.batches("gpt", 1, 4)[0]
    with reusing_captures():  # a reused capture (a copy of the first) starts where the first was
        first = capture(model, batch)
        gm = capture(zoo.build("gpt"), batch).gm if reused else first.gm
    n = len(gm.graph.nodes)
    reads = sum(node.op in ("placeholder", "get_attr", "output") for node in gm.graph.nodes)
    assert propagate_fake(gm, batch) == reads  # nothing changed: only the graph's reads run
    # Narrow one weight as a pass cutting a shard would: its users run again, up to where the
    # values are the same as before (nothing here: the shapes change through to the loss).
    weight = next(node for node in gm.graph.nodes if node.op == "get_attr" and node.target.endswith("mlp.up.weight"))
    users = set(weight.users)
    holder, attr = gm.get_submodule(weight.target.rsplit(".", 1)[0]), weight.target.rsplit(".", 1)[1]
    full = getattr(holder, attr)
    setattr(holder, attr, torch.nn.Parameter(full.detach()[: full.shape[0] // 2].clone()))
    with pytest.raises(Exception):  # the next linear's inner dimension no longer matches
        propagate_fake(gm, batch)
    setattr(holder, attr, full)
    assert propagate_fake(gm, batch) == n  # a failed run leaves nothing to trust: all again
    assert propagate_fake(gm, batch) == reads
    node = next(iter(users))
    node.args = tuple(node.args)
    assert propagate_fake(gm, batch) == reads  # equal arguments are no change
    # Changed arguments run the node; an equal value stops there (a residual add, swapped).
    add = next(node for node in gm.graph.nodes if node.target == torch.ops.aten.add.Tensor
               and all(isinstance(a, torch.fx.Node) for a in node.args)
               and node.args[0].meta[meta.VAL].shape == node.args[1].meta[meta.VAL].shape)
    add.args = (add.args[1], add.args[0])
    assert propagate_fake(gm, batch) == reads + 1
    assert _values(gm) == _from_scratch(gm, batch)


def test_a_reused_capture_runs_only_its_reads():
    batch = zoo.batches("hf_llama", 1, 4)[0]
    with reusing_captures():
        capture(zoo.build("hf_llama"), batch)
        again = capture(zoo.build("hf_llama", seed=1), batch)
    assert again.reused
    reads = sum(node.op in ("placeholder", "get_attr", "output") for node in again.gm.graph.nodes)
    assert propagate_fake(again.gm, batch) == reads
    assert _values(again.gm) == _from_scratch(again.gm, batch)
