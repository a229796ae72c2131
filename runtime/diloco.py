"""DiLoCo's outer step (:mod:`graphpass.diloco`): every ``H`` steps of the user's optimizer,
average the workers' parameter deltas and take one Nesterov step from the shared start.

The compiled program has no gradient buckets under DiLoCo (``insert_collectives``), so the user's
optimizer steps each rank's own copy on its share of the batch. An optimizer step post-hook
counts the steps of any optimizer holding these parameters; on every ``H``-th it runs the outer
step: one all-reduce of ``start - theta`` (flat, averaged over dp), torch's ``SGD(nesterov=True)``
stepping the shared start with it as gradient, and the start copied back into every parameter.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist

from graphpass.diloco import DiLoCo
from graphpass.runtime import rank_progress


class OuterSync:
    """One compiled program's DiLoCo state: the shared start of its parameters, the outer
    optimizer on it, and the inner steps taken since the last outer step."""

    def __init__(self, params: Sequence[torch.nn.Parameter], diloco: DiLoCo, group: Any, link_emulator: Any = None):
        self.params = [p for p in params if p.requires_grad]
        self.diloco, self.group, self.link_emulator = diloco, group, link_emulator
        with torch.no_grad():
            self.start = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer = torch.optim.SGD(self.start, lr=diloco.outer_lr, momentum=diloco.outer_momentum,
                                     nesterov=diloco.outer_momentum > 0)
        self.inner_steps = 0
        self.outer_steps = 0
        self._ids = {id(p) for p in self.params}
        _SYNCS.add(self)
        _install_hook()

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"])

    def after_inner_step(self) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.diloco.inner_steps == 0:
            self.step()

    @torch.no_grad()
    def step(self) -> None:
        """The outer step (every rank calls it: one all-reduce over dp)."""
        deltas = torch.cat([(s - p).reshape(-1) for s, p in zip(self.start, self.params)])
        if self.group is not None:
            rank_progress.enter("DiLoCo outer all_reduce", self.outer_steps)
            with self.link_emulator.active() if self.link_emulator is not None else contextlib.nullcontext():
                dist.all_reduce(deltas, group=self.group)
            deltas /= dist.get_world_size(self.group)
        offset = 0
        for s in self.start:
            s.grad = deltas[offset : offset + s.numel()].view_as(s)
            offset += s.numel()
        self.outer.step()
        for s, p in zip(self.start, self.params):
            s.grad = None
            p.copy_(s)
        self.outer_steps += 1

    @property
    def pending(self) -> int:
        """Inner steps taken since the last outer step (the workers' copies differ meanwhile)."""
        return self.inner_steps % self.diloco.inner_steps


_SYNCS: "weakref.WeakSet[OuterSync]" = weakref.WeakSet()
_HOOK: Any = None


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for sync in list(_SYNCS):
        if sync.holds(optimizer):
            sync.after_inner_step()


def _install_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


__all__ = ["OuterSync"]
