"""Gradient accumulation: ``microbatches=k`` runs k forwards and backwards per step and
synchronises gradients once, with parity against one process on the whole batch.

Tolerances as in test_dp.py: accumulation only changes the order of fp32 additions (each
microbatch's mean, scaled by 1/k, summed into the held-back bucket), ~1e-7 relative; over 3
SGD-momentum steps rtol 1e-5 / atol 1e-6 catch any real error (a gradient summed instead of
averaged over microbatches is off by a factor k, a dropped microbatch by 1/k).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphpass as gp
import zoo
from graphpass.cost import search as S
from graphpass.runtime.step import Action, StepProgram

RTOL, ATOL = 1e-5, 1e-6
BATCH, STEPS = 16, 3
MODELS = ("gpt", "hf_gpt2", "hf_llama")


def _strategies(world: int) -> dict[str, dict]:
    """The layouts accumulation is checked under on ``world`` ranks (``Strategy`` keywords)."""
    if world == 2:
        return {"dp": dict(dp=2), "dp zero3": dict(dp=2, zero=3), "dp zero1": dict(dp=2, zero=1),
                "tp sp": dict(tp=2, sequence_parallel=True)}
    return {"dp": dict(dp=4), "dp zero3": dict(dp=4, zero=3), "dp zero1": dict(dp=4, zero=1),
            "dp x tp": dict(dp=2, tp=2), "dp x tp sp": dict(dp=2, tp=2, sequence_parallel=True)}


def _cases(world: int, name: str) -> dict[str, tuple[dict, int]]:
    """The layouts ``name`` runs on ``world`` ranks, with their microbatch counts: layout i on
    model i mod 3, with 2 or 4 microbatches alternating over layouts and flipped between world
    sizes, so every layout runs at every world size, and the dp/ZeRO layouts and every model
    with both counts (the whole model x layout x count product costs minutes of suite time and
    checks no rule this does not)."""
    layouts = list(_strategies(world).items())
    counts = [(2, 4)[(i + world // 4) % 2] for i in range(len(layouts))]
    return {f"{label} m={k}": (kwargs, k) for i, ((label, kwargs), k) in enumerate(zip(layouts, counts))
            if MODELS[i % len(MODELS)] == name}


def _train_accumulated(name: str) -> dict[str, tuple]:
    """On each rank: the layouts of ``_cases`` -> (losses, full state, microbatches the module
    ran, the graph's input shape)."""
    world = dist.get_world_size()
    data = zoo.batches(name, STEPS, BATCH)
    out = {}
    for case, (kwargs, k) in _cases(world, name).items():
        model = zoo.build(name)
        dmodel = zoo.compile(model, data[0], gp.Strategy(microbatches=k, **kwargs))
        losses = zoo.train_compiled(dmodel, data)
        out[case] = (losses, dmodel.full_state_dict(), dmodel.num_microbatches,
                     tuple(dmodel.graph_module.graph.find_nodes(op="placeholder")[0].meta["val"].shape))
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [2, 4])
def test_accumulation_matches_one_process_on_the_whole_batch(rank_pool, world_size):
    pool = rank_pool(world_size)
    for name in MODELS:
        ref_losses, ref_state = zoo.train_reference(name, steps=STEPS, batch=BATCH)[:2]
        results = pool.run(_train_accumulated, name, timeout_s=600)
        for rank, cases in enumerate(results):
            assert cases.keys() == _cases(world_size, name).keys()
            for case, (losses, state, k, shape) in cases.items():
                dp = gp.Strategy(**_cases(world_size, name)[case][0]).dp
                # The graph is one microbatch of this rank's share: accumulation, not a bigger graph.
                assert k == int(case.split("m=")[1]) and shape[0] == BATCH // (dp * k), (case, shape)
                zoo.assert_matches_reference(f"{name} {case} rank {rank}/{world_size}", losses, state,
                                             ref_losses, ref_state, rtol=RTOL, atol=ATOL)


def _sync_count(k: int) -> tuple[int, int, list[float]]:
    """(all-reduces launched by gradient buckets in one step, microbatches, losses)."""
    from graphpass.runtime import grad_sync

    launched = []
    real = grad_sync.dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if kwargs.get("async_op") and tensor.dim() > 0:  # not the reported (0-dim) losses
            launched.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    data = zoo.batches("gpt", 1, BATCH)
    dmodel = gp.compile(zoo.build("gpt"), gp.Cluster.local(), example_inputs=data[0],
                        strategy=gp.Strategy(dp=2, microbatches=k))
    grad_sync.dist.all_reduce = counting
    try:
        loss = dmodel.train_step(*data[0])
    finally:
        grad_sync.dist.all_reduce = real
    return len(launched), sum(launched), [loss.item()]


@pytest.mark.timeout(300)
def test_gradients_are_reduced_once_per_step_not_once_per_microbatch(rank_pool):
    pool = rank_pool(2)
    one = pool.run(_sync_count, 1, timeout_s=120)[0]
    four = pool.run(_sync_count, 4, timeout_s=120)[0]
    # The same buckets, each all-reduced once (with the last microbatch's backward), moving the
    # same number of elements as without accumulation.
    assert four[:2] == one[:2] and one[0] >= 1
    torch.testing.assert_close(four[2], one[2], rtol=RTOL, atol=0)


# ------------------------------------------------------------------------------ bad input


def test_microbatches_not_dividing_the_per_replica_batch_name_the_field_and_sizes():
    data = zoo.batches("gpt", 1, 8)[0]
    with pytest.raises(ValueError, match=r"8 rows per data-parallel replica \(dp=1\), which do not divide "
                                         r"into Strategy.microbatches=3"):
        gp.compile(zoo.build("gpt"), example_inputs=data, strategy=gp.Strategy(microbatches=3))


def test_a_batch_that_does_not_match_the_plans_microbatches_names_the_sizes():
    data = zoo.batches("gpt", 1, 8)[0]
    dmodel = gp.compile(zoo.build("gpt"), example_inputs=data, strategy=gp.Strategy(microbatches=2))
    plan = dmodel.plan
    assert plan.microbatches == 2 and gp.Plan.from_json(plan.to_json()).microbatches == 2
    with pytest.raises(ValueError, match=r"7 rows, which do not divide into Plan.microbatches=2"):
        dmodel.train_step(*zoo.batches("gpt", 1, 7)[0])
    with pytest.raises(ValueError, match=r"compiled for \(8, 32\) \(2 microbatches of \(4, 32\)\)"):
        dmodel.train_step(*zoo.batches("gpt", 1, 6)[0])
    with pytest.raises(ValueError, match=r"do not divide into Plan.microbatches=4"):
        gp.compile(zoo.build("gpt"), example_inputs=zoo.batches("gpt", 1, 6)[0],
                   strategy=gp.Plan.from_json(plan.to_json().replace('"microbatches": 2', '"microbatches": 4')))


def test_a_schedule_with_a_backward_before_its_forward_is_refused():
    with pytest.raises(ValueError, match="backward of microbatch 1 on stage 0 before its forward"):
        StepProgram([lambda: ()], 0, 0, [Action("forward", 0), Action("backward", 1), Action("forward", 1)])


def test_the_search_offers_gradient_accumulation_and_pipelines():
    cluster = gp.Cluster.preset("a100-80g", nodes=1, gpus_per_node=2)
    found = {(m.mesh.pp, m.mesh.dp, m.microbatches) for m in S.meshes(cluster, 16, [1], 4)}
    assert {(1, 2, 1), (1, 2, 2), (1, 2, 4), (1, 2, 8)} <= found
    # Pipelines run 1F1B: at least as many microbatches as stages.
    assert {(2, 1, 2), (2, 1, 4)} <= found and all(m >= pp for pp, _, m in found)
