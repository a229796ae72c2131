"""The plan: plain, frozen data that says how every node is parallelised.

A :class:`Strategy` is what a user writes: one uniform choice of degrees for the whole model
(``Strategy(dp=4)``). A :class:`Plan` is what passes consume: the device mesh, a placement per
node on each mesh axis (keyed by the node's stable name in the captured graph), the pipeline
stages, and the planner's predictions. Plans round-trip through JSON, so a saved plan replays
without solving, and tests hand-write plans to drive single passes.

Placements use torch's words (``torch.distributed.tensor``): ``Shard(dim)``, ``Replicate()``,
``Partial()``; in JSON they are those strings.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from graphpass.mesh import Mesh

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

    @property
    def mixed(self) -> bool:
        """Operators of the block take different ZeRO stages (``large_ops > 0``)."""
        return self.large_ops > 0

    def rest(self) -> "Choice":
        """The choice of the block's operators after its ``large_ops`` largest."""
        return Choice(self.rest_zero, 1, self.recompute)

    def __str__(self) -> str:
        parts = [f"zero-{self.zero}" if self.zero else "dp"]
        if self.mixed:
            parts[0] += f" on {self.large_ops} largest ops, " + (f"zero-{self.rest_zero}" if self.rest_zero else "dp")
        if self.split > 1:
            parts.append(f"split {self.split}")
        if self.recompute:
            parts.append("recompute")
        return " + ".join(parts)


@dataclass(frozen=True)
class Strategy:
    """A uniform parallel strategy: the same choice for every layer.

    Args:
        dp: data-parallel degree (the batch is split ``dp`` ways).
        tp: tensor-parallel degree (Megatron column/row splits).
        pp: pipeline-parallel degree (ranks along the pipeline; stages ``pp * virtual_stages``).
        zero: ZeRO stage inside the dp axis: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters.
        split: OSDP operator-splitting factor for large linears.
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

    def __post_init__(self) -> None:
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

    @property
    def degree(self) -> int:
        """Number of devices the strategy occupies: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    @property
    def mesh(self) -> Mesh:
        """The ``pp x dp x tp`` mesh this strategy runs on (``ep`` inside ``dp``)."""
        return Mesh.of(pp=self.pp, dp=self.dp, tp=self.tp, ep=self.ep)

    @property
    def choice(self) -> Choice:
        """The per-block choice it makes for every block (no ZeRO without a ``dp`` axis)."""
        return Choice(self.zero if self.dp > 1 else 0, self.split, self.recompute)

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


def placement_from_str(text: str) -> Placement:
    """Parse ``"Shard(0)"``, ``"Replicate()"`` or ``"Partial()"`` (also ``"Partial(avg)"``)."""
    text = text.strip()
    if text == "Replicate()":
        return Replicate()
    match = re.fullmatch(r"Shard\((?:dim=)?(-?\d+)\)", text)
    if match:
        return Shard(int(match.group(1)))
    match = re.fullmatch(r"Partial\((\w*)\)", text)
    if match:
        return Partial(match.group(1) or "sum")
    raise ValueError(f"unknown placement {text!r}; expected Shard(dim), Replicate() or Partial()")


def placement_to_str(placement: Placement) -> str:
    """The JSON spelling of a torch placement."""
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    if isinstance(placement, Partial):
        op = placement.reduce_op
        return "Partial()" if op == "sum" else f"Partial({op})"
    raise TypeError(f"unsupported placement {placement!r}")


#: Plan fields that are the planner's predictions and account, not the program: ``Plan.diff``
#: and golden program texts leave them out.
PREDICTIONS = ("predicted_step_time_s", "predicted_peak_memory_bytes", "predicted_stage_peaks_bytes", "breakdown",
               "time_split_s", "memory_budget_bytes", "devices_per_node", "alternatives", "reasons")


@dataclass(frozen=True)
class Plan:
    """How to run one captured graph on a mesh.

    Attributes:
        mesh: the :class:`~graphpass.mesh.Mesh` (ordered axes and sizes; a ``{"dp": 4}`` mapping
            is accepted and converted); the product is the world size.
        placements: node name → {axis → placement string} for every input, parameter and the loss.
        stages: node names of each pipeline stage's first node (one stage: ``("*",)``).
        strategy: the uniform strategy this plan was made from, if any.
        zero: parameter node name → ZeRO stage (1, 2 or 3) inside the ``dp`` axis; parameters
            not listed are plain data parallel (stage 0). Stages mix freely (OSDP).
        recompute: indices of the repeated layers whose activations are recomputed in backward
            (activation checkpointing) instead of saved.
        sequence_parallel: Megatron sequence parallelism on the ``tp`` axis: partial sums that
            join the residual stream are reduce-scattered along dim 1 instead of all-reduced.
        split: OSDP operator splitting: linear node name → ``{"dim": "out" | "in", "parts": k}``;
            the op runs as k slices whose weights are separate (separately gathered) parameters.
        bucket_cap_bytes: size cap of one gradient all-reduce bucket.
        microbatches: microbatches per step (pipeline / gradient accumulation).
        schedule: the pipeline schedule (one of :data:`SCHEDULES`), with ``pp`` in the mesh.
        tp_parts: for the weight (and bias) of a fused projection that is column-parallel on
            ``tp`` (one linear making q, k and v, or gate and up): the sizes of its parts along
            the sharded dim. Each part is sharded on its own, so rank r holds chunk r of every
            part and the split after the projection stays local (sharded by heads).
        breakdown: the planner's per-block figures, one dict per block in order: ``block``,
            ``stage``, ``choice`` (e.g. ``"zero-3 + recompute"``), ``time_s`` (compute and
            tensor-parallel collectives of one step), ``tp_comm_s``, ``dp_comm_s``,
            ``state_bytes`` (gradients included), ``activation_bytes`` (per microbatch),
            ``transient_bytes``, ``grad_bytes`` (the gradients in ``state_bytes``), ``held_bytes``
            (gradients held across microbatches), ``loss_backward_bytes`` (the loss's backward
            working set, post block only).
        capacity_factor: the capacity factor ``compile`` gives every ``graphpass.nn.MoE`` layer
            before capturing (the planner's choice within the user's drop budget:
            ``gp.plan(..., capacity_factors=, max_dropped=)``); None is dropless; ``"model"``
            (the default) keeps each layer's own.
        ep_all_to_all: how expert parallelism's exchanges run: ``"flat"`` (one all-to-all over
            the ``ep`` group) or ``"hierarchical"`` (two-level, Tutel's 2DH: within each node,
            then one message per node pair; for ``ep`` groups spanning nodes of the cluster
            given to ``compile``). The planner picks the cheaper by its link model.
        predicted_step_time_s: the cost model's step time, None until the planner prices it.
        predicted_peak_memory_bytes: the cost model's per-device peak, None until priced.
        predicted_stage_peaks_bytes: the cost model's peak on each ``pp`` rank (its stages), in
            order; ``()`` until priced.
        time_split_s: the predicted step split (seconds, summing to ``predicted_step_time_s``):
            ``compute`` and ``tp_comm`` (the slowest pipeline rank's microbatches),
            ``dp_comm_exposed`` (data-parallel communication not hidden behind backward),
            ``optimizer`` and ``bubble`` (pipeline fill and drain); empty until priced.
        memory_budget_bytes: the per-device budget the planner fitted the plan under.
        devices_per_node: devices per node of the planned cluster (ranks ``n * k .. n * k + k - 1``
            share node ``n``).
        alternatives: the runner-up meshes and the closest that did not fit, each ``layout``,
            ``step_time_s`` (None: not fitting), ``peak_bytes`` and ``why`` it lost.
        reasons: human-readable lines saying why the plan is what it is (shown by ``explain``).
    """

    mesh: Mesh
    placements: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    stages: tuple[str, ...] = ("*",)
    strategy: Strategy | None = None
    zero: Mapping[str, int] = field(default_factory=dict)
    recompute: tuple[int, ...] = ()
    split: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    sequence_parallel: bool = False
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES
    microbatches: int = 1
    schedule: str = "1f1b"
    tp_parts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    ep_all_to_all: str = "flat"
    capacity_factor: float | str | None = "model"
    predicted_step_time_s: float | None = None
    predicted_peak_memory_bytes: int | None = None
    predicted_stage_peaks_bytes: tuple[int, ...] = ()
    breakdown: tuple[Mapping[str, Any], ...] = ()
    time_split_s: Mapping[str, float] = field(default_factory=dict)
    memory_budget_bytes: int | None = None
    devices_per_node: int | None = None
    alternatives: tuple[Mapping[str, Any], ...] = ()
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            try:
                object.__setattr__(self, "mesh", Mesh(self.mesh))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"Plan.mesh: {exc}") from None
        for node, by_axis in self.placements.items():
            for axis, text in by_axis.items():
                if axis not in self.mesh:
                    raise ValueError(
                        f"Plan.placements[{node!r}] uses mesh axis {axis!r}, which is not in "
                        f"Plan.mesh {dict(self.mesh)}"
                    )
                placement_from_str(text)
        for node, stage in self.zero.items():
            if stage not in (0, 1, 2, 3):
                raise ValueError(f"Plan.zero[{node!r}] must be 0, 1, 2 or 3, got {stage!r}")
            if stage and "dp" not in self.mesh:
                raise ValueError(f"Plan.zero[{node!r}] = {stage} needs a 'dp' mesh axis; mesh is {dict(self.mesh)}")
        for node, spec in self.split.items():
            if set(spec) != {"dim", "parts"} or spec["dim"] not in ("out", "in") or not (
                isinstance(spec["parts"], int) and spec["parts"] >= 1
            ):
                raise ValueError(
                    f"Plan.split[{node!r}] must be {{'dim': 'out' | 'in', 'parts': k >= 1}}, got {spec!r}"
                )
        if not isinstance(self.microbatches, int) or isinstance(self.microbatches, bool) or self.microbatches < 1:
            raise ValueError(f"Plan.microbatches must be a positive int, got {self.microbatches!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Plan.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.ep_all_to_all not in ("flat", "hierarchical"):
            raise ValueError(f"Plan.ep_all_to_all must be 'flat' or 'hierarchical', got {self.ep_all_to_all!r}")
        cf = self.capacity_factor
        if not (cf is None or cf == "model" or (isinstance(cf, (int, float)) and not isinstance(cf, bool) and cf > 0)):
            raise ValueError(f"Plan.capacity_factor must be a positive number, None (dropless) or 'model', got {cf!r}")
        for node, parts in self.tp_parts.items():
            if not parts or not all(isinstance(n, int) and n > 0 for n in parts):
                raise ValueError(f"Plan.tp_parts[{node!r}] must be positive part sizes, got {parts!r}")
            if not isinstance(self.placement(node, "tp"), Shard):
                raise ValueError(f"Plan.tp_parts names {node!r}, which is not Shard(d) on a 'tp' axis; "
                                 "fused parts apply to column-parallel weights")
        if self.mesh.pp > 1 and len(self.stages) % self.mesh.pp:
            raise ValueError(f"Plan.stages has {len(self.stages)} stages, which pp={self.mesh.pp} ranks cannot share "
                             "equally; give pp x virtual stages per rank")
        for layer in self.recompute:
            if not isinstance(layer, int) or layer < 0:
                raise ValueError(f"Plan.recompute entries must be layer indices >= 0, got {layer!r}")

    @property
    def world_size(self) -> int:
        """Product of the mesh sizes."""
        return self.mesh.world_size

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per ``pp`` rank (several under an interleaved schedule)."""
        return max(1, len(self.stages) // self.mesh.pp)

    def placement(self, node: str, axis: str) -> Placement:
        """Placement of ``node`` on ``axis`` (Replicate when the plan does not mention it)."""
        text = self.placements.get(node, {}).get(axis)
        return Replicate() if text is None else placement_from_str(text)

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (what ``to_json`` writes)."""
        data = asdict(self)
        data["mesh"] = dict(self.mesh)
        data["placements"] = {k: dict(v) for k, v in self.placements.items()}
        data["stages"] = list(self.stages)
        data["zero"] = dict(self.zero)
        data["recompute"] = list(self.recompute)
        data["predicted_stage_peaks_bytes"] = list(self.predicted_stage_peaks_bytes)
        data["split"] = {k: dict(v) for k, v in self.split.items()}
        data["tp_parts"] = {k: list(v) for k, v in self.tp_parts.items()}
        data["reasons"] = list(self.reasons)
        data["breakdown"] = [dict(row) for row in self.breakdown]
        data["time_split_s"] = dict(self.time_split_s)
        data["alternatives"] = [dict(row) for row in self.alternatives]
        return data

    def to_json(self, indent: int | None = 1) -> str:
        """JSON text; ``Plan.from_json(plan.to_json()) == plan``."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Plan fields {sorted(unknown)}; known fields: {sorted(known)}")
        kwargs = dict(data)
        if kwargs.get("strategy") is not None:
            kwargs["strategy"] = Strategy(**kwargs["strategy"])
        kwargs["stages"] = tuple(kwargs.get("stages", ("*",)))
        kwargs["reasons"] = tuple(kwargs.get("reasons", ()))
        kwargs["recompute"] = tuple(kwargs.get("recompute", ()))
        kwargs["predicted_stage_peaks_bytes"] = tuple(kwargs.get("predicted_stage_peaks_bytes", ()))
        kwargs["breakdown"] = tuple(dict(row) for row in kwargs.get("breakdown", ()))
        kwargs["alternatives"] = tuple(dict(row) for row in kwargs.get("alternatives", ()))
        kwargs["tp_parts"] = {k: tuple(v) for k, v in kwargs.get("tp_parts", {}).items()}
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Parse a plan written by :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ reading

    def explain(self) -> str:
        """A readable account: the mesh, what each kind of node gets, predictions and reasons."""
        lines = [f"mesh: {self.mesh} ({self.world_size} devices)"]
        if self.strategy is not None:
            lines.append(f"strategy: {self.strategy}")
        groups: dict[str, list[str]] = {}
        for node, by_axis in self.placements.items():
            key = ", ".join(f"{a}: {p}" for a, p in by_axis.items())
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
        if self.mesh.ep > 1:
            lines.append(f"experts sharded over ep={self.mesh.ep} (inside dp={self.mesh.dp}); exchanges "
                         + ("two-level (within nodes, then between them)" if self.ep_all_to_all == "hierarchical"
                            else "flat all-to-all"))
        if self.capacity_factor != "model":
            lines.append("MoE capacity factor: " + ("dropless" if self.capacity_factor is None
                                                    else f"{self.capacity_factor:g}") + " (set by the plan)")
        if self.split:
            parts = sorted({spec["parts"] for spec in self.split.values()})
            lines.append(f"operator splitting: {len(self.split)} linears into {parts} slices")
        lines.append(f"pipeline stages: {len(self.stages)}" + (
            f", {self.microbatches} microbatches" if self.microbatches > 1 else ""))
        lines.append(f"gradient bucket cap: {self.bucket_cap_bytes / 2**20:.1f} MiB")
        time_s = self.predicted_step_time_s
        mem = self.predicted_peak_memory_bytes
        lines.append("predicted step time: " + ("not priced" if time_s is None else f"{time_s * 1e3:.2f} ms"))
        lines.append("predicted peak memory: " + ("not priced" if mem is None else f"{mem / 2**30:.2f} GiB") + (
            "" if self.memory_budget_bytes is None else f" of a {self.memory_budget_bytes / 2**30:.2f} GiB budget"))
        if self.time_split_s:
            lines.append("step time split: " + ", ".join(
                f"{name.replace('_', ' ')} {t * 1e3:.2f} ms" for name, t in self.time_split_s.items()))
        lines.extend(self._breakdown_lines())
        lines.extend(f"why: {r}" for r in self.reasons)
        return "\n".join(lines)

    def _breakdown_lines(self) -> list[str]:
        """Consecutive blocks with the same stage and choice, one line each."""
        if not self.breakdown:
            return []
        runs: list[list[Mapping[str, Any]]] = []
        for row in self.breakdown:
            if runs and (runs[-1][-1]["stage"], runs[-1][-1]["choice"]) == (row["stage"], row["choice"]):
                runs[-1].append(row)
            else:
                runs.append([row])
        lines = ["per block (stage | blocks | choice | compute+tp ms/step | tp comm ms | dp comm ms | state GiB | activations GiB):"]
        for run in runs:
            names = run[0]["block"] if len(run) == 1 else f"{run[0]['block']} .. {run[-1]['block']} ({len(run)})"
            total = lambda key: sum(r[key] for r in run)  # noqa: E731
            lines.append(
                f"  {run[0]['stage']} | {names} | {run[0]['choice']} | {total('time_s') * 1e3:.2f} | "
                f"{total('tp_comm_s') * 1e3:.2f} | {total('dp_comm_s') * 1e3:.2f} | "
                f"{total('state_bytes') / 2**30:.3f} | {total('activation_bytes') / 2**30:.3f}"
            )
        return lines

    def to_html(self, path: str | os.PathLike) -> pathlib.Path:
        """Write a self-contained page of this plan (no network, no external scripts): the mesh
        and ranks on nodes, pipeline stages, every block's choice, the predicted time split and
        memory per device against the budget, the runner-up meshes. Returns the path."""
        from graphpass.plan_html import write_html

        return write_html(self, path)

    def diff(self, other: "Plan") -> list[str]:
        """Lines describing how ``other``'s program differs from this plan's (empty when equal;
        the predictions, :data:`PREDICTIONS`, are not compared)."""
        out = []
        if dict(self.mesh) != dict(other.mesh):
            out.append(f"mesh: {dict(self.mesh)} -> {dict(other.mesh)}")
        for node in sorted(set(self.placements) | set(other.placements)):
            a, b = self.placements.get(node), other.placements.get(node)
            if a != b:
                out.append(f"{node}: {a} -> {b}")
        for name in (f.name for f in fields(self)):
            if name in ("mesh", "placements") or name in PREDICTIONS:
                continue
            if getattr(self, name) != getattr(other, name):
                out.append(f"{name}: {getattr(self, name)} -> {getattr(other, name)}")
        return out
