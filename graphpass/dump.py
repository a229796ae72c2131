"""Readable dumps of the graph after every pass, plus the plan and a summary.

Layout under ``dump_dir`` (``dump_dir=`` argument or ``GRAPHPASS_DUMP_DIR``)::

    rank{r}/00_capture.py            the captured single-device graph
    rank{r}/{NN:02d}_{pass}.py       the graph after pass NN, headed by its PassRecord line
    plan.json, plan.txt, plan.html   the plan (JSON, Plan.explain(), Plan.to_html())
    summary.txt                      capture route and one line per pass

Each graph file is the generated Python of the GraphModule (with shapes) followed by a table of
every node's gp.* metadata, so provenance (module path, layer, placement, which pass created it)
is visible next to the code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch
import torch.fx as fx

from graphpass import meta
from graphpass.pass_manager import PassRecord
from graphpass.ops import op_name
from graphpass.plan import Plan

DUMP_ENV = "GRAPHPASS_DUMP_DIR"


def resolve_dump_dir(dump_dir: str | os.PathLike | None) -> Path | None:
    """The dump directory from the argument, else ``GRAPHPASS_DUMP_DIR``, else None."""
    value = dump_dir if dump_dir is not None else os.environ.get(DUMP_ENV)
    return Path(value) if value else None


def _describe_val(value) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe_val(v) for v in value) + ")"
    return type(value).__name__ if value is not None else "-"


def graph_text(gm: fx.GraphModule, header: str) -> str:
    """The dump of one graph: header, generated code, then a node/metadata table."""
    lines = [f"# {header}", ""]
    lines.append(gm.print_readable(print_output=False, include_stride=False, include_device=False))
    lines.append("")
    lines.append("# node | op | value | module | layer | gp.* extras")
    for node in gm.graph.nodes:
        extras = {
            k.removeprefix("gp."): v
            for k, v in node.meta.items()
            if k.startswith("gp.") and k not in (meta.MODULE_PATH, meta.LAYER, meta.SOURCE)
        }
        extra_text = " ".join(f"{k}={v}" for k, v in extras.items())
        layer = node.meta.get(meta.LAYER)
        lines.append(
            f"# {node.name} | {op_name(node)} | {_describe_val(node.meta.get(meta.VAL))} | "
            f"{node.meta.get(meta.MODULE_PATH, '') or '-'} | {'-' if layer is None else layer} | {extra_text}"
        )
    return "\n".join(lines) + "\n"


class Dumper:
    """Writes dumps for one rank; a no-op when ``root`` is None."""

    def __init__(self, root: Path | None, rank: int):
        self.root = root
        self.rank = rank
        if root is not None:
            (root / f"rank{rank}").mkdir(parents=True, exist_ok=True)

    @property
    def rank_dir(self) -> Path | None:
        """``root/rank{r}`` or None."""
        return None if self.root is None else self.root / f"rank{self.rank}"

    def graph(self, index: int, name: str, gm: fx.GraphModule, header: str) -> None:
        """Write ``rank{r}/{index:02d}_{name}.py``."""
        if self.root is None:
            return
        (self.root / f"rank{self.rank}" / f"{index:02d}_{name}.py").write_text(graph_text(gm, header))

    def record(self, index: int, record: PassRecord, gm: fx.GraphModule) -> None:
        """Dump callback for :func:`graphpass.pass_manager.run_passes`."""
        self.graph(index, record.name, gm, record.header(index))

    def finish(self, plan: Plan, route: str, capture_s: float, records: Sequence[PassRecord]) -> None:
        """Write ``plan.json``, ``plan.txt``, ``plan.html`` and ``summary.txt`` (rank 0 only)."""
        if self.root is None or self.rank != 0:
            return
        (self.root / "plan.json").write_text(plan.to_json() + "\n")
        (self.root / "plan.txt").write_text(plan.explain() + "\n")
        plan.to_html(self.root / "plan.html")
        lines = [f"capture via {route} ({capture_s:.2f} s)"]
        lines += [r.header(i) for i, r in enumerate(records, start=1)]
        (self.root / "summary.txt").write_text("\n".join(lines) + "\n")
