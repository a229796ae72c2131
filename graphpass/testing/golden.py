"""Golden files of a distributed program: the plan and every collective, in order, with the pass
that added it.

``program_text(model, example_inputs, strategy, world_size)`` runs graphpass's passes in this
process for one rank (no ranks are started; capture, plan and passes are what ``compile`` runs)
and describes the result: the plan's fields (its predictions, which depend on the machine, left
out), then each pipeline stage's inputs, collectives and outputs. ``assert_golden(path, text)``
compares that with a file under review in the user's repository: a change in torch, transformers,
graphpass or the model that adds, drops or moves a collective fails with a diff that names the
pass responsible. The ``--graphpass-update-golden`` pytest flag (or ``GRAPHPASS_UPDATE_GOLDEN=1``)
rewrites the files instead; review their diff like code.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from graphpass import meta
from graphpass.ops import op_name
from graphpass.mesh import pipeline_rank
from graphpass.plan import PREDICTIONS, Plan, Strategy

UPDATE_ENV = "GRAPHPASS_UPDATE_GOLDEN"

class GoldenMismatch(AssertionError):
    """A program differs from its golden file; the message says what moved and which pass did it."""


def update_requested() -> bool:
    """True when golden files are to be rewritten (``--graphpass-update-golden`` or the env var)."""
    return os.environ.get(UPDATE_ENV, "") not in ("", "0")


def _tensor(val) -> str:
    return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}" if isinstance(val, torch.Tensor) else "-"


def _value(node: fx.Node) -> str:
    val = node.meta.get(meta.VAL)
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_tensor(v) for v in val) + ")"
    return _tensor(val) + (" (grad)" if node.meta.get(meta.REQUIRES_GRAD) else "")


def collective_line(node: fx.Node) -> str:
    """``[pass] op over axis (what it moves) -> result``: the parameters it moves by name, or the
    values it moves by dtype and shape."""
    axis = node.meta.get(meta.AXIS)
    params = [a.target for a in node.all_input_nodes if a.op == "get_attr"]
    moved = ", ".join(params) if params else ", ".join(_value(a) for a in node.all_input_nodes)
    by = node.meta.get(meta.CREATED_BY, "captured")
    return f"  [{by}] {op_name(node)}" + (f" over {axis}" if axis else "") + f" ({moved}) -> {_value(node)}"


def stage_lines(stage: fx.GraphModule, title: str, last: bool) -> list[str]:
    """One program (a pipeline stage, or the whole rank's graph): what it receives, its
    collectives in order, what it sends on (``last``: returns)."""
    from graphpass.passes.collectives import is_collective

    lines = [title]
    lines += [f"  receives {n.name}: {_value(n)}" for n in stage.graph.nodes if n.op == "placeholder"]
    lines += [collective_line(n) for n in stage.graph.nodes if is_collective(n)]
    output = stage.graph.find_nodes(op="output")[0]
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    for value in returned:
        if isinstance(value, fx.Node):
            lines.append(f"  {'returns' if last else 'sends'} {value.name}: {_value(value)}")
    return lines


def plan_lines(plan: Plan) -> list[str]:
    """The plan's program-defining fields, one line per entry (predictions, the strategy it was
    made from and replicated placements left out)."""
    data = plan.to_dict()
    tensors = data.pop("tensors")
    # Each part of the tensors' entries on lines of its own, as golden texts wrote them before
    # the plan held one entry per tensor (replicated placements, the default, left out).
    parts = {"placements": {node: t["placements"] for node, t in tensors.items()
                            if any(p != "Replicate()" for p in t.get("placements", {}).values())},
             "zero": {node: t["zero"] for node, t in tensors.items() if "zero" in t},
             "split": {node: t["split"] for node, t in tensors.items() if "split" in t},
             "tp_parts": {node: t["parts"] for node, t in tensors.items() if "parts" in t},
             "recompute": list(plan.recompute)}
    data.pop("activations")
    # offload's parts only where the plan offloads (texts written before offload read the same)
    tiers = {node: t["tiers"] for node, t in tensors.items() if "tiers" in t}
    saved_on_host = [layer for layer, saved in sorted(plan.activations.items()) if saved.tier != "device"]
    if tiers:
        parts["tiers"] = tiers
    if saved_on_host:
        parts["saved_on_host"] = saved_on_host
    if not any(t.tiers.parameter != "device" for t in plan.tensors.values()):
        data.pop("offload_window")
    # embedding tables' shardings and jagged inputs only where the plan has them (as offload's)
    for part, key in (("tables", "table"), ("jagged", "jagged")):
        entries = {node: t[key] for node, t in tensors.items() if key in t}
        if entries:
            parts[part] = entries
    for optional in ("embedding_optimizer", "grad_compression", "diloco", "dp_shares"):  # only where a plan has them
        if data.get(optional) is None:
            data.pop(optional, None)
    order = ("mesh", "placements", "stages", "strategy", "zero", "recompute", "split", "sequence_parallel",
             "bucket_cap_bytes", "microbatches", "schedule", "tp_parts")
    data = {**{name: {**data, **parts}[name] for name in order}, **data,
            **{name: value for name, value in parts.items() if name not in order}}
    lines = []
    for name, value in data.items():
        if name in PREDICTIONS or name == "strategy":  # the strategy heads the text
            continue
        if isinstance(value, dict) and value and name != "mesh":
            lines += [f"plan.{name}[{key}] = {value[key]}" for key in sorted(value)]
        else:
            lines.append(f"plan.{name} = {value}")
    return lines


def program_text(model: nn.Module, example_inputs: Sequence[torch.Tensor], strategy: Strategy | Plan,
                 world_size: int, *, rank: int = 0) -> str:
    """The golden text of ``model`` compiled with ``strategy`` on ``world_size`` ranks, seen from
    ``rank``: the plan, then each pipeline stage (or the one program) with its collectives.

    Runs capture and the passes in this process at one microbatch of the rank's share of the
    global batch ``example_inputs``; nothing is launched. ``"auto"`` has no golden text (its plan
    depends on the machine the planner measures): give the Strategy or Plan it chose.
    """
    from graphpass.api import _capture_and_plan
    from graphpass.pass_manager import PassContext, run_passes
    from graphpass.passes import passes_for
    from graphpass.passes.partition_stages import cut_stages

    if not isinstance(strategy, (Strategy, Plan)):
        raise TypeError(f"program_text: strategy must be a graphpass.Strategy or Plan (the plan 'auto' chose), "
                        f"got {strategy!r}")
    # What compile does on `rank`: the same checks, the capture at one microbatch of its share,
    # the plan (a Plan's MoE capacity factor applied to the model first).
    captured, plan, local = _capture_and_plan(model, None, tuple(example_inputs), strategy, rank, 1,
                                              world_size=world_size)
    gm = captured.gm
    gm, _ = run_passes(gm, plan, PassContext(rank=rank, world_size=world_size, example_inputs=local),
                       passes_for(plan))
    stages = cut_stages(gm, plan.stages) if len(plan.stages) > 1 else [gm]
    lines = [f"{type(model).__name__} on {world_size} ranks, rank {rank}"]
    if isinstance(strategy, Strategy):
        lines.append(repr(strategy))
    lines += plan_lines(plan)
    for s, stage in enumerate(stages):
        title = (f"stage {s} (pp rank {pipeline_rank(s, plan.mesh.pp)})" if len(stages) > 1 else "program")
        lines += stage_lines(stage, title, s == len(stages) - 1)
    return "\n".join(lines) + "\n"


def explain_diff(expected: str, actual: str) -> list[str]:
    """What changed between two golden texts, a line per change: collectives added, dropped or
    moved (with the pass that added them) and plan entries changed."""
    old, new = expected.splitlines(), actual.splitlines()
    added: list[tuple[int, str]] = []
    dropped: list[tuple[int, str]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag in ("delete", "replace"):
            dropped += [(i, old[i]) for i in range(i1, i2)]
        if tag in ("insert", "replace"):
            added += [(j, new[j]) for j in range(j1, j2)]
    # A line both dropped and added (as many times as it is both) moved; the rest were added or
    # dropped (a collective that now appears once where it appeared twice is one drop).
    pending_drops: dict[str, list[int]] = {}
    for i, line in dropped:
        pending_drops.setdefault(line, []).append(i)
    out, added_only = [], []
    for j, line in added:
        if pending_drops.get(line):
            out.append(f"moved (line {pending_drops[line].pop(0) + 1} -> {j + 1}): {line.strip()}")
        else:
            added_only.append(f"added (line {j + 1}): {line.strip()}")
    out += added_only
    out += [f"dropped (was line {i + 1}): {line.strip()}" for line, rest in pending_drops.items() for i in rest]
    return out


def assert_golden(path: str | os.PathLike, text: str) -> None:
    """``text`` equals the golden file at ``path``; with updating requested, write it instead.

    Raises:
        GoldenMismatch: the texts differ (or the file is missing); the message lists each added,
            dropped or moved collective with the pass that added it, then the unified diff.
    """
    path = Path(path)
    if update_requested():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        raise GoldenMismatch(f"golden file {path} is missing; write it with pytest --graphpass-update-golden "
                             f"(or {UPDATE_ENV}=1) and commit it")
    expected = path.read_text()
    if text == expected:
        return
    summary = "\n".join(explain_diff(expected, text))
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "now"))
    raise GoldenMismatch(f"the distributed program differs from {path} (rewrite with pytest "
                         f"--graphpass-update-golden if the change is intended):\n{summary}\n\n{diff}")
