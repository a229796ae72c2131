"""Recommendation models (embedding tables fed by jagged multi-hot ids) on 2 and 4 gloo ranks
against one process: loss, gradients and parameters after 3 SGD-momentum steps.

Tolerances: graphpass.testing's defaults (rtol 1e-5, atol 1e-6). Each rank pools the same ids of
its samples as one process does (test_batching checks the cut is exact), then reduces its share's
mean and the all-reduce adds the shares in another order: rounding-level differences, where a
bag cut at the wrong offsets or a missing gradient average is off by far more.
"""

from __future__ import annotations

import pytest
import torch

import graphpass as gp
from graphpass.testing import assert_parity

import zoo
from dlrm import DLRM, CriteoLike, DLRMConfig

_CONFIG = DLRMConfig(per_sample_weights=True)


def dlrm():
    torch.manual_seed(0)
    return DLRM(_CONFIG)


def dlrm_batches():
    data = CriteoLike(_CONFIG, seed=3)
    return [data.batch(16) for _ in range(3)]


def table_major():
    torch.manual_seed(0)
    return zoo.TableMajor(include_last_offset=True)


def table_major_batches():
    return [zoo.table_major_batch(batch=16, seed=s, include_last_offset=True) for s in range(3)]


def dlrm_one_scale():
    torch.manual_seed(0)
    return zoo.ScaledBy(DLRM(_CONFIG))


def dlrm_one_scale_batches():
    return [(*b, torch.tensor([0.5, 2.0])) for b in dlrm_batches()]


def compile_scale_whole(model, example_inputs, strategy):
    """The last input (a [2] scale every sample shares) declared as read whole by every rank."""
    return gp.compile(model, gp.Cluster.local(), example_inputs=example_inputs, strategy=strategy,
                      batch_dims={len(example_inputs) - 1: None})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_recommendation_models_train_as_one_process_under_data_parallel(rank_pool, world_size):
    strategies = [gp.Strategy(), gp.Strategy(microbatches=2), gp.Strategy(zero=3)]
    for model_fn, batch_fn in ((dlrm, dlrm_batches), (table_major, table_major_batches)):
        assert_parity(model_fn, batch_fn, strategies, world_sizes=(world_size,), ranks=rank_pool)
    assert_parity(dlrm_one_scale, dlrm_one_scale_batches, [gp.Strategy(microbatches=2)], world_sizes=(world_size,),
                  ranks=rank_pool, compile_fn=compile_scale_whole)


_BAD = {
    "id past the table": "input 'sparse_and_labels_3' looks up id 200 in table 'tables.1.weight' (200 rows, lookup "
                         "'embedding_bag_1')",
    "negative id": "input 'sparse_and_labels_0' looks up id -1 in table 'tables.0.weight' (1000 rows",
    "decreasing offsets": "input 'sparse_and_labels_4' does not fit 'sparse_and_labels_3': an offset is smaller than "
                          "the one before it (at [3])",
    "offsets past the ids": "does not fit 'sparse_and_labels_0': an offset is past the",
}


def _train_with_bad_batches() -> dict[str, str]:
    """Each bad batch's error on this rank (a rank that did not raise would go on into the
    step's collectives and the next case would hang or fail)."""
    model = dlrm()
    good = dlrm_batches()[0]
    dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=good, strategy=gp.Strategy(dp=2))
    errors = {}
    for kind in _BAD:
        batch = [t.clone() for t in good]
        if kind == "id past the table":
            batch[4][-1] = _CONFIG.table_rows[1]  # feature 1's last id, one past its table
        elif kind == "negative id":
            batch[1][0] = -1
        elif kind == "decreasing offsets":
            batch[5][3] = batch[5][2] - 1
        elif kind == "offsets past the ids":
            batch[2][-1] = len(batch[1]) + 1
        try:
            dmodel.train_step(*batch)
        except ValueError as exc:
            errors[kind] = str(exc)
    dmodel.train_step(*good)  # and the program still trains
    return errors


@pytest.mark.timeout(300)
def test_ids_and_offsets_that_do_not_fit_fail_every_rank_naming_input_and_table(rank_pool):
    for rank, errors in enumerate(rank_pool(2).run(_train_with_bad_batches, timeout_s=120)):
        for kind, message in _BAD.items():
            assert message in errors.get(kind, "(no error)"), (rank, kind, errors.get(kind))
