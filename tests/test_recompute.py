"""The recompute pass: one checkpoint per layer, same numbers, fewer saved activations.

Unit tests run one process with a dp=1 plan, so insert_collectives does nothing and recompute is
the only pass that changes the graph; the graph with and without the pass are captured from the
same model, so they share parameter tensors. Numerics tests run dp with recompute on 2 and 4 gloo
ranks against one process.

Tolerances: in one process the recomputed graph is compared with rtol 0 / atol 0. The checkpoint
runs the same kernels on the same inputs in the same order, and non-reentrant checkpointing keeps
the backward graph as it was (it only changes where saved tensors come from), so loss and
gradients are bitwise equal on CPU. Across ranks the tolerance is test_dp.py's: each rank reduces
over its share of the batch and the all-reduce adds partial means in another order, so results
differ by fp32 rounding (~1e-7 relative); SGD with momentum keeps that at rounding level over 3
steps (DESIGN.md), and rtol 1e-5 / atol 1e-6 allow that and nothing more.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint

import graphpass as gp
from graphpass import meta
from graphpass.plan_builder import plan_from_strategy
from graphpass.capture import capture
from graphpass.pass_manager import PassContext, PassError, run_passes
from graphpass.ops import op_name
from graphpass.passes import PIPELINE
from graphpass.passes.collectives import is_collective
from graphpass.passes.recompute import recompute

import zoo

RTOL, ATOL = 1e-5, 1e-6
NUMERICS_MODELS = ("gpt", "encoder", "hf_llama")


def _compiled(model: nn.Module, batch, dp: int = 1, recompute_layers: bool = True):
    """Capture ``model`` and run the pipeline with a uniform plan; returns (graph, plan, records)."""
    gm = capture(model, batch).gm
    plan = plan_from_strategy(gm, gp.Strategy(dp=dp, recompute=recompute_layers), [])
    gm, records = run_passes(gm, plan, PassContext(0, dp, batch), PIPELINE)
    return gm, plan, records


def _checkpoints(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.utils.checkpoint.checkpoint]


def _saved_bytes(gm: fx.GraphModule, batch) -> tuple[torch.Tensor, int, int]:
    """Run forward under ``saved_tensors_hooks``: (loss, bytes packed, distinct activation bytes).

    "Bytes packed" sums every pack (a tensor saved by three ops counts three times); "distinct
    activation bytes" counts each saved storage once and leaves out parameters, which stay alive
    whatever autograd saves. A checkpoint saves its inputs through the same hook, so both numbers
    include what it keeps for recomputation.
    """
    params = {p.untyped_storage().data_ptr() for p in gm.parameters()}
    packed = 0
    activations: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal packed
        packed += t.numel() * t.element_size()
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            activations[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = gm(*batch)[0]
    return loss, packed, sum(activations.values())


# --------------------------------------------------------------------------- one process


def test_recompute_checkpoints_every_gpt_layer_with_equal_gradients_and_saves_less():
    model = zoo.build("gpt")
    batch = zoo.batches("gpt", 1, 8)[0]
    plain, _, _ = _compiled(model, batch, recompute_layers=False)
    gm, plan, records = _compiled(model, batch)
    assert plan.recompute == (0, 1)
    (record,) = [r for r in records if r.name == "recompute"]
    assert record.op_deltas["checkpoint"] == 2

    checkpoints = _checkpoints(gm)
    assert [meta.get(c, meta.LAYER) for c in checkpoints] == [0, 1]
    for call in checkpoints:
        module = call.args[0]
        assert module.op == "get_attr" and isinstance(getattr(gm, module.target), fx.GraphModule)
        assert call.kwargs == {"use_reentrant": False}
        assert meta.get(call, meta.CREATED_BY) == "recompute"
        assert meta.get(call, meta.MODULE_PATH) == f"h.{meta.get(call, meta.LAYER)}"
    # Nothing of a layer is left at top level but its parameters (get_attr).
    left = [n.name for n in gm.graph.nodes if n.op == "call_function" and n not in checkpoints
            and n.meta.get(meta.LAYER) is not None]
    assert left == []
    params = list(plain.parameters())
    assert [id(p) for p in gm.parameters()] == [id(p) for p in params]

    plain_loss, plain_packed, plain_activations = _saved_bytes(plain, batch)
    loss, packed, activations = _saved_bytes(gm, batch)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    grads = torch.autograd.grad(loss, params)
    plain_grads = torch.autograd.grad(plain_loss, params)
    for (name, _), grad, plain_grad in zip(gm.named_parameters(), grads, plain_grads):
        torch.testing.assert_close(grad, plain_grad, rtol=0, atol=0, msg=lambda m: f"grad {name}: {m}")

    # Measured here (GPT 2 x 64 wide, batch 8 x 32): packed 3.63 MB -> 1.26 MB (-65%), distinct
    # activations 2.51 MB -> 0.53 MB (-79%). Each layer keeps only its input (8x32x64 fp32 = 64 KiB)
    # instead of ~20 activations; what remains is mostly the LM head's logits and the loss.
    assert packed < plain_packed and activations < plain_activations
    assert activations < 0.3 * plain_activations, (activations, plain_activations)
    logging.getLogger(__name__).info(
        "saved bytes: packed %d -> %d, distinct activations %d -> %d",
        plain_packed, packed, plain_activations, activations,
    )


def test_gpt_checkpoint_and_collective_sequence_is_pinned():
    gm, _, _ = _compiled(zoo.build("gpt"), zoo.batches("gpt", 1, 4)[0], dp=2)
    sequence = []
    for node in gm.graph.nodes:
        if node.target is torch.utils.checkpoint.checkpoint:
            sequence.append(f"checkpoint({node.args[0].target})")
        elif is_collective(node):
            sequence.append(op_name(node))
    assert sequence == [
        "grad_sync_begin",
        "all_reduce_grads",  # one bucket, untouched by recompute
        "checkpoint(recompute_layer_0)",
        "checkpoint(recompute_layer_1)",
        "all_reduce",
    ]
    # Layer 1 reads layer 0's one output, then its parameters as the gradient bucket hands them out.
    layer_0, layer_1 = _checkpoints(gm)
    assert layer_1.args[1] is layer_0
    for value in layer_0.args[2:] + layer_1.args[2:]:
        assert value.target is operator.getitem and is_collective(value.args[0]), value.name
    assert len(layer_0.args) == 2 + 16  # module, input activation, 16 parameters of a block
    body = [op_name(n) for n in gm.recompute_layer_0.graph.nodes if n.op == "call_function"]
    assert body == [
        "aten.layer_norm", "aten.linear", "aten.view", "aten.transpose",
        "aten.linear", "aten.view", "aten.transpose", "aten.linear", "aten.view", "aten.transpose",
        "aten.scaled_dot_product_attention", "aten.transpose", "aten.reshape", "aten.linear",
        "aten.add", "aten.layer_norm", "aten.linear", "aten.gelu", "aten.linear", "aten.dropout",
        "aten.add",
    ]


def test_empty_recompute_is_a_logged_no_op(caplog):
    batch = zoo.batches("gpt", 1, 4)[0]
    with caplog.at_level(logging.INFO, logger="graphpass.passes.recompute"):
        gm, _, records = _compiled(zoo.build("gpt"), batch, recompute_layers=False)
    (record,) = [r for r in records if r.name == "recompute"]
    assert record.op_deltas == {}
    assert _checkpoints(gm) == []
    assert "plan.recompute is empty; nothing to do" in caplog.text


def test_unknown_layer_index_is_a_value_error_naming_it_and_the_layers():
    batch = zoo.batches("gpt", 1, 4)[0]
    gm = capture(zoo.build("gpt"), batch).gm
    plan = plan_from_strategy(gm, gp.Strategy(dp=1), [])
    plan = dataclasses.replace(plan, activations={layer: gp.ActivationPlan(recompute=True) for layer in (1, 7)})
    message = r"Plan\.recompute names layer 7, which this graph does not have \(its repeated layers are \[0, 1\]"
    with pytest.raises(ValueError, match=message):
        recompute(gm, plan, PassContext(0, 1, batch))
    # Through the runner it is wrapped, naming the pass, with the ValueError as the cause.
    with pytest.raises(PassError, match=r"pass recompute failed after [\w, ]+: " + message) as info:
        run_passes(gm, plan, PassContext(0, 1, batch), PIPELINE)
    assert isinstance(info.value.__cause__, ValueError)


class _Detour(nn.Module):
    """Layer 0 is ``blocks.0`` and ``post.0``, with an unlayered module between them."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.mix = nn.Linear(8, 8)
        self.post = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x):
        c = torch.tanh(self.post[0](self.mix(torch.tanh(self.blocks[0](x)))))
        return (self.blocks[1](c) * c).mean()


class _NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.b(torch.tanh(self.bn(self.a(x))))


class _Stack(nn.Module):
    def __init__(self, block: type, n: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def _run_both(model_fn, batch):
    """Train one step with and without recompute from equal weights: (plain, recomputed) models
    and graphs, with gradients in ``.grad``."""
    torch.manual_seed(0)
    plain_model = model_fn()
    model = model_fn()
    model.load_state_dict(plain_model.state_dict())
    plain, _, _ = _compiled(plain_model, batch, recompute_layers=False)
    gm, _, _ = _compiled(model, batch)
    for graph in (plain, gm):
        graph(*batch)[0].backward()
    return plain_model, model, gm


def test_layer_that_leaves_and_reenters_is_split_into_consecutive_checkpoints(caplog):
    with caplog.at_level(logging.WARNING, logger="graphpass.passes.recompute"):
        plain, model, gm = _run_both(_Detour, (torch.randn(4, 8),))
    assert [c.args[0].target for c in _checkpoints(gm)] == [
        "recompute_layer_0", "recompute_layer_0_1", "recompute_layer_1",
    ]
    assert "layer 0 cannot be one checkpoint; splitting it at 'linear_2', which uses 'linear_1'" in caplog.text
    for p, q in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def test_batch_norm_statistics_are_updated_once_per_step():
    plain, model, gm = _run_both(lambda: _Stack(_NormBlock), (torch.randn(4, 8),))
    # The batch norm stays outside the checkpoints (recomputing it would update its running
    # statistics again), so each layer is two checkpoints around it.
    assert [c.args[0].target for c in _checkpoints(gm)] == [
        "recompute_layer_0", "recompute_layer_0_1", "recompute_layer_1", "recompute_layer_1_1",
    ]
    assert [op_name(n) for n in gm.graph.nodes].count("aten.batch_norm") == 2
    for (key, value), expected in zip(model.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    for p, q in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


class _CountingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("steps", torch.ones(()))

    def forward(self, x):
        y = self.fc(x) * self.steps
        self.steps.add_(1)  # written after it is read: recomputing the layer cannot be right
        return y


def test_in_place_write_to_a_tensor_the_layer_reads_is_refused():
    batch = (torch.randn(4, 8),)
    gm = capture(_Stack(_CountingBlock), batch).gm
    plan = plan_from_strategy(gm, gp.Strategy(dp=1, recompute=True), [])
    with pytest.raises(ValueError, match=r"cannot recompute layer 0: node 'add_' \(aten.add_.Tensor\) writes "
                       r"in place to 'layers_0_steps', which the layer's node 'mul' reads"):
        recompute(gm, plan, PassContext(0, 1, batch))


# --------------------------------------------------------------------------- gloo ranks


def _train_dp_recompute(name: str, steps: int, batch: int, lr: float = 0.05):
    model = zoo.build(name)
    data = zoo.batches(name, steps, batch)
    strategy = gp.Strategy(dp=dist.get_world_size(), recompute=True)
    dmodel = zoo.compile(model, data[0], strategy)
    num_checkpoints = len(_checkpoints(dmodel.graph_module))
    opt = torch.optim.SGD(dmodel.parameters(), lr=lr, momentum=0.9)
    losses, first_grads = [], None
    for b in data:
        losses.append(dmodel.train_step(*b).item())
        if first_grads is None:
            first_grads = {k: p.grad.clone() for k, p in dmodel.named_parameters()}
        opt.step()
        opt.zero_grad()
    return num_checkpoints, losses, dmodel.full_state_dict(), first_grads


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_with_recompute_matches_one_process(rank_pool, world_size):
    pool = rank_pool(world_size)
    for name in NUMERICS_MODELS:
        ref_losses, ref_state, ref_grads = zoo.train_reference(name, steps=3, batch=8)
        results = pool.run(_train_dp_recompute, name, 3, 8, timeout_s=300)
        for rank, (num_checkpoints, losses, state, grads) in enumerate(results):
            where = f"{name} rank {rank}/{world_size}"
            assert num_checkpoints == 2, where  # every zoo model here has 2 layers
            zoo.assert_matches_reference(where, losses, state, ref_losses, ref_state, grads, ref_grads, RTOL, ATOL)
