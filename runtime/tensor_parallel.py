"""Tensor-parallel collectives (Megatron-LM's conjugate pairs) as graph ops.

Each op takes the mesh ``axis`` and its ``size`` (so that shape propagation works without a
process group) and carries the backward that makes gradients correct:

==========================  ==========================  ============================================
op                          forward                     backward
==========================  ==========================  ============================================
``tp_copy``  (Megatron f)   identity                    all-reduce: the input fed sharded compute,
                                                        so its gradient is partial on every rank
``tp_all_reduce`` (g)       all-reduce (Partial → R)    identity
``tp_all_gather``           all-gather on ``dim``       slice (``grad="slice"``) or reduce-scatter
                            (Shard → R)                 (``grad="reduce_scatter"``: the gathered
                                                        tensor only feeds sharded compute, and
                                                        backward re-gathers it rather than
                                                        keeping it)
``tp_reduce_scatter``       reduce-scatter on ``dim``   all-gather on ``dim``
                            (Partial → Shard)
``tp_scatter``              keep this rank's chunk      all-gather on ``dim``
                            (R → Shard, no traffic)
==========================  ==========================  ============================================

``vocab_parallel_cross_entropy`` computes the mean cross-entropy from vocabulary-sharded logits
without gathering them (Megatron's ``_VocabParallelCrossEntropy``): three all-reduces of
``[tokens]``-sized vectors in forward, none in backward.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime import rank_progress
from graphpass.runtime import regather
from graphpass.runtime.fake import is_fake

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group(axis: str):
    return mesh_lib.current().group(axis)


def _rank(axis: str) -> int:
    return mesh_lib.current().axis_rank(axis)


def _gather(x: torch.Tensor, axis: str, size: int, dim: int) -> torch.Tensor:
    """Concatenation of every rank's ``x`` along ``dim``: contiguous, as the fake op's result
    is (graphs are verified on fake tensors, and later views such as ``view`` rely on it)."""
    group = _group(axis)
    if group is None:
        return x
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # rank-major, as one flat all-gather fills it
    rank_progress.enter("tp_all_gather")
    _all_gather_flat(out, x, group=group)
    if dim == 0:
        return out
    # [size, ..., n, ...] -> [..., size * n, ...]: one copy into the concatenated layout.
    return out.view(size, *x.shape).movedim(0, dim).reshape(*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1 :])


def _reduce_scatter(x: torch.Tensor, axis: str, size: int, dim: int) -> torch.Tensor:
    """This rank's chunk along ``dim`` of the sum over ranks of ``x`` (contiguous)."""
    group = _group(axis)
    if group is None:
        return x
    chunk = x.shape[dim] // size
    # Rank-major input: chunk r of dim ``dim`` becomes block r of a flat buffer.
    blocks = x.unflatten(dim, (size, chunk)).movedim(dim, 0).contiguous()
    out = x.new_empty((*x.shape[:dim], chunk, *x.shape[dim + 1 :]))
    rank_progress.enter("tp_reduce_scatter")
    _reduce_scatter_flat(out, blocks.view(size * out.shape[0], *out.shape[1:]), group=group)
    return out


def _all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    out = x.contiguous().clone()
    group = _group(axis)
    if group is not None:
        rank_progress.enter("tp_all_reduce")
        dist.all_reduce(out, group=group)
    return out


def _chunk(x: torch.Tensor, axis: str, size: int, dim: int) -> torch.Tensor:
    return x.chunk(size, dim=dim)[_rank(axis)].contiguous()


def _resized(x: torch.Tensor, dim: int, factor: float) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = int(shape[dim] * factor)
    return x.new_empty(shape)


def gather_tp_parameters(
    shards: list[torch.Tensor], dims: list[int], axis: str, parts: list[Sequence[int] | None] | None = None
) -> list[torch.Tensor]:
    """Full tensors of tensor-parallel shards (a collective over ``axis``: every rank calls it).

    ``parts[i]``, when given, are the fused part sizes of shard ``i`` (``Plan.tp_parts``): each
    rank holds chunk r of every part, so the gathered chunks are regrouped part by part.
    """
    mesh = mesh_lib.current()
    size = mesh.axis_size(axis)
    out = []
    for shard, dim, fused in zip(shards, dims, parts or [None] * len(shards)):
        full = _gather(shard.detach(), axis, size, dim)
        if fused:
            local = [n // size for n in fused]
            by_rank = [chunk.split(local, dim=dim) for chunk in full.chunk(size, dim=dim)]
            full = torch.cat([by_rank[r][i] for i in range(len(local)) for r in range(size)], dim=dim)
        out.append(full)
    return out


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.axis), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, size, dim, grad_mode):
        ctx.axis, ctx.size, ctx.dim, ctx.grad_mode = axis, size, dim, grad_mode
        return _gather(x, axis, size, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_mode == "reduce_scatter":
            return _reduce_scatter(grad, ctx.axis, ctx.size, ctx.dim), None, None, None, None
        return _chunk(grad, ctx.axis, ctx.size, ctx.dim), None, None, None, None


class _ShardingOp(torch.autograd.Function):
    """Shared backward of the ops that leave each rank a shard of ``dim``: all-gather it."""

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.axis, ctx.size, ctx.dim), None, None, None


class _ReduceScatter(_ShardingOp):
    @staticmethod
    def forward(ctx, x, axis, size, dim):
        ctx.axis, ctx.size, ctx.dim = axis, size, dim
        return _reduce_scatter(x, axis, size, dim)


class _Scatter(_ShardingOp):
    @staticmethod
    def forward(ctx, x, axis, size, dim):
        ctx.axis, ctx.size, ctx.dim = axis, size, dim
        return _chunk(x, axis, size, dim)


def tp_copy(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    """Identity; the gradient is all-reduced over ``axis`` (Megatron's f)."""
    if is_fake(x):
        return x.view_as(x)
    return _Copy.apply(x, axis)


def tp_all_reduce(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    """Sum of the partial values over ``axis`` (Partial → Replicate); identity backward."""
    if is_fake(x):
        return x.clone(memory_format=torch.contiguous_format)  # the real all-reduce returns a contiguous copy
    return _AllReduce.apply(x, axis)


def tp_all_gather(x: torch.Tensor, axis: str, size: int, dim: int, grad: str = "slice") -> torch.Tensor:
    """Concatenate the shards of ``dim`` over ``axis`` (Shard(dim) → Replicate)."""
    if grad not in ("slice", "reduce_scatter"):
        raise ValueError(f"tp_all_gather grad must be 'slice' or 'reduce_scatter', got {grad!r}")
    if is_fake(x):
        return _resized(x, dim, size)
    out = _AllGather.apply(x, axis, size, dim, grad)
    if grad == "reduce_scatter" and regather.active():
        # Sequence parallelism's gather before column linears: the linears save their input,
        # which backward gathers again from this rank's shard instead of keeping it whole, as
        # Megatron-LM does (the shard is 1/size of it).
        local = x.detach()
        regather.register((out,), lambda: (_gather(local, axis, size, dim),))
    return out


def tp_reduce_scatter(x: torch.Tensor, axis: str, size: int, dim: int) -> torch.Tensor:
    """Sum the partial values and keep this rank's chunk of ``dim`` (Partial → Shard(dim))."""
    if is_fake(x):
        return _resized(x, dim, 1 / size)
    return _ReduceScatter.apply(x, axis, size, dim)


def tp_scatter(x: torch.Tensor, axis: str, size: int, dim: int) -> torch.Tensor:
    """This rank's chunk of ``dim`` of a replicated tensor (Replicate → Shard(dim), no traffic)."""
    if is_fake(x):
        return _resized(x, dim, 1 / size)
    return _Scatter.apply(x, axis, size, dim)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, ignore_index, mean=True):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        if group is not None:
            rank_progress.enter("vocab_parallel_cross_entropy")
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        in_range = (target >= vocab_start) & (target < vocab_start + vocab_local)
        local_target = torch.where(in_range, target - vocab_start, torch.zeros_like(target))
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(in_range, target_logit, torch.zeros_like(target_logit))
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        valid = target != ignore_index
        count = valid.sum().clamp(min=1) if mean else 1  # a sum: global_loss_mean divides by the step's count
        losses = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(sum_exp))
        ctx.save_for_backward(exp, sum_exp, local_target, in_range, valid)
        ctx.count = count
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        # In place in the saved exp, as Megatron does: the logits' gradient needs no buffer of
        # the logits' size beyond the one forward saved (the graph is not run backward twice).
        return _vocab_parallel_cross_entropy_grad(ctx, grad, in_place=True)


def _vocab_parallel_cross_entropy_grad(ctx, grad: torch.Tensor, in_place: bool) -> tuple[Any, ...]:
    exp, sum_exp, local_target, in_range, valid = ctx.saved_tensors
    softmax = exp.div_(sum_exp.unsqueeze(-1)) if in_place else exp.div(sum_exp.unsqueeze(-1))
    hit = in_range.unsqueeze(-1).to(softmax.dtype)
    softmax.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
    return softmax.mul_(((grad / ctx.count) * valid).unsqueeze(-1)), None, None, None, None, None


class _VocabParallelCrossEntropyAlone(_VocabParallelCrossEntropy):
    """Its one-rank stand-in (`ALONE`): backward out of place, as a profiler runs it repeatedly."""

    @staticmethod
    def backward(ctx, grad):
        return _vocab_parallel_cross_entropy_grad(ctx, grad, in_place=False)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, axis: str, size: int, vocab_start: int, ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy over non-ignored targets from logits sharded on the last (vocab) dim: their
    mean, or with ``reduction="sum"`` their sum.

    Args:
        logits: ``[tokens, vocab / size]``, this rank's vocabulary slice starting at ``vocab_start``.
        target: ``[tokens]`` global class indices.
    """
    if is_fake(logits):
        return logits.new_empty((), dtype=torch.float32)
    out = _VocabParallelCrossEntropy.apply(logits, target, _group(axis), vocab_start, ignore_index,
                                           reduction == "mean")
    return out.to(logits.dtype)


TP_OPS: tuple[Any, ...] = (tp_copy, tp_all_reduce, tp_all_gather, tp_reduce_scatter, tp_scatter, vocab_parallel_cross_entropy)


# ---- each op as one rank runs it with no other rank ----
# A rank's program timed whole in one process (the planner prices a tensor-parallel program by
# running it) needs every op's result, shapes and strides as the real op gives them, without the
# communication. Each stand-in does the op's local work: a gather lays out ``size`` copies, a
# reduce-scatter keeps a contiguous chunk, the vocabulary-parallel loss runs its passes over
# this rank's logits; values do not matter.


def _alone_copy(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    return x.view_as(x)


def _alone_all_reduce(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def _alone_all_gather(x: torch.Tensor, axis: str, size: int, dim: int, grad: str = "slice") -> torch.Tensor:
    return torch.cat([x] * size, dim=dim)


def _alone_chunk(x: torch.Tensor, axis: str, size: int, dim: int) -> torch.Tensor:
    return x.narrow(dim, 0, x.shape[dim] // size).contiguous()


def _alone_vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, axis: str, size: int, vocab_start: int, ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    return _VocabParallelCrossEntropyAlone.apply(logits, target, None, vocab_start, ignore_index,
                                                 reduction == "mean").to(logits.dtype)


#: ``{op: its stand-in}`` for every op of `TP_OPS`: same arguments, this rank's local work only.
ALONE: dict[Any, Any] = {
    tp_copy: _alone_copy,
    tp_all_reduce: _alone_all_reduce,
    tp_all_gather: _alone_all_gather,
    tp_reduce_scatter: _alone_chunk,
    tp_scatter: _alone_chunk,
    vocab_parallel_cross_entropy: _alone_vocab_parallel_cross_entropy,
}
