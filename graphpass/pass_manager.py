"""The one pass runner: ordered passes, verification, timing, history, dumps.

A pass is a function ``(gm, plan, ctx) -> GraphModule`` decorated with :func:`graph_pass`, which
declares its name and what it requires/provides. :func:`run_passes` runs a list of them in
order and, after each one:

- checks the pass's ``requires`` were provided by an earlier pass;
- verifies the graph (``lint``, ``recompile``, fake-tensor propagation so every tensor node has a
  ``meta["val"]`` consistent with its inputs); a pass that left the program as it was (the same
  nodes, arguments, tensors and submodules) keeps the values already verified;
- records a :class:`PassRecord` (seconds, node counts, per-op deltas) and dumps the graph;
- skips passes named in ``GRAPHPASS_DISABLE_PASSES`` (comma-separated), loudly;
- wraps a failure as ``pass X failed after passes A, B: <cause>``.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphpass import meta
from graphpass.ops import op_name
from graphpass.plan import Plan

log = logging.getLogger(__name__)

DISABLE_ENV = "GRAPHPASS_DISABLE_PASSES"


class PassError(RuntimeError):
    """A pass raised or left a graph that does not verify."""


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: ``op_deltas`` maps an op name to the change in its node count."""

    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    op_deltas: dict[str, int]
    skipped: bool = False

    def header(self, index: int) -> str:
        """The one-line summary that heads the pass's dump."""
        deltas = ", ".join(f"{op} {d:+d}" for op, d in self.op_deltas.items()) or "no op changes"
        state = " (disabled by " + DISABLE_ENV + ")" if self.skipped else ""
        return (
            f"after {index:02d} {self.name}{state} ({self.seconds * 1e3:.1f} ms) | "
            f"nodes {self.nodes_before}→{self.nodes_after} | {deltas}"
        )


@dataclass
class PassContext:
    """What passes may read besides the graph and the plan (they never communicate)."""

    rank: int
    world_size: int
    example_inputs: tuple[torch.Tensor, ...]
    provided: set[str] = field(default_factory=set)



GraphPass = Callable[[fx.GraphModule, Plan, PassContext], fx.GraphModule]


def graph_pass(name: str, requires: Sequence[str] = (), provides: Sequence[str] = ()):
    """Declare a function as a graph pass with a name and its requires/provides sets."""

    def wrap(fn: GraphPass) -> GraphPass:
        fn.pass_name = name  # type: ignore[attr-defined]
        fn.requires = tuple(requires)  # type: ignore[attr-defined]
        fn.provides = tuple(provides)  # type: ignore[attr-defined]
        return fn

    return wrap


def op_counts(gm: fx.GraphModule) -> collections.Counter:
    """Number of nodes per op name."""
    return collections.Counter(op_name(n) for n in gm.graph.nodes)


def program_state(gm: fx.GraphModule) -> tuple:
    """What fake propagation reads from ``gm``: every node's op, target and arguments (nodes by
    identity), and the layout of every tensor and submodule it holds. Two equal states propagate
    to the same values."""
    nodes = tuple((n.name, n.op, n.target, n.args, n.kwargs) for n in gm.graph.nodes)
    tensors = tuple(
        (name, type(t), t.shape, t.dtype, t.device, t.stride() if t.layout == torch.strided else None)
        for name, t in (*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False))
    )
    attrs = tuple(
        (n.target, id(value), getattr(value, "shape", None))
        for n in gm.graph.nodes
        if n.op == "get_attr"
        for value in [_attr_or_none(gm, n.target)]
    )
    modules = tuple((name, id(m)) for name, m in gm.named_modules())
    return nodes, tensors, attrs, modules


def _attr_or_none(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def verify(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], *, propagate: bool = True) -> None:
    """Check the graph is well formed and re-derive every node's fake value.

    Args:
        propagate: ``False`` where the program is unchanged since its values were derived
            (:func:`program_state`): the values are checked to be there, not derived again.

    Raises:
        PassError: lint failure, or a tensor-producing node whose value cannot be propagated.
    """
    from graphpass.fake_values import propagate_fake

    if propagate:
        gm.graph.lint()
        gm.recompile()
        propagate_fake(gm, example_inputs)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            expects_tensor = meta.get(node, meta.ATTR_KIND, None) != "module"
        else:
            expects_tensor = not node.meta.get(meta.OPAQUE, False)
        if node.op in ("call_function", "get_attr", "placeholder") and expects_tensor and meta.VAL not in node.meta:
            raise PassError(f"node {node.name!r} ({op_name(node)}) has no meta['val'] after propagation")


def disabled_passes() -> set[str]:
    """Pass names listed in ``GRAPHPASS_DISABLE_PASSES``."""
    return {p.strip() for p in os.environ.get(DISABLE_ENV, "").split(",") if p.strip()}


def run_passes(
    gm: fx.GraphModule,
    plan: Plan,
    ctx: PassContext,
    passes: Sequence[GraphPass],
    on_record: Callable[[int, PassRecord, fx.GraphModule], Any] | None = None,
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run ``passes`` in order; return the final graph and one record per pass.

    Args:
        on_record: called after each pass with (index, record, graph) — the dump writer.
    """
    records: list[PassRecord] = []
    disabled = disabled_passes()
    unknown = disabled - {p.pass_name for p in passes}  # type: ignore[attr-defined]
    if unknown:
        log.warning("%s names unknown passes %s", DISABLE_ENV, sorted(unknown))
    done: list[str] = []
    for index, graph_pass_fn in enumerate(passes, start=1):
        name = graph_pass_fn.pass_name  # type: ignore[attr-defined]
        before = op_counts(gm)
        nodes_before = len(gm.graph.nodes)
        start = time.perf_counter()
        skipped = name in disabled
        if skipped:
            log.warning("pass %s disabled by %s: the program may be wrong", name, DISABLE_ENV)
        else:
            missing = set(graph_pass_fn.requires) - ctx.provided  # type: ignore[attr-defined]
            if missing:
                raise PassError(
                    f"pass {name} requires {sorted(missing)}, which no earlier pass provided "
                    f"(ran: {', '.join(done) or 'none'})"
                )
            # The first pass always re-derives the values (a graph may come from anywhere); a pass
            # that changed nothing keeps them. Only what changed runs (graphpass.fake_values).
            state = program_state(gm) if done else None
            try:
                result = graph_pass_fn(gm, plan, ctx)
                verify(result, ctx.example_inputs, propagate=result is not gm or program_state(result) != state)
                gm = result
            except Exception as exc:
                where = ", ".join(done) if done else "capture"
                raise PassError(f"pass {name} failed after {where}: {exc}") from exc
            ctx.provided.update(graph_pass_fn.provides)  # type: ignore[attr-defined]
        after = op_counts(gm)
        deltas = {op: after[op] - before[op] for op in sorted(set(before) | set(after))}
        record = PassRecord(
            name=name,
            seconds=time.perf_counter() - start,
            nodes_before=nodes_before,
            nodes_after=len(gm.graph.nodes),
            op_deltas={op: d for op, d in deltas.items() if d},
            skipped=skipped,
        )
        if not skipped and not record.op_deltas:
            log.info("pass %s: nothing to do", name)
        records.append(record)
        done.append(name)
        if on_record is not None:
            on_record(index, record, gm)
    return gm, records
