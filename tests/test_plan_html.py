"""Plan.to_html in a real browser: headless Chromium (Debian's package; .ci/run installs it)
renders the page with no console message, its script runs, a screenshot is taken, and every
figure on the page is the Plan's own (read back from the DOM Chromium built)."""

from __future__ import annotations

import html.parser
import shutil
import subprocess

import pytest

import graphpass as gp
import zoo
from graphpass.cli import main


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert path, "no chromium on PATH: .ci/run installs Debian's (apt-get install chromium)"
    return path


def _browse(page, tmp_path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2400", *flags, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


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


@pytest.fixture(scope="module")
def planned():
    # A pipelined plan of the zoo GPT on 2 nodes of 4 H100s: the page has stages, nodes and
    # runner-ups to show.
    model = zoo.build("gpt_deep")
    return gp.plan(model, "h100-80g:2x4", zoo.batches("gpt_deep", 1, 64)[0],
                   strategy=gp.Strategy(pp=2, dp=2, tp=2, microbatches=4)), gp.plan(
        model, "h100-80g:2x4", zoo.batches("gpt_deep", 1, 64)[0])


def test_the_plan_page_renders_without_console_errors_and_shows_the_plans_figures(planned, tmp_path):
    plan, auto = planned
    page = plan.to_html(tmp_path / "plan.html")
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "src=" not in text  # self-contained

    shot = _browse(page, tmp_path, f"--screenshot={tmp_path / 'plan.png'}")
    assert shot.returncode == 0, shot.stderr[-2000:]
    png = (tmp_path / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a page, not a blank frame
    dom = _browse(page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in (shot.stderr + dom.stderr).splitlines() if ":CONSOLE" in line]
    assert not console, console
    figures = _Figures()
    figures.feed(dom.stdout)
    assert "rendered" in figures.text  # the page's script ran to its end

    found = figures.elements
    (step,) = [e for e in found if "data-step-time" in e]
    assert float(step["data-step-time"]) == plan.predicted_step_time_s
    split = {e["data-time"]: float(e["data-value"]) for e in found if "data-time" in e}
    assert split == dict(plan.time_split_s)
    assert sum(split.values()) == pytest.approx(plan.predicted_step_time_s, rel=1e-9)
    assert split["bubble"] > 0  # 2 stages, 4 microbatches: (p - 1) stage times idle
    peaks = [int(e["data-value"]) for e in found if "data-peak" in e]
    assert peaks == list(plan.predicted_stage_peaks_bytes) and len(peaks) == 2
    (budget,) = [int(e["data-budget"]) for e in found if "data-budget" in e]
    assert budget == plan.memory_budget_bytes == int(0.9 * 80 * 2**30)
    cells = [e for e in found if "data-key" in e]
    assert len(cells) == 5 * len(plan.breakdown)
    for i, row in enumerate(plan.breakdown):
        for cell in cells[5 * i: 5 * i + 5]:
            assert float(cell["data-value"]) == row[cell["data-key"]], (i, cell)
    ranks = [e for e in found if "data-rank" in e]
    assert [int(e["data-pp"]) for e in ranks] == [plan.mesh.coordinate(r, "pp") for r in range(8)]
    assert len([e for e in found if "data-node" in e]) == 2 and len([e for e in found if "data-stage" in e]) == 2

    auto_page = auto.to_html(tmp_path / "auto.html")
    auto_dom = _browse(auto_page, tmp_path, "--dump-dom")
    assert not [line for line in auto_dom.stderr.splitlines() if ":CONSOLE" in line]
    alternatives = [e for e in _parse(auto_dom.stdout) if "data-alternative" in e]
    assert len(alternatives) == len(auto.alternatives) >= 1


def _parse(dom: str) -> list[dict[str, str]]:
    figures = _Figures()
    figures.feed(dom)
    return figures.elements


def test_explain_writes_the_page_of_a_saved_plan(planned, tmp_path, capsys):
    plan, _ = planned
    saved = tmp_path / "plan.json"
    saved.write_text(plan.to_json())
    assert gp.Plan.from_json(saved.read_text()) == plan
    assert main(["explain", str(saved), "--html", str(tmp_path / "out.html")]) == 0
    assert "step time split: compute" in capsys.readouterr().out
    assert (tmp_path / "out.html").read_text() == (plan.to_html(tmp_path / "again.html")).read_text()
