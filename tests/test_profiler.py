"""Tests for graphpass.cost.profiler: device and link measurement, the ring fit, per-op times."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zoo
from graphpass import cluster as cluster_module
from graphpass.capture import capture
from graphpass.cluster import Cluster, DeviceSpec, LinkSpec, profile_path
from graphpass.cost import profiler
from graphpass.cost.collectives import Link, all_reduce_time
from graphpass.cost.compute import graph_compute
from graphpass.cost.profiler import fit_ring_all_reduce, node_times, op_key, run_profile
from graphpass.cost.profiler import op_times, timing


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test writes its profiles and op caches under its own tmp dir, never ~/.cache."""
    monkeypatch.setenv("GRAPHPASS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return tmp_path / "cache"


# --------------------------------------------------------------------------- the ring fit


def test_ring_fit_recovers_alpha_and_beta_from_exact_times():
    link = Link(bandwidth_bytes_per_s=2e9, latency_s=30e-6)
    sizes = [4096 * 4**i for i in range(6)]
    times = [all_reduce_time(s, 4, link) for s in sizes]
    spec, residual = fit_ring_all_reduce(sizes, times, 4)
    assert spec.latency_s == pytest.approx(30e-6, rel=1e-9)
    assert spec.bandwidth_gbps == pytest.approx(2.0, rel=1e-9)
    assert residual == pytest.approx(0.0, abs=1e-12)


def test_ring_fit_clamps_a_negative_alpha_to_zero():
    # Pure bandwidth with the small size measured a bit fast: the free fit's alpha is negative.
    sizes, n = [1e3, 1e6, 1e7], 2
    times = [0.5e-6, 1e-3, 1e-2]  # S / 1e9 with the first point halved
    spec, _ = fit_ring_all_reduce(sizes, times, n)
    assert spec.latency_s == 0.0 and 0.5 < spec.bandwidth_gbps < 2.0
    with pytest.raises(ValueError, match="do not grow"):
        fit_ring_all_reduce([1e3, 1e6], [1e-3, 1e-3 * 0.5], 2)


# --------------------------------------------------------------------------- profile


def test_profile_two_ranks_fits_the_link_to_the_slowest_ranks_ladder(tmp_path):
    path = tmp_path / "two.json"
    report = run_profile(world_size=2, quick=True, path=path)
    c = report.cluster
    assert Cluster.from_json(path.read_text()) == c
    assert c.world_size == 2 and c.num_nodes == 1 and c.backend == "gloo" and "profiled" in c.name
    # One core per rank: a CPU core does ~1e-2..1e-1 TFLOP/s of fp32 GEMM.
    assert 1e-3 < c.device.peak_tflops["fp32"] < 10
    assert set(c.device.peak_tflops) >= {"bf16", "fp16", "fp32", "tf32"}  # stand-ins, logged
    assert report.filled_dtypes == {"bf16": "fp32", "fp16": "fp32", "tf32": "fp32"}
    assert 0.1 < c.device.memory_bandwidth_gbps < 1000
    assert (c.device.compute_efficiency, c.device.memory_efficiency) == (1.0, 1.0)
    # Two ranks computing at once on their own cores: a slowdown >= 1 (clamped), measured.
    assert c.device.contention is not None and c.device.contention >= 1.0
    assert c.device.memory_contention is not None and c.device.memory_contention >= 1.0
    link = c.intra_node
    assert c.inter_node == link and link.name == "measured"
    assert link.latency_s >= 0 and link.bandwidth_gbps > 0
    assert [s for s, _ in report.all_reduce] == [4096, 65536, 2**20, 4 * 2**20]
    assert "alpha" in report.summary() and "beta" in report.summary()
    assert f"contention (all ranks at once vs one alone, slowest rank): compute {c.device.contention:.3g}x" in report.summary()

    # The link is the ring fit of the slowest rank's ladder, exactly (how well it predicts sizes
    # it did not measure depends on the machine's load: bench/fidelity.py measures that).
    fitted, residual = fit_ring_all_reduce([s for s, _ in report.all_reduce], [t for _, t in report.all_reduce], 2)
    assert (fitted.bandwidth_gbps, fitted.latency_s) == (link.bandwidth_gbps, link.latency_s)
    assert residual == report.fit_residual and all(t > 0 for _, t in report.all_reduce)
    # What a blocking collective costs beyond the fit: measured, a machine- and load-dependent
    # figure, so no bound on its size here (bench/fidelity.py shows what it predicts). Not a
    # timing assertion: `_sync_s` clamps it at 0, so it is a finite, non-negative number however
    # slow the machine, and the written profile keeps it.
    assert link.sync_s >= 0.0 and math.isfinite(link.sync_s)
    assert Cluster.from_json(path.read_text()).intra_node.sync_s == link.sync_s


def _profile_in_place(path: str) -> tuple[str, str | None]:
    report = run_profile(world_size=2, quick=True, path=path)
    return report.cluster.to_json(), None if report.path is None else str(report.path)


def test_a_running_jobs_ranks_profile_themselves_in_place_and_rank_0_writes(rank_pool, tmp_path):
    """Called on every rank of a running job (here `RankPool`'s, as under torchrun), the profile
    measures those ranks instead of starting others: each gets the same cluster, rank 0 writes."""
    path = tmp_path / "in-place.json"
    (json0, path0), (json1, path1) = rank_pool(2).run(_profile_in_place, str(path), timeout_s=300)
    assert json0 == json1 and Cluster.from_json(path.read_text()) == Cluster.from_json(json0)
    assert (path0, path1) == (str(path), None)
    # Measured by the job's two ranks: a fitted link, not the one-rank default.
    assert Cluster.from_json(json0).intra_node.name == "measured"


def test_sync_cost_is_the_median_extra_wall_time_per_segment():
    """What the step loses per blocking collective: the wall-time difference, not the wait."""
    from graphpass.cost.profiler.cluster import _sync_s

    ranks = [{"collectives": {"sync": {"wall": [1e-3, 3e-3, 2e-3]}}},
             {"collectives": {"sync": {"wall": [4e-3, 0.5e-3, 2.5e-3]}}}]
    assert _sync_s(ranks) == pytest.approx(2.25e-3)  # per-rank medians 2 and 2.5 ms; their median
    idle = [{"collectives": {"sync": {"wall": [-1e-3, 0.2e-3, -0.5e-3]}}}] * 2
    assert _sync_s(idle) == 0.0  # noise around nothing
    assert _sync_s([{"collectives": {"sync": None}}] * 2) == 0.0  # GPU: not measured


def test_link_sync_cost_round_trips_defaults_to_zero_and_is_validated():
    link = LinkSpec(0.9, 2e-4, "measured", {"all_gather": 1.5}, sync_s=1e-3)
    assert LinkSpec.from_dict(json.loads(json.dumps(link.to_dict()))) == link
    assert hash(link) != hash(dataclasses.replace(link, sync_s=0.0))
    old = link.to_dict()
    del old["sync_s"]
    assert LinkSpec.from_dict(old).sync_s == 0.0  # a profile written before it existed
    with pytest.raises(ValueError, match="LinkSpec.sync_s"):
        dataclasses.replace(link, sync_s=-1e-3)


def test_profile_one_rank_keeps_the_default_link_and_writes_the_default_path(cache_dir):
    c = profiler.profile(world_size=1, quick=True)
    path = profile_path("cpu", 1)
    assert path.parent == cache_dir / "clusters" and path.name == "cpu-1.json"
    assert Cluster.from_json(path.read_text()) == c
    assert c.intra_node == c.inter_node == cluster_module._LOOPBACK  # nothing to measure
    assert c.device.contention is None and c.device.memory_contention is None  # nobody to contend with
    # the host side, for offload: this machine's memory, a copy rate, the temporary dir's disk
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert c.host.memory_bytes == ram and c.host.link_gbps > 0 and c.host.memory_bandwidth_gbps > 0
    assert 0 < c.host.disk_bytes <= shutil.disk_usage(tempfile.gettempdir()).total and c.host.disk_gbps > 0


@pytest.mark.parametrize(
    "given, field",
    [
        (lambda: Cluster.preset("h200", gpus_per_node=1), "kind"),
        (lambda: Cluster.preset("h200", nodes=2, gpus_per_node=1), "num_nodes"),
        (lambda: Cluster(Cluster.local(1).device, 1, 999, cluster_module._LOOPBACK,
                         cluster_module._LOOPBACK, "gloo"), "devices_per_node=999"),
    ],
)
def test_profile_rejects_a_cluster_that_is_not_this_machine(given, field, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=field):
        profiler.profile(given(), quick=True)
    with pytest.raises(ValueError, match="world_size=3 conflicts"):
        profiler.profile(Cluster.local(1), world_size=3)
    with pytest.raises(ValueError, match="dtypes"):
        profiler.profile(world_size=1, dtypes=("int8",))


# --------------------------------------------------------------------------- Cluster.local


def test_cluster_local_loads_a_profile_and_warns_when_there_is_none(cache_dir, caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cluster_module, "_WARNED_UNPROFILED", set())
    with caplog.at_level(logging.WARNING, logger="graphpass.cluster"):
        default = Cluster.local(1)
        Cluster.local(1)
    warnings = [r for r in caplog.records if "unprofiled" in r.getMessage()]
    assert len(warnings) == 1  # once, not per call
    assert "graphpass.profile" in warnings[0].getMessage() and "cpu-1.json" in warnings[0].getMessage()
    assert "default, unprofiled" in default.name

    profiled = profiler.profile(world_size=1, quick=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="graphpass.cluster"):
        loaded = Cluster.local(1)
    assert loaded == profiled and loaded != default
    assert any(str(profile_path("cpu", 1)) in r.getMessage() for r in caplog.records)
    # Another world size has no profile of its own: defaults again.
    assert "default, unprofiled" in Cluster.local(2).name

    # A corrupt or mismatched file is ignored loudly, never trusted.
    profile_path("cpu", 1).write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="graphpass.cluster"):
        assert Cluster.local(1) == default
    assert any("unreadable cluster profile" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- DeviceSpec efficiencies


def test_device_efficiencies_round_trip_default_for_old_json_and_are_validated():
    spec = DeviceSpec("cpu", "cpu", {"fp32": 0.1}, 2**30, 10.0, compute_efficiency=1.0, memory_efficiency=0.9)
    assert DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert hash(spec) != hash(DeviceSpec("cpu", "cpu", {"fp32": 0.1}, 2**30, 10.0))
    old = spec.to_dict()
    del old["compute_efficiency"], old["memory_efficiency"]
    loaded = DeviceSpec.from_dict(old)  # JSON written before the fields existed
    assert (loaded.compute_efficiency, loaded.memory_efficiency) == (0.6, 0.8)
    with pytest.raises(ValueError, match="compute_efficiency"):
        DeviceSpec("cpu", "cpu", {"fp32": 0.1}, 2**30, 10.0, compute_efficiency=1.5)
    with pytest.raises(ValueError, match="memory_efficiency"):
        DeviceSpec("cpu", "cpu", {"fp32": 0.1}, 2**30, 10.0, memory_efficiency=0.0)


def test_device_contention_round_trips_defaults_to_unmeasured_and_is_at_least_one():
    spec = DeviceSpec("cpu", "cpu", {"fp32": 0.1}, 2**30, 10.0, 1.0, 1.0, contention=1.25, memory_contention=1.5)
    assert DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert hash(spec) != hash(dataclasses.replace(spec, contention=None))
    assert hash(spec) != hash(dataclasses.replace(spec, memory_contention=None))
    old = spec.to_dict()
    del old["contention"], old["memory_contention"]
    loaded = DeviceSpec.from_dict(old)  # a profile written before they existed
    assert loaded.contention is None and loaded.memory_contention is None
    with pytest.raises(ValueError, match="DeviceSpec.contention must be >= 1"):
        dataclasses.replace(spec, contention=0.9)
    with pytest.raises(ValueError, match="DeviceSpec.memory_contention must be >= 1"):
        dataclasses.replace(spec, memory_contention=0.5)


# --------------------------------------------------------------------------- per-op times


class ThreeLayerMLP(nn.Module):
    """Layers 2 and 3 are identical ops (their inputs need gradients); layer 1's input is data."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, width)

    def forward(self, x, y):
        return F.mse_loss(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))), y)


def _mlp_graph(width: int, batch: int = 64):
    torch.manual_seed(0)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    return capture(ThreeLayerMLP(width), (x, y)).gm


def _cpu_device() -> DeviceSpec:
    return DeviceSpec("cpu", "cpu", {"fp32": 0.1}, 2**30, 10.0, 1.0, 1.0)


def test_node_times_measures_each_distinct_op_once_then_hits_the_cache(tmp_path, monkeypatch):
    gm = _mlp_graph(64)
    device, cache = _cpu_device(), tmp_path / "ops.json"
    calls = []
    real_measure = op_times._measure_node
    monkeypatch.setattr(op_times, "_measure_node", lambda node, *a: calls.append(node.name) or real_measure(node, *a))

    times = node_times(gm, device, measure=True, cache_path=cache)
    functions = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert set(times) == {n.name for n in functions}  # everything priced: nothing falls back
    linears = [n for n in functions if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 3 and op_key(linears[1], device) == op_key(linears[2], device)
    assert op_key(linears[0], device) != op_key(linears[1], device)  # no input gradient
    assert times[linears[1].name] == times[linears[2].name]
    keys = {op_key(n, device) for n in functions if times[n.name] != (0.0, 0.0)}
    assert len(calls) == len(keys) < len(functions)  # identical ops were measured once
    assert "linear_2" not in calls
    stored = json.loads(cache.read_text())["times"]
    assert set(stored) == keys

    calls.clear()
    assert node_times(gm, device, measure=True, cache_path=cache) == times
    assert calls == []  # all from the cache

    costs = graph_compute(gm, device, "fp32", measured=times)
    forward_s, backward_s = times[linears[1].name]
    assert costs[linears[1].name].forward_s == forward_s > 0
    assert costs[linears[1].name].backward_s == backward_s > 0


def test_measured_linear_time_grows_with_its_size(tmp_path):
    device = _cpu_device()
    small, large = _mlp_graph(32, batch=32), _mlp_graph(512, batch=512)
    t_small = node_times(small, device, measure=True, cache_path=tmp_path / "ops.json")["linear"]
    t_large = node_times(large, device, measure=True, cache_path=tmp_path / "ops.json")["linear"]
    # 4096x more FLOPs (32^3 -> 512^3 multiply-adds); a tiny linear is all dispatch overhead,
    # which a busy machine stretches (a clean-clone CI run measured only 3.8x while the suite
    # shared its 2 cores), so only demand the ordering, with a margin, not proportionality.
    assert t_large[0] > 1.5 * t_small[0] and t_large[1] > 1.5 * t_small[1]
    # And the large one is within reach of the device's GEMM rate: not slower than 0.1 GFLOP/s.
    assert t_large[0] < 2 * 512**3 / 1e8


def test_node_times_warns_loudly_about_nodes_left_to_the_roofline(tmp_path, caplog):
    gm = _mlp_graph(64)
    device = _cpu_device()
    with caplog.at_level(logging.WARNING, logger="graphpass.cost.profiler"):
        times = node_times(gm, device, measure=False, cache_path=tmp_path / "empty.json")
    functions = [n for n in gm.graph.nodes if n.op == "call_function"]
    priced = {name for name, t in times.items() if t == (0.0, 0.0)}  # views only
    missing = len(functions) - len(priced)
    assert missing > 0
    message = next(r.getMessage() for r in caplog.records if "no profiled time" in r.getMessage())
    assert message.startswith(f"{missing} of {len(functions)} nodes have no profiled time on cpu")
    assert "linear" in message and "roofline" in message
    # graph_compute prices the rest by the roofline.
    assert len(graph_compute(gm, device, "fp32", measured=times)) == len(functions)


def test_node_times_does_not_measure_another_machines_device(tmp_path, caplog):
    gm = _mlp_graph(16)
    h200 = Cluster.preset("h200").device
    with caplog.at_level(logging.WARNING, logger="graphpass.cost.profiler"):
        times = node_times(gm, h200, measure=True, cache_path=tmp_path / "h200.json")
    assert all(t == (0.0, 0.0) for t in times.values())
    assert not (tmp_path / "h200.json").exists()
    assert any("not this machine's device" in r.getMessage() for r in caplog.records)


def test_op_key_names_shapes_grad_flags_and_arguments():
    gm = _mlp_graph(8, batch=4)
    device = _cpu_device()
    linear = next(n for n in gm.graph.nodes if n.name == "linear")
    key = op_key(linear, device)
    assert key.startswith("aten.linear.default(")
    assert "float32[4,8]," in key  # the data input: no gradient
    assert "float32[8,8]+grad" in key and "float32[8]+grad" in key
    assert key.endswith(f"@cpu/{torch.get_num_threads()}t")
    assert op_key(linear, Cluster.preset("h200").device).endswith("@h200")


def test_node_times_measures_a_gpt_with_valid_token_ids(tmp_path, caplog):
    batch = zoo.batches("gpt", 1, 2)[0]
    gm = capture(zoo.build("gpt"), batch).gm
    with caplog.at_level(logging.WARNING, logger="graphpass.cost.profiler"):
        times = node_times(gm, _cpu_device(), measure=True, cache_path=tmp_path / "gpt.json")
    # embedding (token ids index the table) and cross_entropy (targets index the classes) ran.
    assert not [r for r in caplog.records if "could not run" in r.getMessage() or "no profiled" in r.getMessage()]
    names = {n.name for n in gm.graph.nodes if n.op == "call_function"}
    assert set(times) == names


def test_isolation_factor_is_the_whole_graphs_time_over_the_sum_of_its_ops(monkeypatch):
    gm = _mlp_graph(32)
    torch.manual_seed(1)
    inputs = (torch.randn(64, 32), torch.randn(64, 32))
    times = {n.name: (1e-3, 2e-3) for n in gm.graph.nodes if n.op == "call_function"}
    op_sum = 3e-3 * len(times)
    ran = []

    def fake_median(fn, kind, *, warmup, repeats):
        fn()
        # The step ran forward and backward, then cleared the gradients it made.
        ran.append(all(p.grad is None for p in gm.parameters()))
        return 1.5 * op_sum

    monkeypatch.setattr(op_times, "_median_s", fake_median)
    assert profiler.isolation_factor(gm, inputs, times) == pytest.approx(1.5)
    assert ran == [True]
    # The whole graph really runs: its backward reaches every parameter.
    grads = []

    def run_once(fn, kind, **_):
        fn()
        return 1.0

    monkeypatch.setattr(op_times, "_median_s", run_once)
    for p in gm.parameters():
        p.register_hook(lambda g, grads=grads: grads.append(g.shape))
    profiler.isolation_factor(gm, inputs, times)
    assert sorted(grads) == sorted(p.shape for p in gm.parameters())


def _slow_on_rank_1() -> float:
    import time

    import torch.distributed as dist

    return profiler.together_median_s(lambda: time.sleep(0.03 if dist.get_rank() == 1 else 0.0), "cpu",
                                      warmup=0, repeats=3)


def test_timing_together_counts_each_repeat_as_long_as_its_slowest_rank(rank_pool):
    # Rank 1 sleeps 30 ms a repeat, rank 0 not at all: both report rank 1's time (a lower bound
    # that holds however slow the machine).
    t0, t1 = rank_pool(2).run(_slow_on_rank_1, timeout_s=120)
    assert t0 == t1 >= 0.03


def _factor_when_one_rank_cannot_run() -> float:
    import torch.distributed as dist

    gm = _mlp_graph(16)
    inputs = (torch.randn(64, 16), torch.randn(64, 16))
    times = {n.name: (1e-3, 1e-3) for n in gm.graph.nodes if n.op == "call_function"}
    if dist.get_rank() == 1:
        times.pop(next(iter(times)))  # rank 1 lacks an op's time: it cannot time the graph
    return profiler.isolation_factor(gm, inputs, times, together=True)


def test_isolation_factor_together_agrees_not_to_run_when_one_rank_cannot(rank_pool):
    """Ranks decide together, so a rank that cannot run the graph leaves no other waiting."""
    assert rank_pool(2).run(_factor_when_one_rank_cannot_run, timeout_s=120) == [1.0, 1.0]


def test_isolation_factor_leaves_times_alone_when_the_graph_cannot_run(monkeypatch):
    gm = _mlp_graph(16)
    times = {n.name: (1e-3, 1e-3) for n in gm.graph.nodes if n.op == "call_function"}
    monkeypatch.setattr(op_times, "_median_s", lambda *a, **k: pytest.fail("must not run the graph"))
    meta_inputs = (torch.empty(64, 16, device="meta"), torch.empty(64, 16, device="meta"))
    assert profiler.isolation_factor(gm, meta_inputs, times) == 1.0
    partial = dict(list(times.items())[1:])  # one op left to the roofline: no op sum to compare
    assert profiler.isolation_factor(gm, (torch.randn(64, 16), torch.randn(64, 16)), partial) == 1.0


def test_the_optimizer_is_measured_on_the_models_own_parameter_shapes(monkeypatch):
    """The step is timed over the model's parameter shapes (the first ones up to a cap), and
    over the same tensors cut to a quarter along dim 0: the difference is per element, the
    rest per tensor."""
    stepped = []

    class Recorder(torch.optim.AdamW):
        def step(self, closure=None):
            stepped.append([tuple(p.shape) for p in self.param_groups[0]["params"]])

    monkeypatch.setattr(timing.torch.optim, "AdamW", Recorder)
    clock = iter(range(100))
    # Each step call takes 1 s on the full shapes' measurement, 0.5 s on the quarter's.
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock) * (1.0 if len(stepped) <= 7 else 0.5))
    shapes = [torch.Size([400, 10]), torch.Size([40]), torch.Size([10**6, 10])]
    per_element, per_tensor = profiler.optimizer_step_times(shapes, torch.float32, 2, max_elements=10_000)
    assert stepped[0] == [(400, 10), (40,)]  # the third would pass the cap
    assert stepped[-1] == [(100, 10), (10,)]
    # whole 1 s over 4040 elements, quarter 0.5 s over 1010: 0.5 s / 3030 per element, the rest
    # (1 - 4040 * that) over 2 tensors.
    assert per_element == pytest.approx(0.5 / 3030)
    assert per_tensor == pytest.approx((1.0 - 4040 * 0.5 / 3030) / 2)
