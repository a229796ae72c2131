"""Plan.to_html: every figure on the page is the Plan's own, read back from the page itself
(html.parser, no browser) and from the DOM a real browser engine built once the page's script ran,
with no console message and a screenshot that is a page, not a blank frame.

Browsers: Qt WebEngine, Chromium's engine shipped in the PyQt6-WebEngine wheels of the dev extra
(``pip install -e '.[dev]'`` brings it, so this runs on a fresh machine; tests/_qt_page.py drives
it headless), and Debian's ``chromium`` where it is on PATH. ``.ci/run`` installs chromium and
sets ``GRAPHPASS_TEST_CHROMIUM=1``, which makes a missing chromium a failure there, so CI always
checks the page in both.
"""

from __future__ import annotations

import html.parser
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import graphpass as gp
import zoo
from graphpass.cli import main

QT_PAGE = pathlib.Path(__file__).with_name("_qt_page.py")


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _browsers() -> list[str]:
    """Qt WebEngine always (a dev dependency); Chromium where installed, or demanded (CI)."""
    return ["qtwebengine"] + (["chromium"] if _chromium() or os.environ.get("GRAPHPASS_TEST_CHROMIUM") == "1" else [])


def _chromium_run(page, tmp_path, *flags: str) -> subprocess.CompletedProcess:
    path = _chromium()
    assert path, "GRAPHPASS_TEST_CHROMIUM=1 but no chromium on PATH: apt-get install chromium (as .ci/run does)"
    cmd = [path, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2400", *flags, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _browse(browser: str, page: pathlib.Path, tmp_path: pathlib.Path) -> tuple[str, list[str], bytes]:
    """``page`` rendered in ``browser``: (the DOM after its scripts ran, console messages, PNG)."""
    shot = tmp_path / f"{page.stem}-{browser}.png"
    if browser == "chromium":
        taken = _chromium_run(page, tmp_path, f"--screenshot={shot}")
        assert taken.returncode == 0, taken.stderr[-2000:]
        dom = _chromium_run(page, tmp_path, "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        console = [line for line in (taken.stderr + dom.stderr).splitlines() if ":CONSOLE" in line]
        return dom.stdout, console, shot.read_bytes()
    run = subprocess.run([sys.executable, str(QT_PAGE), str(page), str(shot)], capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0 and run.stdout.strip(), (run.returncode, run.stderr[-2000:])
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["loaded"], f"Qt WebEngine could not load {page}: {run.stderr[-2000:]}"
    return out["dom"], out["console"], shot.read_bytes()


class _Figures(html.parser.HTMLParser):
    """Every element's data-* attributes, in document order."""

    def __init__(self):
        super().__init__()
        self.elements: list[dict[str, str]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        data = {k: v for k, v in attrs if k.startswith("data-")}
        if data:
            self.elements.append(data)

    def handle_data(self, data):
        self.text.append(data)


def _parse(page: str) -> list[dict[str, str]]:
    figures = _Figures()
    figures.feed(page)
    return figures.elements


@pytest.fixture(scope="module")
def planned():
    # A pipelined plan of the zoo GPT on 2 nodes of 4 H100s: the page has stages, nodes and
    # runner-ups to show.
    model = zoo.build("gpt_deep")
    return gp.plan(model, "h100-80g:2x4", zoo.batches("gpt_deep", 1, 64)[0],
                   strategy=gp.Strategy(pp=2, dp=2, tp=2, microbatches=4)), gp.plan(
        model, "h100-80g:2x4", zoo.batches("gpt_deep", 1, 64)[0])


def _check_figures(plan: gp.Plan, found: list[dict[str, str]]) -> None:
    """The page's data-* figures (in document order) are ``plan``'s own."""
    (step,) = [e for e in found if "data-step-time" in e]
    assert float(step["data-step-time"]) == plan.report.predicted_step_time_s
    split = {e["data-time"]: float(e["data-value"]) for e in found if "data-time" in e}
    assert split == dict(plan.report.time_split_s)
    assert sum(split.values()) == pytest.approx(plan.report.predicted_step_time_s, rel=1e-9)
    assert split["bubble"] > 0  # 2 stages, 4 microbatches: (p - 1) stage times idle
    peaks = [int(e["data-value"]) for e in found if "data-peak" in e]
    assert peaks == list(plan.report.predicted_stage_peaks_bytes) and len(peaks) == 2
    (budget,) = [int(e["data-budget"]) for e in found if "data-budget" in e]
    assert budget == plan.report.memory_budget_bytes == int(0.9 * 80 * 2**30)
    cells = [e for e in found if "data-key" in e]
    assert len(cells) == 5 * len(plan.report.breakdown)
    for i, row in enumerate(plan.report.breakdown):
        for cell in cells[5 * i: 5 * i + 5]:
            assert float(cell["data-value"]) == row[cell["data-key"]], (i, cell)
    ranks = [e for e in found if "data-rank" in e]
    assert [int(e["data-pp"]) for e in ranks] == [plan.mesh.coordinate(r, "pp") for r in range(8)]
    assert len([e for e in found if "data-node" in e]) == 2 and len([e for e in found if "data-stage" in e]) == 2


def test_the_plan_page_is_self_contained_and_shows_the_plans_figures(planned, tmp_path):
    plan, auto = planned
    text = plan.to_html(tmp_path / "plan.html").read_text()
    assert "http://" not in text and "https://" not in text and "src=" not in text  # self-contained
    _check_figures(plan, _parse(text))
    alternatives = [e for e in _parse(auto.to_html(tmp_path / "auto.html").read_text()) if "data-alternative" in e]
    assert len(alternatives) == len(auto.report.alternatives) >= 1


@pytest.mark.parametrize("browser", _browsers())
def test_the_plan_page_renders_in_a_browser_without_console_messages(browser, planned, tmp_path):
    plan, auto = planned
    dom, console, png = _browse(browser, plan.to_html(tmp_path / "plan.html"), tmp_path)
    assert not console, console
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a page, not a blank frame
    figures = _Figures()
    figures.feed(dom)
    assert "rendered" in figures.text  # the page's script ran to its end
    _check_figures(plan, figures.elements)  # the DOM the browser built holds the same figures

    auto_dom, auto_console, _ = _browse(browser, auto.to_html(tmp_path / "auto.html"), tmp_path)
    assert not auto_console, auto_console
    assert len([e for e in _parse(auto_dom) if "data-alternative" in e]) == len(auto.report.alternatives) >= 1


@pytest.mark.parametrize("browser", _browsers())
def test_the_browser_check_sees_a_failing_script(browser, tmp_path):
    """The harness itself: a script error reaches the console list, so an empty list means none."""
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><p id="x"></p><script>document.getElementById("x").textContent = '
                    '"ran"; no_such_function();</script></body></html>')
    dom, console, _ = _browse(browser, page, tmp_path)
    assert "ran" in dom and any("no_such_function" in line for line in console), console


def test_explain_writes_the_page_of_a_saved_plan(planned, tmp_path, capsys):
    plan, _ = planned
    saved = tmp_path / "plan.json"
    saved.write_text(plan.to_json())
    assert gp.Plan.from_json(saved.read_text()) == plan
    assert main(["explain", str(saved), "--html", str(tmp_path / "out.html")]) == 0
    assert "step time split: compute" in capsys.readouterr().out
    assert (tmp_path / "out.html").read_text() == (plan.to_html(tmp_path / "again.html")).read_text()
