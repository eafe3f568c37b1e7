"""Which tree builder accepts most from one DART head at each budget theta (builders.py): the released search, DDTree's
best-first, best-first with the released n-gram, a chain. Per dataset and temperature, each builder decodes the
prompts once at the widest budget (60) and tau(theta) for theta in THETAS is read from the accepted nodes' ranks, as
the tree budget reads it (`cost.acceptance_profile`: the tree of theta nodes is a builder's first theta ranks; at T=0
that is exact, at T=1 it is the budget's own estimate); each builder's build cost is its median search ms a step.

    python experiments/engine/tree_builders.py [--num-prompts 3] [--max-new-tokens 64] [--dtype auto] [--out DIR]
    python experiments/engine/tree_builders.py --smoke          # a tiny random target and head, seconds

Returns {"T0"|"T1": {dataset: {builder: {"tau": {theta: tau}, "search_ms": ms, "match_ar": bool}}}}; with --out it
writes DIR/tree_builders.json and DIR/TABLE.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
import tiny  # noqa: E402

from dart_lab.builders import BUILDERS  # noqa: E402
from dart_lab.config import GenerationConfig  # noqa: E402
from dart_lab.cost import acceptance_profile  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.drafters import DartDrafter  # noqa: E402
from dart_lab.generate import generate  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import MethodOptions, make_drafter  # noqa: E402
from dart_lab.search import TreeSearchConfig  # noqa: E402

THETAS = (1, 2, 4, 8, 16, 32, 60)
DATASETS = ("mt_bench", "humaneval", "gsm8k", "code_alpaca", "alpaca")


def measure(target, head, ngram, prompts, cfg: GenerationConfig, widest: int = 60) -> dict:
    """Per builder: tau(theta) over `prompts` (each decoded once at `widest`), median search ms, and whether
    every decode equals AR (T=0)."""
    out = {}
    ar = [generate(target, p, None, cfg).tokens for p in prompts] if cfg.greedy else None
    for name in BUILDERS:
        steps, same = [], True
        for i, p in enumerate(prompts):
            d = DartDrafter(head, ngram, TreeSearchConfig(max_nodes=widest, builder=name))
            res = generate(target, p, d, cfg)
            steps += res.steps[1:]  # the first step feeds the whole prompt to the head
            same &= ar is None or res.tokens == ar[i]
        tau = acceptance_profile(steps, widest)
        out[name] = {"tau": {th: round(tau[th], 3) for th in THETAS if th <= widest},
                     "search_ms": round(statistics.median(s["search_ms"] for s in steps), 3) if steps else 0.0,
                     "steps": len(steps), **({"match_ar": same} if ar is not None else {})}
    return out


def table(res: dict) -> str:
    lines = []
    for temp, by_ds in res.items():
        thetas = list(next(iter(by_ds.values()))[BUILDERS[0]]["tau"])
        lines += [f"### {temp}: tau(theta) per builder (mean over the datasets), build ms a step", "",
                  "| builder | " + " | ".join(f"theta {th}" for th in thetas) + " | search ms |",
                  "|---|" + "---|" * (len(thetas) + 1)]
        for name in BUILDERS:
            rows = [by_ds[ds][name] for ds in by_ds]
            taus = [statistics.fmean(r["tau"][th] for r in rows) for th in thetas]
            ms = statistics.fmean(r["search_ms"] for r in rows)
            lines.append(f"| {name} | " + " | ".join(f"{t:.3f}" for t in taus) + f" | {ms:.2f} |")
        lines += [""]
        for ds, by_b in by_ds.items():
            lines += [f"{temp} {ds}: " + "; ".join(f"{b} " + "/".join(f"{v:.2f}" for v in r["tau"].values())
                                                   for b, r in by_b.items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--dtype", default="auto", help="the target's arithmetic (fp32: decodes exactly AR's)")
    ap.add_argument("--widest", type=int, default=60, help="the budget each builder decodes at (tau for theta up to it)")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a tiny random target, a random head and n-gram, 2 prompts x 12 tokens (the tests' mode)")
    args = ap.parse_args(argv)
    if args.smoke:
        from dart_lab.methods import random_head

        target = tiny.tiny_target()
        head, ngram = random_head(target, "dart"), tiny.ngram()
        sets = {"random": tiny.prompts(2)}
        tokens, widest = 12, 16
    else:
        torch.set_num_threads(2)
        # the arithmetic `dtype` (auto: the fastest here); in fp32 every builder's decode equals AR's (tests/test_builders.py),
        # in another a decode may part from AR's at a near-tie (`match_ar` says where)
        target = load_target("smollm2-135m", dtype=args.dtype)
        d = make_drafter("dart", target, MethodOptions(tree_nodes="60"))
        head, ngram = d.head, d.ngram
        sets = {ds: [target.encode_prompt(p["prompt"]) for p in load_prompts(ds, args.num_prompts)]
                for ds in args.datasets.split(",")}
        tokens, widest = args.max_new_tokens, args.widest
    res = {}
    for t in (float(x) for x in args.temperatures.split(",")):
        cfg = GenerationConfig(max_new_tokens=tokens, temperature=t, stop_on_eos=not args.smoke)
        res[f"T{t:g}"] = {}
        for ds, prompts in sets.items():
            res[f"T{t:g}"][ds] = measure(target, head, ngram, prompts, cfg, widest)
            print(json.dumps({"T": t, "dataset": ds, **res[f"T{t:g}"][ds]}), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tree_builders.json").write_text(json.dumps({"args": vars(args), "result": res}, indent=1))
        (out / "TABLE.md").write_text(table(res) + "\n")
    print(table(res))
    return res


if __name__ == "__main__":
    main()
