"""The search's winner as a :class:`~graphpass.plan.Plan` (`_to_plan`): its choices per node,
stages, predictions, a per-block breakdown, the step split into compute, communication,
optimizer and bubble, and the reasons (`_reasons`: what was searched and chosen, the
uniform strategies on the same mesh; `_alternatives`: the runner-up meshes and the closest
ones that do not fit).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any, Mapping, Sequence

from graphpass import sites
from graphpass.cost import search as S
from graphpass.plan import Plan, Strategy
from graphpass.plan_builder import plan_from_choices
from graphpass.planner.measure import GraphProfile


def _reasons(best: S.Candidate, found: list[S.Candidate], alternatives: Sequence[Mapping[str, Any]],
             infeasible: int, rejected: Mapping[int, str], costing: S.Costing, tried: int,
             measure_s: float, pruned: int = 0) -> list[str]:
    lines = [
        f"searched {tried} meshes (pp x dp x tp x microbatches x sequence-parallel"
        + (" x ep" if any(c.layout.mesh.ep > 1 for c in found) else "") + ") under a "
        f"{costing.memory_limit_bytes / 2**30:.2f} GiB per-device budget; {len(found)} fit"
        + (f"; {pruned} not solved, their step floor (fastest choices, no bubble beyond the "
           "schedule's) already slower than a plan found" if pruned else ""),
        f"chosen {best.layout}: predicted step {best.step_time_s * 1e3:.2f} ms, peak "
        f"{best.peak_memory_bytes / 2**30:.2f} GiB ({best.how}"
        + ("" if best.optimal else f", gap {best.gap:.1%}") + ")",
    ]
    if best.uniform:
        # Why not the textbook strategy on the same mesh (e.g. ZeRO-2 over pure data parallel:
        # the same traffic, and each rank steps the optimizer on 1/dp of the parameters).
        lines.append(
            "same mesh, uniform: "
            + "; ".join(
                f"{label} {t * 1e3:.2f} ms ({t / best.step_time_s:.2f}x), peak {peak / 2**30:.2f} GiB"
                + ("" if peak <= costing.memory_limit_bytes else " (over budget)")
                for label, t, peak in best.uniform
            )
        )
    for alt in alternatives:
        if alt["step_time_s"] is not None:
            lines.append(f"runner-up {alt['layout']}: {alt['step_time_s'] * 1e3:.2f} ms "
                         f"({alt['step_time_s'] / best.step_time_s:.2f}x), peak {alt['peak_bytes'] / 2**30:.2f} GiB")
    if infeasible:
        lines.append(f"{infeasible} meshes cannot fit the budget, e.g. " + ", ".join(
            f"{alt['layout']} needs >= {alt['peak_bytes'] / 2**30:.2f} GiB"
            for alt in alternatives if alt["step_time_s"] is None))
    for tp, why in sorted(rejected.items()):
        lines.append(f"tp={tp} with Megatron's layout not possible: {why}")
    if best.exposed_comm_s > 0:
        lines.append(f"data-parallel communication not hidden behind compute: {best.exposed_comm_s * 1e3:.2f} ms per step")
    lines.append(f"measuring the graph took {measure_s:.1f} s")
    return lines


def _offload(blocks: Sequence[S.BlockCost], cand: S.Candidate, costing: S.Costing,
             given: int | None = None) -> tuple[int, float, str]:
    """The window of streamed parameters, the bytes it adds to the peak, and what went where and
    why. The solve priced one layer brought in ahead; a wider window hides a layer's copy behind
    the forwards of the layers before it (``ceil(copy / forward)`` layers), as far as the
    budget's slack holds the extra layers' weights; ``given``: the strategy's window instead."""
    off = [i for i, c in enumerate(cand.choices) if c.tiers.offloaded or c.saved_tier != "device"]
    if not off:
        return 1, 0.0, ""
    m = cand.layout.microbatches
    window, extra = 1, 0.0
    streamed = [i for i in off if cand.choices[i].tiers.parameter == "host"]
    layers = [i for i in streamed if blocks[i].kind == S.LAYER]
    if layers:
        # a layer's weights come up twice a microbatch; its forward is about a third of its time
        copy = max(cand.priced[i].host_link_s / (2 * m) for i in layers)
        forward = min(cand.priced[i].time_s / 3 for i in layers)
        wanted = max(1, min(len(layers), math.ceil(copy / forward) if forward > 0 else 1))
        weights = copy * costing.cluster.host.link_gbps * 1e9  # one layer's (shard of) weights
        slack = max(0.0, costing.memory_limit_bytes - cand.peak_memory_bytes)
        window = given or max(1, min(wanted, 1 + int(slack // weights) if weights > 0 else wanted))
        extra = (window - 1) * weights
    kinds: dict[str, int] = {}
    for i in off:
        kinds[_where(cand.choices[i])] = kinds.get(_where(cand.choices[i]), 0) + 1
    host = sum(cand.priced[i].host_bytes + cand.priced[i].host_act_bytes for i in off)
    disk = sum(cand.priced[i].disk_bytes for i in off)
    link = sum(cand.priced[i].host_link_s for i in off)
    hidden = sum(cand.priced[i].host_window_s for i in off)
    link_name = f"{costing.cluster.host.link_gbps:g} GB/s host link" if costing.cluster.host else "host link"
    text = ("offload, chosen with ZeRO, split, tp and recompute in one solve (each block's tiers priced by the "
            "host link, its overlap with compute and the host's memory): "
            + "; ".join(f"{n} block{'s' if n > 1 else ''} with {what}" for what, n in kinds.items())
            + f"; {host / 2**30:.2f} GiB in host memory"
            + (f", {disk / 2**30:.2f} GiB on disk" if disk else "")
            + f", {link * 1e3:.2f} ms of copies a step on the {link_name}, "
            + ("hidden behind compute" if link <= hidden else f"{(link - hidden) * 1e3:.2f} ms of them exposed")
            + (f"; streamed parameters a window of {window} layer{'s' if window > 1 else ''} ahead" if streamed else ""))
    return window, extra, text


def _where(choice) -> str:
    parts = [str(choice.tiers)] if choice.tiers.offloaded else []
    if choice.saved_tier != "device":
        parts.append(f"activations on {choice.saved_tier}")
    return ", ".join(parts)


def _alternatives(best: S.Candidate, found: list[S.Candidate], infeasible: Mapping[str, float]) -> list[dict]:
    """The runner-up meshes (the next three by step time) and the closest ones that do not fit,
    each with why it lost (``PlanReport.alternatives``)."""
    out = [{"layout": str(c.layout), "step_time_s": c.step_time_s, "peak_bytes": int(c.peak_memory_bytes),
            "why": f"{c.step_time_s / best.step_time_s:.2f}x slower"} for c in found[1:4]]
    out += [{"layout": mesh, "step_time_s": None, "peak_bytes": int(need), "why": "does not fit the budget"}
            for mesh, need in sorted(infeasible.items(), key=lambda kv: kv[1])[:2]]
    return out


def _to_plan(profile: GraphProfile, blocks: Sequence[S.BlockCost], cand: S.Candidate, costing: S.Costing,
             strategy: Strategy | None, reasons: list[str], start: float,
             capacity: tuple[float | str | None, str] = ("model", ""), alternatives: Sequence[dict] = (),
             tables=None) -> Plan:
    capacity_factor, capacity_reason = capacity
    layout = cand.layout
    mesh = layout.mesh
    choices = {}
    for gblock, block, choice in zip(profile.blocks, blocks, cand.choices):
        choices.update((n.name, choice) for n in (*gblock.nodes, *gblock.params))
        for op in block.ops[choice.large_ops:] if choice.mixed else ():  # the rest's stage, unsplit
            choices.update((name, choice.rest()) for name in (op.op, *op.params))
    # Stage s starts at its first block's first op (the first stage at the graph's start).
    stages = ("*", *(profile.blocks[stage[0]].nodes[0].name for stage in cand.stages[1:]))
    breakdown = []
    speeds = S.stage_speeds(costing.cluster, mesh)  # each pp rank's devices against the priced one
    for s, indices in enumerate(cand.stages):
        speed = speeds[layout.rank_of(s)]
        for i in indices:
            pr, block = cand.priced[i], blocks[i]
            breakdown.append({
                "block": block.name, "stage": s, "choice": str(cand.choices[i]),
                "time_s": pr.time_s * layout.microbatches / speed,
                "tp_comm_s": pr.tp_comm_s * layout.microbatches / speed,
                "dp_comm_s": pr.dp_comm_s, "state_bytes": pr.state_bytes, "activation_bytes": pr.act_bytes,
                "transient_bytes": pr.transient_bytes, "grad_bytes": pr.grad_bytes, "held_bytes": pr.held_bytes,
                "loss_backward_bytes": pr.start_bytes, "host_bytes": pr.host_bytes + pr.host_act_bytes,
                "disk_bytes": pr.disk_bytes, "host_link_s": pr.host_link_s,
            })
    reasons = list(reasons) + ([capacity_reason] if capacity_reason else [])
    # the embedding tables' point, priced in the candidate's step and peak (the same solve)
    table_s = costing.tables[cand.tables][0] if cand.tables is not None else 0.0
    if tables is not None:
        choices_of, _, priced = tables
        reasons.append(f"embedding tables: {len(choices_of)} sharded over dp={mesh.dp}, {priced.bytes / 2**30:.3f} GiB on "
                       f"the fullest rank, {priced.time_s * 1e3:.2f} ms a step of exchanges (in the step and peak "
                       "predicted)")
        reasons += [f"  {line}" for line in priced.reasons]
    rooms = S.stage_rooms(costing.cluster, mesh)
    site_line = sites.describe(costing.cluster, mesh, uneven=costing.share_compute != 1.0,
                               stage_speeds=speeds, stage_blocks=[len(indices) for indices in cand.stages],
                               stage_budgets=[costing.memory_limit_bytes * room for room in rooms])
    if site_line:
        reasons.append(site_line)
    reasons.append(f"planned in {time.perf_counter() - start:.1f} s")
    # The step on the slowest pp rank: its microbatches' compute and tp collectives, then the
    # tail (exposed dp communication, optimizer); the rest of the step is the pipeline bubble.
    m, slowest = layout.microbatches, max(range(len(cand.stage_times_s)), key=lambda r: cand.stage_times_s[r])
    work = m * cand.stage_times_s[slowest]
    tp = sum(cand.priced[i].tp_comm_s for s, indices in enumerate(cand.stages)
             if layout.rank_of(s) == slowest for i in indices) * m / speeds[slowest]
    bubble = max(0.0, cand.step_time_s - table_s - work - cand.tail_s)
    tp = min(tp, work)
    time_split = {"compute": max(0.0, cand.step_time_s - table_s - tp - cand.tail_s - bubble), "tp_comm": tp,
                  "dp_comm_exposed": cand.exposed_comm_s, "optimizer": max(0.0, cand.tail_s - cand.exposed_comm_s),
                  "bubble": bubble}
    if cand.tables is not None:
        time_split["embedding_exchange"] = table_s
    op_layout = profile.tp_layouts.get((mesh.tp, layout.tp_layout))
    if op_layout is not None:
        reasons.insert(1, f"tensor-parallel layout: {op_layout.name} (the op-level solver placed the projections "
                          f"Megatron's pattern leaves replicated: {op_layout.describe()})")
    window, window_bytes, offload_reason = _offload(blocks, cand, costing,
                                                    strategy.offload_window if strategy is not None else None)
    if offload_reason:
        reasons.insert(-1, offload_reason)
    base = plan_from_choices(profile.gm, mesh, choices, sequence_parallel=layout.sequence_parallel,
                             microbatches=layout.microbatches, strategy=strategy, reasons=reasons,
                             offload_window=window,
                             tp_layout=(op_layout.placements, op_layout.parts) if op_layout is not None else None,
                             table_plan=tables[:2] if tables is not None else None)
    report = replace(
        base.report,
        predicted_step_time_s=cand.step_time_s,
        predicted_peak_memory_bytes=int(cand.peak_memory_bytes + window_bytes),
        predicted_stage_peaks_bytes=tuple(int(p) for p in cand.stage_peaks_bytes),
        breakdown=tuple(breakdown),
        time_split_s=time_split,
        memory_budget_bytes=int(costing.memory_limit_bytes),
        devices_per_node=costing.cluster.devices_per_node,
        alternatives=tuple(alternatives),
    )
    return replace(base, stages=stages, schedule=layout.schedule, ep_all_to_all=S.ep_all_to_all(blocks, layout, costing),
                   capacity_factor=capacity_factor, report=report)
