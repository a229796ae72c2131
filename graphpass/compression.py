"""Compressed data-parallel gradient synchronisation: fewer bytes across a slow link, inexactly.

Two compressors for the gradient buckets of plain data parallelism
(:class:`GradCompression`, ``Strategy(grad_compression=...)``), both with error feedback: what a
step's compression leaves out is kept on the rank and added to its next step's gradient, so
nothing is lost, only delayed (Seide et al. 2014; Karimireddy et al. 2019). Neither trains as
one process does; the planner never picks one unless told it may.

- ``"powersgd"`` (Vogels et al., NeurIPS 2019, Algorithm 1 with error feedback): each gradient
  matrix ``M`` (a parameter of two or more dims, viewed ``rows x rest``) worth compressing at rank
  ``r`` (``(rows + cols) r < rows cols``) is sent as two thin factors. With ``E`` the rank's
  error and ``Q`` last step's (warm start; the first step draws it from a seed every rank
  shares)::

      M <- G + E;   P <- sum_ranks(M Q);   P^ <- orthogonalise(P)   (Gram-Schmidt)
      Q_r <- M^T P^;   E <- M - P^ Q_r^T;   Q <- sum_ranks(Q_r);   G' <- P^ Q^T

  (``G`` already divided by the data-parallel size, so the sums are means; the error is what
  the rank's own factors leave out, the paper's ``e_w <- D_w - decompress(C(D_w))``, so the
  ranks' errors sum to what the mean's approximation left out). Vectors (biases,
  norms) and matrices too small to gain are all-reduced exactly with ``P``. Bytes: ``4 (rows +
  cols) r`` per compressed matrix instead of ``4 rows cols``.
- ``"int8"``: an 8-bit all-reduce in two hops with error feedback on both (the worker and
  server errors of DeepSpeed's compressed all-reduce, 1-bit Adam): the bucket ``G + E_w``, cut
  into one shard per rank and blocks of :data:`INT8_BLOCK` elements, each block a scale
  (``max |x| / 127``) and int8 values; ``E_w`` keeps what rounding lost. An all-to-all hands
  every rank each rank's blocks of its shard, which it sums (plus its server error ``E_s``),
  rounds again to int8 (``E_s`` keeps that loss), and an all-gather returns every shard to
  every rank: ``2 (1 + 4 / INT8_BLOCK)`` bytes an element instead of a ring all-reduce's ``8``.

The runtime ops are :mod:`graphpass.runtime.compressed_sync`; the table's entries "dp gradient
bucket powersgd" / "dp gradient bucket int8" (:mod:`graphpass.transitions`) say what they move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

#: the compressors
KINDS = ("powersgd", "int8")
#: elements per int8 block (one float32 scale each)
INT8_BLOCK = 512


@dataclass(frozen=True)
class GradCompression:
    """How a plan's data-parallel gradient buckets are synchronised compressed (module docstring).

    Attributes:
        kind: ``"powersgd"`` or ``"int8"``.
        rank: PowerSGD's rank ``r`` (columns of its factors).
        warm_start: PowerSGD starts each step's power iteration from the last step's ``Q``.
    """

    kind: str
    rank: int = 4
    warm_start: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"GradCompression.kind must be one of {KINDS}, got {self.kind!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"GradCompression.rank must be a positive int, got {self.rank!r}")
        if not isinstance(self.warm_start, bool):
            raise ValueError(f"GradCompression.warm_start must be a bool, got {self.warm_start!r}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": self.rank, "warm_start": self.warm_start}

    @classmethod
    def from_json(cls, data: Any) -> GradCompression:
        if not isinstance(data, Mapping) or "kind" not in data or set(data) - {"kind", "rank", "warm_start"}:
            raise ValueError(f"Plan.grad_compression must be an object with kind (and rank, warm_start), got {data!r}")
        return cls(**data)

    def __str__(self) -> str:
        return f"PowerSGD rank {self.rank}" if self.kind == "powersgd" else "int8 with error feedback"


def matrix_of(shape: Sequence[int], rank: int) -> tuple[int, int] | None:
    """``(rows, cols)`` PowerSGD compresses a gradient of ``shape`` as, or None where it is sent
    whole (a vector, or a matrix whose factors would be no smaller)."""
    if len(shape) < 2:
        return None
    rows = int(shape[0])
    cols = math.prod(int(s) for s in shape[1:])
    return (rows, cols) if (rows + cols) * rank < rows * cols else None


def powersgd_parts(shapes: Sequence[Sequence[int]], rank: int, itemsize: int = 4) -> dict[str, float]:
    """The bytes PowerSGD's two all-reduces move for a bucket of ``shapes``: ``"p"`` (the
    ``P`` factors and the tensors sent whole) and ``"q"`` (the ``Q`` factors)."""
    p = q = 0.0
    for shape in shapes:
        matrix = matrix_of(shape, rank)
        if matrix is None:
            p += math.prod(shape) * itemsize
        else:
            p += matrix[0] * rank * itemsize
            q += matrix[1] * rank * itemsize
    return {"p": p, "q": q}


def int8_padded(numel: int, num_ranks: int) -> int:
    """A bucket's elements padded to whole blocks of every rank's shard."""
    unit = num_ranks * INT8_BLOCK
    return -(-numel // unit) * unit


def int8_bytes(numel: int, num_ranks: int) -> float:
    """What each int8 hop moves for a bucket of ``numel`` elements: a byte per (padded) element
    and a float32 scale per block."""
    padded = int8_padded(numel, num_ranks)
    return float(padded + 4 * padded // INT8_BLOCK)


def bucket_parts(compression: GradCompression, shapes: Sequence[Sequence[int]], num_ranks: int,
                 itemsize: int = 4) -> dict[str, float]:
    """``S`` of a compressed bucket of gradients of ``shapes`` on ``num_ranks`` ranks, in the
    parts its table entry names ("dp gradient bucket powersgd" / "int8",
    :mod:`graphpass.transitions`)."""
    numel = sum(math.prod(shape) for shape in shapes)
    parts = {"bucket": float(numel * itemsize)}
    if compression.kind == "powersgd":
        parts.update(powersgd_parts(shapes, compression.rank, itemsize))
    else:
        parts.update(wire=int8_bytes(numel, num_ranks), padded=4.0 * int8_padded(numel, num_ranks))
    return parts


def replica_parts(shard_numel: int, replicas: int, itemsize: int = 4) -> dict[str, float]:
    """``S`` of the table's "zero replicas int8" for a reduced gradient shard of ``shard_numel``
    elements sent across ``replicas`` replicas (every part on the shard)."""
    padded = int8_padded(shard_numel, replicas)
    wire = int8_bytes(shard_numel, replicas)
    return {"shard": float(shard_numel * itemsize), "wire": wire, "wire server": wire / replicas,
            "padded": 4.0 * padded, "server": 4.0 * padded / replicas}


def beyond_plain_data_parallel(strategy: Any, also: Sequence[str] = (), hsdp: bool = False) -> list[str]:
    """The fields of ``strategy`` (``name=value``) that go beyond plain data parallelism (ZeRO,
    tp, ep, HSDP, sharded tables, and ``also``), which the inexact synchronisations do not
    combine with yet; ``hsdp``: HSDP's ``zero`` and ``dp_shard`` are built for (they are left out)."""
    plain = {"zero": 0, "tp": 1, "ep": 1, "dp_shard": None, "embeddings": None, "grad_compression": None}
    names = ("tp", "ep", "embeddings") if hsdp else ("zero", "tp", "ep", "dp_shard", "embeddings")
    return [f"{name}={getattr(strategy, name)}" for name in (*names, *also) if getattr(strategy, name) != plain[name]]


def across_replicas(compression: Any, zero: int) -> bool:
    """Whether ``compression`` under HSDP at ZeRO stage ``zero`` compresses only the hop across
    the replicas (int8 at stages 2/3; the table's "zero replicas int8")."""
    return compression is not None and compression.kind == "int8" and zero in (2, 3)


def check_strategy(strategy: Any) -> None:
    """A Strategy's ``grad_compression``: a :class:`GradCompression` on plain data parallelism,
    or int8 on HSDP's hop across the replicas (``dp_shard`` with ZeRO-2/3)."""
    compression = strategy.grad_compression
    if compression is None:
        return
    if not isinstance(compression, GradCompression):
        raise ValueError(f"Strategy.grad_compression must be a graphpass.GradCompression or None, got {compression!r}")
    if strategy.dp_shard is not None:
        if not across_replicas(compression, strategy.zero):
            raise NotImplementedError(
                f"Strategy.grad_compression={compression!r} with dp_shard={strategy.dp_shard}, zero={strategy.zero}: "
                "under HSDP only int8 at zero=2 or 3 is built (it compresses the hop across the replicas, each "
                "rank's reduced shard: flat, so no matrix for PowerSGD; ZeRO-1 all-reduces over all of dp at once)")
    unsupported = beyond_plain_data_parallel(strategy, hsdp=strategy.dp_shard is not None)
    if unsupported:
        raise NotImplementedError(
            f"Strategy.grad_compression={compression!r} compresses plain data parallelism's gradient buckets; "
            f"with {', '.join(unsupported)} it is not built yet (drop those, or grad_compression)")


__all__ = ["GradCompression", "INT8_BLOCK", "KINDS", "across_replicas", "beyond_plain_data_parallel", "replica_parts", "bucket_parts", "check_strategy", "int8_bytes", "int8_padded", "matrix_of",
           "powersgd_parts"]
