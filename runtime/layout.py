"""Where each of a rank's tensors sits in the original model's tensors.

A compiled rank holds, for each ``model.state_dict()`` key its graph reads, zero or more
rectangular pieces of the full tensor, each a view of one local tensor:

- a ZeRO shard (``gp.shard``) is a run of dim-0 rows of the tensor it shards; its padding rows
  belong to nothing, and a rank whose rows are all padding holds no piece;
- a tensor-parallel shard (``gp.tp_shard``) is chunk r of one dim, or chunk r of each fused part
  along it (``parts``: q, k and v of a fused projection), which is one piece per part; experts
  sharded over ``ep`` are chunk r of dim 0 while in order, and one piece per expert once
  dynamic placement has moved them (the expert a slot holds);
- a split operator's slice (``gp.split``) sits at its ``start`` along its dim.

They compose in that order from the local tensor outwards (ZeRO shards the tensor-parallel chunk or
the slice). A :class:`Layout` describes the pieces by index, not by tensor, so it applies to any
tensor of the local shape: the parameter and each of its optimizer states alike. Checkpoints
(:mod:`graphpass.runtime.checkpoint`) write and read these pieces under the original keys, which is
what lets a checkpoint made under one plan load under another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.fx as fx

from graphpass import meta
from graphpass.runtime import mesh as mesh_lib


@dataclass(frozen=True)
class Piece:
    """One rectangle of the full tensor held locally: at ``offsets`` in the full tensor, and at
    ``index`` (one slice per dim) in the local tensor."""

    offsets: tuple[int, ...]
    index: tuple[slice, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.index)


@dataclass(frozen=True)
class Layout:
    """The pieces of full tensor ``key`` (shape ``shape``) that a local tensor of shape ``local``
    holds; empty when this rank holds none of it."""

    key: str
    shape: tuple[int, ...]
    local: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def views(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of ``tensor`` (a tensor of the local shape), as views of it."""
        if tuple(tensor.shape) != self.local:
            raise ValueError(
                f"{self.key!r}: a tensor of shape {tuple(tensor.shape)} does not have this rank's "
                f"local shape {self.local}"
            )
        return [tensor[piece.index] for piece in self.pieces]


def _whole(shape: tuple[int, ...]) -> list[Piece]:
    return [Piece(tuple(0 for _ in shape), tuple(slice(0, n) for n in shape))]


def _zero(pieces: list[Piece], shard: Mapping, rank: int) -> tuple[list[Piece], tuple[int, ...]]:
    """Rows ``[rank * c, rank * c + valid)`` of the tensor the shard cuts (padding dropped)."""
    shape = tuple(shard["shape"])
    out = []
    for piece in pieces:
        rows = piece.index[0].stop - piece.index[0].start
        first = rank * rows
        valid = max(0, min(rows, shape[0] - first))
        if valid:
            index = (slice(piece.index[0].start, piece.index[0].start + valid), *piece.index[1:])
            out.append(Piece((first, *piece.offsets[1:]), index))
    return out, shape


def _tensor_parallel(pieces: list[Piece], shard: Mapping, rank: int, size: int) -> tuple[list[Piece], tuple[int, ...]]:
    """Chunk ``rank`` of dim ``d`` of each fused part (one part: the whole dim)."""
    shape, d = tuple(shard["shape"]), shard["dim"]
    parts = list(shard.get("parts") or [shape[d]])
    out = []
    for piece in pieces:
        start, stop = piece.offsets[d], piece.offsets[d] + piece.sizes[d]
        local_start = full_start = 0
        for n in parts:
            width = n // size
            lo, hi = max(start, local_start), min(stop, local_start + width)
            if lo < hi:
                offsets = list(piece.offsets)
                offsets[d] = full_start + rank * width + (lo - local_start)
                index = list(piece.index)
                first = piece.index[d].start + (lo - start)
                index[d] = slice(first, first + (hi - lo))
                out.append(Piece(tuple(offsets), tuple(index)))
            local_start += width
            full_start += n
    return out, shape


def _split(pieces: list[Piece], split: Mapping) -> tuple[list[Piece], tuple[int, ...]]:
    d = split["dim"]
    moved = []
    for piece in pieces:
        offsets = list(piece.offsets)
        offsets[d] += split["start"]
        moved.append(Piece(tuple(offsets), piece.index))
    return moved, tuple(split["shape"])


def _placed(pieces: list[Piece], placement: torch.Tensor) -> list[Piece]:
    """Pieces of stacked experts whose dim-0 positions are slots: one piece per row, at the row
    of the expert its slot holds (``placement[slot]``)."""
    if torch.equal(placement, torch.arange(placement.numel(), device=placement.device)):
        return pieces
    expert_at = placement.tolist()
    out = []
    for piece in pieces:
        for r in range(piece.sizes[0]):
            index = (slice(piece.index[0].start + r, piece.index[0].start + r + 1), *piece.index[1:])
            out.append(Piece((expert_at[piece.offsets[0] + r], *piece.offsets[1:]), index))
    return out


def layout_of(node: fx.Node, local: torch.Tensor, mesh: mesh_lib.ProcessMesh,
              placement: torch.Tensor | None = None) -> Layout | None:
    """The layout of ``get_attr`` node ``node``'s tensor ``local`` on this rank, under the first
    original key it stands for (tied weights are saved once); None for a node standing for no key
    (a module a pass created). ``placement``: for experts sharded over ``ep``, the expert in
    each slot (:mod:`graphpass.runtime.expert_placement`); None: in order."""
    split = node.meta.get(meta.SPLIT)
    keys = split["state_keys"] if split is not None else node.meta.get(meta.STATE_KEYS, ())
    if not keys:
        return None
    pieces, shape = _whole(tuple(local.shape)), tuple(local.shape)
    if meta.SHARD in node.meta:
        shard = node.meta[meta.SHARD]
        pieces, shape = _zero(pieces, shard, mesh.axis_rank(shard["axis"]))
    if meta.TP_SHARD in node.meta:
        shard = node.meta[meta.TP_SHARD]
        pieces, shape = _tensor_parallel(pieces, shard, mesh.axis_rank(shard["axis"]), mesh.axis_size(shard["axis"]))
        if placement is not None and shard["dim"] == 0:
            pieces = _placed(pieces, placement)
    if split is not None:
        pieces, shape = _split(pieces, split)
    pieces = [p for p in pieces if all(n > 0 for n in p.sizes)]
    return Layout(keys[0], shape, tuple(local.shape), tuple(pieces))
