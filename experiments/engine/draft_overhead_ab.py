"""What the compiled tree search and the draft head's 8-bit linears on `q8mm` buy a DART step: DART decodes the
same HumanEval prompts at fixed budgets (greedy, 128 new tokens) with each side, alternating in one process:
"numpy + halves" = the search's numpy loop and numpy tree cut (`kernels.turned_off("search")`) and the head's
8-bit grid as two 4-bit halves on `q4mm`; "compiled + q8mm" = the package as it is. Median draft / search /
verify ms per step (first step of each answer left out: it feeds the prompt to the head) and decode tok/s; first
the head's forward alone on each side's linears (`budget.head_forward_ms`, 1 and 4 rows drafting together).

    python experiments/engine/draft_overhead_ab.py [--thetas 2,4,8] [--prompts 4] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab import budget, kernels, q4  # noqa: E402
from dart_lab.config import GenerationConfig  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.drafters import DartDrafter, dense_linears, linears_in_8bit  # noqa: E402
from dart_lab.fast_llama import Int4Linear  # noqa: E402
from dart_lab.generate import generate  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import make_drafter  # noqa: E402

Q8MM = q4.q8_linear


def halves(*mods):
    """The same 8-bit grid as `q4.q8_linear` rounds, run as two 4-bit halves on q4mm."""
    q, d, bias = q4.int8_grid(*mods)
    return q4.Q4Linear.of_groups(Int4Linear.halves_of(q, d), bias, halves=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--thetas", default="2,4,8")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    t = load_target()
    d = make_drafter("dart", t)
    if not getattr(d.head, "linears_8bit", False):
        print("the head did not take its 8-bit linears here:", getattr(d.head, "chosen_dtype", None))
        return 1
    prompts = [t.encode_prompt(p["prompt"]) for p in load_prompts("humaneval", args.prompts)]
    cfg = GenerationConfig(max_new_tokens=128)
    sides = ("numpy + halves", "compiled + q8mm")

    def use(side: str) -> None:
        dense_linears(d.head)
        q4.q8_linear = Q8MM if side == sides[1] else halves
        assert linears_in_8bit(d.head)
        q4.q8_linear = Q8MM

    print("| head forward | rows | ms |\n|---|---|---|")
    for rows in (1, 4):
        ms = {s: [] for s in sides}
        for r in range(2 * args.rounds - 1):
            for s in (sides if r % 2 == 0 else sides[::-1]):
                use(s)
                ms[s].append(budget.head_forward_ms(lambda: DartDrafter(d.head, None), t, rows, 7))
        for s in sides:
            print(f"| {s} | {rows} | {statistics.median(ms[s]):.3f} |", flush=True)

    def run(side: str, theta: int) -> dict:
        use(side)
        d.set_budget(theta)
        stats = {"draft_ms": [], "search_ms": [], "verify_ms": [], "tokens": 0, "decode_s": 0.0}
        with kernels.turned_off(*(["search"] if side == sides[0] else [])):
            for p in prompts:
                res = generate(t, p, d, cfg)
                for k in ("draft_ms", "search_ms", "verify_ms"):
                    stats[k] += [s[k] for s in res.steps[1:]]
                stats["tokens"] += len(res.tokens)
                stats["decode_s"] += res.decode_s
        return stats

    print("| theta | side | draft ms | search ms | verify ms | decode tok/s |\n|---|---|---|---|---|---|")
    for theta in (int(x) for x in args.thetas.split(",")):
        got = {s: [] for s in sides}
        for r in range(args.rounds):
            for s in (sides if r % 2 == 0 else sides[::-1]):
                got[s].append(run(s, theta))
        for s in sides:
            med = {k: statistics.median(x for st in got[s] for x in st[k]) for k in ("draft_ms", "search_ms", "verify_ms")}
            tps = statistics.median(st["tokens"] / st["decode_s"] for st in got[s])
            print(f"| {theta} | {s} | {med['draft_ms']:.2f} | {med['search_ms']:.2f} | {med['verify_ms']:.2f} | {tps:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
