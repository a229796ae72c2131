"""The optimizer a DDP user builds before ``compile`` (``opt = SGD(model.parameters())``) trains
the compiled program exactly as one process would, or raises at its first step naming the fix
(graphpass.runtime.ownership).

Tolerances: as tests/test_dp.py (rtol 1e-5 / atol 1e-6: the ranks' reduction order differs from
one process by fp32 rounding; SGD with momentum keeps that at rounding level over 3 steps). An
optimizer that steps tensors the program does not read leaves the loss where it was (off by
far more than that).
"""

from __future__ import annotations

import pytest
import torch

import graphpass as gp
import zoo

RTOL, ATOL = 1e-5, 1e-6
MODEL = "hf_llama"


def _train_with_early_optimizer(strategy_kwargs: dict, built: str):
    model = zoo.build(MODEL)
    data = zoo.batches(MODEL, 3, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if built == "before" else None
    world_size = torch.distributed.get_world_size()
    kwargs = dict(strategy_kwargs)
    kwargs.setdefault("dp", world_size // kwargs.get("tp", 1))
    dmodel = zoo.compile(model, data[0], gp.Strategy(**kwargs))
    if built == "after, from the model":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in data:
        losses.append(dmodel.train_step(*batch).item())
        opt.step()
        opt.zero_grad()
    return losses, dmodel.full_state_dict()


def _expect_refusal(strategy_kwargs: dict, stepped_before: bool) -> str:
    model = zoo.build("gpt")
    data = zoo.batches("gpt", 2, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if stepped_before:
        model(*data[0]).backward()
        opt.step()
    dmodel = zoo.compile(model, data[0], gp.Strategy(dp=torch.distributed.get_world_size(), **strategy_kwargs))
    dmodel.train_step(*data[1])
    try:
        opt.step()
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("the optimizer stepped without an error")
    # the optimizer the README shows trains this program
    good = torch.optim.SGD(dmodel.parameters(), lr=0.05, momentum=0.9)
    good.step()
    return message


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_an_optimizer_built_before_compile_trains_as_one_process(rank_pool, world_size):
    pool = rank_pool(world_size)
    ref_losses, ref_state, _ = zoo.train_reference(MODEL, steps=3, batch=8)
    cases = [({"zero": 3}, "before"), ({"tp": 2}, "before"), ({"zero": 1}, "after, from the model")]
    if world_size == 4:
        cases = [({"tp": 2, "zero": 3}, "before"), ({"tp": 2}, "after, from the model")]
    for kwargs, built in cases:
        for rank, (losses, state) in enumerate(pool.run(_train_with_early_optimizer, kwargs, built, timeout_s=300)):
            zoo.assert_matches_reference(f"{kwargs} optimizer built {built}, rank {rank}/{world_size}",
                                         losses, state, ref_losses, ref_state, rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(300)
def test_an_optimizer_that_cannot_train_the_program_raises_at_its_first_step(rank_pool):
    pool = rank_pool(2)
    split, stale = (pool.run(_expect_refusal, kwargs, stepped, timeout_s=200)[0]
                    for kwargs, stepped in (({"zero": 3, "split": 2}, False), ({"zero": 3}, True)))
    assert "slices" in split and "h.0" in split and "dmodel.parameters()" in split, split
    assert "momentum_buffer" in stale and "stepped before compile" in stale, stale
