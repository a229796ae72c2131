"""Per-op times: each op of a captured graph run alone on this machine, and their on-disk cache.

Every ``call_function`` node of a captured graph is keyed by `op_key` (op overload, input
shapes, strides, dtypes, which inputs need a gradient, the non-tensor arguments, the device);
`node_times` returns the keys found in ``ops/<device>.json`` (`op_cache_path`, under
`graphpass.cluster.cache_dir`), and with ``measure=True`` on this machine's device
(`is_this_machine`) the missing ones are run in isolation on random inputs of the fake shapes,
forward and backward (`_measure_node`), and written back. Identical keys are measured once, so
a 96-layer model measures one layer's ops. Views cost 0 and are never measured. Whatever stays
unpriced is logged at WARNING (the roofline prices it): never silently. `isolation_factor`
then runs the whole graph once and scales the isolated times to what they take in sequence.

**Threads (CPU).** An op's time on CPU depends on the torch threads it may use, so a CPU
`op_key` names the thread count (``cpu/1t``): a cache measured with 1 thread is not used by a
process running 2.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pathlib
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from graphpass import meta
from graphpass.cluster import DeviceSpec, _preset_for_gpu, cache_dir, device_slug
from graphpass.ops import VIEW_NAMES
from graphpass.cost.profiler.timing import _adaptive_median_s, _median_s, _write_atomic, together_median_s
from graphpass.grads import grad_requiring_nodes
from graphpass.ops import op_base
from graphpass.progress import Progress

__all__ = ["is_this_machine", "isolation_factor", "node_times", "op_cache_path", "op_key"]

logger = logging.getLogger(__name__)

_CACHE_VERSION = 1
# Integer inputs index into another input: (op names, how to find the bound from the fake inputs).
_CLASS_DIM_OPS = frozenset({"cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_nd",
                            "nll_loss_forward", "nll_loss2d", "nll_loss2d_forward"})
_MAX_REPORTED = 5


def op_cache_path(device: DeviceSpec) -> pathlib.Path:
    """Where per-op times of ``device`` are cached: ``cache_dir() / "ops" / "<device slug>.json"``."""
    return cache_dir() / "ops" / f"{device_slug(device.name)}.json"


def _device_tag(device: DeviceSpec) -> str:
    # A CPU op's time depends on the threads it may use (see the module docstring).
    return f"{device.name}/{torch.get_num_threads()}t" if device.kind == "cpu" else device.name


def _target_name(target: Any) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)  # "aten.linear.default": the overload is part of the name
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{module}.{name}" if module else name


def _fmt_tensor(t: torch.Tensor) -> str:
    text = f"{str(t.dtype).removeprefix('torch.')}[{','.join(str(int(s)) for s in t.shape)}]"
    if not t.is_contiguous():  # a transposed operand can run a different kernel
        text += f"s({','.join(str(int(s)) for s in t.stride())})"
    return text


def _fmt_arg(value: Any, grad_nodes: Collection[fx.Node]) -> str:
    if isinstance(value, fx.Node):
        val = value.meta.get(meta.VAL)
        text = _fmt_arg(val, ()) if val is not None else f"?{value.name}"
        return text + ("+grad" if value in grad_nodes else "")
    if isinstance(value, torch.Tensor):
        return _fmt_tensor(value)
    if isinstance(value, (list, tuple)):
        inner = ",".join(_fmt_arg(v, grad_nodes) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={_fmt_arg(v, grad_nodes)}" for k, v in sorted(value.items())) + "}"
    return repr(value)


def op_key(node: fx.Node, device: DeviceSpec, grad_nodes: Collection[fx.Node] | None = None) -> str:
    """A stable string naming what one op's time depends on.

    ``"<op overload>(<args>; <kwargs>) @<device>"``, each tensor input as dtype, shape (and stride
    when not contiguous) with ``+grad`` when it needs a gradient, every non-tensor argument (dims,
    causal flags, reductions) by ``repr``. Two nodes with the same key cost the same.

    Args:
        node: A ``call_function`` node whose inputs carry fake values.
        device: The device the time is for; a CPU key also names the current torch thread count.
        grad_nodes: `graphpass.grads.grad_requiring_nodes` of the node's graph (computed
            when None; pass it when keying many nodes).

    Example: ``aten.addmm.default(f32[64]+grad,f32[8,16],f32[16,64]s(1,16)+grad; ) @cpu/2t``.
    """
    if grad_nodes is None:
        grad_nodes = grad_requiring_nodes(node.graph.owning_module)
    args = ",".join(_fmt_arg(a, grad_nodes) for a in node.args)
    kwargs = ",".join(f"{k}={_fmt_arg(v, grad_nodes)}" for k, v in sorted(node.kwargs.items()))
    return f"{_target_name(node.target)}({args}; {kwargs}) @{_device_tag(device)}"


def _read_cache(path: pathlib.Path) -> dict[str, tuple[float, float]]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("version") != _CACHE_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {_CACHE_VERSION}")
        return {k: (float(f), float(b)) for k, (f, b) in data["times"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("ignoring unreadable op-time cache %s: %s", path, exc)
        return {}


def _write_cache(path: pathlib.Path, device: DeviceSpec, new: dict[str, tuple[float, float]]) -> None:
    # Merge with what is on disk now: another process (rank) may have written meanwhile.
    merged = {**_read_cache(path), **new}
    text = json.dumps({"version": _CACHE_VERSION, "device": device.name,
                       "times": {k: list(v) for k, v in sorted(merged.items())}}, indent=1)
    _write_atomic(path, text)


def is_this_machine(device: DeviceSpec) -> bool:
    """Whether ``device`` names this machine's CPU or one of its GPUs (so ops can be measured)."""
    if device.kind == "cpu":
        return device.name == "cpu"  # Cluster.local and profile name every CPU "cpu"
    if not torch.cuda.is_available():
        return False
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    return device.name in names or device.name in {_preset_for_gpu(n) for n in names}


def _index_bound(node: fx.Node) -> int | None:
    """The exclusive upper bound of ``node``'s integer inputs when they index another input."""
    name = op_base(node)
    floats = [v for v in (a.meta.get(meta.VAL) for a in node.all_input_nodes)
              if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not floats:
        return None
    if name == "embedding":
        table = next((v for v in floats if v.dim() == 2), None)
        return int(table.shape[0]) if table is not None else None
    if name in _CLASS_DIM_OPS:
        logits = floats[0]
        return int(logits.shape[1] if logits.dim() >= 2 else logits.shape[0])
    return None


def _materialise(val: torch.Tensor, device: torch.device, needs_grad: bool, bound: int | None) -> torch.Tensor:
    """A real tensor with ``val``'s shape, stride and dtype: random floats, valid indices."""
    shape, stride = tuple(int(s) for s in val.shape), tuple(int(s) for s in val.stride())
    strided = not val.is_contiguous() and all(shape)
    # A non-contiguous input (a transposed weight, an expanded bias) keeps its strides: it can
    # select another kernel. Its storage spans 1 + sum((size - 1) * stride) elements.
    size = (1 + sum((s - 1) * st for s, st in zip(shape, stride)),) if strided else shape
    if val.is_floating_point() or val.is_complex():
        base = torch.randn(size, dtype=val.dtype, device=device)
    elif val.dtype == torch.bool:
        base = torch.ones(size, dtype=torch.bool, device=device)
    elif bound is not None and bound > 0:
        base = torch.randint(0, bound, size, dtype=val.dtype, device=device)
    else:
        base = torch.zeros(size, dtype=val.dtype, device=device)  # a valid index for most ops
    base.requires_grad_(needs_grad)
    return base.as_strided(shape, stride) if strided else base


def _measure_node(node: fx.Node, grad_nodes: Collection[fx.Node], device: torch.device) -> tuple[float, float]:
    """``(forward_s, backward_s)`` of one node run in isolation on random inputs of its shapes.

    Backward is ``torch.autograd.grad(outputs, inputs, grad_outputs=randn_like(outputs))`` (the
    gradient of ``(out * randn_like(out)).sum()`` without that extra op) over the float inputs that
    need a gradient; 0 when none does.
    """
    bound = _index_bound(node)
    grad_inputs: list[torch.Tensor] = []

    def real(arg: fx.Node) -> Any:
        val = arg.meta.get(meta.VAL)
        if not isinstance(val, torch.Tensor):
            return val  # ints, SymInt specialised values, None
        needs_grad = arg in grad_nodes and (val.is_floating_point() or val.is_complex())
        tensor = _materialise(val, device, needs_grad, bound)
        if needs_grad:
            grad_inputs.append(tensor)
        return tensor

    args = fx.node.map_arg(node.args, real)
    kwargs = fx.node.map_arg(node.kwargs, real)
    target = node.target

    def forward() -> Any:
        return target(*args, **kwargs)

    forward_s = _adaptive_median_s(forward, device.type)
    if not grad_inputs:
        return forward_s, 0.0
    out = forward()
    outputs = [t for t in _flat_tensors(out) if t.requires_grad]
    if not outputs:
        return forward_s, 0.0
    grad_outputs = [torch.randn_like(t) for t in outputs]

    def backward() -> Any:
        return torch.autograd.grad(outputs, grad_inputs, grad_outputs, retain_graph=True, allow_unused=True)

    # Each autograd.grad call pays the engine's start-up (~30 us here), which a whole-graph
    # backward pays once, not per node: subtract it, keeping at least a tenth of the reading.
    measured_s = _adaptive_median_s(backward, device.type)
    return forward_s, max(measured_s - _autograd_overhead_s(device), 0.1 * measured_s)


_AUTOGRAD_OVERHEAD_S: dict[str, float] = {}


def _autograd_overhead_s(device: torch.device) -> float:
    """Time of ``autograd.grad`` through one view of a 1-element tensor: the engine's fixed cost."""
    if device.type not in _AUTOGRAD_OVERHEAD_S:
        x = torch.ones(1, device=device, requires_grad=True)
        y = x.view(1)
        g = torch.ones(1, device=device)
        _AUTOGRAD_OVERHEAD_S[device.type] = _adaptive_median_s(
            lambda: torch.autograd.grad(y, x, g, retain_graph=True), device.type, min_repeats=15
        )
    return _AUTOGRAD_OVERHEAD_S[device.type]


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def node_times(
    gm: fx.GraphModule,
    device: DeviceSpec,
    *,
    measure: bool = False,
    cache_path: str | os.PathLike | None = None,
    skip: Callable[[fx.Node], bool] | None = None,
    together: bool = False,
) -> dict[str, tuple[float, float]]:
    """Profiled ``(forward_s, backward_s)`` per ``call_function`` node, for `graph_compute(measured=)`.

    Views (`graphpass.ops.VIEW_NAMES`) cost ``(0, 0)``. Other nodes get their cached time
    by `op_key`; with ``measure=True`` and ``device`` this machine's device, missing keys are run
    (each distinct key once), cached and returned. Ops that fail in isolation are logged and left
    out. Every node left out is reported in one WARNING: the roofline model prices it.

    Args:
        gm: The IR; every tensor node carries a fake value (a meta-device capture works).
        device: The device the times are for (its name keys the cache).
        measure: Run the ops missing from the cache on this machine.
        cache_path: The JSON cache; default `op_cache_path(device)`.
        skip: Nodes neither timed nor reported (a rank program's collectives, which the
            transition table prices).
        together: Every rank of the running default group calls this with the same graph (as
            `isolation_factor`'s ``together`` does): rank 0 measures what the cache lacks while
            the others wait, then they read the cache it wrote, so every rank gets the same
            times, each op timed alone as everywhere else (ranks timing ops at once would each
            see a different share of the host).

    Returns:
        ``{node name: (forward_s, backward_s)}`` for the nodes with a profiled (or view) time.
    """
    if together and measure:
        first = dist.get_rank() == 0
        times = node_times(gm, device, measure=True, cache_path=cache_path, skip=skip) if first else None
        _wait_for_rank_0()
        if first:
            return times
        measure = False
    path = pathlib.Path(cache_path) if cache_path is not None else op_cache_path(device)
    cache = _read_cache(path)
    grad_nodes = grad_requiring_nodes(gm)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and not (skip and skip(n))]
    times: dict[str, tuple[float, float]] = {}
    pending: dict[str, list[fx.Node]] = {}
    for node in nodes:
        if op_base(node) in VIEW_NAMES:
            times[node.name] = (0.0, 0.0)
            continue
        key = op_key(node, device, grad_nodes)
        if key in cache:
            times[node.name] = cache[key]
        else:
            pending.setdefault(key, []).append(node)
    if pending and measure:
        if is_this_machine(device):
            _measure_pending(pending, times, grad_nodes, device, path)
        else:
            logger.warning(
                "node_times(measure=True): %r is not this machine's device; using cached times only",
                device.name,
            )
    missing = [n for group in pending.values() for n in group]
    if missing:
        listed = ", ".join(f"{n.name} ({op_base(n)})" for n in missing[:_MAX_REPORTED])
        more = f", ... {len(missing) - _MAX_REPORTED} more" if len(missing) > _MAX_REPORTED else ""
        logger.warning(
            "%d of %d nodes have no profiled time on %s; priced by the roofline model: %s%s",
            len(missing), len(nodes), device.name, listed, more,
        )
    return times


#: How long ranks wait for rank 0 to time a graph's ops (`node_times` ``together``): minutes
#: for a large graph's first measurement, beyond a process group's usual collective timeout.
_MEASURING_TIMEOUT = datetime.timedelta(hours=1)


def _wait_for_rank_0() -> None:
    """A barrier that outlasts rank 0's op measurement (gloo's monitored barrier takes its own
    timeout; other backends wait as long as their group's timeout)."""
    if "gloo" in str(dist.get_backend()):
        dist.monitored_barrier(timeout=_MEASURING_TIMEOUT)
    else:
        dist.barrier()


def _measure_pending(pending: dict[str, list[fx.Node]], times: dict[str, tuple[float, float]],
                     grad_nodes: Collection[fx.Node], device: DeviceSpec, path: pathlib.Path) -> None:
    """Measures one node per pending key, fills ``times``, removes the measured keys from ``pending``
    and writes them to the cache."""
    torch_device = torch.device("cuda", torch.cuda.current_device()) if device.kind == "cuda" else torch.device("cpu")
    measured: dict[str, tuple[float, float]] = {}
    failed: dict[str, str] = {}
    start_s = time.perf_counter()
    with Progress(len(pending), "timing ops") as bar:
        for i, (key, group) in enumerate(pending.items(), start=1):
            bar.step(f"timing op {i}/{len(pending)} {op_base(group[0])}")
            try:
                measured[key] = _measure_node(group[0], grad_nodes, torch_device)
            except Exception as exc:  # noqa: BLE001 - reported below; the roofline prices the node
                failed[group[0].name] = f"{op_base(group[0])}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    for key, value in measured.items():
        for node in pending.pop(key):
            times[node.name] = value
    if measured:
        _write_cache(path, device, measured)
    logger.info("measured %d distinct ops on %s in %.2f s -> %s",
                len(measured), device.name, time.perf_counter() - start_s, path)
    if failed:
        logger.warning(
            "%d ops could not run in isolation on %s (left to the roofline): %s",
            len(failed), device.name, "; ".join(f"{k}: {v}" for k, v in list(failed.items())[:_MAX_REPORTED]),
        )


def isolation_factor(gm: fx.GraphModule, inputs: Sequence[torch.Tensor],
                     times: dict[str, tuple[float, float]], *, together: bool = False) -> float:
    """How much longer the whole graph's forward and backward takes than the sum of its ops'
    isolated `node_times` (>= 1 expected: caches shared between ops, autograd bookkeeping).

    Ops measured one at a time run on warm inputs with nothing else in the caches; in a step each
    reads what the previous one left. The graph runs for real in this process (median of 5 after
    2 warm-ups), so only where every parameter, buffer and input is a real tensor on this
    machine's device and every op has a profiled time; elsewhere 1.0 (logged).

    ``together``: every rank of the running default group calls this on its copy of the graph
    at once and the graph is timed on all of them together (`together_median_s`), so the factor
    also holds the ranks' contention for the host; the ranks agree first that every one of them
    can run it (else all return 1.0), and all time the graph alike (their factors differ only as
    their ``times`` do).
    """
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    tensors = [*gm.parameters(), *gm.buffers(), *inputs]
    why = None
    if any(n.name not in times for n in nodes):
        why = "not every op has a profiled time"
    elif any(t.is_meta or isinstance(t, FakeTensor) for t in tensors):
        why = "the graph holds meta or fake tensors and cannot run"
    op_sum = 0.0 if why else sum(f + b for f, b in (times[n.name] for n in nodes))
    kind = tensors[0].device.type if tensors else "cpu"
    runnable = why is None and op_sum > 0
    if together:
        agreed = torch.tensor([int(runnable)], device="cuda" if kind == "cuda" else "cpu")
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if runnable and not agreed.item():
            why = "another rank cannot run the graph"
        runnable = bool(agreed.item())
    if not runnable:
        if why:
            logger.info("isolation factor: %s; op times left unscaled", why)
        return 1.0

    def step() -> None:
        out = [t for t in _flat_tensors(gm(*inputs)) if t.requires_grad]
        if out:
            torch.autograd.backward(out, [torch.ones_like(t) for t in out])
        for p in gm.parameters():
            p.grad = None

    whole = (together_median_s if together else _median_s)(step, kind, warmup=2, repeats=5)
    factor = whole / op_sum
    logger.info("isolation factor %.3f: the whole graph took %.1f ms%s, its ops alone %.1f ms",
                factor, whole * 1e3, " on every rank at once" if together else "", op_sum * 1e3)
    return factor
