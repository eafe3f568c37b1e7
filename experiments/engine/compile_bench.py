"""torch.compile of the fast runner's steps (`FastTarget.compile`), measured on the embedded target in
one process (run it on an idle machine):

1. the compile time of each step shape met (node bucket x key bucket);
2. step times, eager vs compiled, paired: the two variants alternate call by call on the same cache, so
   a slow stretch of the machine hits both; median over the pairs (one-token step and a 5-node verify
   at 150 / 300 / 600 tokens of context);
3. end to end: AR and DART (theta 4, what auto chose eagerly here) over MT-bench prompts, eager and
   compiled (after compiling) in alternation, and the tokens after which compiling has paid for itself.

    .venv/bin/python experiments/engine/compile_bench.py [--prompts 5] [--dtype int4] [--out compile.json]
    .venv/bin/python experiments/engine/compile_bench.py --smoke     # a tiny random Llama: one shape compiled

--smoke: one step shape (one token, one context), AR alone end to end over two random prompts -- compiling
that one shape still takes 10-40 s on 2 cores (the tests run it in the slow tier). main() returns the JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
import tiny  # noqa: E402

from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.generate import GenerationConfig  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import MethodOptions, make_runner  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def step_pairs(t, trees: dict, contexts, pairs: int = 40) -> dict:
    """Median ms per step, eager and compiled, and their paired difference, per (context, nodes)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for P in contexts:
        t.compile = False
        t.prefill(torch.randint(3, min(t.vocab_size, 40000), (P,), generator=g), want_aux=True, all_logits=False)
        ts = {(n, c): [] for n in trees for c in (False, True)}
        for r in range(pairs + 2):  # rounds 0-1 warm up (round 0 compiles)
            for n, tree in trees.items():
                for c in ((False, True) if r % 2 else (True, False)):
                    t.compile = c
                    t0 = time.perf_counter()
                    t.verify(tree, want_aux=True)
                    if r >= 2:
                        ts[(n, c)].append((time.perf_counter() - t0) * 1e3)
                    t.commit([0])
                    t.truncate(P)
        for n in trees:
            e, c = ts[(n, False)], ts[(n, True)]
            out[f"context {P}, {n} nodes"] = {"eager_ms": round(statistics.median(e), 2),
                                              "compiled_ms": round(statistics.median(c), 2),
                                              "compiled_minus_eager_ms": round(statistics.median(y - x for x, y in zip(e, c)), 2)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16 | int4 (4-bit weights compile too)")
    ap.add_argument("--out", default="compile.json", help="'' writes nothing")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a tiny random Llama, one step shape compiled, AR end to end (the tests' mode)")
    args = ap.parse_args(argv)
    t = tiny.tiny_target() if args.smoke else load_target(dtype=args.dtype)
    compiles = []
    t0 = time.perf_counter()
    trees = {1: Tree.single(7)}
    if not args.smoke:
        trees[5] = Tree(torch.tensor([5, 10, 11, 12, 13]), torch.tensor([-1, 0, 0, 1, 1]))
    steps = step_pairs(t, trees, (30,) if args.smoke else (150, 300, 600), pairs=4 if args.smoke else 40)
    compiles.append(("step pairs", round(t.compile_seconds, 1)))
    opts = MethodOptions(tree_nodes="4")
    runners = {m: make_runner(m, t, opts) for m in (("ar",) if args.smoke else ("ar", "dart"))}
    if args.smoke:
        cfg = GenerationConfig(max_new_tokens=4, stop_on_eos=False)
        prompts = tiny.prompts(2, lo=12, hi=12)
    else:
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
        prompts = [t.encode_prompt(p["prompt"]) for p in load_prompts("mt_bench", args.prompts)]
    before = t.compile_seconds
    for c in (False, True):  # warm-up: compiles every shape the prompts reach
        t.compile = c
        for ids in prompts:
            for r in runners.values():
                r.generate(ids, cfg)
    compiles.append(("end-to-end warm-up", round(t.compile_seconds - before, 1)))
    secs = {(m, c): 0.0 for m in runners for c in (False, True)}
    toks = {m: 0 for m in runners}
    for k, ids in enumerate(prompts):
        for c in ((False, True) if k % 2 else (True, False)):
            t.compile = c
            for m, r in runners.items():
                res = r.generate(ids, cfg)
                secs[(m, c)] += res.total_s
                toks[m] += res.new_tokens if not c else 0
    e2e = {}
    for m in runners:
        tps_e, tps_c = toks[m] / secs[(m, False)], toks[m] / secs[(m, True)]
        saved_per_token = 1 / tps_e - 1 / tps_c
        e2e[m] = {"eager_tokens_per_s": round(tps_e, 2), "compiled_tokens_per_s": round(tps_c, 2),
                  "compiled_over_eager": round(tps_c / tps_e, 3),
                  "tokens_to_repay_compile": round(t.compile_seconds / saved_per_token) if saved_per_token > 0 else None}
    res = {"dtype": t.precision, "node_buckets": list(t.node_buckets), "key_bucket": t.key_bucket,
           "shapes_compiled": sorted(t.compiled_shapes), "compile_seconds_total": round(t.compile_seconds, 1),
           "compile_seconds_by_phase": dict(compiles), "steps": steps, "end_to_end": e2e,
           "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "wall_s": round(time.perf_counter() - t0)}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
