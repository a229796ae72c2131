"""The public entry point: ``graphpass.compile``.

``compile(model, cluster, example_inputs=..., strategy=...)`` runs on every rank (SPMD): it
resolves the strategy into a :class:`~graphpass.plan.Plan`, captures the model at this rank's
batch shape, runs the pass pipeline (dumping each graph when asked), and wraps the result in a
:class:`~graphpass.runtime.module.DistributedModule`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence, Union

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from graphpass import batching, meta
from graphpass.capture import capture
from graphpass.cluster import Cluster
from graphpass.dump import Dumper, resolve_dump_dir
from graphpass.pass_manager import PassContext, run_passes
from graphpass.passes import passes_for
from graphpass.passes.partition_stages import cut_stages, shared_parameters
from graphpass.mesh import pipeline_rank
from graphpass.model_io import Batch, adapt
from graphpass.layout import Jagged
from graphpass.lookups import IdCheck
from graphpass.tables import SparseOptimizer
from graphpass.plan import Plan, Strategy, check_pipeline
from graphpass.plan_builder import plan_from_strategy
from graphpass.progress import phase
from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime import ownership
from graphpass.runtime import verifier
from graphpass.runtime.pipeline import PipelineProgram
from graphpass.runtime.module import (
    DistributedModule,
    broadcast_replicated_state,
    check_divisible,
    state_keys_read,
)

log = logging.getLogger(__name__)

StrategyLike = Union[str, Strategy, Plan]


def _process_group_size() -> tuple[int, int]:
    from graphpass.runtime.launch import join_torchrun_job

    join_torchrun_job()  # a torchrun rank without gp.launch joins its job's group here
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _link_emulator(cluster: Cluster):
    """The emulated wide-area link of a cluster of sites on one machine
    (``Cluster.local().split(sites, link)``), priced by the cost model's flat collectives; None
    for a real cluster. It delays collectives and the pipeline engine's sends across the link.
    """
    if not cluster.emulated:
        return None
    from graphpass.cost.collectives import collective_time
    from graphpass.runtime.link_emulator import LinkEmulator

    return LinkEmulator(cluster, lambda kind, size, ranks: collective_time(kind, size, ranks, cluster, algorithm="ring"))


def resolve_strategy(strategy: StrategyLike, world_size: int) -> tuple[Strategy | None, Plan | None, list[str]]:
    """Turn the user's ``strategy=`` into a checked Strategy, or a given Plan, plus reasons.

    Raises:
        TypeError: not ``"auto"``, a Strategy or a Plan.
        ValueError / NotImplementedError: from :meth:`Strategy.check`.
    """
    if isinstance(strategy, str):
        if strategy != "auto":
            raise ValueError(f"strategy must be 'auto', a graphpass.Strategy or a graphpass.Plan, got {strategy!r}")
        return None, None, []
    if isinstance(strategy, Strategy):
        strategy.check(world_size)
        return strategy, None, ["uniform strategy given by the user"]
    if isinstance(strategy, Plan):
        if strategy.world_size != world_size:
            raise ValueError(
                f"the given Plan's mesh {dict(strategy.mesh)} needs {strategy.world_size} ranks, "
                f"but world_size is {world_size}"
            )
        if strategy.strategy is not None:
            strategy.strategy.check(world_size)
        if strategy.mesh.pp > 1:
            check_pipeline("Plan", strategy.mesh.pp, strategy.schedule, strategy.microbatches,
                           strategy.virtual_stages, strategy.mesh.dp, strategy.sequence_parallel)
        return strategy.strategy, strategy, []
    raise TypeError(
        f"strategy must be 'auto', a graphpass.Strategy or a graphpass.Plan, got {type(strategy).__name__}"
    )


def _pipeline_stages(gm: fx.GraphModule, plan: Plan, mesh: mesh_lib.ProcessMesh, device: torch.device,
                     timeout_s: float):
    """This rank's stage graphs of ``gm`` with their indices (rank ``r`` of ``pp`` runs stages
    ``r, r + pp, ...``) and a builder of its pipeline program."""
    stages = cut_stages(gm, plan.stages)
    pp, index = plan.mesh.pp, mesh.axis_rank("pp")
    mine = [(s, stage) for s, stage in enumerate(stages) if pipeline_rank(s, pp) == index]
    pipelines = sorted({tuple(plan.mesh.group_ranks("pp", r)) for r in range(plan.mesh.world_size)})
    # The stages' sends and receives wait as long as their group's timeout when the group was
    # made (gloo's point-to-point ignores one set later: a hung peer held its sender for the
    # default group's 60 s under compile(timeout_s=10)), so each pipeline replica gets a group
    # made with compile's timeout, by every rank in the same order (creating a group is collective).
    group = None
    for ranks in pipelines:
        made = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
        if mesh.rank in ranks:
            group = made
    # Parameters read by stages on several ranks (tied embedding and LM head): one group of the
    # ranks holding it per parameter and pipeline replica, made alike.
    shared = []
    for target, users in sorted(shared_parameters(stages).items()):
        holders = sorted({pipeline_rank(s, pp) for s in users})
        if len(holders) < 2:
            continue
        for ranks in pipelines:  # every pipeline replica (one per dp x tp coordinate)
            together = dist.new_group([ranks[h] for h in holders], timeout=timedelta(seconds=timeout_s))
            if mesh.rank in ranks and index in holders:
                shared.append((target, together))

    def program(loss_index: int, report_index: int) -> PipelineProgram:
        return PipelineProgram(mine, len(stages), group, plan.schedule, plan.microbatches, loss_index,
                               report_index, shared, device)

    return mine, program


def _rank_state(gm: fx.GraphModule, stages: Sequence[fx.GraphModule]) -> fx.GraphModule:
    """What this rank's stages read, in one module: the stage itself when there is one, else a
    graph of their ``get_attr`` nodes (metadata included), which is how the
    ``DistributedModule`` finds the rank's parameters, shards and state keys."""
    if len(stages) == 1:
        return stages[0]
    graph, seen = fx.Graph(), set()
    for stage in stages:
        for node in stage.graph.nodes:
            if node.op == "get_attr" and node.target not in seen:
                seen.add(node.target)
                graph.node_copy(node)
    graph.output(None)
    return fx.GraphModule(gm, graph, class_name="RankStages")


#: Default collective timeout of a compiled program (``compile(timeout_s=None)``): long enough for
#: the slowest legitimate collective (a first NCCL connection, a large gather on loaded gloo
#: ranks), short enough that a dead peer ends the job in minutes, not torch's 30 (gloo) / 10 (NCCL).
DEFAULT_TIMEOUT_S = {"cpu": 300.0, "cuda": 600.0}


def compile(  # noqa: A001 - the public name the contract uses
    model: nn.Module,
    cluster: Cluster | None = None,
    *,
    example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    strategy: StrategyLike = "auto",
    dump_dir: str | os.PathLike | None = None,
    verify: bool = True,
    timeout_s: float | None = None,
    loss_fn: Callable | None = None,
    offload_dir: str | os.PathLike | None = None,
    delayed_disk_update: bool = False,
    batch_dims: Mapping[str | int, int | Jagged | None] | None = None,
    embedding_optimizer: SparseOptimizer | None = None,
    staleness: int = 0,
) -> DistributedModule:
    """Compile ``model`` into this rank's distributed training program.

    Every rank calls this with the same arguments (SPMD). ``example_inputs`` is one *global*
    batch; each rank captures the model at its own share of it.

    Args:
        model: an ``nn.Module`` whose ``forward(*inputs)`` (or ``forward(**inputs)``) returns a
            scalar mean loss, or a ``ModelOutput`` / dict / tuple holding it, or its output when
            ``loss_fn`` is given (:mod:`graphpass.model_io`). The model's ``nn.Parameter``
            objects become this rank's tensors (:mod:`graphpass.runtime.ownership`), so an
            optimizer built on them before ``compile`` trains the program, or raises at its
            first step where it cannot.
        cluster: the devices (default ``Cluster.local()``: the running process group).
        example_inputs: one global batch: a tuple of tensors (the model's positional
            arguments) or a dict of tensors (its keyword arguments, e.g. ``{"input_ids": x,
            "labels": y}``; ``train_step(**batch)`` then takes the same keys).
        strategy: ``"auto"``, a :class:`Strategy`, or a saved :class:`Plan`.
        dump_dir: write the graph after every pass there (default: ``GRAPHPASS_DUMP_DIR``).
        verify: check every rank's program against the others' before returning
            (:mod:`graphpass.runtime.verifier`: collectives, shards, memory); one small exchange.
        timeout_s: the collective timeout of every process group the program uses (the default
            group included), in seconds: a peer that died or hangs makes the others raise after
            it. Default 300 on CPU, 600 on GPU.
        loss_fn: ``loss_fn(output, target) -> loss`` for a model that returns its output only:
            the last example input is the target (with a dict batch, the entries
            ``model.forward`` does not take go to ``loss_fn`` by keyword).
        offload_dir: where a plan that keeps optimizer state on disk
            (``Strategy(offload_to="disk")``) writes its files, one directory per rank under it
            (default: ``GRAPHPASS_OFFLOAD_DIR``); a local SSD, writable, with room for about four
            times the disk-tier parameters' bytes.
        delayed_disk_update: opt-in, *not exact*: the disk tier's optimizer step runs a step
            behind, on a thread of its own while the next ``train_step`` computes (Angel-PTM's
            lock-free update): the update of step k uses the gradients taken at the weights
            before update k-1. Needs a plan with optimizer state on disk and no streamed
            parameters (``docs/offload.md``).
        batch_dims: how inputs whose samples are not along dim 0 split, keyed by the batch's keys
            (or positions, for a tuple batch): their batch dim, ``None`` for an input every rank
            reads whole (a shared mask), or ``graphpass.Jagged(offsets=key)`` for a jagged input
            (multi-hot ids cut at another input's offsets). Inputs not named keep what graphpass
            infers from the model's embedding lookups (:mod:`graphpass.batching`), else dim 0.
        embedding_optimizer: with ``strategy="auto"``, the :class:`graphpass.SparseOptimizer`
            of the model's embedding tables: the planner then shards each table its own way
            (``graphpass.plan(..., embedding_optimizer=)``; ``docs/embeddings.md``). A Strategy
            names its own (``Strategy.embedding_optimizer``).
        staleness: with ``strategy="auto"`` and ``embedding_optimizer``, the steps a cached
            embedding row may lag (HET's bounded staleness; ``graphpass.plan(..., staleness=)``):
            0 (default) keeps training exact; more lets the planner give tables caches that
            move fewer bytes and train not quite as one process does.

    Returns:
        the :class:`DistributedModule` for this rank.

    Raises:
        TypeError: bad ``model``, ``cluster``, ``example_inputs`` or ``strategy`` type.
        ValueError: inconsistent sizes (world size, batch divisibility), a non-scalar loss, a
            ``timeout_s`` that is not a positive number.
        NotImplementedError: a strategy field graphpass does not implement yet.
        graphpass.CaptureError: the model cannot be captured.
        graphpass.VerificationError: the ranks' programs disagree or do not fit (``verify``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(delayed_disk_update, bool):
        raise TypeError(f"delayed_disk_update must be True or False, got {delayed_disk_update!r}")
    batch = Batch.of(example_inputs)
    inputs, program_model = batch.tensors, adapt(model, batch, loss_fn)
    rank, world_size = _process_group_size()
    if cluster is None:
        cluster = Cluster.local()
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a graphpass.Cluster, got {type(cluster).__name__}")
    if cluster.world_size != world_size:
        raise ValueError(
            f"cluster describes {cluster.world_size} devices but this process group has {world_size} "
            "ranks; compile on every rank of a launched job (torchrun or graphpass.launch) with "
            "graphpass.Cluster.local()"
        )
    device_type = "cuda" if cluster.device.kind == "cuda" else "cpu"
    timeout_s = _check_timeout(timeout_s, device_type)
    captured, plan, local_inputs = _capture_and_plan(program_model, cluster, inputs, strategy, rank, world_size,
                                                     keys=batch.keys, batch_dims=batch_dims,
                                                     embedding_optimizer=embedding_optimizer, staleness=staleness)
    crossing = cluster.hsdp_warning(plan.mesh)
    if crossing and rank == 0:
        warnings.warn(crossing, stacklevel=2)
    named = type(model).__name__
    gm = captured.gm
    id_check = IdCheck(gm)  # of the tables as captured, before a pass shards them

    process_mesh = mesh_lib.ProcessMesh(plan.mesh, device_type=device_type, node_size=(
        cluster.devices_per_node if plan.ep_all_to_all == "hierarchical" else None))
    process_mesh.set_timeout(timeout_s)
    # Every rank starts from rank 0's weights (as DDP does), before passes cut shards from them.
    broadcast_replicated_state(gm, process_mesh)
    originals = {n.target: ownership.attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}

    dumper = Dumper(resolve_dump_dir(dump_dir), rank)
    dumper.graph(0, "capture", gm, f"after 00 capture via {captured.route}{', reused' if captured.reused else ''} ({captured.seconds * 1e3:.1f} ms) | nodes {len(gm.graph.nodes)}")
    ctx = PassContext(rank=rank, world_size=world_size, example_inputs=local_inputs)
    recorder = verifier.Recorder(plan, rank)

    def after_pass(index: int, record, graph: fx.GraphModule) -> None:
        dumper.record(index, record, graph)
        if verify:
            recorder.after_pass(index, record, graph)

    with phase(f"applying the plan to {named}"):
        gm, records = run_passes(gm, plan, ctx, passes_for(plan), on_record=after_pass)
    dumper.finish(plan, captured.route, captured.seconds, records)
    if dumper.root is not None and rank == 0:
        log.info("graphpass dumps written to %s", dumper.root)
    if verify:
        with phase(f"verifying {named} against the other ranks"):
            verifier.check_across_ranks(recorder, verifier.local_problems(gm, plan, rank, cluster.device.memory_bytes))

    ownership.adopt_replaced(gm, originals)
    emulator = _link_emulator(cluster)
    if plan.mesh.pp == 1:
        return DistributedModule(gm, plan, process_mesh, records, [t.shape for t in local_inputs], model,
                                 captured.route, input_keys=batch.keys, offload_dir=offload_dir,
                                 delayed_disk_update=delayed_disk_update, id_check=id_check, link_emulator=emulator)
    output = gm.graph.find_nodes(op="output")[0]
    with phase(f"building the pipeline stages of {named}"):
        mine, program = _pipeline_stages(gm, plan, process_mesh, torch.device(device_type), timeout_s)
    # This rank keeps only its stages' tensors (the other stages' ranks hold theirs).
    held = {n.target for _, stage in mine for n in stage.graph.nodes if n.op == "get_attr"}
    for target in {n.target for n in gm.graph.nodes if n.op == "get_attr"} - held:
        ownership.release(ownership.attr(gm, target))
    for s, stage in mine:
        name = "partition_stages" if len(mine) == 1 else f"partition_stages_{s}"
        dumper.graph(len(records) + 1, name, stage,
                     f"after {len(records) + 1:02d} partition_stages | stage {s} of {len(plan.stages)} "
                     f"(pp rank {process_mesh.axis_rank('pp')} of {plan.mesh.pp}) | nodes {len(stage.graph.nodes)}")
    return DistributedModule(_rank_state(gm, [stage for _, stage in mine]), plan, process_mesh, records,
                             [t.shape for t in local_inputs], model, captured.route, pipeline=program,
                             input_names=[n.name for n in gm.graph.nodes if n.op == "placeholder"],
                             roles=meta.get(output, meta.ROLE), graph_keys=state_keys_read(gm),
                             input_keys=batch.keys, offload_dir=offload_dir,
                             delayed_disk_update=delayed_disk_update, id_check=id_check, link_emulator=emulator)


def verify(
    model: nn.Module,
    cluster: Cluster | str,
    *,
    example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    strategy: StrategyLike = "auto",
    loss_fn: Callable | None = None,
) -> dict[int, dict[verifier.Group, tuple[verifier.Entry, ...]]]:
    """Compile every rank's program of ``cluster`` in this process, on meta copies of the
    weights (no process group, no devices: a 1024-GPU job from a laptop), and check them against
    each other as ``compile`` does (:mod:`graphpass.runtime.verifier`).

    Args:
        model: as for :func:`compile` (on the meta device too).
        cluster: a :class:`Cluster` or a preset name / ``"h100-80g:16x8"`` string.
        example_inputs: one global batch.
        strategy: ``"auto"`` (planned for ``cluster``), a :class:`Strategy` or a :class:`Plan`.
        loss_fn: as for :func:`compile`.

    Returns:
        each rank's program after the last pass: its collectives by process group and the
        tensors it holds (``"shards"``).

    Raises:
        graphpass.VerificationError: the ranks' programs disagree or do not fit.
    """
    from graphpass.capture import _rebind

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    batch = Batch.of(example_inputs)
    inputs, model = batch.tensors, adapt(model, batch, loss_fn)
    if isinstance(cluster, str):
        from graphpass.planner import resolve_cluster

        cluster = resolve_cluster(cluster)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a graphpass.Cluster or a preset name, got {type(cluster).__name__}")
    world_size = cluster.world_size
    captured, plan, local_inputs = _capture_and_plan(model, cluster, inputs, strategy, 0, 1, world_size=world_size)
    recorders, problems = [], []
    on_meta = tuple(t.to("meta") for t in local_inputs)  # the weights are meta copies too
    for rank in range(world_size):
        recorder = verifier.Recorder(plan, rank)
        ctx = PassContext(rank=rank, world_size=world_size, example_inputs=on_meta)
        gm, _ = run_passes(_on_meta(_rebind(captured.gm, None)), plan, ctx, passes_for(plan),
                           on_record=recorder.after_pass)
        problems += verifier.local_problems(gm, plan, rank, cluster.device.memory_bytes)
        recorders.append(recorder)
    verifier.check_programs(recorders, problems)
    return {rec.rank: rec.snapshots[-1][1] if rec.snapshots else {} for rec in recorders}


def _on_meta(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (holding meta stand-ins of its state) with the tensors its ops create (``arange``,
    ``zeros``, ... captured with the example's device) made on the meta device too, so that
    they meet the meta weights and inputs."""
    for node in gm.graph.nodes:
        device = node.kwargs.get("device")
        if isinstance(device, torch.device) and device.type != "meta":
            node.update_kwarg("device", torch.device("meta"))
    gm.recompile()
    return gm


def _check_timeout(timeout_s: float | None, device_type: str) -> float:
    if timeout_s is None:
        return DEFAULT_TIMEOUT_S[device_type]
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def _capture_and_plan(model: nn.Module, cluster: Cluster | None, inputs: tuple[torch.Tensor, ...], strategy: StrategyLike,
                      rank: int, ranks_present: int, *, world_size: int | None = None,
                      keys: tuple[str, ...] | None = None, batch_dims: Mapping[Any, Any] | None = None,
                      embedding_optimizer: SparseOptimizer | None = None, staleness: int = 0):
    """The plan (the user's, or planned: on rank 0 and broadcast when ``ranks_present > 1``) and
    the capture at one microbatch of a rank's share; (capture, plan, local inputs)."""
    world_size = ranks_present if world_size is None else world_size
    chosen, given_plan, reasons = resolve_strategy(strategy, world_size)
    if (embedding_optimizer is not None or staleness) and (chosen is not None or given_plan is not None):
        raise ValueError("compile(embedding_optimizer=, staleness=) go to the planner (strategy='auto'); a Strategy "
                         "names its own (Strategy(embeddings=..., embedding_optimizer=..., staleness=...)) and a Plan "
                         "holds them (Plan.embedding_optimizer, TableSharding.staleness)")
    name = type(getattr(model, "wrapped", model)).__name__
    batches = batching.resolve(model, inputs, keys, batch_dims)
    if chosen is None and given_plan is None:  # "auto": rank 0 plans, every rank gets its plan
        with phase(f"planning {name} on {world_size} device{'s' if world_size != 1 else ''}"):
            given_plan = _auto_plan(model, cluster, inputs, rank, ranks_present, batches, embedding_optimizer,
                                    staleness)
    source = given_plan if given_plan is not None else chosen
    dp = source.mesh.dp  # type: ignore[union-attr]
    k = source.microbatches  # type: ignore[union-attr]
    if source.mesh.pp > 1 and any(b != batching.InputBatch() for b in batches):  # type: ignore[union-attr]
        odd = [keys[i] if keys else f"example_inputs[{i}]" for i, b in enumerate(batches) if b != batching.InputBatch()]
        raise NotImplementedError(
            f"pipeline stages (pp={source.mesh.pp}) cut microbatches along dim 0 of every input, and {odd} hold their "  # type: ignore[union-attr]
            "samples along another dim or are jagged; use pp=1 for this model")

    if given_plan is not None and given_plan.capacity_factor != "model":
        apply_capacity_factor(model, given_plan.capacity_factor)
    # Capture at one microbatch of this rank's share: shapes are specialised in the graph.
    names = list(keys) if keys else _input_names_guess(len(inputs))
    counts = _share_counts(source, inputs, batches, names)
    if counts is None:
        batching.check_divisible(inputs, batches, names, dp, "dp")
        _check_microbatches(inputs, batches, names, dp, k, "Plan" if given_plan is not None else "Strategy")
        local_inputs = batching.cut(inputs, batches, dp * k, 0, names)
    else:  # uneven shares: this rank's own (its graph is specialised to it), then its first microbatch
        share = batching.cut(inputs, batches, dp, source.mesh.coordinate(rank, "dp"), names, counts)
        _check_microbatches(share, batches, names, 1, k, "Plan" if given_plan is not None else "Strategy")
        local_inputs = batching.cut(share, batches, k, 0, names)
    with phase(f"capturing {name}"):
        captured = capture(model, local_inputs)
    batching.annotate(captured.gm, batches)
    plan = given_plan if given_plan is not None else plan_from_strategy(  # type: ignore[arg-type]
        captured.gm, chosen, reasons, node_size=cluster.devices_per_node if cluster is not None else None)
    if counts is not None and plan.dp_shares is None:  # the weights, as the batch's samples
        plan = dataclasses.replace(plan, dp_shares=counts)
    plan.check_graph(captured.gm)  # the plan's placements against this model's graph
    input_names = [n.name for n in captured.gm.graph.nodes if n.op == "placeholder"]
    check_divisible(inputs, input_names, plan)
    return captured, plan, local_inputs


def apply_capacity_factor(model: nn.Module, capacity_factor: float | None) -> None:
    """Give every ``graphpass.nn.MoE`` layer of ``model`` the plan's capacity factor (the model
    then computes what the compiled program does, in one process too).

    Raises:
        ValueError: no such layer, or one whose gate chooses tokens (expert choice has its own
            capacity).
    """
    from graphpass.nn.moe import MoE

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"Plan.capacity_factor={capacity_factor!r} applies to graphpass.nn.MoE layers, and "
                         f"{type(model).__name__} has none; use capacity_factor='model'")
    for name, layer in layers:
        if not getattr(layer.gate, "token_choice", True):
            raise ValueError(f"Plan.capacity_factor cannot be applied to {name!r}: its gate "
                             f"({type(layer.gate).__name__}) lets experts choose tokens, with its own capacity")
        layer.capacity_factor = capacity_factor


def _auto_plan(model: nn.Module, cluster: Cluster, inputs: Sequence[torch.Tensor], rank: int, world_size: int,
               batches: Sequence[batching.InputBatch], embedding_optimizer: SparseOptimizer | None = None,
               staleness: int = 0) -> Plan:
    """The planner's choice among what the runtime executes, solved on rank 0 and broadcast, so
    that every rank runs the same plan.

    A planning error on rank 0 is raised on every rank as the same exception type
    (``NoPlanError``, ``PlanningError``, ``ValueError``...), so callers can catch it by type;
    rank 0 keeps its traceback, the other ranks get a note that it came from rank 0.
    """
    from graphpass.planner import plan as make_plan

    if rank == 0:
        try:
            text = make_plan(model, cluster, inputs, batch_dims=batching.declaration(batches),
                             embedding_optimizer=embedding_optimizer, staleness=staleness).to_json(indent=None)
        except Exception as exc:
            if world_size > 1:
                _broadcast_plan(None, _portable(exc))
            raise
        if world_size > 1:
            _broadcast_plan(text, None)
    else:
        text, error = _broadcast_plan(None, None)
        if error is not None:
            error.add_note("graphpass.compile(strategy='auto'): raised while planning on rank 0")
            raise error
    chosen = Plan.from_json(text)
    if rank == 0:
        log.info("strategy='auto' planned:\n%s", chosen.explain())
    return chosen


def _broadcast_plan(text: str | None, error: BaseException | None) -> tuple[str | None, BaseException | None]:
    box = [text, error]
    dist.broadcast_object_list(box, src=0)
    return box[0], box[1]


def _portable(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling (to reach the other ranks), else a RuntimeError
    with its type and message."""
    import pickle

    try:
        copy = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - an exception that does not pickle is sent as text
        copy = None
    if type(copy) is type(exc) and str(copy) == str(exc):
        return copy
    return RuntimeError(f"{type(exc).__name__}: {exc}")


def _share_counts(source: Any, inputs: Sequence[torch.Tensor], batches: Sequence[batching.InputBatch],
                  names: Sequence[str]) -> tuple[int, ...] | None:
    """The samples each dp rank takes under uneven shares (a Plan's counts, or a Strategy's
    weights applied to this batch); None for equal shares."""
    if isinstance(source, Plan) and source.dp_shares is None and source.strategy is not None:
        source = source.strategy  # a plan gp.plan made from a Strategy with weights: their counts now
    shares = source.dp_shares
    if shares is None:
        return None
    totals = {batching.num_samples(v, b) for v, b in zip(inputs, batches)} - {None}
    if len(totals) != 1:
        raise ValueError(f"uneven data-parallel shares need one sample count across the split inputs {list(names)}, "
                         f"got {sorted(totals)}")
    total = totals.pop()
    if isinstance(source, Plan):
        if sum(shares) != total:
            raise ValueError(f"Plan.dp_shares={shares} cut {sum(shares)} samples, but the batch has {total}")
        return tuple(shares)
    return batching.share_counts(total, shares)


def _check_microbatches(inputs: Sequence[torch.Tensor], batches: Sequence[batching.InputBatch], names: Sequence[str],
                        dp: int, k: int, field: str) -> None:
    """Raise unless every input's per-replica samples divide into ``k`` microbatches."""
    if k == 1:
        return
    for value, batch, name in zip(inputs, batches, names):
        count = batching.num_samples(value, batch)
        if count is None:
            continue
        rows = count // dp
        if rows == 0 or rows % k:
            raise ValueError(
                f"{name} has batch size {count}: {rows} rows per data-parallel "
                f"replica (dp={dp}), which do not divide into {field}.microbatches={k}; make the global "
                f"batch a multiple of {dp * k} or choose microbatches dividing {rows}"
            )


def _input_names_guess(n: int) -> list[str]:
    return [f"example_inputs[{i}]" for i in range(n)]
