"""Profile this machine as a `Cluster`: its device's achieved rates and the alpha-beta of its links.

Presets and `Cluster.local`'s defaults are spec-sheet or guessed figures; `profile` replaces
them with measurements (the primitives are `graphpass.cost.profiler.timing`'s):

* **Device** (`profile`): achieved matmul TFLOP/s per dtype and copy bandwidth
  (`graphpass.cost.profiler.timing._measure_device`). The `DeviceSpec` records these *achieved*
  rates with ``compute_efficiency = memory_efficiency = 1.0``, so the roofline applies no
  further discount.
* **Contention** (`profile`, CPU, ``world_size > 1``): each rank times an MLP sub-layer's
  forward and backward alone, then with every rank running it at once, each repeat as long as
  its slowest rank (a synchronous step waits for it); that slowdown is
  ``DeviceSpec.contention``, by which the planner scales op times that one process measured
  (`graphpass.cost.profiler.op_times.node_times`). An AdamW step over 4M parameters measured
  alike (memory-bound: DRAM is what the ranks share most) gives
  ``DeviceSpec.memory_contention`` for optimizer steps.
* **Host** (`profile`): host memory, its bandwidth, the device's link to it and the disk tier's
  free space and write rate, one device's share (`graphpass.cost.profiler.host`), as
  ``Cluster.host`` for the planner's offload choices.
* **Links** (`profile`, ``world_size > 1``): ``world_size`` local ranks
  (`graphpass.runtime.launch.launch`, gloo on CPU, nccl on GPU) time ``all_reduce`` over a ladder
  of sizes: median of repeats after warmup on each rank, the slowest rank's median per size. On
  CPU each operand comes fresh out of a matmul, as in a step (gloo shares the cores with
  compute; buffers are cold); the ranks start each call together after a barrier. The
  ring model of `graphpass.cost.collectives` (``all_reduce_time``)::

      t(S) = 2(n-1) * alpha + 2(n-1)/n * S / B

  is fitted by least squares on relative error (each point weighted by ``1/t``, so 4 KiB and
  16 MiB count alike) with ``alpha >= 0``, giving ``LinkSpec(B, alpha, "measured")``. On CPU,
  compute segments with a small blocking all-reduce after each give ``LinkSpec.sync_s``,
  what a collective the step waits for costs beyond the fit (the ranks arrive apart, gloo's
  threads wake; `_measure_sync`). One machine
  is one node: the measured link is both ``intra_node`` and ``inter_node``. The cluster goes to
  `graphpass.cluster.profile_path` (``clusters/<device>-<world_size>.json`` under
  `graphpass.cluster.cache_dir`), where `Cluster.local` picks it up.

**Threads (CPU).** A CPU `DeviceSpec` is one rank's share of the host. `launch` gives each rank
``os.cpu_count() // world_size`` torch threads (1 each for 2 ranks on this 2-core machine), and
device figures for ``world_size > 1`` are measured on all ranks at once, so they include the
contention for cores and DRAM that training sees; the slowest rank's figure is kept. With
``world_size == 1`` the device is measured in this process with its current thread count.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import math
import os
import pathlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from graphpass.cluster import (
    Cluster,
    DeviceSpec,
    LinkSpec,
    _LOOPBACK,
    _PCIE,
    _PRESETS,
    _preset_for_gpu,
    profile_path,
)
from graphpass.cost.collectives import Link, all_gather_time, reduce_scatter_time
from graphpass.cost.profiler.host import measure_host
from graphpass.cost.profiler.timing import (
    _TORCH_DTYPES,
    GiB,
    KiB,
    _budget,
    _measure_device,
    _median_s,
    _optimizer_step,
    _time_once_s,
    _write_atomic,
)
from graphpass.progress import Progress
from graphpass.units import format_bytes

__all__ = ["ProfileReport", "fit_ring_all_reduce", "profile", "profile_path", "run_profile"]

logger = logging.getLogger(__name__)

_CPU_DTYPES = ("fp32",)
_CUDA_DTYPES = ("bf16", "fp16", "fp32", "tf32")
# A dtype left unmeasured takes the measured rate of the first of these that was measured
# (logged): the cost model needs a figure per dtype, and these are the nearest stand-ins.
_STAND_INS = {
    "bf16": ("fp16", "fp32"),
    "fp16": ("bf16", "fp32"),
    "tf32": ("fp32",),
    "fp32": ("tf32", "bf16", "fp16"),
}


# --------------------------------------------------------------------------- links


#: Width of the matmul that produces each timed collective's operand on CPU (`_operand`).
_PRODUCER_WIDTH = 256


def _operand(like: torch.Tensor, kind: str) -> torch.Tensor:
    """The tensor a timed collective sends, shaped like ``like``.

    On GPU, ``like`` itself: NCCL runs on its own stream. On CPU, gloo's collectives run on the
    cores that compute, so the operand is made the way training makes it: fresh out of a matmul,
    outside the cache. Either way a barrier follows, so the ranks start together: what arriving
    apart from compute costs is measured on its own (`_measure_sync`, ``LinkSpec.sync_s``) and
    charged to the collectives the step waits for, not folded into every collective's fit."""
    if kind != "cpu":
        dist.barrier()
        return like
    n = like.numel()
    rows = -(-n // _PRODUCER_WIDTH)
    weight = _producer_weight()
    x = torch.randn(rows, _PRODUCER_WIDTH, dtype=like.dtype)
    operand = (x @ weight).view(-1)[:n]
    dist.barrier()
    return operand


@functools.lru_cache(maxsize=1)
def _producer_weight() -> torch.Tensor:
    return torch.randn(_PRODUCER_WIDTH, _PRODUCER_WIDTH) / _PRODUCER_WIDTH**0.5


def _measure_collectives(kind: str, quick: bool) -> dict[str, Any]:
    """This rank's median all_reduce time per ladder size, plus one all_gather and reduce_scatter."""
    n = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    budget = _budget(kind, quick, n)
    tensors = [torch.ones(size // 4, dtype=torch.float32, device=device) for size in budget.ladder_bytes]
    # The first collectives of a fresh group pay for connection set-up and buffer allocation:
    # warm passes over the whole ladder before timing keep that out of the smallest sizes.
    for _ in range(2 + budget.warmup):
        for tensor in tensors:
            dist.all_reduce(tensor)
    # Rounds over the ladder, one timed call per size per round: a slow spell of the machine
    # (other processes, the OS) then spreads over all sizes instead of skewing one, and the
    # median per size discards it.
    samples: list[list[float]] = [[] for _ in tensors]
    for _ in range(budget.repeats):
        for tensor, times in zip(tensors, samples):
            operand = _operand(tensor, kind)
            times.append(_time_once_s(lambda: dist.all_reduce(operand), kind))
    all_reduce = [(size, statistics.median(times)) for size, times in zip(budget.ladder_bytes, samples)]
    # For the report only: the same size as the ladder's largest step.
    size = budget.ladder_bytes[-1] - budget.ladder_bytes[-1] % (4 * n)
    gathered = torch.empty(size // 4, dtype=torch.float32, device=device)
    shard = torch.ones(size // 4 // n, dtype=torch.float32, device=device)
    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    others = {}
    for name, fn, out, like in (
        ("all_gather", all_gather, gathered, shard),
        ("reduce_scatter", reduce_scatter, shard, gathered),
    ):
        try:
            fn(out, like)  # warm-up
            times = []
            for _ in range(max(3, budget.repeats // 2)):
                operand = _operand(like, kind)
                times.append(_time_once_s(lambda: fn(out, operand), kind))
            others[name] = (size, statistics.median(times))
        except (RuntimeError, NotImplementedError) as exc:  # not every backend has every op
            others[name] = (size, None)
            logger.debug("%s not timed on %s: %s", name, dist.get_backend(), exc)
    return {"all_reduce": all_reduce, **others}


def _layer_work(rows: int, width: int) -> Callable[[], None]:
    """One MLP sub-layer's forward and backward (matmuls, GELU, residual add, LayerNorm), the mix
    of compute-bound and memory-bound ops a training step runs, on fresh activations each call."""
    w1 = torch.randn(width, 4 * width, requires_grad=True)
    w2 = torch.randn(4 * width, width, requires_grad=True)
    gamma = torch.ones(width, requires_grad=True)

    def run() -> None:
        x = torch.randn(rows, width, requires_grad=True)
        h = torch.nn.functional.gelu(x @ w1)
        torch.nn.functional.layer_norm(h @ w2 + x, (width,), gamma).sum().backward()

    return run


def _measure_contention(quick: bool) -> dict[str, list[tuple[float, list[float]]]]:
    """Per kind of work (``"compute"``: `_layer_work`, ``"memory"``: an AdamW step over 4M
    parameters, `_optimizer_step`), per round: this rank's median time while the other ranks
    wait, and its time of each repeat while every rank runs it at once (CPU ranks share cores,
    caches and DRAM), the repeats started together by a barrier as a synchronous step's are.

    Rounds alternate the two, so that a slow spell of the machine falls on both sides of each
    ratio (`_contention` takes the median over rounds). As one round of 15 repeats each (all
    alone first, then all together), six profiles' figures taken back to back on 2 ranks here
    spread from 1.006 to 1.185 (compute) and 1.13 to 1.40 (memory-bound); as the median of 8
    rounds, four spread from 1.03 to 1.11 and 1.13 to 1.19.
    """
    rounds, repeats = (2, 3) if quick else (8, 3)
    works = {"compute": _layer_work(512 if quick else 2048, 256), "memory": _optimizer_step([(2**18 if quick else 2**20,)] * 4)}
    out = {}
    for kind, work in works.items():
        work()
        per_round = []
        for _ in range(rounds):
            alone = 0.0
            for rank in range(dist.get_world_size()):  # one rank at a time, the others idle in a barrier
                dist.barrier()
                if dist.get_rank() == rank:
                    alone = _median_s(work, "cpu", warmup=0, repeats=repeats)
                dist.barrier()
            together = []
            for _ in range(repeats):
                dist.barrier()
                together.append(_time_once_s(work, "cpu"))
            per_round.append((alone, together))
        out[kind] = per_round
    return out


#: Bytes of the collective `_measure_sync` issues between compute segments: small, so its own
#: time (the alpha the ladder fits) is a small part of what is measured.
_SYNC_PROBE_BYTES = 4 * KiB


def _measure_sync(quick: bool) -> dict[str, list[float]]:
    """What one blocking collective costs when it is issued between compute segments beyond the
    same collective issued back to back (``LinkSpec.sync_s``), as raw samples.

    A round times ``k`` segments of `_layer_work` (5-15 ms each here, with the machine's load:
    about the compute between a tensor-parallel step's collectives) each followed by a small
    blocking all-reduce, then ``k`` of those all-reduces back to back,
    then ``k`` segments alone, each run between barriers. Ranks drift apart while they compute,
    so the first to arrive waits for the last, and the collective's threads wake from idle;
    neither shows when collectives run back to back, as the ladder times them. Returns, per
    round, the extra wall time per segment, ``(with - alone - segments) / k`` (``"wall"``).
    Rounds alternate the three, so a slow spell of the machine spreads over all.
    """
    work = _layer_work(128 if quick else 256, 256)
    probe = torch.ones(_SYNC_PROBE_BYTES // 4)
    # A round's figure is a difference of three timings, noisy next to the 1-2 ms it measures:
    # many short rounds (the median is taken) rather than a few long ones.
    k, rounds = (4, 3) if quick else (8, 24)
    for _ in range(2):
        work()
        dist.all_reduce(probe)

    def timed(fn: Callable[[], Any]) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(k):
            fn()
        dist.barrier()
        return (time.perf_counter() - start) / k

    wall = []
    for _ in range(rounds):
        with_sync = timed(lambda: (work(), dist.all_reduce(probe)))
        alone = timed(lambda: dist.all_reduce(probe))
        wall.append(with_sync - alone - timed(work))
    return {"wall": wall}


def _rank_profile(kind: str, dtypes: tuple[str, ...], quick: bool) -> dict[str, Any]:
    """Runs on every rank (module-level for `launch`): the device, then the collectives."""
    if kind == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    dist.barrier()  # all ranks measure their device at once: shared cores and DRAM show up
    device = _measure_device(kind, dtypes, quick, dist.get_world_size())
    # GPUs do not share compute with each other; CPU ranks of one host do.
    device["contention"] = _measure_contention(quick) if kind == "cpu" else None
    dist.barrier()
    with Progress(2, "profiling links") as bar:
        bar.step(f"timing all-reduce, all-gather, reduce-scatter over {dist.get_world_size()} ranks")
        collectives = _measure_collectives(kind, quick)
        bar.step("timing how far apart ranks arrive")
        # On GPU the ranks' compute is queued on streams; their drift is not measured yet.
        collectives["sync"] = _measure_sync(quick) if kind == "cpu" else None
    return {"device": device, "collectives": collectives}


def fit_ring_all_reduce(
    sizes_bytes: Sequence[float], times_s: Sequence[float], num_ranks: int
) -> tuple[LinkSpec, float]:
    """Fits ``t(S) = 2(n-1) alpha + 2(n-1)/n * S / B`` to measured ring all_reduce times.

    Least squares on relative error (rows weighted by ``1/t``) with ``alpha >= 0``: when the free
    fit gives a negative alpha, alpha is 0 and ``1/B`` is refitted alone.

    Args:
        sizes_bytes: Tensor sizes ``S``.
        times_s: Measured all_reduce times.
        num_ranks: ``n >= 2``.

    Returns:
        ``(LinkSpec(B, alpha, "measured"), rms relative residual)``.

    Raises:
        ValueError: fewer than two points, ``n < 2``, non-positive times, or times that do not
            grow with size (no bandwidth term to fit).
    """
    if num_ranks < 2:
        raise ValueError(f"fit_ring_all_reduce: num_ranks must be >= 2, got {num_ranks}")
    if len(sizes_bytes) != len(times_s) or len(sizes_bytes) < 2:
        raise ValueError("fit_ring_all_reduce: needs two or more (size, time) points of equal count")
    if any(not t > 0 for t in times_s):
        raise ValueError(f"fit_ring_all_reduce: times must be > 0, got {list(times_s)}")
    n = num_ranks
    rows = [(2.0 * (n - 1) / t, 2.0 * (n - 1) / n * s / t) for s, t in zip(sizes_bytes, times_s)]
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa = sum(a for a, _ in rows)
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    alpha, inv_bw = ((sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det) if det > 0 else (-1.0, 0.0)
    if alpha < 0:
        alpha, inv_bw = 0.0, sb / sbb
    if not inv_bw > 0:
        raise ValueError(
            f"fit_ring_all_reduce: all_reduce times {list(times_s)} do not grow with sizes "
            f"{list(sizes_bytes)}; use a ladder that reaches bandwidth-bound sizes"
        )
    residual = math.sqrt(sum((alpha * a + inv_bw * b - 1.0) ** 2 for a, b in rows) / len(rows))
    return LinkSpec(bandwidth_gbps=1.0 / inv_bw / 1e9, latency_s=alpha, name="measured"), residual


# --------------------------------------------------------------------------- profile


@dataclass
class ProfileReport:
    """What `run_profile` measured.

    Attributes:
        cluster: The profiled cluster (also written to ``path``).
        path: Where its JSON was written (None on ranks other than 0 under torchrun).
        threads: Torch threads per rank during the device measurement.
        all_reduce: ``(size_bytes, seconds)`` per ladder size, slowest rank; empty for 1 rank.
        fit_residual: RMS relative error of the ring fit (None for 1 rank).
        others: ``{"all_gather": (size_bytes, seconds or None), "reduce_scatter": ...}``.
        filled_dtypes: Unmeasured dtypes priced at a measured stand-in's rate: ``{dtype: stand-in}``.
        seconds: Wall time of the whole profile.
    """

    cluster: Cluster
    path: pathlib.Path | None
    threads: int
    all_reduce: list[tuple[int, float]] = field(default_factory=list)
    fit_residual: float | None = None
    others: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    filled_dtypes: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> str:
        """A few human lines: TFLOP/s, GB/s, alpha, beta, fit residual."""
        c, d = self.cluster, self.cluster.device
        rates = ", ".join(
            f"{dtype} {tflops:.3g}" + (f" (= {self.filled_dtypes[dtype]})" if dtype in self.filled_dtypes else "")
            for dtype, tflops in sorted(d.peak_tflops.items())
        )
        lines = [
            f"profiled {c.world_size} x {d.name} ({c.backend}) in {self.seconds:.1f} s"
            + (f" -> {self.path}" if self.path else ""),
            f"  matmul TFLOP/s per rank: {rates}" + (f"  [{self.threads} thread(s) per rank]" if d.kind == "cpu" else ""),
            f"  memory (copy) {d.memory_bandwidth_gbps:.3g} GB/s per rank, {d.memory_bytes / GiB:.1f} GiB",
        ]
        if d.contention is not None:
            memory = f", memory-bound {d.memory_contention:.3g}x" if d.memory_contention is not None else ""
            lines.append(f"  contention (all ranks at once vs one alone, slowest rank): compute {d.contention:.3g}x{memory}")
        if self.all_reduce:
            link = c.intra_node
            span = f"{format_bytes(self.all_reduce[0][0])}..{format_bytes(self.all_reduce[-1][0])}"
            lines.append(
                f"  all_reduce ring fit over {len(self.all_reduce)} sizes ({span}): alpha "
                f"{link.latency_s * 1e6:.1f} us, beta {link.bandwidth_gbps:.3g} GB/s, "
                f"rms relative residual {self.fit_residual:.0%}"
            )
            if link.sync_s:
                lines.append(f"  blocking collective issued from compute: {link.sync_s * 1e3:.2f} ms more "
                             "(ranks arrive apart, threads wake)")
            model = Link.from_spec(link)
            predict = {"all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time}
            for name, (size, seconds) in self.others.items():
                if seconds is None:
                    lines.append(f"  {name}: not supported by {c.backend}")
                else:
                    lines.append(
                        f"  {name} {format_bytes(size)}: {seconds * 1e3:.2f} ms measured, "
                        f"{predict[name](size, c.world_size, model) * 1e3:.2f} ms by the fitted link"
                    )
        else:
            lines.append(f"  links: one rank, nothing measured; kept the default {c.intra_node.name} link")
        if c.host is not None:
            h = c.host
            lines.append(f"  host per rank: {h.memory_bytes / GiB:.1f} GiB memory at {h.memory_bandwidth_gbps:.3g} GB/s, "
                         f"link {h.link_gbps:.3g} GB/s, disk {h.disk_bytes / GiB:.0f} GiB free at {h.disk_gbps:.3g} GB/s")
        return "\n".join(lines)


_MAX_RANKS_PER_CORE = 4


def _resolve_target(cluster: Cluster | None, world_size: int | None) -> tuple[str, int]:
    """``(device kind, world size)`` to profile, checked against this machine."""
    where = "world_size"
    if cluster is not None:
        if not isinstance(cluster, Cluster):
            raise TypeError(f"profile(cluster=...) must be a Cluster, got {type(cluster).__name__}")
        if world_size is not None and world_size != cluster.world_size:
            raise ValueError(
                f"profile: world_size={world_size} conflicts with cluster.world_size="
                f"{cluster.world_size}; pass one of them"
            )
        if cluster.num_nodes != 1:
            raise ValueError(
                f"profile: Cluster.num_nodes={cluster.num_nodes}, but profile measures the ranks of "
                f"this one machine; profile a one-node cluster (num_nodes=1)"
            )
        kind, world_size, where = cluster.device.kind, cluster.world_size, "Cluster.devices_per_node"
    else:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        world_size = 1 if world_size is None else world_size
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"profile: world_size must be a positive int, got {world_size!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "profile: Cluster.device.kind='cuda', but this machine has no CUDA device; "
                "profile a CPU cluster (Cluster.local() here) instead"
            )
        if world_size > torch.cuda.device_count():
            raise ValueError(
                f"profile: {where}={world_size} exceeds the {torch.cuda.device_count()} CUDA "
                f"devices of this machine"
            )
    else:
        cores = os.cpu_count() or 1
        if world_size > _MAX_RANKS_PER_CORE * cores:
            # Each rank is a process with its own torch import (~300 MB); hundreds of them swap
            # the machine to a standstill long before a single collective is timed.
            raise ValueError(
                f"profile: {where}={world_size} local ranks on {cores} CPU cores is more than "
                f"{_MAX_RANKS_PER_CORE} per core; profile at most {_MAX_RANKS_PER_CORE * cores} "
                f"ranks here (the link fit extrapolates to larger clusters)"
            )
        if world_size > cores and not (dist.is_initialized() and dist.get_rank() != 0):
            # More ranks than cores share them: the figures then include that contention, which
            # is what a job of that many ranks on this machine sees (the planner's op-time
            # scaling covers compute; the links are only measurable this way). Said once per
            # job: by rank 0 when a running group profiles itself.
            logger.warning(
                "profile: %s=%d ranks share this machine's %d CPU cores; the figures include that contention",
                where, world_size, cores,
            )
    return kind, world_size


def _check_dtypes(dtypes: Sequence[str] | None, kind: str) -> tuple[str, ...]:
    if dtypes is None:
        return _CUDA_DTYPES if kind == "cuda" else _CPU_DTYPES
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    unknown = [d for d in dtypes if d not in _TORCH_DTYPES]
    if unknown or not dtypes:
        raise ValueError(f"profile: dtypes must be a non-empty subset of {sorted(_TORCH_DTYPES)}, got {dtypes!r}")
    return tuple(dict.fromkeys(dtypes))


def _fill_dtypes(tflops: dict[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    """Adds a rate for each standard dtype left unmeasured, from its nearest measured stand-in."""
    out, filled = dict(tflops), {}
    for dtype, stand_ins in _STAND_INS.items():
        if dtype in out:
            continue
        source = next((s for s in stand_ins if s in tflops), None)
        if source is not None:
            out[dtype], filled[dtype] = tflops[source], source
    return out, filled


def run_profile(
    cluster: Cluster | None = None,
    *,
    world_size: int | None = None,
    path: str | os.PathLike | None = None,
    dtypes: Sequence[str] | None = None,
    quick: bool = False,
    disk_dir: str | os.PathLike | None = None,
) -> ProfileReport:
    """`profile`, returning the full `ProfileReport` (the raw ladder, the fit residual...)."""
    start_s = time.perf_counter()
    kind, world_size = _resolve_target(cluster, world_size)
    dtypes = _check_dtypes(dtypes, kind)
    report_links: list[tuple[int, float]] = []
    others: dict[str, tuple[int, float | None]] = {}
    residual = None
    if world_size == 1:
        if kind == "cuda":
            torch.cuda.set_device(0)
        device_result = _measure_device(kind, dtypes, quick, 1)
        device_name = torch.cuda.get_device_name(0) if kind == "cuda" else "cpu"
        # One rank has no link to measure: keep Cluster.local's default for this device kind.
        link = _default_link(kind, device_name)
        logger.info("profile: one rank, no collectives to time; keeping the default %s link "
                    "(%.3g GB/s, %.3g us)", link.name, link.bandwidth_gbps, link.latency_s * 1e6)
        intra = inter = link
    else:
        from graphpass.runtime.launch import launch

        results = launch(_rank_profile, world_size, (kind, dtypes, quick),
                         backend="nccl" if kind == "cuda" else "gloo", timeout_s=600.0)
        device_name = torch.cuda.get_device_name(0) if kind == "cuda" else "cpu"
        # The slowest rank bounds every synchronous step: keep each figure's minimum over ranks.
        device_result = {
            "tflops": {d: min(r["device"]["tflops"][d] for r in results) for d in dtypes},
            "memory_bandwidth_gbps": min(r["device"]["memory_bandwidth_gbps"] for r in results),
            "threads": results[0]["device"]["threads"],
            "contention": _contention(results, "compute"),
            "memory_contention": _contention(results, "memory"),
        }
        ladder = results[0]["collectives"]["all_reduce"]
        report_links = [
            (size, max(r["collectives"]["all_reduce"][i][1] for r in results))
            for i, (size, _) in enumerate(ladder)
        ]
        link, residual = fit_ring_all_reduce(
            [s for s, _ in report_links], [t for _, t in report_links], world_size
        )
        for name in ("all_gather", "reduce_scatter"):
            size, _ = results[0]["collectives"][name]
            times = [r["collectives"][name][1] for r in results]
            others[name] = (size, None if None in times else max(times))
        link = dataclasses.replace(link, kind_factors=_kind_factors(link, others, world_size),
                                   sync_s=_sync_s(results))
        intra = inter = link  # one machine is one node
    peaks, filled = _fill_dtypes(device_result["tflops"])
    if filled:
        logger.info(
            "profile: %s not measured; priced at the measured rate of %s (pass dtypes= to measure them)",
            ", ".join(filled), ", ".join(f"{d} <- {s}" for d, s in filled.items()),
        )
    if kind == "cuda":
        memory_bytes = int(torch.cuda.get_device_properties(0).total_memory)
    else:
        memory_bytes = max(1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world_size)
    device = DeviceSpec(
        name=device_name,
        kind=kind,
        peak_tflops=peaks,
        memory_bytes=memory_bytes,
        memory_bandwidth_gbps=device_result["memory_bandwidth_gbps"],
        compute_efficiency=1.0,  # achieved rates, not peaks
        memory_efficiency=1.0,
        contention=device_result.get("contention"),
        memory_contention=device_result.get("memory_contention"),
    )
    today = datetime.date.today().isoformat()
    profiled = Cluster(
        device=device, num_nodes=1, devices_per_node=world_size, intra_node=intra, inter_node=inter,
        backend="nccl" if kind == "cuda" else "gloo", host=_host(kind, world_size, disk_dir, quick),
        name=f"local (profiled {today}{', quick' if quick else ''})",
    )
    out_path: pathlib.Path | None = pathlib.Path(path) if path is not None else profile_path(device_name, world_size)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        out_path = None  # under torchrun every rank profiles; rank 0 alone writes
    if out_path is not None:
        _write_atomic(out_path, profiled.to_json())
    return ProfileReport(
        cluster=profiled, path=out_path, threads=device_result["threads"], all_reduce=report_links,
        fit_residual=residual, others=others, filled_dtypes=filled,
        seconds=time.perf_counter() - start_s,
    )


def _host(kind: str, world_size: int, disk_dir: str | os.PathLike | None, quick: bool):
    """The host side (`measure_host`); in a running job rank 0 measures it for every rank."""
    in_job = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    host = [measure_host(kind, world_size, disk_dir, quick) if not in_job or dist.get_rank() == 0 else None]
    if in_job:
        dist.broadcast_object_list(host, src=0)
    return host[0]


def _contention(results: Sequence[dict[str, Any]], kind: str) -> float | None:
    """How much longer ``kind`` of work takes when every rank runs it at once and each repeat
    lasts as long as its slowest rank (a synchronous step waits for it), than on one rank alone:
    per round of `_measure_contention`, the median over repeats of the slowest rank's time over
    the ranks' mean alone time; the median over rounds (>= 1; None off CPU)."""
    measured = [r["device"]["contention"] for r in results]
    if any(m is None for m in measured):
        return None
    ratios = []
    for rounds in zip(*(m[kind] for m in measured)):  # one round, every rank's figures
        alone = statistics.fmean(a for a, _ in rounds)
        slowest = statistics.median(max(times) for times in zip(*(t for _, t in rounds)))
        ratios.append(slowest / alone)
    return round(max(1.0, statistics.median(ratios)), 3)


def _sync_s(results: Sequence[dict[str, Any]]) -> float:
    """``LinkSpec.sync_s`` from every rank's `_measure_sync` samples: the median over rounds of
    the extra wall time per segment, the median over ranks, at least 0 (0 off CPU).

    The wall time, not the time a rank spends inside the collective: a rank that waits for the
    others leaves the host's caches, DRAM and (oversubscribed) cores to them, so they compute
    faster meanwhile and part of the wait is not lost. On 2 ranks with a core each here, both
    ranks waited 3.8-5.1 ms on average inside an all-reduce issued after ~25 ms of compute,
    while the step lost 1.6-1.8 ms per segment (two profiles, each rank); pricing the wait
    over-priced the 45 blocking collectives of the bench GPT's tp 2 + sp step by ~60 ms."""
    samples = [r["collectives"].get("sync") for r in results]
    if any(x is None for x in samples):
        return 0.0
    return max(0.0, statistics.median(statistics.median(x["wall"]) for x in samples))


#: Measured kind factors are clamped to this range: a single timing far outside it is noise.
_FACTOR_RANGE = (0.5, 10.0)


def _kind_factors(link: LinkSpec, others: dict[str, tuple[int, float | None]], world_size: int) -> dict[str, float]:
    """How much slower than the ring formula (with the all-reduce fit) each other kind ran.

    NCCL's all-gather and reduce-scatter are rings (factor ~1); gloo's are not (about 2-3x on
    loopback here), and the planner prices ZeRO and sequence parallelism with them.
    """
    ring = Link.from_spec(link)
    predict = {"all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time}
    factors = {}
    for name, (size, seconds) in others.items():
        if seconds is None or name not in predict:
            continue
        model = predict[name](size, world_size, ring)
        if model > 0:
            factors[name] = round(min(max(seconds / model, _FACTOR_RANGE[0]), _FACTOR_RANGE[1]), 3)
    return factors


def _default_link(kind: str, device_name: str) -> LinkSpec:
    """The link `Cluster.local` assumes for this device kind when nothing is measured."""
    if kind == "cpu":
        return _LOOPBACK
    preset = _preset_for_gpu(device_name)
    return _PRESETS[preset][1] if preset is not None else _PCIE


def profile(
    cluster: Cluster | None = None,
    *,
    world_size: int | None = None,
    path: str | os.PathLike | None = None,
    dtypes: Sequence[str] | None = None,
    quick: bool = False,
    disk_dir: str | os.PathLike | None = None,
) -> Cluster:
    """Measures this machine's device and links and writes a cluster JSON that `Cluster.local` loads.

    Args:
        cluster: What to profile: its world size and device kind (``"cpu"``/``"cuda"``) decide.
            It must describe this machine: one node, a device kind this machine has, no more ranks
            than devices (GPU) or cores (CPU). None: this machine's accelerator (else CPU) and
            ``world_size``.
        world_size: Ranks to profile (default 1; with ``cluster``, must agree with it). With more
            than one, local ranks time the collectives and the ring alpha-beta is fitted: the
            ranks of the running job when called on every rank of one (under torchrun or in
            `graphpass.launch`'s ranks, whose ``world_size`` it must be: its ranks profile in
            place and each gets the cluster; rank 0 writes it), else ranks started for it.
        path: Where to write the JSON; default `graphpass.cluster.profile_path` (device name,
            world size), where `Cluster.local` looks.
        dtypes: Matmul dtypes to time; default ``("fp32",)`` on CPU, ``("bf16", "fp16", "fp32",
            "tf32")`` on CUDA. Other standard dtypes take a measured stand-in's rate (logged).
        quick: Fewer sizes and repeats: seconds instead of about a minute, noisier figures (a test
            mode; the quick CPU copy may partly hit cache).
        disk_dir: Where the disk tier will write (its free space and write rate go into
            ``Cluster.host``, `graphpass.cost.profiler.host`); default ``GRAPHPASS_OFFLOAD_DIR``,
            else the temporary directory.

    Returns:
        The profiled `Cluster` (``compute_efficiency = memory_efficiency = 1.0``).

    Raises:
        ValueError: ``cluster`` does not describe this machine (the message names the field), or
            bad ``world_size``/``dtypes``.
        RankError, TimeoutError: a profiling rank failed or hung (all ranks were killed).
    """
    report = run_profile(cluster, world_size=world_size, path=path, dtypes=dtypes, quick=quick, disk_dir=disk_dir)
    logger.info("%s", report.summary())
    return report.cluster
