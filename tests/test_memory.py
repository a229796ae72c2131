"""MemoryProbe against hand counts and against torch's MemTracker, on one process and 2 gloo ranks.

MemTracker (``torch.distributed._tools.mem_tracker``) is the reference: it tracks the same thing
(live storages of op outputs, plus the parameters, gradients and optimizer state it is told
about) with a different mechanism (module hooks, weak-keyed storage table). Both count the
storage's ``nbytes()`` on CPU, so the peaks are compared to the byte: any difference is a bug in
one of them, not a tolerance. To compare like with like, MemTracker is given the model, the
optimizer and the batch (``track_external``) and the probe the same tensors as its ``baseline``,
and the probe is entered *inside* MemTracker (MemTracker wraps ``UntypedStorage.resize_`` with the
function it saw when it was built, so a probe entered first would stop seeing resizes meanwhile).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker

import zoo
from graphpass.runtime.memory import (
    MemoryProbe,
    measure_peak_bytes,
    optimizer_state_tensors,
    tensor_bytes,
)

F32 = 4


def _mem_tracker_peak(mt: MemTracker) -> int:
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _step_both(model: nn.Module, opt: torch.optim.Optimizer, batch) -> tuple[int, int, int]:
    """One forward+backward+step under MemTracker and a MemoryProbe.

    Returns:
        (probe peak, MemTracker peak, probe's current bytes at the end).
    """
    baseline = [*model.parameters(), *model.buffers(), *optimizer_state_tensors(opt), *batch]
    # Garbage that earlier work in this rank process left in reference cycles (the rank pools
    # outlive a test module) must not be collected inside the measured region: seen as a 48 KiB
    # disagreement after tests/test_expert_parallel.py ran in the same ranks.
    gc.collect()
    mt = MemTracker()
    mt.track_external(model, opt, *batch)
    with mt, MemoryProbe(baseline=baseline) as probe:
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        del loss
    return probe.peak_bytes, _mem_tracker_peak(mt), probe.current_bytes


# ---- helpers ----------------------------------------------------------------------------------


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    b = torch.zeros(3, dtype=torch.float64)
    # Views and slices share a's storage; None (a missing gradient) is skipped.
    assert tensor_bytes([a, a.view(2, 5), a[3:], b, None]) == 10 * F32 + 3 * 8
    assert tensor_bytes([]) == 0


def test_optimizer_state_tensors_lists_every_state_tensor():
    lin = nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters())
    assert optimizer_state_tensors(opt) == []
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    # AdamW keeps step, exp_avg and exp_avg_sq per parameter.
    state = optimizer_state_tensors(opt)
    assert len(state) == 3 * 2
    # Two moments of W (3x4) and b (3), and two 0-dim float32 step counters.
    assert tensor_bytes(state) == 2 * (12 + 3) * F32 + 2 * F32


# ---- one process ------------------------------------------------------------------------------


def test_probe_matches_hand_count_for_one_linear():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    params = (4 * 3 + 3) * F32  # 60
    with MemoryProbe(baseline=[*lin.parameters(), x]) as probe:
        assert probe.current_bytes == params + 2 * 4 * F32  # 92: params + x
        y = lin(x)  # addmm output, 2x3; W.t() is a view of W's storage
        loss = y.sum()
        assert probe.current_bytes == 92 + 6 * F32 + F32  # 120
        loss.backward()
        # Backward adds the seed ones_like(loss) (expanded to y's shape as a view), then
        # grad W = (x.t() @ dy).t() and grad b = dy.sum(0), which AccumulateGrad keeps as .grad:
        # 120 + 4 + 48 + 12 = 184, after which the seed is freed.
        assert probe.peak_bytes == 120 + F32 + params
        del y, loss
        assert probe.current_bytes == 92 + params
        torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9).step()  # momentum = clone of grad
        assert probe.peak_bytes == 92 + 2 * params
    assert probe.peak_bytes == 212


@pytest.mark.parametrize("warm", [False, True], ids=["first_step", "after_warmup"])
@pytest.mark.parametrize("name", ["mlp", "gpt", "encoder"])
def test_probe_peak_equals_mem_tracker_peak(name, warm):
    model = zoo.build(name)
    batch = zoo.batches(name, 1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if warm:  # optimizer state exists before the measured step
        model(*batch).backward()
        opt.step()
        opt.zero_grad()
    baseline_bytes = tensor_bytes(
        [*model.parameters(), *model.buffers(), *optimizer_state_tensors(opt), *batch]
    )
    probe_peak, tracker_peak, after = _step_both(model, opt, batch)
    assert probe_peak == tracker_peak
    momentum_bytes = 0 if warm else tensor_bytes(model.parameters())
    assert after == baseline_bytes + momentum_bytes  # activations and grads all freed


def test_probe_sees_backward_allocations_and_frees():
    model = zoo.build("mlp")
    batch = zoo.batches("mlp", 1)[0]
    baseline = [*model.parameters(), *batch]
    baseline_bytes = tensor_bytes(baseline)
    with MemoryProbe(baseline=baseline) as probe:
        loss = model(*batch)
        forward_peak = probe.peak_bytes
        loss.backward()
        assert probe.peak_bytes > forward_peak
        del loss  # frees the activations autograd saved
        grad_bytes = tensor_bytes(p.grad for p in model.parameters())
        assert probe.current_bytes == baseline_bytes + grad_bytes
        model.zero_grad()
        assert probe.current_bytes == baseline_bytes
    # At the peak all grads but the first layer's coexist with activations saved for backward.
    assert probe.peak_bytes > baseline_bytes + grad_bytes


def test_probe_measures_a_module_that_runs_twice_per_step():
    """Microbatching runs each module twice per step: MemTracker raises, the probe measures."""
    model = zoo.build("mlp")
    micro = zoo.batches("mlp", 2, batch=4)
    inputs = [t for b in micro for t in b]

    def two_microbatches(between=lambda: None) -> None:
        for i, b in enumerate(micro):
            if i:
                between()
            model(*b).backward()  # the second accumulates into .grad

    with MemoryProbe(baseline=[*model.parameters(), *inputs]) as probe:
        two_microbatches()
        grad_bytes = tensor_bytes(model.parameters())  # one .grad per parameter, accumulated
        assert probe.current_bytes == tensor_bytes([*model.parameters(), *inputs]) + grad_bytes
    model.zero_grad()

    mt = MemTracker()
    mt.track_external(model, *inputs)
    with pytest.raises(NotImplementedError, match="multiple iterative calls"):
        with mt:
            two_microbatches()
    model.zero_grad()

    # Told to forget its per-module stats between microbatches, MemTracker measures this
    # sequential case too, and agrees.
    mt = MemTracker()
    mt.track_external(model, *inputs)
    with mt:
        two_microbatches(between=mt.reset_mod_stats)
    assert probe.peak_bytes == _mem_tracker_peak(mt)


def test_reset_peak_restarts_from_current_bytes():
    with MemoryProbe() as probe:
        a = torch.zeros(100)
        del a
        assert probe.peak_bytes == 100 * F32
        probe.reset_peak()
        assert probe.peak_bytes == 0
        b = torch.zeros(10)
        assert (probe.current_bytes, probe.peak_bytes) == (10 * F32, 10 * F32)
    del b


def test_probe_follows_storage_resizes_and_set():
    kept = torch.zeros(100)  # 400 bytes, in the baseline
    freed = torch.empty(50)
    freed.untyped_storage().resize_(0)  # like an FSDP2 unsharded parameter between uses
    original_resize = torch.UntypedStorage.resize_
    with MemoryProbe(baseline=[kept, freed]) as probe:
        assert probe.current_bytes == 400
        kept.untyped_storage().resize_(0)
        assert probe.current_bytes == 0
        kept.untyped_storage().resize_(400)
        freed.untyped_storage().resize_(200)  # untracked, grows from nothing: an allocation
        assert probe.current_bytes == 600
        freed.untyped_storage().resize_(0)
        assert (probe.current_bytes, probe.peak_bytes) == (400, 600)
        grown = torch.empty(0).resize_(25)  # aten.resize_ goes through dispatch
        assert probe.current_bytes == 500
        grown.set_(torch.empty(10))  # the 25-float storage dies, the 10-float one is adopted
        assert probe.current_bytes == 440
        # FSDP2's way under torch.compile; its schema does not say it mutates.
        torch.ops.inductor.resize_storage_bytes_(kept, 0)
        assert probe.current_bytes == 40
        torch.ops.inductor.resize_storage_bytes_(kept, 400)
        assert torch.UntypedStorage.resize_ is not original_resize
    assert torch.UntypedStorage.resize_ is original_resize
    assert probe.current_bytes == 440  # frozen at exit
    del grown
    assert probe.current_bytes == 440


def test_measure_peak_bytes_returns_result_and_peak():
    x = torch.ones(256)
    result, peak = measure_peak_bytes(lambda t, k: (t * k).sum(), x, 3.0, baseline=[x])
    assert result.item() == 768.0
    assert peak == 256 * F32 + 256 * F32 + F32  # x, x * 3, the sum


def test_nested_probes_each_count_their_own_baseline():
    a = torch.zeros(10)
    with MemoryProbe() as outer:
        with MemoryProbe(baseline=[a]) as inner:
            b = torch.zeros(5)
        del b
    assert (outer.peak_bytes, inner.peak_bytes) == (5 * F32, 15 * F32)
    with pytest.raises(RuntimeError, match="already active"):
        with outer:
            with outer:
                pass


def test_baseline_rejects_non_tensors():
    with pytest.raises(TypeError, match="baseline holds a str"):
        MemoryProbe(baseline=["weights"])


# ---- 2 gloo ranks -----------------------------------------------------------------------------


def _sharded_mlp_peaks(parallel: str, warm: bool) -> dict:
    """One step of a 128-wide MLP under FSDP2 or TP on this rank: probe and MemTracker peaks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = zoo.MLP(width=128, depth=3)
    full_param_bytes = tensor_bytes(model.parameters())
    x, y = zoo.batches("mlp", 1, batch=32)[0]
    if parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in [*model.layers, model.out]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        rank = dist.get_rank()
        x, y = x[16 * rank : 16 * rank + 16].clone(), y[16 * rank : 16 * rank + 16].clone()
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel(),
                "layers.2": ColwiseParallel(), "out": RowwiseParallel()}
        parallelize_module(model, mesh, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if warm:  # FSDP2 then starts the step with its unsharded parameters freed (storage size 0)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    probe_peak, tracker_peak, after = _step_both(model, opt, (x, y))
    return {
        "probe": probe_peak,
        "tracker": tracker_peak,
        "after": after,
        "kept_bytes": tensor_bytes([*model.parameters(), *optimizer_state_tensors(opt), x, y]),
        "local_param_bytes": tensor_bytes(model.parameters()),
        "full_param_bytes": full_param_bytes,
    }


@pytest.mark.parametrize("warm", [False, True], ids=["first_step", "after_warmup"])
@pytest.mark.parametrize("parallel", ["fsdp2", "tp"])
def test_probe_peak_equals_mem_tracker_peak_on_two_ranks(rank_pool, parallel, warm):
    results = rank_pool(2).run(_sharded_mlp_peaks, parallel, warm, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["probe"] == r["tracker"], f"rank {rank}: {r}"
        # After the step only parameters, momentum and the batch are left: FSDP2's unsharded
        # parameters were freed again (storage resized to 0) and not left counted.
        assert r["after"] == r["kept_bytes"], f"rank {rank}: {r}"
        # Each rank holds about half of every parameter (FSDP2 pads uneven dim-0 shards;
        # TP here splits every weight, and replicates the biases of the row-wise layers).
        assert r["local_param_bytes"] < 0.6 * r["full_param_bytes"], f"rank {rank}: {r}"


def _collective_buffers() -> tuple[int, int]:
    x = torch.full((1000,), float(dist.get_rank()))
    with MemoryProbe(baseline=[x]) as probe:
        out = torch.empty(2000)
        dist.all_gather_into_tensor(out, x)
        parts = [torch.empty(1000) for _ in range(2)]
        dist.all_gather(parts, x)
        dist.all_reduce(out)  # in place: nothing new
    assert out[1000:].eq(2.0).all()
    return probe.peak_bytes, probe.current_bytes


def test_probe_counts_collective_output_buffers(rank_pool):
    results = rank_pool(2).run(_collective_buffers, timeout_s=60)
    assert results == [((1000 + 2000 + 2 * 1000) * F32,) * 2] * 2


def test_fake_probe_simulates_a_region_on_shapes():
    """With fake=True the probe counts fake tensors (the planner's simulations) and no real one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.ones(1000)
    with FakeTensorMode():
        x = torch.empty(1000, 1000)  # 4 MB, nothing allocated
        with MemoryProbe(baseline=[x, real], fake=True) as probe:
            assert probe.current_bytes == 4_000_000  # the real baseline tensor is not counted
            y = x * 2
            z = y + 1
            del y  # freed: the peak stays, the current total drops
            assert probe.current_bytes == 8_000_000
        assert probe.peak_bytes == 12_000_000
        del z
