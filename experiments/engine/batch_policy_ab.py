"""Which batch-policy setting decodes a batch faster? Runners of one target alternate per group of prompts
(order rotated each group), each side a method with optional `BudgetConfig` fields set on its controller
(`dart:batch_resume_gain=1.0`); tokens/s over all groups, and x the first side.

    python experiments/engine/batch_policy_ab.py --rows 8 --prompts 16 --rounds 2 \\
        --sides ar dart dart:batch_resume_gain=1.0
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab.config import GenerationConfig  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import make_runner  # noqa: E402


def side(target, spec: str):
    method, _, sets = spec.partition(":")
    runner = make_runner(method, target)
    if sets:
        fields = {k: float(v) for k, v in (kv.split("=") for kv in sets.split(","))}
        runner.controller.cfg = dataclasses.replace(runner.controller.cfg, **fields)
    return runner


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sides", nargs="+", default=["ar", "dart", "dart-ctx"])
    args = ap.parse_args(argv)
    target = load_target("smollm2-135m", dtype=args.dtype)
    prompts = [target.encode_prompt(p["prompt"]) for p in load_prompts("humaneval", args.prompts)]
    groups = [prompts[i:i + args.rows] for i in range(0, len(prompts), args.rows)]
    runners = {s: side(target, s) for s in args.sides}
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    runners[args.sides[0]].generate_batch(groups[0], cfg)  # warm-up (the calibrations, the batch curves)
    tokens, secs, k = {s: 0 for s in args.sides}, {s: 0.0 for s in args.sides}, 0
    for _ in range(args.rounds):
        for g in groups:
            order = args.sides[k % len(args.sides):] + args.sides[:k % len(args.sides)]
            k += 1
            for s in order:
                res = runners[s].generate_batch(g, cfg)
                tokens[s] += sum(len(r.tokens) for r in res.rows)
                secs[s] += res.wall_s
    base = tokens[args.sides[0]] / secs[args.sides[0]]
    for s in args.sides:
        print(f"{s}: {tokens[s] / secs[s]:.1f} tok/s ({tokens[s] / secs[s] / base:.3f}x {args.sides[0]})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
