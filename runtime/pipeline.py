"""Pipeline stages run by ``torch.distributed.pipelining``'s schedules.

Each rank of the ``pp`` axis runs one stage graph (``graphpass.passes.partition_stages``), or
several under an interleaved schedule, each as a ``PipelineStage`` whose send/receive metadata
comes from the stage graph's fake values (no run-time shape inference), and the engine's
schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble) drives their microbatch
forwards and backwards. Zero-bubble splits each backward into the input gradient and, later, the
weight gradient; ``graphpass.plan.check_pipeline`` keeps it to stage programs that reduce no
gradient inside the graph. graphpass adds what the engine does not know:

- the step's scaling: each microbatch's loss is a mean over its rows, and the loss the engine
  differentiates is that loss divided by the microbatch count (``scale_grads=False``: one
  scaling, here, never a second one in the engine);
- the gradient collectives inside a stage graph (dp buckets, ZeRO groups) synchronise once per
  step: every forward runs under the step's :class:`~graphpass.runtime.grad_sync.Accumulation`
  and the engine's ``last_backward`` marks the stage's last backward, as the step program does;
- a parameter read by several stages (tied embedding and LM head) has its gradient summed over
  the ranks that hold it, once per step (stages on one rank share the one parameter object, so
  their uses already sum into its ``.grad``);
- the reported loss, the mean over the microbatches, is sent from the last stage to every rank;
- the split backward itself (:func:`split_backward_input`, :func:`split_backward_weight`): the
  engine's own (``torch.distributed.pipelining._backward``) leaves out a parameter whose every
  use reaches the stage's outputs without meeting a received activation (an encoder-decoder's
  decoder embedding: a lookup of the weight by label ids, sent on as it is); walks a group read
  at several depths (T5's position bias) through nodes other groups' walks freed, and a
  parameter in two merged groups twice (``Trying to backward through the graph a second
  time``); and detaches in place stage outputs that an op saved for its weight gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from graphpass import meta
from graphpass.mesh import pipeline_rank
from graphpass.runtime import rank_progress
from graphpass.runtime.grad_sync import Accumulation, accumulating
from graphpass.runtime.regather import rebuild_saved_tensors

#: The engine's schedule for each of ``graphpass.plan.RUNNING_SCHEDULES`` (which ``Strategy`` and
#: ``Plan`` are checked against before compile gets here).
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble}


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose forwards run under the step's gradient accumulation, whose
    last backward of the step launches the stage's gradient reductions, whose split backward
    (zero-bubble) is :func:`split_backward_input` / :func:`split_backward_weight`, and whose
    sends are contiguous (a stage may return a transposed value, and autograd may give an input
    a transposed gradient: ``send`` takes neither)."""

    accumulation: Accumulation | None = None

    def forward_maybe_with_nosync(self, *args, **kwargs):
        self.accumulation.last_backward = False
        with accumulating(self.accumulation), rebuild_saved_tensors():
            out = super().forward_maybe_with_nosync(*args, **kwargs)
        if self.is_last:
            return out
        return tuple(_contiguous(o) for o in out) if isinstance(out, tuple) else _contiguous(out)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        self.accumulation.last_backward = last_backward
        if backward_type == "input":  # zero-bubble's split backward, graphpass's own (module docstring)
            outputs = bwd_kwargs["stage_output"]
            outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
            grads, state = split_backward_input(outputs, bwd_kwargs["output_grads"], bwd_kwargs["input_values"],
                                                self.submod.parameters())
            # The engine holds what it passed in until the weight pass, which needs none of the graph
            # above the boundaries: it keeps detached outputs. The last stage's loss is also the
            # schedule's (to the step's end) and nothing saved it: it is detached in place. (Not
            # the other outputs: an op of the stage may have saved one for its weight gradient.)
            if self.is_last:
                for o in outputs:
                    if isinstance(o, torch.Tensor) and not o._is_view():
                        o.detach_()
            else:
                bwd_kwargs["stage_output"] = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
        elif backward_type == "weight":
            split_backward_weight(bwd_kwargs["param_groups"])
            return (), None
        else:
            grads, state = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        return tuple(_contiguous(g) for g in grads), state


def _contiguous(value):
    return value.contiguous() if isinstance(value, torch.Tensor) else value


# ------------------------------------------------------------------------ the split backward


def _node_of(t: torch.Tensor) -> Node:
    """The autograd node that takes ``t``'s gradient: its ``grad_fn``, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's accumulator exists once a view asks for it


@dataclasses.dataclass
class WeightGroup:
    """Parameters whose weight gradients one autograd walk computes, and where it starts.

    Attributes:
        weights: the parameters.
        boundaries: the nodes where the parameters' uses first meet a received activation (ops
            whose input gradient the input pass computed anyway: a linear's matmul, an add); the
            input pass keeps the gradient of their outputs.
        seeds: ``(edge, gradient)`` of each stage output computed from the parameters alone (a
            lookup of an embedding by integer ids, sent on as it is): its gradient is the one
            the next stage sent back.
    """

    weights: list[torch.Tensor]
    boundaries: list[Node] = dataclasses.field(default_factory=list)
    seeds: list[tuple[GradientEdge, torch.Tensor]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class WeightBackward:
    """What one microbatch's input pass leaves for its weight pass: the groups, the gradient of
    every boundary's outputs, and (only where a boundary is a Python autograd Function, whose
    node the graph owns) the stage outputs that keep the graph alive."""

    groups: list[WeightGroup]
    grads: dict[Node, tuple[torch.Tensor | None, ...]]
    keep: tuple[torch.Tensor, ...] = ()


def _weight_groups(roots: Sequence[Node], inputs: Iterable[Node], weights: Sequence[torch.Tensor]
                   ) -> tuple[list[WeightGroup], dict[Node, WeightGroup]]:
    """Group ``weights`` by the part of the autograd graph (below ``roots``) that leads from them
    to the nodes fed by ``inputs``; also the group of every node on a weight's side.

    A weight's side is every node it feeds before one that an input also feeds (a boundary);
    two weights whose sides or boundaries meet are in one group, the groups' sides are
    disjoint, so no node's weight-side backward runs twice. A weight no root reaches is in no
    group (it gets no gradient, as under a whole backward).
    """
    consumers: dict[Node, list[Node]] = {}
    todo = [r for r in dict.fromkeys(roots) if r is not None]
    for r in todo:
        consumers.setdefault(r, [])
    while todo:
        node = todo.pop()
        for fn, _ in node.next_functions:
            if fn is None:
                continue
            if fn not in consumers:
                consumers[fn] = []
                todo.append(fn)
            consumers[fn].append(node)
    closure = {n for n in inputs if n in consumers}
    todo = list(closure)
    while todo:
        for user in consumers[todo.pop()]:
            if user not in closure:
                closure.add(user)
                todo.append(user)

    parent = list(range(len(weights)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    starts = [_node_of(w) for w in weights]
    owner: dict[Node, int] = {}  # a weight-side node (or a boundary) -> a weight that reaches it
    for i, start in enumerate(starts):
        if start not in consumers:
            continue
        owner[start] = i
        todo = [start]
        while todo:
            for user in consumers[todo.pop()]:
                if user in owner:  # reached before: its group's side goes on from there
                    parent[find(i)] = find(owner[user])
                elif user in closure:
                    owner[user] = i
                else:
                    owner[user] = i
                    todo.append(user)
    groups: dict[int, WeightGroup] = {}
    for i, weight in enumerate(weights):
        if starts[i] in owner:
            groups.setdefault(find(i), WeightGroup([])).weights.append(weight)
    side: dict[Node, WeightGroup] = {}
    for node, i in owner.items():
        if node in closure:
            groups[find(i)].boundaries.append(node)
        else:
            side[node] = groups[find(i)]
    return list(groups.values()), side


def split_backward_input(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None] | None,
                         inputs: Sequence[object], weights: Iterable[torch.Tensor]
                         ) -> tuple[tuple[torch.Tensor | None, ...], WeightBackward]:
    """The input gradients of a stage (what the previous stage waits for), and what the weight
    pass needs: the gradient of each boundary between the weights' side of the autograd graph
    and the inputs' side, kept as the input gradients' walk goes through it.

    Args:
        outputs: the stage's outputs (the loss on the last stage).
        output_grads: their gradients from the next stage (None on the last stage: ones).
        inputs: the stage's inputs (received activations; those requiring grad get one).
        weights: the stage's parameters.

    Returns:
        One gradient (or None) per input, and the :class:`WeightBackward` for
        :func:`split_backward_weight`.
    """
    live = [(o, torch.ones_like(o) if output_grads is None else output_grads[i]) for i, o in enumerate(outputs)
            if isinstance(o, torch.Tensor) and o.requires_grad]
    live = [(o, g) for o, g in live if g is not None]
    wanted = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    edges = [get_gradient_edge(o) for o, _ in live]
    groups, side = _weight_groups([e.node for e in edges], [_node_of(inputs[i]) for i in wanted],
                                  [w for w in weights if w.requires_grad])
    for edge, (_, grad) in zip(edges, live):
        if edge.node in side:  # an output of the weights alone: the next stage's gradient seeds it
            side[edge.node].seeds.append((edge, grad))
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def recording(node: Node):
        def hook(grad_outputs):
            grads[node] = tuple(grad_outputs)
        return hook

    handles = [b.register_prehook(recording(b)) for g in groups for b in g.boundaries]
    try:
        dinputs: list[torch.Tensor | None] = [None] * len(inputs)
        if live and wanted:
            got = torch.autograd.grad([o for o, _ in live], [inputs[i] for i in wanted], [g for _, g in live],
                                      retain_graph=True, allow_unused=True)
            for i, grad in zip(wanted, got):
                dinputs[i] = grad
    finally:
        for handle in handles:
            handle.remove()
    for x, grad in zip(inputs, dinputs):
        if grad is not None:  # as the engine's whole backward leaves it
            x.grad = grad if x.grad is None else x.grad + grad
    # The boundaries keep the graph below them alive for the weight pass, but a Python Function's
    # node is owned by its consumers: then the outputs keep it (and the graph above it).
    owned = any(isinstance(b, torch._C._FunctionBase) for g in groups for b in g.boundaries)
    kept = tuple(o for o, _ in live) if owned else ()
    return tuple(dinputs), WeightBackward(groups, grads, kept)


def split_backward_weight(state: WeightBackward) -> None:
    """Add each group's weight gradients to the weights' ``.grad``: one autograd walk per group
    from its boundaries (with the gradients the input pass kept) and its seeds.

    Where a group's boundaries lie one below another (a weight read at two depths: a tied
    embedding and head, a position bias every layer adds), the walk from the upper one reaches
    the lower one through the inputs' side; each boundary's gradient is pinned to the one the
    input pass kept, so nothing is counted twice, and the walks keep the graph (they may pass
    the same nodes) until the state is dropped after the last group.
    """
    for group in state.groups:
        edges, grads = [], []
        for node in group.boundaries:
            for nr, grad in enumerate(state.grads.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, nr))
                    grads.append(grad)
        for edge, grad in group.seeds:
            edges.append(edge)
            grads.append(grad)
        if not edges:
            continue
        pins = [node.register_prehook(lambda _, kept=state.grads[node]: kept)
                for node in group.boundaries if node in state.grads]
        try:
            dweights = torch.autograd.grad(edges, group.weights, grads, retain_graph=True, allow_unused=True)
        finally:
            for pin in pins:
                pin.remove()
        del edges, grads, pins  # the kept gradients (a last stage's logits') go as soon as they are used
        for node in group.boundaries:
            state.grads.pop(node, None)
        group.seeds.clear()
        for weight, grad in zip(group.weights, dweights):
            if grad is not None:
                weight.grad = grad if weight.grad is None else weight.grad + grad


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
        self.steps_run = 0
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

    def run(self, local_inputs: Sequence[torch.Tensor], train: bool = True,
            before: Callable[[], None] | None = None) -> torch.Tensor:
        """Train one step on this pipeline replica's share (given on every rank; only the first
        stage reads it), or with ``train=False`` only run its forwards (the engine's ``eval``,
        without autograd); the mean reported loss, on every rank (detached). ``before()`` runs
        first (inside the watched step when training)."""
        for stage in self.stages:
            stage.accumulation = Accumulation(self.num_microbatches)
        self._reports = []
        args = tuple(local_inputs) if self.is_first else ()
        target = torch.zeros(self.num_microbatches) if self.is_last else None
        if not train:
            with torch.no_grad():
                if before is not None:
                    before()
                self.schedule.eval(*args, target=target, return_outputs=False)
            return self._mean_report()
        self.steps_run += 1
        # Stages differ per rank: a timeout names the ranks that have not started this step.
        with rank_progress.watching(self.steps_run, by_ops=False):
            if before is not None:
                before()
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


__all__ = ["PipelineProgram", "SCHEDULES", "WeightBackward", "WeightGroup", "split_backward_input",
           "split_backward_weight"]
