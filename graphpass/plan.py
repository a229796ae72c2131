"""The plan: plain, frozen data that says how every node is parallelised.

A :class:`Strategy` is what a user writes: one uniform choice of degrees for the whole model
(``Strategy(dp=4)``). A :class:`Plan` is what passes consume: the device mesh, one
:class:`~graphpass.layout.TensorPlan` per input, parameter, buffer and the loss (keyed by the
node's stable name in the captured graph: its placement on each mesh axis, ZeRO stage, fused
parts, operator split and memory tier), the pipeline stages; its :class:`~graphpass.plan_report.PlanReport` (``Plan.report``) holds the planner's
predictions and reasons apart from that program. Plans round-trip through JSON, so a saved plan
replays without solving, and tests hand-write plans to drive single passes.

Placements are torch's objects (``torch.distributed.tensor``): ``Shard(dim)``, ``Replicate()``,
``Partial()``; in JSON they are those strings. A plan's JSON written before the per-tensor form
(``placements``, ``zero``, ``split`` keyed by the linear, ``tp_parts``) loads into it.
"""

from __future__ import annotations

import dataclasses

import json
import math
import os
import pathlib
from types import MappingProxyType
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from graphpass import batching, meta
from graphpass.layout import ACTIVATION_TIERS, ActivationPlan, Jagged, Split, TensorPlan, Tiers, placement_from_str, placement_to_str
from graphpass.mesh import ORDER, Mesh
from graphpass.ops import is_linear, linear_operands
from graphpass.plan_report import PlanReport
from graphpass import tables as tables_lib
from graphpass import compression as compression_lib
from graphpass.compression import GradCompression
from graphpass import diloco as diloco_lib
from graphpass.diloco import DiLoCo
from graphpass.tables import SparseOptimizer, TableSharding

#: What ``Strategy.offload`` may name, in the order it prints them.
OFFLOAD_KINDS = ("optimizer", "gradients", "parameters", "activations")
#: The only schedule names ``Strategy.schedule`` accepts (they map onto torch.distributed.pipelining).
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
#: DDP's default bucket size: large enough to amortise per-collective latency, small enough to
#: start communicating early in backward.
DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Choice:
    """What one block does inside the ``dp`` axis: its ZeRO stage, its OSDP operator-split
    factor, and whether its activations are recomputed in backward.

    Per operator (OSDP): with ``large_ops = k > 0`` only the parameters of the block's ``k``
    largest operators (by parameter bytes) take ``zero`` and ``split``; the other operators'
    parameters take ``rest_zero``. The planner picks such choices where sharding a layer's big
    matrices but not its norms and small projections fits the memory budget faster than any
    whole-block stage.

    A :class:`Strategy` makes the same choice for every block (:attr:`Strategy.choice`); the
    planner picks one per block; :func:`graphpass.plan_builder.plan_from_choices` turns either
    into a :class:`Plan`'s per-node ``zero``, ``split`` and ``recompute``.
    """

    zero: int = 0
    split: int = 1
    recompute: bool = False
    large_ops: int = 0
    rest_zero: int = 0
    tiers: Tiers = Tiers()
    saved_tier: str = "device"

    @property
    def mixed(self) -> bool:
        """Operators of the block take different ZeRO stages (``large_ops > 0``)."""
        return self.large_ops > 0

    def rest(self) -> "Choice":
        """The choice of the block's operators after its ``large_ops`` largest."""
        return Choice(self.rest_zero, 1, self.recompute, tiers=self.tiers, saved_tier=self.saved_tier)

    def __str__(self) -> str:
        parts = [f"zero-{self.zero}" if self.zero else "dp"]
        if self.mixed:
            parts[0] += f" on {self.large_ops} largest ops, " + (f"zero-{self.rest_zero}" if self.rest_zero else "dp")
        if self.split > 1:
            parts.append(f"split {self.split}")
        if self.recompute:
            parts.append("recompute")
        if self.tiers.offloaded:
            parts.append(str(self.tiers))
        if self.saved_tier != "device":
            parts.append(f"activations on {self.saved_tier}")
        return " + ".join(parts)


@dataclass(frozen=True)
class Strategy:
    """A uniform parallel strategy: the same choice for every layer.

    Args:
        dp: data-parallel degree (the batch is split ``dp`` ways).
        tp: tensor-parallel degree (Megatron column/row splits).
        pp: pipeline-parallel degree (ranks along the pipeline; stages ``pp * virtual_stages``).
        zero: ZeRO stage inside the dp axis: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters.
        split: OSDP operator-splitting factor for large linears; needs ``zero=3`` (each slice's
            weight is gathered right before it) and ``tp=1``.
        microbatches: microbatches per step (pipeline / gradient accumulation).
        schedule: pipeline schedule, one of :data:`SCHEDULES`.
        virtual_stages: stages per pipeline rank (``"interleaved_1f1b"``: at least 2,
            ``"zero_bubble"``: 1 or more; the model is cut into ``pp * virtual_stages`` stages,
            rank ``r`` running stages ``r, r + pp, ...``).
        recompute: activation checkpointing of every layer.
        sequence_parallel: with ``tp > 1``, shard norm/dropout/residual activations along the
            sequence (Megatron-LM sequence parallelism).
        ep: expert-parallel degree inside ``dp``: each Mixture-of-Experts layer's experts are
            sharded over groups of ``ep`` data-parallel ranks and tokens travel to their experts
            by all-to-all, while the batch stays split ``dp`` ways (``ep`` divides ``dp``; see
            ``docs/moe.md``).
        dp_shard: hierarchical data parallelism (HSDP; FSDP2's 2-D mesh): ZeRO shards inside
            groups of ``dp_shard`` consecutive data-parallel ranks (a node, preferably) and the
            ``dp // dp_shard`` groups hold replicas; gradients are reduce-scattered within a group
            and all-reduced across groups. Needs ``zero`` 1-3 and divides ``dp`` (with ``ep``,
            ``ep`` divides it). None: ZeRO shards over all of ``dp`` (see ``docs/sharding.md``).
        offload: what lives off the device, some of :data:`OFFLOAD_KINDS`: ``"optimizer"``
            (master weights and optimizer state; the optimizer steps there: ZeRO-Offload),
            ``"gradients"`` (each backward's gradients go down as they land), ``"parameters"``
            (the compute copy streams in ahead of each use, a window of layers at a time:
            STRONGHOLD), ``"activations"`` (each layer's saved activations wait in host memory
            for their backward). Gradients and parameters need ``"optimizer"`` too: the host
            keeps the master copy they stream from and to (see ``docs/offload.md``).
        offload_to: ``"host"`` or ``"disk"``: where the optimizer state and master weights go;
            the other kinds always go to host memory.
        offload_window: with ``"parameters"``: how many layers ahead the compute copy is
            streamed in (at least 1); None: 1.
        embeddings: how every embedding table (a weight only lookups read,
            :mod:`graphpass.tables`) is sharded over ``dp``: one of
            :data:`graphpass.tables.SHARDINGS` (table-wise tables go to the ranks largest first,
            each to the rank holding the fewest rows so far; table-row-wise ones so to the
            nodes, row-wise among a node's ranks, the cluster's devices per node); its gradient is then sparse and
            ``embedding_optimizer`` updates it. None: tables are ordinary weights.
        embedding_optimizer: the :class:`graphpass.SparseOptimizer` of the sharded tables
            (needed with ``embeddings``; the user's optimizer steps the other parameters).
        embedding_cache: HET's cache: the share of each table's rows every rank keeps of the
            other ranks' shards (hot rows, evicted by use count; ``TableSharding.cache``); 0:
            none. Needs ``embeddings`` row-, table- or column-wise.
        staleness: with a cache, how many steps old a cached row may be when read and how many
            steps late a row's gradient may reach the rank holding the row (HET's bounded
            staleness); 0 is exact, more trades exactness for fewer bytes moved.
        grad_compression: the data-parallel gradient buckets sent compressed, with error
            feedback (a :class:`graphpass.GradCompression`: PowerSGD or int8,
            :mod:`graphpass.compression`): fewer bytes a step, no longer one process's training.
            Plain data parallelism only (zero 0, no tp, ep, dp_shard or sharded tables). None:
            exact all-reduces.
        diloco: each data-parallel rank a DiLoCo worker (a :class:`graphpass.DiLoCo`): no
            gradient sync in the step, an outer step every ``inner_steps`` optimizer steps
            (:mod:`graphpass.diloco`); not one process's training. Plain data parallelism, or
            HSDP (``dp_shard`` with ``zero`` 1-3): each shard group a worker, synchronous inside,
            the outer step across the replicas.
        dp_shares: uneven data-parallel shares for unlike devices: one positive weight per dp
            rank (``(3, 3, 1, 1)``: the first two ranks take 3/8 of the batch each); the samples
            are cut in proportion and the loss weighted so training stays one process's (exact).
            None: equal shares. Not with pp, ep or sharded tables.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    split: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: bool = False
    sequence_parallel: bool = False
    virtual_stages: int = 1
    ep: int = 1
    dp_shard: int | None = None
    offload: tuple[str, ...] = ()
    offload_to: str = "host"
    offload_window: int | None = None
    embeddings: str | None = None
    embedding_optimizer: SparseOptimizer | None = None
    embedding_cache: float = 0.0
    staleness: int = 0
    grad_compression: GradCompression | None = None
    diloco: DiLoCo | None = None
    dp_shares: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        self._check_embeddings()
        for name in ("dp", "tp", "pp", "split", "microbatches", "virtual_stages", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Strategy.{name} must be a positive int, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Strategy.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Strategy.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("recompute", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Strategy.{name} must be a bool, got {getattr(self, name)!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("Strategy.sequence_parallel=True needs tp > 1 (it shards activations over the tp axis)")
        if self.dp % self.ep:
            raise ValueError(f"Strategy.ep={self.ep} must divide Strategy.dp={self.dp}: experts are sharded over "
                             f"groups of ep data-parallel ranks (e.g. Strategy(dp={self.ep * max(1, self.dp // self.ep)}, "
                             f"ep={self.ep}))")
        if self.dp_shard is not None:
            self._check_dp_shard()
        self._check_offload()
        if isinstance(self.grad_compression, Mapping):  # from a plan's JSON
            object.__setattr__(self, "grad_compression", GradCompression.from_json(self.grad_compression))
        compression_lib.check_strategy(self)
        if isinstance(self.diloco, Mapping):  # from a plan's JSON
            object.__setattr__(self, "diloco", DiLoCo.from_json(self.diloco))
        diloco_lib.check_strategy(self)
        self._check_dp_shares()
        if self.split > 1 and self.zero != 3:
            # The slices' only gain is that ZeRO-3 gathers each right before its linear and frees it
            # after (split_operators' contract); at stages 0-2 every weight is whole during the step,
            # so the slices would only add collectives. The planner offers split with ZeRO-3 alone.
            raise ValueError(
                f"Strategy.split={self.split} needs Strategy.zero=3 (got zero={self.zero}): operator splitting "
                "lowers the peak of gathered weights because ZeRO-3 gathers each slice right before its linear; "
                f"use Strategy(zero=3, split={self.split}) with dp > 1, or split=1")

    def __repr__(self) -> str:
        # dp_shard and offload only when set: a Strategy without them reads as before (users' golden files)
        fields = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        unset = {"dp_shard": None, "offload": (), "offload_to": "host", "offload_window": None, "embeddings": None,
                 "embedding_optimizer": None, "embedding_cache": 0.0, "staleness": 0, "grad_compression": None,
                 "diloco": None, "dp_shares": None}
        return "Strategy(" + ", ".join(f"{k}={v!r}" for k, v in fields if not (k in unset and v == unset[k])) + ")"

    def _check_embeddings(self) -> None:
        if isinstance(self.embedding_optimizer, Mapping):  # from a plan's JSON
            object.__setattr__(self, "embedding_optimizer", SparseOptimizer.from_json(self.embedding_optimizer))
        tables_lib.check_strategy(self)

    def _check_dp_shares(self) -> None:
        shares = self.dp_shares
        if shares is None:
            return
        if isinstance(shares, list):
            object.__setattr__(self, "dp_shares", shares := tuple(shares))
        if not isinstance(shares, tuple) or len(shares) != self.dp or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in shares):
            raise ValueError(f"Strategy.dp_shares must be {self.dp} positive weights, one per dp rank (e.g. the "
                             f"devices' speeds), got {shares!r}")
        unsupported = [f"{name}={getattr(self, name)}" for name, plain in
                       (("pp", 1), ("ep", 1), ("embeddings", None), ("diloco", None)) if getattr(self, name) != plain]
        if unsupported:
            raise NotImplementedError(f"Strategy.dp_shares (uneven shares) with {', '.join(unsupported)} is not built "
                                      "yet; drop those, or the shares")

    def _check_offload(self) -> None:
        offload = self.offload
        if isinstance(offload, str):
            offload = (offload,)
        if not isinstance(offload, (tuple, list, frozenset, set)):
            raise ValueError(f"Strategy.offload must be a tuple of {OFFLOAD_KINDS}, got {self.offload!r}")
        unknown = [kind for kind in offload if kind not in OFFLOAD_KINDS]
        if unknown:
            raise ValueError(f"Strategy.offload names {unknown[0]!r}, which is not a kind of tensor graphpass offloads; "
                             f"choose from {OFFLOAD_KINDS}")
        object.__setattr__(self, "offload", tuple(kind for kind in OFFLOAD_KINDS if kind in offload))
        if self.offload_to not in ("host", "disk"):
            raise ValueError(f"Strategy.offload_to must be 'host' or 'disk', got {self.offload_to!r}")
        streamed = [kind for kind in ("parameters", "gradients") if kind in self.offload]
        if streamed and "optimizer" not in self.offload:
            raise ValueError(f"Strategy.offload={self.offload!r} offloads {streamed[0]} but not the optimizer: the host "
                             f"keeps the master copy the {streamed[0]} stream from and to, so the optimizer steps "
                             f"there; use offload={tuple(sorted(set(self.offload) | {'optimizer'}, key=OFFLOAD_KINDS.index))!r}")
        window = self.offload_window
        if window is not None:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise ValueError(f"Strategy.offload_window must be a positive int (layers streamed in ahead) or None, "
                                 f"got {window!r}")
            if "parameters" not in self.offload:
                raise ValueError(f"Strategy.offload_window={window} sizes the window of parameters streamed in ahead of "
                                 "their use, but Strategy.offload does not offload 'parameters'; add it or drop the "
                                 "window")
        if "activations" in self.offload and self.recompute:
            raise ValueError("Strategy.offload has 'activations' and Strategy.recompute=True: a recomputed layer saves "
                             "only its input; choose one")

    @property
    def tiers(self) -> Tiers:
        """Where every trainable parameter's parts live under :attr:`offload`."""
        off = "host"
        return Tiers(parameter=off if "parameters" in self.offload else "device",
                     gradient=off if "gradients" in self.offload else "device",
                     optimizer=self.offload_to if "optimizer" in self.offload else "device")

    def _check_dp_shard(self) -> None:
        shard = self.dp_shard
        if not isinstance(shard, int) or isinstance(shard, bool) or shard < 1:
            raise ValueError(f"Strategy.dp_shard must be a positive int or None, got {shard!r}")
        if self.dp % shard:
            divisors = [d for d in range(2, self.dp + 1) if self.dp % d == 0]
            raise ValueError(f"Strategy.dp_shard={shard} must divide Strategy.dp={self.dp}: ZeRO shards inside groups "
                             f"of dp_shard data-parallel ranks and the dp // dp_shard groups are replicas; choose one "
                             f"of {divisors}")
        if self.zero == 0:
            raise ValueError(f"Strategy.dp_shard={shard} says how ZeRO shards (inside groups of {shard} ranks), but "
                             f"Strategy.zero=0 shards nothing; set zero=1, 2 or 3 (e.g. Strategy(dp={self.dp}, zero=3, "
                             f"dp_shard={shard})) or drop dp_shard")
        if shard == 1:
            raise ValueError(f"Strategy.dp_shard=1 shards nothing (each group is one rank) while zero={self.zero} asks "
                             f"for sharding; use zero=0 (plain data parallelism) or dp_shard > 1")
        if self.ep > 1 and shard % self.ep:
            raise ValueError(f"Strategy.ep={self.ep} must divide Strategy.dp_shard={shard}: the experts are sharded "
                             f"inside each group of dp_shard ranks; choose dp_shard a multiple of ep")

    @property
    def degree(self) -> int:
        """Number of devices the strategy occupies: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    @property
    def mesh(self) -> Mesh:
        """The ``pp x dp x tp`` mesh this strategy runs on (``dp_shard`` and ``ep`` inside ``dp``)."""
        return Mesh.of(pp=self.pp, dp=self.dp, tp=self.tp, ep=self.ep, dp_shard=self.dp_shard)

    @property
    def choice(self) -> Choice:
        """The per-block choice it makes for every block (no ZeRO without a ``dp`` axis)."""
        return Choice(self.zero if self.dp > 1 else 0, self.split, self.recompute, tiers=self.tiers,
                      saved_tier="host" if "activations" in self.offload else "device")

    def check(self, world_size: int) -> None:
        """Raise if this strategy cannot run on ``world_size`` ranks or uses an unbuilt feature.

        Raises:
            ValueError: ``dp * tp * pp != world_size``.
            NotImplementedError: a field asks for a capability graphpass does not have yet.
        """
        if self.degree != world_size:
            raise ValueError(
                f"Strategy dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.degree} devices, but "
                f"the cluster has world_size={world_size}; choose degrees whose product is {world_size}"
                + (f" (e.g. Strategy(dp={world_size}))" if self.tp == self.pp == 1 else "")
            )
        if self.pp > 1 or self.virtual_stages > 1:
            check_pipeline("Strategy", self.pp, self.schedule, self.microbatches, self.virtual_stages, self.dp,
                           self.sequence_parallel)
        if self.split > 1 and self.tp > 1:
            raise NotImplementedError(
                f"Strategy.split={self.split} with Strategy.tp={self.tp} is not implemented yet: operator splitting "
                "and tensor parallelism do not combine (a tp-sharded linear is not split); use split=1 or tp=1")


#: The pipeline schedules graphpass runs today (the others of :data:`SCHEDULES` raise).
RUNNING_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
#: The schedules that run several stages per rank.
INTERLEAVED = ("interleaved_1f1b",)
#: The schedules that may run several stages per rank and group the microbatches into rounds of
#: about ``pp`` (torch's interleaved 1F1B and interleaved zero-bubble, ZB1P, which also runs one).
ROUNDS = ("interleaved_1f1b", "zero_bubble")


def interleaved_rounds(microbatches: int, pp: int) -> int:
    """The rounds torch's interleaved schedules run the microbatches in, ``max(1, m // pp)``;
    each round holds ``m / rounds`` microbatches, so the rounds must be equal."""
    return max(1, microbatches // pp)


def check_pipeline(owner: str, pp: int, schedule: str, microbatches: int, virtual_stages: int, dp: int = 1,
                   sequence_parallel: bool = False) -> None:
    """Raise unless ``pp`` ranks (times ``dp`` replicas) can run ``virtual_stages`` stages each as
    ``owner`` asks (``Strategy`` or ``Plan``; a Plan's virtual stages are its stages per pipeline
    rank).

    Raises:
        NotImplementedError: a schedule graphpass does not run yet; zero-bubble on stage programs
            that reduce gradients inside the graph (``dp > 1``, or sequence parallelism).
        ValueError: 1F1B with fewer microbatches than stages; an interleaved schedule with one
            stage per rank, or microbatches it cannot group into rounds of ``pp``; several
            stages per rank with a schedule that runs one.
    """
    if pp == 1 and virtual_stages > 1:
        raise ValueError(f"{owner}.virtual_stages={virtual_stages} needs pipeline stages: use pp > 1 "
                         "(or virtual_stages=1)")
    if schedule not in RUNNING_SCHEDULES:
        raise NotImplementedError(
            f"{owner}.schedule={schedule!r} is not implemented yet; graphpass runs {RUNNING_SCHEDULES}")
    if schedule == "zero_bubble" and (dp > 1 or sequence_parallel):
        # The engine's split backward computes weight gradients with torch.autograd.grad up to the
        # weights and adds them to .grad itself. Gradients graphpass reduces inside the graph (the
        # data-parallel buckets and ZeRO groups; sequence-parallel norm weights' partial sums over
        # tp) pass through autograd Functions between a weight and its uses that write .grad once
        # per step; the split weight backward bypasses them (it fails: "not used in the graph").
        reducing = f"dp={dp}" if dp > 1 else "sequence_parallel=True"
        raise NotImplementedError(
            f"{owner}.schedule='zero_bubble' with {owner}.{reducing} is not implemented yet: the engine's split "
            "weight backward bypasses the gradient reduction graphpass puts in the graph; use zero_bubble with "
            "pp and tp only, or schedule='1f1b' / 'interleaved_1f1b'"
        )
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(
            f"{owner}.schedule='1f1b' needs at least as many microbatches as stages: {owner}.microbatches="
            f"{microbatches} < pp={pp}; use {owner}.microbatches >= {pp} (or schedule='gpipe')"
        )
    if schedule in INTERLEAVED and virtual_stages < 2:
        raise ValueError(
            f"{owner}.schedule={schedule!r} interleaves several stages per rank, but {owner}.virtual_stages="
            f"{virtual_stages}; use virtual_stages >= 2 (or schedule='1f1b' for one stage per rank)"
        )
    if schedule in ROUNDS:
        rounds = interleaved_rounds(microbatches, pp)
        if microbatches % rounds:
            raise ValueError(
                f"{owner}.schedule={schedule!r} runs microbatches in {rounds} equal rounds of about pp={pp}, "
                f"which {owner}.microbatches={microbatches} does not divide into; use a multiple of pp={pp} "
                f"or fewer microbatches than {2 * pp}"
            )
    elif virtual_stages != 1:
        raise ValueError(
            f"{owner}.virtual_stages={virtual_stages} needs a schedule that runs several stages per rank "
            f"({', '.join(ROUNDS)}); {owner}.schedule={schedule!r} runs one stage per rank"
        )


#: The mesh axes graphpass builds and passes read (:data:`graphpass.mesh.ORDER`).
MESH_AXES = ORDER
#: The reductions a ``Partial`` placement may pend: the loss is ``Partial(avg)`` over dp, tp's
#: partial products are sums.
PARTIAL_OPS = ("sum", "avg")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parse_placement(field: str, text: Any) -> Placement:
    """``text`` parsed for ``field`` (``Plan.placements['x']['dp']``); what it means is checked
    with every placement of the plan (:func:`_check_placement`)."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a placement string ('Shard(d)', 'Replicate()' or 'Partial(avg)'), "
                         f"got {text!r}")
    try:
        return placement_from_str(text)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


def _check_placement(field: str, placement: Any) -> None:
    """A placement graphpass can mean: torch's, no dim counted from the end, no reduction other
    than :data:`PARTIAL_OPS`."""
    if not isinstance(placement, (Shard, Replicate, Partial)):
        raise ValueError(f"{field} must be a torch Shard(d), Replicate() or Partial() placement, got {placement!r}")
    if isinstance(placement, Shard) and placement.dim < 0:
        raise ValueError(f"{field}: {placement_to_str(placement)} counts the dim from the end; write it counted "
                         "from 0 (Shard(1) for the last dim of a 2-D tensor)")
    if isinstance(placement, Partial) and placement.reduce_op not in PARTIAL_OPS:
        raise ValueError(f"{field}: {placement_to_str(placement)} is not a reduction graphpass pends; use Partial() "
                         "(a sum) or Partial(avg)")


#: What a plan says of a tensor it does not name: whole, replicated on every axis.
_WHOLE = TensorPlan()

#: The fields of a plan's JSON before the per-tensor form: each now a part of ``Plan.tensors``.
LEGACY_TENSOR_FIELDS = ("placements", "zero", "split", "tp_parts")


def _legacy_tensors(data: Mapping[str, Any]) -> dict[str, TensorPlan]:
    """``Plan.tensors`` from a plan JSON's ``placements``, ``zero``, ``split`` (keyed by the
    linear, which :meth:`Plan.splits` reads as its weight's) and ``tp_parts``."""
    for name in LEGACY_TENSOR_FIELDS:
        if name in data and not isinstance(data[name], Mapping):
            if name == "placements":
                raise ValueError(f"Plan.placements must map node names to {{axis: placement}}, got {data[name]!r}")
            raise ValueError(f"Plan.{name} must be an object (a mapping), got {data[name]!r}")
    entries: dict[str, dict[str, Any]] = {}
    for field_name, key in (("placements", "placements"), ("zero", "zero"), ("split", "split"), ("tp_parts", "parts")):
        for node, value in data.get(field_name, {}).items():
            entries.setdefault(node, {})[key] = value
    return {node: _tensor_from_json(node, entry) for node, entry in entries.items()}


def _activations_from_json(data: Any) -> dict[int, ActivationPlan]:
    """A plan JSON's ``activations``: ``{"3": {"recompute": true}}`` (layer indices as keys)."""
    known = ("recompute", "tier")
    if not isinstance(data, Mapping):
        raise ValueError(f"Plan.activations must map layer indices to their entries, got {data!r}")
    out = {}
    for key, entry in data.items():
        if not (isinstance(key, int) or (isinstance(key, str) and key.isdigit())):
            raise ValueError(f"Plan.activations has key {key!r}; its keys are repeated layer indices (0, 1, ...)")
        if not isinstance(entry, Mapping) or set(entry) - set(known):
            raise ValueError(f"Plan.activations[{key}] must be an object with some of {list(known)}, got {entry!r}")
        out[int(key)] = ActivationPlan(entry.get("recompute", False), entry.get("tier", "device"))
    return out


def _bad_split(node: str, spec: Any) -> ValueError:
    return ValueError(f"Plan.split[{node!r}] must be {{'dim': 'out' | 'in', 'parts': k >= 1}}, got {spec!r}")


def _tensor_from_json(node: str, data: Any) -> TensorPlan:
    """One entry of a plan JSON's ``tensors`` (see :meth:`TensorPlan.to_json`)."""
    known = ("placements", "zero", "parts", "split", "tiers", "tier", "jagged", "table")
    if not isinstance(data, Mapping) or set(data) - set(known):
        raise ValueError(f"Plan.tensors[{node!r}] must be an object with some of {list(known)}, got {data!r}")
    by_axis, spec = data.get("placements", {}), data.get("split")
    if not isinstance(by_axis, Mapping):
        raise ValueError(f"Plan.placements[{node!r}] must map mesh axes to placements, e.g. "
                         f"{{'dp': 'Shard(0)'}}, got {by_axis!r}")
    if spec is not None and not (isinstance(spec, Mapping) and set(spec) == {"dim", "parts"}):
        raise _bad_split(node, spec)
    parts = data.get("parts", ())
    return TensorPlan(
        {axis: _parse_placement(f"Plan.placements[{node!r}][{axis!r}]", text) for axis, text in by_axis.items()},
        data.get("zero", 0), tuple(parts) if isinstance(parts, (list, tuple)) else parts,
        None if spec is None else Split(spec["dim"], spec["parts"]), _tiers_from_json(node, data),
        _jagged_from_json(node, data.get("jagged")),
        None if data.get("table") is None else TableSharding.from_json(data["table"]))


def _jagged_from_json(node: str, data: Any) -> Jagged | None:
    """An input entry's ``jagged`` (``{"offsets": "offsets_0", "include_last_offset": false}``)."""
    if data is None:
        return None
    if not (isinstance(data, Mapping) and isinstance(data.get("offsets"), str)
            and set(data) <= {"offsets", "include_last_offset"}
            and isinstance(data.get("include_last_offset", False), bool)):
        raise ValueError(f"Plan.tensors[{node!r}].jagged must be {{'offsets': <input name>, "
                         f"'include_last_offset': true | false}}, got {data!r}")
    return Jagged(data["offsets"], data.get("include_last_offset", False))


def _tiers_from_json(node: str, data: Mapping[str, Any]) -> Tiers:
    """An entry's ``tiers`` (``{"optimizer": "host"}``); ``"tier": "device"`` of a plan written
    before offload reads as every part on the device."""
    try:
        return Tiers.from_json(data.get("tiers", data.get("tier", "device")))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Plan.tensors[{node!r}].tiers: {exc}") from None


#: The Plan field that is the planner's account, not the program (``Plan.report``):
#: ``Plan.diff`` and golden program texts leave it out.
PREDICTIONS = ("report",)


@dataclass(frozen=True)
class Plan:
    """How to run one captured graph on a mesh.

    Attributes:
        mesh: the :class:`~graphpass.mesh.Mesh` (ordered axes and sizes; a ``{"dp": 4}`` mapping
            is accepted and converted); the product is the world size.
        tensors: node name → :class:`~graphpass.layout.TensorPlan` for every input, parameter,
            buffer and the loss: its placement per mesh axis, ZeRO stage inside ``dp`` (OSDP mixes
            stages freely), fused parts on ``tp``, the operator split of the linear a weight
            feeds, and its memory tier. :attr:`placements`, :attr:`zero`, :attr:`split` and
            :attr:`tp_parts` read one part of every entry.
        stages: node names of each pipeline stage's first node (one stage: ``("*",)``).
        strategy: the uniform strategy this plan was made from, if any.
        activations: repeated layer index → :class:`~graphpass.layout.ActivationPlan`, what the
            plan says of the activations the layer saves for backward: recomputed in backward
            (activation checkpointing) instead of saved, and their memory tier; a layer not
            named saves them on the device. :attr:`recompute` lists the recomputed layers.
        sequence_parallel: Megatron sequence parallelism on the ``tp`` axis: partial sums that
            join the residual stream are reduce-scattered along dim 1 instead of all-reduced.
        bucket_cap_bytes: size cap of one gradient all-reduce bucket.
        microbatches: microbatches per step (pipeline / gradient accumulation).
        schedule: the pipeline schedule (one of :data:`SCHEDULES`), with ``pp`` in the mesh.
        capacity_factor: the capacity factor ``compile`` gives every ``graphpass.nn.MoE`` layer
            before capturing (the planner's choice within the user's drop budget:
            ``gp.plan(..., capacity_factors=, max_dropped=)``); None is dropless; ``"model"``
            (the default) keeps each layer's own.
        ep_all_to_all: how expert parallelism's exchanges run: ``"flat"`` (one all-to-all over
            the ``ep`` group) or ``"hierarchical"`` (two-level, Tutel's 2DH: within each node,
            then one message per node pair; for ``ep`` groups spanning nodes of the cluster
            given to ``compile``). The planner picks the cheaper by its link model.
        offload_window: for parameters whose compute copy lives on the host
            (``Tiers(parameter="host")``): how many layers ahead of its use a layer's copy is
            streamed in (STRONGHOLD's working window).
        embedding_optimizer: the sparse optimizer of the embedding tables the plan shards (a
            :attr:`TensorPlan.table`), applied to the rows each step touches.
        grad_compression: the data-parallel gradient buckets go compressed with error feedback
            (:class:`graphpass.GradCompression`; inexact); None: exact all-reduces.
        diloco: the data-parallel ranks (under HSDP, the shard groups) are DiLoCo workers
            (:class:`graphpass.DiLoCo`; inexact): no gradient sync across workers, an outer step
            every ``inner_steps`` optimizer steps.
        dp_shares: uneven data-parallel shares: how many of the global batch's samples each dp
            rank takes (summing to the batch; ``compile`` turns ``Strategy.dp_shares``' weights
            into these); None: equal shares.
        report: the planner's predictions and reasons (:class:`~graphpass.plan_report.PlanReport`;
            empty for a plan it did not price).
    """

    mesh: Mesh
    tensors: Mapping[str, TensorPlan] = field(default_factory=dict)
    stages: tuple[str, ...] = ("*",)
    strategy: Strategy | None = None
    activations: Mapping[int, ActivationPlan] = field(default_factory=dict)
    sequence_parallel: bool = False
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES
    microbatches: int = 1
    schedule: str = "1f1b"
    ep_all_to_all: str = "flat"
    capacity_factor: float | str | None = "model"
    offload_window: int = 1
    embedding_optimizer: SparseOptimizer | None = None
    grad_compression: GradCompression | None = None
    diloco: DiLoCo | None = None
    dp_shares: tuple[int, ...] | None = None
    report: PlanReport = field(default_factory=PlanReport)

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            try:
                object.__setattr__(self, "mesh", Mesh(self.mesh))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"Plan.mesh: {exc}") from None
        unknown = [axis for axis in self.mesh if axis not in MESH_AXES]
        if unknown:
            raise ValueError(f"Plan.mesh has axis {unknown[0]!r}, which graphpass does not know; its axes are "
                             "'pp' (pipeline), 'dp' (data), 'ep' (experts, inside dp) and 'tp' (tensor)")
        self._check_tensors()
        self._check_stages()
        self._check_sync()
        if self.strategy is not None:
            if not isinstance(self.strategy, Strategy):
                raise ValueError(f"Plan.strategy must be a graphpass.Strategy or None, got {self.strategy!r}")
            if self.strategy.mesh != self.mesh:
                raise ValueError(
                    f"Plan.strategy ({self.strategy.mesh}) disagrees with Plan.mesh ({self.mesh}): compile runs the "
                    "plan's own fields and checks the strategy it was made from; make the two agree, or set "
                    "Plan.strategy to None (null in JSON)")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"Plan.sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.mesh.size("tp") == 1:
            raise ValueError(f"Plan.sequence_parallel=True shards activations over the 'tp' axis, but Plan.mesh has "
                             f"tp=1 ({dict(self.mesh)}); set it to false or use a mesh with tp > 1")
        if not _is_int(self.bucket_cap_bytes) or self.bucket_cap_bytes < 1:
            raise ValueError(f"Plan.bucket_cap_bytes must be a positive number of bytes, got {self.bucket_cap_bytes!r} "
                             f"(DDP's default is {DEFAULT_BUCKET_CAP_BYTES}, 25 MiB)")
        if not _is_int(self.microbatches) or self.microbatches < 1:
            raise ValueError(f"Plan.microbatches must be a positive int, got {self.microbatches!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Plan.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if isinstance(self.dp_shares, list):
            object.__setattr__(self, "dp_shares", tuple(self.dp_shares))
        if self.dp_shares is not None and (
                not isinstance(self.dp_shares, tuple) or len(self.dp_shares) != self.mesh.dp
                or not all(_is_int(c) and c > 0 for c in self.dp_shares) or self.mesh.pp > 1 or self.mesh.ep > 1):
            raise ValueError(f"Plan.dp_shares must be {self.mesh.dp} positive sample counts, one per dp rank, on a "
                             f"mesh without pp or ep; got {self.dp_shares!r} on {dict(self.mesh)}")
        if self.ep_all_to_all not in ("flat", "hierarchical"):
            raise ValueError(f"Plan.ep_all_to_all must be 'flat' or 'hierarchical', got {self.ep_all_to_all!r}")
        if self.ep_all_to_all == "hierarchical" and self.mesh.ep == 1:
            raise ValueError(f"Plan.ep_all_to_all='hierarchical' says how experts' all-to-alls run, but Plan.mesh has "
                             f"no 'ep' axis ({dict(self.mesh)}); use 'flat'")
        cf = self.capacity_factor
        if not (cf is None or cf == "model" or (_is_number(cf) and cf > 0)):
            raise ValueError(f"Plan.capacity_factor must be a positive number, None (dropless) or 'model', got {cf!r}")
        if not _is_int(self.offload_window) or self.offload_window < 1:
            raise ValueError(f"Plan.offload_window must be a positive int (layers streamed in ahead), got "
                             f"{self.offload_window!r}")
        if not isinstance(self.activations, Mapping):
            raise ValueError(f"Plan.activations must map layer indices to ActivationPlans, got {self.activations!r}")
        for layer, saved in self.activations.items():
            if not _is_int(layer) or layer < 0:
                raise ValueError(f"Plan.recompute entries must be layer indices >= 0, got {layer!r}")
            if not isinstance(saved, ActivationPlan) or not isinstance(saved.recompute, bool):
                raise ValueError(f"Plan.activations[{layer}] must be a graphpass.layout.ActivationPlan, got {saved!r}")
            if saved.tier not in ACTIVATION_TIERS:
                extra = " (disk holds master weights and optimizer state only)" if saved.tier == "disk" else ""
                raise ValueError(f"Plan.activations[{layer}].tier must be one of {ACTIVATION_TIERS}, got "
                                 f"{saved.tier!r}{extra}")
            if saved.recompute and saved.tier != "device":
                raise ValueError(f"Plan.activations[{layer}] is recomputed and saved in {saved.tier!r} memory: a "
                                 "recomputed layer saves only its inputs; choose one (recompute or tier='host')")
        if not isinstance(self.report, PlanReport):
            raise ValueError(f"Plan.report must be a graphpass PlanReport, got {self.report!r}")
        tables_lib.check_plan(self)

    def _check_sync(self) -> None:
        """The inexact synchronisations and uneven shares on what they are built for (a Plan
        written by hand, not only from a Strategy)."""
        for name, kind in (("grad_compression", GradCompression), ("diloco", DiLoCo)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"Plan.{name} must be a graphpass.{kind.__name__} or None, got {value!r}")
        tables = any(t.table is not None for t in self.tensors.values())
        if self.dp_shares is not None and tables:
            raise NotImplementedError("Plan.dp_shares (uneven shares) with sharded embedding tables is not built yet")
        used = [name for name in ("grad_compression", "diloco") if getattr(self, name) is not None]
        if not used:
            return
        # DiLoCo's workers may be HSDP's shard groups: ZeRO inside each, the outer step across;
        # int8 may compress HSDP's hop across the replicas of ZeRO-2/3 groups
        stages = {t.zero for t in self.tensors.values() if t.zero}
        on_hsdp = self.diloco is not None and diloco_lib.worker_axis(self.mesh) is not None or (
            self.diloco is None and "dp_shard" in self.mesh and stages
            and all(compression_lib.across_replicas(self.grad_compression, z) for z in stages))
        beyond = [f"{axis}={self.mesh[axis]}" for axis in ("pp", "tp", "ep", "dp_shard")
                  if axis in self.mesh and self.mesh[axis] > 1
                  and not (axis == "dp_shard" and (self.mesh[axis] == self.mesh.dp or on_hsdp))]
        beyond += [] if on_hsdp else [f"ZeRO-{stage} parameters" for stage in sorted(stages)]
        beyond += ["sharded embedding tables"] if tables else []
        beyond += ["both grad_compression and diloco"] if len(used) > 1 else []
        beyond += ["uneven dp_shares"] if self.diloco is not None and self.dp_shares is not None else []
        if beyond:
            raise NotImplementedError(f"Plan.{used[0]} runs on plain data parallelism only (diloco: or HSDP, its "
                                      f"shard groups the workers); this plan has "
                                      f"{', '.join(beyond)}: not built yet")

    def _check_tensors(self) -> None:
        if not isinstance(self.tensors, Mapping):
            raise ValueError(f"Plan.tensors must map node names to TensorPlans, got {self.tensors!r}")
        for node, tensor in self.tensors.items():
            if not isinstance(tensor, TensorPlan):
                raise ValueError(f"Plan.tensors[{node!r}] must be a graphpass.layout.TensorPlan, got {tensor!r}")
            for axis, placement in tensor.placements.items():
                if axis not in self.mesh:
                    raise ValueError(f"Plan.placements[{node!r}] uses mesh axis {axis!r}, which is not in "
                                     f"Plan.mesh {dict(self.mesh)}")
                _check_placement(f"Plan.placements[{node!r}][{axis!r}]", placement)
            stage = tensor.zero
            if not _is_int(stage) or stage not in (0, 1, 2, 3):
                raise ValueError(f"Plan.zero[{node!r}] must be 0, 1, 2 or 3, got {stage!r}")
            if stage and "dp" not in self.mesh:
                raise ValueError(f"Plan.zero[{node!r}] = {stage} needs a 'dp' mesh axis; mesh is {dict(self.mesh)}")
            if stage and self.mesh.dp == 1:
                raise ValueError(f"Plan.zero[{node!r}] = {stage} shards over the data-parallel ranks, but Plan.mesh has "
                                 f"dp=1 ({dict(self.mesh)}): there is nothing to shard over; drop the entry (stage 0) "
                                 "or use a mesh with dp > 1")
            spec = tensor.split
            if spec is not None and not (isinstance(spec, Split) and spec.dim in ("out", "in")
                                         and _is_int(spec.parts) and spec.parts >= 1):
                raise _bad_split(node, spec)
            parts = tensor.parts
            if not isinstance(parts, tuple) or not all(_is_int(n) and n > 0 for n in parts):
                raise ValueError(f"Plan.tp_parts[{node!r}] must be positive part sizes, got {parts!r}")
            if parts and not isinstance(tensor.placement("tp"), Shard):
                raise ValueError(f"Plan.tp_parts names {node!r}, which is not Shard(d) on a 'tp' axis; "
                                 "fused parts apply to column-parallel weights")
            if not isinstance(tensor.tiers, Tiers):
                raise ValueError(f"Plan.tensors[{node!r}].tiers must be a graphpass.Tiers, got {tensor.tiers!r}")

    def _check_stages(self) -> None:
        stages = self.stages
        if not stages or not all(isinstance(s, str) and s for s in stages):
            raise ValueError(f"Plan.stages must be a list of node names (one stage: ['*']), got {list(stages)!r}")
        if stages[0] != "*" or "*" in stages[1:] or len(set(stages)) != len(stages):
            raise ValueError(f"Plan.stages must be '*' (the graph's start) followed by the first op of each later "
                             f"stage, each named once, got {list(stages)!r}")
        if self.mesh.pp == 1 and len(stages) > 1:
            raise ValueError(f"Plan.stages has {len(stages)} stages, but Plan.mesh has no 'pp' axis ({dict(self.mesh)}), "
                             "so no pipeline would run them; use stages ['*'] or a mesh with pp > 1")
        if self.mesh.pp > 1 and len(stages) % self.mesh.pp:
            raise ValueError(f"Plan.stages has {len(stages)} stages, which pp={self.mesh.pp} ranks cannot share "
                             "equally; give pp x virtual stages per rank")

    @property
    def world_size(self) -> int:
        """Product of the mesh sizes."""
        return self.mesh.world_size

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per ``pp`` rank (several under an interleaved schedule)."""
        return max(1, len(self.stages) // self.mesh.pp)

    def tensor(self, node: str) -> TensorPlan:
        """What the plan says of ``node`` (a whole, replicated tensor where it says nothing)."""
        return self.tensors.get(node, _WHOLE)

    def with_tensor(self, node: str, **changes: Any) -> "Plan":
        """This plan with ``node``'s entry changed as ``changes`` say (the fields of
        :class:`~graphpass.layout.TensorPlan`: ``placements``, ``zero``, ``parts``, ``split``,
        ``tiers``, ``jagged``), checked as any plan is: ``plan.with_tensor("h_0_mlp_up_weight", zero=3)``."""
        return replace(self, tensors={**self.tensors, node: replace(self.tensor(node), **changes)})

    def placement(self, node: str, axis: str) -> Placement:
        """Placement of ``node`` on ``axis`` (Replicate when the plan does not mention it)."""
        return self.tensor(node).placement(axis)

    @property
    def recompute(self) -> tuple[int, ...]:
        """The repeated layers whose activations are recomputed in backward, in order."""
        return tuple(sorted(layer for layer, saved in self.activations.items() if saved.recompute))

    # Read-only views of one part of every entry: assigning into them raises (edit with
    # with_tensor), rather than changing a copy nobody reads.

    @property
    def placements(self) -> Mapping[str, Mapping[str, Placement]]:
        """Each tensor's placements: node name → {axis → placement}."""
        return MappingProxyType({node: MappingProxyType(dict(t.placements)) for node, t in self.tensors.items()})

    @property
    def zero(self) -> Mapping[str, int]:
        """Each ZeRO-sharded parameter's stage: node name → 1, 2 or 3."""
        return MappingProxyType({node: t.zero for node, t in self.tensors.items() if t.zero})

    @property
    def split(self) -> Mapping[str, Split]:
        """Each operator split: the weight's node name (the linear's, in a plan JSON written
        before the per-tensor form) → :class:`~graphpass.layout.Split`."""
        return MappingProxyType({node: t.split for node, t in self.tensors.items() if t.split is not None})

    @property
    def tp_parts(self) -> Mapping[str, tuple[int, ...]]:
        """Each fused tensor-parallel weight's part sizes."""
        return MappingProxyType({node: t.parts for node, t in self.tensors.items() if t.parts})

    def splits(self, gm: fx.GraphModule) -> dict[str, Split]:
        """The operator splits as the nodes of ``gm`` to split, by node name: a split on a weight
        is its linear's (each linear reading it); one on a linear (a plan JSON written before the
        per-tensor form keyed it so) is that linear's; any other name is kept as it is, for
        ``split_operators`` to refuse naming it."""
        named = self.split
        out, weights = {}, set()
        for node in gm.graph.nodes:
            if not is_linear(node):
                continue
            weight = linear_operands(node)[1]
            key = meta.plan_name(weight) if isinstance(weight, fx.Node) else None
            if key in named:
                out[node.name] = named[key]
                weights.add(key)
        return {**{name: spec for name, spec in named.items() if name not in weights}, **out}

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (what ``to_json`` writes)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["mesh"] = dict(self.mesh)
        data["tensors"] = {node: t.to_json() for node, t in self.tensors.items()}
        data["stages"] = list(self.stages)
        data["strategy"] = None if self.strategy is None else asdict(self.strategy)
        data["activations"] = {str(layer): saved.to_json() for layer, saved in self.activations.items()}
        data["report"] = self.report.to_dict()
        data["embedding_optimizer"] = None if self.embedding_optimizer is None else self.embedding_optimizer.to_json()
        data["grad_compression"] = None if self.grad_compression is None else self.grad_compression.to_json()
        data["diloco"] = None if self.diloco is None else self.diloco.to_json()
        data["dp_shares"] = None if self.dp_shares is None else list(self.dp_shares)
        return data

    def to_json(self, indent: int | None = 1) -> str:
        """JSON text; ``Plan.from_json(plan.to_json()) == plan``."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`: unknown keys, a missing ``mesh`` or ``placements``, and
        values of the wrong kind are errors naming the field. A plan written before the report
        was its own type (its predictions at the top level) loads too."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a Plan's JSON must be an object of its fields, got {type(data).__name__}")
        data = PlanReport.take_legacy(data)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - set(LEGACY_TENSOR_FIELDS) - {"recompute"}
        if unknown:
            raise ValueError(f"unknown Plan fields {sorted(unknown)}; known fields: {sorted(known)}")
        legacy = [name for name in LEGACY_TENSOR_FIELDS if name in data]
        if legacy and "tensors" in data:
            raise ValueError(f"the Plan gives both 'tensors' and {legacy}, which a plan wrote before 'tensors' held "
                             "them; give each tensor's placements, zero, parts and split in its 'tensors' entry")
        missing = [name for name in ("mesh",) if name not in data] + (
            [] if "tensors" in data or "placements" in data else ["tensors"])
        if missing:
            raise ValueError(
                f"the Plan lacks {' and '.join(repr(m) for m in missing)}: a plan gives its 'mesh' ({{\"dp\": 2}}) and "
                "'tensors' (every input, parameter and the loss: node name -> {'placements': {axis: placement}, ...}); "
                "start from one that graphpass wrote (gp.plan(...).to_json(), GRAPHPASS_DUMP_DIR's plan.json)")
        kwargs = {k: v for k, v in data.items() if k not in LEGACY_TENSOR_FIELDS}
        if legacy:
            kwargs["tensors"] = _legacy_tensors(data)
        elif not isinstance(kwargs["tensors"], Mapping):
            raise ValueError(f"Plan.tensors must map node names to their entries, got {kwargs['tensors']!r}")
        else:
            kwargs["tensors"] = {node: _tensor_from_json(node, entry) for node, entry in kwargs["tensors"].items()}
        if isinstance(kwargs.get("strategy"), Mapping):
            try:
                kwargs["strategy"] = Strategy(**kwargs["strategy"])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"Plan.strategy: {exc}") from None
        if "report" in kwargs:
            kwargs["report"] = PlanReport.from_dict(kwargs["report"])
        if kwargs.get("embedding_optimizer") is not None:
            kwargs["embedding_optimizer"] = SparseOptimizer.from_json(kwargs["embedding_optimizer"])
        if kwargs.get("grad_compression") is not None:
            kwargs["grad_compression"] = GradCompression.from_json(kwargs["grad_compression"])
        if kwargs.get("diloco") is not None:
            kwargs["diloco"] = DiLoCo.from_json(kwargs["diloco"])
        for name in ("stages", "recompute"):
            if name in kwargs:
                if not isinstance(kwargs[name], (list, tuple)):
                    raise ValueError(f"Plan.{name} must be a list, got {kwargs[name]!r}")
                kwargs[name] = tuple(kwargs[name])
        if "recompute" in kwargs:  # written before Plan.activations held it
            if "activations" in kwargs:
                raise ValueError("the Plan gives both 'activations' and 'recompute', which a plan wrote before "
                                 "'activations' held it; mark each layer's entry {'recompute': true} instead")
            kwargs["activations"] = {layer: ActivationPlan(recompute=True) for layer in kwargs.pop("recompute")}
        elif "activations" in kwargs:
            kwargs["activations"] = _activations_from_json(kwargs["activations"])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Parse a plan written by :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def check_graph(self, gm: fx.GraphModule) -> None:
        """Raise unless this plan fits ``gm``, the graph captured from the model it is compiled
        for: every placement names a node of the graph and means something there (a dim within the
        tensor's rank; inputs split along their batch dim over ``dp``, all alike, as the capture at
        a rank's share of the batch assumes; parameters and buffers whole or sharded on ``tp`` and
        ``ep``, never by placement on ``dp``, where ZeRO shards them through :attr:`zero`; the loss
        ``Partial(avg)`` on ``dp``). ``compile`` and ``verify`` call it before any pass runs; the
        passes check the rest (``Plan.stages``, ``Plan.zero``, ``Plan.split``, ``Plan.recompute``
        against the nodes they name).

        Raises:
            ValueError: naming each misplaced entry (``Plan.placements['fc1_weight']['dp']: Shard(5)
                on a 2-D tensor ...``) and what to change.
        """
        nodes = {n.name: n for n in gm.graph.nodes}
        unknown = [name for name in self.placements if name not in nodes]
        if unknown:
            raise ValueError(
                f"the Plan places nodes {unknown[:5]} that are not in the captured graph of this model "
                "(was the plan made for another model or batch shape?)"
            )
        problems = batching.problems(self, [n for n in gm.graph.nodes if n.op == "placeholder"])
        output = gm.graph.find_nodes(op="output")[0]
        role = meta.get(output, meta.ROLE, {})
        loss = output.args[0][role["loss"]] if "loss" in role else None
        for name, by_axis in self.placements.items():
            node = nodes[name]
            if node.op == "placeholder":
                continue
            if self.tensor(name).jagged is not None:
                problems.append(f"Plan.tensors[{name!r}].jagged: {_describe(node)} is not an input; only inputs are "
                                "cut at offsets (leave jagged out)")
            if node.op == "get_attr":
                problems += (tables_lib.problems(self, node) if self.tensor(name).table is not None
                             else _stored_problems(self, node, by_axis))
            elif node is loss:
                problems += _loss_problems(self, node, by_axis)
            elif by_axis:
                problems.append(
                    f"Plan.placements[{name!r}]: {_describe(node)} is neither an input, a parameter or buffer, nor "
                    "the loss, and graphpass derives every other value's placement from those: the entry would "
                    "be ignored; leave it out")
        if problems:
            raise ValueError(problems[0] if len(problems) == 1 else (
                f"the Plan does not fit this model's graph ({len(problems)} problems):\n  " + "\n  ".join(problems)))

    # ------------------------------------------------------------------ reading

    def explain(self) -> str:
        """A readable account: the mesh, what each kind of node gets, predictions and reasons."""
        lines = [f"mesh: {self.mesh} ({self.world_size} devices)"]
        if self.strategy is not None:
            lines.append(f"strategy: {self.strategy}")
        groups: dict[str, list[str]] = {}
        for node, by_axis in self.placements.items():
            key = ", ".join(f"{a}: {placement_to_str(p)}" for a, p in by_axis.items())
            groups.setdefault(key, []).append(node)
        for key, nodes in groups.items():
            shown = ", ".join(nodes[:4]) + (f", ... ({len(nodes)} nodes)" if len(nodes) > 4 else "")
            lines.append(f"  [{key}] {shown}")
        stages: dict[int, int] = {}
        for stage in self.zero.values():
            stages[stage] = stages.get(stage, 0) + 1
        if stages:
            lines.append("ZeRO: " + ", ".join(f"stage {s}: {n} parameters" for s, n in sorted(stages.items())))
        if self.recompute:
            lines.append(f"recompute layers: {list(self.recompute)}")
        if self.sequence_parallel:
            lines.append("sequence parallel: residual-stream activations sharded along the sequence on tp")
        if self.tp_parts:
            lines.append(f"fused projections sharded per part on tp: {len(self.tp_parts)} weights and biases")
        if "dp_shard" in self.mesh:
            shard = self.mesh.dp_shard
            lines.append(f"hierarchical data parallel: ZeRO shards inside groups of dp_shard={shard} ranks, replicated "
                         f"over {self.mesh.dp // shard} groups (gradients reduce-scattered within a group, then "
                         f"all-reduced across groups)")
        if self.mesh.ep > 1:
            lines.append(f"experts sharded over ep={self.mesh.ep} (inside dp={self.mesh.dp}); exchanges "
                         + ("two-level (within nodes, then between them)" if self.ep_all_to_all == "hierarchical"
                            else "flat all-to-all"))
        if self.capacity_factor != "model":
            lines.append("MoE capacity factor: " + ("dropless" if self.capacity_factor is None
                                                    else f"{self.capacity_factor:g}") + " (set by the plan)")
        if self.split:
            parts = sorted({spec.parts for spec in self.split.values()})
            lines.append(f"operator splitting: {len(self.split)} linears into {parts} slices")
        lines.append(f"pipeline stages: {len(self.stages)}" + (
            f", {self.microbatches} microbatches" if self.microbatches > 1 else ""))
        lines.append(f"gradient bucket cap: {self.bucket_cap_bytes / 2**20:.1f} MiB")
        if self.grad_compression is not None:
            lines.append(f"gradient buckets compressed: {self.grad_compression} (error feedback; INEXACT: does not "
                         "train as one process does)")
        if self.dp_shares is not None:
            lines.append(f"uneven data-parallel shares: {'/'.join(map(str, self.dp_shares))} samples of "
                         f"{sum(self.dp_shares)} (the loss weighted by share: exact)")
        if self.diloco is not None:
            workers = diloco_lib.worker_axis(self.mesh)
            lines.append(f"{self.diloco}: " + (
                f"each group of {workers}={self.mesh.size(workers)} ranks a worker (gradients synchronous inside it), "
                f"the outer step over {diloco_lib.outer_axis(self.mesh)}" if workers else
                "each dp rank a worker, no gradient sync in the step") + " (INEXACT: does not train as one process does)")
        lines.extend(self.report.lines())
        return "\n".join(lines)

    def to_html(self, path: str | os.PathLike) -> pathlib.Path:
        """Write a self-contained page of this plan (no network, no external scripts): the mesh
        and ranks on nodes, pipeline stages, every block's choice, the predicted time split and
        memory per device against the budget, the runner-up meshes. Returns the path."""
        from graphpass.plan_html import write_html

        return write_html(self, path)

    def diff(self, other: "Plan") -> list[str]:
        """Lines describing how ``other``'s program differs from this plan's (empty when equal;
        the reports, :data:`PREDICTIONS`, are not compared)."""
        out = []
        if dict(self.mesh) != dict(other.mesh):
            out.append(f"mesh: {dict(self.mesh)} -> {dict(other.mesh)}")
        for node in sorted(set(self.tensors) | set(other.tensors)):
            a, b = self.tensor(node).to_json(), other.tensor(node).to_json()
            if a != b:
                out.append(f"{node}: {a} -> {b}")
        for name in (f.name for f in fields(self)):
            if name in ("mesh", "tensors") or name in PREDICTIONS:
                continue
            if getattr(self, name) != getattr(other, name):
                out.append(f"{name}: {getattr(self, name)} -> {getattr(other, name)}")
        return out


# ---------------------------------------------------------------------- the plan against its graph


def _describe(node: fx.Node) -> str:
    """``parameter 'h.0.attn.q.weight' of shape [64, 64]``, ``input 'idx'``, ``op 'gelu' (aten.gelu)``."""
    val = node.meta.get(meta.VAL)
    shape = f" of shape {list(val.shape)}" if isinstance(val, torch.Tensor) else ""
    if node.op == "placeholder":  # captured at a rank's share of the batch: its shape would mislead
        return f"input {node.name!r}"
    if node.op == "get_attr":
        return f"{meta.get(node, meta.ATTR_KIND, None) or 'attribute'} {node.target!r}{shape}"
    return f"op {node.name!r} ({node.target})"


def _stored_problems(plan: Plan, node: fx.Node, by_axis: Mapping[str, Placement]) -> list[str]:
    """A parameter or buffer is whole (``Replicate()``) or sharded along one of its dims on
    ``tp`` (tensor parallelism) or along dim 0 on ``ep`` (experts); on ``dp`` ZeRO shards it
    (:attr:`Plan.zero`), not its placement, and pipeline stages hold whole tensors."""
    val = node.meta.get(meta.VAL)
    ndim = val.dim() if isinstance(val, torch.Tensor) else None
    problems = []
    for axis, p in by_axis.items():
        field, text = f"Plan.placements[{node.name!r}][{axis!r}]", placement_to_str(p)
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            problems.append(f"{field}: {text} on {_describe(node)}: a stored tensor is whole or sharded, never a "
                            "pending sum; use Replicate() or Shard(d)")
        elif ndim is not None and p.dim >= ndim:
            problems.append(f"{field}: {text} on a {ndim}-D tensor ({_describe(node)}); " + (
                "use Replicate()" if ndim == 0 else f"use Shard(d) with 0 <= d < {ndim}, or Replicate()"))
        elif axis == "dp":
            problems.append(
                f"{field}: {text} on {_describe(node)}, but placements do not shard parameters or buffers over dp (a "
                "parameter's gradient would skip the data-parallel all-reduce); use Replicate(), and "
                f"Plan.zero[{node.name!r}] = 1, 2 or 3 to shard it over dp with ZeRO")
        elif axis == "pp":
            problems.append(f"{field}: {text} on {_describe(node)}: pipeline stages hold whole tensors (Plan.stages "
                            "cuts the model between them); use Replicate()")
        elif axis == "ep" and p.dim != 0:
            problems.append(f"{field}: {text} on {_describe(node)}: experts are sharded along dim 0 (the expert "
                            "dim) on ep; use Shard(0)")
    return problems


def _loss_problems(plan: Plan, node: fx.Node, by_axis: Mapping[str, Placement]) -> list[str]:
    """The loss is each rank's mean over its share of the batch, averaged over ``dp``
    (``Partial(avg)``); tensor parallelism leaves every rank the whole loss."""
    problems = []
    for axis, p in by_axis.items():
        text = placement_to_str(p)
        if axis == "dp":
            if p != Partial("avg") and not (p == Replicate() and plan.mesh["dp"] == 1):
                problems.append(
                    f"Plan.placements[{node.name!r}]['dp']: {text} on the loss, but each rank's loss is the mean over "
                    "its share of the batch, which graphpass averages over dp: use Partial(avg)")
        elif p != Replicate():
            problems.append(f"Plan.placements[{node.name!r}][{axis!r}]: {text} on the loss, but every {axis} rank "
                            "ends the step with the whole loss: use Replicate() or leave it out")
    return problems
