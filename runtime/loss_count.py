"""Each step's count of the targets a mean loss divides by, over the whole batch.

:mod:`graphpass.passes.global_loss_mean` turns a mean loss into a sum over the rank's piece of
the batch divided by a buffer ``G``: the number of counted targets (not ``ignore_index``) in the
step's global batch. Before each step (and each evaluation) :meth:`LossCounts.fill` counts them
on this rank's microbatches with each loss's :class:`~graphpass.passes.global_loss_mean.LossCount`
program and sums the counts over the ranks holding the other shares of the batch (one 0-dim
all-reduce per axis that splits the batch, on the ranks that hold the loss), then writes ``G``.
A rank without such a loss (a pipeline stage before the last) does nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from graphpass import meta
from graphpass.runtime import rank_progress


class LossCounts:
    """The count buffers of one rank's program and how to fill them.

    Args:
        module: the rank's program (or its stages' state: any module whose graph holds the
            buffers' ``get_attr`` nodes with their metadata).
        batch_axes: the mesh axes that split the batch (whose other ranks hold other shares).
        mesh: the process mesh (its groups).
    """

    def __init__(self, module: fx.GraphModule, batch_axes: Sequence[str], mesh):
        self._counts = []
        for node in module.graph.nodes:
            count = node.meta.get(meta.LOSS_COUNT) if node.op == "get_attr" else None
            if count is not None:
                self._counts.append((count, _attr(module, node.target)))
        self._groups = [mesh.group(axis) for axis in batch_axes] if self._counts else []

    def __bool__(self) -> bool:
        return bool(self._counts)

    def fill(self, microbatches: Sequence[Sequence[torch.Tensor]]) -> None:
        """Count the targets of ``microbatches`` (this rank's share) and of the other shares."""
        if not self._counts:
            return
        totals = torch.stack([sum(count.program(*mb) for mb in microbatches) for count, _ in self._counts])
        totals = totals.to(device=self._counts[0][1].device, dtype=torch.float64)
        for group in self._groups:
            rank_progress.enter("all_reduce of the loss's target count")
            dist.all_reduce(totals, group=group)
        with torch.no_grad():
            for (_, buffer), total in zip(self._counts, totals):
                buffer.copy_(total)  # 0 when nothing counts: 0/0, nan, as one process's mean


def _attr(module: torch.nn.Module, target: str) -> torch.Tensor:
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)
