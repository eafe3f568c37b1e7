"""Interactive pictures for the notebooks: draft trees (networkx layout drawn with plotly), the tree
attention mask, and benchmark plots. Needs the `viz` extra (plotly, networkx, ipywidgets)."""
from __future__ import annotations

import math
import os

import numpy as np

from .search import SearchNodes


_VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥"}


def _label(tokenizer, tok: int) -> str:
    """A token as a short visible label: spaces, newlines and tabs drawn as ␣ ⏎ ⇥ (a bare space or
    newline would be an empty label; a repr would print a literal backslash-n)."""
    if tokenizer is None:
        return str(tok)
    s = tokenizer.decode([tok])
    if not s.strip():
        return "".join(_VISIBLE.get(c, "·") for c in s) or "∅"
    return s.replace("\n", "⏎").replace("\t", "⇥")


def tree_graph(nodes: SearchNodes, tokenizer=None):
    """networkx DiGraph of a searched tree; node attributes: token, text, depth, score, draft_logp, ngram_p."""
    import networkx as nx

    t = nodes.tree
    g = nx.DiGraph()
    toks, par, dep = t.tokens.tolist(), t.parents.tolist(), t.depths.tolist()
    sc = t.scores.tolist() if t.scores is not None else [0.0] * len(t)
    for i in range(len(t)):
        g.add_node(i, token=toks[i], text=_label(tokenizer, toks[i]), depth=dep[i], score=sc[i],
                   draft_logp=float(nodes.draft_logp[i]), ngram_p=float(nodes.ngram_p[i]))
        if par[i] >= 0:
            g.add_edge(par[i], i)
    return g


def _layered_positions(g) -> dict:
    """x = depth; y = leaf-order so that subtrees stay together (a tidy tree layout)."""
    import networkx as nx

    order = list(nx.dfs_preorder_nodes(g, 0))
    leaves = [n for n in order if g.out_degree(n) == 0]
    y = {n: float(i) for i, n in enumerate(leaves)}
    for n in reversed(order):  # parents centred over their children
        kids = list(g.successors(n))
        if kids:
            y[n] = float(np.mean([y[k] for k in kids]))
    return {n: (g.nodes[n]["depth"] - 1, -y[n]) for n in g}  # x = level: the root at -1


def _node_text(node: dict) -> str:
    """A node's text on the figure; the root (the last committed token) named as such."""
    return f"root: {node['text']}" if node["depth"] == 0 else node["text"]


def tree_figure(nodes: SearchNodes, tokenizer=None, accepted: list[int] | None = None, title: str = "draft tree",
                score_range: tuple[float, float] | None = None):
    """Plotly figure of the draft tree: x = level (level 0 = the first drafted token; the root, the
    last committed token, sits at -1), nodes coloured by score, hover = token, draft log-prob, n-gram
    prob and score; the accepted path (node indices from the root) drawn in red. `score_range` fixes
    the colour scale, so figures of different settings can be compared."""
    import plotly.graph_objects as go

    g = tree_graph(nodes, tokenizer)
    pos = _layered_positions(g)
    acc_edges = set(zip(accepted[:-1], accepted[1:])) if accepted else set()
    ex, ey, ax, ay = [], [], [], []
    for u, v in g.edges:
        xs, ys = (ax, ay) if (u, v) in acc_edges else (ex, ey)
        xs += [pos[u][0], pos[v][0], None]
        ys += [pos[u][1], pos[v][1], None]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#bbbbbb", width=1), hoverinfo="skip",
                             name="tree edges"))
    if ax:
        fig.add_trace(go.Scatter(x=ax, y=ay, mode="lines", line=dict(color="crimson", width=4), hoverinfo="skip",
                                 name="accepted path"))
    n = list(g.nodes)
    hover = []
    for i in n:
        d = g.nodes[i]
        ng = "-" if math.isnan(d["ngram_p"]) else f"{d['ngram_p']:.3g}"
        hover.append(f"node {i} | level {d['depth'] - 1}<br>token {d['token']} {d['text']!r}<br>"
                     f"draft log p {d['draft_logp']:.3f}<br>n-gram p {ng}<br>score {d['score']:.3f}")
    fig.add_trace(go.Scatter(
        x=[pos[i][0] for i in n], y=[pos[i][1] for i in n], mode="markers+text",
        text=[_node_text(g.nodes[i]) for i in n], textposition="middle right", hovertext=hover, hoverinfo="text",
        marker=dict(size=[16 if accepted and i in accepted else 11 for i in n],
                    color=[g.nodes[i]["score"] for i in n], colorscale="Viridis", showscale=True,
                    **(dict(cmin=score_range[0], cmax=score_range[1]) if score_range else {}),
                    colorbar=dict(title="score"), line=dict(color=["crimson" if accepted and i in accepted else "white"
                                                                   for i in n], width=2)),
        name="nodes"))
    fig.update_traces(textfont=dict(size=11), selector=dict(name="nodes"))
    fig.update_layout(title=title, xaxis=dict(title="level (the root, the last committed token, at -1)", dtick=1),
                      yaxis=dict(visible=False), template="plotly_white", legend=dict(orientation="h"),
                      height=max(420, 20 * sum(1 for i in n if g.out_degree(i) == 0)))  # ~20 px per leaf row
    return fig


def mask_heatmap(tree, title: str = "tree attention mask (row attends to column)"):
    import plotly.graph_objects as go

    m = tree.ancestor_mask().int().numpy()
    fig = go.Figure(go.Heatmap(z=m, colorscale=[[0, "white"], [1, "#3060c0"]], showscale=False,
                               hovertemplate="query %{y} -> key %{x}: %{z}<extra></extra>"))
    fig.update_layout(title=title, yaxis=dict(autorange="reversed", title="query node"), xaxis=dict(title="key node"),
                      height=500, width=520, template="plotly_white")
    return fig


def bench_figures(result: dict) -> dict:
    """tau, speedup and accepted-length histograms from a `dart-lab bench` result dict."""
    import plotly.graph_objects as go

    methods = [m for m in result["methods"] if result["methods"][m].get("tau") is not None]
    figs = {}
    figs["speedup"] = go.Figure(go.Bar(x=list(result["methods"]), y=[result["methods"][m].get("speedup_vs_ar") or 0
                                                                       for m in result["methods"]]))
    figs["speedup"].update_layout(title="speedup vs AR (tokens/s ratio)", template="plotly_white")
    figs["tau"] = go.Figure(go.Bar(x=methods, y=[result["methods"][m]["tau"] for m in methods]))
    figs["tau"].update_layout(title="tau: tokens per verify step", template="plotly_white")
    h = go.Figure()
    for m in methods:
        hist = result["methods"][m]["accept_len_hist"]
        tot = sum(hist.values()) or 1
        h.add_trace(go.Bar(x=[int(k) for k in hist], y=[v / tot for v in hist.values()], name=m))
    h.update_layout(title="accepted draft length per step", barmode="group", xaxis_title="accept_len",
                    yaxis_title="fraction of steps", template="plotly_white")
    figs["accept_len"] = h
    return figs


def setup_notebook(static_images: bool | None = None) -> None:
    """Notebook defaults. Plotly figures render as the JupyterLab mimetype (interactive; no plotly.js in
    the notebook file) plus a PNG of the same figure, so an exported copy (nbconvert HTML, a code host,
    JavaScript off) still shows every figure. The PNG is drawn by kaleido in a local Chrome/Chromium, one
    browser for the session; without them (or with static_images=False, or DART_LAB_STATIC_FIGURES=0) the
    figures carry an HTML version that loads plotly.js from its CDN instead, and one line says so.
    Model-loading progress bars are switched off: they are noise in a lesson and a gap in exported HTML."""
    import plotly.io as pio
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    pio.renderers.default = "plotly_mimetype+notebook_connected"
    if static_images is None:
        static_images = os.environ.get("DART_LAB_STATIC_FIGURES", "1") != "0"
    if not static_images:
        return
    why = _start_static_images()
    if why is None:
        import warnings
        # plotly passes its image options on every call; with kaleido's one shared browser they are the defaults
        warnings.filterwarnings("ignore", message="The kopts argument is ignored if using a server")
        pio.renderers.default = "plotly_mimetype+png"
    else:
        print(f"figures are interactive only (no static image for exported copies): {why}")


def _start_static_images() -> str | None:
    """Start kaleido's browser once and draw a test figure; None when that worked, else the reason."""
    import plotly.graph_objects as go

    try:
        import kaleido
    except ImportError:
        return "kaleido is not installed (pip install kaleido)"
    try:
        if hasattr(kaleido, "start_sync_server"):
            kaleido.start_sync_server(silence_warnings=True)  # one browser for every figure of the session
        go.Figure().to_image(format="png", width=10, height=10)
    except Exception as e:  # no Chrome/Chromium, or it would not start: keep the notebook usable
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no browser'}"
    return None


def static_picture(fig, caption: str = "a static picture of the default settings, for exported copies"):
    """The PNG of `fig` folded under a caption (an HTML <details>, no JavaScript needed): widgets vanish from
    an exported notebook, so an interactive cell shows this picture of its default state after the live
    figure. Nothing when static images are off (setup_notebook)."""
    import base64

    import plotly.io as pio
    from IPython.display import HTML, display

    if "png" not in pio.renderers.default:
        return
    data = base64.b64encode(fig.to_image(format="png")).decode()
    display(HTML(f'<details><summary>{caption}</summary><img src="data:image/png;base64,{data}"/></details>'))
