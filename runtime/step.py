"""The training step as a program: a schedule of microbatch forwards and backwards.

``DistributedModule.train_step`` cuts this rank's share of the batch into the plan's
microbatches and runs a :class:`StepProgram`: a list of :class:`Action` (forward or backward of
microbatch ``i`` on stage program ``s``) over one or more stage programs (one today; a
pipeline gives each rank several). Replicated gradients are synchronised once per step and
stage program: each program runs under one :class:`~graphpass.runtime.grad_sync.Accumulation`
for the whole step, and the program marks the backward that is that stage's last, whose
reductions are launched while it runs (overlapped, as DDP's last bucket is); ZeRO-2/3 groups
reduce-scatter every backward (see :mod:`graphpass.runtime.grad_sync` for why).

The loss of each microbatch is a mean over its rows, so each backward is scaled by
``1 / num_microbatches`` and the step's gradient is that of the mean over the whole batch,
equal to one process on the whole batch (rows split evenly). That 1/k factor lives here only:
no other part of graphpass divides by the microbatch count. The reported (dp-averaged) losses
are all-reduced asynchronously and finished when the step ends.

Accumulation (one stage, ``k`` microbatches) runs ``F0 B0 F1 B1 ...``, so one microbatch's
activations are alive at a time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from graphpass.runtime import rank_progress
from graphpass.runtime.grad_sync import Accumulation, accumulating
from graphpass.runtime.regather import rebuild_saved_tensors

FORWARD, BACKWARD = "forward", "backward"

# Reported values (the dp-averaged loss) whose all-reduce was launched asynchronously during the
# step: (work, tensor, divisor). Nothing reads them before the step ends, so their latency hides
# behind the backward instead of stalling the forward.
_DEFERRED: list[list[tuple[Any, Any, int]]] = []


@contextlib.contextmanager
def _deferring_reports() -> Iterator[None]:
    _DEFERRED.append([])
    try:
        yield
    except BaseException:
        _DEFERRED.pop()  # a failed step's reports are never read: do not wait on a peer that may be gone
        raise
    for work, tensor, divisor in _DEFERRED.pop():
        work.wait()
        if divisor != 1:
            tensor.div_(divisor)


def reports_deferred() -> bool:
    """Whether a step program runs that finishes reported all-reduces at its end."""
    return bool(_DEFERRED)


def defer_report(work: Any, tensor: Any, divisor: int) -> None:
    """Let the running step (see :func:`reports_deferred`) finish a reported value's all-reduce
    at its end, then divide it by ``divisor``."""
    _DEFERRED[-1].append((work, tensor, divisor))


@dataclass(frozen=True)
class Action:
    """One step of a schedule: ``kind`` (forward/backward) of ``microbatch`` on ``stage``."""

    kind: str
    microbatch: int
    stage: int = 0


def accumulation_schedule(num_microbatches: int) -> tuple[Action, ...]:
    """Forward then backward of each microbatch in turn, on one stage program."""
    return tuple(a for i in range(num_microbatches) for a in (Action(FORWARD, i), Action(BACKWARD, i)))


class StepProgram:
    """Runs a schedule of forwards and backwards over stage programs; one gradient sync per step.

    Args:
        stages: the stage programs this rank runs, each ``program(*inputs) -> outputs tuple``.
        loss_index: which output is the loss to differentiate.
        report_index: which output is the loss to report (the global average of a microbatch).
        schedule: the actions, in order; every microbatch's forward comes before its backward.
    """

    def __init__(self, stages: Sequence[Callable], loss_index: int, report_index: int,
                 schedule: Sequence[Action]):
        self.stages = tuple(stages)
        self.loss_index, self.report_index = loss_index, report_index
        self.schedule = tuple(schedule)
        self.num_microbatches = 1 + max(a.microbatch for a in self.schedule)
        self.steps_run = 0  # steps started: a collective that times out names the step it was in
        self._last_backward = {}
        for position, action in enumerate(self.schedule):
            if action.kind == BACKWARD:
                self._last_backward[action.stage] = position
        seen: set[tuple[int, int]] = set()
        for action in self.schedule:
            key = (action.stage, action.microbatch)
            if action.kind == FORWARD:
                seen.add(key)
            elif key not in seen:
                raise ValueError(f"schedule runs the backward of microbatch {action.microbatch} on stage "
                                 f"{action.stage} before its forward")

    def run(self, microbatches: Sequence[Sequence[torch.Tensor]],
            before: Callable[[], None] | None = None) -> torch.Tensor:
        """Train on ``microbatches`` (inputs of each); the mean reported loss (detached).
        ``before()`` runs first, inside the step (its collectives are watched as the step's).

        Gradients end in ``.grad`` of every parameter, synchronised.
        """
        if len(microbatches) != self.num_microbatches:
            raise ValueError(f"the schedule has {self.num_microbatches} microbatches, got {len(microbatches)}")
        accumulations = [Accumulation(self.num_microbatches) for _ in self.stages]
        losses: dict[tuple[int, int], torch.Tensor] = {}
        reports: list[torch.Tensor] = []
        weight = 1.0 / self.num_microbatches
        self.steps_run += 1
        with rank_progress.watching(self.steps_run), _deferring_reports():
            if before is not None:
                before()
            self._run(accumulations, losses, reports, weight, microbatches)
        return torch.stack(reports).mean() if len(reports) > 1 else reports[0]

    def _run(self, accumulations, losses, reports, weight, microbatches) -> None:
        for position, action in enumerate(self.schedule):
            accumulation = accumulations[action.stage]
            key = (action.stage, action.microbatch)
            if action.kind == FORWARD:
                accumulation.last_backward = False  # a forward's GradSync reads it only in backward
                with accumulating(accumulation), rebuild_saved_tensors():  # ZeRO-3, SP re-gather in backward
                    outputs = self.stages[action.stage](*microbatches[action.microbatch])
                losses[key] = outputs[self.loss_index]
                reports.append(outputs[self.report_index].detach())
            else:
                accumulation.last_backward = position == self._last_backward[action.stage]
                loss = losses.pop(key)
                loss.backward(torch.full_like(loss, weight) if weight != 1.0 else None)
