"""Uneven data-parallel shares (``Strategy(dp_shares=...)``, for unlike devices) against one
process: the global batch cut in proportion to the weights, each rank's program compiled for its
own share, the loss weighted by share (``global_loss_mean``). Tolerances as tests/test_dp.py's:
only the order of fp32 additions differs from one process; a rank whose loss kept the even
1/dp weight (off by 3x for a 3:1 split) or a share cut at the wrong sample misses them."""

from __future__ import annotations

import pytest

import graphpass as gp

import zoo

RTOL, ATOL = 1e-5, 1e-6


def _train(name: str, strategy: dict, batch: int):
    import torch.distributed as dist

    data = zoo.batches(name, 3, batch)
    dmodel = zoo.compile(zoo.build(name), data[0], gp.Strategy(dp=dist.get_world_size(), **strategy))
    return zoo.train_compiled(dmodel, data), dmodel.full_state_dict(), dmodel.plan.dp_shares, \
        tuple(dmodel.local_batch(*data[0])[0].shape)


CASES = [  # (world, model, strategy, global batch)
    (2, "gpt", {"dp_shares": (3, 1)}, 8),  # cross-entropy: counted per step, made global
    (2, "mlp", {"dp_shares": (3, 1), "microbatches": 2}, 8),  # a mean squared error, weighted by share
    (4, "gpt", {"dp_shares": (3, 3, 1, 1), "zero": 3}, 16),
    (4, "mlp", {"dp_shares": (2.5, 1.5, 1, 1), "zero": 1, "microbatches": 2}, 24),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_shares_train_as_one_process(rank_pool, world_size):
    pool = rank_pool(world_size)
    for world, name, strategy, batch in CASES:
        if world != world_size:
            continue
        ref_losses, ref_state, _ = zoo.train_reference(name, steps=3, batch=batch)
        counts = gp.batching.share_counts(batch, strategy["dp_shares"])
        for rank, (losses, state, shares, local) in enumerate(pool.run(_train, name, strategy, batch,
                                                                         timeout_s=300)):
            assert shares == counts and local[0] == counts[rank], (shares, local)
            zoo.assert_matches_reference(f"{name} {strategy} rank {rank}", losses, state, ref_losses, ref_state,
                                         rtol=RTOL, atol=ATOL)


def test_uneven_shares_are_checked():
    with pytest.raises(ValueError, match=r"Strategy.dp_shares must be 2 positive weights, one per dp rank"):
        gp.Strategy(dp=2, dp_shares=(1, 1, 1))
    with pytest.raises(ValueError, match=r"Strategy.dp_shares must be 2 positive weights"):
        gp.Strategy(dp=2, dp_shares=(1, 0))
    with pytest.raises(NotImplementedError, match=r"Strategy.dp_shares \(uneven shares\) with pp=2"):
        gp.Strategy(dp=2, pp=2, dp_shares=(2, 1))
    with pytest.raises(ValueError, match=r"the batch's 4 samples in shares of \(10, 1, 1\) leave a share empty"):
        gp.batching.share_counts(4, (10, 1, 1))
    assert gp.batching.share_counts(10, (3, 1)) == (8, 2) and sum(gp.batching.share_counts(7, (1, 1, 1))) == 7
    with pytest.raises(ValueError, match=r"Plan.dp_shares must be 2 positive sample counts"):
        gp.Plan(mesh={"dp": 2}, dp_shares=(3, 1, 1))
    plan = gp.Plan(mesh={"dp": 2}, dp_shares=(3, 1))
    assert gp.Plan.from_json(plan.to_json()) == plan and "uneven data-parallel shares: 3/1" in plan.explain()
