"""The engine benchmark's headline table: every method on the paper's five datasets plus the copy-heavy `copy_edit`
set, at T=0 and T=1, interleaved per prompt (`--run`: one `dart-lab bench` per dataset and temperature, auto dtype,
auto tree budget, 128 new tokens per prompt), then markdown tables of a run's folder: speedup over AR (tau) per
method and dataset, the ratios the issues ask for, theta chosen, load and divergences.

    .venv/bin/python experiments/engine/engine_table.py --run reproduce/results/<date>_<machine>_engine   # bench + TABLE.md
        [--num-prompts 10] [--t1-prompts 10] [--repeats 2] [--methods-t0 ar,dart,dart-ctx,eagle3,pld,hf] [--datasets ...]
    .venv/bin/python experiments/engine/engine_table.py [reproduce/results/<date>_<machine>_engine]      # the tables alone
    .venv/bin/python experiments/engine/engine_table.py --smoke     # the tables of the stored run (no model)

Run the bench on an idle machine: each JSON records the machine's load and marks a contended run (T=0: the ablations
of dart-ctx too unless --methods-t0 leaves them out, ~1/3 shorter). main() returns {"T0": lines, "T1": lines}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root (run by path)
from dart_lab.bench import ratio_interval  # noqa: E402
from dart_lab.smoke import SMOKE  # noqa: E402

# the default folder (README's results table, bf16) and --smoke's: its TABLE.md rows come back
STORED = ROOT / "reproduce" / "results" / "2026-12-02_epyc-2c_engine-context-priced"
DATASETS = "mt_bench,humaneval,gsm8k,code_alpaca,alpaca,copy_edit"
METHODS_T0 = "ar,dart,dart-ctx,dart-ctx-ngram,dart-ctx-copy,dart-ctx-pooled,eagle3,pld,hf"
METHODS_T1 = "ar,dart,dart-ctx,eagle3,pld"

PAPER = ["mt_bench", "humaneval", "gsm8k", "code_alpaca", "alpaca"]
SHORT = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "code_alpaca": "CodeAlpaca",
         "alpaca": "Alpaca", "copy_edit": "copy_edit"}


def load(out: Path, temp: str) -> dict:
    return {f.stem[:-3]: json.loads(f.read_text()) for f in sorted(out.glob(f"*_{temp}.json"))}


def table(runs: dict, methods: list[str]) -> list[str]:
    ds = [d for d in PAPER + ["copy_edit"] if d in runs]
    lines = ["| speedup over AR (tau) | " + " | ".join(SHORT[d] for d in ds) + " | mean of the paper's five | theta |",
             "|---" * (len(ds) + 3) + "|"]
    for m in methods:
        cells, sp = [], []
        thetas = []
        for d in ds:
            r = runs[d]["methods"].get(m)
            if r is None:
                cells.append("-")
                continue
            tau = f" ({r['tau']:.2f})" if r.get("tau") and m not in ("ar", "hf") else ""
            cells.append(f"{r['speedup_vs_ar']:.2f}{tau}")
            if d in PAPER:
                sp.append(r["speedup_vs_ar"])
            if r.get("theta_range"):
                thetas += r["theta_range"]
        mean = f"**{statistics.fmean(sp):.2f}**" if sp else "-"
        th = (f"{min(thetas)}-{max(thetas)}" if min(thetas) != max(thetas) else str(thetas[0])) if thetas else "-"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {mean} | {th} |")
    return lines


def ratio(runs: dict, a: str, b, label: str, interval: bool = False) -> str:
    """tokens/s of a over b (b: a method or a list: the faster of them per dataset); interval: each
    dataset's 95 % bootstrap interval over prompts (`bench.ratio_interval`) in brackets."""
    cells, vals = [], []
    for d in [d for d in PAPER + ["copy_edit"] if d in runs]:
        m = runs[d]["methods"]
        bs = [b] if isinstance(b, str) else b
        if a not in m or not all(x in m for x in bs):
            cells.append("-")
            continue
        v = m[a]["tokens_per_s"] / max(m[x]["tokens_per_s"] for x in bs)
        ci = ratio_interval(runs[d]["per_prompt"], a, bs) if interval else None
        cells.append(f"{SHORT[d]} {v:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
        if d in PAPER:
            vals.append(v)
    if all(c == "-" for c in cells):
        return None
    mean = f"; mean of the five {statistics.fmean(vals):.2f}" if vals else ""
    return f"- {label}: " + ", ".join(c for c in cells if c != "-") + mean


def first_pass_line(runs: dict, methods: list[str]) -> str:
    """The same run without the best-of-repeats selection (bench --repeats): speedup per dataset."""
    reps = next(iter(runs.values()))["config"].get("repeats", 1)
    parts = []
    for m in methods:
        vals = {d: run["methods_first_pass"][m]["speedup_vs_ar"] for d, run in runs.items()
                if m in run.get("methods_first_pass", {})}
        five = [v for d, v in vals.items() if d in PAPER]
        mean = f" (mean of the five {statistics.fmean(five):.2f})" if five else ""
        parts.append(f"{m} " + ", ".join(f"{SHORT[d]} {v:.2f}" for d, v in vals.items()) + mean)
    return f"- each (prompt, method) counted by the fastest of {reps} interleaved passes; the first pass alone: " + "; ".join(parts)


def run_bench(out: Path, args) -> None:
    """One `dart-lab bench` per dataset and temperature into `out` (what engine_bench.sh ran)."""
    from dart_lab.cli import main as dart_lab

    out.mkdir(parents=True, exist_ok=True)
    for temp, methods, n, extra in (("T0", args.methods_t0, args.num_prompts, ["--repeats", str(args.repeats)]),
                                    ("T1", METHODS_T1, args.t1_prompts, ["--temperature", "1.0"])):
        for ds in args.datasets.split(","):
            rc = dart_lab(["bench", "--methods", methods, "--dataset", ds, "--num-prompts", str(n), *extra,
                           "--max-new-tokens", "128", "--out", str(out / f"{ds}_{temp}.json"), "--no-progress"])
            if rc:
                raise SystemExit(f"dart-lab bench {ds} {temp} failed ({rc})")


def render(out: Path) -> dict:
    """{temperature: markdown lines} of the run in `out` (one JSON per dataset and temperature)."""
    tables = {}
    for temp in ("T0", "T1"):
        runs = load(out, temp)
        if not runs:
            continue
        lines = tables[temp] = []
        methods = [m for m in next(iter(runs.values()))["methods"] if m != "ar"]
        lines.append(f"\n### {temp} ({next(iter(runs.values()))['config']['num_prompts']} prompts x 128 tokens per dataset)\n")
        lines.append("\n".join(table(runs, methods)))
        lines.append("")
        for line in (ratio(runs, "dart", "hf", "dart over HF generate"), ratio(runs, "ar", "hf", "our AR over HF generate"),
                     ratio(runs, "dart", "eagle3", "dart over eagle3"),
                     ratio(runs, "dart-ctx", ["dart", "pld"], "dart-ctx over the faster of dart and pld "
                           "[95 % bootstrap interval over prompts]", interval=True)):
            if line:
                lines.append(line)
        if any("methods_first_pass" in run for run in runs.values()):
            lines.append(first_pass_line(runs, [m for m in methods if m in ("dart", "dart-ctx", "eagle3", "pld")]))
        share = [f"{SHORT[d]} {run['methods']['dart-ctx']['copy_only_share']:.2f}" for d, run in runs.items()
                 if "copy_only_share" in run["methods"].get("dart-ctx", {})]
        if share:
            lines.append("- dart-ctx steps that verified the copy chain alone (copy-only): " + ", ".join(share))
        load_ = [r["machine_load"] for r in runs.values()]
        lines.append(f"- machine: other processes {min(x['others_cores'] for x in load_):.2f}-"
              f"{max(x['others_cores'] for x in load_):.2f} cores; contended runs: "
              f"{sum(x['contended'] for x in load_)} of {len(load_)}")
        # what the load counters cannot see (a VM's host, memory bandwidth): AR's own step time per prompt
        ar_ms = {d: [p["verify_ms"] for p in run["per_prompt"] if p["method"] == "ar" and p.get("verify_ms")]
                 for d, run in runs.items()}
        lines.append("- AR step ms per prompt, median (min-max): " + ", ".join(
            f"{SHORT[d]} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for d, v in ar_ms.items() if v))
        if temp == "T0":
            div = [(d, m, r.get("divergences", 0), r.get("max_divergence_margin"), r.get("unexplained_divergences", 0))
                   for d, run in runs.items() for m, r in run["methods"].items() if m not in ("ar",)]
            n = sum(x[2] or 0 for x in div)
            worst = max((x[3] for x in div if x[3] is not None), default=None)
            dtypes = ", ".join(sorted({str(run["machine"].get("dtype")) for run in runs.values()}))
            lines.append(f"- divergences from AR ({dtypes}): {n} (method, prompt) pairs, largest AR top-1 minus top-2 margin "
                  f"there {worst if worst is None else round(worst, 3)}; unexplained: {sum(x[4] or 0 for x in div)}")
            r = runs.get("mt_bench") or next(iter(runs.values()))
            b = r["drafters"].get("dart", {}).get("tree_budget")
            if b:
                v = b["verify_ms"]
                one = v.get("1") or v.get(1)
                lines.append("- cost curve (verify ms of N nodes, MT-bench run): " + ", ".join(
                    f"N={k} {float(ms):.1f} ({float(ms) / one:.2f}x)" for k, ms in sorted(v.items(), key=lambda kv: int(kv[0]))
                    if int(k) in (1, 4, 8, 16, 32, 64)))
    return tables


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="", help=f"a run's folder (default: {STORED.relative_to(ROOT)})")
    ap.add_argument("--run", action="store_true", help="run the bench into OUT first, then write OUT/TABLE.md")
    ap.add_argument("--num-prompts", type=int, default=10, help="T=0 prompts per dataset")
    ap.add_argument("--t1-prompts", type=int, default=10, help="T=1 prompts per dataset")
    ap.add_argument("--repeats", type=int, default=2, help="T=0 passes per (prompt, method), the fastest counts")
    ap.add_argument("--methods-t0", default=METHODS_T0)
    ap.add_argument("--datasets", default=DATASETS)
    ap.add_argument("--smoke", action="store_true", default=SMOKE, help="the stored run's tables (the tests' mode)")
    args = ap.parse_args(argv)
    if args.run and (args.smoke or not args.out):
        ap.error("--run needs the folder to write, and the embedded target (no --smoke)")
    out = Path(args.out) if args.out else STORED
    start = time.time()
    if args.run:
        run_bench(out, args)
    tables = render(out)
    text = "\n".join(line for lines in tables.values() for line in lines)
    print(text)
    if args.run:
        (out / "TABLE.md").write_text(text + "\n")
        print(f"engine bench: {(time.time() - start) / 60:.0f} min")
    return tables


if __name__ == "__main__":
    main()
