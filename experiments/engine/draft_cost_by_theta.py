"""Drafting + search time per decode step as a function of the tree budget theta, inside the real
decode loop (the target's forward between drafts evicts the head's weights, so isolated timings are
too low). Two calibration prompts x 48 new tokens per theta, T=0, median over steps (first step
left out: it feeds the whole prompt to the head). Run it on an idle machine:

    python experiments/engine/draft_cost_by_theta.py dart eagle3
"""
from __future__ import annotations

import statistics
import sys

import torch

from dart_lab.budget import CALIBRATION_PROMPTS
from dart_lab.generate import GenerationConfig, generate
from dart_lab.loading import load_target
from dart_lab.methods import make_drafter

THETAS = (1, 2, 4, 8, 16, 32, 63)


def main(names: list[str]) -> None:
    t = load_target()
    torch.set_num_threads(2)
    print("| method | theta | draft ms | search ms | verify ms |\n|---|---|---|---|---|")
    for name in names or ["dart"]:
        d = make_drafter(name, t)
        for th in THETAS:
            d.set_budget(th)
            dr, se, ve = [], [], []
            for text in CALIBRATION_PROMPTS[:2]:
                res = generate(t, t.encode_prompt(text), d, GenerationConfig(max_new_tokens=48))
                st = [s for s in res.steps if "draft_ms" in s][1:]
                dr += [s["draft_ms"] for s in st]
                se += [s["search_ms"] for s in st]
                ve += [s["verify_ms"] for s in st]
            print(f"| {name} | {th} | {statistics.median(dr):.2f} | {statistics.median(se):.2f} | "
                  f"{statistics.median(ve):.2f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
