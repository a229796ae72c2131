"""split_operators (OSDP operator splitting): numerics, the pinned graph, memory, bad input.

One-process tests run the pass pipeline on the captured graph and compare loss and gradients with
the unsplit model. Multi-rank tests train with ZeRO-3 + split on 2 and 4 gloo ranks against one
process, as tests/test_zero.py does.

Tolerances: splitting "out" computes every output element with the same dot product, but the
input's gradient becomes a sum over slices and BLAS blocks differently shaped matrices
differently; splitting "in" re-associates the forward sum too. Both change only the order of
fp32 additions: on the zoo GPT the loss is bitwise equal and the gradients differ by at most
6e-8 absolute, 8e-7 relative (measured, parts 2 and 3, both directions). The one-process checks
use rtol 1e-5 / atol 2e-7; the atol matters for the attention key biases, whose gradient is 0 in
exact arithmetic (softmax ignores a constant added to every key) and ~1e-11 in fp32, so it is
compared in absolute terms only. The multi-rank checks use test_zero.py's
rtol 1e-5 / atol 1e-6: per-rank partial means plus reduce-scatter add another reordering, and
SGD with momentum keeps it at that level over 3 steps; a slice offset by one row, a gradient not
averaged or a slice gathered into the wrong place are errors of order 1e-2.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import graphpass as gp
from graphpass import meta
from graphpass.plan_builder import plan_from_strategy
from graphpass.capture import capture
from graphpass.pass_manager import PassContext, PassError, run_passes
from graphpass.ops import op_name
from graphpass.passes import PIPELINE
from graphpass.passes.collectives import is_collective
from graphpass.ops import is_linear
from graphpass.passes.split_operators import split_operators
from graphpass.runtime.memory import MemoryProbe, optimizer_state_tensors

import zoo

RTOL, ATOL = 1e-5, 1e-6


def _plan(gm: fx.GraphModule, strategy: gp.Strategy, split: dict | None = None) -> gp.Plan:
    """``strategy``'s plan with the splits ``split`` names by node (a linear, as plans written
    before the per-tensor form named them, or a weight)."""
    plan = plan_from_strategy(gm, strategy, ["test"])
    for node, spec in (split or {}).items():
        plan = plan.with_tensor(node, split=gp.Split(**spec))
    return plan


def _untied_linears(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if is_linear(n) and len(n.args[1].users) == 1]


def _full_grads(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Gradients under the original state_dict keys, split slices concatenated back."""
    grads: dict[str, torch.Tensor] = {}
    slices: dict[str, list] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or meta.get(node, meta.ATTR_KIND) != "parameter":
            continue
        grad = gm.get_parameter(node.target).grad
        split = meta.slice_of(node)
        if split is None:
            grads.update((key, grad) for key in meta.get(node, meta.STATE_KEYS))
        else:
            slices.setdefault(split.state_keys, []).append((split.index, split.dim, grad))
    for keys, parts in slices.items():
        parts.sort(key=lambda p: p[0])
        full = torch.cat([g for _, _, g in parts], dim=parts[0][1])
        grads.update((key, full) for key in keys)
    return grads


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("route", ["export", "symbolic_trace"])
@pytest.mark.parametrize("dim, parts", [("out", 2), ("out", 3), ("in", 2), ("in", 3)])
def test_split_keeps_loss_and_gradients(route, dim, parts):
    # 64 and 256 features into 3 parts are uneven (22/21/21, 86/85/85): tensor_split's sizes.
    batch = zoo.batches("gpt", 1, 4)[0]
    model = zoo.build("gpt")
    expected_loss = model(*batch)
    expected_loss.backward()
    expected = {k: p.grad for k, p in model.named_parameters(remove_duplicate=False)}

    gm = capture(zoo.build("gpt"), batch, route=route).gm
    split = {name: {"dim": dim, "parts": parts} for name in _untied_linears(gm)}
    assert len(split) == 12  # every linear but the lm_head, which is tied to wte
    gm, records = run_passes(gm, _plan(gm, gp.Strategy(), split), PassContext(0, 1, batch), PIPELINE)
    assert sum(is_linear(n) for n in gm.graph.nodes) == 12 * parts + 1
    deltas = next(r for r in records if r.name == "split_operators").op_deltas
    assert deltas.get("aten.cat" if dim == "out" else "aten.slice") == 12 * (1 if dim == "out" else parts)
    slice_shapes = {tuple(p.shape) for n, p in gm.named_parameters() if n.startswith("h.0.mlp.up.weight.")}
    assert slice_shapes == ({(86, 64), (85, 64)} if (dim, parts) == ("out", 3) else slice_shapes)

    loss = gm(*batch)[0]
    loss.backward()
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=0)
    grads = _full_grads(gm)
    assert sorted(grads) == sorted(expected)
    for key, grad in expected.items():
        torch.testing.assert_close(grads[key], grad, rtol=RTOL, atol=2e-7, msg=lambda m: f"{key}: {m}")


def _zero3_split_graph(split: int = 2, dp: int = 2) -> fx.GraphModule:
    batch = zoo.batches("gpt", 1, 4)[0]
    gm = capture(zoo.build("gpt"), batch).gm
    plan = plan_from_strategy(gm, gp.Strategy(dp=dp, zero=3, split=split), [])
    gm, _ = run_passes(gm, plan, PassContext(0, dp, batch), PIPELINE)
    return gm


def test_zero3_split_gathers_each_slice_right_before_its_linear():
    gm = _zero3_split_graph(split=2)
    sequence = []
    for node in gm.graph.nodes:
        if is_collective(node) and node.kwargs.get("stage") and meta.get(node, meta.LAYER) == 0:
            sequence.append(f"gather({', '.join(p.target.removeprefix('h.0.') for p in node.args[1:])})")
        elif meta.get(node, meta.LAYER, None) == 0 and op_name(node) in ("aten.linear", "aten.cat"):
            if op_name(node) == "aten.cat":
                sequence.append(f"cat({', '.join(a.name for a in node.args[0])})")
            else:
                sequence.append(node.name)
    slices = []
    for linear, module in (("linear", "attn.q"), ("linear_1", "attn.k"), ("linear_2", "attn.v"),
                           ("linear_3", "attn.proj"), ("linear_4", "mlp.up"), ("linear_5", "mlp.down")):
        slices += [
            f"gather({module}.weight.split0, {module}.bias.split0)", f"{linear}_split0",
            f"gather({module}.weight.split1, {module}.bias.split1)", f"{linear}_split1",
            f"cat({linear}_split0, {linear}_split1)",
        ]
    assert sequence == (
        ["gather(ln_1.weight, ln_1.bias)"] + slices[:20] + ["gather(ln_2.weight, ln_2.bias)"] + slices[20:]
    )
    # Each slice linear's gather feeds that linear alone, and sits right before it (then getitems).
    slice_linears = [n for n in gm.graph.nodes if is_linear(n) and "_split" in n.name]
    assert len(slice_linears) == 24
    for node in slice_linears:
        gather = node.args[1].args[0]
        assert is_collective(gather) and {u for item in gather.users for u in item.users} == {node}
        assert node.prev.prev.prev is gather  # gather, getitem (weight), getitem (bias), linear
    # The whole graph: stage-3 gathers of the embeddings, 2 layers x (2 LayerNorm + 12 slices), ln_f.
    gathers = [n for n in gm.graph.nodes if is_collective(n) and n.kwargs.get("stage") == 3]
    assert len(gathers) == 1 + 2 * (2 + 12) + 1
    # Slices are sharded over dp like any parameter: up.weight [256, 64] → 2 x [128, 64] → [64, 64].
    assert tuple(gm.get_parameter("h.0.mlp.up.weight.split1").shape) == (64, 64)
    up1 = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "h.0.mlp.up.weight.split1")
    layout = meta.get(up1, meta.LAYOUT)
    assert layout.to_json() == {
        "shape": [256, 64], "placements": {"dp": "Shard(0)"}, "sizes": {"dp": 2}, "zero": 3,
        "slice": {"dim": 0, "start": 128, "size": 128, "index": 1, "parts": 2, "source": "h_0_mlp_up_weight",
                  "target": "h.0.mlp.up.weight", "state_keys": ["h.0.mlp.up.weight"]},
    }
    assert layout.shape_on("dp") == (128, 64) and layout.local_shape == (64, 64)


def test_strategy_split_skips_tied_linears_and_logs_why(caplog):
    batch = zoo.batches("gpt", 1, 4)[0]
    gm = capture(zoo.build("gpt"), batch).gm
    gp.Strategy(dp=1, zero=3, split=2).check(1)  # one rank: ZeRO-3 has nothing to shard, the split still runs
    with caplog.at_level(logging.INFO, logger="graphpass.splittable"):
        plan = plan_from_strategy(gm, gp.Strategy(zero=3, split=4), [])
    assert len(plan.split) == 12 and "linear_12" not in plan.split  # lm_head shares wte.weight
    assert "not splitting linear_12 (lm_head)" in caplog.text and "would untie the weights" in caplog.text
    assert "operator splitting: 12 linears into [4] slices" in plan.explain()
    assert plan_from_strategy(gm, gp.Strategy(), []).split == {}


def test_empty_split_plan_is_a_logged_no_op(caplog):
    batch = zoo.batches("gpt", 1, 4)[0]
    gm = capture(zoo.build("gpt"), batch).gm
    before = gm.code
    with caplog.at_level(logging.INFO, logger="graphpass.passes.split_operators"):
        out = split_operators(gm, _plan(gm, gp.Strategy()), PassContext(0, 1, batch))
    assert out.code == before and "nothing to do" in caplog.text


def test_split_larger_than_the_dimension_names_the_op():
    batch = zoo.batches("gpt", 1, 4)[0]
    gm = capture(zoo.build("gpt"), batch).gm
    ctx = PassContext(0, 1, batch)
    too_many = _plan(gm, gp.Strategy(), {"linear_4": {"dim": "in", "parts": 65}})
    with pytest.raises(ValueError, match=r"Plan.split\['linear_4'\] asks for 65 slices of linear 'linear_4' "
                       r"\(module h.0.mlp.up\), but its weight 'h.0.mlp.up.weight' of shape \[256, 64\] has "
                       r"only 64 input features; use parts <= 64"):
        split_operators(gm, too_many, ctx)
    assert "h_0_mlp_up_weight" in {n.name for n in gm.graph.nodes}  # nothing was split
    tied = _plan(gm, gp.Strategy(), {"linear_12": {"dim": "out", "parts": 2}})
    with pytest.raises(ValueError, match=r"cannot split linear 'linear_12' \(module lm_head\): its weight "
                       r"'wte.weight' \(wte.weight, lm_head.weight\) is also used by \['embedding'\]"):
        split_operators(gm, tied, ctx)
    not_linear = _plan(gm, gp.Strategy(), {"gelu": {"dim": "out", "parts": 2}})
    with pytest.raises(ValueError, match=r"Plan.split names 'gelu', which is a call_function aten.gelu.default, not a linear"):
        split_operators(gm, not_linear, ctx)
    # Through compile the pass runner names the pass as well.
    plan = _plan(gm, gp.Strategy(), {"linear_5": {"dim": "out", "parts": 65}})
    with pytest.raises(PassError, match=r"pass split_operators failed after global_loss_mean: .*linear 'linear_5' "
                       r"\(module h.0.mlp.down\).* has only 64 output features"):
        gp.compile(zoo.build("gpt"), example_inputs=batch, strategy=plan)


def test_compile_single_process_with_split_trains_and_rebuilds_the_state_dict():
    batch = zoo.batches("gpt", 1, 4)[0]
    model = zoo.build("gpt")
    expected = model(*batch).item()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    dmodel = gp.compile(model, example_inputs=batch, strategy=gp.Strategy(zero=3, split=4))
    names = [k for k, _ in dmodel.named_parameters()]
    assert "h.0.mlp.up.weight.split3" in names and "h.0.mlp.up.weight" not in names
    # compile took ownership of the replaced full weight, as for ZeRO shards.
    assert model.h[0].mlp.up.weight.numel() == 0
    assert dmodel.train_step(*batch).item() == pytest.approx(expected, rel=1e-6)
    state = dmodel.full_state_dict()
    assert list(state) == list(reference)
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)


def test_a_saved_plan_with_splits_keyed_by_the_linear_still_compiles_and_splits():
    """A plan JSON written before the per-tensor form (placements, zero, split keyed by the
    linear) compiles to the same program as the same plan keyed by the weight."""
    batch = zoo.batches("gpt", 1, 4)[0]
    gm = capture(zoo.build("gpt"), batch).gm
    plan = _plan(gm, gp.Strategy())
    up = next(n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get(meta.MODULE_PATH) == "h.0.mlp.up")
    data = plan.to_dict()
    tensors = data.pop("tensors")
    legacy = {**data, "placements": {n: t["placements"] for n, t in tensors.items() if "placements" in t},
              "split": {up.name: {"dim": "in", "parts": 2}}}
    old = gp.Plan.from_json(json.dumps(legacy))
    new = plan.with_tensor("h_0_mlp_up_weight", split=gp.Split("in", 2))
    assert old.splits(gm) == new.splits(gm) == {up.name: gp.Split("in", 2)}
    model = zoo.build("gpt")
    expected = model(*batch).item()
    dmodel = gp.compile(model, example_inputs=batch, strategy=old)
    assert "h.0.mlp.up.weight.split1" in dict(dmodel.named_parameters())
    # the in-split re-associates the sum of the products: fp32 rounding, not a different value
    assert dmodel.train_step(*batch).item() == pytest.approx(expected, rel=1e-6)


# --------------------------------------------------------------------------- multi-rank


def _in_split(plan: gp.Plan) -> gp.Plan:
    for node in plan.split:
        plan = plan.with_tensor(node, split=gp.Split("in", 2))
    return plan


def _without_zero(plan: gp.Plan) -> gp.Plan:
    for node in plan.zero:
        plan = plan.with_tensor(node, zero=0)
    return dataclasses.replace(plan, strategy=None)


def _train(name: str, strategy_kwargs: dict, plan_edit=None, steps: int = 3, batch: int = 8):
    dmodel, data = zoo.compile_on_ranks(name, strategy_kwargs, steps, batch, plan_edit)
    assert dmodel.plan.split, "the strategy split nothing"
    return zoo.train_compiled(dmodel, data), dmodel.full_state_dict()


def _check(results, what, ref):
    ref_losses, ref_state, _ = ref
    for rank, (losses, state) in enumerate(results):
        zoo.assert_matches_reference(f"{what} rank {rank}", losses, state, ref_losses, ref_state, rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_with_split_matches_one_process(rank_pool, world_size):
    """Each model with split 2 or 4, alternating over models and flipped between world sizes:
    every model meets both splits and each world size both (all pairs double the time)."""
    pool = rank_pool(world_size)
    for i, name in enumerate(("gpt", "encoder", "hf_llama")):
        ref = zoo.train_reference(name, steps=3, batch=8)
        split = (2, 4)[(i + world_size // 4) % 2]
        results = pool.run(_train, name, {"zero": 3, "split": split}, timeout_s=300)
        _check(results, f"{name} zero=3 split={split} on {world_size}", ref)
    if world_size == 2:
        ref = zoo.train_reference("gpt", steps=3, batch=8)
        # Split along input features (slices summed), and a Plan that splits without ZeRO (slices
        # all-reduced; a Strategy refuses split without zero=3, a hand-written Plan runs as written).
        _check(pool.run(_train, "gpt", {"zero": 3, "split": 2}, _in_split, timeout_s=300), "gpt in-split", ref)
        _check(pool.run(_train, "gpt", {"zero": 3, "split": 2}, _without_zero, timeout_s=300), "gpt dp split", ref)


class WideMLP(nn.Module):
    """Two 4 MB linears around a narrow residual stream: gathered weights dominate the peak."""

    def __init__(self, width: int = 256, hidden: int = 4096):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.down(F.gelu(self.up(x))), y)


def _peak_bytes(split: int) -> tuple[int, int]:
    """ZeRO-3 on WideMLP: (peak live bytes of one train_step + SGD step after a warm-up step,
    peak bytes above the parameters and optimizer state during one forward without grad)."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = WideMLP()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g)) for _ in range(2)]
    strategy = gp.Strategy(dp=world, zero=3, split=split)
    dmodel = zoo.compile(model, data[0], strategy)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.01, momentum=0.9)
    dmodel.train_step(*data[0])
    opt.step()
    opt.zero_grad()
    state = list(dmodel.parameters()) + optimizer_state_tensors(opt)
    with MemoryProbe(baseline=state) as step:
        dmodel.train_step(*data[1])
        opt.step()
    opt.zero_grad()
    with MemoryProbe(baseline=state) as forward:
        held = forward.current_bytes
        dmodel(*data[1])
    return step.peak_bytes, forward.peak_bytes - held


@pytest.mark.timeout(300)
def test_zero3_with_split_4_peaks_below_zero3(rank_pool):
    pool = rank_pool(2)
    step, gathered = {}, {}
    for split in (1, 2, 4):
        (step[split], gathered[split]), *_ = pool.run(_peak_bytes, split, timeout_s=120)
    logging.getLogger(__name__).info("ZeRO-3 on 2 ranks, by split: step peak %s, forward peak above state %s",
                                     step, gathered)
    # Forward gathers one slice at a time, so the gathered bytes fall by about k. Unsplit, WideMLP
    # (no repeated layers) gathers both 4 MB weights in one group: flat buffer + unpacked copies =
    # 16.8 MB. Split 2 holds one 2 MB slice twice over (4.3 MB), split 4 one 1 MB slice (2.2 MB);
    # measured here up to one slice more (6.4 / 3.2 MB) when gloo lets go of the previous gather's
    # buffer late, hence the bounds /2 and /4 rather than exact figures.
    assert gathered[4] < gathered[2] < gathered[1] / 2
    assert gathered[4] < gathered[1] / 4
    # A training step peaks in backward: unsplit, at the 4 MB weight's re-gather plus its full
    # gradient and reduce-scatter buffer (29-38 MB here, depending on when gloo releases in-flight
    # buffers); split, each slice's share of those is 1/k (17.0 MB with split 2, 14.7 MB with
    # split 4), down to a floor set by how many full-size reduce-scatter inputs runtime/zero.py
    # keeps in flight (with all of them held to the end of backward, split 2 and 4 both peaked at
    # 21.0 MB).
    assert step[4] <= step[2] < step[1]
    assert step[4] < 0.8 * step[1], step
