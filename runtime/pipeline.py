"""Pipeline stages run by ``torch.distributed.pipelining``'s schedules.

Each rank of the ``pp`` axis runs one stage graph (``graphpass.passes.partition_stages``), or
several under an interleaved schedule, each as a ``PipelineStage`` whose send/receive metadata
comes from the stage graph's fake values (no run-time shape inference), and the engine's
schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble) drives their microbatch
forwards and backwards. Zero-bubble splits each backward into the input gradient and, later, the
weight gradient (the engine's ``torch.autograd.grad`` walks); ``graphpass.plan.check_pipeline``
keeps it to stage programs that reduce no gradient inside the graph.
graphpass adds what the engine does not know:

- the step's scaling: each microbatch's loss is a mean over its rows, and the loss the engine
  differentiates is that loss divided by the microbatch count (``scale_grads=False``: one
  scaling, here, never a second one in the engine);
- the gradient collectives inside a stage graph (dp buckets, ZeRO groups) synchronise once per
  step: every forward runs under the step's :class:`~graphpass.runtime.grad_sync.Accumulation`
  and the engine's ``last_backward`` marks the stage's last backward, as the step program does;
- a parameter read by several stages (tied embedding and LM head) has its gradient summed over
  the ranks that hold it, once per step (stages on one rank share the one parameter object, so
  their uses already sum into its ``.grad``);
- the reported loss, the mean over the microbatches, is sent from the last stage to every rank.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from graphpass import meta
from graphpass.mesh import pipeline_rank
from graphpass.runtime.grad_sync import Accumulation, accumulating
from graphpass.runtime.regather import rebuild_saved_tensors

#: The engine's schedule for each of ``graphpass.plan.RUNNING_SCHEDULES`` (which ``Strategy`` and
#: ``Plan`` are checked against before compile gets here).
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble}


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose forwards run under the step's gradient accumulation and whose
    last backward of the step launches the stage's gradient reductions."""

    accumulation: Accumulation | None = None

    def forward_maybe_with_nosync(self, *args, **kwargs):
        self.accumulation.last_backward = False
        with accumulating(self.accumulation), rebuild_saved_tensors():
            return super().forward_maybe_with_nosync(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        self.accumulation.last_backward = last_backward
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


def _example(node: fx.Node, grad: bool) -> torch.Tensor:
    val = node.meta[meta.VAL]
    return torch.empty(val.shape, dtype=val.dtype).requires_grad_(grad)


class PipelineProgram:
    """One rank's stages of a pipeline, run by an engine schedule; one gradient sync per step.

    Args:
        stages: this rank's stage graphs with their indices in the pipeline (one, or several
            under an interleaved schedule: rank ``r`` of ``pp`` runs stages ``r, r + pp, ...``).
        num_stages: the number of stages in the pipeline.
        group: the ``pp`` process group.
        schedule: a key of :data:`SCHEDULES` (checked by ``graphpass.plan.check_pipeline``).
        num_microbatches: microbatches per step.
        loss_index, report_index: the last stage's outputs to differentiate and to report.
        shared: ``(attribute name, group)`` for every parameter this rank shares with other
            ranks of its pipeline (a tied embedding and LM head): its gradient is summed there.
        device: where the stages run.
    """

    def __init__(self, stages: Sequence[tuple[int, fx.GraphModule]], num_stages: int, group: dist.ProcessGroup,
                 schedule: str, num_microbatches: int, loss_index: int, report_index: int,
                 shared: Sequence[tuple[str, dist.ProcessGroup]], device: torch.device):
        self.stage_modules = [module for _, module in stages]
        self.num_microbatches = num_microbatches
        indices = [index for index, _ in stages]
        self.is_first, self.is_last = 0 in indices, num_stages - 1 in indices
        pp = dist.get_world_size(group)
        self.group, self.last_rank = group, dist.get_global_rank(group, pipeline_rank(num_stages - 1, pp))
        self.device = device
        self.shared = list(shared)
        self.loss_index, self.report_index = loss_index, report_index
        self.stages = [self._stage(module, index, num_stages, group, device) for index, module in stages]
        self._reports: list[torch.Tensor] = []
        engine = SCHEDULES[schedule]
        self.schedule = engine(self.stages if issubclass(engine, PipelineScheduleMulti) else self.stages[0],
                               n_microbatches=num_microbatches, loss_fn=self._loss, scale_grads=False)

    @staticmethod
    def _stage(module: fx.GraphModule, index: int, num_stages: int, group: dist.ProcessGroup,
               device: torch.device) -> _Stage:
        inputs = [n for n in module.graph.nodes if n.op == "placeholder"]
        outputs = list(module.graph.find_nodes(op="output")[0].args[0])
        last = index == num_stages - 1
        return _Stage(
            module, index, num_stages, device,
            input_args=tuple(_example(n, bool(n.meta.get(meta.REQUIRES_GRAD))) for n in inputs),
            output_args=tuple(_example(n, not last and bool(n.meta.get(meta.REQUIRES_GRAD))) for n in outputs),
            group=group,
        )

    def _parameter(self, target: str) -> torch.nn.Parameter:
        """The parameter named ``target`` (one object, whichever of this rank's stages reads it)."""
        for module in self.stage_modules:
            try:
                return module.get_parameter(target)
            except AttributeError:
                continue
        raise KeyError(f"no stage on this rank holds {target!r}")

    def _loss(self, outputs, target) -> torch.Tensor:
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        self._reports.append(outputs[self.report_index].detach())
        return outputs[self.loss_index] / self.num_microbatches

    def run(self, local_inputs: Sequence[torch.Tensor], train: bool = True) -> torch.Tensor:
        """Train one step on this pipeline replica's share (given on every rank; only the first
        stage reads it), or with ``train=False`` only run its forwards (the engine's ``eval``,
        without autograd); the mean reported loss, on every rank (detached)."""
        for stage in self.stages:
            stage.accumulation = Accumulation(self.num_microbatches)
        self._reports = []
        args = tuple(local_inputs) if self.is_first else ()
        target = torch.zeros(self.num_microbatches) if self.is_last else None
        if not train:
            with torch.no_grad():
                self.schedule.eval(*args, target=target, return_outputs=False)
            return self._mean_report()
        self.schedule.step(*args, target=target, return_outputs=False)
        for target_name, group in self.shared:
            p = self._parameter(target_name)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
        return self._mean_report()

    def _mean_report(self) -> torch.Tensor:
        """The mean of the microbatches' reported losses (float32), sent from the last stage to
        every rank. It waits for the last stage, so under zero-bubble the first stage's step
        ends with the last stage's deferred weight gradients (a lazily read functional
        broadcast would let it go on, but returns a tensor subclass that f-strings and type
        checks trip on)."""
        loss = (torch.stack(self._reports).mean().float() if self.is_last
                else torch.zeros((), dtype=torch.float32, device=self.device))
        dist.broadcast(loss, self.last_rank, group=self.group)
        return loss


__all__ = ["PipelineProgram", "SCHEDULES"]
