"""A plan's report: what the planner predicted and why, kept apart from the program it ran.

A :class:`~graphpass.plan.Plan` is the program (the mesh, each tensor's placement, ZeRO stages,
stages, microbatches, ...): what ``compile`` applies and ``Plan.diff`` compares. Its
:class:`PlanReport` (``Plan.report``) is the account the planner gives of it: the predicted
step time and peak memory, the per-block figures, the runner-up meshes and the reasons
``explain()`` prints. A plan written by hand or by ``plan_from_choices`` has an empty report;
two plans with the same program and different reports run the same.

In JSON the report is the plan's ``"report"`` object; a plan written before the two were
separated has the report's fields at its top level, and :meth:`PlanReport.take_legacy` moves
them in, so saved plans and golden files still load.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class PlanReport:
    """What the planner predicted for a plan, and why it chose it.

    Attributes:
        predicted_step_time_s: the cost model's step time, None until the planner prices it.
        predicted_peak_memory_bytes: the cost model's per-device peak, None until priced.
        predicted_stage_peaks_bytes: the cost model's peak on each ``pp`` rank (its stages), in
            order; ``()`` until priced.
        breakdown: the planner's per-block figures, one dict per block in order: ``block``,
            ``stage``, ``choice`` (e.g. ``"zero-3 + recompute"``), ``time_s`` (compute and
            tensor-parallel collectives of one step), ``tp_comm_s``, ``dp_comm_s``,
            ``state_bytes`` (gradients included), ``activation_bytes`` (per microbatch),
            ``transient_bytes``, ``grad_bytes`` (the gradients in ``state_bytes``), ``held_bytes``
            (gradients held across microbatches), ``loss_backward_bytes`` (the loss's backward
            working set, post block only).
        time_split_s: the predicted step split (seconds, summing to ``predicted_step_time_s``):
            ``compute`` and ``tp_comm`` (the slowest pipeline rank's microbatches),
            ``dp_comm_exposed`` (data-parallel communication not hidden behind backward),
            ``optimizer`` and ``bubble`` (pipeline fill and drain); empty until priced.
        memory_budget_bytes: the per-device budget the planner fitted the plan under.
        devices_per_node: devices per node of the planned cluster (ranks ``n * k .. n * k + k - 1``
            share node ``n``).
        alternatives: the runner-up meshes and the closest that did not fit, each ``layout``,
            ``step_time_s`` (None: not fitting), ``peak_bytes`` and ``why`` it lost.
        reasons: human-readable lines saying why the plan is what it is (shown by ``explain``).
    """

    predicted_step_time_s: float | None = None
    predicted_peak_memory_bytes: int | None = None
    predicted_stage_peaks_bytes: tuple[int, ...] = ()
    breakdown: tuple[Mapping[str, Any], ...] = ()
    time_split_s: Mapping[str, float] = field(default_factory=dict)
    memory_budget_bytes: int | None = None
    devices_per_node: int | None = None
    alternatives: tuple[Mapping[str, Any], ...] = ()
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Numbers where numbers go (``explain`` and the page print them)."""
        for name in ("predicted_step_time_s", "predicted_peak_memory_bytes", "memory_budget_bytes"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value >= 0):
                raise ValueError(f"Plan.report.{name} must be a number >= 0 or None, got {value!r}")
        per_node = self.devices_per_node
        if per_node is not None and not (isinstance(per_node, int) and not isinstance(per_node, bool) and per_node > 0):
            raise ValueError(f"Plan.report.devices_per_node must be a positive int or None, got {per_node!r}")
        if not all(_is_number(p) and p >= 0 for p in self.predicted_stage_peaks_bytes):
            raise ValueError(f"Plan.report.predicted_stage_peaks_bytes must be numbers >= 0, got "
                             f"{list(self.predicted_stage_peaks_bytes)!r}")
        if not isinstance(self.time_split_s, Mapping) or not all(
                isinstance(k, str) and _is_number(v) for k, v in self.time_split_s.items()):
            raise ValueError(f"Plan.report.time_split_s must map parts of the step to seconds, got {self.time_split_s!r}")
        for name in ("breakdown", "alternatives"):
            if not all(isinstance(row, Mapping) for row in getattr(self, name)):
                raise ValueError(f"Plan.report.{name} must be a list of objects (one per row), "
                                 f"got {list(getattr(self, name))!r}")
        if not all(isinstance(r, str) for r in self.reasons):
            raise ValueError(f"Plan.report.reasons must be a list of strings, got {list(self.reasons)!r}")

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (the plan's JSON ``"report"``)."""
        data = asdict(self)
        data["predicted_stage_peaks_bytes"] = list(self.predicted_stage_peaks_bytes)
        data["breakdown"] = [dict(row) for row in self.breakdown]
        data["time_split_s"] = dict(self.time_split_s)
        data["alternatives"] = [dict(row) for row in self.alternatives]
        data["reasons"] = list(self.reasons)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "PlanReport":
        """Inverse of :meth:`to_dict`; unknown keys and values of the wrong kind name the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"Plan.report must be an object of the report's fields, got {data!r}")
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown Plan.report fields {sorted(unknown)}; known fields: {list(FIELDS)}")
        kwargs = dict(data)
        for name in ("predicted_stage_peaks_bytes", "breakdown", "alternatives", "reasons"):
            if name in kwargs:
                if not isinstance(kwargs[name], (list, tuple)):
                    raise ValueError(f"Plan.report.{name} must be a list, got {kwargs[name]!r}")
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)

    @staticmethod
    def take_legacy(data: Mapping[str, Any]) -> dict[str, Any]:
        """A plan's JSON with the report's fields that a plan written before the report was its
        own type kept at the top level moved into ``"report"`` (both at once is refused)."""
        legacy = {k: v for k, v in data.items() if k in FIELDS}
        if not legacy:
            return dict(data)
        if "report" in data:
            raise ValueError(f"the Plan gives {sorted(legacy)} both at its top level and in 'report'; keep them in "
                             "'report'")
        out = {k: v for k, v in data.items() if k not in FIELDS}
        out["report"] = legacy
        return out

    # ------------------------------------------------------------------ reading

    def lines(self) -> list[str]:
        """``explain()``'s lines of the report: predictions, step split, per-block runs, reasons."""
        time_s, mem = self.predicted_step_time_s, self.predicted_peak_memory_bytes
        lines = ["predicted step time: " + ("not priced" if time_s is None else f"{time_s * 1e3:.2f} ms"),
                 "predicted peak memory: " + ("not priced" if mem is None else f"{mem / 2**30:.2f} GiB") + (
                     "" if self.memory_budget_bytes is None else f" of a {self.memory_budget_bytes / 2**30:.2f} GiB budget")]
        if self.time_split_s:
            lines.append("step time split: " + ", ".join(
                f"{name.replace('_', ' ')} {t * 1e3:.2f} ms" for name, t in self.time_split_s.items()))
        lines.extend(self._breakdown_lines())
        lines.extend(f"why: {r}" for r in self.reasons)
        return lines

    def _breakdown_lines(self) -> list[str]:
        """Consecutive blocks with the same stage and choice, one line each."""
        if not self.breakdown:
            return []
        runs: list[list[Mapping[str, Any]]] = []
        for row in self.breakdown:
            if runs and (runs[-1][-1]["stage"], runs[-1][-1]["choice"]) == (row["stage"], row["choice"]):
                runs[-1].append(row)
            else:
                runs.append([row])
        lines = ["per block (stage | blocks | choice | compute+tp ms/step | tp comm ms | dp comm ms | state GiB | activations GiB):"]
        for run in runs:
            names = run[0]["block"] if len(run) == 1 else f"{run[0]['block']} .. {run[-1]['block']} ({len(run)})"
            total = lambda key: sum(r[key] for r in run)  # noqa: E731
            lines.append(
                f"  {run[0]['stage']} | {names} | {run[0]['choice']} | {total('time_s') * 1e3:.2f} | "
                f"{total('tp_comm_s') * 1e3:.2f} | {total('dp_comm_s') * 1e3:.2f} | "
                f"{total('state_bytes') / 2**30:.3f} | {total('activation_bytes') / 2**30:.3f}"
            )
        return lines


#: The report's field names (a legacy plan's top-level keys that belong to the report).
FIELDS = tuple(f.name for f in fields(PlanReport))

__all__ = ["FIELDS", "PlanReport"]
