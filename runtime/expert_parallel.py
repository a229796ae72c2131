"""Expert parallelism's token exchange: rows sorted by expert go to the ranks that hold their
experts, and come back.

A Mixture-of-Experts layer (:mod:`graphpass.nn.moe`, Hugging Face's Mixtral / Qwen2-MoE) sorts
its routed rows by expert and multiplies each expert's rows by that expert's weights
(``grouped_mm(rows, weight, offs)``, ``offs`` the running row counts). With the experts sharded
over an ``ep`` group of ``n`` ranks (rank ``j`` holds experts ``j E/n .. (j+1) E/n - 1``), the
rows of one rank's experts are contiguous in that order, so:

- :func:`ep_dispatch` first exchanges the per-expert row counts (an all-to-all of ``E`` integers
  per rank, without gradient), then the rows themselves (an all-to-all with uneven splits: to
  rank ``j`` the rows of its experts), and orders what it received expert-major (all sources'
  rows of local expert 0, then of local expert 1, ...), returning the local offsets for
  ``grouped_mm`` over the local experts' weights;
- :func:`ep_combine` undoes it: back to source-major order, and the reverse all-to-all.

Both are autograd functions whose backward is the same exchange with the splits swapped
(Megatron-Core's and torchtitan's form). How many rows a rank receives is data: under fake
tensors both ops return the balanced expectation (as many rows as were sent), which is what the
cost model prices; the real ops return what routing decided.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime.fake import is_fake


class _Exchange(torch.autograd.Function):
    """All-to-all of rows with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """:class:`_Exchange` over ``group``; the rows themselves on a group of one rank (None)."""
    return rows if group is None else _Exchange.apply(rows, send, recv, group)


def _expert_major(recv_counts: torch.Tensor) -> torch.Tensor:
    """The permutation that orders received rows (source-major: source ``s``'s rows of local
    expert 0, 1, ...) expert-major; ``recv_counts`` is ``[n sources, E local]``."""
    n, local = recv_counts.shape
    starts = torch.cat([recv_counts.new_zeros(1), recv_counts.reshape(-1).cumsum(0)[:-1]]).reshape(n, local)
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + recv_counts[s, e]))
              for e in range(local) for s in range(n)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def ep_dispatch(rows: torch.Tensor, offs: torch.Tensor, axis: str, size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send ``rows`` (sorted by expert, ``offs`` the running counts over all ``E`` experts) to
    the ranks of ``axis`` (``size`` of them) that hold their experts.

    Returns:
        ``(local_rows, local_offs, splits)``: the rows of this rank's ``E/size`` experts from
        every rank, expert-major; the running counts over the local experts (for ``grouped_mm``
        with the local expert weights); and the ``[2, size, E/size]`` counts sent to and
        received from each rank per local expert (what :func:`ep_combine` sends back by).
    """
    num_experts = offs.shape[0]
    if num_experts % size:
        raise ValueError(f"ep_dispatch: {num_experts} experts do not divide over the {size} ranks of axis {axis!r}")
    local = num_experts // size
    if is_fake(rows):
        return rows.new_empty(rows.shape), offs.new_empty(local), offs.new_empty(2, size, local)
    group = mesh_lib.current().group(axis)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    recv_counts = counts.clone()
    if group is not None:
        dist.all_to_all_single(recv_counts, counts, group=group)
    splits = torch.stack([counts.reshape(size, local), recv_counts.reshape(size, local)])
    kept = int(offs[-1])  # rows past the last offset (a capacity's dropped ones) stay home
    sent = _exchange(rows[:kept], splits[0].sum(1).tolist(), splits[1].sum(1).tolist(), group)
    order = _expert_major(splits[1])
    return sent[order], splits[1].sum(0).cumsum(0), splits


def ep_combine(local_out: torch.Tensor, splits: torch.Tensor, num_rows: int, axis: str) -> torch.Tensor:
    """Send the local experts' results (``local_out``, expert-major as :func:`ep_dispatch` gave
    the rows) back to the ranks the rows came from, in their sorted order: ``num_rows`` rows,
    those that were not sent (dropped) zero."""
    if is_fake(local_out):
        return local_out.new_empty(num_rows, *local_out.shape[1:])
    group = mesh_lib.current().group(axis)
    order = _expert_major(splits[1])
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    # the reverse of dispatch's exchange: send what was received, receive what was sent
    home = _exchange(local_out[back], splits[1].sum(1).tolist(), splits[0].sum(1).tolist(), group)
    if home.shape[0] == num_rows:
        return home
    return torch.cat([home, home.new_zeros(num_rows - home.shape[0], *home.shape[1:])])


__all__ = ["ep_dispatch", "ep_combine"]
