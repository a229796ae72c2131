"""How inputs split along the batch (graphpass.batching), in one process: what inference finds
on recommendation models' inputs, and that a share of a jagged batch computes exactly the
share of what the whole batch computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass as gp
from graphpass import batching
from graphpass.batching import InputBatch

from dlrm import DLRM, CriteoLike, DLRMConfig
from zoo import TableMajor, table_major_batch


def test_infer_finds_jagged_ids_and_their_offsets_in_a_dlrm():
    model = DLRM(DLRMConfig(per_sample_weights=True))
    inputs = CriteoLike(model.config).batch(8)
    found = batching.infer(model, inputs)
    tables = len(model.config.table_rows)
    assert found[0] == InputBatch(dim=0) and found[-1] == InputBatch(dim=0)  # dense, labels
    for t in range(tables):
        ids, offsets, weights = 1 + 3 * t, 2 + 3 * t, 3 + 3 * t
        assert found[ids] == InputBatch(dim=0, offsets=offsets)
        assert found[weights] == InputBatch(dim=0, offsets=offsets)  # per-sample weights go with their ids
        assert found[offsets] == InputBatch(dim=0, is_offsets=True)


@pytest.mark.parametrize("include_last_offset", [False, True])
def test_infer_reads_table_major_inputs_through_zip_indexing_and_hashing(include_last_offset):
    model = TableMajor(include_last_offset=include_last_offset)
    found = batching.infer(model, table_major_batch(include_last_offset=include_last_offset))
    assert found == [InputBatch(dim=0), InputBatch(dim=1, offsets=2, include_last_offset=include_last_offset),
                     InputBatch(dim=1, is_offsets=True, include_last_offset=include_last_offset),
                     InputBatch(dim=1), InputBatch(dim=0)]


def test_inputs_that_agree_on_dim_0_are_not_run():
    class Raises(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 2)

        def forward(self, x, y):
            raise AssertionError("the model ran")

    out = batching.resolve(Raises(), (torch.zeros(4, 3, dtype=torch.long), torch.zeros(4)), None, None)
    assert out == [InputBatch(), InputBatch()]


def test_fixed_size_bags_given_table_major_split_along_their_batch_dim():
    class Bags(nn.Module):
        def __init__(self):
            super().__init__()
            self.tables = nn.ModuleList(nn.EmbeddingBag(20, 3) for _ in range(2))

        def forward(self, ids, y):  # ids [tables, batch, hots]
            return sum(t(ids[i]).sum() for i, t in enumerate(self.tables)) - y.sum()

    found = batching.infer(Bags(), (torch.randint(0, 20, (2, 6, 3)), torch.zeros(6)))
    assert found == [InputBatch(dim=1), InputBatch(dim=0)]


def _bags(inputs, batches, ways):
    """Each share's pooled embeddings (sum bags of a fixed table), concatenated."""
    table = torch.randn(1000, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    shares = [batching.cut(inputs, batches, ways, i) for i in range(ways)]
    return torch.cat([F.embedding_bag(s[1], table, s[2], mode="sum", per_sample_weights=s[3].double())
                      for s in shares])


@pytest.mark.parametrize("ways", [2, 4])
def test_a_share_of_a_jagged_batch_pools_what_the_whole_batch_pools_for_its_samples(ways):
    model = DLRM(DLRMConfig(table_rows=(1000,), max_hots=(5,), per_sample_weights=True))
    inputs = CriteoLike(model.config, seed=4).batch(8)
    batches = batching.infer(model, inputs)
    whole = _bags(inputs, batches, 1)
    # exact: each bag's sum runs over the same ids in the same order (float64 to leave no doubt)
    torch.testing.assert_close(_bags(inputs, batches, ways), whole, rtol=0, atol=0)
    share = batching.cut(inputs, batches, ways, 1)
    assert share[2][0] == 0 and len(share[2]) == 8 // ways  # offsets rebased, one per sample
    assert share[0].shape == (8 // ways, 13) and share[-1].shape == (8 // ways,)


def test_a_table_major_share_cuts_every_table_at_its_own_offsets():
    inputs = table_major_batch(batch=8, hots=2, include_last_offset=True)
    batches = batching.infer(TableMajor(include_last_offset=True), inputs)
    dense, ids, offsets, onehot, labels = batching.cut(inputs, batches, 4, 3)
    torch.testing.assert_close(ids, inputs[1][:, 12:16])
    torch.testing.assert_close(offsets, torch.tensor([[0, 2, 4]] * 3))
    torch.testing.assert_close(onehot, inputs[3][:, 6:8])
    torch.testing.assert_close(dense, inputs[0][6:8])


def test_cutting_rejects_offsets_that_do_not_fit_their_ids():
    batches = [InputBatch(dim=0, offsets=1), InputBatch(dim=0, is_offsets=True)]
    with pytest.raises(ValueError, match=r"input 'offsets' does not fit 'ids': a bag runs from 9 to 7"):
        batching.cut((torch.arange(7), torch.tensor([0, 2, 9, 9])), batches, 2, 1, ["ids", "offsets"])
    with pytest.raises(ValueError, match=r"'offsets' has 3 samples along dim 0, which does not divide by the shares = 2"):
        batching.cut((torch.arange(7), torch.tensor([0, 2, 5])), batches, 2, 0, ["ids", "offsets"])


def test_a_table_major_share_whose_rows_differ_in_length_is_refused():
    batches = [InputBatch(dim=1, offsets=1), InputBatch(dim=1, is_offsets=True)]
    ids, offsets = torch.arange(8).reshape(2, 4), torch.tensor([[0, 1], [0, 3]])
    with pytest.raises(ValueError, match="pass one ids tensor and one offsets tensor per table"):
        batching.cut((ids, offsets), batches, 2, 0, ["ids", "offsets"])


def test_declared_batch_dims_override_inference_and_are_checked():
    model = TableMajor()
    inputs = table_major_batch()
    keys = ("dense", "ids", "offsets", "onehot", "labels")
    out = batching.resolve(model, inputs, keys, {"onehot": None})
    assert out[3] == InputBatch(dim=None) and out[1] == InputBatch(dim=1, offsets=2)
    out = batching.resolve(model, inputs, None, {1: gp.Jagged(offsets=2), 2: -1, 3: 1})
    assert out[1:4] == [InputBatch(dim=1, offsets=2), InputBatch(dim=1, is_offsets=True), InputBatch(dim=1)]
    with pytest.raises(ValueError, match=r"batch_dims\['idz'\]: 'idz' is not an input; the inputs are \['dense'"):
        batching.resolve(model, inputs, keys, {"idz": 1})
    with pytest.raises(ValueError, match=r"batch_dims\['onehot'\]: dim 2 of a 2-D input; use 0..1"):
        batching.resolve(model, inputs, keys, {"onehot": 2})
    with pytest.raises(TypeError, match=r"batch_dims\['ids'\] must be a dim \(int\), None"):
        batching.resolve(model, inputs, keys, {"ids": "offsets"})
    with pytest.raises(ValueError, match=r"batch_dims\['ids'\].offsets: 'offset' is not an input"):
        batching.resolve(model, inputs, keys, {"ids": gp.Jagged("offset")})


def test_plans_record_each_inputs_batch_dim_and_jagged_offsets():
    model = TableMajor()
    inputs = table_major_batch()
    batches = batching.infer(model, inputs)
    captured = gp.capture(model, batching.cut(inputs, batches, 2, 0))
    batching.annotate(captured.gm, batches)
    from graphpass.plan_builder import plan_from_strategy

    plan = plan_from_strategy(captured.gm, gp.Strategy(dp=2), ())
    names = [n.name for n in captured.gm.graph.nodes if n.op == "placeholder"]
    assert plan.tensor(names[1]) == gp.TensorPlan({"dp": torch.distributed.tensor.Shard(1)},
                                                  jagged=gp.Jagged(names[2]))
    assert batching.of_plan(gp.Plan.from_json(plan.to_json()), names) == batches  # JSON keeps it
    edited = plan.with_tensor(names[1], jagged=None)
    with pytest.raises(ValueError, match=rf"Plan.tensors\['{names[1]}'\].jagged: None, but '{names[1]}' is jagged "
                                         rf"along its last dim \(dim 1\), cut at the offsets in '{names[2]}'"):
        edited.check_graph(captured.gm)
    moved = plan.with_tensor(names[3], placements={"dp": torch.distributed.tensor.Shard(0)})
    with pytest.raises(ValueError, match=rf"'{names[3]}' holds its samples along dim 1; use '{names[3]}': "
                                         r"\{'dp': 'Shard\(1\)'\}"):
        moved.check_graph(captured.gm)
