"""DiLoCo's outer step (:mod:`graphpass.diloco`): every ``H`` steps of the user's optimizer,
average the workers' parameter deltas and take one Nesterov step from the shared start.

The compiled program has no gradient buckets under DiLoCo (``insert_collectives``), so the user's
optimizer steps each rank's own copy on its share of the batch. After every ``H`` train steps the
outer step runs (at the next ``train_step``'s start, or ``gp.save``): one all-reduce of
``start - theta`` (flat in float32, averaged over dp), torch's ``SGD(nesterov=True)`` stepping the
shared start with it as gradient, and the start copied back into every parameter.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from graphpass.diloco import DiLoCo
from graphpass.runtime import rank_progress


class OuterSync:
    """One compiled program's DiLoCo state: the shared start of its parameters, the outer
    optimizer on it, and the inner steps (``train_step`` calls) taken since the last outer step.

    The outer step is due after every ``inner_steps`` train steps and runs at the start of the
    next one (:meth:`before_step`) or when :meth:`flush` asks, e.g. ``gp.save``: counting train
    steps, which every rank takes alike, keeps the ranks' outer all-reduces paired even where one
    rank's optimizer skips a step (a gradient scaler's inf check is per rank here: no gradient is
    shared).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], diloco: DiLoCo, group: Any, link_emulator: Any = None):
        self.params = [p for p in params if p.requires_grad]
        self.diloco, self.group, self.link_emulator = diloco, group, link_emulator
        self.reset()

    def reset(self) -> None:
        """Start from the parameters as they are now (after a compile or a ``gp.load``): a new
        shared start, no outer momentum, no inner step taken."""
        with torch.no_grad():
            self.start = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer = torch.optim.SGD(self.start, lr=self.diloco.outer_lr, momentum=self.diloco.outer_momentum,
                                     nesterov=self.diloco.outer_momentum > 0)
        self.inner_steps = 0
        self.outer_steps = 0
        self._synced_at = 0

    @property
    def pending(self) -> int:
        """Inner steps taken since the last outer step (the workers' copies differ meanwhile)."""
        return self.inner_steps - self._synced_at

    def before_step(self) -> None:
        """Called by ``train_step`` first: the outer step if one is due."""
        self.flush()

    def after_step(self) -> None:
        """Called by ``train_step`` last: one more inner step."""
        self.inner_steps += 1

    def flush(self) -> None:
        """The outer step now if ``inner_steps`` train steps have passed since the last (every
        rank calls it at the same point: one all-reduce over dp)."""
        if self.pending and self.pending % self.diloco.inner_steps == 0:
            self.step()

    @torch.no_grad()
    def step(self) -> None:
        """The outer step: ``Delta = start - mean(theta)``, Nesterov SGD on the start, copied back."""
        deltas = torch.cat([(s - p).reshape(-1).float() for s, p in zip(self.start, self.params)])
        if self.group is not None:
            rank_progress.enter("DiLoCo outer all_reduce", self.outer_steps)
            with self.link_emulator.active() if self.link_emulator is not None else contextlib.nullcontext():
                dist.all_reduce(deltas, group=self.group)
            deltas /= dist.get_world_size(self.group)
        offset = 0
        for s in self.start:
            s.grad = deltas[offset : offset + s.numel()].view_as(s).to(s.dtype)
            offset += s.numel()
        self.outer.step()
        for s, p in zip(self.start, self.params):
            s.grad = None
            p.copy_(s)
        self.outer_steps += 1
        self._synced_at = self.inner_steps


__all__ = ["OuterSync"]
