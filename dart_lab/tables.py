"""Regenerating the paper's tables for a preset (used by reproduce/run_all.ipynb through papermill).

Every benchmark cell (dataset x temperature) is one `run_bench` call whose JSON is cached under
results_dir/bench/ by the hash of its full config, so a rerun computes only what is missing. Fresh
results go to `local_results_dir` -- keyed by this machine and the package version, outside git --
so `make reproduce` measures on the machine it runs on and leaves the stored reference
(`reproduce/results/<preset>/`, with the machine it came from) untouched.
Tables are written as CSV + Markdown, figures as plotly HTML; the paper's numbers (arXiv 2601.19278,
dart_lab/paper/paper_tables.json) stand beside ours with the ratio ours / paper.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
from pathlib import Path

import torch

from .version import __version__
from .bench import BenchConfig, run_bench
from .measure import cpu_name
from .loading import load_target
from .methods import get_method
from .presets import get_preset

PAPER_TABLES = Path(__file__).resolve().parent / "paper" / "paper_tables.json"  # package data


def paper_tables(path: str | Path | None = None) -> dict:
    p = Path(path) if path else PAPER_TABLES
    return json.loads(p.read_text()) if p.is_file() else {}


def machine_tag() -> str:
    """A short, stable name for this machine + software: cpu model, cores, device, torch, dart_lab."""
    cpu = cpu_name()
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    key = json.dumps([cpu, os.cpu_count(), dev, torch.__version__, __version__])
    name = "".join(c if c.isalnum() else "-" for c in (dev if dev != "cpu" else cpu)).strip("-").lower()[:24]
    return f"{name}-{os.cpu_count()}c-v{__version__}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def local_results_dir(results_dir, preset: str, smoke: bool = False) -> Path:
    """Where this machine's results go: results_dir/local/<preset>[-smoke]/<machine_tag>/."""
    return Path(results_dir) / "local" / (preset + ("-smoke" if smoke else "")) / machine_tag()


def _short(ds: str) -> str:
    return ds[4:] if ds.startswith("hub:") else ds


def run_cells(preset, datasets, methods, num_prompts: int, max_new_tokens: int, temperatures, results_dir,
              target=None, progress: bool = True, dtype: str | None = None, **option_overrides) -> list[dict]:
    """Run (or load from cache) one bench per dataset x temperature. Returns the result dicts.
    preset: a name from presets.PRESETS or a Preset (tests use local stand-ins); dtype: None for the
    preset's."""
    pre = get_preset(preset) if isinstance(preset, str) else preset
    dtype = dtype or pre.dtype
    out_dir = Path(results_dir) / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for ds in datasets:
        for temp in temperatures:
            ms = tuple(m for m in methods if temp == 0 or get_method(m).samples)
            cfg = BenchConfig(methods=ms, dataset=ds, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                              temperature=float(temp), model=pre.model, dtype=dtype,
                              options=pre.options(**option_overrides))
            path = out_dir / f"{_short(ds)}_T{temp}_{cfg.key()}_{num_prompts}.json"
            if path.is_file():
                res = json.loads(path.read_text())
            else:
                if target is None:
                    target = load_target(pre.model, dtype=dtype)
                res = run_bench(cfg, path, target=target, progress=progress)
            res["_file"] = str(path)
            results.append(res)
    return results


def table1(results: list[dict], paper: dict, paper_model: str) -> list[dict]:
    """Speedup and tau per dataset, method and temperature, with the paper's numbers for `paper_model`."""
    rows = []
    ref = {(r["model"], r["method"], r["temperature"]): r for r in paper.get("table1_speedup", [])}
    for res in results:
        ds, temp = _short(res["config"]["dataset"]), res["config"]["temperature"]
        for m, d in res["methods"].items():
            if m == "ar":
                continue
            p = ref.get((paper_model, m, temp))
            ps = p["speedup"].get(ds) if p else None
            rows.append({"dataset": ds, "temperature": temp, "method": m, "speedup": d.get("speedup_vs_ar"),
                         "tau": d.get("tau"), "tokens_per_s": d["tokens_per_s"], "match_ar": d.get("match_ar"),
                         "n_prompts": d["n_prompts"], "paper_model": paper_model if p else None,
                         "paper_speedup": ps, "paper_mean_tau": p["mean_tau"] if p else None,
                         "speedup_ratio_to_paper": (d.get("speedup_vs_ar") / ps) if (ps and d.get("speedup_vs_ar")) else None})
    return rows


def table2(results: list[dict], paper: dict) -> list[dict]:
    """tau with and without the n-gram term (paper Table 2), T = 0 cells."""
    ref = paper.get("table2_ngram_ablation_tau", {})
    rows = []
    for res in results:
        if res["config"]["temperature"] != 0.0:
            continue
        m = res["methods"]
        if "dart" in m and "dart-no-ngram" in m:
            ds = _short(res["config"]["dataset"])
            rows.append({"dataset": ds, "tau_without_ngram": m["dart-no-ngram"]["tau"], "tau_with_ngram": m["dart"]["tau"],
                         "paper_without": ref.get("without_ngram", {}).get(ds), "paper_with": ref.get("with_ngram", {}).get(ds)})
    return rows


def _read_rows(results_dir, name: str) -> list[dict]:
    p = Path(results_dir) / name
    return json.loads(p.read_text())["rows"] if p.is_file() else []


def table3(results_dir, paper: dict) -> list[dict]:
    """Shifted vs unshifted first logit from stored training runs (results_dir/shift_ablation.json,
    written by reproduce/ablations.py): per-level top-1 accuracy and hit@10 of levels 1-3. A preset without
    such a run (the paper presets: a training ablation, not a decoding one) gets the paper's rows, ours blank."""
    ref = paper.get("table3_shifted_logits", {})
    rows = _read_rows(results_dir, "shift_ablation.json") or [  # not trained for this preset: the paper's rows alone
        {"variant": v, "acc": [], "hit10": [], "tau_chain": None} for v in ("unshifted", "shifted") if v in ref]
    return [{"variant": r["variant"], "acc_1_3": r["acc"][:3] or None, "hit10_1_3": r["hit10"][:3] or None,
             "tau_chain": r["tau_chain"], "paper_alpha_1_3": ref.get(r["variant"], {}).get("alpha"),
             "paper_hit10_1_3": ref.get(r["variant"], {}).get("hit_at_10")}
            for r in rows]


def table4(results_dir, paper: dict) -> list[dict]:
    """gamma sweep from stored training runs (results_dir/gamma_sweep.json, written by
    reproduce/ablations.py); the paper's rows alone, ours blank, when not run. acc = per-level top-1 accuracy
    (levels 1-6, the paper's alpha-k), alpha = our conditional chain acceptance."""
    ref = {r["gamma"]: r for r in paper.get("table4_gamma", {}).get("rows", [])}
    rows = []
    ours = _read_rows(results_dir, "gamma_sweep.json") or [  # not trained for this preset: the paper's rows alone
        {"gamma": g, "acc": [], "alpha": [], "tau_chain": None} for g in ref]
    for r in ours:
        pr = ref.get(r["gamma"], {})
        rows.append({"gamma": r["gamma"], "acc_1_6": (r.get("acc") or [])[:6] or None, "alpha_1_6": r["alpha"][:6] or None,
                     "tau_chain": r["tau_chain"], "paper_alpha_1_6": pr.get("alpha"), "paper_tau": pr.get("tau")})
    return rows


def ablation_noise(results_dir) -> str:
    """One line: the run-to-run noise of the stored ablations (gamma 0.6 trained with several seeds;
    gamma_sweep.json "noise"), the yardstick for the differences in Tables 3-4; "" when not run."""
    p = Path(results_dir) / "gamma_sweep.json"
    noise = json.loads(p.read_text()).get("noise") if p.is_file() else None
    if not noise or len(noise["rows"]) < 2:
        return ""
    seeds = ", ".join(f"seed {r['seed']}: acc-1 {r['acc'][0]:.3f}, chain tau {r['tau_chain']:.3f}" for r in noise["rows"])
    return (f"Run-to-run noise (gamma 0.6, {seeds}): spread acc-1 {noise['spread']['acc_1']:.3f}, "
            f"chain tau {noise['spread']['tau_chain']:.3f}. Differences below these are noise.")


def figure1(results: list[dict]):
    """tau vs drafting latency (draft + search ms per step) per method."""
    import plotly.graph_objects as go

    fig = go.Figure()
    pts = {}
    for res in results:
        for m, d in res["methods"].items():
            if d.get("tau") is None or m == "ar":
                continue
            pts.setdefault(m, []).append(((d.get("draft_ms") or 0) + (d.get("search_ms") or 0), d["tau"],
                                          _short(res["config"]["dataset"]) + f" T={res['config']['temperature']}"))
    for m, p in pts.items():
        fig.add_trace(go.Scatter(x=[a for a, _, _ in p], y=[b for _, b, _ in p], text=[c for _, _, c in p], mode="markers",
                                 name=m, marker=dict(size=12)))
    fig.update_layout(title="tau vs drafting latency per step", xaxis_title="draft + search ms per step",
                      yaxis_title="tau (tokens per verify step)", template="plotly_white")
    return fig


def write_table(rows: list[dict], stem: Path) -> None:
    """stem.csv and stem.md."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        stem.with_suffix(".md").write_text("(no rows: not run for this preset)\n")
        return
    cols = list(rows[0])
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}"
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


def summary_markdown(t1: list[dict], preset: str) -> str:
    """Mean speedup / tau per method and temperature over datasets (the last columns of Table 1)."""
    groups = {}
    for r in t1:
        groups.setdefault((r["method"], r["temperature"]), []).append(r)
    lines = [f"Preset `{preset}`: mean over datasets", "", "| method | T | mean speedup | mean tau | paper mean tau |",
             "|---|---|---|---|---|"]
    for (m, t), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        sp = [r["speedup"] for r in rs if r["speedup"] is not None]
        ta = [r["tau"] for r in rs if r["tau"] is not None]
        mean_sp = f"{sum(sp) / len(sp):.2f}" if sp else "-"
        mean_ta = f"{sum(ta) / len(ta):.2f}" if ta else "-"
        pt = rs[0]["paper_mean_tau"]
        lines.append(f"| {m} | {t} | {mean_sp} | {mean_ta} | {'-' if pt is None else pt} |")
    return "\n".join(lines) + "\n"


def run_batch_cell(preset, methods, num_prompts: int, max_new_tokens: int, batch_sizes, results_dir, target=None,
                   progress: bool = True, dtype: str | None = None, **option_overrides) -> dict:
    """Tables 5-7's cell: one bench on the preset's HumanEval at T=0 with every batch size (`--batch-size`),
    methods interleaved per batch; cached by config hash under results_dir/bench/ like `run_cells`."""
    pre = get_preset(preset) if isinstance(preset, str) else preset
    dtype = dtype or pre.dtype
    ds = next((d for d in pre.datasets if _short(d) == "humaneval"), "humaneval")
    cfg = BenchConfig(methods=tuple(methods), dataset=ds, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                      model=pre.model, dtype=dtype, batch_sizes=tuple(batch_sizes),
                      options=pre.options(**option_overrides))
    out_dir = Path(results_dir) / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{_short(ds)}_batch_{cfg.key()}_{num_prompts}.json"
    if path.is_file():
        res = json.loads(path.read_text())
    else:
        res = run_bench(cfg, path, target=target or load_target(pre.model, dtype=dtype), progress=progress)
    res["_file"] = str(path)
    return res


def tables5_7(res: dict, paper: dict) -> list[dict]:
    """Tokens/s by batch size and method (paper Tables 5-7, HumanEval): ours, x our batched AR at that size
    (the paper's "base"), x our batch-1 AR; beside them the paper's tokens/s and x base for Qwen3-4B and
    -8B at the same batch size where the paper has it (its grid starts at 2)."""
    ref = paper.get("tables5_7_batch_humaneval_tokens_per_s", {})
    pb = ref.get("batch", [])
    names = {"ar": "base", "dart": "dart", "eagle3": "eagle3"}
    by = res.get("by_batch") or {str(res["config"]["batch_sizes"][0]): {"methods": res["methods"]}}
    one = (by.get("1") or {}).get("methods", {}).get("ar", {}).get("tokens_per_s")
    rows = []
    for B, block in sorted(by.items(), key=lambda kv: int(kv[0])):
        ms = block["methods"]
        base = ms.get("ar", {}).get("tokens_per_s")
        for m, d in ms.items():
            row = {"batch": int(B), "method": m, "tokens_per_s": d["tokens_per_s"],
                   "x_base": d["tokens_per_s"] / base if base else None,
                   "x_batch1_ar": d["tokens_per_s"] / one if one else None, "tau": d.get("tau"),
                   "theta": "-".join(str(v) for v in sorted(set(d["theta_range"]))) if d.get("theta_range") else None,
                   "match_ar": d.get("match_ar")}
            for model in ("qwen3-4b", "qwen3-8b"):
                p = ref.get(model, {})
                k = names.get(m)
                have = int(B) in pb and k in p
                row[f"paper_{model}_tokens_per_s"] = p[k][pb.index(int(B))] if have else None
                row[f"paper_{model}_x_base"] = p[k][pb.index(int(B))] / p["base"][pb.index(int(B))] if have else None
            rows.append(row)
    return rows


def figure_batch(res: dict, paper: dict):
    """Tokens/s vs batch size, each method over its own base (our batched AR; the paper's base), ours solid,
    the paper's Qwen3-4B / -8B dotted: where the gain of drafting shrinks as the batch fills the hardware."""
    import plotly.graph_objects as go

    fig = go.Figure()
    rows = tables5_7(res, paper)
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["batch"], r["x_base"]) for r in rows if r["method"] == m and r["x_base"] is not None]
        fig.add_trace(go.Scatter(x=[a for a, _ in pts], y=[b for _, b in pts], mode="lines+markers", name=f"ours: {m}"))
    ref = paper.get("tables5_7_batch_humaneval_tokens_per_s", {})
    for model in ("qwen3-4b", "qwen3-8b"):
        p = ref.get(model, {})
        for m in ("dart", "eagle3"):
            if m in p:
                fig.add_trace(go.Scatter(x=ref["batch"], y=[a / b for a, b in zip(p[m], p["base"])], mode="lines",
                                         line=dict(dash="dot"), name=f"paper {model}: {m}"))
    fig.update_layout(title="Throughput over the base at each batch size (HumanEval)", xaxis_title="batch size",
                      yaxis_title="tokens/s / base tokens/s", xaxis_type="log", template="plotly_white")
    return fig
