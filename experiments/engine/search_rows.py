"""How long the tree search of a batch step takes for R rows: each row's own `tree_search` one after the
other (what a batch step ran before) against one `tree_search_batch` for all rows (what it runs now; the
same trees, tests/test_search.py). Random head logits over the draft vocabulary, the embedded n-gram table
(ShareGPT) and random contexts; the released budget (60 nodes) and a CPU-sized one (8).

    python experiments/engine/search_rows.py [--rows 1,8,64] [--repeats 20]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import load_ngram_for  # noqa: E402
from dart_lab.search import TreeSearchConfig, topk_levels, tree_search, tree_search_batch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    target = load_target("smollm2-135m", dtype="fp32")
    ng = load_ngram_for(target, "sharegpt")
    g = torch.Generator().manual_seed(0)
    out = {}
    for nodes in (60, 8):
        cfg = TreeSearchConfig(max_nodes=nodes)
        for R in (int(r) for r in args.rows.split(",")):
            logits = torch.randn(R, 8, 8192, generator=g) * 3
            logp, toks = topk_levels(logits, cfg.topk)
            ctx = [torch.randint(3, 8000, (200,), generator=g).tolist() for _ in range(R)]
            times = {"per_row": [], "batched": []}
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for r in range(R):
                    tree_search(logp[r], toks[r], ctx[r], ng, cfg, target.eos_ids)
                t1 = time.perf_counter()
                tree_search_batch(logp, toks, ctx, ng, cfg, target.eos_ids)
                t2 = time.perf_counter()
                times["per_row"].append((t1 - t0) * 1e3)
                times["batched"].append((t2 - t1) * 1e3)
            row = {k: round(statistics.median(v), 2) for k, v in times.items()}
            out[f"{nodes} nodes, {R} rows"] = row
            print(json.dumps({"nodes": nodes, "rows": R, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
