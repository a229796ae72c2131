"""Collective cost model: alpha-beta links and ring/tree/hierarchical formulas, hand-computed.

Preset figures used throughout (graphpass/cluster.py, a100-80g, 2 nodes x 8):
NVLink 300 GB/s per GPU per direction, alpha 5 us; InfiniBand HDR 25 GB/s, alpha 15 us.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from graphpass.cluster import Cluster
from graphpass.cost import collectives as cc
from graphpass.cost.collectives import Link, collective_time, link_for_group, ring_volume_bytes

NVLINK = Link(300e9, 5e-6)
IB = Link(25e9, 15e-6)
NODE0 = list(range(8))
BOTH_NODES = list(range(16))


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return Cluster.preset("a100-80g", nodes=2, gpus_per_node=8)


# --------------------------------------------------------------------------- links


def test_link_for_group_uses_nvlink_inside_one_node(cluster):
    assert link_for_group(cluster, NODE0) == NVLINK
    assert link_for_group(cluster, [8, 9, 15]) == NVLINK


def test_link_for_group_uses_the_inter_node_link_once_a_group_spans_nodes(cluster):
    assert link_for_group(cluster, [7, 8]) == IB
    assert link_for_group(cluster, BOTH_NODES) == IB


@pytest.mark.parametrize("ranks", [[], [0, 0], [16], [-1]])
def test_link_for_group_rejects_bad_groups(cluster, ranks):
    with pytest.raises(ValueError, match="group_ranks"):
        link_for_group(cluster, ranks)


# --------------------------------------------------------------------------- ring volumes


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("all_reduce", 2 * 3 / 4 * 1000),  # 2(n-1)/n S
        ("all_gather", 3 / 4 * 1000),  # (n-1)/n S
        ("reduce_scatter", 3 / 4 * 1000),
        ("all_to_all", 3 / 4 * 1000),
        ("send_recv", 1000),
    ],
)
def test_ring_collective_volumes_match_the_published_formulas(kind, expected):
    assert ring_volume_bytes(kind, 1000, 4) == pytest.approx(expected)


@pytest.mark.parametrize("kind", cc.KINDS)
def test_ring_volume_is_zero_for_one_rank(kind):
    assert ring_volume_bytes(kind, 1000, 1) == 0


def test_ring_volume_of_an_all_reduce_approaches_twice_the_tensor():
    assert ring_volume_bytes("all_reduce", 1e9, 1024) == pytest.approx(2e9, rel=1e-3)


# --------------------------------------------------------------------------- times


def test_all_reduce_ring_inside_a_node(cluster):
    # 2*7 steps * 5 us + 2*7/8 * 1e9 B / 300e9 B/s
    expected = 70e-6 + 1.75e9 / 300e9
    assert cc.all_reduce_time(1e9, 8, NVLINK) == pytest.approx(expected)
    assert collective_time("all_reduce", 1e9, NODE0, cluster, algorithm="ring") == pytest.approx(expected)


def test_all_gather_and_reduce_scatter_across_two_nodes(cluster):
    # one step * 15 us + 1/2 * 1e9 B / 25e9 B/s
    expected = 15e-6 + 0.02
    assert collective_time("all_gather", 1e9, [0, 8], cluster) == pytest.approx(expected)
    assert collective_time("reduce_scatter", 1e9, [0, 8], cluster) == pytest.approx(expected)


def test_all_to_all_inside_a_node(cluster):
    # 3 steps * 5 us + 3/4 * 1.2e9 B / 300e9 B/s
    expected = 15e-6 + 3e-3
    assert cc.all_to_all_time(1.2e9, 4, NVLINK) == pytest.approx(expected)
    assert collective_time("all_to_all", 1.2e9, [0, 1, 2, 3], cluster) == pytest.approx(expected)


def test_send_recv_is_one_message_on_the_link_between_the_pair(cluster):
    assert collective_time("send_recv", 25e6, [0, 8], cluster) == pytest.approx(15e-6 + 1e-3)
    assert collective_time("send_recv", 25e6, [0, 1], cluster) == pytest.approx(5e-6 + 25e6 / 300e9)
    assert cc.send_recv_time(0, IB) == pytest.approx(15e-6)


@pytest.mark.parametrize("kind", cc.KINDS)
def test_a_group_of_one_rank_costs_nothing(cluster, kind):
    assert collective_time(kind, 1e9, [3], cluster) == 0
    assert cc.all_reduce_time(1e9, 1, NVLINK, algorithm="tree") == 0


def test_tree_all_reduce_formula():
    # 2 * ceil(log2 8) * 5 us + 2 * 3e9 B / 300e9 B/s
    assert cc.all_reduce_time(3e9, 8, NVLINK, algorithm="tree") == pytest.approx(30e-6 + 0.02)
    # 6 ranks: depth ceil(log2 6) = 3
    assert cc.all_reduce_time(0, 6, NVLINK, algorithm="tree") == pytest.approx(30e-6)


def test_tree_beats_ring_for_tiny_messages_and_loses_for_large_ones(cluster):
    tiny, large = 8, 1e9

    def ring(size):
        return collective_time("all_reduce", size, NODE0, cluster, algorithm="ring")

    def tree(size):
        return collective_time("all_reduce", size, NODE0, cluster, algorithm="tree")

    assert tree(tiny) < ring(tiny)  # ~30 us vs ~70 us of latency
    assert tree(large) > ring(large)  # 2 S/B vs 1.75 S/B
    # Crossover: 2*3 a + 2 S/B = 2*7 a + 1.75 S/B  =>  S = 8 a B / 0.25 = 48 kB
    crossover = 8 * 5e-6 * 300e9 / 0.25
    assert tree(crossover) == pytest.approx(ring(crossover))


def test_hierarchical_all_reduce_over_two_nodes(cluster):
    size = 1.6e9
    rs = 7 * 5e-6 + 7 / 8 * size / 300e9  # reduce-scatter in each node
    ar = 2 * 15e-6 + 2 * (1 / 2) * (size / 8) / 25e9  # all-reduce S/8 across the 2 nodes
    ag = rs  # all-gather in each node: same volume and steps
    expected = rs + ar + ag
    got = collective_time("all_reduce", size, BOTH_NODES, cluster, algorithm="hierarchical")
    assert got == pytest.approx(expected)
    assert cc.hierarchical_all_reduce_time(size, 8, 2, NVLINK, IB) == pytest.approx(expected)


@pytest.mark.parametrize("size", [0, 8, 1e6, 1.6e9])
def test_auto_all_reduce_takes_the_cheapest_of_ring_tree_and_hierarchical(cluster, size):
    flat = collective_time("all_reduce", size, BOTH_NODES, cluster, algorithm="ring")
    tree = collective_time("all_reduce", size, BOTH_NODES, cluster, algorithm="tree")
    hier = collective_time("all_reduce", size, BOTH_NODES, cluster, algorithm="hierarchical")
    auto = collective_time("all_reduce", size, BOTH_NODES, cluster)
    assert auto == min(flat, tree, hier)
    assert hier <= flat


def test_small_nccl_all_reduces_take_the_tree_and_gloo_keeps_its_ring(cluster):
    # 8 bytes over 8 NVLink ranks: ring 14 x 5 us = 70 us, tree 2 x 3 x 5 us = 30 us (NCCL's
    # tuner picks the tree for latency-bound sizes); gloo's all-reduce is a ring.
    assert collective_time("all_reduce", 8, NODE0, cluster) == pytest.approx(30e-6, rel=1e-3)
    gloo = Cluster.from_dict({**cluster.to_dict(), "backend": "gloo"})
    assert collective_time("all_reduce", 8, NODE0, gloo) == pytest.approx(70e-6, rel=1e-3)


def test_hierarchical_is_much_cheaper_than_a_flat_ring_for_large_two_node_all_reduces(cluster):
    # flat: 30 * 15 us + 2*15/16 * 1.6e9 / 25e9 = 0.12045 s; hierarchical ~ 0.0174 s
    flat = collective_time("all_reduce", 1.6e9, BOTH_NODES, cluster, algorithm="ring")
    assert flat == pytest.approx(450e-6 + 0.12)
    assert collective_time("all_reduce", 1.6e9, BOTH_NODES, cluster) == pytest.approx(100e-6 + 0.0173333333)


def test_auto_falls_back_to_the_flat_ring_when_hierarchy_does_not_apply(cluster):
    for ranks in ([0, 8], [0, 1, 2, 8]):  # one rank per node; uneven ranks per node
        flat = collective_time("all_reduce", 1e9, ranks, cluster, algorithm="ring")
        assert collective_time("all_reduce", 1e9, ranks, cluster) == flat
        with pytest.raises(ValueError, match="hierarchical"):
            collective_time("all_reduce", 1e9, ranks, cluster, algorithm="hierarchical")


def test_hierarchical_all_to_all_trades_inter_node_latencies_for_intra_node_bytes(cluster):
    """Expert parallelism over 2 nodes of 8: the flat exchange pays 15 inter-node latencies, the
    two-level one 7 intra-node and 1 inter-node latency plus an intra-node pass over the buffer."""
    size = 64e3  # a small dispatch (latency-bound)
    flat = 15 * 15e-6 + 15 / 16 * size / 25e9
    two_level = (7 * 5e-6 + 7 / 8 * size / 300e9) + (1 * 15e-6 + 1 / 2 * size / 25e9)
    assert collective_time("all_to_all", size, BOTH_NODES, cluster, algorithm="ring") == pytest.approx(flat)
    assert collective_time("all_to_all", size, BOTH_NODES, cluster, algorithm="hierarchical") == pytest.approx(two_level)
    assert cc.hierarchical_all_to_all_time(size, 8, 2, NVLINK, IB) == pytest.approx(two_level)
    assert collective_time("all_to_all", size, BOTH_NODES, cluster) == pytest.approx(min(flat, two_level))
    assert two_level < flat
    # A large buffer is bandwidth-bound: the flat exchange sends 15/16 of it across nodes, the
    # two-level one 1/2, so it still wins over 2 nodes; inside one node there is nothing to split.
    big = 1.6e9
    assert collective_time("all_to_all", big, BOTH_NODES, cluster) == pytest.approx(
        cc.hierarchical_all_to_all_time(big, 8, 2, NVLINK, IB))
    assert collective_time("all_to_all", big, NODE0, cluster) == pytest.approx(7 * 5e-6 + 7 / 8 * big / 300e9)


def test_bad_arguments_raise_value_errors_naming_the_field(cluster):
    with pytest.raises(ValueError, match="kind"):
        collective_time("broadcast", 1, NODE0, cluster)
    with pytest.raises(ValueError, match="algorithm"):
        collective_time("all_reduce", 1, NODE0, cluster, algorithm="butterfly")
    with pytest.raises(ValueError, match="all_reduce only"):
        collective_time("all_gather", 1, NODE0, cluster, algorithm="tree")
    with pytest.raises(ValueError, match="all_reduce and all_to_all only"):
        collective_time("all_gather", 1, BOTH_NODES, cluster, algorithm="hierarchical")
    with pytest.raises(ValueError, match="hierarchical all_to_all needs"):
        collective_time("all_to_all", 1, [0, 8], cluster, algorithm="hierarchical")
    with pytest.raises(ValueError, match="size_bytes"):
        ring_volume_bytes("all_gather", -1, 4)
    with pytest.raises(ValueError, match="num_ranks"):
        ring_volume_bytes("all_gather", 1, 0)
    with pytest.raises(ValueError, match="send_recv"):
        collective_time("send_recv", 1, [0, 1, 2], cluster)


# --------------------------------------------------------------------------- graph ops


def test_cost_module_does_not_import_torch():
    tree = ast.parse(pathlib.Path(cc.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(name == "torch" or name.startswith("torch.") for name in imported), imported
