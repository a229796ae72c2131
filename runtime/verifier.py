"""The static verifier: every rank's collectives and shards, checked against its peers' before
anything runs.

A collective pairs up the ranks of one process group by order: the k-th collective a rank issues
on a group meets the k-th of every other member. If one rank's program drops one, reorders two or
gives one another shape, the job hangs (NCCL) or silently mixes values up (gloo pairs whatever
arrives). graphpass emits every collective as a graph node (``graphpass.passes.collectives``), so a
rank's program is known before it runs: this module reads it and compares the ranks.

What a rank's program is, per process group (a mesh axis, or several joined, and the ranks along
it from this rank): the collective nodes of the stages it runs, in graph order, each with its op,
the node's name (the same on every rank: the ranks compile the same model the same way), the
shapes and dtypes of what it moves and returns, the parameters it moves, and its keyword
arguments (ZeRO group, stage, full shapes). Backward's collectives follow from the forward graph
(each op carries its own backward), so equal forward sequences mean equal backward ones. Besides
the collectives, the ranks of one data × tensor parallel group must hold equally shaped shards of
every parameter (the ``shards`` entry), and the shards' layouts must tile each full parameter
exactly (:mod:`graphpass.runtime.layout`, from the graph's metadata), and the predicted memory
must fit the device.

Two ways in, one check:

* ``compile`` (``verify=True``, the default): each rank records its program after every pass;
  the ranks exchange one digest per group and pass (one small ``all_gather_object``), and only if
  they disagree, the programs of the first pass where they do. Every rank then raises the same
  :class:`VerificationError`, naming the pass, the node and the ranks, before training starts.
* :func:`graphpass.verify` simulates every rank's passes in one process on meta tensors (a
  cluster you do not have: 8 ranks of a 1.5B GPT from a laptop) and checks them the same way.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from graphpass import meta
from graphpass.layout import Tiers
from graphpass.mesh import Mesh, pipeline_rank
from graphpass.plan import Plan
from graphpass.units import format_bytes
from graphpass.runtime.collectives import COLLECTIVE_OPS
from graphpass.runtime.layout import layout_of
from graphpass.runtime.offload import schedule_problems

#: A process group as the verifier names it: (axis, or axes joined by commas, its member ranks).
#: The ``shards`` group holds what each rank of a data x tensor parallel group holds.
Group = tuple[str, tuple[int, ...]]
SHARDS = "shards"


class VerificationError(RuntimeError):
    """The ranks' programs, checked before training, disagree (or do not fit the device)."""


@dataclass(frozen=True)
class Entry:
    """One item of a rank's program on a group: a collective node (``op``, the runtime op) or,
    in the ``shards`` group, a tensor the rank holds (``op == "holds"``)."""

    node: str
    op: str
    created_by: str
    signature: tuple

    def describe(self) -> str:
        if self.op == "holds":
            shape, dtype = self.signature
            return f"holds {self.node!r} as {_shape_text(shape, dtype)}"
        moves, returns = self.signature[0], self.signature[1]
        made = f", made by {self.created_by}" if self.created_by else ""
        return f"{self.op} (node {self.node!r}{made}) of {_shapes_text(moves)} -> {_shapes_text(returns)}"


def _shape_text(shape: tuple | None, dtype: str) -> str:
    if shape is None:
        return dtype
    return f"{tuple(shape)} {dtype.removeprefix('torch.')}"


def _shapes_text(tensors: Sequence[tuple], shown: int = 4) -> str:
    text = ", ".join(_shape_text(*t) for t in tensors[:shown])
    return f"[{text}, ... {len(tensors)} in all]" if len(tensors) > shown else f"[{text}]"


def _tensors(value: Any) -> list[tuple[tuple[int, ...] | None, str]]:
    if isinstance(value, torch.Tensor):
        return [(tuple(value.shape), str(value.dtype))]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return [(None, type(value).__name__)] if value is not None else []


def _plain(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _plain(v)) for k, v in value.items()))
    return value


def _value(node: fx.Node) -> Any:
    """What a node holds, as the ranks compare it: a tensor one rank of an axis holds alone (a
    table-wise embedding table; the others hold none of it) as its whole shape."""
    value = node.meta.get(meta.VAL)
    layout = meta.layout(node) if node.op == "get_attr" else None
    if layout is not None and layout.owner is not None and isinstance(value, torch.Tensor):
        return torch.empty(layout.shape, dtype=value.dtype, device="meta")
    return value


def _entry(node: fx.Node) -> Entry:
    moves = tuple(t for a in node.all_input_nodes for t in _tensors(_value(a)))
    returns = tuple(_tensors(node.meta.get(meta.VAL)))
    params = tuple(a.target for a in node.all_input_nodes if a.op == "get_attr")
    # Keyword arguments are the same on every rank (ZeRO group and stage, full shapes); positional
    # constants need not be (a vocabulary shard's first token id), so they are left out.
    kwargs = _plain({k: v for k, v in node.kwargs.items() if k != "axis"})
    op = getattr(node.target, "__name__", str(node.target))
    return Entry(node.name, op, meta.get(node, meta.CREATED_BY, "") or "", (moves, returns, params, kwargs))


def group_members(mesh: Mesh, axis: str, rank: int) -> tuple[int, ...]:
    """The ranks of ``rank``'s group along ``axis`` (axes joined by commas: all their
    combinations), ascending."""
    members = {rank}
    for name in axis.split(","):
        members = {m for r in members for m in mesh.group_ranks(name, r)}
    return tuple(sorted(members))


def rank_stages(plan: Plan, rank: int) -> set[int] | None:
    """The pipeline stages ``rank`` runs; None without a pipeline."""
    if plan.mesh.pp == 1:
        return None
    index = plan.mesh.coordinate(rank, "pp")
    return {s for s in range(len(plan.stages)) if pipeline_rank(s, plan.mesh.pp) == index}


def _stages_of(gm: fx.GraphModule) -> dict[fx.Node, frozenset[int]]:
    """The pipeline stages each node runs in: its own ``gp.stage`` (``partition_stages`` tags the
    ops), else those of its users (parameters, and the collectives passes add afterwards, run
    where what reads them runs); empty for a node nothing staged reads (every stage's)."""
    stages: dict[fx.Node, frozenset[int]] = {}
    for node in reversed(gm.graph.nodes):
        own = node.meta.get(meta.STAGE)
        if own is not None and node.op == "call_function":
            stages[node] = frozenset((own,))
        else:
            stages[node] = frozenset().union(*(stages.get(u, frozenset()) for u in node.users))
    return stages


def _runner(gm: fx.GraphModule, stages: set[int] | None):
    """Whether ``rank_stages``' ``stages`` run a node of ``gm``."""
    if stages is None:
        return lambda node: True
    of = _stages_of(gm)
    return lambda node: not of[node] or bool(of[node] & stages)


def _replica_axes(mesh: Mesh) -> str:
    return ",".join(a for a in mesh if a != "pp" and mesh[a] > 1)


def program(gm: fx.GraphModule, plan: Plan, rank: int) -> dict[Group, tuple[Entry, ...]]:
    """``rank``'s program by group: its collectives on each group it communicates over, and the
    tensors it holds (``shards``: every ``get_attr`` of its stages, with its local shape)."""
    runs = _runner(gm, rank_stages(plan, rank))
    out: dict[Group, list[Entry]] = {}
    for node in gm.graph.nodes:
        if not runs(node):
            continue
        if node.op == "call_function" and node.target in COLLECTIVE_OPS:
            axis = meta.get(node, meta.AXIS)
            members = group_members(plan.mesh, axis, rank)
            if len(members) > 1:
                out.setdefault((axis, members), []).append(_entry(node))
    replica = _replica_axes(plan.mesh)
    if replica:
        members = group_members(plan.mesh, replica, rank)
        held = out.setdefault((SHARDS, members), [])
        for node in gm.graph.nodes:
            value = _value(node)
            if node.op == "get_attr" and runs(node) and isinstance(value, torch.Tensor):
                held.append(Entry(node.target, "holds", "", (tuple(value.shape), str(value.dtype))))
    return {g: tuple(entries) for g, entries in out.items()}


def _digest(entries: Sequence[Entry]) -> str:
    return hashlib.sha1(repr([(e.node, e.op, e.signature) for e in entries]).encode()).hexdigest()


@dataclass
class Recorder:
    """A rank's program after every pass (hand :meth:`after_pass` to ``run_passes``)."""

    plan: Plan
    rank: int
    snapshots: list[tuple[str, dict[Group, tuple[Entry, ...]]]] = field(default_factory=list)
    #: what is wrong with the program on this rank alone, each named with the pass that made it
    problems: list[str] = field(default_factory=list)

    def after_pass(self, index: int, record: Any, gm: fx.GraphModule) -> None:
        self.snapshots.append((record.name, program(gm, self.plan, self.rank)))
        seen = {p.split(": ", 1)[1] for p in self.problems}
        self.problems += [f"after pass {record.name}: {p}" for p in schedule_problems(gm) if p not in seen]

    def digests(self) -> list[dict[Group, str]]:
        return [{g: _digest(entries) for g, entries in groups.items()} for _, groups in self.snapshots]


_EMPTY = _digest(())


def first_disagreement(digests: Mapping[int, Sequence[Mapping[Group, str]]]) -> tuple[int, Group] | None:
    """The first pass (index) after which the ranks of some group hold different programs on it,
    and that group; None when every group agrees after every pass."""
    num_passes = min(len(d) for d in digests.values())
    for index in range(num_passes):
        groups = sorted({g for d in digests.values() for g in d[index]})
        for group in groups:
            seen = {digests[r][index].get(group, _EMPTY) for r in group[1] if r in digests}
            if len(seen) > 1:
                return index, group
    return None


def _key(entry: Entry) -> tuple:
    return entry.node, entry.op, entry.signature


def _first_difference(a: Sequence[Entry], b: Sequence[Entry]) -> int | None:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if _key(x) != _key(y)), None)
    if at is None and len(a) != len(b):
        return min(len(a), len(b))
    return at


def _difference(ref: int, a: Sequence[Entry], rank: int, b: Sequence[Entry], at: int) -> str:
    """What ``rank``'s program ``b`` does differently from ``ref``'s ``a`` at entry ``at``: a
    node it lacks, one it adds, two in another order, or one with other shapes."""
    mine, theirs = (a[at] if at < len(a) else None), (b[at] if at < len(b) else None)
    if mine is None:
        return f"rank {rank} goes on with {theirs.describe()}, where rank {ref} has no more (it has {len(a)})"
    if theirs is None:
        return f"rank {ref}'s {mine.describe()} is missing on rank {rank} (it has {len(b)})"
    b_names, a_names = [e.node for e in b], [e.node for e in a]
    if mine.node == theirs.node:
        return (f"rank {ref}'s {mine.describe()}, but rank {rank}'s is {theirs.describe()} "
                f"(another shape, dtype or arguments)")
    if mine.node not in b_names:
        return f"rank {ref}'s {mine.describe()} is missing on rank {rank}"
    if theirs.node not in a_names:
        return f"rank {rank} adds {theirs.describe()}, which rank {ref} does not run"
    return (f"rank {ref} runs {mine.op} (node {mine.node!r}) there, rank {rank} runs {theirs.op} (node "
            f"{theirs.node!r}) and node {mine.node!r} only at entry {b_names.index(mine.node)}: reordered")


def describe_disagreement(pass_name: str, group: Group, programs: Mapping[int, Sequence[Entry]]) -> str:
    """Where the members of ``group`` first differ from the lowest rank: the entry, what differs
    (missing, added, reordered, reshaped), the node and the pass that made it, the ranks."""
    axis, members = group
    ref = members[0]
    a = programs.get(ref, ())
    differences = [(at, rank) for rank in members[1:]
                   if (at := _first_difference(a, programs.get(rank, ()))) is not None]
    assert differences, "described a group whose programs agree"
    first = min(at for at, _ in differences)
    odd = [rank for at, rank in differences if at == first]
    what = "what they hold" if axis == SHARDS else "collectives"
    name = (f"the data x tensor parallel group of ranks {list(members)}" if axis == SHARDS
            else f"the {axis!r} group of ranks {list(members)}")
    details = "; ".join(_difference(ref, a, rank, programs.get(rank, ()), first) for rank in odd[:3])
    consequence = ("their shards do not fit together" if axis == SHARDS else
                   "at run time this group would hang or combine the wrong tensors")
    return (f"the ranks' {what} disagree on {name} after pass {pass_name!r} (earlier passes left them "
            f"agreeing), at entry {first}: {details}. Ranks {odd} differ from rank {ref}, so "
            f"{consequence}. Each rank's graph after every pass is in the dumps (GRAPHPASS_DUMP_DIR)")


# ----------------------------------------------------------------------------- local checks


@dataclass(frozen=True)
class _RankView:
    """What :func:`layout_of` reads of a process mesh, for any rank of a plan's mesh."""

    mesh: Mesh
    rank: int

    def axis_rank(self, axis: str) -> int:
        return self.mesh.coordinate(self.rank, axis)

    def axis_size(self, axis: str) -> int:
        return self.mesh.size(axis)


def _boxes_problem(key: str, shape: tuple[int, ...], boxes: set[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """Why ``boxes`` ((offsets, sizes) rectangles) do not tile ``shape`` exactly, or None."""
    for offsets, sizes in boxes:
        if any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            return f"a shard at offsets {offsets} of sizes {sizes} lies outside {key!r}'s shape {shape}"
    ordered = sorted(boxes)
    if len(ordered) > 1:
        lo = torch.tensor([o for o, _ in ordered])
        hi = lo + torch.tensor([s for _, s in ordered])
        apart = (lo[:, None, :] >= hi[None, :, :]) | (hi[:, None, :] <= lo[None, :, :])
        overlap = ~apart.any(-1)
        overlap.fill_diagonal_(False)
        if overlap.any():
            i, j = (int(v) for v in overlap.nonzero()[0])
            return (f"shards of {key!r} overlap: offsets {ordered[i][0]} sizes {ordered[i][1]} and offsets "
                    f"{ordered[j][0]} sizes {ordered[j][1]}")
    covered = sum(math.prod(s) for _, s in ordered)
    if covered != math.prod(shape):
        return f"the shards of {key!r} cover {covered} of its {math.prod(shape)} elements (shape {shape})"
    return None


def shard_problems(gm: fx.GraphModule, plan: Plan, rank: int) -> list[str]:
    """For every parameter and buffer ``rank`` holds, whether the pieces that its data x tensor
    parallel group holds (its own layout rule applied to each member) tile the full tensor."""
    runs = _runner(gm, rank_stages(plan, rank))
    replica = _replica_axes(plan.mesh)
    members = group_members(plan.mesh, replica, rank) if replica else (rank,)
    views = [_RankView(plan.mesh, r) for r in members]
    boxes: dict[str, set] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    nodes: dict[str, str] = {}
    for node in gm.graph.nodes:
        value = node.meta.get(meta.VAL)
        if node.op != "get_attr" or not runs(node) or not isinstance(value, torch.Tensor):
            continue
        for view in views:
            layout = layout_of(node, value, view)
            if layout is None:
                break
            shapes[layout.key] = layout.shape
            nodes.setdefault(layout.key, node.name)
            boxes.setdefault(layout.key, set()).update((p.offsets, p.sizes) for p in layout.pieces)
    problems = []
    for key, shape in shapes.items():
        problem = _boxes_problem(key, shape, boxes[key])
        if problem is not None:
            problems.append(f"{problem} (node {nodes[key]!r}, over ranks {list(members)})")
    return problems


def memory_problem(plan: Plan, memory_bytes: int | None, held_bytes: int) -> str | None:
    """Whether the plan's predicted peak (or, unpriced, the parameters and gradients this rank
    keeps on the device, ``held_bytes``) exceeds the device's memory."""
    if memory_bytes is None:
        return None
    if plan.report.predicted_peak_memory_bytes is not None:
        need, what = plan.report.predicted_peak_memory_bytes, "the plan's predicted peak memory"
    else:
        need, what = held_bytes, "this rank's device-resident parameters and their gradients"
    if need <= memory_bytes:
        return None
    return (f"{what} is {format_bytes(need)}, more than the device's {format_bytes(memory_bytes)}; "
            "shard more (zero=3, tp, pp), recompute, offload (Strategy(offload=...)), or plan with strategy='auto'")


def held_bytes(gm: fx.GraphModule, plan: Plan, rank: int) -> int:
    """Bytes of the parameters ``rank`` holds (its stages', as shards) and of their gradients,
    where their tiers keep them on the device: a streamed parameter (``Tiers(parameter="host")``)
    counts as the two in flight at once (the largest), a gradient on the host not at all."""
    runs = _runner(gm, rank_stages(plan, rank))
    seen, total, streamed = set(), 0, [0]
    for node in gm.graph.nodes:
        value = node.meta.get(meta.VAL)
        if (node.op == "get_attr" and node.target not in seen and runs(node)
                and meta.get(node, meta.ATTR_KIND, None) == "parameter" and isinstance(value, torch.Tensor)):
            seen.add(node.target)
            nbytes = value.numel() * value.element_size()
            layout = meta.layout(node)
            tiers = layout.tiers if layout is not None else Tiers()
            if tiers.parameter == "host":
                streamed.append(nbytes)
            else:
                total += nbytes
            if tiers.gradient == "device":
                total += nbytes
    return total + 2 * max(streamed)


def local_problems(gm: fx.GraphModule, plan: Plan, rank: int, memory_bytes: int | None) -> list[tuple[int, str]]:
    """What is wrong with ``rank``'s program on its own: shards that do not tile, memory."""
    problems = shard_problems(gm, plan, rank)
    memory = memory_problem(plan, memory_bytes, held_bytes(gm, plan, rank))
    if memory is not None:
        problems.append(memory)
    return [(rank, p) for p in problems]


# ----------------------------------------------------------------------------- the checks


def check_programs(recorders: Iterable[Recorder], problems: Iterable[tuple[int, str]] = ()) -> None:
    """Check the programs of every rank, all recorded in this process (:func:`graphpass.verify`).

    Raises:
        VerificationError: a local problem, or the first disagreement (pass, node, ranks).
    """
    recorders = list(recorders)
    problems = list(problems) + [(rec.rank, p) for rec in recorders for p in rec.problems]
    if problems:
        raise VerificationError(_problems_text(problems))
    by_rank = {rec.rank: rec for rec in recorders}
    found = first_disagreement({r: rec.digests() for r, rec in by_rank.items()})
    if found is not None:
        index, group = found
        name = next(iter(by_rank.values())).snapshots[index][0]
        programs = {r: rec.snapshots[index][1].get(group, ()) for r, rec in by_rank.items() if r in group[1]}
        raise VerificationError(describe_disagreement(name, group, programs))


def check_across_ranks(recorder: Recorder, problems: Sequence[tuple[int, str]]) -> None:
    """Check this rank's program against every other rank's, in a launched job: every rank calls
    it; every rank raises the same :class:`VerificationError` when any rank's program is wrong.

    One ``all_gather_object`` of the digests (and this rank's local problems); a second one of the
    programs of the first disagreeing pass, only when there is one.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        check_programs([recorder], problems)
        return
    world = dist.get_world_size()
    gathered: list = [None] * world
    problems = list(problems) + [(recorder.rank, p) for p in recorder.problems]
    dist.all_gather_object(gathered, (recorder.digests(), problems))
    everyone = [p for _, ps in gathered for p in ps]
    if everyone:
        raise VerificationError(_problems_text(everyone))
    found = first_disagreement({r: d for r, (d, _) in enumerate(gathered)})
    if found is None:
        return
    index, group = found
    name, groups = recorder.snapshots[index]
    detail: list = [None] * world
    dist.all_gather_object(detail, groups.get(group, ()))
    raise VerificationError(describe_disagreement(name, group, {r: detail[r] for r in group[1]}))


def _problems_text(problems: Sequence[tuple[int, str]]) -> str:
    """Each problem once, with the ranks that have it."""
    ranks: dict[str, list[int]] = {}
    for rank, text in problems:
        ranks.setdefault(text, []).append(rank)
    lines = [f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}: {text}" for text, rs in ranks.items()]
    more = f"; and {len(lines) - 5} more" if len(lines) > 5 else ""
    return f"the compiled program is wrong before it runs: {'; '.join(lines[:5])}{more}"


__all__ = [
    "Entry",
    "Recorder",
    "VerificationError",
    "check_across_ranks",
    "check_programs",
    "describe_disagreement",
    "first_disagreement",
    "group_members",
    "local_problems",
    "program",
    "rank_stages",
    "shard_problems",
]
