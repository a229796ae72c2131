"""Pipeline stages run by torch.distributed.pipelining: parity with one process on the whole batch.

``Strategy(pp=p, microbatches=k, schedule=...)`` cuts the graph into ``p`` stages (even by
layers), one per rank, and the engine's schedule runs ``k`` microbatches through them. Losses
and ``full_state_dict()`` after 3 SGD-with-momentum steps must match one process on the whole
batch. Tolerances as in test_accumulation.py: the pipeline only changes the order of fp32
additions (each microbatch's mean scaled by 1/k and summed into ``.grad``; a tied weight's two
stage gradients summed by an all-reduce), ~1e-7 relative; rtol 1e-5 / atol 1e-6 catch any real
error (a gradient scaled twice is off by k, a tied weight's missing half by far more).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import graphpass as gp
import zoo
from graphpass.plan import Plan

RTOL, ATOL = 1e-5, 1e-6
BATCH, STEPS = 8, 3

# (model, microbatches, schedule, dp, ZeRO stage) per world size: tied (gpt, hf_gpt2) and untied
# (hf_llama) embeddings, both schedules, 4 stages on the 4-layer GPT, 2 stages x dp 2 with and
# without ZeRO (a tied weight sharded on both stages that read it).
CASES = {
    2: [("gpt", 2, "gpipe", 1, 0), ("gpt", 4, "1f1b", 1, 0), ("hf_llama", 2, "1f1b", 1, 0), ("hf_gpt2", 4, "gpipe", 1, 0)],
    4: [("gpt_deep", 4, "1f1b", 1, 0), ("gpt_deep", 2, "gpipe", 1, 0), ("gpt", 2, "1f1b", 2, 0),
        ("hf_llama", 4, "gpipe", 2, 0), ("gpt", 2, "1f1b", 2, 3), ("hf_llama", 2, "gpipe", 2, 1)],
}


def _train_pipelined(name: str, k: int, schedule: str, dp: int, zero: int) -> tuple:
    world = dist.get_world_size()
    data = zoo.batches(name, STEPS, BATCH)
    strategy = gp.Strategy(pp=world // dp, dp=dp, microbatches=k, schedule=schedule, zero=zero)
    model = zoo.build(name)
    total = sum(p.numel() for p in model.parameters())
    dmodel = zoo.compile(model, data[0], strategy)
    # The rank keeps only its stage's weights (and of those its ZeRO shards): the others'
    # storage is released.
    kept = sum(p.numel() for p in model.parameters())
    assert kept <= sum(p.numel() for p in dmodel.parameters()) < total, (kept, total)
    losses = zoo.train_compiled(dmodel, data)
    stage_params = sorted(n for n, _ in dmodel.named_parameters())
    return losses, dmodel.full_state_dict(), stage_params


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_stages_match_one_process_on_the_whole_batch(rank_pool, world_size):
    pool = rank_pool(world_size)
    for name, k, schedule, dp, zero in CASES[world_size]:
        ref_losses, ref_state = zoo.train_reference(name, steps=STEPS, batch=BATCH)[:2]
        results = pool.run(_train_pipelined, name, k, schedule, dp, zero, timeout_s=300)
        for rank, (losses, state, params) in enumerate(results):
            zoo.assert_matches_reference(f"{name} pp={world_size // dp} dp={dp} zero={zero} m={k} {schedule} rank {rank}",
                                         losses, state, ref_losses, ref_state, rtol=RTOL, atol=ATOL)
        # Each rank holds its own stage's parameters (the ranks of one pipeline replica are
        # consecutive on the pp x dp mesh only for dp=1: compare stage 0 with the last stage
        # through the mesh); only a tied embedding / LM head is on two stages.
        pp = world_size // dp
        mesh = gp.Strategy(pp=pp, dp=dp, microbatches=k, schedule=schedule, zero=zero).mesh
        replica = mesh.group_ranks("pp", 0)
        held = [set(results[r][2]) for r in replica]
        assert all(held)
        for a in range(pp):
            for b in range(a + 1, pp):
                assert len(held[a] & held[b]) <= 1, (a, b, held[a] & held[b])


def test_bad_pipeline_strategies_name_the_field_and_sizes():
    with pytest.raises(ValueError, match=r"Strategy.schedule='1f1b' needs at least as many microbatches as stages: "
                                         r"Strategy.microbatches=2 < pp=4"):
        gp.Strategy(pp=4, microbatches=2, schedule="1f1b").check(4)
    with pytest.raises(NotImplementedError, match="Strategy.schedule='interleaved_1f1b' is not implemented yet"):
        gp.Strategy(pp=2, microbatches=2, schedule="interleaved_1f1b").check(2)
    with pytest.raises(NotImplementedError, match=r"Strategy.pp=2 with tp=2, recompute=True is not implemented yet"):
        gp.Strategy(pp=2, tp=2, dp=2, recompute=True, microbatches=2).check(8)
    gp.Strategy(pp=2, microbatches=1, schedule="gpipe").check(2)  # GPipe runs any count
    # The runtime has an engine schedule for every schedule the checks let through.
    from graphpass.plan import RUNNING_SCHEDULES
    from graphpass.runtime.pipeline import SCHEDULES

    assert set(SCHEDULES) == set(RUNNING_SCHEDULES)


def test_more_stages_than_layers_is_refused_at_compile_naming_the_sizes():
    from graphpass.capture import capture
    from graphpass.plan_builder import plan_from_strategy

    data = zoo.batches("gpt", 1, BATCH)
    gm = capture(zoo.build("gpt"), data[0]).gm  # 2 layers
    with pytest.raises(ValueError, match=r"Strategy.pp=4 is larger than the model's 2 repeated layers"):
        plan_from_strategy(gm, gp.Strategy(pp=4, microbatches=4), ["test"])
    plan = plan_from_strategy(gm, gp.Strategy(pp=2, microbatches=2, schedule="gpipe"), ["test"])
    assert len(plan.stages) == 2 and plan.schedule == "gpipe"
    assert Plan.from_json(plan.to_json()) == plan
