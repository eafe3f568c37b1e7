"""How often is a prompt-lookup copy right, by the length of the suffix match that found it?
(dart-ctx keeps its copy probability per match length: dart_ctx.ContextConfig.copy_match_buckets.)

For each dataset: the target's greedy answers (T=0, AR), then at every answer position the copy that
`drafters.copy_match` proposes from the text so far (longest suffix match up to --max-ngram tokens,
most recent occurrence) against what the target really wrote next: the share of copies whose first
token is right, the mean number of leading tokens right, and how often a later copy token is right
given the one before it was (a copy's acceptance by depth: dart-ctx prices copy tokens with one rate p,
p^i for the i-th), per match length (1, 2, 3, 4+).

    python experiments/dart_ctx/copy_match_stats.py --datasets mt_bench,copy_edit --num-prompts 10
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from dart_lab import GenerationConfig, generate, load_target
from dart_lab.data import load_prompts
from dart_lab.drafters import copy_match


def stats(prompt: list[int], answer: list[int], max_ngram: int, length: int, buckets: int, out: dict) -> None:
    full = prompt + answer
    for i in range(len(prompt), len(full) - 1):
        chain, n = copy_match(full[:i + 1], max_ngram, length)
        key = min(n, buckets) if chain else 0
        kept = 0
        for c, t in zip(chain, full[i + 1:]):
            if c != t:
                break
            kept += 1
        row = out[key]
        row[0] += 1
        row[1] += kept > 0
        row[2] += kept
        row[3] += min(kept, len(chain) - 1) if chain else 0  # later tokens tried: each after a kept one
        row[4] += max(kept - 1, 0)  # ... and kept


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", default="mt_bench,copy_edit")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-ngram", type=int, default=8)
    ap.add_argument("--copy-len", type=int, default=16)
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", help="the engine benchmark's dtype here (auto = bf16)")
    ap.add_argument("--out", default="")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    target = load_target("smollm2-135m", dtype=args.dtype)
    result = {"command": " ".join(["python experiments/dart_ctx/copy_match_stats.py", *argv]), "args": vars(args), "datasets": {}}
    for ds in args.datasets.split(","):
        out = defaultdict(lambda: [0, 0, 0, 0, 0])
        for r in load_prompts(ds, args.num_prompts):
            ids = target.encode_prompt(r["prompt"])
            res = generate(target, ids, None, GenerationConfig(max_new_tokens=args.max_new_tokens))
            stats(ids.tolist(), res.tokens, args.max_ngram, args.copy_len, args.buckets, out)
        rows = {("none" if k == 0 else f"{k}+" if k == args.buckets else str(k)):
                {"positions": c, "first_kept": round(f / c, 3), "mean_kept": round(m / c, 2),
                 "later_kept": round(lk / lt, 3) if lt else None}
                for k, (c, f, m, lt, lk) in sorted(out.items()) if c}
        result["datasets"][ds] = rows
        print(ds)
        for k, v in rows.items():
            print(f"  match {k:>4}: {v['positions']:4d} positions, first copy token right {v['first_kept']:.2f}, "
                  f"leading tokens right {v['mean_kept']:.2f}, a later token right after a right one "
                  f"{v['later_kept'] if v['later_kept'] is not None else '-'}")
    if args.out:
        from dart_lab.atomic import write_json
        write_json(args.out, result)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
