"""Markdown tables of an engine benchmark (experiments/engine/engine_bench.sh): speedup over AR (tau) per method
and dataset at T=0 and T=1, the ratios the issues ask for, theta chosen, load and divergences.

    .venv/bin/python experiments/engine/engine_table.py [reproduce/results/<date>_<machine>_engine]
"""
import json
import statistics
import sys
from pathlib import Path

from dart_lab.bench import ratio_interval

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


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "reproduce/results/2026-12-02_epyc-2c_engine-context-priced")
    for temp in ("T0", "T1"):
        runs = load(out, temp)
        if not runs:
            continue
        methods = [m for m in next(iter(runs.values()))["methods"] if m != "ar"]
        print(f"\n### {temp} ({next(iter(runs.values()))['config']['num_prompts']} prompts x 128 tokens per dataset)\n")
        print("\n".join(table(runs, methods)))
        print()
        for line in (ratio(runs, "dart", "hf", "dart over HF generate"), ratio(runs, "ar", "hf", "our AR over HF generate"),
                     ratio(runs, "dart", "eagle3", "dart over eagle3"),
                     ratio(runs, "dart-ctx", ["dart", "pld"], "dart-ctx over the faster of dart and pld "
                           "[95 % bootstrap interval over prompts]", interval=True)):
            if line:
                print(line)
        if any("methods_first_pass" in run for run in runs.values()):
            print(first_pass_line(runs, [m for m in methods if m in ("dart", "dart-ctx", "eagle3", "pld")]))
        share = [f"{SHORT[d]} {run['methods']['dart-ctx']['copy_only_share']:.2f}" for d, run in runs.items()
                 if "copy_only_share" in run["methods"].get("dart-ctx", {})]
        if share:
            print("- dart-ctx steps that verified the copy chain alone (copy-only): " + ", ".join(share))
        load_ = [r["machine_load"] for r in runs.values()]
        print(f"- machine: other processes {min(x['others_cores'] for x in load_):.2f}-"
              f"{max(x['others_cores'] for x in load_):.2f} cores; contended runs: "
              f"{sum(x['contended'] for x in load_)} of {len(load_)}")
        # what the load counters cannot see (a VM's host, memory bandwidth): AR's own step time per prompt
        ar_ms = {d: [p["verify_ms"] for p in run["per_prompt"] if p["method"] == "ar" and p.get("verify_ms")]
                 for d, run in runs.items()}
        print("- AR step ms per prompt, median (min-max): " + ", ".join(
            f"{SHORT[d]} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for d, v in ar_ms.items() if v))
        if temp == "T0":
            div = [(d, m, r.get("divergences", 0), r.get("max_divergence_margin"), r.get("unexplained_divergences", 0))
                   for d, run in runs.items() for m, r in run["methods"].items() if m not in ("ar",)]
            n = sum(x[2] or 0 for x in div)
            worst = max((x[3] for x in div if x[3] is not None), default=None)
            dtypes = ", ".join(sorted({str(run["machine"].get("dtype")) for run in runs.values()}))
            print(f"- divergences from AR ({dtypes}): {n} (method, prompt) pairs, largest AR top-1 minus top-2 margin "
                  f"there {worst if worst is None else round(worst, 3)}; unexplained: {sum(x[4] or 0 for x in div)}")
            r = runs.get("mt_bench") or next(iter(runs.values()))
            b = r["drafters"].get("dart", {}).get("tree_budget")
            if b:
                v = b["verify_ms"]
                one = v.get("1") or v.get(1)
                print("- cost curve (verify ms of N nodes, MT-bench run): " + ", ".join(
                    f"N={k} {float(ms):.1f} ({float(ms) / one:.2f}x)" for k, ms in sorted(v.items(), key=lambda kv: int(kv[0]))
                    if int(k) in (1, 4, 8, 16, 32, 64)))


if __name__ == "__main__":
    main()
