"""Hierarchical data parallelism (HSDP, ``Strategy(dp_shard=...)``) against one process.

ZeRO shards inside groups of ``dp_shard`` ranks and the groups are replicas: gradients are
reduce-scattered within a group and all-reduced across groups. Tolerances as in test_zero.py:
the only difference from one process is the order of fp32 additions (per-rank partial means,
a reduce-scatter, then an all-reduce across replicas), ~1e-7 relative, which SGD with momentum
keeps there over 3 steps; rtol 1e-5 / atol 1e-6 catch a gradient averaged over the shard group
only (off by 2x), a replica that skipped the cross-group all-reduce, or a shard offset.
"""

from __future__ import annotations

import pytest

import graphpass as gp
from graphpass.mesh import Mesh

import zoo

RTOL, ATOL = 1e-5, 1e-6


def _train(name: str, strategy_kwargs: dict, steps: int = 3, batch: int = 8):
    dmodel, data = zoo.compile_on_ranks(name, strategy_kwargs, steps, batch)
    losses = zoo.train_compiled(dmodel, data)
    local = sum(p.numel() for p in dmodel.parameters())
    return losses, dmodel.full_state_dict(), local


def _check(results, where, ref):
    ref_losses, ref_state, _ = ref
    for rank, (losses, state, _) in enumerate(results):
        zoo.assert_matches_reference(f"{where} rank {rank}", losses, state, ref_losses, ref_state,
                                     rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(900)
def test_hsdp_matches_one_process_on_2x2(rank_pool):
    """A transformer with a tied embedding ("gpt") and an untied Llama, ZeRO-1/2/3 inside pairs of
    ranks, replicated across the two pairs; each rank holds half the model (not a quarter)."""
    pool = rank_pool(4)
    for name in ("gpt", "hf_llama"):
        ref = zoo.train_reference(name, steps=3, batch=8)
        full_numel = sum(p.numel() for p in zoo.build(name).parameters())
        for zero in (1, 2, 3):
            results = pool.run(_train, name, {"zero": zero, "dp_shard": 2}, timeout_s=300)
            _check(results, f"{name} zero={zero} dp_shard=2", ref)
            local = results[0][2]
            assert full_numel / 2 <= local < full_numel / 2 * 1.1 + 256, (name, zero, local, full_numel)


@pytest.mark.timeout(600)
def test_hsdp_with_microbatches_and_experts_on_2x2(rank_pool):
    """Microbatches (ZeRO-1 holds the gradients back to the step's last backward; 2/3 reduce every
    backward) and experts sharded over ep = dp_shard (their replicas all-reduced across pairs)."""
    pool = rank_pool(4)
    cases = [("gpt", {"zero": 1, "dp_shard": 2, "microbatches": 2}),
             ("hf_llama", {"zero": 3, "dp_shard": 2, "microbatches": 2}),
             ("moe_topk", {"zero": 3, "dp_shard": 2, "ep": 2}),
             ("moe_topk_capacity", {"zero": 2, "dp_shard": 2, "ep": 2, "microbatches": 2})]
    for name, kwargs in cases:
        results = pool.run(_train, name, kwargs, timeout_s=300)
        _check(results, f"{name} {kwargs}", zoo.train_reference(name, steps=3, batch=8))


@pytest.mark.timeout(900)
def test_hsdp_with_tensor_and_pipeline_parallel_on_8_ranks(rank_pool):
    """dp 4 = 2 x 2 beside tp 2 (ZeRO inside pairs of dp ranks, each shard a tp shard) and beside
    pp 2 (each stage's parameters sharded within its pairs)."""
    pool = rank_pool(8)
    ref = zoo.train_reference("gpt_deep", steps=3, batch=8)
    for kwargs in ({"dp": 4, "tp": 2, "zero": 3, "dp_shard": 2},
                   {"dp": 4, "pp": 2, "zero": 2, "dp_shard": 2, "microbatches": 2}):
        results = pool.run(_train, "gpt_deep", kwargs, timeout_s=600)
        _check(results, f"gpt_deep {kwargs}", ref)


def test_mesh_lays_hsdp_groups_inside_dp():
    """dp_shard groups are consecutive dp ranks (a node), replicas the ranks with the same
    position in each group; with ep, experts are sharded inside a dp_shard group."""
    mesh = Mesh.of(pp=2, dp=4, dp_shard=2)
    assert mesh.world_size == 8 and dict(mesh) == {"pp": 2, "dp": 4, "dp_shard": 2}
    assert mesh.group_ranks("dp_shard", 5) == [4, 5] and mesh.group_ranks("dp_replicate", 5) == [5, 7]
    assert mesh.zero_axis() == "dp_shard" and mesh.replicate_axis("dp_shard") == "dp_replicate"
    assert mesh.within("dp_shard", "dp") and not mesh.within("dp", "dp_shard")
    moe = Mesh.of(dp=8, dp_shard=4, ep=2)
    assert moe.group_ranks("ep", 5) == [4, 5] and moe.group_ranks("edp_shard", 5) == [5, 7]
    assert moe.group_ranks("edp", 5) == [1, 3, 5, 7] and moe.zero_axis(expert=True) == "edp_shard"
    assert Mesh.of(dp=4, dp_shard=4) == Mesh.of(dp=4) and Mesh.of(dp=4).replicate_axis("dp") is None
    with pytest.raises(ValueError, match=r"mesh\['ep'\] = 4 must divide mesh\['dp_shard'\] = 2"):
        Mesh({"dp": 8, "dp_shard": 2, "ep": 4})


def test_bad_dp_shard_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"Strategy.dp_shard=3 must divide Strategy.dp=4.*choose one of \[2, 4\]"):
        gp.Strategy(dp=4, zero=3, dp_shard=3)
    with pytest.raises(ValueError, match=r"Strategy.dp_shard=2 .* Strategy.zero=0 shards nothing; set zero=1, 2 or 3"):
        gp.Strategy(dp=4, dp_shard=2)
    with pytest.raises(ValueError, match=r"Strategy.dp_shard=1 shards nothing"):
        gp.Strategy(dp=4, zero=2, dp_shard=1)
    with pytest.raises(ValueError, match=r"Strategy.ep=4 must divide Strategy.dp_shard=2"):
        gp.Strategy(dp=8, zero=2, dp_shard=2, ep=4)
    assert gp.Strategy(dp=4, zero=3, dp_shard=2).mesh == Mesh({"dp": 4, "dp_shard": 2})


def test_groups_spanning_nodes_are_warned_naming_the_links():
    """dp_shard=3 on nodes of 4 devices puts a group on two nodes; dp_shard=4 (or 2) would not."""
    cluster = gp.Cluster.preset("a100-80g", nodes=3, gpus_per_node=4)
    warning = cluster.hsdp_warning(gp.Strategy(dp=12, zero=3, dp_shard=3).mesh)
    inter, intra = cluster.inter_node.bandwidth_gbps, cluster.intra_node.bandwidth_gbps
    assert warning is not None and "span nodes of 4 devices" in warning, warning
    assert f"{inter:g} GB/s" in warning and f"{intra:g} GB/s" in warning and "dp_shard=4 keeps every group" in warning
    assert cluster.hsdp_warning(gp.Strategy(dp=12, zero=3, dp_shard=4).mesh) is None
    # tp 2 x dp_shard 2 fills a node of 4: aligned; with tp 4 every dp group spans nodes, nothing better exists
    assert cluster.hsdp_warning(gp.Strategy(dp=6, tp=2, zero=3, dp_shard=2).mesh) is None
    assert cluster.hsdp_warning(gp.Strategy(dp=3, tp=4, zero=3).mesh) is None


def test_the_planner_offers_hsdp_where_dp_spans_nodes_and_prices_both_levels():
    """On 4 nodes of 8, every mesh whose dp groups span nodes also comes with dp_shard = the
    ranks of a node; priced, HSDP's ZeRO-3 moves the gathers and reduce-scatters onto NVLink
    (less dp time than ZeRO-3 over all 32 ranks on InfiniBand) and keeps 4x the sharded state."""
    import torch

    from graphpass.cost.search import meshes
    from graphpass.planner import Planner

    cluster = gp.Cluster.preset("a100-80g", nodes=4, gpus_per_node=8)
    layouts = meshes(cluster, 64, (1, 2), num_blocks=4)
    hsdp = {(lay.mesh.dp, lay.mesh.tp, lay.mesh.dp_shard) for lay in layouts if "dp_shard" in lay.mesh}
    assert (32, 1, 8) in hsdp and (16, 2, 4) in hsdp, hsdp
    assert not any("dp_shard" in lay.mesh for lay in meshes(gp.Cluster.preset("a100-80g", 1, 8), 64, (1, 2), 4))

    model = zoo.build("gpt")
    idx = torch.zeros(64, zoo.SEQ, dtype=torch.long)
    planner = Planner(model, cluster, (idx, idx))
    flat = planner.price(gp.Strategy(dp=32, zero=3))
    nodes = planner.price(gp.Strategy(dp=32, zero=3, dp_shard=8))
    assert nodes.mesh == Mesh({"dp": 32, "dp_shard": 8})
    dp_s = [sum(row["dp_comm_s"] for row in p.report.breakdown) for p in (flat, nodes)]
    assert dp_s[1] < dp_s[0], dp_s
    state = [sum(row["state_bytes"] for row in p.report.breakdown) for p in (flat, nodes)]
    assert 3.0 < state[1] / state[0] < 4.5, state
