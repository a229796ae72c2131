"""Progress bars and phases: drawn on a terminal with what is being done, silent in logs, on
other ranks and when quiet."""

from __future__ import annotations

import io
import sys
import threading
import time

import pytest

import graphpass as gp
import zoo
from graphpass import progress
from graphpass.progress import Progress, phase


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


def test_a_phase_longer_than_the_delay_shows_its_name_and_elapsed_time_then_clears(monkeypatch):
    monkeypatch.delenv("GRAPHPASS_QUIET", raising=False)
    monkeypatch.setattr(progress, "PHASE_DELAY_S", 0.05)
    monkeypatch.setattr(progress, "PHASE_REFRESH_S", 0.01)
    terminal = _Terminal()
    with phase("capturing GPT", stream=terminal):
        time.sleep(0.3)
    drawn = terminal.getvalue()
    assert "capturing GPT (0 s)" in drawn, drawn
    assert drawn.endswith("\r"), drawn  # the line is blanked when the phase ends (nothing left behind)


def test_a_short_phase_a_log_quiet_mode_and_other_ranks_draw_nothing(monkeypatch):
    monkeypatch.delenv("GRAPHPASS_QUIET", raising=False)
    monkeypatch.setattr(progress, "PHASE_REFRESH_S", 0.01)
    terminal = _Terminal()
    with phase("quick", stream=terminal):  # under the default delay of ~2 s
        pass
    assert terminal.getvalue() == ""
    monkeypatch.setattr(progress, "PHASE_DELAY_S", 0.0)
    log = io.StringIO()
    with phase("long", stream=log):
        time.sleep(0.05)
    assert log.getvalue() == ""
    monkeypatch.setenv("RANK", "1")
    with phase("long", stream=terminal):
        time.sleep(0.05)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("GRAPHPASS_QUIET", "1")
    with phase("long", stream=terminal):
        time.sleep(0.05)
    assert terminal.getvalue() == ""


def test_a_phase_ends_its_line_when_the_block_raises(monkeypatch):
    monkeypatch.delenv("GRAPHPASS_QUIET", raising=False)
    monkeypatch.setattr(progress, "PHASE_DELAY_S", 0.0)
    terminal = _Terminal()
    with pytest.raises(ValueError):
        with phase("failing", stream=terminal):
            time.sleep(0.05)
            raise ValueError("boom")
    assert not [t for t in threading.enumerate() if t.name.startswith("graphpass phase")]


def test_compile_names_each_phase_it_is_in_on_a_terminal(monkeypatch):
    # A delay of 0 draws every phase however short, so the test sees them all on any machine.
    monkeypatch.delenv("GRAPHPASS_QUIET", raising=False)
    monkeypatch.setattr(progress, "PHASE_DELAY_S", 0.0)
    monkeypatch.setattr(progress, "PHASE_REFRESH_S", 0.01)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    model = zoo.build("gpt")
    gp.compile(model, gp.Cluster.local(), example_inputs=zoo.batches("gpt", 1, 4)[0])
    drawn = terminal.getvalue()
    for named in ("planning GPT on 1 device", "capturing GPT", "applying the plan to GPT",
                  "verifying GPT against the other ranks"):
        assert named in drawn, drawn
    assert not [t for t in threading.enumerate() if t.name.startswith("graphpass phase")]
