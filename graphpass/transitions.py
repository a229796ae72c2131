"""The transition table: every collective graphpass emits, as one entry each.

A *transition* is what one emitted graph op converts — a placement change on a mesh axis
(``Shard(d) → Replicate()`` on ``tp``: an all-gather), or one of data parallelism's gradient
and weight movements (a bucket's ``Partial → Replicate`` gradients, a ZeRO group's
``Shard(0) → Replicate()`` weights). Each entry holds:

- ``op``: the runtime op the emitter inserts (``graphpass.runtime.collectives``; the emitter in
  ``graphpass.passes.collectives`` looks it up here);
- ``collectives``: what the op communicates, forward and backward, each a :class:`Movement` of
  one collective *kind* on ``factor × S`` bytes, where ``S`` is the op's *full* tensor (the
  gathered weights, the partial sum, the bucket of gradients — see ``size``; for ZeRO groups an
  all-gather moves the weights and a reduction their gradients) and how often it runs in a step
  (``per``: every microbatch, or once per step), and whether it is *blocking* (the step waits
  for it right where it runs: a synchronisation point of the ranks, which costs more than the
  collective itself, ``LinkSpec.sync_s``) or asynchronous (launched, then waited for with
  the others at the end of backward, or prefetched one group ahead in forward);
- ``copies``: the local copies the op makes around its collectives, each a :class:`Copy` of
  ``full × S + shard × S/n`` bytes written (and as many read; ``n`` the axis size) in a phase,
  as often as ``per`` says: a bucket flattened and scaled, a ZeRO group's shards flattened
  before the gather and the gathered buffer unpacked into the parameters, gradients written
  rank-major and divided on the way, a clone before an in-place all-reduce, a gathered tensor
  laid out along its dimension. The cost model prices them at the device's memory bandwidth.
  Copies inside a backend's collective (gloo's own staging) belong to the collective's
  measured time, and the accumulation adds of a step's microbatches to the gradients are not
  copies;
- its memory effect, as multiples of ``S``: ``step`` alive from the step's first forward to its
  last backward (ZeRO-1/2's gathered weights), ``transient`` alive only while the op's layer
  runs (ZeRO-3's gathered weights, then their full gradient). Gradients held back between a
  step's microbatches cost nothing extra: they accumulate in the buffer that becomes ``.grad``
  (dp buckets) or that the gradients occupy anyway (ZeRO-1's full-size gradients).

The cost model (``graphpass.cost``) prices the table: each movement's time is the alpha-beta
formula of its kind (``graphpass.cost.collectives.collective_time``) and the bytes each rank
sends are the ring volumes of that kind. ``tests/test_transitions.py`` runs every entry on 2
and 4 gloo ranks and checks that the bytes the runtime actually moves are the entry's. Adding
a collective means adding one entry here (and its runtime op).

Torch-free, so the planner, the passes and the runtime read the same table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

FORWARD, BACKWARD = "forward", "backward"
#: How often a movement runs: in every microbatch's forward/backward, or once per step (the
#: step's first forward or last backward, see ``docs/step_program.md``).
PER_MICROBATCH, PER_STEP = "microbatch", "step"


#: ``Transition.size_of``: ``S`` is the whole tensor (its elements times their bytes), or one
#: float32 per row of it (its last dimension reduced away: the vocabulary-parallel loss);
#: ``PARTS``: several named sizes (a mapping), one per movement and copy (``Movement.part``), given
#: by the entry's own function (the compressed buckets: :mod:`graphpass.compression`).
TENSOR, FLOAT32_PER_ROW, PARTS = "tensor", "float32 per row", "parts"

#: ``Movement.across``: over the replicas of the op's shards (HSDP's ``dp_replicate``, see
#: :meth:`graphpass.mesh.Mesh.replicate_axis`), on this rank's shard, ``S / n``.
REPLICAS = "replicas"


@dataclass(frozen=True)
class Movement:
    """One collective an op runs: ``kind`` on ``factor × S`` bytes, in ``phase``, ``per``;
    ``blocking``: the step waits for it where it runs (see the module docstring). ``across``:
    ``""`` on the op's axis, or :data:`REPLICAS`: across the replicas of the op's shards, on
    ``factor × S / n`` bytes (``n`` the op's axis size); it runs only where the mesh has them."""

    phase: str
    kind: str
    factor: float = 1.0
    per: str = PER_MICROBATCH
    blocking: bool = True
    across: str = ""
    #: for an entry whose ``S`` has several parts (:data:`PARTS`), the part this one moves
    part: str = ""

    def size(self, size_bytes: float | Mapping[str, float], n: int) -> float:
        """The bytes this movement's collective runs on, for an op of ``size_bytes`` on ``n`` ranks
        (a part of an entry sized by parts is its bytes as they are: already on the shard)."""
        return self.factor * _part(size_bytes, self.part) / (n if self.across == REPLICAS and not self.part else 1)


@dataclass(frozen=True)
class Copy:
    """Local bytes an op writes (and reads) around its collectives: ``full × S + shard × S/n``
    in ``phase``, ``per`` microbatch or step (``n``: the size of the op's mesh axis)."""

    phase: str
    full: float = 0.0
    shard: float = 0.0
    per: str = PER_MICROBATCH
    part: str = ""  # as Movement.part

    def bytes(self, size_bytes: float | Mapping[str, float], n: int) -> float:
        size = _part(size_bytes, self.part)
        return self.full * size + self.shard * size / n


def _part(size_bytes: float | Mapping[str, float], part: str) -> float:
    """``S``, or its ``part`` for an entry whose ``S`` has parts (``size_of=PARTS``)."""
    if isinstance(size_bytes, Mapping):
        if not part:
            raise ValueError(f"a movement of an entry sized by parts {sorted(size_bytes)} must name its part")
        return float(size_bytes[part])
    return float(size_bytes)


@dataclass(frozen=True)
class Transition:
    """One entry of the table (see the module docstring).

    Attributes:
        name: the key, e.g. ``"zero3 weights"`` or ``"tp Shard -> Replicate"``.
        op: the runtime op's name.
        axis: ``"dp"``, ``"tp"`` or ``"ep"`` (the data-parallel entries also serve joint ``dp,tp``
            groups and, for expert weights, ``edp``).
        src, dst: the placement change, in torch's words.
        size: what ``S`` is for this op.
        collectives: the movements, forward first.
        copies: the local copies around them.
        step: multiples of ``S`` alive through the step.
        transient: multiples of ``S`` alive only while the op's layer runs (forward or backward).
        across_replicas: the movements across the replicas of the op's shards (HSDP), each
            ``across=REPLICAS``; they run only where the mesh has replicas.
        grad: for a placement change (:attr:`redistributes`), the placement its gradient arrives
            in at ``dst`` in backward where that is not ``dst`` itself: ``"Partial()"`` where
            ``dst`` feeds only sharded compute (Megatron's f; a sequence-parallel gather into
            column linears), whose gradients are partial sums.
        size_of: how ``S`` follows from the tensor (:data:`TENSOR`, :data:`FLOAT32_PER_ROW`).
        op_kwargs: the keyword arguments the emitter gives the runtime op for this entry.
        redistributes: a placement change of a value on ``axis`` (:func:`redistribution` finds
            it by ``(axis, src, dst, grad)``); the others are looked up by what they do (a ZeRO
            stage's weights, a bucket, the experts' exchange).
    """

    name: str
    op: str
    axis: str
    src: str
    dst: str
    size: str
    collectives: tuple[Movement, ...]
    copies: tuple[Copy, ...] = ()
    step: float = 0.0
    transient: float = 0.0
    across_replicas: tuple[Movement, ...] = ()
    grad: str = ""
    size_of: str = TENSOR
    op_kwargs: tuple[tuple[str, Any], ...] = ()
    redistributes: bool = False

    def size_bytes(self, shape: Sequence[int], dtype: Any) -> float:
        """``S`` for a tensor of ``shape`` and ``dtype`` (anything with ``itemsize``: a torch or
        numpy dtype): the bytes every movement and copy of this entry is a multiple of."""
        if self.size_of == FLOAT32_PER_ROW:
            return 4.0 * math.prod(shape[:-1])
        return float(math.prod(shape) * dtype.itemsize)

    def movements(self, size_bytes: float, n: int, *, replicas: bool = False,
                  backward: bool = True) -> list[tuple[Movement, float]]:
        """Each movement that runs, with the bytes its collective runs on, for a tensor of
        ``size_bytes`` (``S``) on an axis of ``n`` ranks (``replicas``: the mesh has replicas of
        the shards; ``backward=False``: forward's only, a value that needs no gradient)."""
        return [(m, m.size(size_bytes, n)) for m in self.moves(replicas) if backward or m.phase == FORWARD]

    def moves(self, replicas: bool = False) -> tuple[Movement, ...]:
        """The movements that run: :attr:`across_replicas` too where the mesh has replicas."""
        return self.collectives + (self.across_replicas if replicas else ())

    def copied(self, size_bytes: float, n: int) -> list[tuple[str, float, str]]:
        """``(phase, bytes written, per)`` of every local copy for a full tensor of ``size_bytes``
        on an axis of ``n`` ranks."""
        return [(c.phase, c.bytes(size_bytes, n), c.per) for c in self.copies]

    @property
    def key(self) -> tuple[str, str, str, str]:
        """``(axis, src, dst, grad)``: what :func:`redistribution` finds this entry by."""
        return self.axis, self.src, self.dst, self.grad


def _entries(*entries: Transition) -> dict[str, Transition]:
    table = {}
    for entry in entries:
        assert entry.name not in table, entry.name
        table[entry.name] = entry
    return table


_F, _B, _MB, _STEP = FORWARD, BACKWARD, PER_MICROBATCH, PER_STEP
_ASYNC = False  # ``Movement.blocking``: launched and waited for later (the runtime's GradSync, a prefetch)

#: Every collective graphpass emits, by name.
TABLE: Mapping[str, Transition] = _entries(
    # ---- data parallel (insert_collectives, shard_parameters) ----
    Transition("dp gradient bucket", "all_reduce_grads", "dp", "Partial()", "Replicate()",
               "the bucket's gradients", (Movement(_B, "all_reduce", per=_STEP, blocking=_ASYNC),),
               # the gradients flattened into the bucket, then averaged in place; .grad are views
               # of it (later microbatches add into it)
               copies=(Copy(_B, full=2.0, per=_STEP),),
               # the bucket's flat buffer stays between steps (as DDP's); filling it from
               # autograd's gradients holds them twice for a moment
               step=1.0, transient=1.0),
    # Compressed buckets (graphpass.compression; S in parts from compression.bucket_parts):
    # "bucket" the gradients' bytes, "p" / "q" PowerSGD's two rounds (P factors with the tensors
    # sent whole, then Q factors), "wire" one int8 hop (a byte an element and a scale a block),
    # "padded" the float32 bucket padded to whole blocks of every rank's shard. Besides the
    # bucket's buffer, each keeps its error between steps (and PowerSGD its Q).
    Transition("dp gradient bucket powersgd", "all_reduce_grads_powersgd", "dp", "Partial()", "Replicate()",
               "the bucket's gradients and PowerSGD's factors",
               (Movement(_B, "all_reduce", per=_STEP, blocking=_ASYNC, part="p"),
                Movement(_B, "all_reduce", per=_STEP, blocking=_ASYNC, part="q")),
               # the bucket filled and scaled (as a plain bucket's), the approximations written
               # back; P factors and whole tensors packed; Q factors packed, and kept (warm start)
               copies=(Copy(_B, full=3.0, per=_STEP, part="bucket"), Copy(_B, full=1.0, per=_STEP, part="p"),
                       Copy(_B, full=2.0, per=_STEP, part="q")),
               step=2.0, transient=1.0, size_of=PARTS),
    Transition("dp gradient bucket int8", "all_reduce_grads_int8", "dp", "Partial()", "Replicate()",
               "the bucket's gradients and their int8 blocks",
               (Movement(_B, "all_to_all", per=_STEP, blocking=_ASYNC, part="wire"),
                Movement(_B, "all_gather", per=_STEP, blocking=_ASYNC, part="wire")),
               # the bucket filled, scaled, copied into the padded float32 buffer and back; the
               # padded buffer divided by its scales, rounded to int8, dequantised (worker), the
               # arrivals unpacked and dequantised, the gathered blocks too (full), the shard's
               # sum divided, rounded and dequantised (a shard); each hop's send packed
               copies=(Copy(_B, full=4.0, per=_STEP, part="bucket"),
                       Copy(_B, full=4.75 + 3 / 512, shard=2.25 + 1 / 512, per=_STEP, part="padded"),
                       Copy(_B, full=1.0, shard=1.0, per=_STEP, part="wire")),
               step=2.0, transient=1.0, size_of=PARTS),
    Transition("dp reported loss", "all_reduce", "dp", "Partial(avg)", "Replicate()",
               "the loss (detached)", (Movement(_F, "all_reduce", blocking=_ASYNC),)),
    Transition("dp step", "grad_sync_begin", "dp", "-", "-", "nothing (waits for the buckets)", ()),
    # A ZeRO gather flattens this rank's shards (S/n) and unpacks the gathered buffer into the
    # full parameters (S; a view for a group of one parameter, priced as a copy all the same);
    # a reduction writes the gradients rank-major, divided on the way (S), every microbatch;
    # ZeRO-1's all-reduce then copies this rank's row out (S/n), once per step.
    Transition("zero1 weights", "all_gather_params", "dp", "Shard(0)", "Replicate()",
               "the group's full parameters (gradients alike)",
               (Movement(_F, "all_gather", per=_STEP, blocking=_ASYNC),
                Movement(_B, "all_reduce", per=_STEP, blocking=_ASYNC)),
               copies=(Copy(_F, full=1.0, shard=1.0, per=_STEP), Copy(_B, full=1.0), Copy(_B, shard=1.0, per=_STEP)),
               step=1.0),
    # Under HSDP (dp_shard), stages 2/3 all-reduce each reduced shard across the replicas once
    # the reduce-scatter is done; stage 1 all-reduces over all of dp as it does without.
    Transition("zero2 weights", "all_gather_params", "dp", "Shard(0)", "Replicate()",
               "the group's full parameters (gradients alike)",
               (Movement(_F, "all_gather", per=_STEP, blocking=_ASYNC), Movement(_B, "reduce_scatter", blocking=_ASYNC)),
               copies=(Copy(_F, full=1.0, shard=1.0, per=_STEP), Copy(_B, full=1.0)),
               step=1.0, across_replicas=(Movement(_B, "all_reduce", blocking=_ASYNC, across=REPLICAS),)),
    Transition("zero3 weights", "all_gather_params", "dp", "Shard(0)", "Replicate()",
               "the group's full parameters (gradients alike)",
               # forward's gathers are prefetched one group ahead; backward re-gathers each group
               # when it first needs it
               (Movement(_F, "all_gather", blocking=_ASYNC), Movement(_B, "all_gather"),
                Movement(_B, "reduce_scatter", blocking=_ASYNC)),
               copies=(Copy(_F, full=1.0, shard=1.0), Copy(_B, full=1.0, shard=1.0), Copy(_B, full=1.0)),
               # gathered weights until the layer is done (re-gathered in backward), then the
               # full gradient until it is reduce-scattered
               transient=2.0, across_replicas=(Movement(_B, "all_reduce", blocking=_ASYNC, across=REPLICAS),)),
    # HSDP's hop across the replicas of a ZeRO-2/3 group sent as int8 blocks with error feedback
    # (GradCompression("int8") with dp_shard: the one hop that crosses sites when the shard
    # groups are sites), in place of the groups' all-reduce there: the two hops of "dp gradient
    # bucket int8" on this rank's reduced shard, every microbatch (S in parts from
    # compression.replica_parts, every part already on the shard: "shard" its float32 bytes,
    # "wire" one int8 hop over the replicas, "padded" the shard padded to whole blocks of every
    # replica's part, "server" that over the replicas). Its errors stay between steps.
    Transition("zero replicas int8", "all_gather_params", "dp", "Partial()", "Replicate()",
               "this rank's reduced gradient shard and its int8 blocks", (),
               across_replicas=(Movement(_B, "all_to_all", blocking=_ASYNC, across=REPLICAS, part="wire"),
                                Movement(_B, "all_gather", blocking=_ASYNC, across=REPLICAS, part="wire")),
               # the shard copied into the padded float32 buffer and the mean back; the int8
               # work's own as the bucket's (its padded, server and wire coefficients)
               copies=(Copy(_B, full=2.0, part="shard"), Copy(_B, full=4.75 + 3 / 512, part="padded"),
                       Copy(_B, full=2.25 + 1 / 512, part="server"), Copy(_B, full=1.0, part="wire"),
                       Copy(_B, full=1.0, part="wire server")),
               size_of=PARTS, op_kwargs=(("compression", "int8"),)),
    # ---- tensor parallel (tensor_parallel) ----
    # An all-reduce clones its input (it reduces in place); a gather or reduce-scatter along a
    # dimension other than 0 lays the tensor out rank-major or back (S), a slice of one keeps
    # its chunk contiguous (S/n): views along dim 0, priced as copies all the same.
    Transition("tp Shard -> Replicate", "tp_all_gather", "tp", "Shard(d)", "Replicate()",
               "the gathered tensor", (Movement(_F, "all_gather"),),
               copies=(Copy(_F, full=1.0), Copy(_B, shard=1.0)), op_kwargs=(("grad", "slice"),), redistributes=True),
    Transition("tp Shard -> Replicate into column linears", "tp_all_gather", "tp", "Shard(d)", "Replicate()",
               # backward gathers it again for the linears' weight gradients instead of keeping it
               "the gathered tensor",
               (Movement(_F, "all_gather"), Movement(_B, "all_gather"), Movement(_B, "reduce_scatter")),
               copies=(Copy(_F, full=1.0), Copy(_B, full=2.0)),
               grad="Partial()", op_kwargs=(("grad", "reduce_scatter"),), redistributes=True),
    Transition("tp Partial -> Replicate", "tp_all_reduce", "tp", "Partial()", "Replicate()",
               "the partial sum", (Movement(_F, "all_reduce"),), copies=(Copy(_F, full=1.0),), redistributes=True),
    Transition("tp Partial -> Shard", "tp_reduce_scatter", "tp", "Partial()", "Shard(d)",
               "the partial sum (full size)", (Movement(_F, "reduce_scatter"), Movement(_B, "all_gather")),
               copies=(Copy(_F, full=1.0), Copy(_B, full=1.0)), redistributes=True),
    Transition("tp Replicate -> Shard", "tp_scatter", "tp", "Replicate()", "Shard(d)",
               "the replicated tensor", (Movement(_B, "all_gather"),), copies=(Copy(_F, shard=1.0), Copy(_B, full=1.0)),
               redistributes=True),
    Transition("tp Replicate into sharded compute", "tp_copy", "tp", "Replicate()", "Replicate()",
               "the replicated tensor", (Movement(_B, "all_reduce"),), copies=(Copy(_B, full=1.0),),
               grad="Partial()", redistributes=True),
    # The max, then the target logits and sums of exponentials stacked into one all-reduce;
    # its passes over the logits are the loss's own compute (the cross-entropy it replaces).
    Transition("tp vocabulary-parallel loss", "vocab_parallel_cross_entropy", "tp", "Shard(-1)", "Replicate()",
               "one float32 per token", (Movement(_F, "all_reduce"), Movement(_F, "all_reduce", 2.0)),
               copies=(Copy(_F, full=2.0),), size_of=FLOAT32_PER_ROW),
    # ---- expert parallel (expert_parallel) ----
    # Every rank learns how many rows it receives per local expert before the rows move
    # (written in place, no copies); the rows' all-to-all has uneven splits, so S is the rows this
    # rank sends, which balanced routing makes also the rows it receives. Each side permutes the
    # rows between source-major (as the all-to-all lays them out) and expert-major (as the
    # grouped product reads them), forward and backward.
    Transition("ep token counts", "ep_counts", "ep", "-", "-",
               "the per-expert row counts (E int64)", (Movement(_F, "all_to_all"),)),
    Transition("ep dispatch", "ep_dispatch", "ep", "Shard(0)", "Shard(0)",
               "the routed rows this rank sends to the experts' ranks",
               (Movement(_F, "all_to_all"), Movement(_B, "all_to_all")),
               copies=(Copy(_F, full=1.0), Copy(_B, full=1.0))),
    Transition("ep combine", "ep_combine", "ep", "Shard(0)", "Shard(0)",
               "the experts' output rows this rank sends back",
               (Movement(_F, "all_to_all"), Movement(_B, "all_to_all")),
               copies=(Copy(_F, full=1.0), Copy(_B, full=1.0))),
    # ---- embedding tables (shard_embeddings) ----
    # Like the experts' exchange: counts first, then the ids (as int64 rows: the row in the
    # receiving shard, the bag, the weight's bits), then the pooled blocks back and, in backward,
    # their gradients out again; S of the ids is what this rank sends, of the blocks what it
    # returns, which balanced ids make also what it receives. A replicated table's backward
    # all-gathers every rank's rows and row gradients (S: this rank's, padded to the most).
    # The ops of one group of lookups (every table's, one exchange): the counts and the ids are
    # stacked per lookup, then laid out per destination (twice S); the pooled rows are added
    # straight into the buffer sent back, and the gradient blocks laid out once per holder
    # (backward); a replicated table's rows and gradients are packed once.
    Transition("table counts", "table_counts", "dp", "-", "-",
               "the id and bag counts of each lookup sent to each rank (2nJ int64)", (Movement(_F, "all_to_all"),),
               copies=(Copy(_F, full=2.0),)),
    Transition("table ids", "table_dispatch", "dp", "Shard(0)", "Shard(0)",
               "the ids this rank sends, with their bags (and weights), as int64 rows",
               (Movement(_F, "all_to_all"),), copies=(Copy(_F, full=2.0),)),
    Transition("table pooled", "table_combine", "dp", "Partial()", "Shard(0)",
               "the pooled blocks this rank returns to the ranks whose ids it served",
               (Movement(_F, "all_to_all"), Movement(_B, "all_to_all")), copies=(Copy(_B, full=1.0),)),
    # A table with HET's cache (graphpass.runtime.row_cache): each rank pulls the rows it reads
    # that are neither its own nor cached fresh enough; S is the bytes of those rows (their
    # columns from each holder), which balanced reads make also the rows it serves. The pull's
    # two requests ahead of the rows, the counts ([n, T] int64 for T tables) and the rows'
    # indices (8 bytes a row asked of each holder), are priced by the cost model with them
    # (cost/search/tables.py). Copies: the rows served, laid out once, and the pulled rows kept
    # by the cache (forward); the gradients of others' rows kept as pending writes (backward),
    # pushed at the end of the step at most staleness steps late, outside the graph. The cache's
    # index bookkeeping (int64 ids, clocks, use counts: 32 bytes a pulled row, 16 a written one)
    # is not priced.
    Transition("table cached rows", "table_cached", "dp", "Shard(0)", "Shard(0)",
               "the rows this rank pulls from their holders (requests ahead: counts, 8 bytes a row)",
               (Movement(_F, "all_to_all"),), copies=(Copy(_F, full=2.0), Copy(_B, full=1.0))),
    Transition("table replicated gradients", "table_replicated", "dp", "-", "-",
               "this rank's rows and row gradients, as rows of the table's dtype",
               (Movement(_B, "all_gather"),), copies=(Copy(_B, full=1.0),)),
)


def _spelled(placement: Any) -> tuple[str, int | None]:
    """A placement (torch's object or its JSON spelling) as the table spells it, with its dim:
    ``("Shard(d)", 1)``, ``("Replicate()", None)``, ``("Partial()", None)``."""
    text = placement if isinstance(placement, str) else type(placement).__name__
    if text.startswith("Shard"):
        dim = getattr(placement, "dim", None)
        if dim is None and "(" in text:
            inner = text[text.index("(") + 1:-1].removeprefix("dim=")
            dim = int(inner) if inner.lstrip("-").isdigit() else None
        return "Shard(d)", dim
    if text.startswith("Replicate"):
        return "Replicate()", None
    if text.startswith("Partial"):
        op = getattr(placement, "reduce_op", None) or (text[text.index("(") + 1:-1] if "(" in text else "sum")
        return ("Partial()" if op in ("sum", "") else f"Partial({op})"), None
    raise ValueError(f"not a placement: {placement!r}")


def redistribution(axis: str, src: Any, dst: Any, grad: Any = None) -> tuple[Transition, ...]:
    """The entries that change a value's placement on ``axis`` from ``src`` to ``dst``, in the
    order they run: none where nothing changes, one entry, or for ``Shard(a) -> Shard(b)`` a
    gather then a scatter. ``grad``: the placement the value's gradient arrives in at ``dst``
    where it is not ``dst`` itself (``Partial()``: ``dst`` feeds only sharded compute; see
    :attr:`Transition.grad`). Placements are torch's objects or their JSON spelling.

    The emitter (`graphpass.passes.collectives.emit_tp_redistribute`), the op-level problem
    (`graphpass.planner.op_placement`) and the planner read the conversion from here.

    Raises:
        NotImplementedError: no entry makes this change.
    """
    (s, s_dim), (d, d_dim) = _spelled(src), _spelled(dst)
    g = _spelled(grad)[0] if grad not in (None, "") and _spelled(grad) != (d, d_dim) else ""
    if (s, s_dim, g) == (d, d_dim, ""):
        return ()
    entry = _INDEX.get((axis, s, d, g))
    if entry is not None:
        return (entry,)
    if s == d == "Shard(d)" and not g:
        return _INDEX[(axis, s, "Replicate()", "")], _INDEX[(axis, "Replicate()", d, "")]
    raise NotImplementedError(f"no collective on {axis!r} turns {s} into {d}"
                              + (f" with a {g} gradient" if g else "")
                              + f"; the table changes {sorted(k[1:] for k in _INDEX if k[0] == axis)}")


def transition(op: str, *, stage: int | None = None) -> Transition:
    """The entry of the emitted op ``op`` (``stage``: the ZeRO stage of ``all_gather_params``).
    An op that carries out several entries (``tp_all_gather``: into replicated or into sharded
    compute) is found by its placements instead (:func:`redistribution`), and an emitted node
    names its entry in ``meta[graphpass.meta.TRANSITION]``.

    Raises:
        ValueError: an op graphpass does not emit, a missing/bad ``stage``, or an op with
            several entries.
    """
    if op == "all_gather_params":
        if stage not in (1, 2, 3):
            raise ValueError(f"transition('all_gather_params'): stage must be 1, 2 or 3, got {stage!r}")
        return TABLE[f"zero{stage} weights"]
    entries = [entry for entry in TABLE.values() if entry.op == op]
    if not entries:
        raise ValueError(f"unknown collective op {op!r}; the table has {sorted({e.op for e in TABLE.values()})}")
    if len(entries) > 1:
        raise ValueError(f"{op!r} carries out {[e.name for e in entries]}; find the entry by its placements "
                         "(redistribution) or by the node's meta[graphpass.meta.TRANSITION]")
    return entries[0]


def _index() -> dict[tuple[str, str, str, str], Transition]:
    index: dict[tuple[str, str, str, str], Transition] = {}
    for entry in TABLE.values():
        if entry.redistributes:
            assert entry.key not in index, (entry.name, index.get(entry.key))
            index[entry.key] = entry
    return index


_INDEX = _index()

#: The names of the runtime ops the table covers.
OPS = tuple(sorted({entry.op for entry in TABLE.values()}))
