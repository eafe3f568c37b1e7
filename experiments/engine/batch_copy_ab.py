"""Does dart-ctx lose to AR at B rows through its copies or through its bookkeeping? AR, dart-ctx, and dart-ctx
with every theta-0 copy cut to none (`budget.copy_cap` -> 0 in the batch loop: its lookups and scoring still run)
decode the same groups of B HumanEval prompts (`Runner.generate_batch`, 128 new tokens), the three alternating per
group, `--rounds` times; tok/s over all, each group's tok/s against AR's on it (median, range), and the verify
share of the wall (the rest: prefill, drafting, accept).

    python experiments/engine/batch_copy_ab.py [--rows 8] [--prompts 16] [--rounds 4]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab import batch  # noqa: E402
from dart_lab.config import GenerationConfig  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import make_runner  # noqa: E402

NAMES = ("ar", "dart-ctx", "dart-ctx without copies")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    t = load_target()
    prompts = [t.encode_prompt(p["prompt"]) for p in load_prompts("humaneval", args.prompts)]
    groups = [prompts[i:i + args.rows] for i in range(0, len(prompts), args.rows)]
    cfg = GenerationConfig(max_new_tokens=128)
    runners = {"ar": make_runner("ar", t), "dart-ctx": make_runner("dart-ctx", t)}
    copy_cap = batch.copy_cap

    def run(name, group):
        batch.copy_cap = (lambda offers, curve: 0) if name.endswith("without copies") else copy_cap
        try:
            res = runners[name.split(" ")[0]].generate_batch(group, cfg)
        finally:
            batch.copy_cap = copy_cap
        return res.new_tokens, res.wall_s, sum(s["verify_ms"] for s in res.steps) / 1e3

    for n in NAMES:  # warm-up: calibrations, batch curves
        run(n, groups[0])
    tot = {n: [0, 0.0, 0.0] for n in NAMES}
    rel = {n: [] for n in NAMES}
    k = 0
    for _ in range(args.rounds):
        for group in groups:
            order = NAMES[k % 3:] + NAMES[:k % 3]
            k += 1
            got = {n: run(n, group) for n in order}
            for n in NAMES:
                tot[n] = [a + b for a, b in zip(tot[n], got[n])]
                rel[n].append((got[n][0] / got[n][1]) / (got["ar"][0] / got["ar"][1]))
    for n in NAMES:
        print(f"{n}: {tot[n][0] / tot[n][1]:.1f} tok/s, verify share {tot[n][2] / tot[n][1]:.2f}, x ar per group "
              f"median {statistics.median(rel[n]):.3f} range {min(rel[n]):.3f}-{max(rel[n]):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
