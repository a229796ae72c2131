"""Tests for graphpass.cluster: preset figures, JSON round trips, errors, Cluster.local."""

import dataclasses
import json
import os
import socket
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest

from graphpass.cluster import Cluster, DeviceSpec, LinkSpec, presets

GiB = 2**30


@pytest.fixture(autouse=True)
def empty_cache_dir(tmp_path, monkeypatch):
    # Cluster.local loads a profile written by graphpass.profile() when one exists: keep a
    # developer's real ~/.cache/graphpass out of these tests of the default figures.
    monkeypatch.setenv("GRAPHPASS_CACHE_DIR", str(tmp_path / "cache"))


def test_presets_lists_the_four_spec_sheet_parts():
    assert {"a100-40g", "a100-80g", "h100-80g", "h200"} <= set(presets())
    assert presets() == sorted(presets())


@pytest.mark.parametrize(
    "name, bf16, fp32, tf32, memory_bytes, hbm_gbps, nvlink_gbps, ib_gbps",
    [
        ("a100-40g", 312.0, 19.5, 156.0, 40 * GiB, 1555.0, 300.0, 25.0),
        ("a100-80g", 312.0, 19.5, 156.0, 80 * GiB, 2039.0, 300.0, 25.0),
        ("h100-80g", 989.0, 67.0, 494.0, 80 * GiB, 3350.0, 450.0, 50.0),
        ("h200", 989.0, 67.0, 494.0, 141 * 10**9, 4800.0, 450.0, 50.0),
    ],
)
def test_preset_figures_match_the_spec_sheets(
    name, bf16, fp32, tf32, memory_bytes, hbm_gbps, nvlink_gbps, ib_gbps
):
    c = Cluster.preset(name)
    assert c.device.name == name and c.device.kind == "cuda" and c.backend == "nccl"
    assert c.device.peak_tflops == {"bf16": bf16, "fp16": bf16, "fp32": fp32, "tf32": tf32}
    assert c.device.memory_bytes == memory_bytes
    assert isinstance(c.device.memory_bytes, int)
    assert c.device.memory_bandwidth_gbps == hbm_gbps
    assert c.intra_node.bandwidth_gbps == nvlink_gbps
    assert c.inter_node.bandwidth_gbps == ib_gbps
    # NVLink is a few µs per message, the network slower still.
    assert 0 < c.intra_node.latency_s < c.inter_node.latency_s < 1e-4


def test_world_size_is_nodes_times_gpus_per_node():
    c = Cluster.preset("a100-80g", nodes=4, gpus_per_node=8)
    assert (c.num_nodes, c.devices_per_node, c.world_size) == (4, 8, 32)
    assert Cluster.preset("h200").world_size == 8


@pytest.mark.parametrize("name", presets())
def test_json_round_trip_is_exact_for_every_preset(name):
    c = Cluster.preset(name, nodes=3, gpus_per_node=4)
    text = c.to_json()
    json.loads(text)  # plain JSON, nothing Python-specific
    assert Cluster.from_json(text) == c
    assert Cluster.from_dict(c.to_dict()) == c
    assert Cluster.from_json(c.to_json(indent=None)).to_json() == text


def test_local_cluster_json_round_trip_is_exact(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    c = Cluster.local(3)
    assert Cluster.from_json(c.to_json()) == c


def test_specs_are_frozen_hashable_and_copy_their_peak_dict():
    peaks = {"fp32": 1.0}
    spec = DeviceSpec("x", "cpu", peaks, 10, 1.0)
    peaks["fp32"] = 2.0
    assert spec.peak_tflops == {"fp32": 1.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "y"
    assert hash(Cluster.preset("h200")) == hash(Cluster.preset("h200"))


def test_unknown_preset_error_lists_the_known_names():
    with pytest.raises(ValueError, match="unknown cluster preset 'v100'") as info:
        Cluster.preset("v100")
    for name in presets():
        assert name in str(info.value)


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"nodes": 0}, "nodes"),
        ({"nodes": -2}, "nodes"),
        ({"nodes": 1.5}, "nodes"),
        ({"nodes": True}, "nodes"),
        ({"gpus_per_node": 0}, "gpus_per_node"),
        ({"gpus_per_node": "8"}, "gpus_per_node"),
    ],
)
def test_bad_node_counts_name_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        Cluster.preset("a100-80g", **kwargs)


def test_bad_spec_fields_are_named():
    with pytest.raises(ValueError, match="DeviceSpec.kind"):
        DeviceSpec("x", "tpu", {"fp32": 1.0}, 10, 1.0)
    with pytest.raises(ValueError, match="DeviceSpec.memory_bytes"):
        DeviceSpec("x", "cpu", {"fp32": 1.0}, 1.5e9, 1.0)
    with pytest.raises(ValueError, match="LinkSpec.bandwidth_gbps"):
        LinkSpec(0.0, 1e-6)
    c = Cluster.preset("h200")
    with pytest.raises(ValueError, match="Cluster.backend"):
        dataclasses.replace(c, backend="mpi")
    with pytest.raises(ValueError, match="Cluster.devices_per_node"):
        dataclasses.replace(c, devices_per_node=0)


def test_from_dict_rejects_unknown_and_missing_keys():
    data = Cluster.preset("h200").to_dict()
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        Cluster.from_dict({**data, "bogus": 1})
    del data["backend"]
    with pytest.raises(ValueError, match="missing keys \\['backend'\\]"):
        Cluster.from_dict(data)


def test_explain_is_one_readable_line():
    c = Cluster.preset("a100-80g", nodes=1, gpus_per_node=4)
    assert c.explain() == "4 x a100-80g (1 node x 4), nvlink 300 GB/s, ib 25 GB/s"
    assert str(c) == c.explain()
    assert str(Cluster.preset("h100-80g", nodes=2)) == (
        "16 x h100-80g (2 nodes x 8), nvlink 450 GB/s, ib 50 GB/s"
    )


# --------------------------------------------------------------------------- Cluster.local


@pytest.fixture
def no_launcher_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.fixture
def cpu_only(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_local_outside_distributed_is_one_cpu_node_on_gloo(no_launcher_env, cpu_only):
    c = Cluster.local(world_size=4)
    assert c.backend == "gloo" and c.device.kind == "cpu" and c.device.name == "cpu"
    assert (c.num_nodes, c.devices_per_node, c.world_size) == (1, 4, 4)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert c.device.memory_bytes == ram // 4
    assert c.intra_node.bandwidth_gbps == 1.0 and c.intra_node.latency_s == 50e-6
    assert "default, unprofiled" in c.name and "default, unprofiled" in c.explain()
    assert Cluster.local().world_size == 1


def test_local_takes_world_size_from_the_environment(monkeypatch, no_launcher_env, cpu_only):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert Cluster.local().world_size == 2
    assert Cluster.local(2).world_size == 2
    with pytest.raises(ValueError, match="world_size=3.*WORLD_SIZE=2"):
        Cluster.local(3)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        Cluster.local()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_local_rejects_a_bad_world_size(bad, no_launcher_env):
    with pytest.raises(ValueError, match="world_size"):
        Cluster.local(bad)


def test_local_maps_a_known_gpu_to_its_preset(monkeypatch, no_launcher_env):
    import torch

    total = 85_198_045_184  # what torch reports for an A100-SXM4-80GB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda *_: SimpleNamespace(total_memory=total)
    )
    c = Cluster.local(4)
    a100 = Cluster.preset("a100-80g")
    assert c.backend == "nccl" and c.device.kind == "cuda"
    assert c.device.name == "NVIDIA A100-SXM4-80GB" and c.device.memory_bytes == total
    assert c.device.peak_tflops == a100.device.peak_tflops
    assert c.intra_node == a100.intra_node
    assert (c.num_nodes, c.devices_per_node) == (1, 4)  # 8 devices capped by 4 ranks
    assert c.name == "local"

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA GeForce RTX 3090")
    unknown = Cluster.local(2)
    assert "default, unprofiled" in unknown.name
    assert unknown.device.peak_tflops["fp32"] < a100.device.peak_tflops["fp32"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_describes_an_initialised_gloo_group(no_launcher_env):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        c = Cluster.local()
        assert c.backend == "gloo" and c.device.kind == "cpu" and c.world_size == 1
        assert Cluster.local(1) == c
        with pytest.raises(ValueError, match="world_size=2.*world_size=1"):
            Cluster.local(2)
    finally:
        dist.destroy_process_group()


def test_module_imports_without_torch(monkeypatch):
    import importlib.util

    import graphpass.cluster

    # A None entry makes any `import torch` raise ImportError, so a fresh copy of
    # the module only loads if torch is imported lazily (inside Cluster.local).
    for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "torch", None)
    spec = importlib.util.spec_from_file_location("_cluster_no_torch", graphpass.cluster.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    assert str(module.Cluster.preset("h200")).startswith("8 x h200")
