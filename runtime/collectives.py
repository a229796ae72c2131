"""Every collective op that appears as a ``call_function`` node in compiled graphs.

Each op is an ordinary Python function (so ``torch.fx`` prints and runs it) wrapping an
``autograd.Function`` that carries its own backward. Ops take the mesh *axis name*; the process
group comes from the active :class:`~graphpass.runtime.mesh.ProcessMesh`. Only
``graphpass.passes.collectives`` (the one emitter) inserts these ops into graphs.

Every op is fake-tensor safe (:mod:`graphpass.runtime.fake`): under ``FakeTensorMode`` (shape
propagation, planning) it returns results of the real op's shape, dtype and strides without
communicating.

The ops live with the idea they implement: gradient synchronisation in
:mod:`~graphpass.runtime.grad_sync`, ZeRO in :mod:`~graphpass.runtime.zero`, Megatron's pairs in
:mod:`~graphpass.runtime.tensor_parallel`, the experts' token exchange in
:mod:`~graphpass.runtime.expert_parallel`, sharded embedding tables' lookups in
:mod:`~graphpass.runtime.embeddings`; this module only adds the reported-loss all-reduce and
lists them all.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime import step
from graphpass.runtime.fake import is_fake
from graphpass.runtime.expert_parallel import EP_OPS, ep_combine, ep_counts, ep_dispatch
from graphpass.runtime.embeddings import TABLE_OPS, table_combine, table_counts, table_dispatch, table_replicated
from graphpass.runtime.row_cache import table_cached
from graphpass.runtime.compressed_sync import all_reduce_grads_int8, all_reduce_grads_powersgd
from graphpass.runtime.grad_sync import all_reduce_grads, grad_sync_begin
from graphpass.runtime.tensor_parallel import (
    TP_OPS,
    tp_all_gather,
    tp_all_reduce,
    tp_copy,
    tp_reduce_scatter,
    tp_scatter,
    vocab_parallel_cross_entropy,
)
from graphpass.runtime.zero import all_gather_params


def all_reduce(tensor: torch.Tensor, axis: str, op: str = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` over ``axis`` without a gradient path (``op``: ``"sum"`` or ``"avg"``).

    Used for values that are reported, not differentiated (the global-batch loss). Inside a
    training step the all-reduce is asynchronous and the step program waits for it at the end
    of the step, so the value must not be read before ``train_step`` returns.
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"all_reduce op must be 'sum' or 'avg', got {op!r}")
    out = tensor.detach().clone()
    if is_fake(tensor):
        return out
    mesh = mesh_lib.current()
    group = mesh.group(axis)
    if group is None:
        return out
    divisor = mesh.axis_size(axis) if op == "avg" else 1
    if step.reports_deferred():  # finished when the step ends, overlapped with its backward
        step.defer_report(dist.all_reduce(out, group=group, async_op=True), out, divisor)
        return out
    dist.all_reduce(out, group=group)
    if divisor != 1:
        out /= divisor
    return out


#: Every op the emitter may insert; a test checks that no other function creates collective nodes.
COLLECTIVE_OPS: Sequence[Any] = (grad_sync_begin, all_reduce_grads, all_reduce_grads_int8, all_reduce_grads_powersgd,
                                 all_reduce, all_gather_params, *TP_OPS, *EP_OPS,
                                 *TABLE_OPS, table_cached)

__all__ = [
    "COLLECTIVE_OPS",
    "all_gather_params",
    "all_reduce",
    "all_reduce_grads",
    "all_reduce_grads_int8",
    "all_reduce_grads_powersgd",
    "ep_combine",
    "ep_counts",
    "ep_dispatch",
    "grad_sync_begin",
    "table_cached",
    "table_combine",
    "table_counts",
    "table_dispatch",
    "table_replicated",
    "tp_all_gather",
    "tp_all_reduce",
    "tp_copy",
    "tp_reduce_scatter",
    "tp_scatter",
    "vocab_parallel_cross_entropy",
]
