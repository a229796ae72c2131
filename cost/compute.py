"""Compute time per IR node: FLOPs and bytes from fake values, priced by a roofline.

Every number here comes from shapes alone (``node.meta["val"]`` of a node and of its inputs), so a
graph captured from a meta-device 175B model is priced without allocating anything.

* **FLOPs.** Matmul-like ops count 2 FLOPs per multiply-add: ``mm``/``addmm``/``bmm``/
  ``baddbmm``/``convolution`` through torch's own formulas (``torch.utils.flop_counter.
  flop_registry``, called on the fake values); ``linear`` and ``matmul`` as ``2·numel(out)·K``
  (plus ``numel(out)`` for a bias); ``scaled_dot_product_attention`` as ``4·B·H·S_q·S_k·D``
  (``QKᵀ`` and ``PV``), halved when causal, because ``FlopCounterMode`` counts CPU attention as 0
  (DESIGN.md). ``embedding`` is a gather: 0 FLOPs, bytes only. Norms, softmax, reductions and
  pointwise ops cost a few FLOPs per element of their largest operand (``_PER_ELEMENT``); views
  cost nothing.
* **Backward FLOPs.** A matmul's backward is one matmul of the forward's size per operand that
  needs a gradient (``dX = dY·Wᵀ``, ``dW = Xᵀ·dY``): 2× forward for a linear layer inside the
  network, 1× for the first layer whose input is data. Attention's backward is 2× forward (``dV``,
  ``dP``, ``dQ``, ``dK``; the recomputation of ``S`` in flash attention is not counted). Other ops
  cost ``_PER_ELEMENT``'s backward factor per element. An op none of whose inputs needs a
  gradient has no backward. Which values need gradients comes from a one-pass dataflow
  (:func:`graphpass.grads.grad_requiring_nodes`: parameters and everything computed from them, never placeholders);
  :func:`node_flops` on its own assumes every floating input needs one.
* **Bytes.** Forward bytes read plus written: every tensor input and output, except that views
  move nothing and an embedding reads only the rows it gathers. Backward moves about twice the
  forward bytes (it reads ``dY`` and the saved inputs and writes a gradient per input).
* **Time.** ``max(flops / (peak·efficiency), bytes / (bandwidth·memory_efficiency))`` per node,
  the efficiencies being the device's (``DeviceSpec.compute_efficiency``/``memory_efficiency``:
  0.6/0.8 for spec-sheet peaks, 1.0 for a profiled device whose figures are achieved rates); a
  measured time (``graph_compute(..., measured=...)``, from ``graphpass.cost.profiler.node_times``)
  replaces the roofline.

Example::

    gm = capture(model, (idx, targets)).gm
    costs = graph_compute(gm, Cluster.preset("a100-80g").device)
    costs["linear"]  # NodeCost(forward_s=..., backward_s=..., forward_flops=..., ...)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from graphpass import meta
from graphpass.grads import grad_requiring_nodes, is_float, tensors
from graphpass.ops import VIEW_NAMES, op_base
# The default efficiencies live with DeviceSpec (its fields default to them); re-exported here.
from graphpass.cluster import DEFAULT_EFFICIENCY, DEFAULT_MEMORY_EFFICIENCY, DeviceSpec

log = logging.getLogger(__name__)

__all__ = [
    "NodeCost",
    "node_flops",
    "node_bytes",
    "roofline_time_s",
    "graph_compute",
    "total_flops",
    "DEFAULT_EFFICIENCY",
    "DEFAULT_MEMORY_EFFICIENCY",
]


# (forward, backward) FLOPs per element for non-matmul ops, approximate operation counts:
# layer_norm = mean, variance, normalise, scale, shift; softmax = max, exp, sum, divide; gelu's
# tanh/erf polynomial. Anything unlisted is a pointwise op costing 1 forward, 1 backward.
_PER_ELEMENT: dict[str, tuple[float, float]] = {
    "layer_norm": (5.0, 10.0),
    "native_layer_norm": (5.0, 10.0),
    "rms_norm": (4.0, 8.0),
    "group_norm": (5.0, 10.0),
    "batch_norm": (5.0, 10.0),
    "_softmax": (5.0, 5.0),
    "softmax": (5.0, 5.0),
    "log_softmax": (5.0, 5.0),
    "_log_softmax": (5.0, 5.0),
    "gelu": (8.0, 10.0),
    "silu": (4.0, 6.0),
    "tanh": (4.0, 2.0),
    "sigmoid": (4.0, 2.0),
    "dropout": (1.0, 1.0),
    # The loss is a log-softmax over the logits plus a gather.
    "cross_entropy_loss": (5.0, 5.0),
    "cross_entropy": (5.0, 5.0),
}

# Matmul-like ops whose formula torch ships (flop_registry keys are OpOverloadPackets).
_TORCH_FORMULAS = {
    "mm": torch.ops.aten.mm,
    "addmm": torch.ops.aten.addmm,
    "bmm": torch.ops.aten.bmm,
    "baddbmm": torch.ops.aten.baddbmm,
    "convolution": torch.ops.aten.convolution,
    "_convolution": torch.ops.aten._convolution,
}
# Which positional inputs of each matmul-like op are the two operands (for backward).
_OPERANDS = {
    "mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "linear": (0, 1),
    "addmm": (1, 2), "baddbmm": (1, 2), "convolution": (0, 1), "_convolution": (0, 1),
    # Mixture-of-Experts grouped products (graphpass.nn's, Hugging Face's fallback, torch's):
    # rows [N, d] times one [d, f] per expert, priced as every row computed (a capacity's
    # dropped rows are not: an upper bound of at most the dropped share).
    "grouped_mm": (0, 1), "grouped_mm_fallback": (0, 1), "_grouped_mm": (0, 1),
}


@dataclass(frozen=True)
class NodeCost:
    """Compute cost of one IR node on one device.

    Attributes:
        forward_s: Forward time (roofline or measured).
        backward_s: Backward time (roofline or measured); 0 when no input needs a gradient.
        forward_flops: Forward FLOPs.
        backward_flops: Backward FLOPs.
        bytes: Forward bytes read plus written.
    """

    forward_s: float
    backward_s: float
    forward_flops: float
    backward_flops: float
    bytes: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


# ------------------------------------------------------------------------------------ helpers


def _val(value: Any) -> Any:
    return value.meta.get(meta.VAL) if isinstance(value, fx.Node) else value


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument ``index``/``name`` of ``node`` (its fake value for nodes)."""
    if len(node.args) > index:
        return _val(node.args[index])
    return _val(node.kwargs.get(name, default))


def _input_tensors(node: fx.Node) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: out.extend(tensors(_val(n))) or n)
    return out


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel()) * t.element_size()


def _numel(value: Any) -> float:
    return float(sum(t.numel() for t in tensors(value)))


def _needs_grad(arg: Any, grad_nodes: Collection[fx.Node] | None) -> bool:
    if not isinstance(arg, fx.Node):
        return False
    if grad_nodes is None:
        return is_float(_val(arg))
    return arg in grad_nodes


def _grad_flags(node: fx.Node, grad_nodes: Collection[fx.Node] | None) -> list[bool]:
    flags: list[bool] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: flags.append(_needs_grad(n, grad_nodes)) or n)
    return flags


# ------------------------------------------------------------------------------------ FLOPs


def _matmul_flops(name: str, node: fx.Node, out: Any) -> float:
    if name in _TORCH_FORMULAS:
        formula = flop_registry[_TORCH_FORMULAS[name]]
        args = fx.node.map_arg(node.args, _val)
        kwargs = fx.node.map_arg(node.kwargs, _val)
        return float(formula(*args, out_val=out, **kwargs))
    # linear / matmul: one multiply-add per output element per contracted element.
    a = _arg(node, 0, "input")
    flops = 2.0 * _numel(out) * a.shape[-1]
    if name == "linear" and _arg(node, 2, "bias") is not None:
        flops += _numel(out)
    return flops


def _sdpa_flops(node: fx.Node) -> float:
    q = _arg(node, 0, "query")
    k = _arg(node, 1, "key")
    v = _arg(node, 2, "value")
    is_causal = bool(_arg(node, 5, "is_causal", False))
    batch = math.prod(q.shape[:-2])  # B·H (GQA: q's heads; k/v broadcast)
    s_q, d = q.shape[-2], q.shape[-1]
    s_k, d_v = k.shape[-2], v.shape[-1]
    # QKᵀ: 2·S_q·S_k·D, then P·V: 2·S_q·S_k·D_v.
    flops = 2.0 * batch * s_q * s_k * (d + d_v)
    if is_causal:
        # A causal mask skips the upper triangle: half the score matrix (exactly half for
        # S_q = S_k up to the diagonal's S/2·S term, which kernels compute anyway).
        flops /= 2
    return flops


def node_flops(node: fx.Node, grad_nodes: Collection[fx.Node] | None = None) -> tuple[float, float]:
    """Forward and backward FLOPs of one IR node, from its inputs' and output's fake values.

    Args:
        node: A ``call_function`` node of the IR (aten op or, from the symbolic_trace route, a
            torch function such as ``F.linear``). Other node kinds cost nothing.
        grad_nodes: The nodes whose values need a gradient (:func:`grad_requiring_nodes`). None
            assumes every floating-point input needs one (an upper bound: it counts the input
            gradient of the first layer, which training never computes).

    Returns:
        ``(forward_flops, backward_flops)``.
    """
    if node.op != "call_function":
        return 0.0, 0.0
    name = op_base(node)
    out = _val(node)
    if name in VIEW_NAMES or out is None:
        return 0.0, 0.0
    if name == "embedding":
        # A gather: no arithmetic forward; backward scatter-adds dY into the weight's rows.
        weight_needs_grad = _needs_grad(node.args[0] if node.args else None, grad_nodes)
        return 0.0, _numel(out) if weight_needs_grad else 0.0
    if name in _BAGS:
        # A gather of every id's row, added into its bag; backward scatter-adds the bags'
        # gradients into the rows read (an id's row, not the table: never the table's size).
        gathered = _gathered(node)
        weight_needs_grad = _needs_grad(node.args[0] if node.args else None, grad_nodes)
        return gathered, gathered if weight_needs_grad else 0.0
    if name in _OPERANDS:
        forward = _matmul_flops(name, node, out)
        i, j = _OPERANDS[name]
        grads = sum(_needs_grad(node.args[p] if len(node.args) > p else None, grad_nodes) for p in (i, j))
        return forward, forward * grads
    if name == "scaled_dot_product_attention":
        forward = _sdpa_flops(node)
        return forward, 2.0 * forward if any(_grad_flags(node, grad_nodes)) else 0.0
    if name in ("arange", "zeros", "ones", "full", "empty", "copy_", "clone", "_to_copy", "to"):
        return 0.0, 0.0  # fills and copies: bytes only
    per_forward, per_backward = _PER_ELEMENT.get(name, (1.0, 1.0))
    # Pointwise ops touch every output element, reductions (sum, the loss) every input element.
    elements = max([_numel(out)] + [float(t.numel()) for t in _input_tensors(node)])
    forward = per_forward * elements
    backward = per_backward * elements if any(_grad_flags(node, grad_nodes)) else 0.0
    return forward, backward


def node_bytes(node: fx.Node) -> float:
    """Forward bytes read plus written by one node: every tensor input and output.

    Views move nothing; an embedding reads its indices and the rows it gathers (the size of its
    output), not the whole table.
    """
    if node.op != "call_function":
        return 0.0
    name = op_base(node)
    out = _val(node)
    if name in VIEW_NAMES:
        return 0.0
    written = float(sum(_nbytes(t) for t in tensors(out)))
    if name == "embedding":
        indices = _arg(node, 1, "indices")
        return 2.0 * written + (_nbytes(indices) if isinstance(indices, torch.Tensor) else 0.0)
    if name in _BAGS:  # the rows its ids gather, the ids, offsets and weights, and the bags written
        weight = _arg(node, 0, "weight")
        rows = _gathered(node) * (weight.element_size() if isinstance(weight, torch.Tensor) else 4)
        small = sum(_nbytes(t) for t in _input_tensors(node)[1:] if isinstance(t, torch.Tensor))
        return written + rows + float(small)
    return written + float(sum(_nbytes(t) for t in _input_tensors(node)))


#: the bag lookups (nn.EmbeddingBag): their table is argument 0, their ids argument 1
_BAGS = ("embedding_bag", "_embedding_bag", "_embedding_bag_forward_only")


def _gathered(node: fx.Node) -> float:
    """Elements a bag lookup gathers: each id's row."""
    weight, indices = _arg(node, 0, "weight"), _arg(node, 1, "indices")
    if not (isinstance(weight, torch.Tensor) and isinstance(indices, torch.Tensor)):
        return 0.0
    return float(indices.numel()) * (weight.shape[-1] if weight.dim() else 1)


# ------------------------------------------------------------------------------------ time


def roofline_time_s(
    flops: float,
    bytes_moved: float,
    device: DeviceSpec,
    dtype: str = "bf16",
    efficiency: float | None = None,
    memory_efficiency: float | None = None,
) -> float:
    """Roofline time: the slower of doing the arithmetic and moving the bytes.

    Args:
        flops: Floating-point operations.
        bytes_moved: Bytes read plus written to device memory.
        device: Peak FLOP/s per dtype and memory bandwidth.
        dtype: Key of ``device.peak_tflops`` (``"bf16"``, ``"fp16"``, ``"tf32"``, ``"fp32"``).
        efficiency: Achieved fraction of peak FLOP/s; None takes ``device.compute_efficiency``
            (`DEFAULT_EFFICIENCY` for spec-sheet peaks, 1.0 for a profiled device).
        memory_efficiency: Achieved fraction of peak bandwidth; None takes
            ``device.memory_efficiency``.

    Raises:
        ValueError: unknown dtype, an efficiency outside (0, 1], or negative work.
    """
    if dtype not in device.peak_tflops:
        raise ValueError(
            f"dtype {dtype!r} has no peak in DeviceSpec {device.name!r}.peak_tflops; "
            f"use one of {sorted(device.peak_tflops)}"
        )
    if efficiency is None:
        efficiency = device.compute_efficiency
    if memory_efficiency is None:
        memory_efficiency = device.memory_efficiency
    for field, value in (("efficiency", efficiency), ("memory_efficiency", memory_efficiency)):
        if not 0 < value <= 1:
            raise ValueError(f"{field} must be in (0, 1], got {value!r}")
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes_moved must be >= 0, got {flops!r} and {bytes_moved!r}")
    compute_s = flops / (device.peak_tflops[dtype] * 1e12 * efficiency)
    memory_s = bytes_moved / (device.memory_bandwidth_gbps * 1e9 * memory_efficiency)
    return max(compute_s, memory_s)


# ------------------------------------------------------------------------------------ graphs


def graph_compute(
    gm: fx.GraphModule,
    device: DeviceSpec,
    dtype: str = "bf16",
    *,
    efficiency: float | None = None,
    memory_efficiency: float | None = None,
    measured: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, NodeCost]:
    """Compute cost of every ``call_function`` node of ``gm``, keyed by node name.

    Args:
        gm: The IR (every tensor node carries a fake value).
        device: The device the graph runs on.
        dtype: Compute dtype, a key of ``device.peak_tflops``.
        efficiency: See :func:`roofline_time_s` (None: the device's).
        memory_efficiency: See :func:`roofline_time_s` (None: the device's).
        measured: Profiled ``(forward_s, backward_s)`` per node name; these replace the roofline
            times (FLOPs and bytes are still reported).

    Raises:
        ValueError: ``measured`` names a node that is not a ``call_function`` of ``gm``.
    """
    grad_nodes = grad_requiring_nodes(gm)
    measured = dict(measured or {})
    costs: dict[str, NodeCost] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        forward_flops, backward_flops = node_flops(node, grad_nodes)
        bytes_moved = node_bytes(node)
        if node.name in measured:
            forward_s, backward_s = measured.pop(node.name)
        else:
            forward_s = roofline_time_s(
                forward_flops, bytes_moved, device, dtype, efficiency, memory_efficiency
            )
            # Backward reads dY and the saved inputs and writes a gradient per input: ~2x bytes.
            has_backward = backward_flops > 0 or any(_grad_flags(node, grad_nodes))
            backward_s = roofline_time_s(
                backward_flops, 2.0 * bytes_moved if has_backward else 0.0,
                device, dtype, efficiency, memory_efficiency,
            )
        costs[node.name] = NodeCost(forward_s, backward_s, forward_flops, backward_flops, bytes_moved)
    if measured:
        raise ValueError(
            f"graph_compute(measured=...) names nodes that are not call_function nodes of the "
            f"graph: {sorted(measured)}"
        )
    log.debug("priced %d nodes on %s (%s)", len(costs), device.name, dtype)
    return costs


def total_flops(gm: fx.GraphModule) -> tuple[float, float]:
    """``(forward_flops, backward_flops)`` of one training step's forward and backward over ``gm``.

    For a transformer the sum is close to the ``6·N·D`` rule of thumb (Kaplan et al. 2020):
    ``2·N·D`` forward plus ``4·N·D`` backward, N parameters and D tokens, plus attention.
    """
    grad_nodes = grad_requiring_nodes(gm)
    forward = backward = 0.0
    for node in gm.graph.nodes:
        f, b = node_flops(node, grad_nodes)
        forward += f
        backward += b
    return forward, backward
