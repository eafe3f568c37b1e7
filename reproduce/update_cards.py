"""Append the measured-after-training section to the model cards of the shipped heads
(dart_lab/heads/smollm2-135m/{dart,eagle3}/README.md): held-out alpha / acc / hit@10 / chain tau on
the 64 validation conversations of the feature cache, and the regenerated-answers measurement from
reproduce/results/embedded/regeneration.json (written by reproduce/regen_ablation.sh), and the decoding
tau per dataset from reproduce/results/2026-11-30_epyc-2c_heads-tau60/ (written by reproduce/head_tau_bench.sh).

    python reproduce/update_cards.py --features runs/features
    python reproduce/update_cards.py --decoding-tau-only      (after head_tau_bench.sh; no target needed)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "\n## Measured after training\n"
MARK_TAU = "\n## Decoding tau on the benchmark prompts\n"


def _fmt(xs) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


def regen_section(path: Path) -> str:
    if not path.is_file():
        return "\n### Regenerated answers\nNot measured (run `bash reproduce/regen_ablation.sh`).\n"
    r = json.loads(path.read_text())
    m = r["regeneration"]
    lines = ["", "### Regenerated answers (does training on the target's own answers help?)",
             f"Measured with `{r['command']}`: {m['num']} ShareGPT first turns, answers regenerated greedily by "
             f"the target (<= {m['max_new_tokens']} new tokens); the same conversations with their ShareGPT answers "
             "as the control; 600 steps each; validation on held-out first turns answered by the target.", "",
             "| training answers | acc-1..4 | chain tau | tree tau MT-bench | tree tau GSM8K |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        v = row["validation"]
        lines.append(f"| {row['what']} | {_fmt(v['acc'][:4])} | {v['tau_chain']:.3f} | "
                     f"{row.get('bench_mt_bench', {}).get('tau', '-')} | {row.get('bench_gsm8k', {}).get('tau', '-')} |")
    if r.get("finetune_shipped"):
        lines += ["", "| DART head | chain tau, target-written val | chain tau, ShareGPT val | tree tau MT-bench | "
                  "tree tau GSM8K |", "|---|---|---|---|---|"]
        for f in r["finetune_shipped"]:
            lines.append(f"| {f['what']} | {f['eval_target_written_val']['tau_chain']:.3f} | "
                         f"{f['eval_sharegpt_val']['tau_chain']:.3f} | {f['bench'].get('mt_bench', {}).get('tau', '-')} | "
                         f"{f['bench'].get('gsm8k', {}).get('tau', '-')} |")
    def mean_tau(d):
        t = [v["tau"] for v in d.values()]
        return sum(t) / len(t) if t else float("nan")

    orig, reg = r["rows"]
    b_orig = mean_tau({k: v for k, v in orig.items() if k.startswith("bench_")})
    b_reg = mean_tau({k: v for k, v in reg.items() if k.startswith("bench_")})
    verdict = (f"Mean tree tau: {b_reg:.3f} with regenerated answers vs {b_orig:.3f} with ShareGPT answers "
               f"(chain tau on target-written text {reg['validation']['tau_chain']:.3f} vs {orig['validation']['tau_chain']:.3f}).")
    ft = {f["head"]: mean_tau(f["bench"]) for f in r.get("finetune_shipped", [])}
    if len(ft) == 2:
        verdict += f" Shipped head {ft['shipped']:.3f} vs fine-tuned on regenerated answers {ft['ft']:.3f}."
    lines += ["", "Tree tau: `dart-lab bench --methods ar,dart`, 5 prompts x 64 new tokens, T=0. " + verdict]
    return "\n".join(lines) + "\n"


TAU_RESULTS = ROOT / "reproduce/results/2026-11-30_epyc-2c_heads-tau60"  # the shipped heads' measured run


def tau_section(kind: str, results: Path = TAU_RESULTS) -> str:
    """Decoding tau of the shipped head with the paper's 60-node tree, per dataset (head_tau_bench.sh)."""
    runs = {f.stem.replace("_tau60", ""): json.loads(f.read_text()) for f in sorted(results.glob("*_tau60.json"))}
    rows = [(ds, r["methods"][kind]["tau"], r["config"]["num_prompts"]) for ds, r in runs.items() if kind in r["methods"]]
    if not rows:
        return MARK_TAU + "Not measured (run `bash reproduce/head_tau_bench.sh`).\n"
    with_ar = all("ar" in r["methods"] for r in runs.values())
    lines = [MARK_TAU.lstrip("\n").rstrip(), "", "`bash reproduce/head_tau_bench.sh` (T=0, the paper's 60-node tree, "
             "128 new tokens per prompt, bf16; " + ("where the output left AR it was at a near-tie of AR's own choice):"
                                                   if with_ar else "run without AR: `METHODS=dart,eagle3`):"), "",
             "| dataset | prompts | tau |", "|---|---|---|"]
    lines += [f"| {ds} | {n} | {tau:.2f} |" for ds, tau, n in rows]
    lines.append(f"| mean | | {sum(t for _, t, _ in rows) / len(rows):.2f} |")
    return "\n" + "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", default="runs/features")
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--decoding-tau-only", action="store_true", help="only refresh the decoding-tau section")
    ap.add_argument("--results", default=str(TAU_RESULTS), help="the head_tau_bench.sh run the cards cite")
    args = ap.parse_args()
    if args.decoding_tau_only:
        for kind in ("dart", "eagle3"):
            card = ROOT / f"dart_lab/heads/smollm2-135m/{kind}/README.md"
            card.write_text(card.read_text().split(MARK_TAU)[0] + tau_section(kind, Path(args.results)))
        return 0
    import torch

    from dart_lab import load_target
    from dart_lab.methods import load_head
    from dart_lab.train import evaluate_head

    target = load_target("smollm2-135m", dtype="fp32")
    regen = regen_section(ROOT / "reproduce/results/embedded/regeneration.json")
    for kind in ("dart", "eagle3"):
        head = load_head(target, kind, "", random_heads=False).to(torch.float32)
        ev = evaluate_head(target, head, args.features, kind, args.num)
        card = ROOT / f"dart_lab/heads/smollm2-135m/{kind}/README.md"
        text = card.read_text().split(MARK)[0].split(MARK_TAU)[0]
        note = ("DART levels are predicted from the prefix alone (no earlier draft token is read)."
                if kind == "dart" else
                "EAGLE-3 levels are teacher-forced (step k reads the true earlier tokens), so acc-k is P(level k right | "
                "earlier levels right in the input) and not comparable with DART's acc-k; compare alpha and chain tau.")
        text += (MARK + f"`dart-lab eval-head {kind} --features {args.features} --num {args.num}` "
                 f"({ev['anchors']} anchors in {args.num} held-out ShareGPT conversations, records 17000+):\n\n"
                 f"- acc (top-1 per level) = {_fmt(ev['acc'])}\n- hit@10 per level = {_fmt(ev['hit10'])}\n"
                 f"- alpha (conditional chain acceptance) = {_fmt(ev['alpha'])}\n"
                 f"- simulated greedy chain tau = {ev['tau_chain']:.3f}\n\n{note}\n" + regen + tau_section(kind, Path(args.results)))
        card.write_text(text)
        print(f"{kind}: chain tau {ev['tau_chain']}, acc {ev['acc']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
