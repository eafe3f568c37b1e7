"""Drafting + search time per decode step as a function of the tree budget theta, inside the real
decode loop (the target's forward between drafts evicts the head's weights, so isolated timings are
too low). Two calibration prompts x 48 new tokens per theta, T=0, median over steps (first step
left out: it feeds the whole prompt to the head). Run it on an idle machine:

    python experiments/engine/draft_cost_by_theta.py dart eagle3
    python experiments/engine/draft_cost_by_theta.py --smoke dart eagle3   # tiny random target and heads, seconds

Prints a markdown table; main() returns {method: {theta: {draft_ms, search_ms, verify_ms}}}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
import tiny  # noqa: E402

from dart_lab.budget import CALIBRATION_PROMPTS  # noqa: E402
from dart_lab.generate import GenerationConfig, generate  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import MethodOptions, make_drafter  # noqa: E402

THETAS = (1, 2, 4, 8, 16, 32, 63)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("methods", nargs="*", default=["dart"], help="dart, eagle3, dart-ctx, ...")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a tiny random target and random heads, theta 1 and 4, 8 tokens (the tests' mode)")
    args = ap.parse_args(argv)
    if not args.smoke:  # (the smallest mode leaves the process's threads as they are: the tests run it in theirs)
        torch.set_num_threads(2)
    if args.smoke:
        t, thetas = tiny.tiny_target(), (1, 4)
        opts, cache = MethodOptions(random_heads=True, tree_nodes="4"), {"ngram": tiny.ngram()}
        prompts, cfg = tiny.prompts(2), GenerationConfig(max_new_tokens=8, stop_on_eos=False)
    else:
        t, thetas = load_target(), THETAS
        opts, cache = MethodOptions(), {}
        prompts, cfg = [t.encode_prompt(text) for text in CALIBRATION_PROMPTS[:2]], GenerationConfig(max_new_tokens=48)
    out: dict = {}
    print("| method | theta | draft ms | search ms | verify ms |\n|---|---|---|---|---|")
    for name in args.methods:
        d = make_drafter(name, t, opts, cache)
        for th in thetas:
            d.set_budget(th)
            dr, se, ve = [], [], []
            for ids in prompts:
                res = generate(t, ids, d, cfg)
                st = [s for s in res.steps if "draft_ms" in s][1:]
                dr += [s["draft_ms"] for s in st]
                se += [s["search_ms"] for s in st]
                ve += [s["verify_ms"] for s in st]
            row = {"draft_ms": statistics.median(dr), "search_ms": statistics.median(se),
                   "verify_ms": statistics.median(ve)}
            out.setdefault(name, {})[th] = row
            print(f"| {name} | {th} | {row['draft_ms']:.2f} | {row['search_ms']:.2f} | {row['verify_ms']:.2f} |",
                  flush=True)
    return out


if __name__ == "__main__":
    main()
