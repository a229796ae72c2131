"""Timing primitives of the profiler: how long a call takes here, and the device's achieved rates.

Every figure the profiler records is a median of repeated calls after untimed warm-up ones
(`_median_s`; `_adaptive_median_s` fits the number of repeats to a time budget, many for µs
ops, few for slow ones), timed by CUDA events on GPU and ``time.perf_counter`` on CPU.
`together_median_s` times a call on every rank of the running group at once, each repeat
started on a barrier and counted as long as its slowest rank, as a synchronous step waits for
it. How much a profile measures (matmul sizes, copy size, the all-reduce ladder, repeats) is a
`_Budget` per device kind (`_budget`).

* **Device** (`_measure_device`): large square matmuls per dtype give achieved TFLOP/s (best
  over a few sizes, median of repeats after warmup, `_matmul_tflops`); a large tensor copy
  gives achieved memory bandwidth (bytes read plus written, `_copy_gbps`).
* **Optimizer step** (`optimizer_step_times`): one optimizer step over a model's parameter
  shapes and again over a quarter of them gives its cost per parameter element and per tensor.
"""

from __future__ import annotations

import math
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from graphpass.progress import Progress

__all__ = ["optimizer_step_times", "together_median_s"]

_TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "tf32": torch.float32,  # fp32 storage, TF32 tensor-core matmuls (CUDA only)
}


@dataclass(frozen=True)
class _Budget:
    """How much to measure: matmul sizes, copy size, all_reduce ladder, repeats."""

    matmul_sizes: tuple[int, ...]
    copy_bytes: int
    ladder_bytes: tuple[int, ...]
    warmup: int
    repeats: int


KiB, MiB, GiB = 2**10, 2**20, 2**30


def _budget(kind: str, quick: bool, world_size: int) -> _Budget:
    if kind == "cuda":
        if quick:
            return _Budget((4096,), 256 * MiB, (64 * KiB, 4 * MiB, 64 * MiB), 2, 5)
        return _Budget((4096, 8192), GiB, tuple(64 * KiB * 4**i for i in range(7)), 5, 20)
    if quick:
        # 512^3 fp32 is ~2 ms on one core here; 64 MiB copies already run at DRAM speed here.
        return _Budget((512,), 64 * MiB, (4 * KiB, 64 * KiB, MiB, 4 * MiB), 2, 9)
    # A copy must not fit in the last-level cache (480 MiB on this VM's Xeon) to measure DRAM;
    # cap it at an eighth of each rank's RAM share.
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    copy_bytes = int(min(max(256 * MiB, 2 * _last_level_cache_bytes()), ram // (8 * world_size)))
    # 4 KiB ... 16 MiB in steps of 4: latency-bound to bandwidth-bound on loopback TCP.
    return _Budget((1024, 2048), copy_bytes, tuple(4 * KiB * 4**i for i in range(7)), 5, 20)


def _last_level_cache_bytes() -> int:
    """Size of the largest CPU cache sysfs reports (0 when it reports none)."""
    best = 0
    for path in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            scale = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return best


# --------------------------------------------------------------------------- timing


def _sync(kind: str) -> None:
    if kind == "cuda":
        torch.cuda.synchronize()


def _time_once_s(fn: Callable[[], Any], kind: str) -> float:
    if kind == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


def _median_s(fn: Callable[[], Any], kind: str, *, warmup: int, repeats: int) -> float:
    """Median of ``repeats`` timed calls after ``warmup`` untimed ones. The median, not the mean
    or the minimum: a 2-core machine shares its cores with the OS, and single outliers are common."""
    for _ in range(warmup):
        fn()
    _sync(kind)
    return statistics.median(_time_once_s(fn, kind) for _ in range(repeats))


def together_median_s(fn: Callable[[], Any], kind: str, *, warmup: int, repeats: int) -> float:
    """`_median_s` with every rank of the running default group calling ``fn`` at once (all must
    call this, in the same order): each repeat starts on a barrier and counts as long as its
    slowest rank, as a synchronous step does; every rank gets the median of those.

    On a shared host this is the contention the ranks' step sees on the work itself: the
    profile's probes (`graphpass.cost.profiler.cluster._measure_contention`) stand in for it
    when one process plans, and the model's own forward and backward slowed 1.04x at a local
    batch of 4 and 1.21x at 8 with two ranks here, where the probes said 1.06x (compute) and
    1.38x (memory-bound)."""
    for _ in range(warmup):
        fn()
    _sync(kind)
    times = []
    for _ in range(repeats):
        dist.barrier()
        times.append(_time_once_s(fn, kind))
    slowest = torch.tensor(times, dtype=torch.float64, device="cuda" if kind == "cuda" else "cpu")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def _adaptive_median_s(fn: Callable[[], Any], kind: str, *, budget_s: float = 0.02,
                       min_repeats: int = 3, max_repeats: int = 25) -> float:
    """Median timing whose repeat count fits ``budget_s``: many repeats for µs ops, few for slow ones."""
    first_s = _time_once_s(fn, kind)  # also the warmup (allocator, kernel selection)
    repeats = int(min(max_repeats, max(min_repeats, budget_s / max(first_s, 1e-7))))
    return _median_s(fn, kind, warmup=1, repeats=repeats)


# --------------------------------------------------------------------------- device


def _matmul_tflops(dtype: str, sizes: Sequence[int], device: torch.device, budget: _Budget) -> float:
    kind = device.type
    torch_dtype = _TORCH_DTYPES[dtype]
    best = 0.0
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32 if kind == "cuda" else None
    try:
        if kind == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        for n in sizes:
            a = torch.randn(n, n, dtype=torch_dtype, device=device)
            b = torch.randn(n, n, dtype=torch_dtype, device=device)
            out = torch.empty(n, n, dtype=torch_dtype, device=device)
            seconds = _median_s(lambda: torch.mm(a, b, out=out), kind,
                                warmup=budget.warmup, repeats=budget.repeats)
            best = max(best, 2.0 * n**3 / seconds / 1e12)
            del a, b, out
    finally:
        if kind == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    return best


def _copy_gbps(num_bytes: int, device: torch.device, budget: _Budget) -> float:
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    # A copy reads the source and writes the destination: 2 x its size crosses the memory bus.
    seconds = _median_s(lambda: dst.copy_(src), device.type,
                        warmup=max(1, budget.warmup // 2), repeats=max(3, budget.repeats // 4))
    return 2.0 * src.nbytes / seconds / 1e9


def _measure_device(kind: str, dtypes: Sequence[str], quick: bool, world_size: int) -> dict[str, Any]:
    """Achieved TFLOP/s per dtype and copy GB/s of this process's device (picklable result)."""
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    budget = _budget(kind, quick, world_size)
    tflops = {}
    with Progress(len(dtypes) + 1, "profiling the device") as bar:
        for dtype in dtypes:
            bar.step(f"profiling {dtype} matmuls on {kind}")
            tflops[dtype] = _matmul_tflops(dtype, budget.matmul_sizes, device, budget)
        bar.step(f"profiling {kind} memory bandwidth")
        bandwidth = _copy_gbps(budget.copy_bytes, device, budget)
    return {
        "tflops": tflops,
        "memory_bandwidth_gbps": bandwidth,
        "threads": torch.get_num_threads(),
        "matmul_sizes": budget.matmul_sizes,
        "copy_bytes": budget.copy_bytes,
    }



# --------------------------------------------------------------------------- optimizer step


def _optimizer_step(sizes: Sequence[tuple[int, ...]], dtype: torch.dtype = torch.float32, states: int = 2,
                    device: str = "cpu") -> Callable[[], Any]:
    """One optimizer step over random parameters of ``sizes`` with random gradients: AdamW
    (foreach, the default implementation) for 2 states, SGD with momentum for 1, plain SGD for 0."""
    params = [torch.nn.Parameter(torch.randn(size, dtype=dtype, device=device)) for size in sizes]
    for param in params:
        param.grad = torch.randn_like(param)
    if states >= 2:
        return torch.optim.AdamW(params, lr=1e-4).step
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if states == 1 else 0.0).step


def optimizer_step_times(shapes: Sequence[torch.Size], dtype: torch.dtype, states: int, device: str = "cpu",
                         max_elements: int = 2**23, *, together: bool = False) -> tuple[float, float]:
    """(seconds per parameter element, seconds per parameter tensor) of one optimizer step on
    this machine (`_optimizer_step`) over tensors of a model's parameter ``shapes`` (the first
    ones up to ``max_elements``), and again over the same tensors a quarter the size (dim 0 cut,
    as ZeRO's shards are): the difference is the per-element part, the rest per tensor.
    ``together``: every rank of the running group steps at once (`together_median_s`)."""
    chosen, total = [], 0
    for shape in shapes:
        if chosen and total + math.prod(shape) > max_elements:
            break
        chosen.append(tuple(shape) or (1,))
        total += math.prod(chosen[-1])
    quarter = [(max(1, size[0] // 4), *size[1:]) for size in chosen]
    timed = together_median_s if together else _median_s
    whole_s, quarter_s = (timed(_optimizer_step(sizes, dtype, states, device), device, warmup=2, repeats=5)
                          for sizes in (chosen, quarter))
    fewer = total - sum(math.prod(size) for size in quarter)
    per_element = max(0.0, whole_s - quarter_s) / fewer if fewer > 0 else whole_s / max(total, 1)
    per_tensor = max(0.0, whole_s - per_element * total) / len(chosen)
    return per_element, per_tensor



# --------------------------------------------------------------------------- files


def _write_atomic(path: pathlib.Path, text: str) -> None:
    """Writes ``text`` to ``path`` by renaming a finished temporary file over it (the cluster
    profile and the op-time cache both): a reader, another rank or a later job, sees the old
    file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
