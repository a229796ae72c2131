"""The static verifier (graphpass.runtime.verifier): every rank's program checked against its peers'.

Corruptions are injected by an extra pass that edits one rank's graph after the real passes —
a collective removed, two reordered, one given another shape — and must be reported before
anything runs, naming that pass, the node and the ranks: by ``gp.verify`` (every rank simulated in
this process) and by ``gp.compile`` on real gloo ranks (every rank raises the same error). Valid
programs pass it everywhere else in the suite, since ``compile`` verifies by default.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import graphpass as gp
import graphpass.api
import zoo
from graphpass import meta
from graphpass.pass_manager import graph_pass
from graphpass.passes.collectives import is_collective

H100x4 = gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=4)


def _collectives(gm, op: str):
    return [n for n in gm.graph.nodes if is_collective(n) and n.target.__name__ == op]


def _erase_gather(gm, node):
    """Remove a ZeRO gather: its users (getitem of each parameter) read the shards instead; the
    fake values are re-derived by the runner, the sizes differ, so read them through a view that
    keeps the graph valid (the verifier must catch it before any shape does)."""
    params = [a for a in node.args[1:] if isinstance(a, torch.fx.Node)]
    full = node.kwargs["shapes"]
    for user in list(node.users):
        index = user.args[1]
        with gm.graph.inserting_before(user):
            padded = gm.graph.call_function(torch.ops.aten.new_zeros.default, (params[index], list(full[index])))
        padded.meta.update({k: v for k, v in user.meta.items() if k != meta.VAL})
        user.replace_all_uses_with(padded)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)


@graph_pass("drop_a_gather_on_rank_1")
def drop_gather(gm, plan, ctx):
    if ctx.rank == 1:
        _erase_gather(gm, _collectives(gm, "all_gather_params")[1])
    return gm


@graph_pass("swap_two_gathers_on_rank_1")
def swap_gathers(gm, plan, ctx):
    if ctx.rank == 1:
        first, second = _collectives(gm, "all_gather_params")[1:3]
        first.prepend(second)  # both read only parameters and the step's sync node
    return gm


@graph_pass("reshape_the_loss_on_rank_1")
def reshape_loss(gm, plan, ctx):
    if ctx.rank == 1:
        node = _collectives(gm, "all_reduce")[-1]  # the reported loss, a 0-dim tensor
        with gm.graph.inserting_before(node):
            wide = gm.graph.call_function(torch.ops.aten.expand.default, (node.args[0], [2]))
        node.replace_input_with(node.args[0], wide)
    return gm


CORRUPTIONS = {
    "removed": (drop_gather, "all_gather_params_1", "is missing on rank 1"),
    "reordered": (swap_gathers, "all_gather_params_1", "node 'all_gather_params_2') and node 'all_gather_params_1' "
                                                       "only at entry 3: reordered"),
    "reshaped": (reshape_loss, "all_reduce", "of [(2,) float32] -> [(2,) float32] (another shape"),
}
STRATEGY = dict(dp=2, zero=3)


def _with_pass(monkeypatch, corrupt):
    real = graphpass.api.passes_for
    monkeypatch.setattr(graphpass.api, "passes_for", lambda plan: (*real(plan), corrupt))


def _assert_names_pass_node_and_ranks(message: str, corrupt, node: str, detail: str, ranks: str) -> None:
    assert f"after pass {corrupt.pass_name!r}" in message, message
    assert f"node {node!r}" in message and detail in message, message
    assert ranks in message and "rank 1" in message, message


# ------------------------------------------------------------------ simulated in one process


def test_valid_programs_pass_and_each_group_is_listed():
    data = zoo.batches("gpt", 1, 8)
    programs = gp.verify(zoo.build("gpt"), H100x4, example_inputs=data[0],
                         strategy=gp.Strategy(dp=2, tp=2, zero=3, sequence_parallel=True))
    assert sorted(programs) == [0, 1, 2, 3]
    # rank 0's groups: dp over ranks 0 and 2 (tp is the inner axis), tp over 0 and 1, and the
    # shards of the 2 x 2 replica group.
    assert set(programs[0]) == {("dp", (0, 2)), ("tp", (0, 1)), ("shards", (0, 1, 2, 3))}
    ops = {e.op for e in programs[0][("dp", (0, 2))]}
    assert {"all_gather_params", "grad_sync_begin", "all_reduce"} <= ops
    assert {e.op for e in programs[0][("tp", (0, 1))]} >= {"tp_all_gather", "tp_reduce_scatter"}
    # The tp peers move the same shapes; rank 3's program on its own tp group equals rank 0's.
    assert programs[3][("tp", (2, 3))] == programs[0][("tp", (0, 1))]


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_simulated_corruption_is_named(monkeypatch, kind):
    corrupt, node, detail = CORRUPTIONS[kind]
    _with_pass(monkeypatch, corrupt)
    data = zoo.batches("gpt", 1, 8)
    cluster = gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=2)
    with pytest.raises(gp.VerificationError) as err:
        gp.verify(zoo.build("gpt"), cluster, example_inputs=data[0], strategy=gp.Strategy(**STRATEGY))
    _assert_names_pass_node_and_ranks(str(err.value), corrupt, node, detail, "'dp' group of ranks [0, 1]")


@graph_pass("mislabel_a_shard")
def mislabel_a_shard(gm, plan, ctx):
    """Every rank: one ZeRO shard claims a larger full tensor than it is a shard of."""
    node = next(n for n in gm.graph.nodes if n.op == "get_attr" and meta.layout(n) is not None and n.target == "h.0.mlp.up.weight")
    node.meta[meta.LAYOUT] = dataclasses.replace(meta.layout(node), shape=(400, 64))
    return gm


def test_shards_that_do_not_tile_the_parameter_are_named(monkeypatch):
    _with_pass(monkeypatch, mislabel_a_shard)
    data = zoo.batches("gpt", 1, 8)
    cluster = gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=2)
    with pytest.raises(gp.VerificationError, match=r"shards of 'h.0.mlp.up.weight' cover 16384 of its 25600 "
                                                    r"elements \(shape \(400, 64\)\) \(node 'h_0_mlp_up_weight', over ranks \[0, 1\]\)"):
        gp.verify(zoo.build("gpt"), cluster, example_inputs=data[0], strategy=gp.Strategy(**STRATEGY))


def test_a_program_over_the_device_memory_is_refused():
    # The GPT's parameters are 474 kB: with their gradients 948 kB a rank under dp, 237 kB under ZeRO-3.
    tiny = dataclasses.replace(H100x4.device, memory_bytes=500_000)
    cluster = dataclasses.replace(H100x4, device=tiny)
    data = zoo.batches("gpt", 1, 8)
    with pytest.raises(gp.VerificationError, match=r"ranks \[0, 1, 2, 3\]: this rank's device-resident parameters and their "
                                                    r"gradients is 926 KiB, more than the device's 488 KiB; shard more"):
        gp.verify(zoo.build("gpt"), cluster, example_inputs=data[0], strategy=gp.Strategy(dp=4))
    gp.verify(zoo.build("gpt"), cluster, example_inputs=data[0], strategy=gp.Strategy(dp=4, zero=3))
    # A pipeline stage holds its own layer only (~200 kB) and the embeddings (~100 kB): with
    # gradients at most 594 kB, under 700 kB, where dp's 926 KiB is not.
    roomier = dataclasses.replace(cluster, device=dataclasses.replace(tiny, memory_bytes=700_000))
    gp.verify(zoo.build("gpt"), roomier, example_inputs=data[0], strategy=gp.Strategy(pp=2, dp=2, microbatches=2))
    with pytest.raises(gp.VerificationError, match="926 KiB"):
        gp.verify(zoo.build("gpt"), roomier, example_inputs=data[0], strategy=gp.Strategy(dp=4))


def test_each_pipeline_rank_runs_and_holds_its_own_stage():
    data = zoo.batches("gpt", 1, 8)
    cluster = gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=4)
    programs = gp.verify(zoo.build("gpt"), cluster, example_inputs=data[0],
                         strategy=gp.Strategy(pp=2, dp=2, zero=3, microbatches=2))
    held = {r: {e.node for e in programs[r][("shards", group)]} for r in programs
            for axis, group in programs[r] if axis == "shards"}
    assert held[0] == held[1] and held[2] == held[3]  # a stage's dp replicas hold the same tensors
    assert "h.0.attn.q.weight" in held[0] and "h.0.attn.q.weight" not in held[2]
    assert "h.1.attn.q.weight" in held[2] and "h.1.attn.q.weight" not in held[0]
    gathered = {r: {p for e in programs[r][("dp", group)] if e.op == "all_gather_params" for p in e.signature[2]}
                for r in programs for axis, group in programs[r] if axis == "dp"}
    # Only the tied embedding / LM head is gathered on both stages (each stage its own use).
    assert gathered[0] & gathered[2] <= {"wte.weight"}, gathered[0] & gathered[2]


# ------------------------------------------------------------------ on real ranks in compile


def _compile_corrupted(kind: str, verify: bool = True) -> str:
    """On each rank: compile with the corrupting pass appended; the verifier's message, or
    ``"compiled"``."""
    corrupt = CORRUPTIONS[kind][0]
    real = graphpass.api.passes_for
    graphpass.api.passes_for = lambda plan: (*real(plan), corrupt)
    try:
        data = zoo.batches("gpt", 1, 8)
        gp.compile(zoo.build("gpt"), gp.Cluster.local(), example_inputs=data[0], strategy=gp.Strategy(**STRATEGY),
                   verify=verify)
        return "compiled"
    except gp.VerificationError as exc:
        return str(exc)
    finally:
        graphpass.api.passes_for = real


@pytest.mark.timeout(300)
def test_compile_raises_the_same_error_on_every_rank_before_anything_runs(rank_pool):
    pool = rank_pool(2)
    for kind, (corrupt, node, detail) in CORRUPTIONS.items():
        messages = pool.run(_compile_corrupted, kind, timeout_s=120)
        assert messages[0] == messages[1], messages  # both ranks raise, with the same words
        _assert_names_pass_node_and_ranks(messages[0], corrupt, node, detail, "'dp' group of ranks [0, 1]")
    # verify=False compiles the corrupted program (what would then run is the user's choice).
    assert pool.run(_compile_corrupted, "removed", False, timeout_s=120) == ["compiled", "compiled"]
