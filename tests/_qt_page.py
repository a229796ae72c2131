"""Render one local page in Qt WebEngine, headless, for tests/test_plan_html.py.

Qt WebEngine is Chromium's engine (Blink and V8) packaged in the PyQt6-WebEngine wheels of the
dev extra, so the page test has a real browser wherever `pip install -e '.[dev]'` ran, without a
system Chromium or a download at test time. Run as a script in its own process (Qt wants its
application object on the main thread, once per process)::

    python tests/_qt_page.py PAGE.html SHOT.png

prints one JSON object: ``loaded`` (the load succeeded), ``dom`` (the document's outerHTML once
the page's scripts ran) and ``console`` (every console message, uncaught errors included, as
``level: message (line N)``); exits 2 if the page did not finish within the time limit.
"""

from __future__ import annotations

import json
import os
import sys

# Before Qt loads: no display (offscreen platform), software rendering, and no Chromium sandbox
# (it refuses to start as root, which CI is; the page is our own file).
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("QTWEBENGINE_DISABLE_SANDBOX", "1")
os.environ.setdefault("QTWEBENGINE_CHROMIUM_FLAGS", "--disable-gpu --disable-logging")

from PyQt6.QtCore import QTimer, QUrl  # noqa: E402
from PyQt6.QtWebEngineCore import QWebEnginePage  # noqa: E402
from PyQt6.QtWebEngineWidgets import QWebEngineView  # noqa: E402
from PyQt6.QtWidgets import QApplication  # noqa: E402

LIMIT_MS = 60_000
#: grabs, 200 ms apart, until the first frame has painted (20 s at most)
PAINT_TRIES = 100
#: the window size of the Chromium screenshot in test_plan_html.py
WIDTH, HEIGHT = 1280, 2400


class _Page(QWebEnginePage):
    def __init__(self, parent, console: list[str]):
        super().__init__(parent)
        self.console = console

    def javaScriptConsoleMessage(self, level, message, line, source):  # noqa: N802 - Qt's name
        self.console.append(f"{level.name}: {message} (line {line})")


def _blank(image) -> bool:
    """Whether every pixel of ``image`` has the first one's colour (nothing painted yet)."""
    data = image.constBits().asstring(image.sizeInBytes())
    size = max(1, image.depth() // 8)
    return data == data[:size] * (len(data) // size)


def main(page_path: str, shot_path: str) -> int:
    app = QApplication(sys.argv[:1])
    result: dict = {"loaded": False, "dom": "", "console": []}
    view = QWebEngineView()
    page = _Page(view, result["console"])
    view.setPage(page)
    view.resize(WIDTH, HEIGHT)
    view.show()

    def shoot(tries: int) -> None:
        # the first frame paints when the machine gets to it: grab again until the view holds
        # more than its background (a busy CI machine takes seconds); a page that paints
        # nothing (a failing script's) is saved blank after PAINT_TRIES
        image = view.grab().toImage()
        if _blank(image) and tries > 1:
            QTimer.singleShot(200, lambda: shoot(tries - 1))
            return
        image.save(shot_path)
        app.exit(0)

    def got_dom(dom: str) -> None:
        result["dom"] = dom or ""
        QTimer.singleShot(100, lambda: shoot(PAINT_TRIES))

    def loaded(ok: bool) -> None:
        result["loaded"] = ok
        page.runJavaScript("document.documentElement.outerHTML", got_dom)

    page.loadFinished.connect(loaded)
    page.load(QUrl.fromLocalFile(os.path.abspath(page_path)))
    QTimer.singleShot(LIMIT_MS, lambda: app.exit(2))
    code = app.exec()
    print(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
