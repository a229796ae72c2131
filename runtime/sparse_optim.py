"""The sparse optimizers of sharded embedding tables: each step updates the rows it touched.

After a step's last backward, every sharded table's shard holds the rows the step read and
their summed gradients (:class:`graphpass.runtime.embeddings.SparseGrad`); :class:`SparseStep`
applies the plan's :class:`graphpass.tables.SparseOptimizer` to those rows alone, with its
state shaped like the shard (so sharded like the table), as FBGEMM's fused optimizers do:

- ``sgd``: ``w[r] -= lr g``;
- ``adagrad``: ``s[r] += g^2; w[r] -= lr g / (sqrt(s[r]) + eps)`` (torch.optim.Adagrad, whose
  sparse and dense forms agree on the touched rows and leave the others unchanged);
- ``rowwise_adagrad``: one state per row, ``s[r] += mean(g^2)`` over the row (FBGEMM's
  ``EXACT_ROWWISE_ADAGRAD``); a column-wise shard holds part of each row, so the ranks add their
  parts' squares (an all-reduce of one number per touched row: every rank touched the same rows,
  it received every id) before taking the mean over the whole row, as one process does (TorchRec
  keeps a state per column shard instead, which trains differently);
- ``lazy_adam``: torch.optim.SparseAdam: the moments of the touched rows only, bias-corrected
  by the number of steps the table has taken.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch
import torch.distributed as dist

from graphpass.tables import SparseOptimizer
from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime.embeddings import sparse_grad
from graphpass.runtime.layout import HeldPieces

#: the checkpoint keys of the sparse optimizer's state: ``sparse.<table key>.<state>`` (laid out as
#: the table, or one value per row), and ``sparse.steps``
SPARSE = "sparse."


class SparseStep:
    """The plan's sparse optimizer over this rank's table shards.

    Args:
        optimizer: the plan's :class:`SparseOptimizer`.
        shards: this rank's table shards, by attribute target.
        columns: for column-wise shards, by target: the mesh axis they are cut over and the
            table's whole width.
    """

    def __init__(self, optimizer: SparseOptimizer, shards: dict[str, torch.Tensor],
                 columns: dict[str, tuple[str, int]] | None = None):
        self.optimizer = optimizer
        self.shards = shards
        self.columns = dict(columns or {})
        self.state: dict[str, dict[str, torch.Tensor]] = {target: self._new_state(t) for target, t in shards.items()}
        self.steps = 0

    def _new_state(self, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        kind = self.optimizer.kind
        if kind == "adagrad":
            return {"sum": torch.zeros_like(shard)}
        if kind == "rowwise_adagrad":
            return {"sum": shard.new_zeros(shard.shape[0])}
        if kind == "lazy_adam":
            return {"exp_avg": torch.zeros_like(shard), "exp_avg_sq": torch.zeros_like(shard)}
        return {}

    def step(self) -> None:
        """Apply the step's row gradients of every shard (a shard no id reached: nothing)."""
        self.steps += 1
        self.apply()

    @torch.no_grad()
    def apply(self) -> None:
        """Apply the row gradients the shards hold now, without counting a step (a cache's
        flush: :func:`graphpass.runtime.row_cache.push`)."""
        for target, shard in self.shards.items():
            grads = sparse_grad(shard)
            if not grads:
                continue
            rows, g = grads.take()
            self._update(shard, self.state[target], rows, g.to(shard.dtype), self.columns.get(target))

    def _update(self, w: torch.Tensor, state: dict[str, torch.Tensor], rows: torch.Tensor, g: torch.Tensor,
                columns: tuple[str, int] | None) -> None:
        opt = self.optimizer
        if opt.kind == "sgd":
            w.index_add_(0, rows, g, alpha=-opt.lr)
        elif opt.kind == "adagrad":
            s = state["sum"]
            s.index_add_(0, rows, g * g)
            w.index_add_(0, rows, g / (s[rows].sqrt() + opt.eps), alpha=-opt.lr)
        elif opt.kind == "rowwise_adagrad":
            s = state["sum"]
            squares = (g * g).sum(1)
            width = g.shape[1]
            if columns is not None:  # the other columns' squares, from the ranks holding them
                axis, width = columns
                group = mesh_lib.current().group(axis)
                if group is not None:
                    dist.all_reduce(squares, group=group)
            s.index_add_(0, rows, squares / width)
            w.index_add_(0, rows, g / (s[rows].sqrt() + opt.eps).unsqueeze(1), alpha=-opt.lr)
        else:  # lazy_adam: torch.optim.SparseAdam's update, on the touched rows
            beta1, beta2 = opt.betas
            m, v = state["exp_avg"], state["exp_avg_sq"]
            old_m, old_v = m[rows], v[rows]
            m_update = (g - old_m) * (1 - beta1)
            v_update = (g * g - old_v) * (1 - beta2)
            m.index_add_(0, rows, m_update)
            v.index_add_(0, rows, v_update)
            numer = m_update + old_m
            denom = (v_update + old_v).sqrt() + opt.eps
            step_size = opt.lr * math.sqrt(1 - beta2 ** self.steps) / (1 - beta1 ** self.steps)
            w.index_add_(0, rows, numer / denom, alpha=-step_size)

    def checkpoint_entries(self, layouts: Mapping[str, HeldPieces]
                           ) -> tuple[dict[str, list[tuple[HeldPieces, torch.Tensor]]], dict[str, torch.Tensor]]:
        """The state as a checkpoint holds it (:mod:`graphpass.runtime.checkpoint`), given each
        shard's layout by target: per-element states laid out as their table, per-row states as
        its rows, and the step count; a load reads into these same tensors."""
        pieces: dict[str, list[tuple[HeldPieces, torch.Tensor]]] = {}
        for target, state in self.state.items():
            layout = layouts[target]
            for name, value in state.items():
                pieces[f"{SPARSE}{layout.key}.{name}"] = [(layout if value.dim() == 2 else _rows(layout), value)]
        self._steps = torch.tensor(self.steps, dtype=torch.long)
        return pieces, {f"{SPARSE}steps": self._steps}

    def loaded(self) -> None:
        """Take the step count a checkpoint load wrote into :meth:`checkpoint_entries`' tensor."""
        self.steps = int(self._steps)


def _rows(layout: HeldPieces) -> HeldPieces:
    """The layout of one value per row of a table of ``layout`` (each piece's rows once)."""
    pieces = {(piece.offsets[0], piece.index[0].start, piece.index[0].stop): piece for piece in layout.pieces}
    rows = [dataclasses.replace(p, offsets=(p.offsets[0],), index=(p.index[0],)) for p in pieces.values()]
    return HeldPieces(layout.key, layout.shape[:1], layout.local[:1], tuple(rows))
