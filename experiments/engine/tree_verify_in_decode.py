"""What a small tree's verify costs inside decoding, against a one-token step's: the target's `verify` (median
ms) while decoding the same HumanEval prompts as plain AR, as "shadow" (DART drafts every step -- head forward and
search -- but only the root is verified: what drafting does to the next verify), as DART with trees of
`--theta` nodes, and the same without the n-gram term; `--rounds` rounds in turn.

    python experiments/engine/tree_verify_in_decode.py [--theta 2] [--prompts 3] [--rounds 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab.config import GenerationConfig  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.generate import Drafter, generate  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import make_drafter  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


class Shadow(Drafter):
    """DART's drafting every step, the root alone verified (plain AR steps with the drafting between them)."""

    name = "shadow"
    needs_aux = True

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def begin(self, target, ids, aux):
        self.inner.begin(target, ids, aux)

    def propose(self, ids):
        self.inner.propose(ids)
        return Tree.single(ids[-1])

    def observe(self, ids, aux):
        self.inner.observe(ids, aux)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--theta", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    t = load_target()
    d = make_drafter("dart", t)
    prompts = [t.encode_prompt(p["prompt"]) for p in load_prompts("humaneval", args.prompts)]
    times = []
    verify = t.verify

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = verify(*a, **k)
        times.append(time.perf_counter() - t0)
        return out

    d.set_budget(args.theta)
    for drafter in (None, d):  # warm-up: the first answers of a process pay for first calls, not for trees
        generate(t, prompts[0], drafter, GenerationConfig(max_new_tokens=32))
    t.verify = timed
    search = d.search
    sides = {"ar": None, "shadow": Shadow(d), f"dart {args.theta}": d, f"dart {args.theta}, no n-gram": d}
    for _ in range(args.rounds):
        row = {}
        for name, drafter in sides.items():
            times.clear()
            d.set_budget(args.theta)
            if name.endswith("no n-gram"):
                d.search = dataclasses.replace(d.search, w_ngram=0.0)
            for p in prompts:
                generate(t, p, drafter, GenerationConfig(max_new_tokens=96))
            d.search = dataclasses.replace(search, max_nodes=args.theta)
            row[name] = round(statistics.median(times) * 1e3, 2)
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
