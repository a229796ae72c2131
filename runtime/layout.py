"""Where each of a rank's tensors sits in the original model's tensors, and the full tensors back.

A compiled rank holds, for each ``model.state_dict()`` key its graph reads, zero or more
rectangular pieces of the full tensor, each a view of one local tensor. Which pieces follows from
the tensor's :class:`graphpass.layout.TensorLayout` (``gp.layout``), its cuts undone from the
rank's tensor outwards (:meth:`~graphpass.layout.TensorLayout.cuts` in reverse):

- ZeRO's ``Shard(0)`` is a run of dim-0 rows of the tensor it shards; its padding rows belong to
  nothing, and a rank whose rows are all padding holds no piece;
- a tensor-parallel ``Shard(d)`` is chunk r of dim d, or chunk r of each fused part along it (q, k
  and v of a fused projection), which is one piece per part; experts sharded over ``ep`` are
  chunk r of dim 0 while in order, and one piece per expert once dynamic placement has moved
  them (the expert a slot holds);
- a split operator's slice sits at its ``start`` along its dim.

A :class:`HeldPieces` describes the pieces by index, not by tensor, so it applies to any tensor of the
local shape: the parameter and each of its optimizer states alike. Checkpoints
(:mod:`graphpass.runtime.checkpoint`) write and read these pieces under the original keys, which is
what lets a checkpoint made under one plan load under another. :func:`gather_full` undoes the same
cuts with collectives (``full_state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.fx as fx

from graphpass import meta
from graphpass.layout import Cut, Slice, TensorLayout, shard_rows
from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime.tensor_parallel import gather_tp_parameters
from graphpass.runtime.zero import gather_full_parameters


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
class HeldPieces:
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


def _zero(pieces: list[Piece], cut: Cut, rank: int) -> list[Piece]:
    """Rows ``[rank * c, rank * c + valid)`` of the tensor the shard cuts (padding dropped)."""
    out = []
    for piece in pieces:
        rows = piece.index[0].stop - piece.index[0].start
        first = rank * rows
        valid = max(0, min(rows, cut.shape[0] - first))
        if valid:
            index = (slice(piece.index[0].start, piece.index[0].start + valid), *piece.index[1:])
            out.append(Piece((first, *piece.offsets[1:]), index))
    return out


def _chunk(pieces: list[Piece], cut: Cut, rank: int) -> list[Piece]:
    """Chunk ``rank`` of dim ``d`` of each fused part (one part: the whole dim)."""
    d = cut.dim
    parts = list(cut.parts or [cut.shape[d]])
    out = []
    for piece in pieces:
        start, stop = piece.offsets[d], piece.offsets[d] + piece.sizes[d]
        local_start = full_start = 0
        for n in parts:
            width = n // cut.size
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
    return out


def _sliced(pieces: list[Piece], slice_: Slice) -> list[Piece]:
    moved = []
    for piece in pieces:
        offsets = list(piece.offsets)
        offsets[slice_.dim] += slice_.start
        moved.append(Piece(tuple(offsets), piece.index))
    return moved


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
              placement: torch.Tensor | None = None) -> HeldPieces | None:
    """The layout of ``get_attr`` node ``node``'s tensor ``local`` on this rank, under the first
    original key it stands for (tied weights are saved once); None for a node standing for no key
    (a module a pass created). ``placement``: for experts sharded over ``ep``, the expert in
    each slot (:mod:`graphpass.runtime.expert_placement`); None: in order."""
    tensor_layout = meta.layout(node)
    slice_ = None if tensor_layout is None else tensor_layout.slice
    keys = slice_.state_keys if slice_ is not None else node.meta.get(meta.STATE_KEYS, ())
    if not keys:
        return None
    pieces, shape = _whole(tuple(local.shape)), tuple(local.shape)
    if tensor_layout is not None and tensor_layout.owner is not None and tensor_layout.rows:
        # a group's rows: any rank's view is of a group member's padded rows (this rank may hold none)
        pieces = _whole(tensor_layout.local_shape)
    if tensor_layout is not None:
        # from the rank's tensor outwards: the cuts in reverse order
        first = tensor_layout.owner[1] if tensor_layout.owner is not None else 0  # a group's first rank
        for cut in reversed(list(tensor_layout.cuts())):
            rank = mesh.axis_rank(cut.axis) - (first if cut.rows else 0)
            if cut.padded:
                pieces = _zero(pieces, cut, rank)
            else:
                pieces = _chunk(pieces, cut, rank)
                if placement is not None and cut.dim == 0:
                    pieces = _placed(pieces, placement)
            shape = cut.shape
        if slice_ is not None:
            pieces, shape = _sliced(pieces, slice_), tensor_layout.shape
    local_shape = tuple(local.shape)
    if tensor_layout is not None and tensor_layout.owner is not None:
        axis, owner = tensor_layout.owner
        if tensor_layout.rows:  # rows cut among a group of ranks from the owner on; none elsewhere
            if not owner <= mesh.axis_rank(axis) < owner + tensor_layout.axis_size(axis):
                pieces = []
        else:  # the owner holds it whole
            shape = tensor_layout.shape
            mine = mesh.axis_rank(axis) == owner
            pieces, local_shape = (_whole(shape), shape) if mine else ([], local_shape)
    pieces = [p for p in pieces if all(n > 0 for n in p.sizes)]
    return HeldPieces(keys[0], shape, local_shape, tuple(pieces))


def _from_group(local: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """The whole tensor whose rows a group of ranks holds (``layout.owner``'s rank and the next
    ones, padded rows each; a table-row-wise embedding table), on every rank of its axis: one
    all-gather of every rank's padded rows (zeros outside the group)."""
    axis, owner = layout.owner
    mesh = mesh_lib.current()
    group = mesh.group(axis)
    c = shard_rows(layout.shape[0], layout.axis_size(axis))
    padded = local.new_zeros(c, *layout.shape[1:])
    padded[:local.shape[0]] = local.detach()
    if group is None:
        return padded[:layout.shape[0]]
    everyone = padded.new_empty(mesh.axis_size(axis) * c, *layout.shape[1:])
    torch.distributed.all_gather_into_tensor(everyone, padded, group=group)
    return everyone[owner * c:owner * c + layout.shape[0]].clone()


def _from_owner(local: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """The whole tensor held by ``layout.owner`` alone, on every rank of its axis (a broadcast)."""
    axis, owner = layout.owner
    mesh = mesh_lib.current()
    group = mesh.group(axis)
    if group is None:
        return local
    full = local.detach().clone() if mesh.axis_rank(axis) == owner else local.new_empty(layout.shape)
    torch.distributed.broadcast(full, src=torch.distributed.get_global_rank(group, owner), group=group)
    return full


def gather_full(tensors: Mapping[str, tuple[torch.Tensor, TensorLayout]],
                experts: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors of sharded ones, by attribute target: each tensor's cuts undone from the
    innermost out (ZeRO's rows gathered first, then tensor- or expert-parallel chunks, experts back
    in expert order), then a split operator's slices concatenated under the original target.

    A collective over each axis a tensor is cut on: every rank of those axes calls it with the
    same tensors (one pipeline stage's). ``tensors``: ``{target: (local tensor, layout)}``;
    ``experts(buffer)``: the tensor naming each slot's expert.
    """
    out: dict[str, torch.Tensor] = {}
    # a group's rows (table-row-wise) are gathered by _from_group below, not cut by cut
    pending = {target: (local, [] if layout.owner is not None and layout.rows else list(layout.cuts()))
               for target, (local, layout) in tensors.items()}
    with torch.no_grad():
        while any(cuts for _, cuts in pending.values()):
            # every tensor's innermost remaining cut, one batched collective per (axis, kind)
            groups: dict[tuple[str, bool], list[str]] = {}
            for target, (_, cuts) in pending.items():
                if cuts:
                    groups.setdefault((cuts[-1].axis, cuts[-1].padded), []).append(target)
            for (axis, zero), targets in sorted(groups.items()):
                local = [pending[t][0] for t in targets]
                cuts = [pending[t][1].pop() for t in targets]
                if zero:
                    fulls = gather_full_parameters(local, [c.shape for c in cuts], axis)
                else:
                    fulls = gather_tp_parameters(local, [c.dim for c in cuts], axis, [c.parts or None for c in cuts])
                for target, cut, full in zip(targets, cuts, fulls):
                    buffer = tensors[target][1].experts
                    if buffer is not None and not cut.padded:  # slots back to expert order
                        full = full[experts(buffer).argsort()]
                    pending[target] = (full, pending[target][1])
        for target, (local, layout) in tensors.items():
            if layout.owner is not None and layout.rows:  # rows held by a group of ranks
                pending[target] = (_from_group(local, layout), [])
            elif layout.owner is not None:  # held by one rank: it sends the others the whole tensor
                pending[target] = (_from_owner(pending[target][0], layout), [])
        slices: dict[str, list[tuple[Slice, torch.Tensor]]] = {}
        for target, (full, _) in pending.items():
            slice_ = tensors[target][1].slice
            if slice_ is None:
                out[target] = full
            else:
                slices.setdefault(slice_.target, []).append((slice_, full))
        for target, parts in slices.items():
            parts.sort(key=lambda item: item[0].index)
            out[target] = torch.cat([full for _, full in parts], dim=parts[0][0].dim)
    return out
