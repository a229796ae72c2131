"""What the planner knows about the machines: devices, links and their sizes.

A `Cluster` is plain data: one `DeviceSpec` (every rank has the same kind of
device), a node grid (``num_nodes x devices_per_node``), one `LinkSpec` for the
links inside a node and one for the links between nodes, and the
``torch.distributed`` backend. The cost model reads it; nothing here measures.

Where the figures come from:

* **Presets** (`Cluster.preset`) are public spec-sheet figures for SXM parts:
  peak dense tensor-core TFLOP/s (no 2:4 sparsity) per dtype, memory size,
  HBM bandwidth, NVLink bandwidth per GPU per direction, and a typical
  InfiniBand rail per GPU. Sources are named next to each number below. They
  are peaks, not achievable rates: the cost model applies its own efficiency.
* **Local clusters** (`Cluster.local`) take what torch reports (device name,
  device memory, world size) and, for a GPU that matches a preset, that
  preset's compute and link figures. Everything else (CPU compute, CPU links,
  unknown GPUs) is a *default, unprofiled* placeholder until the profiler
  measures it; the cluster's ``name`` says so, and a warning says so once.
* **Profiled clusters** (`graphpass.profile`, in ``graphpass.cost.profiler``)
  hold measured, *achieved* rates: matmul TFLOP/s, copy bandwidth, and a
  fitted alpha-beta link. They are written to `profile_path` (under
  `cache_dir`), where `Cluster.local` finds them for the same device name and
  world size and loads them instead of the defaults.

Efficiencies: a spec-sheet peak is not achievable, so `DeviceSpec` carries the
fraction the roofline applies (``compute_efficiency``, ``memory_efficiency``;
`DEFAULT_EFFICIENCY` and `DEFAULT_MEMORY_EFFICIENCY` for presets and defaults).
A profiled device already records achieved rates and sets both to 1.0.

Units follow the names: ``_tflops`` is 1e12 FLOP/s, ``_gbps`` is GB/s (1e9
bytes per second, not gigabits), ``_bytes`` bytes, ``_s`` seconds. Link
bandwidth is what one GPU can send in one direction (the beta of the
alpha-beta model); latency is the alpha.

Example::

    >>> c = Cluster.preset("a100-80g", nodes=2, gpus_per_node=8)
    >>> str(c)
    '16 x a100-80g (2 nodes x 8), nvlink 300 GB/s, ib 25 GB/s'
    >>> Cluster.from_json(c.to_json()) == c
    True
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import pathlib
import re
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from graphpass.mesh import DP_SHARD, Mesh

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEFAULT_MEMORY_EFFICIENCY",
    "Cluster",
    "DeviceSpec",
    "HostSpec",
    "LinkSpec",
    "cache_dir",
    "presets",
    "profile_path",
]

logger = logging.getLogger(__name__)

DEVICE_KINDS = ("cuda", "cpu")
BACKENDS = ("nccl", "gloo")

GiB = 2**30

#: Typical achieved fraction of peak tensor-core FLOP/s for large dense matmuls in training
#: (Megatron-LM reports 0.5-0.6 model FLOPs utilisation on A100, Narayanan et al. 2021, table 1).
#: The default `DeviceSpec.compute_efficiency`; a profiled device measures achieved rates (1.0).
DEFAULT_EFFICIENCY = 0.6
#: Typical achieved fraction of HBM bandwidth for streaming pointwise kernels (STREAM-like copies
#: reach ~80-90% on A100/H100). The default `DeviceSpec.memory_efficiency`.
DEFAULT_MEMORY_EFFICIENCY = 0.8


# --------------------------------------------------------------------------- validation


def _check_positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def _check_number(owner: str, name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{name} must be {bound}, got {value!r}")
    return float(value)


def _check_str(owner: str, name: str, value: Any, choices: tuple[str, ...] | None = None) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{owner}.{name} must be a str, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {list(choices)}, got {value!r}")


def _from_fields(cls: type, data: Any, what: str) -> dict[str, Any]:
    """Checks that ``data`` is a dict with exactly the dataclass's keys (defaults optional)."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a dict, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    unknown = sorted(set(data) - names)
    missing = sorted(required - set(data))
    if unknown:
        raise ValueError(f"{what} has unknown keys {unknown}; expected {sorted(names)}")
    if missing:
        raise ValueError(f"{what} is missing keys {missing}")
    return dict(data)


# --------------------------------------------------------------------------- specs


def _check_number_dict(owner: str, field_name: str, value: Any, key: str, unit: str,
                       non_empty: bool = False) -> dict[str, float]:
    """A copy of ``{name: positive number}``, or ValueError naming ``owner.field_name``."""
    if not isinstance(value, dict) or (non_empty and not value):
        size = "non-empty " if non_empty else ""
        raise ValueError(f"{owner}.{field_name} must be a {size}dict of {key} -> {unit}, got {value!r}")
    out = {}
    for name, number in value.items():
        if not isinstance(name, str):
            raise ValueError(f"{owner}.{field_name} keys must be {key} names, got {name!r}")
        out[name] = _check_number(owner, f"{field_name}[{name!r}]", number)
    return out


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU rank's share of the host).

    Attributes:
        name: Short name, e.g. ``"a100-80g"``, ``"cpu"``, or torch's device name.
        kind: ``"cuda"`` or ``"cpu"``.
        peak_tflops: Peak dense TFLOP/s per dtype (``"bf16"``, ``"fp16"``, ``"fp32"``,
            ``"tf32"``), no structured sparsity.
        memory_bytes: Device memory (for a CPU rank: its share of host RAM).
        memory_bandwidth_gbps: HBM (or DRAM) bandwidth in GB/s.
        compute_efficiency: Fraction of ``peak_tflops`` the roofline model assumes is achieved,
            in (0, 1]; 1.0 when ``peak_tflops`` was measured.
        memory_efficiency: Fraction of ``memory_bandwidth_gbps`` assumed achieved, in (0, 1];
            1.0 when the bandwidth was measured.
        contention: How many times longer one rank's compute takes while every rank of the host
            computes at once than one process alone measured it (CPU ranks share cores, caches
            and DRAM), >= 1; measured by `graphpass.profile`. None = not measured: the planner
            then assumes only core oversubscription.
        memory_contention: The same slowdown for memory-bound work (an optimizer step streaming
            its states), which contends for DRAM more than compute does; None = not measured
            (``contention`` stands in).
    """

    name: str
    kind: str
    peak_tflops: dict[str, float]
    memory_bytes: int
    memory_bandwidth_gbps: float
    compute_efficiency: float = DEFAULT_EFFICIENCY
    memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY
    contention: float | None = None
    memory_contention: float | None = None

    def __post_init__(self) -> None:
        _check_str("DeviceSpec", "name", self.name)
        _check_str("DeviceSpec", "kind", self.kind, DEVICE_KINDS)
        # A private copy, so that mutating the caller's dict cannot change a frozen spec.
        object.__setattr__(self, "peak_tflops", _check_number_dict(
            "DeviceSpec", "peak_tflops", self.peak_tflops, "dtype", "TFLOP/s", non_empty=True))
        _check_positive_int("DeviceSpec", "memory_bytes", self.memory_bytes)
        object.__setattr__(
            self,
            "memory_bandwidth_gbps",
            _check_number("DeviceSpec", "memory_bandwidth_gbps", self.memory_bandwidth_gbps),
        )
        for name in ("compute_efficiency", "memory_efficiency"):
            value = _check_number("DeviceSpec", name, getattr(self, name))
            if value > 1:
                raise ValueError(f"DeviceSpec.{name} must be in (0, 1], got {value!r}")
            object.__setattr__(self, name, value)
        for name in ("contention", "memory_contention"):
            if getattr(self, name) is not None:
                value = _check_number("DeviceSpec", name, getattr(self, name))
                if value < 1:
                    raise ValueError(f"DeviceSpec.{name} must be >= 1 (a slowdown), got {value!r}")
                object.__setattr__(self, name, value)

    @property
    def speed_tflops(self) -> float:
        """The speed unlike devices are compared by (dp shares, stage sizes): the largest peak
        times the efficiency the roofline applies."""
        return max(self.peak_tflops.values()) * self.compute_efficiency

    def __hash__(self) -> int:  # the dict field would make the generated hash fail
        return hash(
            (self.name, self.kind, tuple(sorted(self.peak_tflops.items())), self.memory_bytes,
             self.memory_bandwidth_gbps, self.compute_efficiency, self.memory_efficiency, self.contention, self.memory_contention)
        )

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict; `from_dict` inverts it exactly."""
        return {
            "name": self.name,
            "kind": self.kind,
            "peak_tflops": dict(self.peak_tflops),
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
            "compute_efficiency": self.compute_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "contention": self.contention,
            "memory_contention": self.memory_contention,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceSpec:
        """Builds a spec from `to_dict` output; unknown or missing keys raise ValueError.

        The efficiencies and the contentions may be missing (JSON written before they existed):
        they take their defaults.
        """
        return cls(**_from_fields(cls, data, "DeviceSpec"))


@dataclass(frozen=True)
class LinkSpec:
    """One level of interconnect, priced by the alpha-beta model ``t = latency_s + bytes / bw``.

    Attributes:
        bandwidth_gbps: Usable GB/s per GPU per direction.
        latency_s: Per-message latency (alpha), seconds.
        name: Label for summaries, e.g. ``"nvlink"``, ``"ib"``, ``"loopback"``.
        kind_factors: Measured multiplier on the ring model's time per collective kind (e.g.
            ``{"all_gather": 2.1}``): the profiler fits alpha-beta to all-reduce and records how
            much slower the backend runs the other kinds than the ring formula says (gloo's
            all-gather and reduce-scatter are not bandwidth-optimal rings). Empty = 1 for all.
        sync_s: Extra time of one *blocking* collective issued from the middle of compute (the
            step waits for it right there: tensor-parallel collectives, ZeRO-3's backward
            re-gathers, the end of backward's gradient wait) over the same collective issued
            back to back: the wait for the last rank to arrive (ranks drift apart while they
            compute) and the wake-up of the collective's threads. Measured by `gp.profile` on
            CPU (about 1 ms for 2 gloo ranks here); 0 when not measured.
    """

    bandwidth_gbps: float
    latency_s: float
    name: str = ""
    kind_factors: dict[str, float] = field(default_factory=dict)
    sync_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "bandwidth_gbps", _check_number("LinkSpec", "bandwidth_gbps", self.bandwidth_gbps)
        )
        object.__setattr__(
            self, "latency_s", _check_number("LinkSpec", "latency_s", self.latency_s, allow_zero=True)
        )
        _check_str("LinkSpec", "name", self.name)
        object.__setattr__(self, "sync_s", _check_number("LinkSpec", "sync_s", self.sync_s, allow_zero=True))
        object.__setattr__(self, "kind_factors", _check_number_dict(
            "LinkSpec", "kind_factors", self.kind_factors, "collective kind", "factor"))

    def __hash__(self) -> int:  # the dict field would make the generated hash fail
        return hash((self.bandwidth_gbps, self.latency_s, self.name, tuple(sorted(self.kind_factors.items())),
                     self.sync_s))

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict; `from_dict` inverts it exactly."""
        data: dict[str, Any] = {"bandwidth_gbps": self.bandwidth_gbps, "latency_s": self.latency_s, "name": self.name}
        if self.kind_factors:
            data["kind_factors"] = dict(self.kind_factors)
        if self.sync_s:
            data["sync_s"] = self.sync_s
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinkSpec:
        """Builds a link from `to_dict` output; unknown or missing keys raise ValueError."""
        return cls(**_from_fields(cls, data, "LinkSpec"))


@dataclass(frozen=True)
class HostSpec:
    """What one device has on its host's side, for offload: its share of the node's host memory
    and local disk, and its link to host memory (the node's figures divided by its devices).

    Attributes:
        memory_bytes: Host memory (RAM) for one device's offloaded tensors.
        link_gbps: Device <-> host memory copy bandwidth, GB/s per direction (PCIe 4.0 x16
            about 25, PCIe 5.0 x16 about 50, GH200's NVLink-C2C 450).
        memory_bandwidth_gbps: The device's share of host DRAM bandwidth, GB/s (an optimizer
            stepping host-resident state streams through it).
        disk_bytes: Local disk (NVMe) for one device's disk tier; 0: none.
        disk_gbps: The device's share of the disk's write bandwidth, GB/s (0 with no disk).
    """

    memory_bytes: int
    link_gbps: float
    memory_bandwidth_gbps: float
    disk_bytes: int = 0
    disk_gbps: float = 0.0

    def __post_init__(self) -> None:
        _check_positive_int("HostSpec", "memory_bytes", self.memory_bytes)
        for name in ("link_gbps", "memory_bandwidth_gbps"):
            object.__setattr__(self, name, _check_number("HostSpec", name, getattr(self, name)))
        if isinstance(self.disk_bytes, bool) or not isinstance(self.disk_bytes, int) or self.disk_bytes < 0:
            raise ValueError(f"HostSpec.disk_bytes must be an int >= 0, got {self.disk_bytes!r}")
        object.__setattr__(self, "disk_gbps", _check_number("HostSpec", "disk_gbps", self.disk_gbps, allow_zero=True))
        if self.disk_bytes and not self.disk_gbps:
            raise ValueError("HostSpec.disk_gbps must be > 0 where disk_bytes is: a disk moves bytes at some speed")

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict; `from_dict` inverts it exactly."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostSpec:
        """Builds a spec from `to_dict` output; unknown or missing keys raise ValueError."""
        return cls(**_from_fields(cls, data, "HostSpec"))


# --------------------------------------------------------------------------- preset figures

# Latencies (alpha). NCCL's own tuning model (src/graph/tuning.cc) charges a
# base latency of a few µs per collective plus ~0.5-3.4 µs per NVLink step and
# several µs more per network step; nccl-tests small-message all_reduce on one
# DGX node measures in the tens of µs for a whole 8-GPU ring. We price one
# message: 5 µs inside a node, 15 µs across InfiniBand (RDMA one-way ~2 µs plus
# NCCL proxy and kernel launch overheads).
_NVLINK_LATENCY_S = 5e-6
_IB_LATENCY_S = 15e-6

# NVLink, per GPU per direction: A100 NVLink3 is 600 GB/s bidirectional total
# (12 links x 50 GB/s) = 300 GB/s each way; H100/H200 NVLink4 is 900 GB/s
# bidirectional (18 links x 50 GB/s) = 450 GB/s each way (NVIDIA data sheets).
_NVLINK3 = LinkSpec(bandwidth_gbps=300.0, latency_s=_NVLINK_LATENCY_S, name="nvlink")
_NVLINK4 = LinkSpec(bandwidth_gbps=450.0, latency_s=_NVLINK_LATENCY_S, name="nvlink")
# Inter-node, per GPU per direction: one NIC per GPU is the DGX layout.
# DGX A100: 8 x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU; DGX H100/H200:
# 8 x 400 Gb/s NDR (ConnectX-7) = 50 GB/s per GPU.
_IB_HDR = LinkSpec(bandwidth_gbps=25.0, latency_s=_IB_LATENCY_S, name="ib")
_IB_NDR = LinkSpec(bandwidth_gbps=50.0, latency_s=_IB_LATENCY_S, name="ib")

# Compute, dense tensor-core peaks (the data sheets quote "with sparsity" at 2x).
# A100 SXM (NVIDIA A100 data sheet): bf16/fp16 312, tf32 156, fp32 (non-tensor) 19.5.
_A100_TFLOPS = {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5, "tf32": 156.0}
# H100 SXM (NVIDIA H100 data sheet): bf16/fp16 989 (1979 sparse), tf32 494 (989 sparse),
# fp32 67. H200 SXM has the same GH100 compute (NVIDIA H200 data sheet).
_H100_TFLOPS = {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "tf32": 494.0}

# Host side per GPU (each node's figures over its 8 GPUs). DGX A100 (NVIDIA DGX A100 user guide):
# 2 TB DDR4 (1 TB on the 320 GB model), 2 x AMD EPYC 7742 with 8 DDR4-3200 channels each
# (2 x 204.8 GB/s), 15 TB of NVMe (4 x 3.84 TB U.2, about 3.5 GB/s sequential write each), one
# PCIe 4.0 x16 per GPU (32 GB/s raw; pinned copies reach about 25). DGX H100 (DGX H100 user
# guide): 2 TB DDR5, 2 x Xeon 8480C with 8 DDR5-4800 channels each (2 x 307 GB/s), 30 TB of NVMe
# (8 x 3.84 TB, ~3.5 GB/s write each), PCIe 5.0 x16 per GPU (64 GB/s raw, ~50 pinned). GH200
# (NVIDIA Grace Hopper data sheet): 480 GB LPDDR5X at 512 GB/s per superchip, NVLink-C2C
# 900 GB/s total (450 each way); a disk per superchip taken as one 3.84 TB NVMe.
_DGX_A100_HOST = HostSpec(2 * 1024**4 // 8, 25.0, 409.6 / 8, 15 * 10**12 // 8, 4 * 3.5 / 8)
_DGX_A100_40G_HOST = HostSpec(1024**4 // 8, 25.0, 409.6 / 8, 15 * 10**12 // 8, 4 * 3.5 / 8)
_DGX_H100_HOST = HostSpec(2 * 1024**4 // 8, 50.0, 614.4 / 8, 30 * 10**12 // 8, 8 * 3.5 / 8)
_GH200_HOST = HostSpec(480 * 10**9, 450.0, 512.0, 3840 * 10**9, 3.5)

# name -> (DeviceSpec, intra-node link, inter-node link)
_PRESETS: dict[str, tuple[DeviceSpec, LinkSpec, LinkSpec]] = {
    # "40GB" HBM2 is 40 GiB of DRAM (nvidia-smi reports 40960 MiB); 1555 GB/s.
    "a100-40g": (
        DeviceSpec("a100-40g", "cuda", _A100_TFLOPS, 40 * GiB, 1555.0),
        _NVLINK3,
        _IB_HDR,
    ),
    # "80GB" HBM2e is 80 GiB (nvidia-smi: 81920 MiB); 2039 GB/s on the SXM part.
    "a100-80g": (
        DeviceSpec("a100-80g", "cuda", _A100_TFLOPS, 80 * GiB, 2039.0),
        _NVLINK3,
        _IB_HDR,
    ),
    # H100 SXM "80GB" HBM3: 80 GiB (nvidia-smi shows slightly less, 81559 MiB, after
    # reserved space; the cost model keeps its own headroom); 3350 GB/s.
    "h100-80g": (
        DeviceSpec("h100-80g", "cuda", _H100_TFLOPS, 80 * GiB, 3350.0),
        _NVLINK4,
        _IB_NDR,
    ),
    # H200 SXM: NVIDIA quotes "141GB" HBM3e at 4.8 TB/s. Taken as 141e9 bytes, the
    # conservative reading: unlike the GiB-sized parts above, the usable size torch
    # reports on an H200 is larger (about 139-140 GiB, ~150e9 bytes), not smaller.
    "h200": (
        DeviceSpec("h200", "cuda", _H100_TFLOPS, 141 * 10**9, 4800.0),
        _NVLINK4,
        _IB_NDR,
    ),
    # GH200 superchip: the H100 GPU with 96 GB HBM3 at 4 TB/s (NVIDIA Grace Hopper data sheet),
    # NVLink4 between superchips of a node, NDR InfiniBand across.
    "gh200": (
        DeviceSpec("gh200", "cuda", _H100_TFLOPS, 96 * 10**9, 4000.0),
        _NVLINK4,
        _IB_NDR,
    ),
}
#: Each preset's host side (:class:`HostSpec`), per GPU.
_PRESET_HOSTS: dict[str, HostSpec] = {"a100-40g": _DGX_A100_40G_HOST, "a100-80g": _DGX_A100_HOST,
                                      "h100-80g": _DGX_H100_HOST, "h200": _DGX_H100_HOST, "gh200": _GH200_HOST}


def presets() -> list[str]:
    """Returns the names accepted by `Cluster.preset`, sorted."""
    return sorted(_PRESETS)


# --------------------------------------------------------------------------- local defaults

# CPU ranks: default, unprofiled placeholders until the profiler measures them.
# 0.1 TFLOP/s is roughly what a few AVX2/AVX-512 cores sustain on fp32 GEMM; bf16
# and fp16 are no faster on CPUs without AMX, so all dtypes share the figure.
_CPU_PEAK_TFLOPS = {"bf16": 0.1, "fp16": 0.1, "fp32": 0.1, "tf32": 0.1}
# One rank's share of DRAM bandwidth (a socket gives ~50-100 GB/s to all ranks).
_CPU_MEMORY_BANDWIDTH_GBPS = 10.0
# gloo over loopback TCP. Measured here (DESIGN.md): a 16 MB all_reduce takes ~15 ms
# on 2 ranks. A ring all_reduce sends 2 (n-1)/n x 16 MB = 16 MB per rank at n = 2,
# so 16e6 B / 15e-3 s ~ 1.07 GB/s (4 ranks: 24 MB in ~30 ms = 0.8 GB/s); we take
# 1 GB/s. 50 µs is a loopback TCP round trip plus gloo's per-op overhead.
_LOOPBACK = LinkSpec(bandwidth_gbps=1.0, latency_s=50e-6, name="loopback")

# A GPU that matches no preset: conservative, default, unprofiled figures (below a
# V100's 15.7 fp32 / 125 fp16 TFLOP/s and 900 GB/s), PCIe Gen4 x16 (~25 GB/s usable
# of 32) between devices, and a 100 Gb/s Ethernet/IB NIC (12.5 GB/s) between nodes.
_GPU_DEFAULT_TFLOPS = {"bf16": 50.0, "fp16": 50.0, "fp32": 10.0, "tf32": 10.0}
_GPU_DEFAULT_MEMORY_BANDWIDTH_GBPS = 500.0
_PCIE = LinkSpec(bandwidth_gbps=25.0, latency_s=10e-6, name="pcie")
_NET_DEFAULT = LinkSpec(bandwidth_gbps=12.5, latency_s=_IB_LATENCY_S, name="net")

_UNPROFILED = "default, unprofiled"


def _preset_for_gpu(device_name: str) -> str | None:
    """Maps torch's device name ("NVIDIA A100-SXM4-80GB", "NVIDIA H200", ...) to a preset.

    PCIe and NVL boards have lower clocks or other links than the SXM parts the
    presets describe; H100 PCIe and H100 NVL get no preset. A100 PCIe keeps the
    A100 compute peaks (the same 312 TFLOP/s), which is why it still matches.
    """
    upper = device_name.upper()
    if "H200" in upper:
        return "h200"
    if "H100" in upper:
        return None if ("PCIE" in upper or "NVL" in upper) else "h100-80g"
    if "A100" in upper:
        return "a100-80g" if "80G" in upper else "a100-40g"
    return None


# --------------------------------------------------------------------------- profile cache

#: Environment variable naming the cache directory (profiles, per-op times).
CACHE_DIR_ENV = "GRAPHPASS_CACHE_DIR"

# (device name, world size) pairs already warned about as unprofiled, so the warning shows once.
_WARNED_UNPROFILED: set[tuple[str, int]] = set()


def cache_dir() -> pathlib.Path:
    """``$GRAPHPASS_CACHE_DIR``, else ``~/.cache/graphpass``: profiles and per-op times."""
    raw = os.environ.get(CACHE_DIR_ENV)
    return pathlib.Path(raw) if raw else pathlib.Path.home() / ".cache" / "graphpass"


def device_slug(device_name: str) -> str:
    """A file-name-safe form of a device name: ``"NVIDIA H200"`` → ``"nvidia-h200"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return slug or "device"


def profile_path(device_name: str, world_size: int) -> pathlib.Path:
    """Where `graphpass.profile` writes, and `Cluster.local` looks for, a profiled cluster:
    ``cache_dir() / "clusters" / "<device slug>-<world_size>.json"``."""
    _check_positive_int("profile_path", "world_size", world_size)
    return cache_dir() / "clusters" / f"{device_slug(device_name)}-{world_size}.json"


def _load_profile(device_name: str, kind: str, world_size: int) -> Cluster | None:
    """The profiled cluster for this device and world size, or None (with a warning when a file
    exists but cannot be used)."""
    path = profile_path(device_name, world_size)
    if not path.is_file():
        return None
    try:
        cluster = Cluster.from_json(path.read_text())
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        logger.warning("ignoring unreadable cluster profile %s: %s", path, exc)
        return None
    found = (cluster.device.name, cluster.device.kind, cluster.world_size)
    if found != (device_name, kind, world_size):
        logger.warning(
            "ignoring cluster profile %s: it describes (device, kind, world_size) = %s, "
            "this job is %s",
            path, found, (device_name, kind, world_size),
        )
        return None
    logger.info("Cluster.local: using the profiled cluster %s (%s)", path, cluster.name)
    return cluster


def _rank() -> int:
    """This process's rank in its job: the default group's, else torchrun's ``RANK``, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    raw = os.environ.get("RANK", "")
    return int(raw) if raw.isdigit() else 0


def _warn_unprofiled(device_name: str, world_size: int, why: str) -> None:
    """Warn once per job (on rank 0; the other ranks log it at debug level)."""
    if (device_name, world_size) in _WARNED_UNPROFILED:
        return
    _WARNED_UNPROFILED.add((device_name, world_size))
    logger.log(
        logging.WARNING if _rank() == 0 else logging.DEBUG,
        "Cluster.local: %s; %d x %r uses %s figures (nothing at %s). Measure this machine with "
        "graphpass.profile(world_size=%d) or `graphpass profile --world-size %d`.",
        why, world_size, device_name, _UNPROFILED, profile_path(device_name, world_size),
        world_size, world_size,
    )


def _env_int(var: str) -> int | None:
    raw = os.environ.get(var)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {var} must be a positive int, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"environment variable {var} must be a positive int, got {raw!r}")
    return value


# --------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Cluster:
    """A homogeneous grid of ``num_nodes x devices_per_node`` devices, or sites of such grids
    joined by a wide-area link (:meth:`join`).

    Attributes:
        device: The device every rank runs on.
        num_nodes: Number of nodes.
        devices_per_node: Ranks (devices) per node.
        intra_node: Link between devices of one node (NVLink, loopback).
        inter_node: Link between nodes (InfiniBand, RoCE, Ethernet).
        backend: ``"nccl"`` or ``"gloo"``.
        name: Free-form label, e.g. the preset name.
        host: Each device's host side (:class:`HostSpec`: host memory, its link, disk), what
            offload may use; None: not known, and the planner offloads nothing.
        sites: The clusters :meth:`join` put behind one wide-area link, in rank order (site 0's
            ranks first); empty for one site. Their own links price the groups inside them;
            the fields above are the slowest site's (:mod:`graphpass.sites`).
        wan: The wide-area link between the sites (its bandwidth shared by every group that
            crosses it); None for one site.
        emulated: The sites are ranks of this machine (:meth:`split`), and the runtime emulates
            the link (``graphpass.runtime.link_emulator``): every collective that crosses it
            takes at least the link's time.
    """

    device: DeviceSpec
    num_nodes: int
    devices_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    backend: str
    name: str = ""
    host: HostSpec | None = None
    sites: tuple[Cluster, ...] = ()
    wan: LinkSpec | None = None
    emulated: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.device, DeviceSpec):
            raise ValueError(f"Cluster.device must be a DeviceSpec, got {type(self.device).__name__}")
        _check_positive_int("Cluster", "num_nodes", self.num_nodes)
        _check_positive_int("Cluster", "devices_per_node", self.devices_per_node)
        for name in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, name), LinkSpec):
                raise ValueError(
                    f"Cluster.{name} must be a LinkSpec, got {type(getattr(self, name)).__name__}"
                )
        _check_str("Cluster", "backend", self.backend, BACKENDS)
        _check_str("Cluster", "name", self.name)
        if self.host is not None and not isinstance(self.host, HostSpec):
            raise ValueError(f"Cluster.host must be a HostSpec or None, got {type(self.host).__name__}")
        object.__setattr__(self, "sites", tuple(self.sites))
        if bool(self.sites) != (self.wan is not None) or len(self.sites) == 1:
            raise ValueError("Cluster.sites and Cluster.wan go together (two or more sites and their link); build "
                             "joined clusters with Cluster.join(site, site, link=...)")
        if not isinstance(self.emulated, bool) or (self.emulated and not self.sites):
            raise ValueError(f"Cluster.emulated must be a bool, and True only for sites (Cluster.split), got "
                             f"{self.emulated!r}")
        if self.wan is not None and not isinstance(self.wan, LinkSpec):
            raise ValueError(f"Cluster.wan must be a LinkSpec, got {type(self.wan).__name__}")
        if self.sites and (sum(s.world_size for s in self.sites) != self.world_size
                           or any(s.devices_per_node != self.devices_per_node or s.sites for s in self.sites)):
            raise ValueError(f"Cluster.sites hold {sum(s.world_size for s in self.sites)} devices in nodes of "
                             f"{sorted({s.devices_per_node for s in self.sites})}, but the cluster has {self.world_size} "
                             f"in nodes of {self.devices_per_node}; build it with Cluster.join")

    @classmethod
    def join(cls, *sites: Cluster, link: LinkSpec) -> Cluster:
        """Sites (each a cluster of its own devices and links) behind one wide-area link, as one
        cluster whose ranks are site-major (:mod:`graphpass.sites`). Its own device, links and
        host are the slowest site's (the device with the smallest memory of any site, each host
        figure the smallest), so code that does not know about sites plans for the slowest.

        Args:
            sites: Two or more clusters with the same devices per node and backend; their
                devices and node counts may differ.
            link: ``graphpass.Link(bandwidth=, latency=)`` or a preset, ``graphpass.Link("wan-10g")``.

        Raises:
            ValueError: Fewer than two sites, a site that is itself joined, unlike backends, a
                link that is not a LinkSpec. NotImplementedError: sites with different devices
                per node.
        """
        if len(sites) < 2:
            raise ValueError(f"Cluster.join needs at least two sites, got {len(sites)}")
        for i, site in enumerate(sites):
            if not isinstance(site, Cluster):
                raise TypeError(f"Cluster.join: site {i} must be a graphpass.Cluster, got {type(site).__name__}")
            if site.sites:
                raise ValueError(f"Cluster.join: site {i} ({site.name}) is itself joined; join its sites and the "
                                 "others in one call (one wide-area link between every pair of sites)")
        if not isinstance(link, LinkSpec):
            raise ValueError(f"Cluster.join: link={link!r}: give graphpass.Link(bandwidth=..., latency=...) or a "
                             "preset such as graphpass.Link('wan-10g')")
        per_node = {s.devices_per_node for s in sites}
        if len(per_node) > 1:
            raise NotImplementedError(
                "Cluster.join: sites with different devices per node "
                f"({', '.join(f'{s.name or i}: {s.devices_per_node}' for i, s in enumerate(sites))}) are not "
                "supported yet (ranks are placed on nodes of one size); describe each site with the same gpus_per_node")
        backends = {s.backend for s in sites}
        if len(backends) > 1:
            raise ValueError(f"Cluster.join: every site must run the same backend, got {sorted(backends)}")
        slowest = min(sites, key=lambda s: (s.device.speed_tflops, s.device.memory_bytes))
        hosts = [s.host for s in sites]
        host = None if any(h is None for h in hosts) else HostSpec(
            min(h.memory_bytes for h in hosts), min(h.link_gbps for h in hosts),
            min(h.memory_bandwidth_gbps for h in hosts), min(h.disk_bytes for h in hosts),
            min(h.disk_gbps for h in hosts) if all(h.disk_bytes for h in hosts) else 0.0)

        def slowest_link(links: list[LinkSpec]) -> LinkSpec:
            return min(links, key=lambda spec: (spec.bandwidth_gbps, -spec.latency_s))

        return cls(
            device=replace(slowest.device, memory_bytes=min(s.device.memory_bytes for s in sites)),
            num_nodes=sum(s.num_nodes for s in sites),
            devices_per_node=per_node.pop(),
            intra_node=slowest_link([s.intra_node for s in sites]),
            inter_node=slowest_link([s.inter_node for s in sites]),
            backend=backends.pop(),
            name=" + ".join(s.name or f"site {i}" for i, s in enumerate(sites)) + f" over {link.name or 'wan'}",
            host=host,
            sites=tuple(sites),
            wan=link,
        )

    def split(self, sites: int, link: LinkSpec) -> Cluster:
        """This cluster's ranks as ``sites`` equal sites behind ``link``, which the runtime
        emulates (``emulated=True``): slow links measured on one machine, e.g.
        ``gp.Cluster.local().split(2, gp.Link("1 Gbit/s", "20 ms"))`` for 2 sites x 2 on 4 ranks.

        Raises:
            ValueError: ``sites`` below 2 or not dividing the nodes (or one node's devices).
        """
        if self.sites:
            raise ValueError("Cluster.split: this cluster is already sites; split a cluster of one site")
        _check_positive_int("Cluster.split", "sites", sites)
        if sites < 2:
            raise ValueError(f"Cluster.split: sites must be at least 2, got {sites}")
        if self.num_nodes % sites == 0:
            site = replace(self, num_nodes=self.num_nodes // sites)
        elif self.num_nodes == 1 and self.devices_per_node % sites == 0:
            site = replace(self, devices_per_node=self.devices_per_node // sites)
        else:
            raise ValueError(f"Cluster.split: {sites} sites do not divide {self.num_nodes} nodes of "
                             f"{self.devices_per_node} devices")
        return replace(Cluster.join(*[replace(site, name=f"{self.name or 'site'} {i}") for i in range(sites)],
                                    link=link), emulated=True)

    def site_of(self, rank: int) -> int:
        """The site ``rank`` is in (0 for a cluster of one site)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is not in 0..{self.world_size - 1}")
        return bisect.bisect_right(self.site_starts(), rank) - 1

    def device_of(self, rank: int) -> DeviceSpec:
        """The device ``rank`` runs on: its site's (``device`` for a cluster of one site)."""
        return self.sites[self.site_of(rank)].device if self.sites else self.device

    def relative_speed(self, rank: int) -> float:
        """How many times faster ``rank``'s device computes than ``device`` (the one a plan is
        priced on: the slowest site's), by peak times efficiency; 1.0 on one site."""
        return self.device_of(rank).speed_tflops / self.device.speed_tflops if self.sites else 1.0

    def site_starts(self) -> tuple[int, ...]:
        """Each site's first rank."""
        starts, first = [], 0
        for site in self.sites or (self,):
            starts.append(first)
            first += site.world_size
        return tuple(starts)

    def crosses_sites(self, mesh: Mesh, axis: str) -> bool:
        """Whether some group of ``axis`` in ``mesh`` spans more than one site."""
        return bool(self.sites) and any(len({self.site_of(r) for r in mesh.group_ranks(axis, rank)}) > 1
                                        for rank in range(mesh.world_size))

    def with_host(self, **changes: Any) -> Cluster:
        """This cluster with its host side changed (``cluster.with_host(memory_bytes=2**40)``:
        1 TiB of host memory per device); a cluster without one takes ``changes`` as a whole
        :class:`HostSpec`."""
        host = replace(self.host, **changes) if self.host is not None else HostSpec(**changes)
        return replace(self, host=host)

    @property
    def world_size(self) -> int:
        """Total number of ranks: ``num_nodes * devices_per_node``."""
        return self.num_nodes * self.devices_per_node

    def crosses_nodes(self, mesh: Mesh, axis: str) -> bool:
        """Whether some group of ``axis`` in ``mesh`` spans more than one node."""
        per = self.devices_per_node
        return any(len({r // per for r in mesh.group_ranks(axis, rank)}) > 1 for rank in range(mesh.world_size))

    def node_aligned_shard(self, mesh: Mesh) -> int | None:
        """The largest ``dp_shard`` (below ``dp``, a multiple of ``ep``) whose groups each lie
        inside one node; None if there is none."""
        aligned = [d for d in range(2, mesh.dp) if mesh.dp % d == 0 and d % mesh.ep == 0
                   and not self.crosses_nodes(mesh.with_dp_shard(d), DP_SHARD)]
        return max(aligned, default=None)

    def hsdp_warning(self, mesh: Mesh) -> str | None:
        """Why HSDP's ``dp_shard`` groups of ``mesh`` are slower than they need be: they span
        nodes while another ``dp_shard`` keeps every group inside one node (so ZeRO's gathers
        and reduce-scatters would run on the intra-node link); None otherwise."""
        if DP_SHARD not in mesh or not self.crosses_nodes(mesh, DP_SHARD):
            return None
        best = self.node_aligned_shard(mesh)
        if best is None:
            return None  # every sharded group spans nodes (e.g. tp fills a node): nothing better to say
        intra, inter = self.intra_node, self.inter_node
        return (f"dp_shard={mesh[DP_SHARD]} makes ZeRO groups that span nodes of {self.devices_per_node} devices, so "
                f"their all-gathers and reduce-scatters run on the inter-node link ({inter.name or 'inter_node'}, "
                f"{inter.bandwidth_gbps:g} GB/s) instead of inside a node ({intra.name or 'intra_node'}, "
                f"{intra.bandwidth_gbps:g} GB/s, {intra.bandwidth_gbps / inter.bandwidth_gbps:.1f}x faster per byte); "
                f"dp_shard={best} keeps every group inside one node")

    # ---- serialisation

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict; `from_dict` inverts it exactly."""
        return {
            "name": self.name,
            "device": self.device.to_dict(),
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "backend": self.backend,
            **({"host": self.host.to_dict()} if self.host is not None else {}),
            **({"sites": [s.to_dict() for s in self.sites], "wan": self.wan.to_dict()} if self.sites else {}),
            **({"emulated": True} if self.emulated else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """Builds a cluster from `to_dict` output; unknown or missing keys raise ValueError."""
        kwargs = _from_fields(cls, data, "Cluster")
        if kwargs.get("host") is not None:
            kwargs["host"] = HostSpec.from_dict(kwargs["host"])
        kwargs["device"] = DeviceSpec.from_dict(kwargs["device"])
        kwargs["intra_node"] = LinkSpec.from_dict(kwargs["intra_node"])
        kwargs["inter_node"] = LinkSpec.from_dict(kwargs["inter_node"])
        if "sites" in kwargs:
            if not isinstance(kwargs["sites"], list):
                raise ValueError(f"Cluster.sites must be a list of clusters, got {type(kwargs['sites']).__name__}")
            kwargs["sites"] = tuple(cls.from_dict(site) for site in kwargs["sites"])
        if kwargs.get("wan") is not None:
            kwargs["wan"] = LinkSpec.from_dict(kwargs["wan"])
        return cls(**kwargs)

    def to_json(self, indent: int | None = 2) -> str:
        """Serialises to JSON text; ``Cluster.from_json(c.to_json()) == c``."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        """Parses `to_json` output."""
        return cls.from_dict(json.loads(text))

    # ---- summaries

    def explain(self) -> str:
        """One line, e.g. ``"4 x a100-80g (1 node x 4), nvlink 300 GB/s, ib 25 GB/s"``."""
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''}"
        intra = self.intra_node.name or "intra-node"
        inter = self.inter_node.name or "inter-node"
        text = (
            f"{self.world_size} x {self.device.name} ({nodes} x {self.devices_per_node}), "
            f"{intra} {self.intra_node.bandwidth_gbps:g} GB/s, "
            f"{inter} {self.inter_node.bandwidth_gbps:g} GB/s"
        )
        if _UNPROFILED in self.name:
            text += f" [{_UNPROFILED}]"
        if self.sites:
            wan = self.wan
            text = (" + ".join(f"[{site.explain()}]" for site in self.sites)
                    + f", joined by {wan.name or 'wan'} {wan.bandwidth_gbps * 8:g} Gbit/s, {wan.latency_s * 1e3:g} ms"
                    + (" (emulated)" if self.emulated else ""))
        return text

    def __str__(self) -> str:
        return self.explain()

    # ---- constructors

    @classmethod
    def preset(cls, name: str, nodes: int = 1, gpus_per_node: int = 8) -> Cluster:
        """A cluster of identical SXM GPUs from public spec-sheet figures.

        Args:
            name: One of `presets()`: ``"a100-40g"``, ``"a100-80g"``, ``"h100-80g"``, ``"h200"``,
                ``"gh200"`` (each with its DGX / Grace Hopper host side, :class:`HostSpec`).
            nodes: Number of nodes.
            gpus_per_node: GPUs per node (8 in a DGX/HGX node).

        Raises:
            ValueError: Unknown name (the message lists the known ones), or a count
                that is not a positive int.
        """
        if name not in _PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; known presets: {', '.join(presets())}")
        for field_name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Cluster.preset: {field_name} must be a positive int, got {value!r}")
        device, intra, inter = _PRESETS[name]
        return cls(
            device=device,
            num_nodes=nodes,
            devices_per_node=gpus_per_node,
            intra_node=intra,
            inter_node=inter,
            backend="nccl",
            name=name,
            host=_PRESET_HOSTS.get(name),
        )

    @classmethod
    def local(cls, world_size: int | None = None) -> Cluster:
        """Describes the ranks of this job on this machine.

        The world size comes from, in order: the initialised default process group,
        the ``WORLD_SIZE`` environment variable (set by torchrun and `gp.launch`), the
        argument, else 1. A ``world_size`` argument that disagrees with either source
        raises. With CUDA, ranks are grouped ``min(device_count, world_size)`` per node
        (``LOCAL_WORLD_SIZE`` overrides when set); on CPU all ranks are one node and
        share the host's RAM. A profile written by `graphpass.profile` for this device
        name and world size (`profile_path`) supplies every figure when it exists.
        Otherwise figures the hardware does not report are presets (for a known GPU) or
        default, unprofiled placeholders (the ``name`` then says so, and rank 0 logs a
        warning once).

        Args:
            world_size: Expected number of ranks; None to take it from the environment.

        Raises:
            ValueError: ``world_size`` not a positive int or in conflict with the running
                group or ``WORLD_SIZE``; a world size that does not fill whole nodes.
        """
        import torch  # lazily: planning code imports this module without torch
        import torch.distributed as dist

        if world_size is not None:
            _check_positive_int("Cluster.local", "world_size", world_size)

        backend: str | None = None
        if dist.is_available() and dist.is_initialized():
            running = dist.get_world_size()
            if world_size is not None and world_size != running:
                raise ValueError(
                    f"Cluster.local(world_size={world_size}) conflicts with the initialised "
                    f"process group's world_size={running}; drop the argument or pass {running}"
                )
            world_size = running
            # A multi-device backend string reads like "cpu:gloo,cuda:nccl".
            backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        else:
            env = _env_int("WORLD_SIZE")
            if env is not None:
                if world_size is not None and world_size != env:
                    raise ValueError(
                        f"Cluster.local(world_size={world_size}) conflicts with environment "
                        f"variable WORLD_SIZE={env}; drop the argument or unset WORLD_SIZE"
                    )
                world_size = env
            elif world_size is None:
                world_size = 1

        use_cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
        if use_cuda:
            return cls._local_cuda(torch, world_size)
        return cls._local_cpu(world_size)

    @classmethod
    def _local_cuda(cls, torch: Any, world_size: int) -> Cluster:
        device_name = torch.cuda.get_device_name(0)
        memory_bytes = int(torch.cuda.get_device_properties(0).total_memory)
        per_node = _env_int("LOCAL_WORLD_SIZE") or min(torch.cuda.device_count(), world_size)
        if world_size % per_node:
            raise ValueError(
                f"Cluster.local: world_size={world_size} is not a multiple of the ranks per node "
                f"({per_node}); set LOCAL_WORLD_SIZE or launch whole nodes"
            )
        profiled = _load_profile(device_name, "cuda", world_size)
        if profiled is not None:
            return profiled
        preset = _preset_for_gpu(device_name)
        if preset is not None:
            spec, intra, inter = _PRESETS[preset]
            peaks, bandwidth, name = spec.peak_tflops, spec.memory_bandwidth_gbps, "local"
            logger.info(
                "Cluster.local: %r priced by the %s spec-sheet preset (no profile at %s)",
                device_name, preset, profile_path(device_name, world_size),
            )
        else:
            _warn_unprofiled(
                device_name, world_size, f"GPU matches no preset ({', '.join(presets())})"
            )
            peaks, bandwidth = _GPU_DEFAULT_TFLOPS, _GPU_DEFAULT_MEMORY_BANDWIDTH_GBPS
            intra, inter, name = _PCIE, _NET_DEFAULT, f"local ({_UNPROFILED})"
        device = DeviceSpec(device_name, "cuda", peaks, memory_bytes, bandwidth)
        return cls(device, world_size // per_node, per_node, intra, inter, "nccl", name)

    @classmethod
    def _local_cpu(cls, world_size: int) -> Cluster:
        profiled = _load_profile("cpu", "cpu", world_size)
        if profiled is not None:
            return profiled
        _warn_unprofiled("cpu", world_size, "CPU compute and loopback links are not profiled")
        ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        device = DeviceSpec(
            name="cpu",
            kind="cpu",
            peak_tflops=_CPU_PEAK_TFLOPS,
            memory_bytes=max(1, ram_bytes // world_size),
            memory_bandwidth_gbps=_CPU_MEMORY_BANDWIDTH_GBPS,
        )
        return cls(device, 1, world_size, _LOOPBACK, _LOOPBACK, "gloo", f"local ({_UNPROFILED})")
