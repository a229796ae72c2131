"""Progress bars for long work: profiling a machine, timing a graph's ops, solving meshes.

A bar is drawn (tqdm) only on rank 0, only when stderr is a terminal, and never under
``GRAPHPASS_QUIET=1``; elsewhere (CI logs, other ranks, pipes) :class:`Progress` and
:func:`phase` do nothing. Each step names what is being done, e.g. ``solving mesh 3/12 pp=2
dp=8 tp=4``.

Two shapes of work:

* counted steps (meshes, ops, profiling sizes): :class:`Progress`, a bar over ``total`` steps;
* one phase of unknown length (capturing a model, pricing its ops, running the passes):
  :func:`phase`, a line naming the phase and its elapsed time, drawn only once the phase has
  run :data:`PHASE_DELAY_S` seconds, so quick phases leave the terminal alone. A
  :class:`Progress` bar opened inside a phase is drawn below it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import IO, Iterator

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


#: A phase shorter than this draws nothing (a bar that flashes for a moment only distracts).
PHASE_DELAY_S = 2.0
#: Seconds between redraws of a phase's elapsed time.
PHASE_REFRESH_S = 0.2


@contextlib.contextmanager
def phase(what: str, stream: IO | None = None) -> Iterator[None]:
    """Show ``what`` and its elapsed time while the block runs, once it has run
    :data:`PHASE_DELAY_S` seconds; nothing where :func:`enabled` is false. The line is removed
    when the block ends (also when it raises)::

        with phase("capturing GPT"):
            gm = capture(model, inputs)

    The line is redrawn by a daemon thread, so it ticks while the block runs without calling
    back.
    """
    stream = stream if stream is not None else sys.stderr
    if not enabled(stream):
        yield
        return
    done = threading.Event()
    thread = threading.Thread(target=_draw_phase, args=(what, stream, done, time.monotonic()),
                              name=f"graphpass phase: {what}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _draw_phase(what: str, stream: IO, done: threading.Event, started: float) -> None:
    if done.wait(PHASE_DELAY_S):
        return
    from tqdm import tqdm

    bar = tqdm(total=None, desc=what, file=stream, leave=False, dynamic_ncols=True, bar_format="{desc}")
    try:
        while True:
            bar.set_description_str(f"{what} ({time.monotonic() - started:.0f} s)", refresh=False)
            bar.refresh()
            if done.wait(PHASE_REFRESH_S):
                return
    finally:
        bar.close()
