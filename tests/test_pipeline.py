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
from graphpass.plan import Plan, interleaved_rounds

RTOL, ATOL = 1e-5, 1e-6
BATCH, STEPS = 8, 3

# (model, Strategy fields besides pp, which takes the ranks the others leave) per world size:
# tied (gpt, hf_gpt2) and untied (hf_llama) embeddings, both schedules, 4 stages on the 4-layer
# GPT, 2 stages x dp 2 with and without ZeRO (a tied weight sharded on both stages that read it),
# 2 stages x tp 2 (with sequence parallelism: the carried residual is a sequence shard),
# recompute and operator splitting inside the stages, interleaved 1F1B, and zero-bubble (its split
# weight backward, with recompute, two stages per rank, tp and a tied LM head).
CASES = {
    2: [("gpt", dict(microbatches=2, schedule="gpipe")), ("gpt", dict(microbatches=4)),
        ("hf_llama", dict(microbatches=2)), ("hf_gpt2", dict(microbatches=4, schedule="gpipe")),
        ("gpt", dict(microbatches=2, recompute=True)),
        ("gpt_deep", dict(microbatches=2, schedule="interleaved_1f1b", virtual_stages=2)),
        ("hf_llama_deep", dict(microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)),
        ("gpt", dict(microbatches=2, schedule="zero_bubble", recompute=True)),
        ("hf_llama_deep", dict(microbatches=4, schedule="zero_bubble", virtual_stages=2))],
    4: [("gpt_deep", dict(microbatches=4)), ("gpt_deep", dict(microbatches=2, schedule="gpipe")),
        # (gpt with pp 2 x dp 2, 2 microbatches: examples/test_gpt_parity.py)
        ("hf_llama", dict(dp=2, microbatches=4, schedule="gpipe")),
        ("gpt", dict(dp=2, zero=3, microbatches=2)), ("hf_llama", dict(dp=2, zero=1, microbatches=2, schedule="gpipe")),
        ("gpt", dict(tp=2, microbatches=2)), ("hf_llama", dict(tp=2, sequence_parallel=True, microbatches=2)),
        ("hf_gpt2", dict(tp=2, microbatches=2, schedule="gpipe")),
        ("gpt", dict(dp=2, zero=3, split=2, microbatches=2, recompute=True)),  # split is defined with ZeRO-3
        ("gpt_deep", dict(dp=2, microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)),
        ("hf_gpt2", dict(tp=2, microbatches=4, schedule="zero_bubble"))],
}


def _strategy(world: int, fields: dict) -> gp.Strategy:
    return gp.Strategy(pp=world // (fields.get("dp", 1) * fields.get("tp", 1)), **fields)


def _train_pipelined(name: str, fields: dict) -> tuple:
    data = zoo.batches(name, STEPS, BATCH)
    strategy = _strategy(dist.get_world_size(), fields)
    model = zoo.build(name)
    total = sum(p.numel() for p in model.parameters())
    dmodel = zoo.compile(model, data[0], strategy)
    # The rank keeps only its stage's weights (and of those its ZeRO and tp shards): the others'
    # storage is released.
    kept = sum(p.numel() for p in model.parameters())
    assert kept <= sum(p.numel() for p in dmodel.parameters()) < total, (kept, total)
    evaluated = dmodel(*data[0]).item()  # forwards only (the engine's eval): the first step's loss
    losses = zoo.train_compiled(dmodel, data)
    assert evaluated == pytest.approx(losses[0], rel=1e-6), (evaluated, losses[0])
    stage_params = sorted(n for n, _ in dmodel.named_parameters())
    return losses, dmodel.full_state_dict(), stage_params


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_stages_match_one_process_on_the_whole_batch(rank_pool, world_size):
    pool = rank_pool(world_size)
    for name, fields in CASES[world_size]:
        strategy = _strategy(world_size, fields)
        ref_losses, ref_state = zoo.train_reference(name, steps=STEPS, batch=BATCH)[:2]
        results = pool.run(_train_pipelined, name, fields, timeout_s=300)
        for rank, (losses, state, params) in enumerate(results):
            zoo.assert_matches_reference(f"{name} {strategy!r} rank {rank}", losses, state, ref_losses, ref_state,
                                         rtol=RTOL, atol=ATOL)
        # Each rank holds its own stage's parameters; only a tied embedding / LM head is on two
        # stages (compared along one pipeline replica of the mesh).
        replica = strategy.mesh.group_ranks("pp", 0)
        held = [set(results[r][2]) for r in replica]
        assert all(held)
        for a in range(strategy.pp):
            for b in range(a + 1, strategy.pp):
                assert len(held[a] & held[b]) <= 1, (a, b, held[a] & held[b])


def test_bad_pipeline_strategies_name_the_field_and_sizes():
    with pytest.raises(ValueError, match=r"Strategy.schedule='1f1b' needs at least as many microbatches as stages: "
                                         r"Strategy.microbatches=2 < pp=4"):
        gp.Strategy(pp=4, microbatches=2, schedule="1f1b").check(4)
    with pytest.raises(ValueError, match=r"Strategy.schedule='interleaved_1f1b' interleaves several stages per "
                                         r"rank, but Strategy.virtual_stages=1; use virtual_stages >= 2"):
        gp.Strategy(pp=2, microbatches=2, schedule="interleaved_1f1b").check(2)
    with pytest.raises(ValueError, match=r"runs microbatches in 2 equal rounds of about pp=2, which "
                                         r"Strategy.microbatches=5 does not divide into"):
        gp.Strategy(pp=2, microbatches=5, schedule="interleaved_1f1b", virtual_stages=2).check(2)
    with pytest.raises(ValueError, match=r"Strategy.virtual_stages=2 needs a schedule that runs several stages per rank"):
        gp.Strategy(pp=2, microbatches=2, virtual_stages=2).check(2)
    with pytest.raises(ValueError, match=r"Strategy.virtual_stages=2 needs pipeline stages: use pp > 1"):
        gp.Strategy(dp=2, virtual_stages=2, schedule="interleaved_1f1b").check(2)
    with pytest.raises(NotImplementedError, match="Strategy.schedule='zero_bubble' with Strategy.sequence_parallel=True "
                                                  "is not implemented yet"):
        gp.Strategy(pp=2, tp=2, microbatches=2, schedule="zero_bubble", sequence_parallel=True).check(4)
    with pytest.raises(ValueError, match=r"Strategy.schedule='zero_bubble' runs microbatches in 2 equal rounds"):
        gp.Strategy(pp=2, microbatches=5, schedule="zero_bubble").check(2)
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
    with pytest.raises(ValueError, match=r"Strategy.pp x Strategy.virtual_stages=4 is larger than the model's 2 "
                                         r"repeated layers"):
        plan_from_strategy(gm, gp.Strategy(pp=2, microbatches=2, schedule="interleaved_1f1b", virtual_stages=2),
                           ["test"])
    plan = plan_from_strategy(gm, gp.Strategy(pp=2, microbatches=2, schedule="gpipe"), ["test"])
    assert len(plan.stages) == 2 and plan.schedule == "gpipe"
    assert Plan.from_json(plan.to_json()) == plan


def _train_auto_with_memory(name: str, memory_bytes: int) -> tuple:
    import dataclasses

    data = zoo.batches(name, STEPS, BATCH)
    local = gp.Cluster.local()
    cluster = dataclasses.replace(local, device=dataclasses.replace(local.device, memory_bytes=memory_bytes))
    dmodel = gp.compile(zoo.build(name), cluster, example_inputs=data[0])  # strategy='auto'
    losses = zoo.train_compiled(dmodel, data)
    return losses, dmodel.full_state_dict(), dmodel.plan.to_json()


@pytest.mark.timeout(300)
def test_auto_runs_the_pipeline_the_planner_picks_under_a_tight_memory_budget(rank_pool):
    """On 2 ranks with 2.8 MB of memory each (the planner's budget is 90% of it; the default,
    unprofiled figures of this machine price the plans), no data-parallel plan of the 4-layer
    GPT fits (the smallest, dp 2 with 4 microbatches, needs over 3.5 MB with Adam's state);
    the planner picks 2 stages at the boundary it balances, and the plan trains with parity."""
    memory = int(2.8e6 / 0.9)
    pool = rank_pool(2)
    ref_losses, ref_state = zoo.train_reference("gpt_deep", steps=STEPS, batch=BATCH)[:2]
    results = pool.run(_train_auto_with_memory, "gpt_deep", memory, timeout_s=240)
    plans = {plan for _, _, plan in results}
    assert len(plans) == 1
    plan = Plan.from_json(plans.pop())
    assert plan.mesh.pp == 2 and len(plan.stages) == 2 and plan.schedule == "1f1b", plan.explain()
    assert plan.report.predicted_peak_memory_bytes <= 2.8e6 and len(plan.report.predicted_stage_peaks_bytes) == 2
    for rank, (losses, state, _) in enumerate(results):
        zoo.assert_matches_reference(f"auto pp rank {rank}", losses, state, ref_losses, ref_state, rtol=RTOL, atol=ATOL)


def _engine_peak(schedule: str, pp: int, virtual_stages: int, microbatches: int, held_from: str = "FORWARD"
                 ) -> list[int]:
    """Per rank, the most stage-microbatches torch's own schedule holds at once from a ``held_from``
    action to the backward that frees them (the weight-gradient one under zero-bubble): its action
    order, built as the engine builds it, without ranks."""
    from torch.distributed.pipelining import schedules as S

    engine = {"interleaved_1f1b": S.ScheduleInterleaved1F1B, "zero_bubble": S.ScheduleInterleavedZeroBubble}[schedule]
    frees = S._ComputationType.BACKWARD_WEIGHT if schedule == "zero_bubble" else S._ComputationType.FULL_BACKWARD
    starts = getattr(S._ComputationType, held_from)
    order = engine.__new__(engine)
    order.n_local_stages, order.pp_group_size, order._n_microbatches = virtual_stages, pp, microbatches
    order.number_of_rounds = interleaved_rounds(microbatches, pp)
    order.microbatches_per_round = microbatches // order.number_of_rounds
    peaks = []
    for rank in range(pp):
        held = peak = 0
        for action in order._calculate_single_rank_operations(rank):
            if action is not None and action.computation_type == starts:
                held += 1
                peak = max(peak, held)
            elif action is not None and action.computation_type == frees:
                held -= 1
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("schedule, pp, v, m", [("zero_bubble", 4, 1, 8), ("zero_bubble", 2, 1, 2),
                                                ("zero_bubble", 2, 2, 4), ("zero_bubble", 4, 2, 8),
                                                ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 4, 2, 8),
                                                ("interleaved_1f1b", 4, 3, 12)])
def test_priced_microbatches_in_flight_are_the_engines_own(schedule, pp, v, m):
    """The planner's activation memory per stage (``in_flight_microbatches``, averaged over a
    rank's ``v`` stages) is what torch's schedule holds: its action order, not a paper's formula."""
    from graphpass.cost.memory import deferred_weight_gradients, in_flight_microbatches

    priced = [in_flight_microbatches(pp, m, rank, schedule, v) * v for rank in range(pp)]
    assert priced == pytest.approx(_engine_peak(schedule, pp, v, m))
    if schedule == "zero_bubble":  # and the output gradients kept for deferred weight gradients
        deferred = [deferred_weight_gradients(pp, m, rank, v) * v for rank in range(pp)]
        assert deferred == pytest.approx(_engine_peak(schedule, pp, v, m, held_from="BACKWARD_INPUT"))
