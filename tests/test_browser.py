"""JupyterLab, driven in a real browser: notebook 03 opens, runs in smoke mode without an error in any
cell, and moving a slider of its interactive cell changes the figure (and the live verification).

Needs a Chromium (Debian's `chromium`; `.ci/run` installs it) and the `playwright` package (the
`dev` extra); skipped with the reason otherwise. The screenshot goes to $DART_LAB_SCREENSHOT_DIR
(`make screenshot` sets docs/), else to the test's temporary folder, so `make test` leaves git clean.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "03_tree_search.ipynb"
CHROMIUM = next((p for p in (os.environ.get("DART_LAB_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), shutil.which("google-chrome")) if p), None)

pytestmark = [pytest.mark.slow, pytest.mark.embedded,
              pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (Debian: apt-get install chromium)")]
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")

# JS helpers, run in the page: JupyterLab exposes its app object with expose_app_in_browser
_NOTEBOOK_JS = "() => window.jupyterapp.shell.currentWidget"
_ERRORS_JS = """() => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  const out = [];
  for (const cell of nb.widgets) {
    if (cell.model.type !== 'code') continue;
    for (const o of cell.model.outputs.toJSON()) if (o.output_type === 'error') out.push(o.ename + ': ' + o.evalue);
  }
  return out;
}"""
_BUSY_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext.session && w.sessionContext.session.kernel;
  const pending = [...w.content.widgets].filter(c => c.model.type === 'code' && c.model.executionCount === null).length;
  return {status: k ? k.status : 'none', pending};
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on localhost over a copy of the notebooks (the kernel runs in smoke mode)."""
    work = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "notebooks" / NOTEBOOK, work / NOTEBOOK)
    port, token = _free_port(), "dart-lab-test"
    env = {**os.environ, "DART_LAB_SMOKE": "1", "DART_LAB_STATIC_FIGURES": "1", "JUPYTER_RUNTIME_DIR": str(work / ".runtime")}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--LabApp.expose_app_in_browser=True",
           "--ServerApp.disable_check_xsrf=True", "--allow-root"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(work / "lab.log", "w"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=1)
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail("JupyterLab did not start: " + (work / "lab.log").read_text()[-2000:])
            time.sleep(0.5)
    yield url, token, work
    proc.terminate()
    proc.wait(timeout=30)


def _wait_idle(page, timeout_s: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        s = page.evaluate(_BUSY_JS)
        if s["status"] == "idle" and s["pending"] == 0:
            return
        time.sleep(1)
    raise AssertionError(f"notebook still running after {timeout_s:.0f} s: {page.evaluate(_BUSY_JS)}")


def test_notebook_03_runs_in_jupyterlab_and_its_slider_updates_the_figure(lab, tmp_path):
    url, token, work = lab
    shots = Path(os.environ.get("DART_LAB_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}")
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget && "
                               "window.jupyterapp.shell.currentWidget.sessionContext.session", timeout=120_000)
        page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                               ".status === 'idle'", timeout=120_000)
        page.add_style_tag(content=".Toastify { display: none !important; }")  # the "Jupyter news?" toast
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        time.sleep(2)
        _wait_idle(page, 400)
        assert page.evaluate(_ERRORS_JS) == []

        # the interactive cell: its figure title names the settings and the live verification result
        widget = page.locator(".widget-interact").first
        widget.scroll_into_view_if_needed()
        title = widget.locator(".gtitle").first
        title.wait_for(timeout=60_000)
        before = title.text_content()
        widget.locator(".noUi-handle").first.focus()  # the first slider: beam width
        for _ in range(3):
            page.keyboard.press("ArrowRight")
        deadline = time.time() + 180
        while time.time() < deadline and widget.locator(".gtitle").first.text_content() == before:
            time.sleep(1)
        _wait_idle(page, 180)
        after = widget.locator(".gtitle").first.text_content()
        assert after != before and "beam 20," in before and "beam 20," not in after
        assert page.evaluate(_ERRORS_JS) == []
        widget.screenshot(path=str(shots / "jupyterlab_03_slider.png"))

        # the executed notebook, exported as a code host shows it: every figure present as an image
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        time.sleep(3)
        html, figure_cells = _export_html(work / NOTEBOOK, tmp_path)
        static = browser.new_page(java_script_enabled=False, viewport={"width": 1400, "height": 1000})
        static.goto(html.as_uri())
        drawn = static.evaluate(_IMAGES_PER_CELL_JS)  # loaded images in each code cell, in order
        assert figure_cells and len(drawn) >= max(figure_cells) + 1
        assert all(drawn[i] > 0 for i in figure_cells), (drawn, figure_cells)
        browser.close()


# per code cell of an nbconvert (lab template) page: how many of its images have loaded
_IMAGES_PER_CELL_JS = """() => [...document.querySelectorAll('.jp-CodeCell')].map(
  c => [...c.querySelectorAll('img')].filter(i => i.complete && i.naturalWidth > 0).length)"""


def _export_html(notebook: Path, out: Path) -> tuple[Path, list[int]]:
    """nbconvert's HTML of a saved notebook, and the indices (among code cells) of the cells holding a
    figure or a widget: each should show an image with JavaScript off."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(notebook, as_version=4)
    outs = [[o for o in c.get("outputs", []) if "data" in o] for c in nb.cells if c.cell_type == "code"]
    kinds = ("application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json")
    cells = [i for i, cell in enumerate(outs) if any(k in o["data"] for o in cell for k in kinds)]
    path = out / "export.html"
    path.write_text(HTMLExporter().from_notebook_node(nb)[0])
    return path, cells
