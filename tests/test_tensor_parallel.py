"""Tensor parallel (Megatron column/row, vocab-parallel embedding and loss, sequence parallel)
and 2-D dp x tp meshes on 2 and 4 gloo ranks against one process.

Tolerances as in test_dp.py: tensor parallelism changes only the order of fp32 additions (the
row-parallel all-reduce sums partial matmuls; the vocab-parallel loss sums partial softmax
denominators), ~1e-7 relative; over 3 SGD-momentum steps rtol 1e-5 / atol 1e-6 catches any real
error (a missing f/g pair doubles or drops a gradient, a wrong shard offset moves rows).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import graphpass as gp
from graphpass.plan_builder import plan_from_strategy
from graphpass.capture import capture
from graphpass.pass_manager import PassContext, PassError, run_passes
from graphpass.ops import op_name
from graphpass.passes import PIPELINE
from graphpass.passes.collectives import is_collective

import fuzz_models
import zoo
from gpt import GPT, GPTConfig
from graphpass import meta

RTOL, ATOL = 1e-5, 1e-6


def _plan_and_run(model: nn.Module, batch, strategy: gp.Strategy, world: int) -> fx.GraphModule:
    gm = capture(model, batch).gm
    plan = plan_from_strategy(gm, strategy, [])
    gm, _ = run_passes(gm, plan, PassContext(0, world, batch), PIPELINE)
    return gm


def _tp_sequence(gm: fx.GraphModule) -> list[str]:
    return [op_name(n) for n in gm.graph.nodes if is_collective(n) and op_name(n).startswith(("tp_", "vocab"))]


def test_tp2_gpt_block_has_two_forward_all_reduces():
    gm = _plan_and_run(zoo.build("gpt"), zoo.batches("gpt", 1, 4)[0], gp.Strategy(tp=2), 2)
    block = ["tp_copy", "tp_all_reduce", "tp_copy", "tp_all_reduce"]  # attention, then MLP (f ... g)
    assert _tp_sequence(gm) == ["tp_all_reduce"] + block * 2 + ["tp_copy", "vocab_parallel_cross_entropy"]
    # Shapes are local: q/k/v produce 64/2 features, the head view splits into 4/2 heads.
    q = next(n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("gp.module_path") == "h.0.attn.q")
    assert tuple(q.meta["val"].shape) == (4, 32, 32)
    assert tuple(gm.get_parameter("h.0.attn.proj.weight").shape) == (64, 32)  # row parallel
    assert tuple(gm.get_parameter("wte.weight").shape) == (128, 64)  # vocab parallel, tied head


def test_sequence_parallel_uses_gather_and_reduce_scatter_pairs():
    gm = _plan_and_run(zoo.build("gpt"), zoo.batches("gpt", 1, 4)[0], gp.Strategy(tp=2, sequence_parallel=True), 2)
    block = ["tp_all_gather", "tp_reduce_scatter"] * 2
    assert _tp_sequence(gm) == ["tp_reduce_scatter", "tp_scatter"] + block * 2 + ["tp_all_gather", "vocab_parallel_cross_entropy"]
    gathers = [n for n in gm.graph.nodes if op_name(n) == "tp_all_gather"]
    # Gathered activations feed column-parallel linears only: their backward reduce-scatters.
    assert all(n.kwargs["grad"] == "reduce_scatter" for n in gathers)
    # Norm weights see sequence shards: their gradients are summed over tp.
    ln = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "h.0.ln_1.weight")
    assert ln.meta["gp.grad_partial"] == "tp"


def test_llama_attention_and_mlp_are_split_megatron_style():
    gm = _plan_and_run(zoo.build("hf_llama"), zoo.batches("hf_llama", 1, 4)[0], gp.Strategy(tp=2), 2)
    seq = _tp_sequence(gm)
    assert seq.count("tp_all_reduce") == 1 + 2 * 2 and "tp_all_gather" not in seq
    shapes = {k: tuple(p.shape) for k, p in gm.named_parameters()}
    assert shapes["model.model.layers.0.self_attn.q_proj.weight"] == (32, 64)
    assert shapes["model.model.layers.0.self_attn.k_proj.weight"] == (16, 64)  # 2 kv heads / 2
    assert shapes["model.model.layers.0.mlp.down_proj.weight"] == (64, 64)


def test_tp_not_dividing_heads_names_the_module_and_sizes():
    with pytest.raises(PassError, match=r"tp=8 cannot split node .* \(module h.0.attn\).*sharded size 4, not divisible by 8"):
        _plan_and_run(zoo.build("gpt"), zoo.batches("gpt", 1, 4)[0], gp.Strategy(tp=8), 8)


def test_tp_not_dividing_query_heads_names_the_module():
    """Key/value heads fewer than tp are replicated (test_tp_layouts), query heads are not: tp=8
    on 4 query heads is an error naming the attention module and the sizes."""
    with pytest.raises(PassError, match=r"tp=8 cannot split node .* \(module model.model.layers.0.self_attn\).*sharded size 4, not divisible by 8"):
        _plan_and_run(zoo.build("hf_llama"), zoo.batches("hf_llama", 1, 4)[0], gp.Strategy(tp=8), 8)


def test_a_vocabulary_tp_does_not_divide_stays_whole_and_a_plan_sharding_it_names_the_parameter():
    model = GPT(GPTConfig(vocab_size=255, block_size=16, n_layer=1, n_head=2, n_embd=32))
    idx = torch.randint(0, 255, (2, 16))
    # The Strategy's Megatron layout leaves the tied embedding and head whole: plain cross-entropy.
    gm = _plan_and_run(model, (idx, idx), gp.Strategy(tp=2), 2)
    assert tuple(gm.get_parameter("wte.weight").shape) == (255, 32)
    assert "vocab_parallel_cross_entropy" not in _tp_sequence(gm)
    assert tuple(gm.get_parameter("h.0.mlp.up.weight").shape)[0] * 2 == 4 * 32  # the blocks still sharded
    # A plan that shards it anyway is refused naming the parameter.
    gm = capture(model, (idx, idx)).gm
    plan = plan_from_strategy(gm, gp.Strategy(tp=2), [])
    plan = plan.with_tensor("wte_weight", placements={**plan.tensor("wte_weight").placements, "tp": Shard(0)})
    with pytest.raises(PassError, match=r"tp=2 does not divide dim 0 \(size 255\) of 'wte.weight'"):
        run_passes(gm, plan, PassContext(0, 2, (idx, idx)), PIPELINE)


class _CumsumMLP(nn.Module):
    """An op with no tensor-parallel rule (cumsum) between a column and a row linear."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 1)

    def forward(self, x, y):
        h = torch.cumsum(F.gelu(self.up(x)), dim=-1) / 32
        return F.mse_loss(self.down(h).squeeze(-1), y)


def _cumsum_plan(gm: fx.GraphModule, world: int) -> gp.Plan:
    plan = plan_from_strategy(gm, gp.Strategy(tp=world), [])
    for node, placement in (("up_weight", Shard(0)), ("up_bias", Shard(0)), ("down_weight", Shard(1))):
        plan = plan.with_tensor(node, placements={**plan.tensor(node).placements, "tp": placement})
    return plan


def _tp_sharded(gm: fx.GraphModule) -> set[str]:
    return {n.target for n in gm.graph.nodes if n.op == "get_attr" and meta.layout(n) is not None}


def test_a_causal_mask_written_with_masked_fill_keeps_attention_sharded():
    # scores.masked_fill(mask, -inf) between q @ k^T and the softmax: q, k and v are column
    # sharded by heads (the single kv head replicated) and proj row sharded, as with sdpa.
    config = fuzz_models.FuzzConfig(heads=4, kv_heads=1, attention="eager_masked_fill")
    gm = _plan_and_run(fuzz_models.build(config), fuzz_models.batches(config, 1, 2)[0], gp.Strategy(tp=2), 2)
    assert {"h.0.attn.q.weight", "h.0.attn.proj.weight"} <= _tp_sharded(gm)
    assert "h.0.attn.k.weight" not in _tp_sharded(gm)  # one kv head: every rank computes it


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_one_row_per_rank_keeps_heads_sharded(name):
    # A batch dim of 1 is not the heads dim a view moves the shard to.
    gm = _plan_and_run(zoo.build(name), zoo.batches(name, 1, 1)[0], gp.Strategy(tp=2), 2)
    two_rows = _plan_and_run(zoo.build(name), zoo.batches(name, 1, 2)[0], gp.Strategy(tp=2), 2)
    assert _tp_sequence(gm) == _tp_sequence(two_rows) and _tp_sharded(gm) == _tp_sharded(two_rows)


def test_a_value_every_stage_converts_is_converted_in_each_stage():
    # Rotary tables computed once and read by layers in both stages, scattered along the sequence
    # for the replicated kv projection: one tp_scatter per stage, not one spanning the cut.
    from graphpass.passes import passes_for
    from graphpass.passes.partition_stages import cut_stages

    config = fuzz_models.FuzzConfig(depth=2, heads=4, kv_heads=1, norm="rmsnorm", position="rope")
    batch = fuzz_models.batches(config, 1, 2)[0]
    strategy = gp.Strategy(pp=2, tp=2, sequence_parallel=True)
    gm = capture(fuzz_models.build(config), batch).gm
    plan = plan_from_strategy(gm, strategy, [])
    gm, _ = run_passes(gm, plan, PassContext(0, 4, batch), passes_for(plan))
    stages = cut_stages(gm, plan.stages)
    scatters = [[n for n in stage.graph.nodes if op_name(n) == "tp_scatter"] for stage in stages]
    assert all(scatters), [len(s) for s in scatters]


def test_op_without_rule_falls_back_to_replicate_with_one_warning(caplog):
    torch.manual_seed(0)
    batch = (torch.randn(4, 16), torch.randn(4))
    gm = capture(_CumsumMLP(), batch).gm
    with caplog.at_level(logging.WARNING):
        gm, _ = run_passes(gm, _cumsum_plan(gm, 2), PassContext(0, 2, batch), PIPELINE)
    warnings = [r.message for r in caplog.records if "no tensor-parallel rule" in r.message]
    assert len(warnings) == 1 and "aten.cumsum" in warnings[0]
    # x is an input (no gradient): no tp_copy; cumsum gets a gathered input, down its shard back.
    assert _tp_sequence(gm) == ["tp_all_gather", "tp_scatter", "tp_all_reduce"]


def _train(name: str, kwargs: dict, steps: int = 3, batch: int = 8):
    world = dist.get_world_size()
    model = zoo.build(name) if name != "cumsum" else _seeded_cumsum()
    data = zoo.batches(name if name != "cumsum" else "mlp", steps, batch)
    strategy = gp.Strategy(**kwargs)
    if name == "cumsum":
        gm = capture(_seeded_cumsum(), data[0]).gm
        strategy = _cumsum_plan(gm, world)
    dmodel = zoo.compile(model, data[0], strategy)
    return zoo.train_compiled(dmodel, data), dmodel.full_state_dict()


def _seeded_cumsum() -> nn.Module:
    torch.manual_seed(0)
    return _CumsumMLP()


def _reference(name: str):
    if name != "cumsum":
        return zoo.train_reference(name, steps=3, batch=8)[:2]
    model = _seeded_cumsum()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for b in zoo.batches("mlp", 3, 8):
        loss = model(*b)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, model.state_dict()


def _check(results, where, ref):
    ref_losses, ref_state = ref
    for rank, (losses, state) in enumerate(results):
        zoo.assert_matches_reference(f"{where} rank {rank}", losses, state, ref_losses, ref_state, rtol=RTOL, atol=ATOL)


# GPT with tp 2 + sequence parallelism (dp 1 on 2 ranks, dp 2 on 4) is
# examples/test_gpt_parity.py's case.
CASES = {
    2: [("gpt", {"tp": 2}), ("encoder", {"tp": 2}), ("hf_llama", {"tp": 2}),
        ("hf_llama", {"tp": 2, "sequence_parallel": True}),
        ("encoder", {"tp": 2, "sequence_parallel": True}),
        ("gpt", {"tp": 2, "recompute": True}), ("cumsum", {"tp": 2})],
    4: [("gpt", {"tp": 4}), ("encoder", {"tp": 4}), ("hf_llama_mha", {"tp": 4}),
        ("hf_llama", {"dp": 2, "tp": 2}),
        # ZeRO inside the dp axis of a 2-D mesh: each rank's tp chunk is sharded again over dp.
        ("gpt", {"dp": 2, "tp": 2, "zero": 3}), ("hf_llama", {"dp": 2, "tp": 2, "zero": 1}),
        # ... and with sequence parallel: norm-weight gradients are summed over tp, then reduce-scattered over dp.
        ("hf_llama", {"dp": 2, "tp": 2, "zero": 2, "sequence_parallel": True})],
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_one_process(rank_pool, world_size):
    pool = rank_pool(world_size)
    refs: dict[str, tuple] = {}
    for name, kwargs in CASES[world_size]:
        if name not in refs:
            refs[name] = _reference(name)
        results = pool.run(_train, name, kwargs, timeout_s=300)
        _check(results, f"{name} {kwargs} on {world_size}", refs[name])
