"""Progress bars for long work: profiling a machine, timing a graph's ops, solving meshes.

A bar is drawn (tqdm) only on rank 0, only when stderr is a terminal, and never under
``GRAPHPASS_QUIET=1``; elsewhere (CI logs, other ranks, pipes) :class:`Progress` does nothing.
Each step names what is being done, e.g. ``solving mesh 3/12 pp=2 dp=8 tp=4``.
"""

from __future__ import annotations

import os
import sys
from typing import IO

QUIET_ENV = "GRAPHPASS_QUIET"


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def enabled(stream: IO | None = None) -> bool:
    """Whether bars are drawn on ``stream`` (default stderr): rank 0, a terminal, not quiet."""
    if os.environ.get(QUIET_ENV, "") not in ("", "0"):
        return False
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and _rank() == 0


class Progress:
    """A bar over ``total`` steps of ``what``; a no-op where :func:`enabled` is false.

    ::

        with Progress(len(meshes), "solving meshes") as bar:
            for i, mesh in enumerate(meshes, 1):
                bar.step(f"solving mesh {i}/{len(meshes)} {mesh}")
                solve(mesh)
    """

    #: Least seconds between redraws.
    MIN_INTERVAL_S = 0.2

    def __init__(self, total: int, what: str, stream: IO | None = None):
        self._bar = None
        stream = stream if stream is not None else sys.stderr
        if total > 0 and enabled(stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, file=stream, leave=False, dynamic_ncols=True,
                             mininterval=self.MIN_INTERVAL_S, unit="")

    def step(self, doing: str) -> None:
        """Start the next step, described by ``doing`` (the bar counts steps begun)."""
        if self._bar is not None:
            self._bar.set_description_str(doing, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
