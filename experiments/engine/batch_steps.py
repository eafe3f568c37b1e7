"""Where does a batch's time go, per method and per step shape? Each method decodes the same groups of B
HumanEval prompts (`Runner.generate_batch`, after a warm-up group); its steps are grouped by shape (live rows,
widest tree) with their median propose / verify / accept ms (`BatchResult.steps`: propose = drafting and the
copy lookups, verify = the target's forward, accept = acceptance, compaction and each row's bookkeeping) and
the tokens they emitted per ms -- whether a shape pays against the plain steps of the same rows.

    python experiments/engine/batch_steps.py [--rows 8] [--prompts 16] [--methods ar,dart,dart-ctx]
    python experiments/engine/batch_steps.py --smoke     # a tiny random target, random heads, theta 4, seconds

main() returns {method: {"tokens_per_s", "shapes": {"<rows> x <widest>": {steps, propose_ms, verify_ms, accept_ms,
tokens_per_step, tokens_per_ms}}}}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (run by path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
import tiny  # noqa: E402

from dart_lab.config import GenerationConfig  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import MethodOptions, make_runner  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="ar,dart,dart-ctx")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a tiny random target, random heads at theta 4, 4 prompts in rows of 2, 6 tokens (the tests' mode)")
    args = ap.parse_args(argv)
    if args.smoke:
        target, opts, cache = tiny.tiny_target(), MethodOptions(random_heads=True, tree_nodes="4"), {"ngram": tiny.ngram()}
        prompts, args.rows = tiny.prompts(4), 2
        cfg = GenerationConfig(max_new_tokens=6, stop_on_eos=False)
    else:
        target, opts, cache = load_target("smollm2-135m", dtype=args.dtype), MethodOptions(), {}
        prompts = [target.encode_prompt(p["prompt"]) for p in load_prompts("humaneval", args.prompts)]
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    groups = [prompts[i:i + args.rows] for i in range(0, len(prompts), args.rows)]
    methods = args.methods.split(",")
    runners = {m: make_runner(m, target, opts, cache) for m in methods}
    for m in methods:  # warm-up: the calibrations and the batch curves
        runners[m].generate_batch(groups[0], cfg)
    shapes = {m: defaultdict(list) for m in methods}  # (rows, widest) -> [(propose, verify, accept, tokens)]
    totals = {m: [0, 0.0] for m in methods}
    for k, group in enumerate(groups):
        for m in methods[k % len(methods):] + methods[:k % len(methods)]:
            res = runners[m].generate_batch(group, cfg)
            totals[m][0] += res.new_tokens
            totals[m][1] += res.wall_s
            for i, s in enumerate(res.steps):
                tokens = sum(1 + r.steps[i]["accept_len"] for r in res.rows if i < len(r.steps))
                shapes[m][(s["rows"], s["max_tree"])].append((s["propose_ms"], s["verify_ms"], s["accept_ms"], tokens))
    out = {}
    for m in methods:
        out[m] = {"tokens_per_s": totals[m][0] / totals[m][1], "shapes": {}}
        print(f"{m}: {out[m]['tokens_per_s']:.1f} tok/s over {len(groups)} groups of {args.rows}")
        print("  rows widest  steps  propose   verify   accept  tokens/step  tokens/ms")
        for (rows, widest), v in sorted(shapes[m].items()):
            med = [statistics.median(x[j] for x in v) for j in range(3)]
            toks = sum(x[3] for x in v)
            ms = sum(x[0] + x[1] + x[2] for x in v)
            out[m]["shapes"][f"{rows} x {widest}"] = {"steps": len(v), "propose_ms": med[0], "verify_ms": med[1],
                                                      "accept_ms": med[2], "tokens_per_step": toks / len(v),
                                                      "tokens_per_ms": toks / ms}
            print(f"  {rows:4d} {widest:6d} {len(v):6d} {med[0]:8.2f} {med[1]:8.2f} {med[2]:8.2f} {toks / len(v):12.2f}"
                  f" {toks / ms:10.3f}")
    return out


if __name__ == "__main__":
    main()
