"""What the tree search (Algorithm 1) costs on this machine: one call at the paper's settings, and a batch
step's search for R rows.

    .venv/bin/python experiments/engine/microbench_search.py [--calls 300] [--ngram-max-tokens 0] [--rows 1,8,64]
    .venv/bin/python experiments/engine/microbench_search.py --smoke     # a random n-gram table, a few seconds

1. one call: draft logits random (8 levels x 8,192 draft tokens, N(0, 4^2)), the context a real chat prompt,
   the n-gram table the full packaged-ShareGPT one; median / p90 ms per call of the released algorithm
   (`search.tree_search`). In real decoding `dart-lab bench` records `search_ms` per step.
2. rows (`--rows`): each row's own `tree_search` one after the other against one `tree_search_batch` for all rows
   (what a batch step runs on a CPU; the same trees, tests/test_search.py) and against the search as batched
   tensor ops (`engine.on_device.search_batch`, what it runs on a GPU; the same trees, tests/test_on_device.py)
   on `--device`, random head logits, the same n-gram table and random 200-token contexts, at the released
   budget (60 nodes) and a CPU-sized one (8). `--rows ''` leaves it out.
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

from dart_lab import load_target  # noqa: E402
from dart_lab.methods import load_ngram_for  # noqa: E402
from dart_lab.engine.on_device import DeviceNGram, search_batch, trees  # noqa: E402
from dart_lab.search import TreeSearchConfig, topk_levels, tree_search, tree_search_batch  # noqa: E402


def one_call(ng, ctx: list[int], eos, calls: int, levels: int, vocab: int, warmup: int = 20) -> dict:
    cfg = TreeSearchConfig()
    g = torch.Generator().manual_seed(0)
    times, sizes = [], []
    for i in range(calls + warmup):
        logits = torch.randn(levels, vocab, generator=g) * 4
        logp, toks = topk_levels(logits, cfg.topk)
        t = time.perf_counter()
        tree = tree_search(logp, toks, ctx, ng, cfg, eos)
        dt = time.perf_counter() - t
        if i >= warmup:
            times.append(dt * 1e3)
            sizes.append(len(tree))
    times.sort()
    return {"calls": calls, "levels": levels, "config": cfg.__dict__, "ngram": ng.num_ngrams,
            "median_ms": round(statistics.median(times), 3), "p90_ms": round(times[int(0.9 * len(times))], 3),
            "mean_tree_nodes": statistics.fmean(sizes)}


def by_rows(ng, eos, rows: list[int], repeats: int, vocab: int, context: int = 200, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    dev_ng = DeviceNGram(ng, device)
    for nodes in (60, 8):
        cfg = TreeSearchConfig(max_nodes=nodes)
        for R in rows:
            logits = torch.randn(R, 8, vocab, generator=g) * 3
            logp, toks = topk_levels(logits, cfg.topk)
            ctx = [torch.randint(3, vocab - 1, (context,), generator=g).tolist() for _ in range(R)]
            lp, tk = torch.from_numpy(logp).to(device), torch.from_numpy(toks).to(device)
            last2 = torch.tensor([c[-2:] for c in ctx], device=device)
            times = {"per_row": [], "batched": [], "on_device": []}
            for _ in range(repeats):
                t0 = time.perf_counter()
                for r in range(R):
                    tree_search(logp[r], toks[r], ctx[r], ng, cfg, eos)
                t1 = time.perf_counter()
                want = tree_search_batch(logp, toks, ctx, ng, cfg, eos)
                t2 = time.perf_counter()
                got = trees(search_batch(lp, tk, last2, dev_ng, cfg, eos))  # the trees on the host: one copy
                t3 = time.perf_counter()
                times["per_row"].append((t1 - t0) * 1e3)
                times["batched"].append((t2 - t1) * 1e3)
                times["on_device"].append((t3 - t2) * 1e3)
            row = {k: round(statistics.median(v), 3) for k, v in times.items()}
            row["same_trees"] = all(torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
                                    for a, b in zip(want, got))
            out[f"{nodes} nodes, {R} rows"] = row
            print(json.dumps({"nodes": nodes, "rows": R, **row}), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--ngram-max-tokens", type=int, default=0)
    ap.add_argument("--levels", type=int, default=8)
    ap.add_argument("--rows", default="1,8,64", help="row counts of part 2, comma-separated ('' leaves it out)")
    ap.add_argument("--repeats", type=int, default=20, help="part 2's rounds per row count")
    ap.add_argument("--device", default="cpu", help="where part 2's tensor search runs (cpu, cuda)")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a random n-gram table over 1,024 tokens, 20 calls, rows 1,4, 3 repeats (the tests' mode)")
    args = ap.parse_args(argv)
    if args.smoke:
        vocab, calls, repeats, rows = 1024, 20, 3, [1, 4]
        ng, eos = tiny.ngram(vocab), frozenset({1})
        ctx = tiny.prompts(1, vocab, 30, 30)[0].tolist()
    else:
        vocab, calls, repeats = 8192, args.calls, args.repeats
        rows = [int(r) for r in args.rows.split(",") if r]
        target = load_target("smollm2-135m", device="cpu", dtype="fp32")
        ng, eos = load_ngram_for(target, "sharegpt", args.ngram_max_tokens), target.eos_ids
        ctx = target.encode_prompt("Explain how a hash map works.").tolist()
    res = one_call(ng, ctx, eos, calls, args.levels, vocab, warmup=5 if args.smoke else 20)
    print(json.dumps(res), flush=True)
    if rows:
        res["rows"] = by_rows(ng, eos, rows, repeats, vocab, device=args.device)
    return res


if __name__ == "__main__":
    main()
