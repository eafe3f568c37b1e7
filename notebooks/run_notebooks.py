"""Run the notebooks as a student would (top to bottom, full size unless DART_LAB_SMOKE=1), then render
each executed copy to static HTML, and report per notebook: the wall time, the longest stretch a cell ran
without printing or drawing anything, and whether every figure and widget carries a static image (what
an HTML export without JavaScript shows).

    python notebooks/run_notebooks.py                      # all notebooks, full size (about an hour on 2 cores)
    DART_LAB_SMOKE=1 python notebooks/run_notebooks.py 03  # one notebook, small
    options: --out DIR (executed .ipynb + .html; default build/notebooks), --json FILE

Exit status 1 when a cell fails or a figure has no static image. `make notebooks` runs it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbconvert import HTMLExporter

HERE = Path(__file__).resolve().parent
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
# what a student sees change: outputs, and widget updates (a progress bar moving is a comm message)
VISIBLE = {"stream", "display_data", "execute_result", "error", "update_display_data", "clear_output", "comm_msg"}


class TimedClient(NotebookClient):
    """nbclient that notes when each cell starts, shows something, and finishes (monotonic seconds)."""

    def __init__(self, nb, **kw):
        super().__init__(nb, **kw)
        self.events: dict[int, list[float]] = {}

    def process_message(self, msg, cell, cell_index):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "execute_input" or kind in VISIBLE or (kind == "status" and content["execution_state"] == "idle"):
            self.events.setdefault(cell_index, []).append(time.monotonic())
        return super().process_message(msg, cell, cell_index)


def longest_silence(events: dict[int, list[float]]) -> tuple[float, int]:
    """(seconds, cell index) of the longest gap between a cell's start, its outputs and its end."""
    gaps = [(b - a, i) for i, ts in events.items() for a, b in zip(ts, ts[1:])]
    return max(gaps, default=(0.0, -1))


def figure_report(nb) -> dict:
    """Figures (plotly outputs) and widgets, and how many of each have a static form in their cell (a PNG; for a
    widget, a picture or a printed line)."""
    figs = figs_static = widgets = widgets_static = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outs = [o for o in cell.get("outputs", []) if o.get("output_type") in ("display_data", "execute_result")]
        images = sum("image/png" in o["data"] or "<img" in o["data"].get("text/html", "") for o in outs)
        for o in outs:
            if PLOTLY in o["data"]:
                figs += 1
                figs_static += "image/png" in o["data"]
        # progress bars (tqdm's widget; its text is the bar) need no static copy: they vanish harmlessly
        n_widgets = sum(WIDGET in o["data"] and "%|" not in o["data"].get("text/plain", "") for o in outs)
        widgets += n_widgets
        # a widget's static form: a picture of its default state, or text that points to one
        static = images + any(o.get("output_type") == "stream" for o in cell.get("outputs", []))
        widgets_static += min(n_widgets, static)
    return {"figures": figs, "figures_with_image": figs_static, "widgets": widgets, "widgets_with_image": widgets_static}


def run(path: Path, out: Path, timeout: int) -> dict:
    nb = nbformat.read(path, as_version=4)
    client = TimedClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}})
    t0, error = time.monotonic(), None
    try:
        client.execute()
    except Exception as e:  # a failing cell: keep what ran, report it
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    wall = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out / path.name)
    html, _ = HTMLExporter().from_notebook_node(nb)
    (out / path.with_suffix(".html").name).write_text(html)
    silence, cell = longest_silence(client.events)
    return {"notebook": path.name, "seconds": round(wall, 1), "longest_silence_s": round(silence, 1),
            "silent_cell": cell, "html_img_tags": len(re.findall(r"<img\b", html)), "error": error,
            **figure_report(nb)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("only", nargs="*", help="notebook number prefixes (e.g. 03 07); default all")
    ap.add_argument("--out", type=Path, default=HERE.parent / "build" / "notebooks")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    args = ap.parse_args(argv)
    paths = [p for p in sorted(HERE.glob("[0-9][0-9]_*.ipynb")) if not args.only or p.name[:2] in args.only]
    rows = []
    for p in paths:
        print(f"running {p.name} ...", flush=True)
        rows.append(run(p, args.out, args.timeout))
        r = rows[-1]
        print(f"  {r['seconds']:.0f} s; longest silence {r['longest_silence_s']:.1f} s (cell {r['silent_cell']}); "
              f"figures {r['figures_with_image']}/{r['figures']} with an image, widgets {r['widgets_with_image']}/"
              f"{r['widgets']}; {r['error'] or 'no error'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print("\n| notebook | minutes | longest silence (s) | figures with a static image | widgets with one |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['notebook']} | {r['seconds'] / 60:.1f} | {r['longest_silence_s']:.1f} | "
              f"{r['figures_with_image']}/{r['figures']} | {r['widgets_with_image']}/{r['widgets']} |")
    bad = [r["notebook"] for r in rows if r["error"] or r["figures_with_image"] < r["figures"]
           or r["widgets_with_image"] < r["widgets"]]
    if bad:
        print("not clean:", ", ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
