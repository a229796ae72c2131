"""Closed-form memory (and pipeline-bubble) formulas for the planner, torch-free.

Every function here is a published formula, written out so that a test can check it against the
paper's own numbers and the planner can price a strategy without building a graph:

* model state (parameters, gradients, optimizer state) by ZeRO stage: Rajbhandari et al. 2020,
  "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section 3 and Figure 1;
* activations a transformer layer saves for backward, under tensor parallel, sequence parallel and
  recomputation: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", sections 4.1-4.3 and Table 2;
* the pipeline bubble of GPipe / 1F1B / interleaved 1F1B: Huang et al. 2019 (GPipe) and Narayanan
  et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  section 2.2;
* microbatches whose activations are alive on one pipeline stage (GPipe vs 1F1B), the same
  sources;
* transient weights gathered by ZeRO-3 / FSDP, reduced by operator splitting (OSDP, Jiang et al.
  2023) and multiplied by prefetching.

Units end names (``_bytes``); counts are plain numbers. Results are floats where the formula
divides (``x / dp``, ``x / tp``) so that they stay exact for the divisible cases a test checks and
never round a fraction of a byte away silently.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from graphpass.mesh import pipeline_rank
from graphpass.plan import interleaved_rounds


__all__ = [
    "ModelState",
    "model_state_bytes",
    "megatron_activation_bytes",
    "pipeline_bubble_fraction",
    "interleaved_bubble_fraction",
    "zero_bubble_fraction",
    "deferred_weight_gradients",
    "ZERO_BUBBLE_SHARE",
    "in_flight_microbatches",
    "gathered_weight_bytes",
]

_ZERO_STAGES = (0, 1, 2, 3)
_RECOMPUTE = ("none", "selective", "full")
_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")

#: The part of a stage's forward + backward time that zero-bubble scheduling cannot hide: the
#: forward, of forward + input-gradient backward + weight-gradient backward taken as equal thirds
#: (a matmul's two gradient matmuls each cost its forward). Qi et al. 2024 (ZB-H1): bubble
#: (p − 1)(T_F + T_B − T_W) against 1F1B's (p − 1)(T_F + T_B + T_W).
ZERO_BUBBLE_SHARE = 1 / 3


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# --------------------------------------------------------------------------------------------
# Model state by ZeRO stage
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelState:
    """Per-rank bytes of model state: parameters, gradients and optimizer state."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def model_state_bytes(
    num_params: float,
    zero_stage: int,
    dp: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> ModelState:
    """Per-rank memory of parameters, gradients and optimizer state under ZeRO.

    Source: Rajbhandari et al. 2020 (ZeRO), section 3.1 and Figure 1. With Ψ parameters, N
    data-parallel ranks and K bytes of optimizer state per parameter, mixed-precision Adam keeps
    fp16 parameters (2Ψ), fp16 gradients (2Ψ) and K = 12 bytes of fp32 state per parameter
    (master copy, momentum, variance), so per rank:

    =====  ====================  =========================
    stage  partitioned           bytes per rank
    =====  ====================  =========================
    0      nothing (plain DP)    (2 + 2 + K)Ψ
    1      optimizer state       (2 + 2)Ψ + KΨ/N
    2      + gradients           2Ψ + (2 + K)Ψ/N
    3      + parameters          (2 + 2 + K)Ψ/N
    =====  ====================  =========================

    The paper's example (Ψ = 7.5e9, N = 64) gives 120 GB, 31.4 GB, 16.6 GB and 1.9 GB.

    fp32 training with Adam is ``param_bytes=4, grad_bytes=4, optimizer_bytes=8`` (momentum and
    variance; the parameters are their own master copy), i.e. (4 + 4 + 8)Ψ at stage 0.

    Args:
        num_params: Ψ, the number of parameters held by this data-parallel group (already divided
            by tensor / pipeline parallelism, if any).
        zero_stage: 0, 1, 2 or 3.
        dp: N, the data-parallel (sharding) group size.
        param_bytes: bytes per parameter of the working copy.
        grad_bytes: bytes per gradient element.
        optimizer_bytes: K, bytes of optimizer state per parameter.

    Returns:
        A ``ModelState`` with the three components and ``total_bytes``.
    """
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params!r}")
    if zero_stage not in _ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {_ZERO_STAGES}, got {zero_stage!r}")
    _positive_int("dp", dp)
    for name, value in (
        ("param_bytes", param_bytes),
        ("grad_bytes", grad_bytes),
        ("optimizer_bytes", optimizer_bytes),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")

    psi = num_params
    return ModelState(
        params_bytes=param_bytes * psi / (dp if zero_stage >= 3 else 1),
        grads_bytes=grad_bytes * psi / (dp if zero_stage >= 2 else 1),
        optimizer_bytes=optimizer_bytes * psi / (dp if zero_stage >= 1 else 1),
    )


# --------------------------------------------------------------------------------------------
# Activation memory of a transformer layer (Megatron)
# --------------------------------------------------------------------------------------------

# Korthikanti et al. 2022, section 4.1, counts the bytes one transformer layer saves for backward
# with 16-bit activations and 1-byte dropout masks. Split by kind (units: s·b·h, and a·s²·b for
# the attention core), so that ``bytes_per_element`` can scale the tensors but not the masks:
#
#   tensors kept whole under tensor parallel (t does not divide them):
#       two LayerNorm inputs 2, QKV-matmul input 1, MLP input 1            -> 4 elements  = 8 bytes
#       dropout masks after attention projection and after the MLP       -> 2 mask bytes
#                                                                            (8 + 2 = the "10")
#   tensors split by tensor parallel:
#       Q and K 2, V 1, projection input 1, GeLU input 4, GeLU output 4    -> 12 elements = 24 bytes
#   attention core (per a·s²·b, split by tensor parallel; dropped by selective recompute):
#       softmax output 1, attention-dropout output 1                       -> 2 elements  = 4 bytes
#       attention-dropout mask                                             -> 1 mask byte
#                                                                            (4 + 1 = the "5")
#
# 8 + 2 + 24 = 34 and 4 + 1 = 5 reproduce the paper's s·b·h·(34 + 5·a·s/h).
_REPLICATED_ELEMENTS = 4
_REPLICATED_MASK_BYTES = 2
_SPLIT_ELEMENTS = 12
_CORE_ELEMENTS = 2
_CORE_MASK_BYTES = 1
# Full recomputation keeps only the layer's input: one s·b·h tensor.
_INPUT_ELEMENTS = 1


def megatron_activation_bytes(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    bytes_per_element: float = 2,
    dropout: bool = True,
) -> float:
    """Bytes one transformer layer saves for backward, per tensor-parallel rank.

    Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", sections 4.1-4.3 and Table 2 (s = ``seq``, b = ``batch``, h = ``hidden``,
    a = ``heads``, t = ``tp``). With the default 16-bit activations:

    ==============================  ==========================================
    no parallelism                  s·b·h·(34 + 5·a·s/h)
    tensor parallel                 s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel      s·b·h/t·(34 + 5·a·s/h)
    TP + selective recompute        s·b·h·(10 + 24/t)
    TP + SP + selective recompute   s·b·h·34/t
    full recompute                  2·s·b·h        (÷t with sequence parallel)
    ==============================  ==========================================

    Selective recomputation recomputes the attention core (QKᵀ, softmax, softmax dropout,
    attention over V), which removes the 5·a·s/h term; full recomputation keeps only the layer's
    input (Megatron-LM with sequence parallel keeps that input sharded along the sequence).

    How ``bytes_per_element`` scales the paper's numbers: the paper's constants are bytes, not
    elements. Of the 34, 32 are 16-bit tensors and 2 are 1-byte dropout masks; of the 5, 4 are
    16-bit tensors and 1 is a mask. The tensor part is scaled by ``bytes_per_element / 2``; the
    masks stay at one byte each (they are ``bool`` whatever the activation dtype). So fp32
    (``bytes_per_element=4``) gives s·b·h·(66 + 9·a·s/h), not twice the paper's figure.
    ``dropout=False`` (no dropout layers, as in many modern recipes) drops the masks: 32 and 4.

    Args:
        seq: s, sequence length.
        batch: b, microbatch size.
        hidden: h, hidden size.
        heads: a, number of attention heads.
        tp: t, tensor-parallel degree.
        sequence_parallel: shard LayerNorm / dropout activations along the sequence (Megatron SP).
        recompute: ``"none"``, ``"selective"`` or ``"full"``.
        bytes_per_element: bytes per activation element (2 for fp16/bf16, 4 for fp32).
        dropout: whether the layer has dropout (and therefore stores 1-byte masks).

    Returns:
        Bytes per layer on one tensor-parallel rank (a float; exact when t divides the terms).
    """
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads)):
        _positive_int(name, value)
    _positive_int("tp", tp)
    if recompute not in _RECOMPUTE:
        raise ValueError(f"recompute must be one of {_RECOMPUTE}, got {recompute!r}")
    _positive("bytes_per_element", bytes_per_element)

    sbh = seq * batch * hidden
    mask = 1 if dropout else 0
    # Sequence parallel shards the tensors tensor parallel leaves whole (and the layer input).
    replicated_divisor = tp if sequence_parallel else 1

    if recompute == "full":
        return _INPUT_ELEMENTS * bytes_per_element * sbh / replicated_divisor

    replicated = sbh * (_REPLICATED_ELEMENTS * bytes_per_element + _REPLICATED_MASK_BYTES * mask)
    split = sbh * _SPLIT_ELEMENTS * bytes_per_element
    total = replicated / replicated_divisor + split / tp
    if recompute == "none":
        core = heads * seq * seq * batch * (_CORE_ELEMENTS * bytes_per_element + _CORE_MASK_BYTES * mask)
        total += core / tp
    return total


# --------------------------------------------------------------------------------------------
# Pipeline
# --------------------------------------------------------------------------------------------


def pipeline_bubble_fraction(stages: int, microbatches: int) -> float:
    """Fraction of a GPipe / 1F1B step that a stage sits idle: (p − 1)/(m + p − 1).

    Source: Huang et al. 2019 (GPipe) and Narayanan et al. 2021, section 2.2.1. With p stages and m
    microbatches, each of forward time t_f and backward time t_b, the bubble is
    (p − 1)(t_f + t_b) and the ideal time m(t_f + t_b), so the step takes (m + p − 1)(t_f + t_b).

    Definition used throughout this module: idle time as a fraction of the *whole step*
    (bubble / (ideal + bubble)). Narayanan et al. quote the ratio to the *ideal* time instead,
    (p − 1)/m; the two are related by ``ratio = f / (1 − f)``. A planner gets the step time as
    ``ideal_s / (1 − f)``.

    1F1B has the same bubble as GPipe; it changes memory (see ``in_flight_microbatches``), not time.
    """
    return interleaved_bubble_fraction(stages, microbatches, 1)


def interleaved_bubble_fraction(stages: int, microbatches: int, chunks: int) -> float:
    """Bubble fraction of interleaved 1F1B with v model chunks per stage: (p − 1)/(v·m + p − 1).

    Source: Narayanan et al. 2021, section 2.2.2: with v chunks per device each chunk's forward and
    backward take t_f/v and t_b/v, so the bubble shrinks to (p − 1)(t_f + t_b)/v and the paper's
    bubble-to-ideal ratio becomes (p − 1)/(v·m). Expressed, like ``pipeline_bubble_fraction``, as a
    fraction of the whole step: ((p − 1)/v) / (m + (p − 1)/v) = (p − 1)/(v·m + p − 1). ``chunks=1``
    is plain 1F1B. Megatron-LM's schedule also needs m to be a multiple of p; torch's runs any m
    whose rounds (``graphpass.plan.interleaved_rounds``) are equal, which ``check_pipeline``
    checks.
    """
    _positive_int("stages", stages)
    _positive_int("microbatches", microbatches)
    _positive_int("chunks", chunks)
    return (stages - 1) / (chunks * microbatches + stages - 1)


def zero_bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Bubble fraction of torch's interleaved zero-bubble schedule (ZB1P, Qi et al. 2024) with
    ``chunks`` stages per rank: the interleaved bubble with the idle time cut to
    :data:`ZERO_BUBBLE_SHARE` of it, ``s(p − 1)/(v·m + s(p − 1))``: deferred weight-gradient
    backwards fill the rest (they need no neighbour's data).
    """
    _positive_int("stages", stages)
    _positive_int("microbatches", microbatches)
    _positive_int("chunks", chunks)
    idle = ZERO_BUBBLE_SHARE * (stages - 1)
    return idle / (chunks * microbatches + idle)


def in_flight_microbatches(
    stages: int, microbatches: int, stage_index: int, schedule: str = "1f1b", virtual_stages: int = 1
) -> float:
    """Microbatches whose activations a stage holds at its peak.

    GPipe runs every forward before any backward, so each stage holds all m microbatches
    (Huang et al. 2019). 1F1B (PipeDream-Flush, Narayanan et al. 2021, section 2.2.1) warms up
    with p − stage_index forwards and then alternates one forward with one backward, so stage i
    holds at most min(p − i, m): the first stage p, the last one. Interleaved 1F1B with ``v``
    stages per rank (``stage_index`` then counts the ``p * v`` stages; rank ``r = stage_index %
    p`` runs ``r, r + p, ...``) warms up with ``(v − 1) * m_round + 2 (p − 1 − r)`` stage
    forwards before its first backward (torch.distributed.pipelining's ``_get_warmup_ops``,
    ``m_round`` the microbatches of one round, ``m / max(1, m // p)``), at most ``m * v``: the
    rank holds that many stage-microbatches plus the one in flight, on average that over ``v``
    per stage (a fraction). Zero-bubble (torch's ZB1P) warms up with ``(v − 1) * m_round + (p −
    1 − r)`` forwards and defers rank ``r``'s weight-gradient backwards by ``r`` microbatches,
    whose activations it also holds (counted whole: an upper bound, a weight gradient needs only
    its matmul's input): ``p`` microbatches on every rank when ``v = 1``, Qi et al.'s ZB-H1 peak.

    Multiply by the activation bytes of one microbatch on that stage (e.g.
    ``megatron_activation_bytes`` times the stage's layers) for the stage's activation peak.
    """
    _positive_int("stages", stages)
    _positive_int("microbatches", microbatches)
    _positive_int("virtual_stages", virtual_stages)
    total = stages * virtual_stages
    if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not 0 <= stage_index < total:
        raise ValueError(f"stage_index must be in [0, {total}), got {stage_index!r}")
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}")
    if schedule == "gpipe":
        return microbatches
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        rank = pipeline_rank(stage_index, stages)
        per_round = microbatches // interleaved_rounds(microbatches, stages)
        if schedule == "interleaved_1f1b":
            held = (virtual_stages - 1) * per_round + 2 * (stages - 1 - rank) + 1
        else:
            held = (virtual_stages - 1) * per_round + (stages - 1 - rank) + 1 + rank
        return min(held, microbatches * virtual_stages) / virtual_stages
    return min(stages - stage_index, microbatches)


def deferred_weight_gradients(stages: int, microbatches: int, stage_index: int, virtual_stages: int = 1) -> float:
    """Under zero-bubble (torch's ZB1P), the most stage-microbatches whose input gradient has run
    and whose weight gradient has not, per stage of the rank that runs ``stage_index``: rank
    ``r`` defers ``r`` of them behind the one in hand, ``min(r + 1, m v)`` over its ``v`` stages.
    Each keeps the output gradients its weight gradients need (``BlockCost.weight_grad_bytes``);
    the first stage runs whole backwards (its input needs no gradient) and keeps none.
    """
    _positive_int("stages", stages)
    _positive_int("microbatches", microbatches)
    _positive_int("virtual_stages", virtual_stages)
    rank = pipeline_rank(stage_index, stages)
    return min(rank + 1, microbatches * virtual_stages) / virtual_stages


# --------------------------------------------------------------------------------------------
# Transient gathered weights (ZeRO-3 / FSDP)
# --------------------------------------------------------------------------------------------


def gathered_weight_bytes(
    param_bytes_per_layer: float | Iterable[float], split: int = 1, prefetch: int = 1
) -> float:
    """Peak transient bytes of full weights gathered by ZeRO-3 / FSDP.

    A sharded layer all-gathers its full parameters just before use and frees them after, so the
    transient peak is set by the largest gather group, not the sum (Rajbhandari et al. 2020,
    section 5.3; FSDP's per-unit all-gather). Two refinements:

    * operator splitting (OSDP, Jiang et al. 2023) gathers a layer in ``split`` slices, one live
      at a time, so the live gather is largest / split;
    * prefetching ``prefetch`` further groups while computing (FSDP ``forward_prefetch`` /
      ``backward_prefetch``, DeepSpeed's prefetch bucket) keeps that many more gathers alive,
      hence the factor (1 + prefetch).

    Result: max(group bytes) / split · (1 + prefetch). Using the largest group for the prefetched
    ones too is the conservative bound the planner wants.

    Args:
        param_bytes_per_layer: bytes of one gather group, or an iterable of them (one per layer).
        split: slices each gather group is split into (1 = unsplit).
        prefetch: gather groups fetched ahead of the one in use (0 = no prefetch).
    """
    if isinstance(param_bytes_per_layer, (int, float)):
        largest = param_bytes_per_layer
    else:
        sizes = list(param_bytes_per_layer)
        largest = max(sizes, default=0)
    if largest < 0:
        raise ValueError(f"param_bytes_per_layer must be >= 0, got {param_bytes_per_layer!r}")
    _positive_int("split", split)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
    return largest / split * (1 + prefetch)

