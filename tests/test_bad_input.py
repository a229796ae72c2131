"""The bad-input catalogue: each user mistake across compile, plan, verify, launch and save/load
raises a clear error naming the field, key, node or module path and what to change.

Each case is (what is wrong, a function making the mistake, the exception type, a pattern the
message must match). Single process, no ranks: the mistakes are caught before anything runs.
Multi-rank failures (a raising or dead rank) are in test_fail_fast.py; checkpoint corner cases
(interrupted saves, crafted metadata) in test_checkpoint.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import graphpass as gp
import zoo
from graphpass.planner import PlanningError
from graphpass.runtime.launch import launch

H100x2 = gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=2)


def _gpt():
    return zoo.build("gpt")


def _batch(n: int = 8):
    return zoo.batches("gpt", 1, n)[0]


def _compile(**kwargs):
    kwargs.setdefault("example_inputs", _batch())
    return gp.compile(kwargs.pop("model", None) or _gpt(), kwargs.pop("cluster", None), **kwargs)


class _NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)  # a tensor per sample, not a scalar loss


class _Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.ones(4))

    def forward(self, x):
        return (x * self.w).mean()


def _trained(tmp_path, *, optimizer: bool = True):
    """A compiled GPT, its SGD optimizer, and a checkpoint of both at tmp_path/ck."""
    dmodel = _compile(strategy=gp.Strategy())
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1, momentum=0.9)
    dmodel.train_step(*_batch())
    opt.step()
    gp.save(dmodel, opt if optimizer else None, tmp_path / "ck")
    return dmodel, opt


def _load_other_model(tmp_path):
    _trained(tmp_path)
    gp.load_into(nn.Linear(4, 4), tmp_path / "ck")


def _load_missing_optimizer_state(tmp_path):
    dmodel, opt = _trained(tmp_path, optimizer=False)
    gp.load(dmodel, opt, tmp_path / "ck")


def _load_incomplete(tmp_path):
    dmodel, opt = _trained(tmp_path)
    os.remove(tmp_path / "ck" / "graphpass.json")  # as if the save was killed before committing
    gp.load(dmodel, opt, tmp_path / "ck")


def _save_over_user_data(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    dmodel = _compile(strategy=gp.Strategy())
    gp.save(dmodel, None, tmp_path / "ck")


def _verify_edited_plan(**placements):
    """The GPT's dp=2 plan with some placements edited by hand, through compile's checks (verify)."""
    from graphpass.capture import capture
    from graphpass.plan_builder import plan_from_strategy

    plan = plan_from_strategy(capture(_gpt(), _batch(4)).gm, gp.Strategy(dp=2), []).to_dict()
    tensors = {**plan["tensors"], **{node: {**plan["tensors"].get(node, {}), "placements": by_axis}
                                     for node, by_axis in placements.items()}}
    plan = gp.Plan.from_dict({**plan, "tensors": tensors})
    gp.verify(_gpt(), H100x2, example_inputs=_batch(), strategy=plan)


def _unpicklable_on_ranks(_):
    launch(lambda: 1, 2)


def _launch_under_torchrun_with_another_world_size(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    launch(print, 2)


CASES = {
    # ---- compile
    "model is not a module": (lambda _: _compile(model=lambda x: x), TypeError,
                              r"model must be a torch.nn.Module, got function"),
    "example_inputs a bare tensor": (lambda _: _compile(example_inputs=_batch()[0]), TypeError,
                                     r"example_inputs must be a tuple of tensors .* write example_inputs=\(x,\)"),
    "example_inputs holds an int": (lambda _: _compile(example_inputs=(_batch()[0], 3)), TypeError,
                                    r"example_inputs\[1\] must be a torch.Tensor, got int"),
    "strategy by an unknown name": (lambda _: _compile(strategy="fast"), ValueError,
                                    r"strategy must be 'auto', a graphpass.Strategy or a graphpass.Plan, got 'fast'"),
    "strategy of another type": (lambda _: _compile(strategy={"dp": 2}), TypeError,
                                 r"strategy must be 'auto', a graphpass.Strategy or a graphpass.Plan, got dict"),
    "degrees not the world size": (lambda _: _compile(strategy=gp.Strategy(dp=2)), ValueError,
                                   r"Strategy dp=2 x tp=1 x pp=1 = 2 devices, but the cluster has world_size=1"),
    "cluster of another type": (lambda _: _compile(cluster="h100-80g"), TypeError,
                                r"cluster must be a graphpass.Cluster, got str"),
    "cluster of another size": (lambda _: _compile(cluster=H100x2), ValueError,
                                r"cluster describes 2 devices but this process group has 1 ranks"),
    "timeout_s not positive": (lambda _: _compile(strategy=gp.Strategy(), timeout_s=0), ValueError,
                               r"timeout_s must be a positive number of seconds, got 0"),
    "forward without a scalar loss": (lambda _: _compile(model=_NoLoss(), example_inputs=(torch.ones(2, 4),),
                                                         strategy=gp.Strategy()), ValueError,
                                      r"_NoLoss.forward must return the scalar loss .* returned a tensor of shape \(2, 4\)"),
    "a Plan of another model": (lambda _: _compile(strategy=gp.Plan(mesh={"dp": 1}, tensors={"no_such_node": gp.TensorPlan()})),
                                ValueError, r"the Plan places nodes \['no_such_node'\] that are not in the captured graph"),
    "split without ZeRO-3": (lambda _: _compile(strategy=gp.Strategy(zero=1, split=2)), ValueError,
                             r"Strategy.split=2 needs Strategy.zero=3 \(got zero=1\)"),
    # ---- a saved plan edited by hand
    "a Plan JSON without placements": (lambda _: gp.Plan.from_json('{"mesh": {"dp": 2}}'), ValueError,
                                       r"the Plan lacks 'tensors'"),
    "a Plan with a negative bucket cap": (
        lambda _: gp.Plan.from_json('{"mesh": {"dp": 2}, "placements": {}, "bucket_cap_bytes": -1}'), ValueError,
        r"Plan.bucket_cap_bytes must be a positive number of bytes, got -1"),
    "a Plan sharding a weight on a dim it lacks": (
        lambda _: _verify_edited_plan(h_0_attn_q_weight={"dp": "Shard(5)"}), ValueError,
        r"Plan.placements\['h_0_attn_q_weight'\]\['dp'\]: Shard\(5\) on a 2-D tensor"),
    "a Plan whose inputs split the batch differently": (
        lambda _: _verify_edited_plan(idx={"dp": "Replicate()"}, targets={"dp": "Shard(0)"}), ValueError,
        r"Plan.placements\['idx'\]\['dp'\]: Replicate\(\) on input 'idx', but the batch is split over dp=2"),
    # ---- verify (every rank of a cluster simulated here)
    "batch not divisible by dp": (lambda _: gp.verify(_gpt(), H100x2, example_inputs=_batch(3), strategy=gp.Strategy(dp=2)),
                                  ValueError, r"input 'example_inputs\[0\]' has batch size 3, which does not divide by dp = 2"),
    "microbatches not dividing the batch": (
        lambda _: gp.verify(_gpt(), H100x2, example_inputs=_batch(6), strategy=gp.Strategy(dp=2, microbatches=2)),
        ValueError, r"3 rows per data-parallel replica \(dp=2\), which do not divide into Strategy.microbatches=2"),
    # (a vocabulary tp does not divide stays replicated: the first weight it cannot shard is q's)
    "tp not dividing a layer's features": (
        lambda _: gp.verify(_gpt(), gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=3), example_inputs=_batch(),
                            strategy=gp.Strategy(tp=3)), gp.PassError,
        r"pass tensor_parallel failed .* tp=3 does not divide dim 0 \(size 64\) of 'h.0.attn.q.weight'"),
    "ep not dividing dp": (lambda _: gp.Strategy(dp=4, ep=3), ValueError, r"Strategy.ep=3 must divide Strategy.dp=4"),
    "ep for a model without experts": (
        lambda _: gp.verify(_gpt(), H100x2, example_inputs=_batch(), strategy=gp.Strategy(dp=2, ep=2)),
        ValueError, r"mesh ep=2 shards experts, but the captured graph has no Mixture-of-Experts layer"),
    "ep not dividing the experts": (
        lambda _: gp.verify(zoo.build("moe_topk"), gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=8),
                            example_inputs=zoo.batches("moe_topk", 1, 8)[0], strategy=gp.Strategy(dp=8, ep=8)),
        gp.PassError, r"pass expert_parallel failed .* layer 'h.0.moe.experts' has 4 experts, which the ep=8 ranks"),
    # ---- plan
    "unknown cluster preset": (lambda _: gp.plan(_gpt(), "h900", _batch()), ValueError, r"h900.*h100-80g"),
    "unparsable memory budget": (lambda _: gp.plan(_gpt(), H100x2, _batch(), memory_budget="lots"), ValueError,
                                 r"memory_budget.*'lots'"),
    "a model with nothing to train": (lambda _: gp.plan(_Frozen(), H100x2, (torch.ones(2, 4),)), PlanningError,
                                      r"_Frozen has no trainable parameters"),
    # ---- launch
    "a function ranks cannot import": (_unpicklable_on_ranks, TypeError,
                                       r"RankPool.run: cannot pickle .*<lambda>.*; use a module-level function"),
    "launch world size against torchrun's": (
        None, ValueError, r"launch\(world_size=2\) under torchrun with WORLD_SIZE=4: pass world_size=4"),
    # ---- save / load
    "load from a path with no checkpoint": (lambda p: gp.load(_compile(strategy=gp.Strategy()), None, p / "nowhere"),
                                            FileNotFoundError, r"no checkpoint at '.*nowhere'"),
    "load a checkpoint of another model": (_load_other_model, gp.CheckpointError,
                                           r"not of this model.*'weight', 'bias'|not of this model.*weight, bias"),
    "load without the optimizer state saved": (_load_missing_optimizer_state, gp.CheckpointError,
                                               r"no optimizer state.*optimizer=None"),
    "load an incomplete checkpoint": (_load_incomplete, gp.CheckpointError, r"is an incomplete save"),
    "save over a directory of user data": (_save_over_user_data, gp.CheckpointError,
                                           r"save path '.*ck' exists and is not a complete graphpass checkpoint"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_named(case, tmp_path, monkeypatch):
    make, kind, pattern = CASES[case]
    if make is None:  # needs the monkeypatch fixture
        make = lambda _: _launch_under_torchrun_with_another_world_size(monkeypatch)  # noqa: E731
    with pytest.raises(kind, match=pattern):
        make(tmp_path)

