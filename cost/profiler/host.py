"""Measure this machine's host side for offload (`graphpass.cluster.HostSpec`).

`graphpass.profile` calls :func:`measure_host` once per machine and divides what the devices
share by their number (each `HostSpec` figure is one device's share):

* ``memory_bytes``: the host's physical memory;
* ``link_gbps``: the copy rate between the device and host memory: on a GPU, a pinned host
  buffer copied to the device and back (the slower direction), on device 0 (each GPU's link
  taken as its own, not shared); on a CPU-only
  machine the device *is* the host (offload is emulated), so the "link" is a copy between two
  host buffers;
* ``memory_bandwidth_gbps``: the host's copy bandwidth (bytes read plus written per second), what
  an optimizer stepping on the host streams at;
* ``disk_bytes`` / ``disk_gbps``: free space under the offload directory and the rate of a
  file written there and synced (``os.fsync``), what the disk tier's write-back needs.

Each rate is the best of a few repeats of one large copy (64 MiB, 16 MiB with ``quick``; a
256 MiB file, 32 MiB with ``quick``), so caches play no part but in the quick mode.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import time

import torch

from graphpass.cluster import HostSpec


def _best_s(job, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        job()
        best = min(best, time.perf_counter() - start)
    return best


def _copy_gbps(src: torch.Tensor, dst: torch.Tensor, repeats: int, sync) -> float:
    """Bytes moved (``src`` read into ``dst``) per second, GB/s."""
    dst.copy_(src)  # warm-up: page faults, the CUDA context
    sync()

    def job() -> None:
        dst.copy_(src, non_blocking=True)
        sync()

    return src.numel() * src.element_size() / _best_s(job, repeats) / 1e9


def _disk(directory: pathlib.Path, nbytes: int, repeats: int) -> tuple[int, float]:
    """(free bytes, write-and-sync GB/s) under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    data = os.urandom(1 << 20) * (nbytes >> 20)
    path = directory / f".graphpass-disk-probe-{os.getpid()}"

    def job() -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    try:
        seconds = _best_s(job, repeats)
    finally:
        path.unlink(missing_ok=True)
    return shutil.disk_usage(directory).free, len(data) / seconds / 1e9


def measure_host(kind: str, world_size: int, disk_dir: str | os.PathLike | None = None,
                 quick: bool = False) -> HostSpec:
    """This machine's host side, one device's share of it (``world_size`` devices).

    Args:
        kind: ``"cuda"`` (the link is measured to device 0) or ``"cpu"``.
        world_size: the devices sharing the host.
        disk_dir: the disk tier's directory (default ``GRAPHPASS_OFFLOAD_DIR``, else the
            temporary directory).
        quick: smaller copies and files, fewer repeats.
    """
    repeats = 2 if quick else 5
    numel = (16 if quick else 64) * 2**20 // 4
    pin = kind == "cuda"
    host_a = torch.empty(numel, pin_memory=pin).fill_(1.0)
    host_b = torch.empty(numel, pin_memory=pin)
    memory_gbps = 2 * _copy_gbps(host_a, host_b, repeats, lambda: None)  # read + written
    if kind == "cuda":
        device = torch.empty(numel, device="cuda:0")
        sync = torch.cuda.synchronize
        link = min(_copy_gbps(host_a, device, repeats, sync), _copy_gbps(device, host_b, repeats, sync))
    else:
        link = memory_gbps / 2  # the emulated device's copies are host copies
    directory = pathlib.Path(disk_dir or os.environ.get("GRAPHPASS_OFFLOAD_DIR") or tempfile.gettempdir())
    free, disk_gbps = _disk(directory, (32 if quick else 256) * 2**20, 1 if quick else 3)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # a GPU's link is its own (measured alone); the emulated device's copies share the host's memory
    return HostSpec(memory_bytes=ram // world_size, link_gbps=link if kind == "cuda" else link / world_size,
                    memory_bandwidth_gbps=memory_gbps / world_size, disk_bytes=free // world_size,
                    disk_gbps=disk_gbps / world_size)


__all__ = ["measure_host"]
