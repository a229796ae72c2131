"""A plan as one self-contained HTML page (``Plan.to_html``): inline CSS and SVG, one small inline
script, nothing fetched.

Sections: the headline figures; the mesh with every rank on its node (coloured by pipeline stage,
its ``pp/dp/tp`` coordinates on hover); each pipeline stage, named by its first block (``layer
48``); the predicted step split into compute, tensor-parallel communication, exposed
data-parallel communication, optimizer and pipeline bubble; memory per pipeline rank against the
budget; the blocks' choices and figures (``Plan.report.breakdown``), consecutive blocks with the same
stage and choice in one row as ``Plan.explain`` groups them (every block's own row folded below);
the runner-up meshes and why they lost; the planner's reasons. Every figure carries a ``data-*``
attribute with the exact value it shows, so a test (or a user's script) can read the page back.
"""

from __future__ import annotations

import html
import os
import pathlib
from typing import Any

from graphpass.mesh import pipeline_rank
from graphpass.units import format_bytes

# The functions take a graphpass.plan.Plan (not imported: Plan.to_html imports this module).
Plan = Any

#: Nodes drawn in the mesh picture; larger clusters show this many and say how many more.
MAX_NODES_DRAWN = 32
_STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                  "#9c755f", "#bab0ac")
_SPLIT_COLOURS = {"compute": "#4e79a7", "tp_comm": "#f28e2b", "dp_comm_exposed": "#e15759",
                  "optimizer": "#59a14f", "bubble": "#bab0ac"}

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; } td, th { padding: 3px 8px; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f6f6f6; } td.l, th.l { text-align: left; }
.node { display: flex; align-items: center; margin: 2px 0; } .node span.label { width: 70px; color: #666; }
.rank { width: 26px; height: 18px; margin-right: 2px; border-radius: 3px; color: #fff; font-size: 10px;
        display: inline-flex; align-items: center; justify-content: center; }
.bar { display: flex; height: 22px; border: 1px solid #ccc; } .bar div { height: 100%; }
.legend span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; vertical-align: middle; }
tr.hl td { background: #fff6d5; } .muted { color: #777; } .over { color: #b00; font-weight: 600; }
"""

_SCRIPT = """
document.querySelectorAll("tr[data-block], tr[data-run]").forEach(function (row) {
  row.addEventListener("mouseenter", function () { row.classList.add("hl"); });
  row.addEventListener("mouseleave", function () { row.classList.remove("hl"); });
});
document.getElementById("rendered").textContent = "rendered";
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _gib(num: float) -> str:
    return format_bytes(num)


def _mesh_section(plan: Plan) -> str:
    mesh, world = plan.mesh, plan.world_size
    per_node = plan.report.devices_per_node or world
    nodes = -(-world // per_node)
    rows = []
    for node in range(min(nodes, MAX_NODES_DRAWN)):
        cells = []
        for rank in range(node * per_node, min(world, (node + 1) * per_node)):
            coords = {axis: mesh.coordinate(rank, axis) for axis in ("pp", "dp", "tp", "ep") if mesh.size(axis) > 1}
            stage = coords.get("pp", 0)
            title = f"rank {rank}: " + (", ".join(f"{a} {c}" for a, c in coords.items()) or "the only rank")
            cells.append(f'<span class="rank" data-rank="{rank}" data-pp="{stage}" title="{_e(title)}" '
                         f'style="background:{_STAGE_COLOURS[stage % len(_STAGE_COLOURS)]}">{rank}</span>')
        rows.append(f'<div class="node" data-node="{node}"><span class="label">node {node}</span>{"".join(cells)}</div>')
    more = (f'<p class="muted">... {nodes - MAX_NODES_DRAWN} more nodes laid out the same way</p>'
            if nodes > MAX_NODES_DRAWN else "")
    axes = " x ".join(f"{a}={n}" for a, n in mesh.items())
    groups = "; ".join(f"{a} groups: ranks {mesh.group_ranks(a, 0)} (rank 0's)" for a in ("tp", "ep", "dp", "pp")
                       if mesh.size(a) > 1 and len(mesh.group_ranks(a, 0)) <= 16)
    where = f"{nodes} nodes of {per_node}" if plan.report.devices_per_node else "nodes unknown (a plan not made by the planner)"
    return (f'<h2>Mesh</h2><p data-mesh="{_e(dict(mesh))}">{_e(axes)} on {world} devices, {where}. '
            f'Colour: pipeline stage (pp rank); hover a rank for its coordinates.</p>'
            f'<p class="muted">{_e(groups)}</p>{"".join(rows)}{more}')


def _stage_starts(plan: Plan) -> list[str]:
    """Where each stage starts, as a person names it: its first block (``layer 48``) from the
    breakdown, with the node that cuts there; the node alone for a plan without a breakdown."""
    first_block = {}
    for row in plan.report.breakdown:
        first_block.setdefault(row["stage"], row["block"])
    starts = []
    for s, node in enumerate(plan.stages):
        block = first_block.get(s)
        if s == 0:
            starts.append(f"<b>{_e(block)}</b> (the model's start)" if block else "the model's start")
        else:
            starts.append(f"<b>{_e(block)}</b> (node <code>{_e(node)}</code>)" if block else f"node <code>{_e(node)}</code>")
    return starts


def _stages_section(plan: Plan) -> str:
    if len(plan.stages) == 1:
        return "<h2>Pipeline</h2><p>No pipeline: every rank runs the whole model.</p>"
    items = "".join(f'<li data-stage="{s}">stage {s} (pp rank {pipeline_rank(s, plan.mesh.pp)}) starts at {start}</li>'
                    for s, start in enumerate(_stage_starts(plan)))
    return (f"<h2>Pipeline</h2><p>{len(plan.stages)} stages on pp={plan.mesh.pp}, schedule {_e(plan.schedule)}, "
            f"{plan.microbatches} microbatches.</p><ol start=0>{items}</ol>")


def _time_section(plan: Plan) -> str:
    if not plan.report.predicted_step_time_s:
        return "<h2>Step time</h2><p>Not priced (give the plan to graphpass.plan to predict it).</p>"
    if not plan.report.time_split_s:
        return (f'<h2>Step time</h2><p>Predicted <b data-step-time="{plan.report.predicted_step_time_s!r}">'
                f"{_ms(plan.report.predicted_step_time_s)}</b> per step; no split recorded (a plan saved before "
                "graphpass recorded one).</p>")
    total = plan.report.predicted_step_time_s
    bars, legend = [], []
    for name, seconds in plan.report.time_split_s.items():
        share = 100.0 * seconds / total
        label = name.replace("_", " ")
        bars.append(f'<div style="width:{share:.3f}%;background:{_SPLIT_COLOURS.get(name, "#999")}" '
                    f'title="{_e(label)}: {_ms(seconds)}"></div>')
        legend.append(f'<span style="background:{_SPLIT_COLOURS.get(name, "#999")}"></span>{_e(label)} '
                      f'<b data-time="{_e(name)}" data-value="{seconds!r}">{_ms(seconds)}</b>')
    return (f'<h2>Step time</h2><p>Predicted <b data-step-time="{total!r}">{_ms(total)}</b> per step.</p>'
            f'<div class="bar">{"".join(bars)}</div><p class="legend">{"".join(legend)}</p>')


def _memory_section(plan: Plan) -> str:
    peaks = list(plan.report.predicted_stage_peaks_bytes) or (
        [plan.report.predicted_peak_memory_bytes] if plan.report.predicted_peak_memory_bytes else [])
    if not peaks:
        return "<h2>Memory</h2><p>Not priced.</p>"
    budget = plan.report.memory_budget_bytes
    scale = max([*peaks, budget or 0])
    rows = []
    for r, peak in enumerate(peaks):
        over = budget is not None and peak > budget
        width = 100.0 * peak / scale
        mark = f'<div style="position:absolute;left:{100.0 * budget / scale:.3f}%;top:0;bottom:0;border-left:2px dashed #b00"></div>' if budget else ""
        rows.append(
            f'<tr><td class="l">pp rank {r}</td><td class="{"over" if over else ""}" data-peak="{r}" data-value="{peak}">'
            f'{_gib(peak)}</td><td style="width:60%"><div class="bar" style="position:relative">'
            f'<div style="width:{width:.3f}%;background:{"#e15759" if over else "#4e79a7"}"></div>{mark}</div></td></tr>')
    head = (f'Budget <b data-budget="{budget}">{_gib(budget)}</b> per device (dashed line).' if budget
            else "No budget recorded.")
    return f"<h2>Memory per device</h2><p>{head}</p><table style=\"width:100%\">{''.join(rows)}</table>"


#: (breakdown key, scale to the unit shown, decimals) of the figures in a block row.
_BLOCK_FIGURES = (("time_s", 1e3, 3), ("tp_comm_s", 1e3, 3), ("dp_comm_s", 1e3, 3),
                  ("state_bytes", 2**-30, 4), ("activation_bytes", 2**-30, 4))
_BLOCK_HEAD = ("<th>stage</th><th class=l>choice</th><th>compute + tp ms</th><th>tp comm ms</th>"
               "<th>dp comm ms</th><th>state GiB</th><th>activations GiB</th>")


def _runs(breakdown) -> list[list[int]]:
    """Consecutive blocks with the same stage and choice, as ``Plan.explain`` groups them."""
    runs: list[list[int]] = []
    for i, row in enumerate(breakdown):
        if runs and (breakdown[runs[-1][-1]]["stage"], breakdown[runs[-1][-1]]["choice"]) == (row["stage"], row["choice"]):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _blocks_section(plan: Plan) -> str:
    if not plan.report.breakdown:
        return "<h2>Blocks</h2><p>No per-block figures (the plan was not priced).</p>"
    blocks = plan.report.breakdown
    # One row per run of equal blocks (a 96-layer model is a handful of rows), their figures summed;
    # every block's own row below, folded.
    grouped = []
    for r, run in enumerate(_runs(blocks)):
        first, last = blocks[run[0]], blocks[run[-1]]
        names = _e(first["block"]) if len(run) == 1 else f'{_e(first["block"])} .. {_e(last["block"])} ({len(run)})'
        grouped.append(
            f'<tr data-run="{r}" data-blocks="{run[0]}-{run[-1]}"><td class="l">{names}</td><td>{_e(first["stage"])}</td>'
            f'<td class="l">{_e(first["choice"])}</td>'
            + "".join(f'<td data-sum="{key}" data-value="{sum(blocks[i][key] for i in run)!r}">'
                      f'{sum(blocks[i][key] for i in run) * scale:.{digits}f}</td>' for key, scale, digits in _BLOCK_FIGURES)
            + "</tr>")
    rows = []
    for i, row in enumerate(blocks):
        rows.append(
            f'<tr data-block="{i}"><td class="l">{_e(row["block"])}</td><td>{_e(row["stage"])}</td>'
            f'<td class="l">{_e(row["choice"])}</td>'
            + "".join(f'<td data-key="{key}" data-value="{row[key]!r}">{row[key] * scale:.{digits}f}</td>'
                      for key, scale, digits in _BLOCK_FIGURES)
            + "</tr>")
    extras = []
    if plan.sequence_parallel:
        extras.append("sequence parallelism on tp")
    if plan.mesh.ep > 1:
        extras.append(f"experts over ep={plan.mesh.ep} ({plan.ep_all_to_all} exchanges)")
    if plan.split:
        extras.append(f"{len(plan.split)} linears split (OSDP)")
    note = f'<p>{_e("; ".join(extras))}</p>' if extras else ""
    return (f"<h2>Blocks ({len(blocks)})</h2>{note}<p class=\"muted\">Consecutive blocks with the same stage and "
            "choice share a row; their figures are summed.</p>"
            f"<table><tr><th class=l>blocks</th>{_BLOCK_HEAD}</tr>{''.join(grouped)}</table>"
            f"<details><summary>every block ({len(blocks)})</summary>"
            f"<table><tr><th class=l>block</th>{_BLOCK_HEAD}</tr>{''.join(rows)}</table></details>")


def _alternatives_section(plan: Plan) -> str:
    if not plan.report.alternatives:
        return ""
    rows = "".join(
        f'<tr data-alternative="{i}"><td class="l">{_e(a["layout"])}</td>'
        f'<td>{"-" if a["step_time_s"] is None else _ms(a["step_time_s"])}</td><td>{_gib(a["peak_bytes"])}</td>'
        f'<td class="l">{_e(a["why"])}</td></tr>' for i, a in enumerate(plan.report.alternatives))
    return ('<h2>Runner-up meshes</h2><table><tr><th class=l>mesh</th><th>step</th><th>peak</th>'
            f'<th class=l>why not</th></tr>{rows}</table>')


def render(plan: Plan) -> str:
    """The page's HTML text."""
    time_s, peak = plan.report.predicted_step_time_s, plan.report.predicted_peak_memory_bytes
    summary = (f"{_e(plan.mesh)} on {plan.world_size} devices"
               + (f", {_ms(time_s)} per step" if time_s else "") + (f", peak {_gib(peak)}" if peak else ""))
    reasons = "".join(f"<li>{_e(r)}</li>" for r in plan.report.reasons)
    body = "".join((
        f"<h1>graphpass plan: {summary}</h1>",
        _mesh_section(plan), _stages_section(plan), _time_section(plan), _memory_section(plan),
        _blocks_section(plan), _alternatives_section(plan),
        f"<h2>Why</h2><ul>{reasons}</ul>" if reasons else "",
        # the script writes here when it has run (a browser test reads it); nothing a reader sees
        '<p id="rendered" hidden></p>',
    ))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>graphpass plan: {summary}</title>'
            f"<style>{_CSS}</style></head><body>{body}<script>{_SCRIPT}</script></body></html>\n")


def write_html(plan: Plan, path: str | os.PathLike) -> pathlib.Path:
    """Write :func:`render`'s page to ``path``; returns it."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(plan), encoding="utf-8")
    return path
