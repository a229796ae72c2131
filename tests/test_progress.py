"""Progress bars: drawn on a terminal with what is being done, silent in logs and when quiet."""

from __future__ import annotations

import io
import sys

import graphpass as gp
import zoo
from graphpass.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _plan_on(stream, monkeypatch) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(Progress, "MIN_INTERVAL_S", 0.0)  # draw every step
    gp.plan(zoo.build("gpt"), "h100-80g:1x4", zoo.batches("gpt", 1, 16)[0])
    return stream.getvalue()


def test_solving_draws_a_bar_naming_each_mesh_on_a_terminal(monkeypatch):
    monkeypatch.delenv("GRAPHPASS_QUIET", raising=False)
    drawn = _plan_on(_Terminal(), monkeypatch)
    assert "solving mesh 1/" in drawn and "pp=1 dp=4 tp=1" in drawn, drawn[-500:]


def test_no_bar_in_a_log_or_under_graphpass_quiet(monkeypatch):
    monkeypatch.delenv("GRAPHPASS_QUIET", raising=False)
    assert "solving mesh" not in _plan_on(io.StringIO(), monkeypatch)  # not a terminal
    monkeypatch.setenv("GRAPHPASS_QUIET", "1")
    assert "solving mesh" not in _plan_on(_Terminal(), monkeypatch)


def test_only_rank_0_draws(monkeypatch):
    monkeypatch.delenv("GRAPHPASS_QUIET", raising=False)
    monkeypatch.setattr(Progress, "MIN_INTERVAL_S", 0.0)
    monkeypatch.setenv("RANK", "1")
    terminal = _Terminal()
    with Progress(3, "work", stream=terminal) as bar:
        bar.step("step 1/3")
    assert terminal.getvalue() == ""
    monkeypatch.setenv("RANK", "0")
    with Progress(3, "work", stream=terminal) as bar:
        bar.step("step 1/3")
    assert "step 1/3" in terminal.getvalue()
