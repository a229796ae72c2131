"""The cost model of expert parallelism (cost/experts.py, cost/search/pricing.py) and the
planner's choice of ``ep``, on a Mixtral-shaped decoder planned on meta tensors (no rank, no
measurement: every figure is the cost model's, checked against hand-computed ones).

The model: 2 layers of 8 experts of d 4096 x 14336 (Mixtral 8x7B's shape), bf16, 64 sequences
of 1024 tokens on 8 H100s.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import graphpass as gp
import zoo
from graphpass.cost.collectives import collective_time, sync_time
from graphpass.cost.experts import choose_capacity, dropped, imbalance, rank_loads, zipf_loads
from graphpass.cost.search import Parallelism
from graphpass.planner import Planner
from graphpass.transitions import TABLE
from moe_gpt import MoEGPT, MoEGPTConfig

E, D, H, SEQ, BATCH = 8, 4096, 14336, 1024, 64
CLUSTER = "h100-80g:1x8"


def test_zipf_loads_and_the_slowest_ranks_share():
    loads = zipf_loads(4, 1.0)
    assert loads == pytest.approx([12 / 25, 6 / 25, 4 / 25, 3 / 25])  # 1, 1/2, 1/3, 1/4 over H_4 = 25/12
    assert rank_loads(loads, 2) == pytest.approx([18 / 25, 7 / 25])  # experts 0,1 on rank 0
    assert imbalance(loads, 2) == pytest.approx(36 / 25)
    assert imbalance(loads, 2, owner=[0, 1, 1, 0]) == pytest.approx(2 * 15 / 25)  # hot and cold paired
    assert imbalance(zipf_loads(8, 0.0), 8) == pytest.approx(1.0) and imbalance(None, 4) == 1.0
    assert imbalance(loads, 4) == pytest.approx(4 * 12 / 25)
    with pytest.raises(ValueError, match="do not divide"):
        rank_loads(loads, 3)


def _mixtral_shaped():
    config = MoEGPTConfig(vocab_size=32000, block_size=SEQ, n_layer=2, n_head=32, n_embd=D, num_experts=E, d_hidden=H)
    with torch.device("meta"):
        model = MoEGPT(config).to(torch.bfloat16)
    return model, torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")


@pytest.fixture(scope="module")
def planner():
    model, idx = _mixtral_shaped()
    return Planner(model, CLUSTER, (idx, idx))


def _layer(planner, layout):
    return next(b for b in planner.blocks(layout) if b.kind == "layer")


def test_the_blocks_know_their_experts_and_what_expert_parallelism_would_exchange(planner):
    layer = _layer(planner, Parallelism.of(1, 8, 1))
    # SwiGLU experts: w_in [E, d, 2h], w_out [E, h, d]
    assert layer.expert_params == E * 3 * D * H and layer.expert_param_bytes == 2 * layer.expert_params
    assert layer.num_experts == E
    rows = BATCH * SEQ * 2 * D * 2  # top-2: two rows per token, bf16
    assert sorted(layer.exchanges) == sorted([("ep token counts", 8.0 * E), ("ep dispatch", rows), ("ep combine", rows)])
    forward, backward = layer.expert_times[BATCH // 8]
    total_forward, _ = layer.times[BATCH // 8]
    assert 0 < forward < total_forward and backward > forward  # the products dominate the layer


def test_ep_shards_the_experts_state_and_pays_the_exchange_on_the_ep_group(planner):
    dp = planner.price(gp.Strategy(dp=8))
    ep = planner.price(gp.Strategy(dp=8, ep=8))
    layer = _layer(planner, Parallelism.of(1, 8, 1))
    # The experts' weights, gradients and Adam state (bf16 + bf16 + 12 bytes per element) fall
    # from all of them to 1/8 on each rank.
    experts = layer.expert_params * (2 + 2 + 12)
    state = {p: {r["block"]: r["state_bytes"] for r in plan.report.breakdown} for p, plan in (("dp", dp), ("ep", ep))}
    assert state["dp"]["layer 0"] - state["ep"]["layer 0"] == pytest.approx(experts * 7 / 8, rel=1e-6)
    # Each microbatch: counts, dispatch and combine forward, dispatch and combine backward, each
    # an all-to-all over the 8 ranks priced by the collective formula (plus the link's sync, as
    # every blocking collective) and its permutation copy at the memory bandwidth.
    cluster = planner.cluster
    ranks = list(range(8))
    rows = BATCH // 8 * SEQ * 2 * D * 2
    one = lambda size: collective_time("all_to_all", size, ranks, cluster) + sync_time(ranks, cluster)  # noqa: E731
    bandwidth = cluster.device.memory_bandwidth_gbps * 1e9 * cluster.device.memory_efficiency
    moved = one(8.0 * E) + 4 * one(rows) + 4 * 2 * rows / bandwidth
    # ... and the experts' gradient bucket (flattened and scaled: 2 writes and reads of the
    # bf16 gradients) holds 1/8 of them.
    moved -= 7 / 8 * 2 * 2 * (2 * layer.expert_params) / bandwidth
    time = {p: {r["block"]: r["time_s"] for r in plan.report.breakdown} for p, plan in (("dp", dp), ("ep", ep))}
    assert time["ep"]["layer 0"] - time["dp"]["layer 0"] == pytest.approx(moved, rel=1e-6)
    assert TABLE["ep dispatch"].collectives and ep.mesh.ep == 8


def test_skewed_routing_slows_the_rank_with_the_hottest_experts(planner):
    layer = _layer(planner, Parallelism.of(1, 8, 1))
    forward, backward = layer.expert_times[BATCH // 8]
    balanced = planner.price(gp.Strategy(dp=8, ep=8))
    skewed_costing = planner.costing
    try:
        planner.costing = dataclasses.replace(skewed_costing, expert_loads=zipf_loads(E, 1.0))
        skewed = planner.price(gp.Strategy(dp=8, ep=8))
    finally:
        planner.costing = skewed_costing
    slowest = E / sum(1 / (e + 1) for e in range(E))  # rank 0 holds the hottest expert alone
    rows = BATCH // 8 * SEQ * 2 * D * 2
    cluster, ranks = planner.cluster, list(range(8))
    bandwidth = cluster.device.memory_bandwidth_gbps * 1e9 * cluster.device.memory_efficiency
    more_rows = 4 * (collective_time("all_to_all", slowest * rows, ranks, cluster)
                     - collective_time("all_to_all", rows, ranks, cluster)) + 8 * (slowest - 1) * rows / bandwidth
    extra = {r["block"]: r["time_s"] for r in skewed.report.breakdown}["layer 0"] - {
        r["block"]: r["time_s"] for r in balanced.report.breakdown}["layer 0"]
    assert extra == pytest.approx((slowest - 1) * (forward + backward) + more_rows, rel=1e-6)


def test_the_planner_shards_experts_when_routing_is_balanced_and_not_when_one_expert_is_hot(planner):
    chosen = planner.auto()
    assert chosen.mesh.ep > 1, chosen.explain()
    assert any("ep=" in line for line in chosen.report.reasons)
    saved = planner.costing
    try:
        planner.costing = dataclasses.replace(saved, expert_loads=zipf_loads(E, 2.0))
        skewed = planner.auto()
    finally:
        planner.costing = saved
    assert skewed.mesh.ep < chosen.mesh.ep, skewed.explain()
    assert math.isfinite(skewed.report.predicted_step_time_s)


def test_expert_loads_are_checked():
    with pytest.raises(ValueError, match="must be 4 non-negative shares"):
        gp.plan(zoo.build("moe_topk"), CLUSTER, zoo.batches("moe_topk", 1, 8)[0], expert_loads=[1.0, 2.0])
    with pytest.raises(ValueError, match="no Mixture-of-Experts layer"):
        gp.plan(zoo.build("gpt"), CLUSTER, zoo.batches("gpt", 1, 8)[0], expert_loads=[1.0])



def test_an_ep_group_across_nodes_exchanges_in_two_levels_where_the_link_model_says_so(planner):
    """On 2 nodes of 8 H100s, ep 16 spans both nodes: the two-level exchange sends one message
    per node pair over InfiniBand instead of eight, and the plan says so; ep 4 stays in a node."""
    config = MoEGPTConfig(vocab_size=32000, block_size=SEQ, n_layer=1, n_head=32, n_embd=D, num_experts=16, d_hidden=H)
    with torch.device("meta"):
        model = MoEGPT(config).to(torch.bfloat16)
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    two_nodes = Planner(model, "h100-80g:2x8", (idx, idx))
    assert two_nodes.price(gp.Strategy(dp=16, ep=16)).ep_all_to_all == "hierarchical"
    assert two_nodes.price(gp.Strategy(dp=16, ep=4)).ep_all_to_all == "flat"
    assert planner.price(gp.Strategy(dp=8, ep=8)).ep_all_to_all == "flat"  # one node


def test_a_capacity_drops_what_exceeds_it_and_bounds_the_slowest_rank():
    loads = zipf_loads(4, 1.0)  # 0.48, 0.24, 0.16, 0.12
    assert dropped(loads, 1.25) == pytest.approx(0.48 - 0.3125)  # each expert keeps 1.25 / 4 at most
    assert dropped(None, 1.0, 4) == 0.0 and dropped(loads, None) == 0.0
    assert imbalance(loads, 2, capacity_factor=1.25) == pytest.approx(2 * (0.3125 + 0.24))
    assert imbalance(None, 1, capacity_factor=0.5) == pytest.approx(0.5)  # half the rows computed
    assert choose_capacity(loads, [1.0, 1.25, 1.5, 2.0, None], 0.10, 4) == 2.0  # 1.5 drops 10.5%
    assert choose_capacity(loads, [1.0, 1.25, 1.5, 2.0, None], 0.11, 4) == 1.5
    assert choose_capacity(loads, [None, 1.0], 0.0, 4) is None
    with pytest.raises(ValueError, match="no capacity factor among"):
        choose_capacity(loads, [1.0], 0.0, 4)


def test_the_planner_chooses_a_capacity_within_the_drop_budget_and_prices_its_bound(planner):
    model, idx = _mixtral_shaped()
    loads = zipf_loads(E, 1.0)
    capped = Planner(model, CLUSTER, (idx, idx), expert_loads=loads, capacity_factors=(1.0, 1.5, 2.0, 3.0, None),
                     max_dropped=0.05)
    chosen = capped.auto()
    assert chosen.capacity_factor == choose_capacity(loads, (1.0, 1.5, 2.0, 3.0, None), 0.05, E) == 3.0
    assert any(r.startswith("capacity factor 3:") for r in chosen.report.reasons), chosen.report.reasons
    # (the hottest expert gets 1/H_8 = 36.8% of the rows: 2.0 keeps 25% of them and would drop
    # 11.8%, 3.0 keeps 37.5%.) A capacity that drops bounds the slowest rank: ep 8 at 2.0 is priced
    # below ep 8 dropless.
    saved = planner.costing
    try:
        planner.costing = dataclasses.replace(saved, expert_loads=loads)
        dropless = planner.price(gp.Strategy(dp=8, ep=8)).report.predicted_step_time_s
        planner.costing = dataclasses.replace(saved, expert_loads=loads, capacity_factor=2.0)
        at_two = planner.price(gp.Strategy(dp=8, ep=8)).report.predicted_step_time_s
    finally:
        planner.costing = saved
    assert at_two < dropless
    with pytest.raises(ValueError, match="max_dropped must be a share"):
        Planner(model, CLUSTER, (idx, idx), capacity_factors=(1.0,), max_dropped=1.5)
    with pytest.raises(ValueError, match="has none"):
        gp.plan(zoo.build("hf_mixtral"), CLUSTER, zoo.batches("hf_mixtral", 1, 8)[0], capacity_factors=(1.0,))
