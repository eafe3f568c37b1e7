"""Micro-benchmark of the tree search (Algorithm 1) at the paper's settings on this machine.

    .venv/bin/python experiments/engine/microbench_search.py [--calls 300] [--ngram-max-tokens 0]

Draft logits are random (8 levels x 8,192 draft tokens, N(0, 4^2)), the context a real chat prompt,
the n-gram table the full packaged-ShareGPT one. Prints median / p90 ms per call of the released
algorithm (`search.tree_search`). In real decoding `dart-lab bench` records `search_ms` per step.
"""
import argparse
import json
import statistics
import time

import torch

from dart_lab import load_target
from dart_lab.methods import load_ngram_for
from dart_lab.search import TreeSearchConfig, topk_levels, tree_search


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--ngram-max-tokens", type=int, default=0)
    ap.add_argument("--levels", type=int, default=8)
    args = ap.parse_args()
    target = load_target("smollm2-135m", device="cpu", dtype="fp32")
    ng = load_ngram_for(target, "sharegpt", args.ngram_max_tokens)
    cfg = TreeSearchConfig()
    g = torch.Generator().manual_seed(0)
    ctx = target.encode_prompt("Explain how a hash map works.").tolist()
    times, sizes = [], []
    for i in range(args.calls + 20):
        logits = torch.randn(args.levels, 8192, generator=g) * 4
        logp, toks = topk_levels(logits, cfg.topk)
        t = time.perf_counter()
        tree = tree_search(logp, toks, ctx, ng, cfg, target.eos_ids)
        dt = time.perf_counter() - t
        if i >= 20:
            times.append(dt * 1e3)
            sizes.append(len(tree))
    times.sort()
    print(json.dumps({"calls": args.calls, "levels": args.levels, "config": cfg.__dict__,
                      "ngram": ng.num_ngrams, "median_ms": round(statistics.median(times), 3),
                      "p90_ms": round(times[int(0.9 * len(times))], 3), "mean_tree_nodes": statistics.fmean(sizes)}))


if __name__ == "__main__":
    main()
