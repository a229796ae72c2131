"""``graphpass::grouped_mm``: one matrix product per expert over rows grouped by expert.

``grouped_mm(x, weight, offs)`` multiplies rows ``offs[e - 1]:offs[e]`` of ``x`` (``[N, d]``,
rows sorted by expert) by ``weight[e]`` (``[E, d, f]``); rows past ``offs[-1]`` (assignments a
capacity dropped, or a sparse gate left out) are zeros and cost nothing. The output has the
static shape ``[N, f]`` whatever the routing, so a Mixture-of-Experts layer captures as one
static graph: how many rows each expert gets is data, not shape.

torch's own ``torch.nn.functional.grouped_mm`` needs 16-byte aligned strides and fails
backward with empty groups on CPU (torch 2.13), so graphpass carries this one (the same form
as Hugging Face's ``transformers::grouped_mm_fallback``, which :mod:`graphpass.cost.compute`
prices alike). Its backward is a custom op too, so autograd never looks into the loop.
"""

from __future__ import annotations

import torch


def _check(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or offs.dim() != 1:
        raise ValueError(f"grouped_mm takes x [N, d], weight [E, d, f] and offs [E]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}, offs {tuple(offs.shape)}")
    if offs.shape[0] != weight.shape[0] or x.shape[1] != weight.shape[1]:
        raise ValueError(f"grouped_mm: offs has {offs.shape[0]} groups for {weight.shape[0]} experts, or x's "
                         f"{x.shape[1]} features do not match weight's {weight.shape[1]}")
    if offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_mm: offs must be int32 or int64, got {offs.dtype}")


@torch.library.custom_op("graphpass::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[offs[e-1]:offs[e]] @ weight[e]`` for every expert ``e``; rows past ``offs[-1]`` are 0."""
    _check(x, weight, offs)
    out = x.new_zeros(x.shape[0], weight.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):  # one device-to-host copy of the offsets
        if end > start:
            torch.mm(x[start:end], weight[e], out=out[start:end])
        start = end
    return out


@grouped_mm.register_fake
def _(x, weight, offs):
    _check(x, weight, offs)
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("graphpass::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`grouped_mm`'s ``x`` and ``weight`` for the output gradient ``grad``."""
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(weight)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(grad[start:end], weight[e].t(), out=grad_x[start:end])
            torch.mm(x[start:end].t(), grad[start:end], out=grad_w[e])
        start = end
    return grad_x, grad_w


@grouped_mm_backward.register_fake
def _(x, weight, offs, grad):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output) -> None:
    x, weight, offs = inputs
    ctx.save_for_backward(x, weight, offs)


def _backward(ctx, grad):
    x, weight, offs = ctx.saved_tensors
    grad_x, grad_w = torch.ops.graphpass.grouped_mm_backward(x, weight, offs, grad)
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup)

__all__ = ["grouped_mm"]
