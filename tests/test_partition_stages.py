"""Pipeline stages cut from the captured graph: chained in one process they are the graph.

Each stage runs on what the previous one returned (stage 0 on the graph's inputs), as
``torch.distributed.pipelining`` chains them. In one process the stages share the original
parameter tensors, so a tied weight read by two stages accumulates both gradients into one
``.grad`` as the original graph does. The chained stages run the same kernels on the same inputs
in the same order as the original graph, so loss and gradients are compared bitwise (rtol 0,
atol 0).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from graphpass import meta
from graphpass.capture import capture
from graphpass.passes.partition_stages import cut_stages, shared_parameters
from graphpass.stages import layer_starts, stage_starts

import zoo


def _captured(name: str, batch: int = 4):
    model = zoo.build(name)
    inputs = zoo.batches(name, 1, batch)[0]
    return capture(model, inputs).gm, inputs


def _chain(stages: list[fx.GraphModule], inputs) -> torch.Tensor:
    values = tuple(inputs)
    for stage in stages[:-1]:
        values = stage(*values)
        assert isinstance(values, tuple) and all(isinstance(v, torch.Tensor) for v in values)
    out = stages[-1](*values)
    return out[0] if isinstance(out, (tuple, list)) else out


def _reads_an_input(node: fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _grads(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in gm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name,pp", [("gpt", 2), ("gpt_deep", 3), ("gpt_deep", 4), ("hf_llama", 2), ("hf_gpt2", 2),
                                     ("encoder", 2), ("hf_t5", 2)])
def test_chained_stages_compute_the_graphs_loss_and_gradients(name, pp):
    gm, inputs = _captured(name)
    expected = gm(*inputs)
    expected = expected[0] if isinstance(expected, (tuple, list)) else expected
    expected.backward()
    reference = _grads(gm)
    gm.zero_grad(set_to_none=True)

    starts = stage_starts(gm, pp)
    stages = cut_stages(gm, starts)
    assert len(stages) == pp
    loss = _chain(stages, inputs)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    got = _grads(gm)
    assert got.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(got[key], reference[key], rtol=0, atol=0, msg=key)
    # Every op of the graph runs in a stage under its original name; an op runs in several only
    # when it reads no input of the step (a rotary table made from a buffer): each stage makes
    # its own rather than receive it.
    ops = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    staged = [n.name for stage in stages for n in stage.graph.nodes if n.op == "call_function"]
    assert set(staged) == set(ops)
    for name in {n for n in staged if staged.count(n) > 1}:
        assert not _reads_an_input(ops[name]), name
    # Stage graphs keep the original parameter names.
    for stage in stages:
        for pname, p in stage.named_parameters():
            assert gm.get_parameter(pname) is p


def test_layers_are_split_evenly_and_the_earlier_stages_take_the_remainder():
    gm, _ = _captured("gpt_deep")  # 4 layers
    layers = layer_starts(gm)
    assert [layer for layer, _ in layers] == [f"h.{i}" for i in range(len(layers))]
    first = [name for _, name in layers]
    n = len(layers)
    assert stage_starts(gm, 1) == ("*",)
    assert stage_starts(gm, 2) == ("*", first[n // 2])
    # 4 layers over 3 stages: 2, 1, 1
    assert stage_starts(gm, 3) == ("*", first[2], first[3])
    stages = cut_stages(gm, stage_starts(gm, 3))
    owned = [{n.meta.get(meta.LAYER) for n in s.graph.nodes if n.op == "call_function"} - {None} for s in stages]
    assert owned == [{0, 1}, {2}, {3}]


def test_a_value_that_skips_a_stage_is_carried_through_it():
    """The targets are read only by the loss in the last stage: stage 0 receives them with the
    step's inputs and every stage passes them on."""
    gm, inputs = _captured("gpt_deep")
    stages = cut_stages(gm, stage_starts(gm, 3))
    targets = [n.name for n in gm.graph.nodes if n.op == "placeholder"][1]
    for s, stage in enumerate(stages):
        takes = [n.name for n in stage.graph.nodes if n.op == "placeholder"]
        assert targets in takes, s
        if s < len(stages) - 1:
            returned = stage.graph.find_nodes(op="output")[0].args[0]
            assert targets in [n.name for n in returned]
    # Each stage returns exactly what the next one takes, in order.
    for stage, following in zip(stages, stages[1:]):
        returned = [n.name for n in stage.graph.find_nodes(op="output")[0].args[0]]
        assert returned == [n.name for n in following.graph.nodes if n.op == "placeholder"]
    # The last stage returns the graph's outputs, with their roles.
    last_out = stages[-1].graph.find_nodes(op="output")[0]
    assert meta.get(last_out, meta.ROLE) == meta.get(gm.graph.find_nodes(op="output")[0], meta.ROLE)


def test_a_tied_embedding_and_head_is_kept_on_both_stages_and_reported_shared():
    gm, _ = _captured("gpt")
    stages = cut_stages(gm, stage_starts(gm, 2))
    shared = shared_parameters(stages)
    tied = [n for n in gm.graph.nodes if n.op == "get_attr" and len(meta.get(n, meta.STATE_KEYS, ())) > 1]
    assert tied, "the zoo GPT ties its embedding and LM head"
    assert shared == {tied[0].target: [0, 1]}
    untied, _ = _captured("hf_llama")
    assert shared_parameters(cut_stages(untied, stage_starts(untied, 2))) == {}


def test_an_encoder_and_a_decoder_layer_with_one_index_are_two_layers():
    """T5's encoder and decoder blocks both count from 0: cut evenly, 2 stages put the encoder on
    one rank and the decoder on the other."""
    gm, _ = _captured("hf_t5")
    layers = [layer for layer, _ in layer_starts(gm)]
    assert [layer.rsplit(".", 3)[-3:] for layer in layers] == [
        ["encoder", "block", "0"], ["encoder", "block", "1"], ["decoder", "block", "0"], ["decoder", "block", "1"]]
    assert stage_starts(gm, 2)[1] == dict(layer_starts(gm))[layers[2]]


def test_bad_stage_counts_and_cuts_are_named():
    gm, _ = _captured("gpt")
    n = len(layer_starts(gm))
    with pytest.raises(ValueError, match=rf"Strategy.pp={n + 1} is larger than the model's {n} repeated layers"):
        stage_starts(gm, n + 1)
    flat = capture(_TwoLinears(), (torch.randn(4, 8),)).gm
    with pytest.raises(ValueError, match="Strategy.pp=2: the model has no repeated layers"):
        stage_starts(flat, 2)
    with pytest.raises(ValueError, match="must start with"):
        cut_stages(gm, ("linear",))
    with pytest.raises(ValueError, match="not an op of the captured graph"):
        cut_stages(gm, ("*", "no_such_node"))
    first = [name for _, name in layer_starts(gm)]
    with pytest.raises(ValueError, match="not in graph order"):
        cut_stages(gm, ("*", first[1], first[0]))


class _TwoLinears(torch.nn.Module):
    """No nn.ModuleList / nn.Sequential: nothing to cut at."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.second(self.first(x).relu()).mean()


def test_after_every_pass_each_stage_synchronises_its_own_parameters():
    """With pp x dp the passes run on the whole graph, then it is cut: partition_stages gave the
    tied embedding / LM head one node per stage, so every gradient bucket holds one stage's
    parameters, and each stage gets its own copy of the gradient-sync handle."""
    import graphpass as gp
    from graphpass.pass_manager import PassContext, run_passes
    from graphpass.passes import passes_for
    from graphpass.plan_builder import plan_from_strategy
    from graphpass.runtime import collectives as ops

    gm, inputs = _captured("gpt")
    plan = plan_from_strategy(gm, gp.Strategy(pp=2, dp=2, microbatches=2), ["test"])
    gm, _ = run_passes(gm, plan, PassContext(rank=0, world_size=4, example_inputs=tuple(inputs)), passes_for(plan))
    tied = [n for n in gm.graph.nodes if n.op == "get_attr" and len(meta.get(n, meta.STATE_KEYS, ())) > 1]
    assert len(tied) == 2 and tied[0].target == tied[1].target  # one node per stage reading it
    stages = cut_stages(gm, plan.stages)
    for s, stage in enumerate(stages):
        calls = [n for n in stage.graph.nodes if n.op == "call_function"]
        assert sum(n.target is ops.grad_sync_begin for n in calls) == 1, s
        buckets = [n for n in calls if n.target is ops.all_reduce_grads]
        assert buckets, s
        bucketed = {a.target for b in buckets for a in b.args[1:]}
        held = {n.target for n in stage.graph.nodes if n.op == "get_attr" and meta.get(n, meta.ATTR_KIND) == "parameter"}
        assert bucketed == held, s  # every parameter of the stage, and only those


def test_a_tied_weight_read_through_each_stages_own_node_is_still_not_split():
    """partition_stages gives the tied LM head its own node on the last stage; a hand-written
    Plan.split naming the head must still see the tie (splitting would untie the embedding)."""
    import graphpass as gp
    from graphpass.pass_manager import PassContext, PassError, run_passes
    from graphpass.passes import passes_for
    from graphpass.plan_builder import plan_from_strategy

    gm, inputs = _captured("gpt")
    plan = plan_from_strategy(gm, gp.Strategy(pp=2, microbatches=2), ["test"])
    head = next(n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get(meta.MODULE_PATH) == "lm_head")
    plan = plan.with_tensor(head.name, split=gp.Split("out", 2))
    with pytest.raises(PassError, match="would untie the weights"):
        run_passes(gm, plan, PassContext(rank=0, world_size=2, example_inputs=tuple(inputs)), passes_for(plan))

