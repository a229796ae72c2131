"""DistributedModule: one rank's compiled program, ready to train.

It owns the rank's executable ``GraphModule`` (whose attributes are this rank's parameters), the
plan, the process mesh, and the pass history. ``train_step(*global_batch)`` takes the *global*
batch (the same on every rank), keeps this rank's share, cuts it into the plan's microbatches,
runs the step program (:mod:`graphpass.runtime.step`: forward and backward of each microbatch,
gradients synchronised once) and returns the global-batch loss; any torch optimizer then steps
``dmodel.parameters()``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.placement_types import Shard

from graphpass import batching, meta
from graphpass.lookups import IdCheck
from graphpass.model_io import order_call
from graphpass.plan import Plan
from graphpass.runtime import grad_sync
from graphpass.runtime import mesh as mesh_lib
from graphpass.layout import TensorLayout
from graphpass.runtime.layout import HeldPieces, gather_full, layout_of
from graphpass.runtime.loss_count import LossCounts
from graphpass.runtime import disk
from graphpass.runtime.disk import DiskStore, check_offload_dir
from graphpass import diloco as diloco_lib
from graphpass.runtime.diloco import OuterSync
from graphpass.runtime.link_emulator import LinkEmulator
from graphpass.runtime.offload import OffloadedParams
from graphpass.runtime.pipeline import PipelineProgram
from graphpass.runtime import row_cache
from graphpass.runtime.sparse_optim import SparseStep
from graphpass.runtime.step import StepProgram, accumulation_schedule

log = logging.getLogger(__name__)


def batch_axes(plan: Plan, input_names: Sequence[str]) -> list[str]:
    """The mesh axes (of size > 1) the batch is split over: those some input is ``Shard(d)`` on,
    in mesh order."""
    return [axis for axis in plan.mesh if plan.mesh[axis] > 1
            and any(isinstance(plan.placement(name, axis), Shard) for name in input_names)]


def check_divisible(inputs: Sequence[torch.Tensor], input_names: Sequence[str], plan: Plan) -> None:
    """Raise if the batch's samples do not divide over the axes that split it.

    Raises:
        ValueError: naming the input, its sample count and the mesh axes.
    """
    axes = [a for a in batch_axes(plan, input_names) if not (a == "dp" and plan.dp_shares is not None)]
    batching.check_divisible(inputs, batching.of_plan(plan, input_names), input_names,
                             math.prod(plan.mesh[a] for a in axes), " x ".join(axes))  # uneven shares: cut checks


class DistributedModule(nn.Module):
    """The compiled, per-rank program returned by :func:`graphpass.compile`.

    Attributes:
        graph_module: this rank's executable ``torch.fx.GraphModule`` (one microbatch); with
            pipeline stages, this rank's stage, or under an interleaved schedule a module of the
            ``get_attr`` nodes of its stages (their parameters and buffers; the stages themselves
            are in the dumps).
        plan: the :class:`~graphpass.plan.Plan` it was built from.
        history: one :class:`~graphpass.pass_manager.PassRecord` per pass.
        capture_route: ``"export"`` or ``"symbolic_trace"``.
    """

    def __init__(
        self,
        graph_module: fx.GraphModule,
        plan: Plan,
        process_mesh: mesh_lib.ProcessMesh,
        history: list,
        local_input_shapes: Sequence[torch.Size],
        state_dict_source: nn.Module,
        capture_route: str,
        *,
        pipeline: Callable[[int, int], PipelineProgram] | None = None,
        input_names: Sequence[str] | None = None,
        roles: Mapping[str, int] | None = None,
        graph_keys: Sequence[tuple[str, ...]] | None = None,
        input_keys: Sequence[str] | None = None,
        offload_dir: str | os.PathLike | None = None,
        delayed_disk_update: bool = False,
        id_check: IdCheck | None = None,
        link_emulator: LinkEmulator | None = None,
    ):
        super().__init__()
        #: the emulated wide-area link of sites on one machine (runtime/link_emulator.py), or None
        self.link_emulator = link_emulator
        self._id_check = id_check
        self.graph_module = graph_module
        self.plan = plan
        self.history = list(history)
        self.capture_route = capture_route
        self._mesh = process_mesh
        # A pipeline stage's graph takes what the previous stage sends: the step's inputs and
        # the loss's roles are the whole graph's, given here.
        self._input_names = list(input_names) if input_names is not None else [
            n.name for n in graph_module.graph.nodes if n.op == "placeholder"]
        self._local_shapes = [torch.Size(s) for s in local_input_shapes]  # of one microbatch
        # compiled from a dict batch: train_step(**batch) takes these keys, in this order
        self._input_keys = tuple(input_keys) if input_keys is not None else None
        self._batch_axes = batch_axes(plan, self._input_names)
        self._batches = batching.of_plan(plan, self._input_names)
        output = graph_module.graph.find_nodes(op="output")[0]
        self._roles = dict(roles) if roles is not None else dict(meta.get(output, meta.ROLE))
        self.num_microbatches = plan.microbatches
        self._report = self._roles.get("loss_report", self._roles["loss"])
        self._pipeline = pipeline(self._roles["loss"], self._report) if pipeline is not None else None
        self._program = StepProgram(
            [graph_module], self._roles["loss"], self._report, accumulation_schedule(self.num_microbatches)
        ) if pipeline is None else None
        # the loss's global count sums over the ranks holding the other shares (a DiLoCo worker's, its own)
        step = diloco_lib.step_axis(plan.mesh, plan.diloco)
        self._loss_counts = LossCounts(graph_module, [step if a == "dp" else a for a in self._batch_axes
                                                      if not (a == "dp" and step is None)], process_mesh)
        # The original module's state_dict order and the tensors the graph does not use.
        self._state_keys = list(state_dict_source.state_dict(keep_vars=True).keys())
        self._extra_state = {
            k: v for k, v in state_dict_source.state_dict(keep_vars=True).items()
        }
        self._attr_of_key: dict[str, str] = {}
        self._layouts: dict[str, TensorLayout] = {}  # get_attr target -> its gp.layout (sharded tensors)
        # The state keys of every tensor the whole program reads, by tensor (tied weights: several),
        # also those other pipeline stages hold.
        self._graph_keys = [tuple(k) for k in graph_keys] if graph_keys is not None else state_keys_read(graph_module)
        offloaded = {}
        for node in graph_module.graph.nodes:
            if node.op == "get_attr":
                for key in node.meta.get(meta.STATE_KEYS, ()):
                    self._attr_of_key[key] = node.target
                layout = meta.layout(node)
                if layout is not None:
                    self._layouts[node.target] = layout
                    if layout.slice is not None:  # a slice of a split operator's parameter
                        for key in layout.slice.state_keys:
                            self._attr_of_key[key] = layout.slice.target
                    if layout.tiers.offloaded:
                        offloaded[node.target] = (node.target, self._compute_copy(node.target), layout.tiers)
        # master copies in host memory of the parameters whose optimizer lives there
        store = None
        on_disk = [param for _, param, tiers in offloaded.values() if tiers.optimizer == "disk"]
        if on_disk:  # master, gradient and (about) two optimizer states per parameter in files
            need = 4 * sum(p.numel() * p.element_size() for p in on_disk)
            store = DiskStore(check_offload_dir(offload_dir, need), process_mesh.rank)
        self._offload = OffloadedParams(offloaded.values(), plan.offload_window, store, delayed_disk_update)
        # sharded embedding tables: their sparse optimizer steps them at the end of each train_step
        self._tables = {n.target: self._compute_copy(n.target) for n in graph_module.graph.nodes
                        if n.op == "get_attr" and plan.tensor(meta.plan_name(n)).table is not None}
        columns = {target: (layout.placements[-1][0], layout.shape[1]) for target, layout in self._layouts.items()
                   if target in self._tables and layout.placements and layout.placements[-1][1].dim == 1}
        self._sparse = SparseStep(plan.embedding_optimizer, self._tables, columns) if self._tables else None
        # the shards of tables with HET's cache, whose pending writes each step ends by pushing
        cached = {n.target for n in graph_module.graph.nodes
                  if n.op == "get_attr" and n.target in self._tables and plan.tensor(meta.plan_name(n)).table.cache}
        self._cached = [self._tables[target] for target in sorted(cached)]
        if self._pipeline is not None:  # their stages' gradients are summed after the schedule
            self._offload.hold_gradients(target for target, _ in self._pipeline.shared)
        # DiLoCo: after every inner_steps train steps, the workers' outer step
        self.outer_sync = (OuterSync([p for _, p in self.named_parameters()], plan.diloco,
                                     process_mesh.group(diloco_lib.outer_axis(plan.mesh)), link_emulator)
                           if plan.diloco is not None else None)

    # ------------------------------------------------------------------ parameters

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's trainable tensors under their original names (first name of tied weights):
        what the optimizer steps. A parameter whose optimizer lives in host memory (offload) is
        its master copy there; the program computes with a device copy of it. Embedding tables
        the plan shards are not among them: the plan's sparse optimizer steps them inside
        :meth:`train_step` (:attr:`sparse_optimizer`)."""
        tables = {id(t) for t in self._tables.values()}
        for name, p in self.graph_module.named_parameters(remove_duplicate=remove_duplicate):
            if id(p) in tables:  # a sharded embedding table: its sparse optimizer steps it
                continue
            master = self._offload.master_of(p)
            yield prefix + name, p if master is None else master

    @property
    def sparse_optimizer(self) -> SparseStep | None:
        """The sparse optimizer of the plan's sharded embedding tables (its ``state`` per table
        shard), or None when the plan shards none."""
        return self._sparse

    def resident_buffers(self) -> list[torch.Tensor]:
        """Tensors the runtime keeps on this rank between steps besides the parameters: the
        data-parallel gradient buckets' flat buffers (reused every step, as DDP's are). A memory
        probe's baseline should include them, with the parameters and the optimizer state."""
        return grad_sync.resident_buffers(list(self.graph_module.parameters()))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the original ``model.state_dict()`` keys, in its order (copies).

        Sharded parameters are gathered, so every rank must call this (it is a collective); the
        slices of a split operator's parameter are concatenated back into the original tensor.
        """
        with mesh_lib.active(self._mesh):
            gathered = gather_full({t: (self._attr(t), layout) for t, layout in self._layouts.items()}, self._attr)
        out = {}
        for key in self._state_keys:
            attr = self._attr_of_key.get(key)
            if attr in gathered:
                tensor = gathered[attr]
            elif attr is not None:
                tensor = self._attr(attr)
            else:
                tensor = self._extra_state[key]
            out[key] = tensor.detach().clone()
        if self._pipeline is not None:  # each stage holds its own layers: take theirs
            owned = {k: v for k, v in out.items() if self._attr_of_key.get(k) is not None}
            stages: list = [None] * self._mesh.axis_size("pp")
            dist.all_gather_object(stages, owned, group=self._mesh.group("pp"))
            for theirs in stages:
                out.update({k: v for k, v in theirs.items() if self._attr_of_key.get(k) is None})
            out = {k: out[k] for k in self._state_keys}
        return out

    def checkpoint_state(self) -> tuple[list[tuple[HeldPieces, torch.Tensor]], dict[str, torch.Tensor], list[str]]:
        """What a checkpoint of this rank holds (:mod:`graphpass.runtime.checkpoint`): the layout
        and local tensor of each parameter and buffer the rank's program reads; the tensors no
        program reads, by key (kept whole); and every key a checkpoint of the model has (tied
        weights under their first key only)."""
        entries, seen = [], set()
        for node in self.graph_module.graph.nodes:
            if node.op != "get_attr" or node.target in seen:
                continue
            seen.add(node.target)
            tensor = self._attr(node.target)
            sharded = self._layouts.get(node.target)
            experts = self._attr(sharded.experts) if sharded is not None and sharded.experts is not None else None
            layout = (layout_of(node, tensor, self._mesh, experts)
                      if isinstance(tensor, torch.Tensor) else None)
            if layout is not None:
                entries.append((layout, tensor))
        read = {k for keys in self._graph_keys for k in keys}
        aliases = {k for keys in self._graph_keys for k in keys[1:]}
        unplaced = {k: self._extra_state[k] for k in self._state_keys if k not in read}
        return entries, unplaced, [k for k in self._state_keys if k not in aliases]

    def _attr(self, target: str) -> torch.Tensor:
        """The tensor the rank stores for attribute ``target``: the master copy of an offloaded
        parameter (what the optimizer has stepped), else the graph's attribute."""
        master = self._offload.masters.get(target)
        if master is None:
            return self._compute_copy(target)
        disk.settle()  # a delayed disk-tier step writing it: done first
        return master

    def _compute_copy(self, target: str) -> torch.Tensor:
        module_path, _, name = target.rpartition(".")
        return getattr(self.graph_module.get_submodule(module_path), name)

    # ------------------------------------------------------------------ running

    def local_batch(self, *global_batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's share of the global batch: cut along each input's batch dim on each axis
        that splits the batch (jagged inputs at their offsets, :func:`graphpass.batching.cut`).

        Raises:
            TypeError/ValueError: wrong number, type or shape of inputs, naming the input.
        """
        if len(global_batch) != len(self._input_names):
            raise TypeError(
                f"expected {len(self._input_names)} inputs ({', '.join(self._input_names)}), "
                f"got {len(global_batch)}"
            )
        for i, value in enumerate(global_batch):
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"input {self._input_names[i]!r} must be a torch.Tensor, got {type(value).__name__}"
                )
        check_divisible(global_batch, self._input_names, self.plan)
        batching.check_offsets(global_batch, self._batches, self._input_names)
        if self._id_check:  # on every rank, on the whole batch: no rank starts a step others refuse
            ways = math.prod(self.plan.mesh[a] for a in self._batch_axes) * self.num_microbatches
            self._id_check.check(global_batch, lambda: self._pieces(global_batch, ways))
        local = tuple(global_batch)
        for axis in self._batch_axes:
            local = batching.cut(local, self._batches, self.plan.mesh[axis], self._mesh.axis_rank(axis),
                                 self._input_names, counts=self.plan.dp_shares if axis == "dp" else None)
        k = self.num_microbatches
        for value, name, batch, shape in zip(local, self._input_names, self._batches, self._local_shapes):
            cut = batch.dim is not None and k > 1
            expected = shape
            if cut and batch.offsets is None:
                expected = torch.Size((*shape[:batch.dim], shape[batch.dim] * k, *shape[batch.dim + 1:]))
            if batch.is_offsets and batch.include_last_offset and cut:
                expected = torch.Size((*shape[:-1], (shape[-1] - 1) * k + 1))
            if batch.offsets is not None:  # jagged: the ids' count changes from step to step
                same = value.dim() == len(shape) and value.shape[:-1] == shape[:-1]
            else:
                same = value.shape == expected
            if not same:
                count = batching.num_samples(value, batch)
                if cut and count is not None and count % k:
                    raise ValueError(
                        f"input {name!r}: this rank's share has {count} rows, which do not divide "
                        f"into Plan.microbatches={k} microbatches; make the global batch a multiple of "
                        f"{math.prod(self.plan.mesh[a] for a in self._batch_axes) * k}"
                    )
                raise ValueError(
                    f"input {name!r}: this rank's share has shape {tuple(value.shape)} but the program "
                    f"was compiled for {tuple(expected)}"
                    + (f" ({k} microbatches of {tuple(shape)})" if cut else "")
                    + "; call graphpass.compile again for a new shape"
                )
        return local

    def _pieces(self, global_batch: Sequence[torch.Tensor], ways: int) -> list[tuple[torch.Tensor, ...]]:
        """Every rank's microbatches of the global batch, in order (the ids check reads them all)."""
        if self.plan.dp_shares is None:
            return [batching.cut(global_batch, self._batches, ways, i) for i in range(ways)]
        dp, k = self.plan.mesh.dp, self.num_microbatches
        shares = [batching.cut(global_batch, self._batches, dp, i, counts=self.plan.dp_shares) for i in range(dp)]
        return [batching.cut(share, self._batches, k, j) for share in shares for j in range(k)]

    def microbatches(self, *global_batch: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """This rank's share cut into the plan's microbatches (inputs not split along the batch,
        such as a shared mask, go whole to every microbatch)."""
        local = self.local_batch(*global_batch)
        k = self.num_microbatches
        if k == 1:
            return [local]
        return [batching.cut(local, self._batches, k, i, self._input_names) for i in range(k)]

    def train_step(self, *global_batch: torch.Tensor, **keyword_batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward on this rank's share; returns the global-batch loss (detached).

        Takes the global batch as ``compile``'s ``example_inputs`` was given: positional tensors,
        or ``train_step(**batch)`` for a dict. Gradients land in ``p.grad`` for ``p in
        self.parameters()``, already synchronised, so the caller's optimizer can step right away.
        With ``plan.microbatches = k`` the share runs as k microbatches whose gradients are
        accumulated and synchronised once. Embedding tables the plan shards are updated here, by
        the plan's sparse optimizer, once the step's last backward is done.
        """
        if self.outer_sync is not None:  # DiLoCo: the outer step, if due
            self.outer_sync.before_step()
        with self.link_emulator.active() if self.link_emulator is not None else contextlib.nullcontext():
            loss = self._train_step(order_call(self._input_keys, global_batch, keyword_batch, self._input_names))
        if self.outer_sync is not None:
            self.outer_sync.after_step()
        return loss

    def _train_step(self, global_batch: Sequence[torch.Tensor]) -> torch.Tensor:
        count = functools.partial(self._loss_counts.fill, self.microbatches(*global_batch)) if self._loss_counts else None
        self._offload.upload()  # masters changed since (a load, a step without the hook): up they go
        self._offload.start_delayed()  # the disk tier's delayed step, while this one computes
        with mesh_lib.active(self._mesh):
            if self._pipeline is not None:  # the engine's schedule cuts the microbatches
                loss = self._pipeline.run(self.local_batch(*global_batch), before=count)
            else:
                loss = self._program.run(self.microbatches(*global_batch), before=count)
        self._offload.finish_step()  # every gradient down in its master's .grad
        if self._sparse is not None:  # the tables' rows this step touched, updated
            with mesh_lib.active(self._mesh):
                if self._cached:  # gradients of cached rows that are due go to the rows' holders
                    row_cache.push(self._cached, "dp")
                self._sparse.step()
        return loss

    def flush_cache(self) -> None:
        """Send every pending write of the embedding tables' caches to the rows' holders, apply
        them with the sparse optimizer (no step counted) and empty the caches, so the tables hold
        every update made so far (:mod:`graphpass.runtime.row_cache`). Every rank calls it (a
        collective); :func:`graphpass.save` does. Nothing to do without a cache."""
        if self._cached:
            with mesh_lib.active(self._mesh):
                row_cache.push(self._cached, "dp", everything=True)
                self._sparse.apply()

    def forward(self, *global_batch: torch.Tensor, **keyword_batch: torch.Tensor) -> torch.Tensor:
        """The global-batch loss without a backward pass (for evaluation).

        Its result has no backward: calling ``.backward()`` on it raises, saying to call
        :meth:`train_step` (which runs forward and backward of the distributed program)."""
        global_batch = order_call(self._input_keys, global_batch, keyword_batch, self._input_names)
        disk.settle()
        self._offload.upload()
        if self._pipeline is not None:
            with mesh_lib.active(self._mesh):
                loss = self._pipeline.run(self.local_batch(*global_batch), train=False, before=functools.partial(
                    self._loss_counts.fill, self.microbatches(*global_batch)))
        else:
            microbatches = self.microbatches(*global_batch)
            with mesh_lib.active(self._mesh), torch.no_grad():
                self._loss_counts.fill(microbatches)
                losses = [self.graph_module(*mb)[self._report] for mb in microbatches]
            loss = torch.stack(losses).mean() if len(losses) > 1 else losses[0]
        return _NoBackward.apply(loss) if torch.is_grad_enabled() else loss


class _NoBackward(torch.autograd.Function):
    """The evaluation loss with a backward that tells the user to call ``train_step``: a plain
    detached loss would fail at ``.backward()`` with torch's "does not require grad"."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor) -> torch.Tensor:
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError(
            "dmodel(...) computes the loss only (evaluation); it has no backward. Train with "
            "loss = dmodel.train_step(*batch) (forward and backward of the distributed program, "
            "gradients synchronised), then optimizer.step()"
        )

    @classmethod
    def apply(cls, loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # an input that requires grad, so that the result has a backward to refuse
        return super().apply(loss.detach().requires_grad_(True))


def state_keys_read(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    """The original state keys of each tensor ``gm`` reads (a split parameter's from its slices)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            slice_ = meta.slice_of(node)
            keys = tuple(slice_.state_keys if slice_ is not None else node.meta.get(meta.STATE_KEYS, ()))
            if keys:
                out.append(keys)
    return out


def broadcast_replicated_state(gm: fx.GraphModule, mesh: mesh_lib.ProcessMesh) -> None:
    """Make every rank start from rank 0's parameters and buffers, as DDP does at construction.

    Tensors are flattened per dtype so the broadcast is a handful of collectives, not one per tensor.
    """
    if mesh.size == 1 or not dist.is_initialized():
        return
    tensors = [t for t in list(gm.parameters()) + list(gm.buffers()) if t.device.type != "meta"]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype, group in by_dtype.items():
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.broadcast(flat, src=0)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
