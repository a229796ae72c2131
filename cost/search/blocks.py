"""What the search decides for: blocks, and what the graph side measures of each. Torch-free.

The unit of decision is a *block*: one repeated layer (``h.3``), or the segment before the first
layer (embeddings: ``"pre"``) or after the last one (final norm, head, loss: ``"post"``). The
graph side (:mod:`graphpass.planner`) measures every block once per tensor-parallel layout
``(tp, sequence_parallel, tp_layout)`` (:attr:`~graphpass.cost.search.layouts.Parallelism.key`;
``tp_layout`` is Megatron's pattern or one of the op-level solver's,
:mod:`graphpass.planner.op_placement`): compute time per local batch, activations saved for
backward, parameter bytes per tp rank, and the tensor-parallel collectives the pass would emit
(:class:`BlockCost`). The rest of the search prices (:mod:`graphpass.cost.search.pricing`) and
searches with those numbers and the :class:`~graphpass.cluster.Cluster`'s links.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

#: The kinds of block (:attr:`BlockCost.kind`).
PRE, LAYER, POST = "pre", "layer", "post"


@dataclass(frozen=True)
class OpParams:
    """The trainable parameters an operator of a block reads first (weight and bias of a
    linear, a norm's scale and shift): the unit of a per-operator ZeRO choice (OSDP).

    Attributes:
        op: the operator's node name.
        params: its parameters' node names.
        elements: their elements on one rank (after tensor-parallel sharding).
        param_bytes: their bytes.
        tensors: how many tensors.
        split_bytes: the weight bytes operator splitting would cut when the operator is a
            splittable linear, else 0.
    """

    op: str
    params: tuple[str, ...]
    elements: float
    param_bytes: float
    tensors: int
    split_bytes: float = 0.0


@dataclass(frozen=True)
class BlockCost:
    """One block under one tensor-parallel layout, per rank, measured at the reference batch.

    Attributes:
        name: ``"pre"``, ``"layer 3"``, ``"post"``.
        kind: ``"pre"``, ``"layer"`` or ``"post"``.
        signature: equal for identical blocks (same ops, shapes and parameters): they cluster.
        layer: repeated-layer index, None for pre/post.
        params: trainable elements this rank holds (after tensor-parallel sharding).
        tensors: trainable parameter tensors (what a foreach optimizer steps one by one).
        param_bytes: bytes of those parameters in their dtype.
        split_bytes: bytes of the linears operator splitting would cut (0: nothing to split).
        split_count: how many such linears.
        times: local batch size -> (forward_s, backward_s) of the block's compute.
        saved_bytes: activations saved for backward at the reference batch.
        input_bytes: the block's input activation at the reference batch (what recomputation keeps).
        output_bytes: the activation the block hands to the next (a pipeline send).
        tp_traffic: ``(phase, kind, bytes, blocking)`` of each tensor-parallel collective at the
            reference batch, phase ``"forward"`` or ``"backward"`` (``Movement.blocking``).
        tp_copies: ``(phase, bytes written)`` of each tensor-parallel op's local copies at the
            reference batch, every microbatch (``Transition.copies``).
        backward_bytes: the most the block's backward allocates beyond what was alive when
            backward reached it, at the reference batch. The last block's (the post block's:
            the loss's gradients, the logits' and the loss's own) meets every activation at the
            start of backward; a recomputed layer's comes on top of its rematerialised
            activations.
        backward_starts_here: the last block of the model, whose backward runs first.
        weight_grad_bytes: the output gradients of the block's ops that read a trainable
            parameter, at the reference batch: what a split backward keeps from the input
            gradient's pass to the weight gradient's (zero-bubble schedules).
        expert_params: the trainable elements of Mixture-of-Experts expert weights among
            ``params`` (what an ``ep`` axis shards); 0 for a block without experts.
        expert_param_bytes: their bytes.
        num_experts: experts per MoE layer of the block (``ep`` must divide it); 0 without.
        expert_times: local batch size -> (forward_s, backward_s) of the experts' part of
            ``times`` (the grouped products and what lies between them).
        exchanges: ``(table entry, S bytes at the reference batch)`` of each exchange expert
            parallelism would emit (``"ep token counts"``, ``"ep dispatch"``, ``"ep combine"``
            per MoE layer).
        ops: the block's dense (non-expert) trainable parameters by the operator that reads
            them first, largest first: what a per-operator choice (``Choice.large_ops``) divides.
        param_shapes: the shapes of the block's dense trainable parameters (whole, before
            tensor parallelism): what a compressed gradient bucket sends follows them
            (:func:`graphpass.compression.bucket_parts`).
        frozen_bytes: the bytes of the block's frozen parameters (``requires_grad=False``: a
            model's base under adapters) and buffers on one rank: held all step on every rank,
            with no gradient, optimizer state or collective.
    """

    name: str
    kind: str
    signature: str
    layer: int | None
    params: float
    param_bytes: float
    split_bytes: float
    split_count: int
    times: Mapping[int, tuple[float, float]]
    saved_bytes: float
    input_bytes: float
    output_bytes: float
    tp_traffic: tuple[tuple[str, str, float, bool], ...] = ()
    tp_copies: tuple[tuple[str, float], ...] = ()
    backward_bytes: float = 0.0
    tensors: int = 0
    backward_starts_here: bool = False
    weight_grad_bytes: float = 0.0
    expert_params: float = 0.0
    expert_param_bytes: float = 0.0
    num_experts: int = 0
    expert_times: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    exchanges: tuple[tuple[str, float], ...] = ()
    ops: tuple[OpParams, ...] = ()
    param_shapes: tuple[tuple[int, ...], ...] = ()
    frozen_bytes: float = 0.0
